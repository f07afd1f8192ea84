"""Offline tuning: measure candidate configs and rewrite an arch's JSON table.

    python -m na3d.tools.tune                       # forward, all benchmark shapes, print the table
    python -m na3d.tools.tune --write               # ... and rewrite configs/<arch>.json
    python -m na3d.tools.tune --backward --write    # also the backward kernels' tiles
    python -m na3d.tools.tune --budget-s 60         # at most ~60 s of candidates per bucket and pass
    python -m na3d.tools.tune --buckets medium_window --backward --graph-timing   # GPU time only
    python -m na3d.tools.tune --shapes dit-hunyuan --backward --pairs 2x8x4/2x4x4 --dkdv-pairs 4x4x4/2x4x4
                                                    # given candidates (see benchmarks/tune_dit.sh)

Candidates per shape are the tile pairs that issue the fewest QK^T products
(``geometry.issued_flops_ratio``; dK/dV's by its own count,
``geometry.issued_flops_ratio(..., own="keys")``), each with a few warp/stage settings. Every
candidate is first checked (outputs poisoned with NaN before the launch): the
forward against the exact reference, the backward against the float32 kernels'
gradients (themselves tested against the float64 oracle), with a tolerance of
twice the error of the table's current bf16 config plus a rounding band. Only a
correct candidate is timed. For each bucket of the table, the config with the
best geometric-mean slowdown over its shapes wins. The backward is tuned in two
steps: dQ tiles with the dK/dV tiles fixed, then dK/dV with the chosen dQ.
The table is rewritten after every bucket, so a time limit loses nothing done.
Nothing here runs at call time: the library only reads the JSON.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch

from .. import configs, geometry, launch
from ..device import device_arch
from ..reference import na3d_sdpa_exact
from .common import Timer, bench_shapes, log

POW2 = (1, 2, 4, 8, 16, 32, 64)


def launch_fits(rows: int, num_warps: int) -> bool:
    """Which warp counts to try for a box of ``rows`` queries (or keys, in dK/dV):
    4 warps for any box; 8 only for 128 rows (two of Hopper's 64-row warpgroup
    products); 1-2 only for boxes of at most 32 rows, which run as mma.sync tiles
    of 16 rows per warp instead of warpgroup products."""
    return num_warps == 4 or (num_warps == 8 and rows == 128) or (num_warps < 4 and rows <= 32)


def tile_candidates(shape, kernel, top: int, issued=geometry.issued_flops_ratio) -> List[Tuple[tuple, tuple]]:
    """Box pairs ``(own box, scanned box)`` that issue the fewest products by ``issued``
    (``issued(shape, kernel, own, scanned)``): the forward's and dQ's count (query boxes
    scanning keys) by default, :func:`dkdv_tile_candidates` for dK/dV's (key boxes
    scanning queries), plus the best of a few box families."""
    q_tiles = [t for t in itertools.product(POW2, POW2, POW2) if math.prod(t) in (32, 64, 128)
               and all(x <= max(1, 2 * L) for x, L in zip(t, shape))]
    kv_tiles = [t for t in itertools.product(POW2, POW2, POW2) if math.prod(t) in (32, 64, 128)]
    scored = []
    for qt in q_tiles:
        for kt in kv_tiles:
            fitted = configs.fit_tile(kt, [min(L, a + K - 1) for L, a, K in zip(shape, qt, kernel)])
            if fitted != kt:
                continue
            scored.append((issued(shape, kernel, qt, kt), math.prod(qt), qt, kt))
    scored.sort()

    def best(n, keep):
        picked, seen_q = [], {}
        for ratio, bq, qt, kt in scored:  # at most two key boxes per query box, for variety
            if not keep(qt, kt) or seen_q.get(qt, 0) >= 2:
                continue
            seen_q[qt] = seen_q.get(qt, 0) + 1
            picked.append((qt, kt))
            if len(picked) >= n:
                break
        return picked

    # The fewest issued products overall (small boxes win that count), and the best
    # of the families the model cannot rank against them: 64- and 128-query boxes
    # (less K/V traffic per query, fuller tensor-core tiles), 32-key boxes (less
    # padding at the union's edges) and 32-query boxes with 64-key boxes.
    picked = best(top, lambda qt, kt: True)
    picked += best(2, lambda qt, kt: math.prod(qt) == 64)
    picked += best(2, lambda qt, kt: math.prod(qt) == 128)
    picked += best(2, lambda qt, kt: math.prod(kt) == 32)
    # 32-query boxes (mma.sync with 1-2 warps) with 64-key boxes: fewer steps, each
    # with the same fixed cost, than the 32-key boxes the count above prefers.
    picked += best(2, lambda qt, kt: math.prod(qt) == 32 and math.prod(kt) == 64)
    return list(dict.fromkeys(picked))


def dkdv_tile_candidates(shape, kernel, top: int) -> List[Tuple[tuple, tuple]]:
    """dK/dV's candidates ``(key box, query box)``, ranked by the products that kernel
    issues (``geometry.issued_flops_ratio(..., own="keys")``), not by the forward's count of the
    swapped pair: the two differ (on dit-wan the table's 4x4x8/2x4x8 issues 3.10 per
    useful product where the swapped count says 2.79; NOTES v48)."""
    return tile_candidates(shape, kernel, top, functools.partial(geometry.issued_flops_ratio, own="keys"))


def tile_pair(text: str) -> Tuple[tuple, tuple]:
    """``"2x8x4/2x4x4"`` -> ``((2, 8, 4), (2, 4, 4))`` (command-line tile pairs)."""
    try:
        boxes = tuple(tuple(int(x) for x in box.split("x")) for box in text.split("/"))
    except ValueError:
        boxes = ()
    if len(boxes) != 2 or any(len(b) != 3 or any(x < 1 or x & (x - 1) for x in b) for b in boxes):
        raise argparse.ArgumentTypeError(f"{text!r}: expected two boxes of three powers of two, like 2x8x4/2x4x4")
    return boxes


class Budget:
    """Wall-clock budget for trying candidates; the current table's config is always tried."""

    def __init__(self, seconds: Optional[float]):
        self.deadline = None if seconds is None else time.perf_counter() + seconds

    def spent(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline

    def tried(self, candidates: list, name: str):
        """``candidates`` in order while the budget lasts; the first (the current config) always."""
        for i, cfg in enumerate(candidates):
            if i > 0 and self.spent():
                log(f"{name}: time budget spent, {len(candidates) - i} candidates not tried")
                return
            yield cfg


def _inputs(spec: dict, device):
    shape = tuple(spec["shape"])
    gen = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(shape, generator=gen, dtype=torch.bfloat16, device=device) for _ in range(4)]



def measure(spec: dict, candidates: List[configs.ForwardConfig], timer: Timer, device,
            budget: Budget) -> Dict[str, float]:
    """Time each forward candidate on one shape after checking it against the exact reference."""
    name, ks = spec["name"], tuple(spec["kernel_size"])
    q, k, v, _ = _inputs(spec, device)
    HD = q.shape[-1]
    oracle = na3d_sdpa_exact(q.float(), k.float(), v.float(), ks)
    ref_err = (na3d_sdpa_exact(q, k, v, ks).float() - oracle).abs().max().item()
    tol = 2 * ref_err + 2 * torch.finfo(torch.bfloat16).eps * max(1.0, oracle.abs().max().item())
    times = {}
    for cfg in budget.tried(candidates, name):
        key = config_key(cfg)
        out = torch.full_like(q, float("nan"))
        t0 = time.perf_counter()
        try:
            launch.na3d_forward(q, k, v, ks, HD ** -0.5, out=out, config=cfg)
            torch.cuda.synchronize()
        except Exception as exc:  # e.g. out of shared memory for this tile
            log(f"{name} {key}: failed to run: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        err = (out.float() - oracle).abs().max().item()
        if not err <= tol:
            log(f"{name} {key}: WRONG, max abs error {err:.3e} > {tol:.3e}")
            times[key] = float("inf")
            continue
        times[key] = timer(lambda: launch.na3d_forward(q, k, v, ks, HD ** -0.5, out=out, config=cfg),
                           min_runs=10, target_ms=100)
        log(f"{name} {key}: {times[key]:.4f} ms (err {err:.2e}, first call {time.perf_counter() - t0:.1f}s)")
    return times


def measure_backward(spec: dict, candidates: List[configs.BackwardConfig], current: configs.BackwardConfig,
                     timer: Timer, device, budget: Budget, fit=None, fit_spec=None) -> Dict[str, float]:
    """Time each backward candidate (both kernels) on one shape after checking its gradients.

    Results are keyed by the candidate as given; it runs fitted to the shape when
    ``fit`` is given (``fit(dq, dkdv, spec)``, as the table's lookup will fit it).
    """
    name, ks = spec["name"], tuple(spec["kernel_size"])
    q, k, v, grad_out = _inputs(spec, device)
    scale = q.shape[-1] ** -0.5
    # Oracle: the float32 kernels (IEEE products), fed the same bf16 values.
    q32, k32, v32, do32 = (t.float() for t in (q, k, v, grad_out))
    out32, lse32 = launch.na3d_forward(q32, k32, v32, ks, scale, return_lse=True)
    oracle = launch.na3d_backward(do32, q32, k32, v32, out32, lse32, ks, scale)
    del q32, k32, v32, do32, out32, lse32
    out, lse = launch.na3d_forward(q, k, v, ks, scale, return_lse=True)

    def errors(cfg):
        grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
        launch.na3d_backward(grad_out, q, k, v, out, lse, ks, scale, grads=grads, config=cfg)
        return [(g.float() - o).abs().max().item() for g, o in zip(grads, oracle)]

    base = errors(current)
    tol = [2 * e + 2 * torch.finfo(torch.bfloat16).eps * max(1.0, o.abs().max().item()) for e, o in zip(base, oracle)]
    times = {}
    for cfg in budget.tried(candidates, name):
        key = backward_key(cfg)
        if fit is not None:
            cfg = fit((cfg.dq_q_tile, cfg.dq_kv_tile, cfg.num_warps, cfg.num_stages),
                      (cfg.dkdv_k_tile, cfg.dkdv_q_tile, cfg.dkdv_warps, cfg.dkdv_stages, cfg.fused), fit_spec)
        t0 = time.perf_counter()
        try:
            errs = errors(cfg)
        except Exception as exc:  # e.g. out of shared memory for this tile
            log(f"{name} bwd {key}: failed to run: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        if not all(e <= t for e, t in zip(errs, tol)):
            log(f"{name} bwd {key}: WRONG, max abs errors {errs} > {tol}")
            times[key] = float("inf")
            continue
        grads = tuple(torch.empty_like(t) for t in (q, k, v))
        times[key] = timer(lambda: launch.na3d_backward(grad_out, q, k, v, out, lse, ks, scale, grads=grads,
                                                        config=cfg), min_runs=5, target_ms=100)
        log(f"{name} bwd {key}: {times[key]:.4f} ms (errs {[f'{e:.1e}' for e in errs]}, "
            f"first call {time.perf_counter() - t0:.1f}s)")
    return times


def timing_method(timer: Timer) -> str:
    """How the table's ``measured`` times were taken (``--graph-timing`` or not)."""
    return "GPU time, CUDA-graph replay" if timer.graphs else "eager, L2 flushed"


def config_key(cfg: configs.ForwardConfig) -> str:
    return json.dumps([list(cfg.q_tile), list(cfg.kv_tile), cfg.num_warps, cfg.num_stages, cfg.tma, cfg.maxnreg,
                       cfg.fixed_mask])


def backward_key(cfg: configs.BackwardConfig) -> str:
    return json.dumps({"dq": [list(cfg.dq_q_tile), list(cfg.dq_kv_tile)],
                       "dkdv": [list(cfg.dkdv_k_tile), list(cfg.dkdv_q_tile)],
                       "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                       "dkdv_num_warps": cfg.dkdv_warps, "dkdv_num_stages": cfg.dkdv_stages, "tma": cfg.tma,
                       **{name: getattr(cfg, name) for name in ("dq_maxnreg", "dkdv_maxnreg")
                          if getattr(cfg, name) is not None},
                       **({} if cfg.fixed_mask else {"fixed_mask": False}),
                       **{name: getattr(cfg, name) for name in ("split_full", "dkdv_split_full")
                          if getattr(cfg, name) is not None},
                       **{name: True for name in ("redo_in_program", "dkdv_redo_in_program") if getattr(cfg, name)},
                       **({"dkdv_head_split": cfg.dkdv_head_split} if cfg.dkdv_head_split != 1 else {}),
                       **({"fused": True} if cfg.fused else {})})


def choose(results: Dict[str, Dict[str, float]], names: List[str]) -> Tuple[str, float, Dict[str, float]]:
    """The key with the best geometric-mean slowdown over ``names`` (keys all of them measured)."""
    keys = set.intersection(*(set(results[m]) for m in names))
    best = {m: min(results[m].values()) for m in names}

    def slowdown(key):
        return math.exp(sum(math.log(results[m][key] / best[m]) for m in names) / len(names))

    choice = min(keys, key=slowdown)
    return choice, slowdown(choice), best


def tune_forward(entry: dict, members: List[dict], args, timer, device, budget) -> Dict[str, Dict[str, float]]:
    launches = [tuple(int(x) for x in s.split(",")) for s in args.launch]
    if "maxnreg" in entry and "maxnreg_when" in entry and not args.maxnreg:
        # The table's cap holds for some calls only; every candidate runs with it, so the
        # bucket is tuned on the members it holds for (--maxnreg tunes them all).
        held = [s for s in members if configs.matches(entry["maxnreg_when"], s["shape"][-1],
                                                      s["kernel_size"], torch.bfloat16)]
        log(f"bucket {entry['bucket']} forward: its register cap holds for {[s['name'] for s in held]} only; "
            f"tuning on those (--maxnreg to tune every member)")
        members = held
        if not members:
            return {}
    # Every member is measured with every candidate of the bucket, so the choice
    # compares like with like. The table's current config goes first.
    current = (tuple(entry["q_tile"]), tuple(entry["kv_tile"]))
    tiles = set(args.pairs or ())
    if not tiles:
        for s in members:
            tiles.update(tile_candidates(tuple(s["shape"][1:4]), tuple(s["kernel_size"]), args.top))
    tiles.discard(current)
    # Each with key/value boxes loaded through tensor descriptors and through pointers.
    # Register caps: those of --maxnreg (0: none), else the table's own.
    # The table's own tiles also with the mask computed on every step (fixed_mask
    # flipped); other tiles with the default (fixed where the geometry allows).
    tma = entry.get("tma", True)
    fixed = bool(entry.get("fixed_mask", True))
    caps = [c or None for c in args.maxnreg] if args.maxnreg else [entry.get("maxnreg")]
    # The table's split_full and redo_in_program (not searched) go with every candidate:
    # they stay in the entry, so the times must be those of the kernels the table will run.
    split = entry.get("split_full")
    redo = bool(entry.get("redo_in_program", False))
    candidates = [configs.ForwardConfig(*current, entry["num_warps"], entry["num_stages"], "candidate", flag, cap,
                                        fixed_flag, split, redo)
                  for flag in ((tma,) if args.tma_only else (tma, not tma)) for cap in caps
                  for fixed_flag in (fixed, not fixed)]
    loads = (True,) if args.tma_only else (True, False)
    candidates += [configs.ForwardConfig(qt, kt, w, st, "candidate", flag, cap, split_full=split, redo_in_program=redo)
                   for qt, kt in sorted(tiles) for w, st in launches for flag in loads for cap in caps
                   if launch_fits(math.prod(qt), w)]
    log(f"bucket {entry['bucket']} forward: {len(candidates)} candidates on {[s['name'] for s in members]}")
    results = {}
    for s in members:
        results[s["name"]] = measure(s, candidates, timer, device, budget)
        torch.cuda.empty_cache()
    names = [s["name"] for s in members]
    choice, slow, best = choose(results, names)
    qt, kt, warps, stages, tma, cap, fixed = json.loads(choice)
    entry.update(q_tile=qt, kv_tile=kt, num_warps=warps, num_stages=stages, tma=tma)
    if cap is None:
        entry.pop("maxnreg", None)
    else:
        entry["maxnreg"] = cap
    if fixed:
        entry.pop("fixed_mask", None)
    else:
        entry["fixed_mask"] = False
    entry["measured"] = {m: {"ms": round(results[m][choice], 4), "best_ms": round(best[m], 4),
                             "timing": timing_method(timer)} for m in names}
    log(f"bucket {entry['bucket']} forward: {choice} (geomean slowdown {slow:.3f})")
    return results


def tune_backward(entry: dict, members: List[dict], arch: str, args, timer, device,
                  budget) -> Dict[str, Dict[str, float]]:
    """Two steps on the bucket's shapes: dQ tiles (dK/dV fixed), then dK/dV tiles.
    Only the shapes its backward's own ``when`` holds for (the others take a later
    bucket's backward: ``configs.backward_config``); the entry written keeps it."""
    when = (entry.get("backward") or {}).get("when", {})
    members = [s for s in members if configs.matches(when, s["shape"][-1], s["kernel_size"], torch.bfloat16)]
    if not members:
        return {}
    names = [s["name"] for s in members]
    launches = [tuple(int(x) for x in s.split(",")) for s in args.bwd_launch]
    dkdv_launches = [tuple(int(x) for x in s.split(",")) for s in (args.dkdv_launch
                                                                   or args.bwd_launch)]

    def current_for(spec):
        shape = tuple(spec["shape"])
        return configs.backward_config(arch, shape[1:4], tuple(spec["kernel_size"]), shape[-1], torch.bfloat16)

    configs.load_table.cache_clear()
    configs.forward_config.cache_clear()
    configs.backward_config.cache_clear()
    pairs, key_pairs = set(), set()
    for s in members:
        pairs.update(tile_candidates(tuple(s["shape"][1:4]), tuple(s["kernel_size"]), args.top))
        key_pairs.update(dkdv_tile_candidates(tuple(s["shape"][1:4]), tuple(s["kernel_size"]), args.top))
    dq_pairs = sorted(args.pairs or pairs)
    dkdv_pairs = sorted(args.dkdv_pairs or key_pairs)
    # The table's current backward, as it states it (unfitted; each shape fits it).
    bwd = entry.get("backward")
    if bwd is None:  # derived from the forward's tiles (configs.backward_config)
        stages = max(1, entry["num_stages"] - 1)
        dq_now = (tuple(entry["q_tile"]), tuple(entry["kv_tile"]), entry["num_warps"], stages)
        dkdv_now = dq_now
    else:
        dq_now = (tuple(bwd["dq"][0]), tuple(bwd["dq"][1]), bwd["num_warps"], bwd["num_stages"])
        dkdv_now = (tuple(bwd["dkdv"][0]), tuple(bwd["dkdv"][1]), bwd.get("dkdv_num_warps", bwd["num_warps"]),
                    bwd.get("dkdv_num_stages", bwd["num_stages"]))

    # Register caps, the descriptor flag, fixed_mask and the splits are kept as the table
    # states them (not searched here): every candidate runs with them, and the entry written keeps them.
    caps = {name: bwd[name] for name in ("dq_maxnreg", "dkdv_maxnreg", "dkdv_split_full", "dkdv_redo_in_program",
                                         "dkdv_head_split") if bwd and bwd.get(name) is not None}
    caps["tma"] = bool((bwd or entry).get("tma", True))
    if not (bwd or entry).get("fixed_mask", True):
        caps["fixed_mask"] = False
    for name in ("split_full", "redo_in_program"):  # (a derived backward's dQ takes the forward's)
        if (bwd or entry).get(name) is not None:
            caps[name] = (bwd or entry)[name]

    def as_config(dq, dkdv, spec=None):
        """A candidate as a config: as the table will state it, or fitted to ``spec``'s shape.
        ``dkdv``: (key box, query box, warps, stages[, fused])."""
        fused = len(dkdv) > 4 and bool(dkdv[4])
        entry_form = {"dq": [list(dq[0]), list(dq[1])], "dkdv": [list(dkdv[0]), list(dkdv[1])],
                      "num_warps": dq[2], "num_stages": dq[3], "dkdv_num_warps": dkdv[2], "dkdv_num_stages": dkdv[3],
                      **caps, **({"fused": True} if fused else {})}
        if spec is None:
            return configs.BackwardConfig(dq[0], dq[1], dkdv[0], dkdv[1], dq[2], dq[3], "candidate", dkdv[2], dkdv[3],
                                          fused, **caps)
        return configs.fit_backward(entry_form, tuple(spec["shape"][1:4]), tuple(spec["kernel_size"]), "candidate")

    def step(kernel: str, now, make_config, pairs, launches, fused=(False,)):
        """Measure ``now`` and every other candidate of one kernel's (tiles, warps, stages)
        on each shape of the bucket, as configs ``make_config(candidate)``; pick one.
        ``fused=(False, True)``: dK/dV candidates also as the one-pass backward."""
        options = [now] + [(a, b, w, st) + ((True,) if f else ()) for a, b in pairs for w, st in launches
                           for f in fused if launch_fits(math.prod(a), w) and ((a, b, w, st) != now or f)]
        log(f"bucket {entry['bucket']} backward {kernel}: {len(options)} candidates on {names}")
        times = {}
        for s in members:
            cands = [make_config(option) for option in options]
            times[s["name"]] = measure_backward(s, cands, current_for(s), timer, device, budget, as_config, s)
            torch.cuda.empty_cache()
        return times, *choose(times, names)

    step1, choice, slow, _ = step("dQ", dq_now, lambda dq: as_config(dq, dkdv_now), dq_pairs, launches)
    picked = json.loads(choice)
    dq_best = (tuple(picked["dq"][0]), tuple(picked["dq"][1]), picked["num_warps"], picked["num_stages"])
    log(f"bucket {entry['bucket']} backward dQ: {choice} (geomean slowdown {slow:.3f})")
    step2, choice, slow, best = step("dK/dV", dkdv_now, lambda dkdv: as_config(dq_best, dkdv), dkdv_pairs,
                                      dkdv_launches,
                                      (False, True) if args.fused else (False,))
    picked = json.loads(choice)
    before = backward_key(as_config(dq_now, dkdv_now))
    entry["backward"] = dict(({"when": when} if when else {}), **picked, measured={
        m: {"ms": round(step2[m][choice], 4), "best_ms": round(best[m], 4),
            "before_ms": round(step1[m].get(before, float("nan")), 4), "timing": timing_method(timer)}
        for m in names})
    for name in ("dq_alternatives", "dkdv_alternatives"):
        if bwd and bwd.get(name):
            # Not searched here (each candidate runs as one pair): kept, and taken per call
            # where they issue fewer products than the pair picked (configs.fit_backward).
            entry["backward"][name] = bwd[name]
    log(f"bucket {entry['bucket']} backward: {choice} (geomean slowdown {slow:.3f})")
    results: Dict[str, Dict[str, float]] = {}
    for m in names:
        results[m + "/dq"] = step1[m]
        results[m + "/dkdv"] = step2[m]
    return results


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m na3d.tools.tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*")
    parser.add_argument("--buckets", nargs="*", help="only these buckets of the table")
    parser.add_argument("--top", type=int, default=4, help="tile pairs per shape")
    parser.add_argument("--launch", nargs="*", default=["4,2", "4,3", "8,2"],
                        help="forward num_warps,num_stages settings to try (8 warps only on 128-query boxes, "
                             "1-2 warps only on boxes of at most 32 queries)")
    parser.add_argument("--bwd-launch", nargs="*", default=["4,1", "4,2", "4,3", "8,1"],
                        help="the same for the backward kernels (the dK/dV kernel's rows are its key box; "
                             "the sm90 table's dK/dV runs 3 stages)")
    parser.add_argument("--pairs", nargs="*", type=tile_pair, default=None, metavar="QxQxQ/KxKxK",
                        help="try these (query box, key box) pairs instead of the geometry's best (forward, dQ)")
    parser.add_argument("--dkdv-pairs", nargs="*", type=tile_pair, default=None, metavar="KxKxK/QxQxQ",
                        help="try these (key box, query box) pairs for dK/dV instead of the geometry's best")
    parser.add_argument("--fused", action="store_true",
                        help="also try each dK/dV candidate as the one-pass backward (dQ by atomic adds; not "
                             "deterministic, and overridden by torch.use_deterministic_algorithms)")
    parser.add_argument("--tma-only", action="store_true",
                        help="new forward candidates load through tensor descriptors only (not also through "
                             "pointers)")
    parser.add_argument("--dkdv-launch", nargs="*", default=None,
                        help="num_warps,num_stages settings for the dK/dV kernel alone (default: --bwd-launch's)")
    parser.add_argument("--maxnreg", nargs="*", type=int, default=None,
                        help="forward register caps to try with every candidate (0: none); default: the table's")
    parser.add_argument("--no-forward", action="store_true", help="keep the forward tiles as they are")
    parser.add_argument("--backward", action="store_true", help="also tune the backward kernels' tiles")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="per bucket and pass (forward, backward): stop trying new candidates after this "
                             "many seconds and keep the best so far")
    parser.add_argument("--graph-timing", action="store_true",
                        help="time candidates as CUDA-graph replays, GPU time only (tools.common.Timer): for "
                             "latency-bound shapes whose host overhead per call exceeds their kernels")
    parser.add_argument("--write", action="store_true", help="rewrite the arch's JSON table")
    parser.add_argument("--log", default=None, help="also write every measurement to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        log("python -m na3d.tools.tune measures on a GPU; none found.")
        return 1
    device = torch.device("cuda", torch.cuda.current_device())
    arch = device_arch(device)
    # Default: the LTX shapes; --shapes may name any, the video-DiT ones included.
    specs = bench_shapes("all") if args.shapes else bench_shapes()
    specs = [s for s in specs if not args.shapes or s["name"] in args.shapes]
    table = configs.load_table(arch)
    buckets = [dict(entry) for entry in table["forward"]]
    path = os.path.join(os.path.dirname(configs.__file__), "configs", f"{arch}.json")

    def bucket_of(spec):
        for i, entry in enumerate(buckets):
            if configs.matches(entry.get("when", {}), spec["shape"][-1], spec["kernel_size"], torch.bfloat16):
                return i
        return None

    def save():
        text = json.dumps(dict(table, forward=buckets), indent=1)
        if args.write:
            with open(path, "w") as f:
                f.write(text + "\n")
            configs.load_table.cache_clear()
            configs.forward_config.cache_clear()
            configs.backward_config.cache_clear()
            log(f"wrote {path}")
        return text

    timer = Timer(device, graphs=args.graph_timing)
    results: Dict[str, Dict[str, float]] = {}
    for i, entry in enumerate(buckets):
        members = [s for s in specs if bucket_of(s) == i]
        if not members or (args.buckets and entry["bucket"] not in args.buckets):
            continue
        if not args.no_forward:
            results.update(tune_forward(entry, members, args, timer, device, Budget(args.budget_s)))
            save()
        if args.backward:
            results.update({f"{k} (bwd)": v for k, v in
                            tune_backward(entry, members, arch, args, timer, device, Budget(args.budget_s)).items()})
            save()
        if args.log:
            with open(args.log, "w") as f:
                json.dump({"arch": arch, "results": results}, f, indent=1)
    text = save()
    if not args.write:
        log(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
