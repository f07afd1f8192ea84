"""The Gluon sm90 forward for perfectly block-sparse calls (``na3d/kernels/sm90_forward.py``)
against the portable kernel, on an H100/H200, in one process: exactness first, then time.

    PYTHONPATH=src python benchmarks/sm90_gluon_probe.py [--out DIR] [--quick]

1. Exactness: small block-sparse problems (B > 1, heads > 1, partial query boxes,
   GQA), bf16 and fp16, head dims 64 and 128, against the float64 oracle
   (``reference.na3d_brute_force``); the portable kernel's error on the same inputs
   beside it. Outputs poisoned (NaN) before the launch. A probe passes where its
   error is at most twice the portable kernel's plus 1e-3 and it wrote every output.
2. Time (GPU time, CUDA-graph replay, L2 flushed; ``tools.common.Timer``): the strided
   benchmark rows' forwards, the portable kernel (table config, ``assume_finite``)
   against the Gluon kernel with key boxes of 64 and 128 and 2-4 slots; dense cuDNN
   on the same tokens for the speed of light. One JSON line per measurement. With
   ``--variants``: the table's boxes and slots only, each set of the kernel's
   switches in alternating rounds, and the launcher's own forward (default and
   ``assume_finite``).
"""

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "src")]

from na3d import configs, launch, reference  # noqa: E402
from na3d.tools.common import Timer  # noqa: E402

ROWS = {
    "dit-hunyuan-s2x8x8": ((1, 30, 48, 80, 24, 128), (18, 24, 24), (2, 8, 8)),
    "dit-hunyuan-s2x8x16": ((1, 30, 48, 80, 24, 128), (18, 24, 24), (2, 8, 16)),
    "video-hd64-s4x4x8": ((1, 32, 64, 64, 16, 64), (16, 16, 16), (4, 4, 8)),
}


def gluon_forward(q, k, v, kernel_size, stride, scale, q_box, kv_box, stages, return_lse=False, out=None,
                  **switches):
    """The launcher's Gluon launch (``launch.sm90_block_sparse_forward``) with any boxes
    and slots, no non-finite check, and the kernel's measurement switches (``OVERLAP``,
    ``PINGPONG``, ...)."""
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(q.shape[:5], dtype=torch.float32, device=q.device) if return_lse else None
    unused_flags = torch.empty(1, dtype=torch.int8, device=q.device)
    launch.sm90_block_sparse_forward(q, k, v, out, lse, unused_flags, stages, q_box, kv_box, kernel_size, stride,
                                     scale, True, **switches)
    return out, lse


def parse_variant(text):
    """``"TREE=1,LATE_REFILL=0"`` -> switches; ``""`` -> none (the kernel's defaults)."""
    return {name: bool(int(value)) for name, value in (p.split("=") for p in text.split(",") if p)}


def check(args, log):
    cases = [  # (B, T, H, W, NH, NKV, HD), kernel, stride, q box, kv box
        ((2, 6, 20, 24, 3, 3, 128), (4, 8, 16), (2, 8, 8), (2, 8, 8), (1, 8, 8)),
        ((2, 6, 20, 24, 3, 3, 128), (4, 8, 16), (2, 8, 8), (2, 8, 8), (2, 8, 8)),
        ((1, 5, 16, 40, 4, 2, 64), (4, 8, 16), (2, 8, 8), (2, 8, 8), (2, 4, 16)),
        ((1, 8, 12, 36, 2, 2, 64), (4, 4, 8), (4, 4, 8), (4, 4, 8), (1, 4, 16) if False else (2, 4, 8)),
    ]
    ok_all = True
    for dtype in (torch.bfloat16, torch.float16):
        for (B, T, H, W, NH, NKV, HD), K, S, qb, kb in cases:
            if not all(launch.block_sparse_axes(qb, kb, K, (False,) * 3, S, (T, H, W), (1, 1, 1))):
                log({"check": "skipped, not block-sparse", "shape": [B, T, H, W, NH, HD], "q_box": qb, "kv_box": kb})
                continue
            g = torch.Generator(device="cuda").manual_seed(7)
            q = torch.randn(B, T, H, W, NH, HD, device="cuda", dtype=dtype, generator=g)
            k = torch.randn(B, T, H, W, NKV, HD, device="cuda", dtype=dtype, generator=g)
            v = torch.randn(B, T, H, W, NKV, HD, device="cuda", dtype=dtype, generator=g)
            scale = HD ** -0.5
            want, want_lse = reference.na3d_brute_force(q.double(), k.double(), v.double(), K, scale, stride=S,
                                                        return_lse=True)
            cfg = configs.ForwardConfig(qb, kb, 8 if math.prod(qb) == 128 else 4, 2)
            port = torch.full_like(q, float("nan"))
            launch.na3d_forward(q, k, v, K, scale, out=port, config=cfg, stride=S, assume_finite=True)
            for stages, switches in [(3, {}), (4, {}), (3, {"PINGPONG": False}), (3, {"OVERLAP": False})] + [
                    (3, parse_variant(v)) for v in args.variants if v] + [(4, parse_variant(v)) for v in args.variants[-1:] if v]:
                got = torch.full_like(q, float("nan"))
                t0 = time.time()
                try:
                    _, lse = gluon_forward(q, k, v, K, S, scale, qb, kb, stages, return_lse=True, out=got, **switches)
                    torch.cuda.synchronize()
                except Exception as e:  # e.g. more shared memory than the GPU has
                    log({"check": "skipped", "q_box": qb, "kv_box": kb, "stages": stages, "error": repr(e)[:200]})
                    continue
                nan = torch.isnan(got)
                finite = ~nan
                err = (got.double() - want).abs().max().item()
                lse_err = (lse.double() - want_lse).abs().max().item()
                perr = (port.double() - want).abs().max().item()
                ok = not nan.any().item() and err <= 2 * perr + 1e-3 and lse_err <= 1e-3
                ok_all &= ok
                record = {"check": "ok" if ok else "FAIL", "dtype": str(dtype), "shape": [B, T, H, W, NH, NKV, HD],
                          "kernel": K, "stride": S, "q_box": qb, "kv_box": kb, "stages": stages, "switches": switches,
                          "max_err": err, "lse_err": lse_err, "portable_err": perr, "s": round(time.time() - t0, 1)}
                if not ok:  # where it goes wrong: NaN share, per box row half and column, error where finite
                    rows = nan.any(-1)  # (B, T, H, W, NH)
                    record.update(nan_share=nan.float().mean().item(),
                                  nan_cols=nan.flatten(0, 4).any(0).nonzero().flatten()[:8].tolist(),
                                  nan_t=rows.any(0).any(-1).any(-1).any(-1).nonzero().flatten().tolist(),
                                  nan_h=rows.any(0).any(0).any(-1).any(-1).nonzero().flatten().tolist(),
                                  nan_w=rows.any(0).any(0).any(0).any(-1).nonzero().flatten().tolist(),
                                  finite_err=(got.double() - want)[finite].abs().max().item() if finite.any() else None)
                log(record)
    return ok_all


def timing(args, log):
    timer = Timer("cuda", graphs=True)
    for name in (["dit-hunyuan-s2x8x8"] if args.quick else ROWS):
        (B, T, H, W, NH, HD), K, S = ROWS[name]
        q, k, v = (torch.randn(B, T, H, W, NH, HD, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        scale = HD ** -0.5
        cfg = configs.forward_config("sm90", (T, H, W), K, HD, torch.bfloat16, S, (False,) * 3)
        n = T * H * W
        dq, dk, dv = (x.reshape(B, n, NH, HD).transpose(1, 2).contiguous() for x in (q, k, v))
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            dense = timer(lambda: F.scaled_dot_product_attention(dq, dk, dv))
        sol = dense * math.prod(K) / n
        log({"row": name, "method": "dense cudnn", "gpu_ms": dense, "sol_ms": sol})
        ref, _ = launch.na3d_forward(q, k, v, K, scale, config=cfg, stride=S, assume_finite=True)
        ms = timer(lambda: launch.na3d_forward(q, k, v, K, scale, config=cfg, stride=S, assume_finite=True))
        log({"row": name, "method": "portable", "q_box": cfg.q_tile, "kv_box": cfg.kv_tile, "gpu_ms": ms,
             "x_sol": ms / sol})
        if args.variants:  # the table's boxes and slots; each variant, in alternating rounds
            for round_ in range(args.rounds):
                for text in args.variants:
                    switches = parse_variant(text)
                    got, _ = gluon_forward(q, k, v, K, S, scale, cfg.q_tile, cfg.kv_tile, cfg.sm90_gluon, **switches)
                    err = (got.float() - ref.float()).abs().max().item()
                    ms = timer(lambda: gluon_forward(q, k, v, K, S, scale, cfg.q_tile, cfg.kv_tile, cfg.sm90_gluon,
                                                     **switches))
                    log({"row": name, "method": "gluon", "variant": text, "round": round_, "kv_box": cfg.kv_tile,
                         "stages": cfg.sm90_gluon, "gpu_ms": ms, "x_sol": ms / sol, "max_diff_vs_portable": err})
                for finite in (True, False):  # through the launcher as the API calls it (table switches)
                    ms = timer(lambda: launch.na3d_forward(q, k, v, K, scale, stride=S, assume_finite=finite))
                    log({"row": name, "method": "launcher", "assume_finite": finite, "round": round_, "gpu_ms": ms,
                         "x_sol": ms / sol})
            continue
        kv_boxes = [cfg.kv_tile] + [b for b in ((1, 8, 8), (2, 4, 8), (1, 8, 16), (2, 8, 8)) if b != cfg.kv_tile]
        for kb in kv_boxes:
            if not all(launch.block_sparse_axes(cfg.q_tile, kb, K, (False,) * 3, S, (T, H, W), (1, 1, 1))):
                continue
            slot = math.prod(kb) * HD * 2 * 2
            most = (232448 - 2048 - math.prod(cfg.q_tile) * HD * 2) // slot
            for stages, pingpong in [(st, True) for st in range(3, most + 1)] + [(most, False)]:
                try:
                    got, _ = gluon_forward(q, k, v, K, S, scale, cfg.q_tile, kb, stages, pingpong=pingpong)
                    err = (got.float() - ref.float()).abs().max().item()
                    ms = timer(lambda: gluon_forward(q, k, v, K, S, scale, cfg.q_tile, kb, stages, pingpong=pingpong))
                    log({"row": name, "method": "gluon", "q_box": cfg.q_tile, "kv_box": kb, "stages": stages,
                         "pingpong": pingpong, "gpu_ms": ms, "x_sol": ms / sol, "max_diff_vs_portable": err})
                except Exception as e:  # a configuration that does not compile or launch
                    log({"row": name, "method": "gluon", "kv_box": kb, "stages": stages, "error": repr(e)[:300]})


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--variants", nargs="*", default=[], metavar="NAME=0|1,...",
                        help="time these switch sets (\"\": the kernel's defaults) at the table's boxes and slots, "
                             "and the launcher's default and assume_finite forwards, instead of the box sweep; "
                             "the exactness check adds them")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    sink = open(os.path.join(args.out, "sm90_gluon_probe.jsonl"), "a") if args.out else None

    def log(record):
        line = json.dumps(dict(record, t=round(time.time(), 2)))  # (wall time: to set beside a clock log)
        print(line, flush=True)
        if sink:
            sink.write(line + "\n")
            sink.flush()

    log({"device": torch.cuda.get_device_name(), "torch": torch.__version__})
    ok = True if args.skip_check else check(args, log)
    log({"exact": ok})
    if ok:
        timing(args, log)


if __name__ == "__main__":
    main()
