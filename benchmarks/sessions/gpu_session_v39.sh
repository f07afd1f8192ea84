#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v37: the Gluon sm90 forward with the two warpgroups taking turns
# at the tensor cores ("ping-pong": v38's kernel, exact, ran them in step and ended level with the portable
# kernel at head dim 128, 0.90x at head dim 64), the lagging warpgroup issuing the copies, up to 6 slots.
# benchmarks/sm90_gluon_probe.py: exactness against the float64 oracle, then GPU time of every (key box,
# slots, ping-pong on/off) that fits against the portable kernel; then the GPU tests and the strided rows'
# forwards through the API. Make the variant tree here first:
#   .ab/gluon  this tree with sm90.json's strided entries taking the Gluon kernel: dit_large_window
#              {"kv_positions": 64, "stages": 6}, large_window {"kv_positions": 128, "stages": 6}
# then run on the device carrying [".ab"].
# Prediction (v37's cycle count: per step and SM, 1.12 us of products at the tensor cores' peak, about 0.45
# us of softmax per warpgroup): with the softmax of one warpgroup under the other's products, dit-hunyuan's
# strided forwards from about 29-30 ms to 20-24 ms; ping-pong off about as v38 (29-30 ms).
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
echo "=== 1. Gluon probe"
timeout 300 env PYTHONPATH=src python3 benchmarks/sm90_gluon_probe.py --out $OUT > $OUT/gluon_probe.log 2>&1
echo "probe rc=$? at ${SECONDS}s"; cut -c1-600 $OUT/gluon_probe.log | grep -v Traceback | tail -40
if grep -q '"exact": true' $OUT/gluon_probe.log; then
  echo "=== 2. GPU tests"
  timeout 150 env PYTHONPATH=.ab/gluon/src python3 -m pytest -q -n 4 -m gpu tests/kernels/test_sm90_forward.py \
    > $OUT/sm90_tests.log 2>&1; echo "tests rc=$? at ${SECONDS}s"; tail -3 $OUT/sm90_tests.log
  echo "=== 3. strided forwards through the API"
  for round in 1 2; do
    for t in gluon:.ab/gluon/src portable:src; do
      [ $SECONDS -gt 540 ] && break
      timeout 60 env PYTHONPATH=${t#*:} python3 benchmarks/ab_gpu_time.py --tag ${t%%:*} --repeats 3 --no-backward \
        --shapes dit-hunyuan-s2x8x8 dit-hunyuan-s2x8x16 video-hd64-s4x4x8 >> $OUT/ab_strided.jsonl 2>> $OUT/ab.err
      echo "ab ${t%%:*} rc=$? at ${SECONDS}s"
    done
  done
  python3 - <<'PY'
import json, os, statistics
path = os.path.join(os.environ["OUT"], "ab_strided.jsonl")
runs = {}
for r in (json.loads(l) for l in open(path) if l.startswith("{")):
    runs.setdefault((r["name"], r["pass"]), {}).setdefault(r["tag"], []).append(r["gpu_ms"])
for key, tags in runs.items():
    print(key, {t: round(statistics.median(v), 3) for t, v in tags.items()}, "ms")
PY
fi
echo "done at ${SECONDS}s"
