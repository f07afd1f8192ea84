#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v37: the Gluon sm90 forward for perfectly block-sparse calls again
# (v37's first try wrote NaN: the probabilities a P V product reads from registers were not kept alive until
# its wait), then, if exact, its GPU tests and the strided rows' forwards through the API against the
# portable kernel. Make the variant tree here first:
#   .ab/gluon  this tree with sm90.json's strided entries (dit_large_window, large_window) taking the Gluon kernel,
#              sm90_gluon {"kv_positions": 64, "stages": 4}
# then run on the device carrying [".ab"].
# Prediction: dit-hunyuan-s2x8x8's forward from about 30.6 ms to 25-27 ms.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
echo "=== 1. Gluon probe"
timeout 260 env PYTHONPATH=src python3 benchmarks/sm90_gluon_probe.py --out $OUT > $OUT/gluon_probe.log 2>&1
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
