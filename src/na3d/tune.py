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
    picked, seen_q = [], {}
    for ratio, bq, qt, kt in scored:  # at most two key tiles per query tile, for variety
        if seen_q.get(qt, 0) >= 2:
            continue
        seen_q[qt] = seen_q.get(qt, 0) + 1
        picked.append((qt, kt))
        if len(picked) >= top:
            break
    return picked


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m na3d.tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*")
    parser.add_argument("--top", type=int, default=5, help="tile pairs per shape")
    parser.add_argument("--launch", nargs="*", default=["4,2", "4,3", "8,2"],
                        help="num_warps,num_stages settings to try")
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
    timer = Timer(device)
    results: Dict[str, Dict[str, float]] = {}
    for spec in specs:
        name, shape, ks = spec["name"], tuple(spec["shape"]), tuple(spec["kernel_size"])
        B, T, H, W, NH, HD = shape
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(shape, generator=gen, dtype=torch.bfloat16, device=device) for _ in range(3))
        oracle = na3d_sdpa_exact(q.float(), k.float(), v.float(), ks)
        ref_err = (na3d_sdpa_exact(q, k, v, ks).float() - oracle).abs().max().item()
        tol = 2 * ref_err + 2 * torch.finfo(torch.bfloat16).eps * max(1.0, oracle.abs().max().item())
        results[name] = {}
        for qt, kt in tile_candidates((T, H, W), ks, args.top):
            for warps, stages in launches:
                cfg = configs.ForwardConfig(qt, kt, warps, stages, "candidate")
                key = json.dumps([list(qt), list(kt), warps, stages])
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
                    results[name][key] = float("inf")
                    continue
                ms = timer(lambda: launch.na3d_forward(q, k, v, ks, HD ** -0.5, out=out, config=cfg),
                           min_runs=10, target_ms=150)
                results[name][key] = ms
                log(f"{name} {key}: {ms:.4f} ms (err {err:.2e}, first call {time.perf_counter() - t0:.1f}s)")
        del q, k, v, oracle
        torch.cuda.empty_cache()
    if args.log:
        with open(args.log, "w") as f:
            json.dump({"arch": arch, "results": results}, f, indent=1)

    table = configs.load_table(arch)
    buckets = table["forward"]

    def bucket_of(spec):
        for i, entry in enumerate(buckets):
            if configs._matches(entry.get("when", {}), spec["shape"][-1], spec["kernel_size"], torch.bfloat16):
                return i
        return None

    new_buckets = []
    for i, entry in enumerate(buckets):
        entry = dict(entry)
        members = [s["name"] for s in specs if bucket_of(s) == i and results.get(s["name"])]
        keys = set.intersection(*(set(results[m]) for m in members)) if members else set()
        if keys:
            best = {m: min(results[m].values()) for m in members}

            def slowdown(key):
                return math.exp(sum(math.log(results[m][key] / best[m]) for m in members) / len(members))

            choice = min(keys, key=slowdown)
            qt, kt, warps, stages = json.loads(choice)
            entry.update(q_tile=qt, kv_tile=kt, num_warps=warps, num_stages=stages)
            entry["measured"] = {m: {"ms": round(results[m][choice], 4), "best_ms": round(best[m], 4)}
                                 for m in members}
            log(f"bucket {entry['bucket']}: {choice} (geomean slowdown {slowdown(choice):.3f}) over {members}")
        new_buckets.append(entry)
    table = dict(table, forward=new_buckets)
    text = json.dumps(table, indent=1)
    log(text)
    if args.write:
        path = os.path.join(os.path.dirname(__file__), "configs", f"{arch}.json")
        with open(path, "w") as f:
            f.write(text + "\n")
        log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
