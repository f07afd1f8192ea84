"""The CUDA kernels one na3d call runs, with their GPU time (torch.profiler), for A/B runs.

Run once per tree (``PYTHONPATH=<tree>/src python benchmarks/kernel_list.py --shapes edge-wide``):
for each shape, the forward (and with ``--backward`` forward + backward) is called ``--calls``
times under the profiler and every kernel is printed with its count per call and mean time,
so two trees' calls can be compared kernel by kernel.
"""

import argparse
import json
from importlib import resources

import torch
from torch.profiler import ProfilerActivity, profile


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tag", required=True)
    parser.add_argument("--shapes", nargs="+", required=True)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--assume-finite", action="store_true")
    args = parser.parse_args(argv)
    import na3d

    folder = resources.files("na3d") / "tools"
    if not (folder / "bench_shapes.json").is_file():
        folder = resources.files("na3d")
    specs = {s["name"]: s for s in json.loads((folder / "bench_shapes.json").read_text())["shapes"]}
    extra = {"assume_finite": True} if args.assume_finite else {}
    for name in args.shapes:
        spec = specs[name]
        shape, ks = tuple(spec["shape"]), tuple(spec["kernel_size"])
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(shape, generator=gen, dtype=torch.bfloat16, device="cuda") for _ in range(4))
        leaves = [t.detach().clone().requires_grad_(args.backward) for t in (q, k, v)]

        def call():
            out = na3d.na3d(*leaves, ks, scale=shape[-1] ** -0.5, **extra)
            if args.backward:
                torch.autograd.grad(out, leaves, do)

        for _ in range(5):
            call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                call()
            torch.cuda.synchronize()
        for event in prof.key_averages():
            total = getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0)
            if not total or event.count == 0:
                continue
            us = total / event.count
            print(json.dumps({"tag": args.tag, "shape": name, "kernel": event.key[:90],
                              "per_call": event.count / args.calls, "us": round(us, 2)}), flush=True)


if __name__ == "__main__":
    main()
