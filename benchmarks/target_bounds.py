"""What the forward and backward targets ask of a box-tiled kernel, shape by shape.

    python benchmarks/target_bounds.py [benchmarks/results/h200.json]

Runs on the CPU from a committed results file. For every benchmark shape:

* the fewest QK^T/PV products any box pair issues (query boxes of 16, 32, 64 or 128
  queries, key boxes of 16-128 keys, power-of-two sides; ``geometry.issued_pairs_1d``
  counts a box pair's products exactly, borders included), per query-box size: a
  tensor-core product has at least 16 rows on one warp (mma.sync) and 64 on a
  warpgroup (wgmma), and every key a box scans is multiplied by every query of it;
* the rate of issued products (TFLOP/s) a kernel with those boxes needs to run
  within 1.5x of the floor, and the rate (TB/s) at which the keys and values the
  boxes scan must reach the SMs (each box loading its keys once: the best case of
  L2 hits), beside the rate na3d reaches now (its row's eager time
  and issued ratio) and the dense-attention rates measured in the same run
  (``ceilings.dense_reference``: flash = FA2, cuDNN, FlexAttention; no mask);
* the backward: its products per box pair against the forward's two (seven for the
  deterministic two-kernel backward: QK^T, dO V^T, dS K in the dQ kernel and QK^T,
  dO V^T, P^T dO, dS^T Q in the dK/dV kernel; five for any one-pass backward), and
  how much faster each product must then run than a forward product for the
  backward to take 2.5x the forward's time, against what dense attention's own
  backward does in the same run.
"""

import itertools
import json
import math
import os
import sys

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "src")]

from na3d import geometry  # noqa: E402

SIDES = (1, 2, 4, 8, 16, 32)


def boxes(sizes):
    return [b for b in itertools.product(SIDES, repeat=3) if math.prod(b) in sizes]


def fewest_issued(grid, kernel_size, queries):
    """Smallest issued/useful ratio over box pairs with ``queries`` queries per box."""
    best = (math.inf, None, None)
    for qt in boxes({queries}):
        if any(q > 2 * L for q, L in zip(qt, grid)):
            continue
        for kt in boxes({16, 32, 64, 128}):
            r = geometry.issued_flops_ratio(grid, kernel_size, qt, kt)
            if r < best[0]:
                best = (r, qt, kt)
    return best


def main(path):
    with open(path) as f:
        results = json.load(f)
    # (Feature rows, from --features, time a feature against the plain call: no floor.)
    rows = {(r["name"], r["pass"]): r for r in results["rows"] if "feature" not in r}
    dense = results["ceilings"].get("dense_reference", {})
    print(f"results: {path} (commit {results['commit'][:7]}, {results['device']})")
    print(f"ceilings: {results['ceilings']['copy_tbs']} TB/s copy, dense flash "
          f"{results['ceilings']['dense_attn_tflops']} TFLOP/s")
    for name, ref in dense.items():
        if isinstance(ref, dict) and "fwd_tflops" in ref:
            print(f"dense {name}: fwd {ref['fwd_tflops']} TFLOP/s, bwd {ref['bwd_tflops']} TFLOP/s, "
                  f"bwd/fwd {ref['bwd_over_fwd']}")
    print()
    print("Forward, within 1.5x of the floor, with the fewest products any box pair of that many queries "
          "issues: the rates needed")
    print("| shape | floor ms | 1.5x ms | 16 queries | 32 queries | 64 queries | 128 queries | na3d now |")
    print("|---|---|---|---|---|---|---|---|")
    for (name, pas), row in rows.items():
        if pas != "fwd":
            continue
        B, T, H, W, NH, HD = row["shape"]
        ks = row["kernel_size"]
        useful = 4.0 * B * T * H * W * NH * HD * math.prod(ks)
        target_s = 1.5 * row["floor_ms"] * 1e-3
        cells = []
        for queries in (16, 32, 64, 128):
            ratio, qt, kt = fewest_issued((T, H, W), ks, queries)
            # Each box loads the keys and values it scans once (from L2 at best):
            # issued pairs / queries per box keys, HD elements each, K and V, 2 bytes.
            kv_bytes = ratio * B * T * H * W * NH * math.prod(ks) / queries * HD * 2 * 2
            cells.append(f"{ratio:.2f}: {useful * ratio / target_s / 1e12:.0f}, {kv_bytes / target_s / 1e12:.1f}")
        issued = row["flops_issued_ratio"]
        now_s = row["ms"]["na3d"] * 1e-3
        queries_now = math.prod(row["config"]["q_tile"])
        kv_now = issued * B * T * H * W * NH * math.prod(ks) / queries_now * HD * 2 * 2
        print(f"| {name} | {row['floor_ms']:.4f} | {1.5 * row['floor_ms']:.4f} | " + " | ".join(cells)
              + f" | {queries_now} queries, {issued:.2f}: {useful * issued / now_s / 1e12:.0f}, "
                f"{kv_now / now_s / 1e12:.1f} |")
    print("(cells: fewest issued/useful, then the issued rate needed in TFLOP/s and the rate in TB/s at which "
          "the boxes' K/V loads must reach the SMs; na3d now: its boxes, issued ratio and the two rates its eager time gives)")
    print()
    print("Backward within 2.5x of the forward: each backward product's speed against a forward product's")
    print("| shape | bwd/fwd now | two kernels (7 products): needed | now | one pass (5): needed |")
    print("|---|---|---|---|---|")
    for (name, pas), row in rows.items():
        fwd = rows.get((name, "fwd"))
        if pas != "bwd" or not fwd:
            continue
        now = row["ms"]["na3d"] / fwd["ms"]["na3d"]
        print(f"| {name} | {now:.2f} | {3.5 / 2.5:.2f}x | {3.5 / now:.2f}x | {2.5 / 2.5:.2f}x |")
    for name, ref in dense.items():
        if isinstance(ref, dict) and "bwd_over_fwd" in ref:
            print(f"dense {name} (one pass, 5 products): bwd/fwd {ref['bwd_over_fwd']}, each backward product "
                  f"at {2.5 / ref['bwd_over_fwd']:.2f}x a forward product's speed")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "results", "h200.json"))
