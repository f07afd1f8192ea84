"""Offline tuning: measure candidate forward configs and rewrite an arch's JSON table.

    python -m na3d.tune                       # all benchmark shapes, print the table
    python -m na3d.tune --write               # ... and rewrite configs/<arch>.json

Candidates per shape are the tile pairs that issue the fewest QK^T products
(``geometry.issued_flops_ratio``), each with a few warp/stage settings. Every
candidate is first checked against the exact reference (output poisoned with NaN
before the launch); only a correct candidate is timed. For each bucket of the
table, the config with the best geometric-mean slowdown over its shapes wins.
Nothing here runs at call time: the library only reads the JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch

from . import configs, geometry, launch
from .bench import Timer, bench_shapes, log
from .reference import na3d_sdpa_exact

POW2 = (1, 2, 4, 8, 16, 32, 64)


def tile_candidates(shape, kernel, top: int) -> List[Tuple[tuple, tuple]]:
    T, H, W = shape
    q_tiles = [t for t in itertools.product(POW2, POW2, POW2) if math.prod(t) in (64, 128)
               and all(x <= max(1, 2 * L) for x, L in zip(t, shape))]
    kv_tiles = [t for t in itertools.product(POW2, POW2, POW2) if math.prod(t) in (32, 64, 128)]
    scored = []
    for qt in q_tiles:
        for kt in kv_tiles:
            fitted = configs._fit(kt, [min(L, a + K - 1) for L, a, K in zip(shape, qt, kernel)])
            if fitted != kt:
                continue
            scored.append((geometry.issued_flops_ratio(shape, kernel, qt, kt), math.prod(qt), qt, kt))
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

    # The fewest issued products overall, and the best of the two other families the
    # model cannot rank against them: 128-query boxes (half the K/V traffic per query)
    # and 32-key boxes (less padding at the union's edges).
    picked = best(top, lambda qt, kt: True)
    picked += best(2, lambda qt, kt: math.prod(qt) == 128)
    picked += best(2, lambda qt, kt: math.prod(kt) == 32)
    return list(dict.fromkeys(picked))


def measure(spec: dict, candidates: List[configs.ForwardConfig], timer: Timer, device) -> Dict[str, float]:
    """Time each candidate on one shape after checking it against the exact reference."""
    name, shape, ks = spec["name"], tuple(spec["shape"]), tuple(spec["kernel_size"])
    HD = shape[-1]
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.bfloat16, device=device) for _ in range(3))
    oracle = na3d_sdpa_exact(q.float(), k.float(), v.float(), ks)
    ref_err = (na3d_sdpa_exact(q, k, v, ks).float() - oracle).abs().max().item()
    tol = 2 * ref_err + 2 * torch.finfo(torch.bfloat16).eps * max(1.0, oracle.abs().max().item())
    times = {}
    for cfg in candidates:
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


def config_key(cfg: configs.ForwardConfig) -> str:
    return json.dumps([list(cfg.q_tile), list(cfg.kv_tile), cfg.num_warps, cfg.num_stages])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m na3d.tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*")
    parser.add_argument("--top", type=int, default=4, help="tile pairs per shape")
    parser.add_argument("--launch", nargs="*", default=["4,2", "4,3", "8,2"],
                        help="num_warps,num_stages settings to try (8 warps only on 128-query boxes)")
    parser.add_argument("--write", action="store_true", help="rewrite the arch's JSON table")
    parser.add_argument("--log", default=None, help="also write every measurement to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        log("python -m na3d.tune measures on a GPU; none found.")
        return 1
    device = torch.device("cuda")
    arch = configs.device_arch(torch.cuda.current_device())
    specs = [s for s in bench_shapes() if not args.shapes or s["name"] in args.shapes]
    launches = [tuple(int(x) for x in s.split(",")) for s in args.launch]
    table = configs.load_table(arch)
    buckets = [dict(entry) for entry in table["forward"]]

    def bucket_of(spec):
        for i, entry in enumerate(buckets):
            if configs._matches(entry.get("when", {}), spec["shape"][-1], spec["kernel_size"], torch.bfloat16):
                return i
        return None

    timer = Timer(device)
    results: Dict[str, Dict[str, float]] = {}
    for i, entry in enumerate(buckets):
        members = [s for s in specs if bucket_of(s) == i]
        if not members:
            continue
        # Every member is measured with every candidate of the bucket, so the
        # choice compares like with like.
        tiles = {(tuple(entry["q_tile"]), tuple(entry["kv_tile"]))}
        for s in members:
            tiles.update(tile_candidates(tuple(s["shape"][1:4]), tuple(s["kernel_size"]), args.top))
        candidates = [configs.ForwardConfig(qt, kt, w, st, "candidate")
                      for qt, kt in sorted(tiles) for w, st in launches
                      if w == 4 or math.prod(qt) == 128]
        log(f"bucket {entry['bucket']}: {len(candidates)} candidates on {[s['name'] for s in members]}")
        for s in members:
            results[s["name"]] = measure(s, candidates, timer, device)
            torch.cuda.empty_cache()
        names = [s["name"] for s in members]
        keys = set.intersection(*(set(results[m]) for m in names))
        best = {m: min(results[m].values()) for m in names}

        def slowdown(key):
            return math.exp(sum(math.log(results[m][key] / best[m]) for m in names) / len(names))

        choice = min(keys, key=slowdown)
        qt, kt, warps, stages = json.loads(choice)
        entry.update(q_tile=qt, kv_tile=kt, num_warps=warps, num_stages=stages)
        entry["measured"] = {m: {"ms": round(results[m][choice], 4), "best_ms": round(best[m], 4)} for m in names}
        log(f"bucket {entry['bucket']}: {choice} (geomean slowdown {slowdown(choice):.3f})")
    if args.log:
        with open(args.log, "w") as f:
            json.dump({"arch": arch, "results": results}, f, indent=1)
    table = dict(table, forward=buckets)
    text = json.dumps(table, indent=1)
    if args.write:
        path = os.path.join(os.path.dirname(__file__), "configs", f"{arch}.json")
        with open(path, "w") as f:
            f.write(text + "\n")
        log(f"wrote {path}")
    else:
        log(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
