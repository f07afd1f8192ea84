"""Benchmark: na3d against the exact grouped-SDPA reference and FlexAttention.

    python -m na3d.bench                 # forward, the six LTX-2.5 shapes, bf16
    python -m na3d.bench --backward      # ... and the backward (dq, dk, dv from dO)
    python -m na3d.bench --decoder       # ... and the LTX-2.5 decoder end to end (diffusers)
    python -m na3d.bench --shapes edge-wide ltx-stage1 --no-flex

On a GPU, in one process: measures the two ceilings (device-to-device copy
bandwidth; dense SDPA flash-attention rate), then per shape times every method
(median of many runs, L2 flushed before each), checks na3d's error against a float32
oracle, prints a table and writes ``benchmarks/results/<device>.json`` and a plot.
With ``--backward`` each bwd row also records ``bwd_over_fwd``, and the ceilings
gain ``dense_reference``: dense attention's own forward and backward (no mask;
FA2, cuDNN, FlexAttention) on the same GPU.
Without a GPU it says so and runs a small CPU demonstration instead.

``ms`` is the time of an eager call (CUDA events around it): what a caller sees,
host work included. For na3d each row also records ``gpu_ms``, its GPU time alone
(the call replayed as a CUDA graph, ``Timer(graphs=True)``): on calls of tens of
microseconds the host's launch work exceeds the kernels' and ``ms`` measures the
host; ``gpu_ms`` is what CUDA graphs and ``torch.compile``'s graph mode get.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from .. import geometry, launch
from ..api import na3d
from ..reference import na3d_brute_force, na3d_sdpa_exact
from .common import Timer, bench_shapes, log


def useful_flops(shape, kernel_size) -> float:
    B, T, H, W, NH, HD = shape
    return 4.0 * B * T * H * W * NH * HD * math.prod(kernel_size)


def min_bytes(shape, elt: int) -> float:
    B, T, H, W, NH, HD = shape
    return 4.0 * B * T * H * W * NH * HD * elt


def measure_ceilings(timer: Timer, device) -> Dict[str, float]:
    """Copy bandwidth (TB/s, read + written) and dense SDPA flash rate (TFLOP/s)."""
    n = (2 << 30) // 2  # 2 GiB of bf16
    src = torch.randn(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src), min_runs=20)
    copy_tbs = 2 * src.numel() * 2 / (ms * 1e-3) / 1e12
    del src, dst
    B, heads, seq, hd = 1, 8, 32768, 64
    q, k, v = (torch.randn(B, heads, seq, hd, dtype=torch.bfloat16, device=device) for _ in range(3))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def dense():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v)

    ms = timer(dense, min_runs=10)
    tflops = 4.0 * B * heads * seq * seq * hd / (ms * 1e-3) / 1e12
    return {"copy_tbs": round(copy_tbs, 3), "dense_attn_tflops": round(tflops, 1)}


def measure_dense_references(timer: Timer, device, flex: bool) -> Dict[str, dict]:
    """Forward and backward of dense attention (no mask) at the ceiling's shape.

    The backward rows' ``bwd / fwd`` ratio has no floor of its own; these say what
    the dense kernels on the same GPU reach with the same head dim and no
    neighborhood at all: PyTorch's flash backend (FA2), cuDNN's fused attention
    where the build has it, and FlexAttention (Triton) with no block mask.
    Backward = forward + backward minus forward, from dO; FLOPs 2.5x the forward's.
    """
    B, heads, seq, hd = 1, 8, 32768, 64
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, heads, seq, hd, dtype=torch.bfloat16, device=device, generator=gen,
                           requires_grad=True) for _ in range(3))
    grad_out = torch.randn(B, heads, seq, hd, dtype=torch.bfloat16, device=device, generator=gen)
    fwd_flops = 4.0 * B * heads * seq * seq * hd
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def run(a, b, c):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(a, b, c)
        return run

    kernels = {"flash": sdpa(SDPBackend.FLASH_ATTENTION), "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}
    if flex:
        from torch.nn.attention.flex_attention import flex_attention
        kernels["flex"] = torch.compile(flex_attention, dynamic=False)
    out = {}
    for name, fn in kernels.items():
        def forward_and_backward():
            torch.autograd.grad(fn(q, k, v), (q, k, v), grad_out)
        try:
            with torch.no_grad():
                fwd_ms = timer(lambda: fn(q, k, v), min_runs=10)
            both_ms = timer(forward_and_backward, min_runs=10)
        except Exception as exc:  # e.g. a build without cuDNN attention
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        bwd_ms = both_ms - fwd_ms
        out[name] = {"fwd_ms": round(fwd_ms, 3), "bwd_ms": round(bwd_ms, 3),
                     "fwd_tflops": round(fwd_flops / (fwd_ms * 1e-3) / 1e12, 1),
                     "bwd_tflops": round(2.5 * fwd_flops / (bwd_ms * 1e-3) / 1e12, 1),
                     "bwd_over_fwd": round(bwd_ms / fwd_ms, 2)}
    out["shape"] = [B, heads, seq, hd]
    return out


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=os.path.dirname(__file__))
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_slug(name: str) -> str:
    for key in ("H200", "H100", "B200", "A100", "MI300X", "MI350X", "MI355X"):
        if key.lower() in name.lower():
            return key.lower()
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-") or "gpu"


def forward_row(spec: dict, timer: Timer, ceilings: Dict[str, float], device, methods: List[str],
                dtype=torch.bfloat16, gpu_timer: Optional[Timer] = None) -> dict:
    """Time every method on one shape; error of na3d against a float32 oracle. With
    ``gpu_timer`` (a ``Timer(graphs=True)``), na3d's GPU time too (``gpu_ms``)."""
    name, shape, ks = spec["name"], tuple(spec["shape"]), tuple(spec["kernel_size"])
    B, T, H, W, NH, HD = shape
    scale = HD ** -0.5
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen, dtype=dtype, device=device) for _ in range(3))
    flops, nbytes = useful_flops(shape, ks), min_bytes(shape, q.element_size())
    floor_ms = max(flops / (ceilings["dense_attn_tflops"] * 1e12), nbytes / (ceilings["copy_tbs"] * 1e12)) * 1e3
    cfg = launch.forward_config(q, ks)
    row = {"name": name, "shape": list(shape), "kernel_size": list(ks), "dtype": str(dtype).split(".")[-1],
           "pass": "fwd", "ms": {}, "floor_ms": round(floor_ms, 5),
           "floor_bound": "compute" if flops / (ceilings["dense_attn_tflops"] * 1e12)
           > nbytes / (ceilings["copy_tbs"] * 1e12) else "memory",
           "config": {"q_tile": list(cfg.q_tile), "kv_tile": list(cfg.kv_tile), "num_warps": cfg.num_warps,
                      "num_stages": cfg.num_stages, "bucket": cfg.bucket},
           "flops_issued_ratio": round(geometry.issued_flops_ratio((T, H, W), ks, cfg.q_tile, cfg.kv_tile), 3)}

    log(f"  {name}: oracle (float32 grouped SDPA)")
    oracle = na3d_sdpa_exact(q.float(), k.float(), v.float(), ks, scale=scale)
    out = na3d(q, k, v, ks, scale=scale)
    row["max_abs_err"] = float((out.float() - oracle).abs().max())
    ref_bf16 = na3d_sdpa_exact(q, k, v, ks, scale=scale)
    row["sdpa_exact_max_abs_err"] = float((ref_bf16.float() - oracle).abs().max())
    del oracle, out, ref_bf16

    runners = {
        "na3d": lambda: na3d(q, k, v, ks, scale=scale),
        "sdpa_exact": lambda: na3d_sdpa_exact(q, k, v, ks, scale=scale),
    }
    if "flex" in methods:
        try:
            from torch.nn.attention.flex_attention import flex_attention

            from .flex_baseline import neighborhood_block_mask, to_flex_layout
            log(f"  {name}: flex block mask + compile")
            # A fresh compile per shape: otherwise dynamo's recompile limit is reached
            # after a few shapes and flex_attention silently runs eagerly (unfused).
            torch._dynamo.reset()
            t0 = time.perf_counter()
            bm = neighborhood_block_mask((T, H, W), ks, 128, device=device)
            fq, fk, fv = (to_flex_layout(x) for x in (q, k, v))
            flex_fn = torch.compile(flex_attention, dynamic=False)
            flex_fn(fq, fk, fv, block_mask=bm, scale=scale)
            row["flex_setup_s"] = round(time.perf_counter() - t0, 1)
            runners["flex"] = lambda: flex_fn(fq, fk, fv, block_mask=bm, scale=scale)
        except Exception as exc:  # report, keep benchmarking the rest
            row["flex_error"] = f"{type(exc).__name__}: {exc}"[:500]
            log(f"  {name}: flex failed: {row['flex_error']}")
    for method in methods:
        if method not in runners:
            continue
        log(f"  {name}: timing {method}")
        slow = method != "na3d"
        row["ms"][method] = round(timer(runners[method], min_runs=5 if slow else 20,
                                        target_ms=1000 if slow else 300), 5)
    row["x_floor"] = {m: round(t / floor_ms, 3) for m, t in row["ms"].items()}
    if gpu_timer is not None and "na3d" in row["ms"]:
        log(f"  {name}: GPU time of na3d (graph replay)")
        record_gpu_time(row, gpu_timer(runners["na3d"], min_runs=20, target_ms=300), floor_ms)
    if "na3d" in row["ms"]:
        t = row["ms"]["na3d"] * 1e-3
        row["na3d_tflops"] = round(flops / t / 1e12, 1)
        row["na3d_tbs"] = round(nbytes / t / 1e12, 3)
        row["speedup_vs"] = {m: round(ms / row["ms"]["na3d"], 2) for m, ms in row["ms"].items() if m != "na3d"}
    return row


def record_gpu_time(row: dict, ms: float, floor_ms: float) -> None:
    """``row["gpu_ms"]``/``row["gpu_x_floor"]`` for na3d."""
    row["gpu_ms"] = {"na3d": round(ms, 5)}
    row["gpu_x_floor"] = {"na3d": round(ms / floor_ms, 3)}


def backward_row(spec: dict, timer: Timer, ceilings: Dict[str, float], device, methods: List[str],
                 dtype=torch.bfloat16, gpu_timer: Optional[Timer] = None) -> dict:
    """Time dq, dk, dv from a given dO (forward excluded) for every method on one shape.

    na3d and FlexAttention are timed the same way: ``torch.autograd.grad`` of their
    retained graphs. ``na3d_fused`` is the one-pass backward (dQ by atomic adds)
    through the launcher, when the table's config is the two-kernel one.
    Floor: the backward does 2.5x the forward's matrix work (five products instead of
    two) and moves 8 tensors (q, k, v, o, dO in; dq, dk, dv out) instead of 4.
    ``gpu_timer``: as in :func:`forward_row`. A backward replays in a CUDA graph only
    with the forward that recorded its autograd graph captured beside it, so its GPU
    time is that of forward + ``autograd.grad`` minus that of the forward alone.
    """
    name, shape, ks = spec["name"], tuple(spec["shape"]), tuple(spec["kernel_size"])
    B, T, H, W, NH, HD = shape
    scale = HD ** -0.5
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(shape, generator=gen, dtype=dtype, device=device) for _ in range(4))
    flops, nbytes = 2.5 * useful_flops(shape, ks), 2 * min_bytes(shape, q.element_size())
    floor_ms = max(flops / (ceilings["dense_attn_tflops"] * 1e12), nbytes / (ceilings["copy_tbs"] * 1e12)) * 1e3
    cfg = launch.backward_config(q, ks)
    row = {"name": name, "shape": list(shape), "kernel_size": list(ks), "dtype": str(dtype).split(".")[-1],
           "pass": "bwd", "ms": {}, "floor_ms": round(floor_ms, 5),
           "config": {"dq": [list(cfg.dq_q_tile), list(cfg.dq_kv_tile)],
                      "dkdv": [list(cfg.dkdv_k_tile), list(cfg.dkdv_q_tile)],
                      "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                      "dkdv_num_warps": cfg.dkdv_warps, "dkdv_num_stages": cfg.dkdv_stages,
                      "fused": cfg.fused, "bucket": cfg.bucket}}
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def graph_of(fn):
        out = fn(*leaves)
        return lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)

    # The grouped-SDPA reference is left out: its autograd graph keeps every box's
    # copies alive (tens of GB at stage 5) and it is not a competitor.
    runners = {"na3d": lambda: graph_of(lambda a, b, c: na3d(a, b, c, ks, scale=scale))}
    if "flex" in methods:
        def flex_graph():
            from torch.nn.attention.flex_attention import flex_attention

            from .flex_baseline import from_flex_layout, neighborhood_block_mask, to_flex_layout
            bm = neighborhood_block_mask((T, H, W), ks, 128, device=device)
            torch._dynamo.reset()  # see forward_row
            flex_fn = torch.compile(flex_attention, dynamic=False)
            return graph_of(lambda a, b, c: from_flex_layout(
                flex_fn(*(to_flex_layout(x) for x in (a, b, c)), block_mask=bm, scale=scale), shape))
        runners["flex"] = flex_graph
    # Gradients of na3d against the float32 reference's, W chunk by W chunk.
    log(f"  {name}: backward error vs float32 grouped-SDPA autograd")
    grads = runners["na3d"]()()
    row["max_abs_err"] = {n: 0.0 for n in ("dq", "dk", "dv")}
    ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
    chunk = max(1, W // 8)
    for w0 in range(0, W, chunk):
        w1 = min(W, w0 + chunk)
        out = na3d_sdpa_exact(ref[0][:, :, :, w0:w1], ref[1], ref[2], ks, scale=scale, w_offset=w0)
        out.backward(do[:, :, :, w0:w1].float())
    for n, g, r in zip(("dq", "dk", "dv"), grads, ref):
        row["max_abs_err"][n] = float((g.float() - r.grad).abs().max())
    del grads
    # The one-pass backward (dQ by atomic adds; not the default unless the table
    # says so), timed beside it through the launcher: its error against the same
    # reference first.
    fused_cfg = dataclasses.replace(cfg, fused=True)
    fwd_out, fwd_lse = launch.na3d_forward(q, k, v, ks, scale, need_lse=True)

    def fused_backward():
        return launch.na3d_backward(do, q, k, v, fwd_out, fwd_lse, ks, scale, config=fused_cfg)

    if not cfg.fused:
        runners["na3d_fused"] = lambda: fused_backward
        methods = list(methods) + ["na3d_fused"]
        try:
            row["max_abs_err_fused"] = {n: float((g.float() - r.grad).abs().max())
                                        for n, g, r in zip(("dq", "dk", "dv"), fused_backward(), ref)}
        except Exception as exc:
            row.setdefault("errors", {})["na3d_fused"] = f"{type(exc).__name__}: {exc}"[:300]
            methods.remove("na3d_fused")
    del ref, out
    torch.cuda.empty_cache()
    for method in methods:
        if method not in runners:
            continue
        log(f"  {name}: timing {method} backward")
        try:
            fn = runners[method]()
            ours = method.startswith("na3d")
            row["ms"][method] = round(timer(fn, min_runs=20 if ours else 5, target_ms=300 if ours else 1000), 5)
        except Exception as exc:  # e.g. out of memory in a baseline: report it
            row.setdefault("errors", {})[method] = f"{type(exc).__name__}: {exc}"[:300]
            log(f"  {name}: {method} backward failed: {row['errors'][method]}")
        torch.cuda.empty_cache()
    row["x_floor"] = {m: round(t / floor_ms, 3) for m, t in row["ms"].items()}
    if gpu_timer is not None and "na3d" in row["ms"]:
        log(f"  {name}: GPU time of na3d's backward (graph replay, minus the forward's)")

        def forward():
            return na3d(*leaves, ks, scale=scale)

        def forward_backward():
            return torch.autograd.grad(forward(), leaves, do)

        both = gpu_timer(forward_backward, min_runs=20, target_ms=300)
        record_gpu_time(row, both - gpu_timer(forward, min_runs=20, target_ms=300), floor_ms)
        torch.cuda.empty_cache()
    return row


def add_bwd_over_fwd(bwd: dict, fwd: dict) -> None:
    """Backward time over forward time per method, same run (the backward target's
    number; ``na3d_gpu`` from the CUDA-graph GPU times). A method with no forward
    row of its own (``na3d_fused``) gets none."""
    ratio = {m: round(bwd["ms"][m] / fwd["ms"][m], 3) for m in bwd["ms"]
             if m in fwd["ms"] and bwd["ms"][m] > 0 and fwd["ms"][m] > 0}
    gpu_b, gpu_f = bwd.get("gpu_ms", {}).get("na3d"), fwd.get("gpu_ms", {}).get("na3d")
    if gpu_b and gpu_f:
        ratio["na3d_gpu"] = round(gpu_b / gpu_f, 3)
    bwd["bwd_over_fwd"] = ratio


def print_table(rows: List[dict]) -> None:
    head = f"{'shape':<18}{'pass':>5}{'na3d ms':>10}{'x_floor':>9}{'gpu ms':>9}{'TFLOP/s':>9}{'TB/s':>7}" \
           f"{'sdpa ms':>10}{'flex ms':>10}{'floor ms':>10}{'issued':>8}{'max err':>10}{'bwd/fwd':>9}"
    log(head)
    for r in rows:
        ms = r["ms"]
        err = r.get("max_abs_err", float("nan"))
        err = max(err.values()) if isinstance(err, dict) else err
        gpu_ms = r.get("gpu_ms", {}).get("na3d", float("nan"))
        log(f"{r['name']:<18}{r['pass']:>5}{ms.get('na3d', float('nan')):>10.4f}{r['x_floor'].get('na3d', float('nan')):>9.2f}"
            f"{gpu_ms:>9.4f}{r.get('na3d_tflops', float('nan')):>9.1f}{r.get('na3d_tbs', float('nan')):>7.2f}"
            f"{ms.get('sdpa_exact', float('nan')):>10.3f}{ms.get('flex', float('nan')):>10.3f}"
            f"{r['floor_ms']:>10.4f}{r.get('flops_issued_ratio', float('nan')):>8.2f}{err:>10.2e}"
            f"{r.get('bwd_over_fwd', {}).get('na3d', float('nan')):>9.2f}")


def plot(rows: List[dict], path: str, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no plot")
        return
    methods = [m for m in ("na3d", "na3d_fused", "flex", "sdpa_exact") if any(m in r["ms"] for r in rows)]
    if not rows or not methods:  # e.g. a decoder-only run: nothing to draw
        log(f"no fwd/bwd rows: no plot at {path}")
        return
    fig, ax = plt.subplots(figsize=(15, 5.5))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        xs = [j + i * width for j in range(len(rows))]
        ax.bar(xs, [r["ms"].get(m, float("nan")) for r in rows], width, label=m)
    for j, r in enumerate(rows):
        ax.hlines(r["floor_ms"], j - width / 2, j + width * (len(methods) - 0.5), colors="k",
                  linestyles="--", label="roofline floor" if j == 0 else None)
    ax.set_yscale("log")
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(rows))])
    ax.set_xticklabels([f"{r['name']}\n{r['pass']}" for r in rows], fontsize=7)
    ax.set_ylabel("ms (median, log scale)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


def cpu_demo() -> None:
    log("No GPU found: running a small CPU demonstration instead (no results file written).")
    log(f"Kernels {'run in the Triton interpreter' if launch.kernels_interpreted() else 'are not used on the CPU; the exact PyTorch reference runs'}.")
    shape, ks = (1, 6, 8, 10, 2, 32), (3, 5, 5)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen) for _ in range(3))
    t0 = time.perf_counter()
    out = na3d(q, k, v, ks)
    t1 = time.perf_counter()
    oracle = na3d_brute_force(q, k, v, ks)
    err = (out.double() - oracle).abs().max().item()
    log(f"na3d on {shape} kernel {ks}, float32, CPU: {1e3 * (t1 - t0):.1f} ms, max abs error vs float64 "
        f"brute force {err:.2e}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m na3d.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", help="shape names from bench_shapes.json (default: all)")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    parser.add_argument("--no-reference", action="store_true", help="skip timing the grouped-SDPA reference")
    parser.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--commit", default=None, help="git sha of the measured tree (default: git rev-parse)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--backward", action="store_true", help="also time the backward (bwd rows)")
    parser.add_argument("--no-forward", action="store_true", help="skip the forward rows")
    parser.add_argument("--decoder", action="store_true",
                        help="also decode with the full-size LTX-2.5 decoder (needs diffusers; row ltx-decoder)")
    parser.add_argument("--no-shapes", action="store_true", help="no shape rows (e.g. --decoder alone)")
    parser.add_argument("--merge", default=None, metavar="RESULTS_JSON",
                        help="start from this results file (same commit required): rows measured now replace "
                             "its rows of the same name and pass, the others are kept")

    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        cpu_demo()
        return 0
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    specs = bench_shapes()
    if args.shapes:
        unknown = set(args.shapes) - {s["name"] for s in specs}
        if unknown:
            parser.error(f"unknown shapes {sorted(unknown)}; known: {[s['name'] for s in specs]}")
        specs = [s for s in specs if s["name"] in args.shapes]
    if args.no_shapes:
        specs = []
    commit = args.commit or git_commit()
    kept = []
    if args.merge:
        with open(args.merge) as f:
            earlier = json.load(f)
        if earlier.get("commit") != commit:
            parser.error(f"--merge {args.merge}: its rows are from commit {earlier.get('commit')}, this run is {commit}")
        kept = earlier["rows"]
    methods = ["na3d"] + ([] if args.no_reference else ["sdpa_exact"]) + ([] if args.no_flex else ["flex"])
    timer = Timer(device)
    # (Its own 256 MiB flush buffer: only when shape rows are timed, so that a
    # decoder-only run's peak memory holds one.)
    gpu_timer = Timer(device, graphs=True) if specs else None
    log(f"device: {name}; torch {torch.__version__}; measuring ceilings")
    ceilings = measure_ceilings(timer, device)
    log(f"ceilings: copy {ceilings['copy_tbs']} TB/s, dense SDPA flash {ceilings['dense_attn_tflops']} TFLOP/s")
    if args.backward:
        ceilings["dense_reference"] = measure_dense_references(timer, device, flex=not args.no_flex)
        for ref_name, ref in ceilings["dense_reference"].items():
            if isinstance(ref, dict):
                log(f"dense {ref_name} (no mask, {ceilings['dense_reference']['shape']}): " + (
                    ref["error"] if "error" in ref else
                    f"fwd {ref['fwd_tflops']} TFLOP/s, bwd {ref['bwd_tflops']} TFLOP/s, bwd/fwd {ref['bwd_over_fwd']}"))
    import triton

    slug = device_slug(name)
    path = os.path.join(args.out_dir, f"{slug}.json")

    def write(rows: List[dict], complete: bool) -> None:
        """The results file; rewritten after every shape, so a cut run keeps its rows."""
        if args.no_write:
            return
        measured = {(r["name"], r["pass"]) for r in rows}
        result = {"device": name, "torch": torch.__version__, "triton": triton.__version__,
                  "python": platform.python_version(), "commit": commit,
                  "date": datetime.date.today().isoformat(), "ceilings": ceilings,
                  "rows": [r for r in kept if (r["name"], r["pass"]) not in measured] + rows}
        if not complete:
            result["incomplete"] = "the run stopped before measuring every requested row"
        os.makedirs(args.out_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    rows = []
    for i, spec in enumerate(specs):
        log(f"[{i + 1}/{len(specs)}] {spec['name']} {spec['shape']} kernel {spec['kernel_size']}")
        if not args.no_forward:
            rows.append(forward_row(spec, timer, ceilings, device, methods, gpu_timer=gpu_timer))
            torch.cuda.empty_cache()
        if args.backward:
            rows.append(backward_row(spec, timer, ceilings, device, methods, gpu_timer=gpu_timer))
            if not args.no_forward:
                add_bwd_over_fwd(rows[-1], rows[-2])
            torch.cuda.empty_cache()
        write(rows, complete=False)
    if args.decoder:
        from .bench_decoder import decoder_row, print_row
        log("[decoder] LTX-2.5 diffusion decoder, 121 frames at 512x768, tiled")
        row = decoder_row(device)
        print_row(row)
        rows.append(row)
    measured = {(r["name"], r["pass"]) for r in rows}
    print_table([r for r in kept if (r["name"], r["pass"]) not in measured and r["pass"] in ("fwd", "bwd")]
                + [r for r in rows if r["pass"] in ("fwd", "bwd")])
    if args.no_write:
        return 0
    write(rows, complete=True)
    log(f"wrote {path}")
    with open(path) as f:
        all_rows = json.load(f)["rows"]
    plot([r for r in all_rows if r["pass"] in ("fwd", "bwd")], os.path.join(args.out_dir, f"{slug}.png"),
         f"na3d on {name} (bf16; fwd and bwd rows)")
    return 0

if __name__ == "__main__":
    sys.exit(main())
