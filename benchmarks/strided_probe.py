"""Strided (generalized) neighborhood attention on the GPU: launch settings of the
stride-aligned boxes, against the speed of light (dense cuDNN times the window's
fraction of keys), in one process.

    PYTHONPATH=src python benchmarks/strided_probe.py [--shapes NAME ...] [--quick] [--out DIR]

For each shape: dense cuDNN forward and forward+backward on the same tokens, heads and
head dim (no mask), the speed of light, then na3d's forward for each candidate of
(queries per box, keys per box, warps, stages), and the backward for each candidate of
(dQ warps, dK/dV warps, dK/dV stages) with the best forward. Boxes come from
``configs.stride_aligned_option``, so each candidate is what the table would run with
those numbers. Prints one line of JSON per measurement and a table last; ``--out``
also writes them to ``strided_probe.jsonl``.
"""

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "src")]

from na3d import configs, geometry, launch  # noqa: E402
from na3d.configs import BackwardConfig, ForwardConfig  # noqa: E402

# (name, (B, T, H, W, NH, HD), kernel, stride)
SHAPES = {
    "dit-hunyuan-s2x8x8": ((1, 30, 48, 80, 24, 128), (18, 24, 24), (2, 8, 8)),
    "dit-hunyuan-s2x8x16": ((1, 30, 48, 80, 24, 128), (18, 24, 24), (2, 8, 16)),
    "dit-hunyuan-s3x8x8": ((1, 30, 48, 80, 24, 128), (18, 24, 24), (3, 8, 8)),
    "hd64-s4x4x8": ((1, 32, 64, 64, 16, 64), (16, 16, 16), (4, 4, 8)),
}
FORWARD = [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 4, 2), (64, 128, 4, 2), (64, 64, 4, 3)]
BACKWARD = [(8, 8, 1), (8, 8, 2), (4, 4, 1), (8, 4, 1)]  # (dQ warps, dK/dV warps, dK/dV stages)


def bench(fn, rep=200):
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def dense_times(shape):
    B, T, H, W, NH, HD = shape
    n = T * H * W
    q, k, v = (torch.randn(B, NH, n, HD, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    go = torch.randn_like(q)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        fwd = bench(lambda: F.scaled_dot_product_attention(q, k, v), rep=100)
        fwdbwd = bench(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), go), rep=100)
    return fwd, fwdbwd


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--quick", action="store_true", help="first two forward and backward candidates only")
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    log = open(os.path.join(args.out, "strided_probe.jsonl"), "a") if args.out else None

    def emit(record):
        line = json.dumps(record)
        print(line, flush=True)
        if log:
            log.write(line + "\n")
            log.flush()

    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    summary = []
    for name in args.shapes:
        shape, kernel, stride = SHAPES[name]
        B, T, H, W, NH, HD = shape
        frac = math.prod(kernel) / (T * H * W)
        dense_f, dense_fb = dense_times(shape)
        sol_f, sol_fb = dense_f * frac, dense_fb * frac
        useful = 4 * B * T * H * W * NH * HD * math.prod(kernel)
        emit(dict(name=name, dense_fwd_ms=dense_f, dense_fwdbwd_ms=dense_fb, sol_fwd_ms=sol_f, sol_fwdbwd_ms=sol_fb))
        torch.cuda.empty_cache()
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        go = torch.randn_like(q)
        scale = HD ** -0.5
        ref, _ = launch.na3d_forward(q, k, v, kernel, scale, stride=stride,
                                     config=ForwardConfig((4, 4, 4), (2, 2, 16), 4, 2))  # a masked config
        entry = configs.table_entry("sm90", kernel, HD, torch.bfloat16)
        best = None
        for qn, kvn, warps, stages in FORWARD[:2] if args.quick else FORWARD:
            option = configs.stride_aligned_option(dict(entry["strided"], q_positions=qn, kv_positions=kvn),
                                                   (T, H, W), kernel, stride, (False,) * 3)
            cfg = ForwardConfig(tuple(option["q_tile"]), tuple(option["kv_tile"]), warps, stages)
            full = launch.block_sparse_axes(cfg.q_tile, cfg.kv_tile, kernel, (False,) * 3, stride, (T, H, W),
                                            (1, 1, 1))
            try:
                out, lse = launch.na3d_forward(q, k, v, kernel, scale, return_lse=True, stride=stride, config=cfg)
                diff = (out.float() - ref.float()).abs().max().item()
                ms = bench(lambda: launch.na3d_forward(q, k, v, kernel, scale, stride=stride, config=cfg,
                                                       assume_finite=True))
                ms_checked = bench(lambda: launch.na3d_forward(q, k, v, kernel, scale, stride=stride, config=cfg))
            except Exception as error:  # noqa: BLE001 (a candidate that does not compile is reported)
                emit(dict(name=name, pass_="fwd", config=[qn, kvn, warps, stages], error=str(error)[:200]))
                continue
            record = dict(name=name, pass_="fwd", config=[qn, kvn, warps, stages], q_tile=cfg.q_tile,
                          kv_tile=cfg.kv_tile, full_axes=full,
                          issued=round(geometry.issued_flops_ratio((T, H, W), kernel, cfg.q_tile, cfg.kv_tile,
                                                                   stride=stride), 4),
                          ms=ms, ms_checked=ms_checked, x_sol=ms_checked / sol_f,
                          useful_tflops=useful / ms_checked / 1e9, diff_vs_masked=diff)
            emit(record)
            if best is None or ms_checked < best[0]:
                best = (ms_checked, cfg, option, lse, out)
        summary.append((name, "fwd", best[0], sol_f, best[1]))
        if args.no_backward:
            continue
        ms_f, cfg, option, lse, out = best
        bwd_best = None
        for dq_warps, dkdv_warps, dkdv_stages in BACKWARD[:2] if args.quick else BACKWARD:
            (dq_q, dq_kv), (k_box, q_box) = option["backward"]["dq"], option["backward"]["dkdv"]
            bcfg = BackwardConfig(tuple(dq_q), tuple(dq_kv), tuple(k_box), tuple(q_box), dq_warps, 2,
                                  dkdv_num_warps=dkdv_warps, dkdv_num_stages=dkdv_stages)
            keys_full = launch.block_sparse_axes(bcfg.dkdv_k_tile, bcfg.dkdv_q_tile, kernel, (False,) * 3, stride,
                                                 (T, H, W), (1, 1, 1), own="keys")
            try:
                ms = bench(lambda: launch.na3d_backward(go, q, k, v, out, lse, kernel, scale, stride=stride,
                                                        config=bcfg), rep=400)
            except Exception as error:  # noqa: BLE001
                emit(dict(name=name, pass_="bwd", config=[dq_warps, dkdv_warps, dkdv_stages], error=str(error)[:200]))
                continue
            emit(dict(name=name, pass_="bwd", config=[dq_warps, dkdv_warps, dkdv_stages], dkdv_k=bcfg.dkdv_k_tile,
                      dkdv_q=bcfg.dkdv_q_tile, keys_full=keys_full, ms=ms, bwd_over_fwd=ms / ms_f,
                      fwdbwd_ms=ms + ms_f, x_sol_fwdbwd=(ms + ms_f) / sol_fb))
            if bwd_best is None or ms < bwd_best[0]:
                bwd_best = (ms, bcfg)
        summary.append((name, "fwd+bwd", ms_f + bwd_best[0], sol_fb, bwd_best[1]))
        q = k = v = go = out = lse = ref = None  # (freed before the next shape; closures above read them)
        torch.cuda.empty_cache()
    print("\nshape                  pass      best ms   speed of light   x_sol   config")
    for name, pass_, ms, sol, cfg in summary:
        print(f"{name:22s} {pass_:8s} {ms:9.3f} {sol:16.3f} {ms / sol:7.3f}   {cfg}")


if __name__ == "__main__":
    main()
