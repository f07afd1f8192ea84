"""One launch of the Gluon sm90 forward (and one of the portable forward) on a
dit-hunyuan-like strided problem with fewer heads, for Nsight Compute:

    ncu --clock-control none -k regex:na3d_fwd --section WarpStateStats --section SchedulerStats \\
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \\
        python benchmarks/sm90_gluon_profile.py [--heads 4]

(``PYTHONPATH=src``). The table's configuration for the call, ``assume_finite`` (one
kernel each)."""

import argparse
import dataclasses
import os
import sys

import torch

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "src")]

from na3d import launch  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, default=4)
    args = parser.parse_args()
    shape, kernel, stride = (1, 30, 48, 80, args.heads, 128), (18, 24, 24), (2, 8, 8)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cfg = launch.forward_config(q, kernel, stride=stride)
    print(cfg)
    launch.na3d_forward(q, k, v, kernel, 128 ** -0.5, config=cfg, stride=stride, assume_finite=True)
    portable = dataclasses.replace(cfg, sm90_gluon=None)
    launch.na3d_forward(q, k, v, kernel, 128 ** -0.5, config=portable, stride=stride, assume_finite=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
