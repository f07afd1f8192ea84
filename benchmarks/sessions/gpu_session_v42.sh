#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v38: the Gluon forward's softmax reductions as trees, the loading
# warpgroup's refill after its products, the window sizes as compile-time constants. Carry [".ab"]:
#   .ab/old   the tree before (92fa627: runtime window sizes, chained reductions, refill before the products)
# Usage: bash benchmarks/sessions/gpu_session_v42.sh
# Predictions (H100, dit-hunyuan-s2x8x8, v39: 26.06 ms): the window as constants 0-1 % (the loading warpgroup's
# loop 633 -> 564 instructions, mostly uniform-pipe integer work); late refill 0-2 %; tree reductions 5-10 %
# (the row max and sum were two chains of 31 dependent instructions each per row, about 300 cycles of each
# warpgroup's 3450-cycle step on its own path to the next products).
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
VARIANTS=("" "TREE=1" "LATE_REFILL=1" "TREE=1,LATE_REFILL=1" "TREE=1,LATE_REFILL=1,PINGPONG=0")  # (switches of f88281e)
echo "=== 1. probe: exactness of every variant, then their times (this tree)"
timeout 330 env PYTHONPATH=src python3 benchmarks/sm90_gluon_probe.py --out $OUT --variants "${VARIANTS[@]}" \
  > $OUT/gluon_probe.log 2>&1
echo "probe rc=$? at ${SECONDS}s"; grep -c '"check": "ok"' $OUT/gluon_probe.log; grep '"FAIL"\|exact\|Error' $OUT/gluon_probe.log | cut -c1-400
echo "=== 2. the tree before (its kernel as it was), same rows"
mkdir -p $OUT/old
timeout $((470 - SECONDS)) env PYTHONPATH=.ab/old/src python3 .ab/old/benchmarks/sm90_gluon_probe.py --out $OUT/old \
  --skip-check --variants "" > $OUT/gluon_probe_old.log 2>&1
echo "old probe rc=$? at ${SECONDS}s"
echo "=== 3. GPU tests of the Gluon path"
timeout $((570 - SECONDS)) env PYTHONPATH=src python3 -m pytest -q -n 4 -m gpu tests/kernels/test_sm90_forward.py \
  > $OUT/sm90_tests.log 2>&1; echo "tests rc=$? at ${SECONDS}s"; tail -3 $OUT/sm90_tests.log
python3 - <<'PY'
import json, os, statistics
runs = {}
for path in ("sm90_gluon_probe.jsonl", "old/sm90_gluon_probe.jsonl"):
    full = os.path.join(os.environ["OUT"], path)
    if not os.path.exists(full):
        continue
    tag = "old" if path.startswith("old") else "new"
    for r in (json.loads(l) for l in open(full) if l.startswith("{")):
        if "gpu_ms" not in r or "round" not in r:
            continue
        key = r.get("variant", "launcher af" if r.get("assume_finite") else "launcher default")
        runs.setdefault(r["row"], {}).setdefault(f"{tag} {key}", []).append((r["gpu_ms"], r["x_sol"]))
for row, variants in runs.items():
    print(row)
    for key, vals in variants.items():
        print(f"  {key:45s} {statistics.median(v for v, _ in vals):8.3f} ms  x_sol {statistics.median(x for _, x in vals):.3f}  {[round(v, 3) for v, _ in vals]}")
PY
echo "done at ${SECONDS}s"
