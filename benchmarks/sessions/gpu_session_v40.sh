#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v37: sm90.json's strided entries take the Gluon forward
# (dit_large_window: 128-key boxes, 3 slots; large_window: 128-key boxes, 4 slots). Carry [".peers", ".ab"]:
#   .peers         NATTEN 0.21.7 Hopper FNA (../shared/peers/README.md)
#   .ab/portable   this tree without sm90_gluon in the table (the portable kernel), for the API A/B
# Usage: bash benchmarks/sessions/gpu_session_v40.sh <commit of this tree>
# 1. GPU tests of the Gluon path and of the block-sparse kernels (now through it where the table says so);
# 2. the strided rows with NATTEN, from this tree, one process (results file h100-strided-<commit>.json);
# 3. the strided forwards through the API, Gluon against portable, alternating.
# Predictions (v39 probe, H100): dit-hunyuan-s2x8x8 forward about 26.1 ms (1.12x the speed of light) against
# NATTEN's about 27.0; s2x8x16 about 26.2 against NATTEN's 45.0; video-hd64-s4x4x8 about 5.5 ms (1.17x).
set -u
export PYTHONUNBUFFERED=1
COMMIT=${1:-unknown}
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
echo "=== 1. GPU tests"
timeout 120 env PYTHONPATH=src python3 -m pytest -q -n 4 -m gpu tests/kernels/test_sm90_forward.py \
  tests/kernels/test_block_sparse.py > $OUT/gpu_tests.log 2>&1; echo "tests rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests.log
echo "=== 2. strided rows with NATTEN"
timeout $((520 - SECONDS)) env PYTHONPATH=$PWD/.peers:$PWD/src python3 -m na3d.bench --group strided --backward \
  --no-flex --no-reference --no-comfy --commit $COMMIT --out-dir $OUT > $OUT/strided_bench.log 2>&1
echo "bench rc=$? at ${SECONDS}s"; tail -32 $OUT/strided_bench.log
echo "=== 3. strided forwards through the API"
for t in gluon:src portable:.ab/portable/src gluon:src portable:.ab/portable/src; do
  [ $SECONDS -gt 560 ] && break
  timeout 35 env PYTHONPATH=${t#*:} python3 benchmarks/ab_gpu_time.py --tag ${t%%:*} --repeats 3 --no-backward \
    --shapes dit-hunyuan-s2x8x8 dit-hunyuan-s2x8x16 video-hd64-s4x4x8 >> $OUT/ab_strided.jsonl 2>> $OUT/ab.err
  echo "ab ${t%%:*} rc=$? at ${SECONDS}s"
done
[ -f $OUT/ab_strided.jsonl ] && python3 - <<'PY'
import json, os, statistics
runs = {}
for r in (json.loads(l) for l in open(os.path.join(os.environ["OUT"], "ab_strided.jsonl")) if l.startswith("{")):
    runs.setdefault((r["name"], r["pass"]), {}).setdefault(r["tag"], []).append(r["gpu_ms"])
for key, tags in runs.items():
    print(key, {t: round(statistics.median(v), 3) for t, v in tags.items()}, "ms")
PY
echo "done at ${SECONDS}s"
