"""Benchmark: na3d against NATTEN, comfy-kitchen, FlexAttention and the exact reference.

    python -m na3d.bench                 # forward, every shape (LTX-2.5 and video DiT), bf16
    python -m na3d.bench --backward      # ... and the backward (dq, dk, dv from dO)
    python -m na3d.bench --group dit     # only the video-DiT shapes (head dim 128)
    python -m na3d.bench --decoder       # ... and the LTX-2.5 decoder end to end (diffusers)
    python -m na3d.bench --shapes edge-wide ltx-stage1 --no-flex
    python -m na3d.bench --features --backward   # each feature against the plain call (below)

On a GPU, in one process: measures the two ceilings (device-to-device copy
bandwidth; dense SDPA flash-attention rate), then per shape times every method
(median of many runs, L2 flushed before each), checks each one's error against a
float32 oracle, prints tables and writes ``benchmarks/results/<device>.json`` and a
plot. With ``--backward`` each bwd row also records ``bwd_over_fwd`` and
``fwd_plus_bwd`` (a training step's attention: forward + backward per method), and
the ceilings gain ``dense_reference``: dense attention's own forward and backward
(no mask; FA2, cuDNN, FlexAttention) on the same GPU.
Without a GPU it says so and runs a small CPU demonstration instead.

Methods: ``na3d``; ``sdpa_exact``, the grouped-SDPA reference (forward, not timed on
the DiT shapes: seconds per call); ``flex``, FlexAttention compiled with a
neighborhood ``BlockMask``; and the peers of ``tools/peers.py`` where they run:
``natten_hopper`` (NATTEN's Hopper FNA, forward and backward, its fastest
configuration per shape), ``comfy_cuda`` and ``comfy_triton`` (comfy-kitchen,
forward, head dim <= 64). A peer that is not installed, or not built for this GPU,
is left out with one note at the start of the run.

``ms`` is the time of an eager call (CUDA events around it): what a caller sees,
host work included. For na3d each row also records ``gpu_ms``, its GPU time alone
(the call replayed as a CUDA graph, ``Timer(graphs=True)``): on calls of tens of
microseconds the host's launch work exceeds the kernels' and ``ms`` measures the
host; ``gpu_ms`` is what CUDA graphs and ``torch.compile``'s graph mode get.

``--features`` times, instead of the shape rows, each feature of the call (``FEATURES``:
GQA 8 query heads on 2 key/value heads, MQA, dilation (1,2,2) and (2,2,2), causal time
and causal on all axes, ``return_lse``) against the plain ``na3d(q, k, v, kernel_size)``
on the same base shape (``feature-base``, ``ltx-stage3``, ``feature-hd128``), forward (and backward with
``--backward``). Rows ``feature-<name>/<base>`` hold ``ms`` and ``gpu_ms`` of ``plain``
and ``feature``, ``vs_plain`` (feature over plain: ``na3d`` eager, ``na3d_gpu`` by GPU
time), the feature's ``args`` and ``launches`` (GPU kernels per call, counted with
``torch.profiler`` after every timing). They are merged into the results file already
there, whose other rows and fields stay; each records its own commit.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import subprocess
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .. import geometry, launch
from ..api import na3d
from ..reference import na3d_brute_force, na3d_sdpa_exact
from . import peers
from .common import SHAPE_GROUPS, Timer, bench_shapes, log

# Runs per configuration when choosing NATTEN's fastest (after a warm-up and an
# estimate): enough to rank configurations whose times differ by more than noise.
CONFIG_TRIAL_RUNS = 3


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
    ms = timer(functools.partial(dst.copy_, src), min_runs=20)
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


def forward_row(spec: dict, timer: Timer, ceilings: Dict[str, float], device, methods: List[str], rounds: int = 1,
                dtype=torch.bfloat16, gpu_timer: Optional[Timer] = None) -> dict:
    """Time every method on one shape; error of each against a float32 oracle. With
    ``gpu_timer`` (a ``Timer(graphs=True)``), na3d's GPU time too (``gpu_ms``).

    Methods other than na3d that do not run on this shape are listed in
    ``skipped`` (why), those that failed in ``errors``. NATTEN's configuration
    is chosen here (:func:`natten_forward_choice`) and recorded as
    ``natten_hopper_config``.
    """
    name, shape, ks = spec["name"], tuple(spec["shape"]), tuple(spec["kernel_size"])
    stride = tuple(spec.get("stride", (1, 1, 1)))
    B, T, H, W, NH, HD = shape
    scale = HD ** -0.5
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen, dtype=dtype, device=device) for _ in range(3))
    flops, nbytes = useful_flops(shape, ks), min_bytes(shape, q.element_size())
    floor_ms = max(flops / (ceilings["dense_attn_tflops"] * 1e12), nbytes / (ceilings["copy_tbs"] * 1e12)) * 1e3
    cfg = launch.forward_config(q, ks, stride=stride)
    row = {"name": name, "group": spec.get("group"), "shape": list(shape), "kernel_size": list(ks),
           "dtype": str(dtype).split(".")[-1], "pass": "fwd", "ms": {}, "floor_ms": round(floor_ms, 5),
           "floor_bound": "compute" if flops / (ceilings["dense_attn_tflops"] * 1e12)
           > nbytes / (ceilings["copy_tbs"] * 1e12) else "memory",
           "config": {"q_tile": list(cfg.q_tile), "kv_tile": list(cfg.kv_tile), "num_warps": cfg.num_warps,
                      "num_stages": cfg.num_stages, "bucket": cfg.bucket},
           "flops_issued_ratio": round(geometry.issued_flops_ratio((T, H, W), ks, cfg.q_tile, cfg.kv_tile,
                                                                   stride=stride), 3),
           "full_products_share": round(geometry.full_products_share((T, H, W), ks, cfg.q_tile, cfg.kv_tile,
                                                                     stride=stride), 3)}
    if stride != (1, 1, 1):
        row["stride"] = list(stride)
        row["speed_of_light_ms"] = round(spec["dense_ms"]["fwd"] * window_fraction(spec), 5)

    log(f"  {name}: oracle (float32 grouped SDPA)")
    oracle = na3d_sdpa_exact(q.float(), k.float(), v.float(), ks, scale=scale, stride=stride)
    out = na3d(q, k, v, ks, scale=scale, stride=stride)
    row["max_abs_err"] = float((out.float() - oracle).abs().max())
    ref_bf16 = na3d_sdpa_exact(q, k, v, ks, scale=scale, stride=stride)
    row["sdpa_exact_max_abs_err"] = float((ref_bf16.float() - oracle).abs().max())
    del out, ref_bf16

    runners = {"na3d": lambda: na3d(q, k, v, ks, scale=scale, stride=stride)}
    if spec.get("group") != "ltx":
        if "sdpa_exact" in methods:
            skip(row, "sdpa_exact", "not timed on the DiT shapes (seconds per call); its error is measured")
    else:
        runners["sdpa_exact"] = lambda: na3d_sdpa_exact(q, k, v, ks, scale=scale)
    for method in peers.METHODS:
        if method not in methods:
            continue
        reason = peers.skip_reason(method, shape, dtype, stride=stride)
        if reason is not None:
            skip(row, method, reason)
            continue
        try:
            if method == peers.NATTEN:
                log(f"  {name}: choosing NATTEN's forward configuration")
                config = natten_forward_choice(row, q, k, v, ks, scale, timer, stride)
                if config is None:
                    continue
                # natten.na3d as a user calls it: its token permutations are timed too.
                runners[method] = functools.partial(peers.natten_hopper, q, k, v, ks, scale, stride=stride, **config)
            else:
                # comfy-kitchen's backend function on the same (B, T, H, W, NH, HD) tensors,
                # no layout change (what it does besides its kernel: peers.comfy_kernel).
                runners[method] = functools.partial(peers.comfy_kernel(method), q, k, v, list(ks), None, scale)
            row[f"{method}_max_abs_err"] = float((runners[method]().float() - oracle).abs().max())
        except Exception as exc:  # report, keep benchmarking the rest
            fail(row, method, exc)
            runners.pop(method, None)
    del oracle
    torch.cuda.empty_cache()
    if "flex" in methods and stride != (1, 1, 1):
        skip(row, "flex", "strided windows: the benchmark's block mask is stride 1's")
    elif "flex" in methods:
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
    def measure(method):
        if method == GPU_TIME:
            log(f"  {name}: GPU time of na3d (graph replay)")
            return gpu_timer(runners["na3d"], min_runs=20, target_ms=300)
        log(f"  {name}: timing {method}")
        slow = method != "na3d"
        return timer(runners[method], min_runs=5 if slow else 20, target_ms=1000 if slow else 300)

    def failed(method, exc):  # e.g. out of memory in a baseline: report it
        if method in ("na3d", GPU_TIME):
            raise exc
        fail(row, method, exc)

    timed = [m for m in methods if m in runners] + ([GPU_TIME] if gpu_timer is not None else [])
    record_rounds(row, *time_in_rounds(timed, measure, rounds, failed), rounds, floor_ms)
    record_speed_of_light(row)
    if "na3d" in row["ms"]:
        t = row["ms"]["na3d"] * 1e-3
        row["na3d_tflops"] = round(flops / t / 1e12, 1)
        row["na3d_tbs"] = round(nbytes / t / 1e12, 3)
        record_speedups(row)
    return row


def time_in_rounds(methods: List[str], measure: Callable[[str], float], rounds: int,
                   on_error: Callable[[str, Exception], None]) -> Tuple[Dict[str, float], Dict[str, List[float]]]:
    """Each method's median time over ``rounds`` rounds, the methods taking turns within
    a round (the order rotating from one round to the next), so that a GPU whose clock
    moves under its power cap (an H100 at 700 W: NOTES v38) weighs on every method
    alike. ``measure(method)`` times one method once; a method that raises is passed
    to ``on_error`` (which may raise again) and left out of the later rounds. Returns
    ``({method: median ms}, {method: [ms per round]})``."""
    times = {m: [] for m in methods}
    failed = set()
    for r in range(rounds):
        turn = r % max(1, len(methods))
        for method in methods[turn:] + methods[:turn]:
            if method in failed:
                continue
            try:
                times[method].append(measure(method))
            except Exception as exc:
                failed.add(method)
                on_error(method, exc)
    done = {m: v for m, v in times.items() if v and m not in failed}
    return {m: statistics.median(v) for m, v in done.items()}, done


# The pseudo-method under which na3d's GPU time (CUDA-graph replay) takes its turn in the
# rounds beside the eager timings: a clock that moves between measurements weighs on it too.
GPU_TIME = "na3d (GPU time)"


def record_rounds(row: dict, medians: Dict[str, float], per_round: Dict[str, List[float]], rounds: int,
                  floor_ms: float) -> None:
    """A row's times from :func:`time_in_rounds`: the methods' (``ms``, ``ms_rounds``,
    ``x_floor``) and na3d's GPU time (``gpu_ms``, ``gpu_x_floor``, over more than one
    round ``gpu_ms_rounds``) where it was measured."""
    gpu, gpu_rounds = medians.pop(GPU_TIME, None), per_round.pop(GPU_TIME, None)
    record_times(row, medians, per_round, rounds)
    row["x_floor"] = {m: round(t / floor_ms, 3) for m, t in row["ms"].items()}
    if gpu is not None and "na3d" in row["ms"]:
        record_gpu_time(row, gpu, floor_ms)
        if rounds > 1:
            row["gpu_ms_rounds"] = {"na3d": [round(t, 5) for t in gpu_rounds]}


def record_times(row: dict, medians: Dict[str, float], per_round: Dict[str, List[float]], rounds: int) -> None:
    """``row["ms"]`` (medians) and, over more than one round, ``row["ms_rounds"]``."""
    for method, ms in medians.items():
        row["ms"][method] = round(ms, 5)
    if rounds > 1:
        row["ms_rounds"] = {m: [round(t, 5) for t in v] for m, v in per_round.items()}


def skip(row: dict, method: str, reason: str) -> None:
    """``row["skipped"][method]``: a method not run on this row, and why."""
    row.setdefault("skipped", {})[method] = reason


def fail(row: dict, method: str, exc: Exception) -> None:
    """``row["errors"][method]``: a method that raised on this row (the others go on)."""
    row.setdefault("errors", {})[method] = f"{type(exc).__name__}: {exc}"[:300]
    log(f"  {row['name']}: {method} failed: {row['errors'][method]}")


def record_speedups(row: dict) -> None:
    """``row["speedup_vs"]``: each other method's time over na3d's (above 1: na3d is faster)."""
    row["speedup_vs"] = {m: round(ms / row["ms"]["na3d"], 2) for m, ms in row["ms"].items() if m != "na3d"}


def window_fraction(spec: dict) -> float:
    """The share of the grid's keys a query sees: ``prod(kernel) / (T * H * W)``."""
    return math.prod(spec["kernel_size"]) / math.prod(spec["shape"][1:4])


def measure_dense_on_tokens(spec: dict, timer: Timer, device, rounds: int = 1) -> Dict[str, float]:
    """Dense attention (cuDNN, no mask) on a strided row's tokens, heads and head dim:
    ``{"fwd": ms, "bwd": ms}`` (bwd = forward + backward minus forward), the base of
    the row's speed of light (``window_fraction`` of it: DESIGN's section 3c); medians
    over ``rounds`` measurements."""
    B, T, H, W, NH, HD = spec["shape"]
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, NH, T * H * W, HD, dtype=torch.bfloat16, device=device, generator=gen,
                           requires_grad=True) for _ in range(3))
    grad_out = torch.randn_like(q)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def dense():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)

    fwds, boths = [], []
    for _ in range(rounds):
        with torch.no_grad():
            fwds.append(timer(dense, min_runs=5, target_ms=1000))
        boths.append(timer(lambda: torch.autograd.grad(dense(), (q, k, v), grad_out), min_runs=5, target_ms=2000))
    fwd, both = statistics.median(fwds), statistics.median(boths)
    return {"fwd": round(fwd, 4), "bwd": round(both - fwd, 4)}


def record_speed_of_light(row: dict) -> None:
    """``row["x_speed_of_light"]``: each method's time over the row's speed of light
    (strided rows), na3d's GPU time too."""
    if "speed_of_light_ms" not in row:
        return
    sol = row["speed_of_light_ms"]
    row["x_speed_of_light"] = {m: round(t / sol, 3) for m, t in row["ms"].items()}
    if "gpu_ms" in row:
        row["x_speed_of_light"]["na3d_gpu"] = round(row["gpu_ms"]["na3d"] / sol, 3)


def natten_forward_choice(row: dict, q, k, v, kernel_size, scale, timer: Timer,
                          stride=(1, 1, 1)) -> Optional[dict]:
    """NATTEN's fastest forward configuration on these inputs, as ``natten.na3d`` keywords.

    Each configuration NATTEN offers (at most ``peers.MAX_CONFIGS``) is timed
    briefly (``CONFIG_TRIAL_RUNS`` runs); the row records the chosen one
    (``natten_hopper_config``), every trial's median ms (``natten_hopper_trials``)
    and the failures. None when none ran.
    """
    def trial(config):
        fn = functools.partial(peers.natten_hopper, q, k, v, kernel_size, scale, stride=stride, **config)
        return timer(fn, min_runs=CONFIG_TRIAL_RUNS, target_ms=0, max_runs=CONFIG_TRIAL_RUNS)

    return record_choice(row, *peers.best_config(peers.natten_configs(q), trial))


def record_choice(row: dict, best: Optional[dict], times: Dict[str, float], errors: Dict[str, str],
                  base: Optional[dict] = None) -> Optional[dict]:
    """Record NATTEN's chosen configuration (``base``'s keywords with it) and its trials in ``row``."""
    row["natten_hopper_trials"] = times
    if errors:
        row["natten_hopper_config_errors"] = errors
    if best is None:
        row.setdefault("errors", {})[peers.NATTEN] = "no configuration ran: " + "; ".join(errors.values())[:300]
        log(f"  {row['name']}: {peers.NATTEN}: {row['errors'][peers.NATTEN]}")
        return None
    row["natten_hopper_config"] = peers.config_json(dict(base or {}, **best))
    return best


def record_gpu_time(row: dict, ms: float, floor_ms: float) -> None:
    """``row["gpu_ms"]``/``row["gpu_x_floor"]`` for na3d."""
    row["gpu_ms"] = {"na3d": round(ms, 5)}
    row["gpu_x_floor"] = {"na3d": round(ms / floor_ms, 3)}


def backward_row(spec: dict, timer: Timer, ceilings: Dict[str, float], device, methods: List[str], rounds: int = 1,
                 dtype=torch.bfloat16, gpu_timer: Optional[Timer] = None,
                 natten_forward_config: Optional[dict] = None) -> dict:
    """Time dq, dk, dv from a given dO (forward excluded) for every method on one shape.

    na3d, NATTEN and FlexAttention are timed the same way: ``torch.autograd.grad`` of
    their retained graphs. ``na3d_fused`` is the one-pass backward (dQ by atomic adds)
    through the launcher, when the table's config is the two-kernel one.
    NATTEN's backward configurations are timed with its forward configuration
    ``natten_forward_config`` (the forward row's ``natten_hopper_config``; chosen
    here when None) and the fastest kept (``natten_hopper_config`` holds both).
    Errors: each method's gradients against the float32 reference's
    (:func:`reference_grads`).
    Floor: the backward does 2.5x the forward's matrix work (five products instead of
    two) and moves 8 tensors (q, k, v, o, dO in; dq, dk, dv out) instead of 4.
    ``gpu_timer``: as in :func:`forward_row`. A backward replays in a CUDA graph only
    with the forward that recorded its autograd graph captured beside it, so its GPU
    time is that of forward + ``autograd.grad`` minus that of the forward alone.
    """
    name, shape, ks = spec["name"], tuple(spec["shape"]), tuple(spec["kernel_size"])
    stride = tuple(spec.get("stride", (1, 1, 1)))
    B, T, H, W, NH, HD = shape
    scale = HD ** -0.5
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(shape, generator=gen, dtype=dtype, device=device) for _ in range(4))
    flops, nbytes = 2.5 * useful_flops(shape, ks), 2 * min_bytes(shape, q.element_size())
    floor_ms = max(flops / (ceilings["dense_attn_tflops"] * 1e12), nbytes / (ceilings["copy_tbs"] * 1e12)) * 1e3
    cfg = launch.backward_config(q, ks, stride=stride)
    row = {"name": name, "group": spec.get("group"), "shape": list(shape), "kernel_size": list(ks),
           "dtype": str(dtype).split(".")[-1], "pass": "bwd", "ms": {}, "floor_ms": round(floor_ms, 5),
           "config": {"dq": [list(cfg.dq_q_tile), list(cfg.dq_kv_tile)],
                      "dkdv": [list(cfg.dkdv_k_tile), list(cfg.dkdv_q_tile)],
                      "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                      "dkdv_num_warps": cfg.dkdv_warps, "dkdv_num_stages": cfg.dkdv_stages,
                      "fused": cfg.fused, "bucket": cfg.bucket},
           # Products issued per useful one by each kernel, counted as each scans (dQ as the
           # forward; dK/dV from its key boxes: own="keys").
           "flops_issued_ratio": {
               "dq": round(geometry.issued_flops_ratio((T, H, W), ks, cfg.dq_q_tile, cfg.dq_kv_tile, stride=stride), 3),
               "dkdv": round(geometry.issued_flops_ratio((T, H, W), ks, cfg.dkdv_k_tile, cfg.dkdv_q_tile,
                                                         stride=stride, own="keys"), 3)},
           "full_products_share": {
               "dq": round(geometry.full_products_share((T, H, W), ks, cfg.dq_q_tile, cfg.dq_kv_tile, stride=stride), 3),
               "dkdv": round(geometry.full_products_share((T, H, W), ks, cfg.dkdv_k_tile, cfg.dkdv_q_tile,
                                                          stride=stride, own="keys"), 3)}}
    if stride != (1, 1, 1):
        row["stride"] = list(stride)
        row["speed_of_light_ms"] = round(spec["dense_ms"]["bwd"] * window_fraction(spec), 5)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def graph_of(fn):
        return retained_backward(fn, leaves, do)

    # The grouped-SDPA reference is left out: its autograd graph keeps every box's
    # copies alive (tens of GB at stage 5) and it is not a competitor.
    runners = {"na3d": lambda: graph_of(lambda a, b, c: na3d(a, b, c, ks, scale=scale, stride=stride))}
    if "flex" in methods and stride != (1, 1, 1):
        skip(row, "flex", "strided windows: the benchmark's block mask is stride 1's")
    elif "flex" in methods:
        def flex_graph():
            from torch.nn.attention.flex_attention import flex_attention

            from .flex_baseline import from_flex_layout, neighborhood_block_mask, to_flex_layout
            bm = neighborhood_block_mask((T, H, W), ks, 128, device=device)
            torch._dynamo.reset()  # see forward_row
            flex_fn = torch.compile(flex_attention, dynamic=False)
            return graph_of(lambda a, b, c: from_flex_layout(
                flex_fn(*(to_flex_layout(x) for x in (a, b, c)), block_mask=bm, scale=scale), shape))
        runners["flex"] = flex_graph
    for method in peers.METHODS:
        if method in methods:
            reason = peers.skip_reason(method, shape, dtype, backward=True, stride=stride)
            if reason is not None:
                skip(row, method, reason)
    if peers.NATTEN in methods and peers.NATTEN not in row.get("skipped", {}):
        try:
            config = natten_backward_choice(row, q, k, v, ks, scale, timer, graph_of, natten_forward_config, stride)
            if config is not None:
                runners[peers.NATTEN] = lambda: graph_of(
                    functools.partial(peers.natten_hopper, kernel_size=ks, scale=scale, stride=stride, **config))
        except Exception as exc:
            fail(row, peers.NATTEN, exc)
    # Gradients of every method against the float32 reference's.
    log(f"  {name}: backward error vs float32 grouped-SDPA autograd")
    ref = reference_grads(q, k, v, do, ks, scale, stride=stride)
    grads = runners["na3d"]()()
    row["max_abs_err"] = grad_errors(grads, ref)
    del grads
    if peers.NATTEN in runners:
        try:
            row["natten_hopper_max_abs_err"] = grad_errors(runners[peers.NATTEN]()(), ref)
        except Exception as exc:
            fail(row, peers.NATTEN, exc)
            runners.pop(peers.NATTEN)
    # The one-pass backward (dQ by atomic adds; not the default unless the table
    # says so), timed beside it through the launcher: its error against the same
    # reference first.
    fused_cfg = dataclasses.replace(cfg, fused=True)
    fwd_out, fwd_lse = launch.na3d_forward(q, k, v, ks, scale, return_lse=True, stride=stride)

    def fused_backward():
        return launch.na3d_backward(do, q, k, v, fwd_out, fwd_lse, ks, scale, config=fused_cfg, stride=stride)

    if not cfg.fused:
        runners["na3d_fused"] = lambda: fused_backward
        methods = list(methods) + ["na3d_fused"]
        try:
            row["max_abs_err_fused"] = grad_errors(fused_backward(), ref)
        except Exception as exc:
            row.setdefault("errors", {})["na3d_fused"] = f"{type(exc).__name__}: {exc}"[:300]
            methods.remove("na3d_fused")
    del ref
    torch.cuda.empty_cache()
    def measure(method):
        if method == GPU_TIME:
            log(f"  {name}: GPU time of na3d's backward (graph replay, minus the forward's)")
            try:
                return backward_gpu_ms(gpu_timer, functools.partial(na3d, kernel_size=ks, scale=scale, stride=stride),
                                       leaves, do)
            finally:
                torch.cuda.empty_cache()
        log(f"  {name}: timing {method} backward")
        fn = runners[method]()
        ours = method.startswith("na3d")
        try:
            return timer(fn, min_runs=20 if ours else 5, target_ms=300 if ours else 1000)
        finally:
            fn = None
            torch.cuda.empty_cache()

    def failed(method, exc):  # e.g. out of memory in a baseline: report it
        if method == GPU_TIME:
            raise exc
        row.setdefault("errors", {})[method] = f"{type(exc).__name__}: {exc}"[:300]
        log(f"  {name}: {method} backward failed: {row['errors'][method]}")
        torch.cuda.empty_cache()

    timed = [m for m in methods if m in runners] + ([GPU_TIME] if gpu_timer is not None else [])
    record_rounds(row, *time_in_rounds(timed, measure, rounds, failed), rounds, floor_ms)
    if "na3d" in row["ms"]:
        record_speedups(row)
    record_speed_of_light(row)
    return row


def retained_backward(fn, leaves, grads) -> Callable:
    """``fn(*leaves)`` run once; returns a call that takes the gradients of the ``leaves``
    from its retained autograd graph (``grads``: the output's gradient, or a sequence
    of them for a call returning several tensors): the backward alone, forward excluded."""
    out = fn(*leaves)
    return lambda: torch.autograd.grad(out, leaves, grads, retain_graph=True)


def backward_gpu_ms(gpu_timer: Timer, fn, leaves, grads) -> float:
    """GPU time of ``fn``'s backward: a backward replays in a CUDA graph only with the
    forward that recorded its autograd graph captured beside it, so this is the graph
    time of ``fn(*leaves)`` + ``autograd.grad`` minus that of ``fn(*leaves)`` alone."""
    def forward():
        return fn(*leaves)

    def forward_backward():
        return torch.autograd.grad(forward(), leaves, grads)

    both = gpu_timer(forward_backward, min_runs=20, target_ms=300)
    return both - gpu_timer(forward, min_runs=20, target_ms=300)


def natten_backward_choice(row: dict, q, k, v, kernel_size, scale, timer: Timer, graph_of,
                           forward_config: Optional[dict], stride=(1, 1, 1)) -> Optional[dict]:
    """NATTEN's fastest backward configuration with ``forward_config`` (chosen here when
    None), as ``natten.na3d`` keywords for both passes. Timed as the benchmark times
    backwards (``graph_of``: ``autograd.grad`` of a retained graph), briefly."""
    if forward_config is None:  # no forward row: its choice is made (and recorded) here
        forward_config = natten_forward_choice(row, q, k, v, kernel_size, scale, timer, stride)
        row["natten_hopper_forward_trials"] = row.pop("natten_hopper_trials")
        if forward_config is None:
            return None
    forward_config = peers.config_from_json(forward_config)

    def trial(config):
        fn = graph_of(functools.partial(peers.natten_hopper, kernel_size=kernel_size, scale=scale, stride=stride,
                                        **forward_config, **config))
        return timer(fn, min_runs=CONFIG_TRIAL_RUNS, target_ms=0, max_runs=CONFIG_TRIAL_RUNS)

    best = record_choice(row, *peers.best_config(peers.natten_configs(q, backward=True), trial),
                         base=forward_config)
    return None if best is None else dict(forward_config, **best)


def grad_errors(grads, ref) -> Dict[str, float]:
    """Max abs error of (dq, dk, dv) against the reference's."""
    return {n: float((g.float() - r).abs().max()) for n, g, r in zip(("dq", "dk", "dv"), grads, ref)}


# Bytes the float32 reference's autograd graph may hold at a time (at most a quarter of
# the free memory): at DiT windows one W column of queries holds ~20 GB of box copies.
REFERENCE_GRAD_BUDGET = 16 << 30


def reference_grads(q, k, v, do, kernel_size, scale, budget: Optional[int] = None,
                    stride=(1, 1, 1)) -> List[torch.Tensor]:
    """float32 dq, dk, dv through autograd of the grouped-SDPA reference, W chunk by W chunk.

    Each chunk of query columns (``w_offset``) runs forward and backward before the
    next, so only its autograd graph is alive: every box of queries keeps its own
    float32 copies of its window union of K and V. The first chunk is one column
    wide; each next one is sized from the peak memory the previous one took
    (:func:`next_chunk_width`) to stay near ``budget`` bytes.
    """
    device = q.device
    cuda = device.type == "cuda"  # (elsewhere, memory is not measured: chunks grow 4x)
    if budget is None:
        budget = min(REFERENCE_GRAD_BUDGET, torch.cuda.mem_get_info(device)[0] // 4) if cuda else 0
    ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
    W = q.shape[3]
    w0, width = 0, 1
    while w0 < W:
        w1 = min(W, w0 + width)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            start = torch.cuda.memory_allocated(device)
        out = na3d_sdpa_exact(ref[0][:, :, :, w0:w1], ref[1], ref[2], kernel_size, scale=scale, w_offset=w0,
                              stride=stride)
        out.backward(do[:, :, :, w0:w1].float())
        del out
        used = torch.cuda.max_memory_allocated(device) - start if cuda else 0
        width = next_chunk_width(w1 - w0, used, budget)
        w0 = w1
    return [t.grad for t in ref]


def next_chunk_width(width: int, used_bytes: int, budget: int, max_growth: int = 4) -> int:
    """Columns of the next chunk: ``width`` scaled by ``budget / used_bytes`` (a chunk's
    graph grows about linearly with its width), at least 1 and at most ``max_growth``
    times ``width``."""
    if used_bytes <= 0:
        return width * max_growth
    return max(1, min(width * max_growth, int(width * budget / used_bytes)))


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
    add_fwd_plus_bwd(bwd, fwd)


def add_fwd_plus_bwd(bwd: dict, fwd: dict) -> None:
    """``bwd["fwd_plus_bwd"]``: forward + backward ms per method of both rows (the same
    run), what one training step's attention costs; ``na3d_gpu`` from the CUDA-graph
    GPU times; ``speedup_vs``: each other method's sum over na3d's."""
    total = {m: round(fwd["ms"][m] + bwd["ms"][m], 5) for m in bwd["ms"] if m in fwd["ms"]}
    gpu_b, gpu_f = bwd.get("gpu_ms", {}).get("na3d"), fwd.get("gpu_ms", {}).get("na3d")
    summary = {"ms": total}
    if gpu_b and gpu_f:
        summary["na3d_gpu_ms"] = round(gpu_f + gpu_b, 5)
    if total.get("na3d", 0) > 0:
        summary["speedup_vs"] = {m: round(t / total["na3d"], 2) for m, t in total.items() if m != "na3d"}
    bwd["fwd_plus_bwd"] = summary


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


# The methods, in the order the method table and the plot show them.
METHOD_ORDER = ("na3d", "na3d_fused") + peers.METHODS + ("flex", "sdpa_exact")


def print_method_table(rows: List[dict]) -> None:
    """ms of every method that ran, per row, with forward + backward lines (``fwd+bwd``)
    where a bwd row has its forward's; ``-``: not run on that row."""
    methods = [m for m in METHOD_ORDER if any(m in r["ms"] for r in rows)]
    lines = []
    for r in rows:
        lines.append((r["name"], r["pass"], r["ms"]))
        if "fwd_plus_bwd" in r:
            lines.append((r["name"], "fwd+bwd", r["fwd_plus_bwd"]["ms"]))
    log(f"{'shape':<18}{'pass':>8}" + "".join(f"{m + ' ms':>18}" for m in methods))
    for name, pas, ms in lines:
        log(f"{name:<18}{pas:>8}" + "".join(f"{ms[m]:>18.4f}" if m in ms else f"{'-':>18}" for m in methods))


def plot(rows: List[dict], path: str, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no plot")
        return
    methods = [m for m in METHOD_ORDER if any(m in r["ms"] for r in rows)]
    if not rows or not methods:  # e.g. a decoder-only run: nothing to draw
        log(f"no fwd/bwd rows: no plot at {path}")
        return
    fig, ax = plt.subplots(figsize=(max(15, 1.1 * len(rows)), 5.5))
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


# Features against the plain call (--features): each feature of the public call timed
# beside na3d(q, k, v, kernel_size) on the same base shape, in the same process.

# Bases of their own (defined here, not in bench_shapes.json: bench_shapes() callers, the
# tuner and the tests, do not pick them up), and an LTX shape; all have 8 heads. feature-hd128
# is a video DiT's regime: head dim 128, a window of 1089 keys (sm90's dit_large_window bucket).
FEATURE_BASE = {"name": "feature-base", "group": "features", "shape": [1, 24, 48, 64, 8, 64],
                "kernel_size": [3, 5, 5]}
FEATURE_BASE_HD128 = {"name": "feature-hd128", "group": "features", "shape": [1, 24, 48, 64, 8, 128],
                      "kernel_size": [9, 11, 11]}
FEATURE_BASE_NAMES = ("feature-base", "ltx-stage3", "feature-hd128")

# name -> the feature's arguments: na3d's keywords, and kv_heads (key and value sliced to
# their first kv_heads heads, views, as a user passes them).
FEATURES = {
    "gqa-8on2": {"kv_heads": 2},
    "mqa": {"kv_heads": 1},
    "dilation-122": {"dilation": (1, 2, 2)},
    "dilation-222": {"dilation": (2, 2, 2)},
    "causal-t": {"is_causal": (True, False, False)},
    "causal-thw": {"is_causal": (True, True, True)},
    "lse": {"return_lse": True},
}


def feature_row_name(feature: str, base: str) -> str:
    """``feature-<feature>/<base>``: unique per (feature, base), so that rows merge by (name, pass)."""
    return f"feature-{feature}/{base}"


def feature_bases(names: Optional[List[str]] = None) -> List[dict]:
    """The base shapes of the feature rows (``FEATURE_BASE_NAMES``), or those named in
    ``names``; ValueError for another name."""
    known = {s["name"]: s for s in bench_shapes("ltx")}
    for base in (FEATURE_BASE, FEATURE_BASE_HD128):
        known[base["name"]] = base
    return named_shapes([known[n] for n in FEATURE_BASE_NAMES], names, "feature base shapes")


def feature_skip_reason(spec: dict, args: dict) -> Optional[str]:
    """Why the feature ``args`` cannot run on the base shape ``spec``; None when it can."""
    B, T, H, W, NH, HD = spec["shape"]
    nkv = args.get("kv_heads")
    if nkv is not None and (nkv >= NH or NH % nkv):
        return f"{nkv} key/value heads do not divide the {NH} query heads into groups"
    dilation = args.get("dilation")
    if dilation is not None:
        over = [f"{axis} {k} * {d} > {size}" for axis, k, d, size
                in zip("THW", spec["kernel_size"], dilation, (T, H, W)) if k * d > size]
        if over:
            return "kernel * dilation beyond the size: " + ", ".join(over)
    return None


def feature_call(q, k, v, kernel_size, args: dict) -> Tuple[Callable, list]:
    """``na3d`` with the feature's keywords, and its inputs: q, and k, v sliced to their
    first ``kv_heads`` heads for GQA/MQA (views). ``args`` empty: the plain call."""
    kwargs = dict(args)
    nkv = kwargs.pop("kv_heads", None)
    if nkv is not None:
        k, v = k[..., :nkv, :], v[..., :nkv, :]
    return functools.partial(na3d, kernel_size=kernel_size, **kwargs), [q, k, v]


def feature_calls(spec: dict, args: dict, pas: str, device, dtype=torch.bfloat16) -> Dict[str, tuple]:
    """The plain call's and the feature's runs on one base shape, for one pass:
    ``{"plain": (run, gpu_ms), "feature": (run, gpu_ms)}``. ``run()`` is what the eager
    timer and the launch count call: the call itself (fwd), or ``autograd.grad`` of its
    retained graph (bwd: :func:`retained_backward`, as in :func:`backward_row`);
    ``gpu_ms(gpu_timer)`` its GPU time by graph replay (bwd: :func:`backward_gpu_ms`).
    Both take the same q (and dO); a call returning the lse gets a dLSE beside dO."""
    shape, ks = tuple(spec["shape"]), tuple(spec["kernel_size"])
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(shape, generator=gen, dtype=dtype, device=device) for _ in range(4))
    dlse = torch.randn(shape[:-1], generator=gen, dtype=torch.float32, device=device)
    calls = {}
    for method, method_args in (("plain", {}), ("feature", args)):
        fn, inputs = feature_call(q, k, v, ks, method_args)
        if pas == "fwd":
            run = functools.partial(fn, *inputs)
            calls[method] = (run, functools.partial(graph_forward_ms, run=run))
        else:
            leaves = [t.detach().requires_grad_() for t in inputs]
            grads = (do, dlse) if method_args.get("return_lse") else do
            # The graph replay takes leaves of its own: a retained autograd graph keeps
            # its leaves' gradient-accumulator nodes alive, with the stream they were
            # made on (the default one), and a capture that reaches them fails
            # (cudaErrorStreamCaptureImplicit).
            graph_leaves = [t.detach().requires_grad_() for t in inputs]
            calls[method] = (retained_backward(fn, leaves, grads),
                             functools.partial(backward_gpu_ms, fn=fn, leaves=graph_leaves, grads=grads))
    return calls


def graph_forward_ms(gpu_timer: Timer, run: Callable) -> float:
    """GPU time of ``run`` by graph replay, as :func:`forward_row` times na3d's."""
    return gpu_timer(run, min_runs=20, target_ms=300)


def feature_row(spec: dict, feature: str, pas: str, timer: Timer, device, gpu_timer: Optional[Timer] = None,
                dtype=torch.bfloat16) -> dict:
    """One feature against the plain call on the base shape ``spec``, one pass (``"fwd"``
    or ``"bwd"``): ``ms`` (eager, as na3d's in the shape rows) and ``gpu_ms`` (with
    ``gpu_timer``) for ``plain`` and ``feature``, and their ratios in ``vs_plain``."""
    args = FEATURES[feature]
    row = {"name": feature_row_name(feature, spec["name"]), "feature": feature, "base": spec["name"],
           "group": "features", "shape": list(spec["shape"]), "kernel_size": list(spec["kernel_size"]),
           "dtype": str(dtype).split(".")[-1], "pass": pas,
           "args": {a: list(x) if isinstance(x, tuple) else x for a, x in args.items()}, "ms": {}}
    calls = feature_calls(spec, args, pas, device, dtype)
    for method, (run, gpu_ms) in calls.items():
        log(f"  {row['name']} {pas}: timing {method}")
        row["ms"][method] = round(timer(run, min_runs=20, target_ms=300), 5)
        if gpu_timer is not None:
            row.setdefault("gpu_ms", {})[method] = round(gpu_ms(gpu_timer), 5)
    del calls
    torch.cuda.empty_cache()
    record_vs_plain(row)
    return row


def record_vs_plain(row: dict) -> None:
    """``row["vs_plain"]``: the feature's time over the plain call's, eager (``na3d``) and
    by GPU time (``na3d_gpu``, where both were measured and positive)."""
    ms, gpu = row["ms"], row.get("gpu_ms", {})
    ratio = {"na3d": round(ms["feature"] / ms["plain"], 3)}
    if gpu.get("plain", 0) > 0 and gpu.get("feature", 0) > 0:
        ratio["na3d_gpu"] = round(gpu["feature"] / gpu["plain"], 3)
    row["vs_plain"] = ratio


def is_kernel_event(event) -> bool:
    """A GPU kernel among a ``torch.profiler`` run's events (copies, memsets, syncs and
    annotations left out)."""
    kind = getattr(event, "activity_type", None)  # kineto's activity name, in newer torch
    if kind is not None:
        return kind == "kernel"
    from torch.autograd import DeviceType
    return (event.device_type == DeviceType.CUDA and not getattr(event, "is_user_annotation", False)
            and not event.name.startswith(("Memcpy", "Memset")) and "Sync" not in event.name)


def kernel_launches(run: Callable) -> int:
    """GPU kernels that one ``run()`` runs, as ``torch.profiler`` (CUPTI) records them."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if is_kernel_event(e))


def add_launch_counts(row: dict, device) -> None:
    """``row["launches"]``: kernels one plain call and one feature call run (for a bwd
    row, the backward alone), counted after every row is timed, so that the profiler
    runs after the timings. A count of 0 (the profiler saw no kernel) or a profiler
    error is recorded as ``launches_note`` instead."""
    calls = feature_calls(row, FEATURES[row["feature"]], row["pass"], device, getattr(torch, row["dtype"]))
    try:
        counts = {method: kernel_launches(run) for method, (run, _) in calls.items()}
    except Exception as exc:  # a profiler that does not run here: no count
        row["launches_note"] = f"not counted: {type(exc).__name__}: {exc}"[:300]
        return
    finally:
        del calls
        torch.cuda.empty_cache()
    if min(counts.values()) == 0:
        row["launches_note"] = f"not counted: the profiler recorded no kernel ({counts})"
    else:
        row["launches"] = counts


def print_speed_of_light_table(rows: List[dict]) -> None:
    """Strided rows: the speed of light and each method's time over it (GPU time for na3d too)."""
    rows = [r for r in rows if "speed_of_light_ms" in r]
    if not rows:
        return
    log(f"{'shape':<22}{'pass':>5}{'stride':>10}{'sol ms':>10}{'na3d ms':>10}{'na3d gpu':>10}{'natten ms':>11}"
        f"{'x_sol na3d':>12}{'x_sol natten':>14}")
    for r in rows:
        x = r.get("x_speed_of_light", {})
        log(f"{r['name']:<22}{r['pass']:>5}{'x'.join(map(str, r['stride'])):>10}{r['speed_of_light_ms']:>10.3f}"
            f"{r['ms'].get('na3d', float('nan')):>10.3f}{r.get('gpu_ms', {}).get('na3d', float('nan')):>10.3f}"
            f"{r['ms'].get(peers.NATTEN, float('nan')):>11.3f}{x.get('na3d_gpu', x.get('na3d', float('nan'))):>12.3f}"
            f"{x.get(peers.NATTEN, float('nan')):>14.3f}")


def is_shape_row(row: dict) -> bool:
    """A forward or backward row of a benchmark shape (not a feature or decoder row)."""
    return row["pass"] in ("fwd", "bwd") and "feature" not in row


def print_feature_table(rows: List[dict]) -> None:
    """The feature rows: ms of the plain and the feature call, their ratio, eager and by GPU time."""
    log(f"{'feature':<14}{'base':<14}{'pass':>5}{'plain ms':>10}{'feature ms':>11}{'x eager':>9}"
        f"{'plain gpu':>11}{'feature gpu':>12}{'x gpu':>8}{'launches':>10}")
    nan = float("nan")
    for r in rows:
        ms, gpu, ratio = r["ms"], r.get("gpu_ms", {}), r.get("vs_plain", {})
        launches = "/".join(str(r["launches"][m]) for m in ("plain", "feature")) if "launches" in r else "-"
        log(f"{r['feature']:<14}{r['base']:<14}{r['pass']:>5}{ms.get('plain', nan):>10.4f}"
            f"{ms.get('feature', nan):>11.4f}{ratio.get('na3d', nan):>9.3f}{gpu.get('plain', nan):>11.4f}"
            f"{gpu.get('feature', nan):>12.4f}{ratio.get('na3d_gpu', nan):>8.3f}{launches:>10}")


def merged_results(fields: dict, kept: List[dict], rows: List[dict], complete: bool) -> dict:
    """The results file: ``fields`` (device, versions, commit, ceilings, peers), then
    ``kept``'s rows not measured again (same name and pass) followed by ``rows``."""
    measured = {(r["name"], r["pass"]) for r in rows}
    result = dict(fields, rows=[r for r in kept if (r["name"], r["pass"]) not in measured] + rows)
    if not complete:
        result["incomplete"] = "the run stopped before measuring every requested row"
    return result


def write_merged_results(path: str, rows: List[dict], fields: dict, complete: bool) -> None:
    """Merge ``rows`` into the results file at ``path`` (:func:`merged_results`: rows of the
    same name and pass replaced, the others kept). A file already there keeps its own
    top-level fields (they describe its other rows: stamp new rows with their own);
    a new file gets ``fields``."""
    kept = []
    if os.path.exists(path):
        with open(path) as f:
            earlier = json.load(f)
        kept = earlier.pop("rows", [])
        earlier.pop("incomplete", None)
        fields = earlier
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(merged_results(fields, kept, rows, complete), f, indent=1)


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m na3d.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--group", choices=SHAPE_GROUPS, default="all",
                        help="shapes of one regime: ltx (the LTX-2.5 decoder, head dim 64), dit (video DiT "
                             "training, head dim 128) or all (default)")
    parser.add_argument("--shapes", nargs="*", help="shape names from bench_shapes.json (default: the group's)")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    parser.add_argument("--no-reference", action="store_true", help="skip timing the grouped-SDPA reference")
    parser.add_argument("--no-natten", action="store_true", help="skip NATTEN's Hopper FNA")
    parser.add_argument("--no-comfy", action="store_true", help="skip comfy-kitchen's kernels")
    parser.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--commit", default=None, help="git sha of the measured tree (default: git rev-parse)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--backward", action="store_true", help="also time the backward (bwd rows)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time the methods of each row in this many rounds, taking turns (and a strided "
                             "row's dense base as often), and keep the medians: on a GPU at its power cap the "
                             "clock moves between measurements (NOTES v38)")
    parser.add_argument("--no-forward", action="store_true", help="skip the forward rows")
    parser.add_argument("--decoder", action="store_true",
                        help="also decode with the full-size LTX-2.5 decoder (needs diffusers; row ltx-decoder)")
    parser.add_argument("--no-shapes", action="store_true", help="no shape rows (e.g. --decoder alone)")
    parser.add_argument("--merge", default=None, metavar="RESULTS_JSON",
                        help="start from this results file (same commit required, except with --features): rows "
                             "measured now replace its rows of the same name and pass, the others are kept")
    parser.add_argument("--features", action="store_true",
                        help="instead of the shape rows, time each feature (GQA 8 on 2 heads, MQA, dilation, "
                             "causal, return_lse) against the plain call on the base shapes feature-base, ltx-stage3 "
                             "and feature-hd128 (--shapes picks among them): rows feature-<name>/<base>, bwd rows too "
                             "with --backward. Merged into the results file already at the output path (or "
                             "--merge's) whatever its commit: its other rows and fields are kept, each feature "
                             "row records its own commit. A run without --features (and without --merge) "
                             "rewrites the file: run --features after it")
    return parser


def select_shapes(group: str, names: Optional[List[str]]) -> List[dict]:
    """The group's shapes, or those of them named in ``names``; ValueError for a name
    the group does not have."""
    return named_shapes(bench_shapes(group), names, f"shapes in group {group}")


def named_shapes(specs: List[dict], names: Optional[List[str]], what: str) -> List[dict]:
    """``specs``, or those of them named in ``names`` (in ``specs``' order); ValueError,
    naming ``what``, for a name they do not have."""
    if names:
        unknown = set(names) - {s["name"] for s in specs}
        if unknown:
            raise ValueError(f"unknown {what}: {sorted(unknown)}; known: {[s['name'] for s in specs]}")
        specs = [s for s in specs if s["name"] in names]
    return specs


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        cpu_demo()
        return 0
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    if args.features and args.decoder:
        parser.error("--features runs on its own: run --decoder in another run")
    try:
        specs = [] if args.features or args.no_shapes else select_shapes(args.group, args.shapes)
        bases = feature_bases(args.shapes) if args.features else []
    except ValueError as exc:
        parser.error(str(exc))
    commit = args.commit or git_commit()
    slug = device_slug(name)
    path = os.path.join(args.out_dir, f"{slug}.json")
    # --features merges into the results file there (its shape rows are kept), whatever
    # its commit: feature rows record their own.
    merge_from = args.merge or (path if args.features and os.path.exists(path) else None)
    kept, earlier = [], None
    if merge_from:
        with open(merge_from) as f:
            earlier = json.load(f)
        if earlier.get("commit") != commit and not args.features:
            parser.error(f"--merge {args.merge}: its rows are from commit {earlier.get('commit')}, this run is {commit}")
        kept = earlier["rows"]
    methods = ["na3d"] + ([] if args.no_reference else ["sdpa_exact"]) + ([] if args.no_flex else ["flex"])
    peer_methods, peer_notes = peers.available_methods(
        device, natten=not args.no_natten and bool(specs), comfy=not args.no_comfy and bool(specs))
    for note in peer_notes:
        log(note)
    methods += peer_methods
    timer = Timer(device)
    # (Its own 256 MiB flush buffer: only when shape or feature rows are timed, so that a
    # decoder-only run's peak memory holds one.)
    gpu_timer = Timer(device, graphs=True) if specs or bases else None
    log(f"device: {name}; torch {torch.__version__}")
    ceilings = {}
    if not args.features:  # (feature rows have no floor: no ceilings)
        log("measuring ceilings")
        ceilings = measure_ceilings(timer, device)
        log(f"ceilings: copy {ceilings['copy_tbs']} TB/s, dense SDPA flash {ceilings['dense_attn_tflops']} TFLOP/s")
    if args.backward and not args.features:
        ceilings["dense_reference"] = measure_dense_references(timer, device, flex=not args.no_flex)
        for ref_name, ref in ceilings["dense_reference"].items():
            if isinstance(ref, dict):
                log(f"dense {ref_name} (no mask, {ceilings['dense_reference']['shape']}): " + (
                    ref["error"] if "error" in ref else
                    f"fwd {ref['fwd_tflops']} TFLOP/s, bwd {ref['bwd_tflops']} TFLOP/s, bwd/fwd {ref['bwd_over_fwd']}"))
    import triton

    fields = {"device": name, "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "commit": commit,
              "date": datetime.date.today().isoformat(), "ceilings": ceilings,
              "peers": dict(peers.versions(methods), skipped=peer_notes)}
    if args.features and earlier is not None:
        # The file's own fields (its shape rows' commit, ceilings, peers) stay.
        fields = {key: value for key, value in earlier.items() if key != "rows"}

    def write(rows: List[dict], complete: bool) -> None:
        """The results file; rewritten after every shape, so a cut run keeps its rows."""
        if args.no_write:
            return
        os.makedirs(args.out_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(merged_results(fields, kept, rows, complete), f, indent=1)

    rows = []
    for i, spec in enumerate(specs):
        log(f"[{i + 1}/{len(specs)}] {spec['name']} {spec['shape']} kernel {spec['kernel_size']}"
            + (f" stride {spec['stride']}" if "stride" in spec else ""))
        if "stride" in spec:
            log(f"  {spec['name']}: dense cuDNN on the same tokens (the speed of light's base)")
            spec = dict(spec, dense_ms=measure_dense_on_tokens(spec, timer, device, args.rounds))
            torch.cuda.empty_cache()
        if not args.no_forward:
            rows.append(forward_row(spec, timer, ceilings, device, methods, args.rounds, gpu_timer=gpu_timer))
            torch.cuda.empty_cache()
        if args.backward:
            natten_config = None if args.no_forward else rows[-1].get("natten_hopper_config")
            rows.append(backward_row(spec, timer, ceilings, device, methods, args.rounds, gpu_timer=gpu_timer,
                                     natten_forward_config=natten_config))
            if not args.no_forward:
                add_bwd_over_fwd(rows[-1], rows[-2])
            torch.cuda.empty_cache()
        write(rows, complete=False)
    passes = ([] if args.no_forward else ["fwd"]) + (["bwd"] if args.backward else [])
    # Feature rows say what measured them (the file's fields may be another run's).
    stamp = {"commit": commit, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
             "triton": triton.__version__}
    for i, base in enumerate(bases):
        log(f"[features {i + 1}/{len(bases)}] {base['name']} {base['shape']} kernel {base['kernel_size']}")
        for feature, feature_args in FEATURES.items():
            reason = feature_skip_reason(base, feature_args)
            if reason is not None:
                log(f"  {feature_row_name(feature, base['name'])}: skipped: {reason}")
                continue
            for pas in passes:
                rows.append(dict(feature_row(base, feature, pas, timer, device, gpu_timer=gpu_timer), **stamp))
                write(rows, complete=False)
    if bases:
        log("[features] kernels per call (torch.profiler), counted after every timing")
        for row in rows:
            if "feature" in row:
                add_launch_counts(row, device)
    if args.decoder:
        from .bench_decoder import decoder_row, print_row
        log("[decoder] LTX-2.5 diffusion decoder, 121 frames at 512x768, tiled")
        row = decoder_row(device)
        print_row(row)
        rows.append(row)
    shown = merged_results({}, kept, rows, complete=True)["rows"]
    if args.features:
        print_feature_table([r for r in shown if "feature" in r])
    else:
        shown = [r for r in shown if is_shape_row(r)]
        print_table(shown)
        print_method_table(shown)
        print_speed_of_light_table(shown)
    if args.no_write:
        return 0
    write(rows, complete=True)
    log(f"wrote {path}")
    if args.features:  # the plot draws the shape rows: unchanged
        return 0
    with open(path) as f:
        all_rows = json.load(f)["rows"]
    plot([r for r in all_rows if is_shape_row(r)], os.path.join(args.out_dir, f"{slug}.png"),
         f"na3d on {name} (bf16; fwd and bwd rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
