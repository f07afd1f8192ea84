#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v38 (next session): dK/dV of the head-dim-128 strided entry scanning
# 64-query boxes (sm90.json dit_large_window.strided "dkdv_q_positions": 64) against today's 128, where the
# 128 x 128 boxes spill (sm90 SASS: 93 local loads and stores per step at dit-hunyuan-s2x8x8's boxes, 110 at
# s2x8x16's; none with 64-query boxes, at 13.2 against 11.5 instructions per score). No carry needed.
# Usage: bash benchmarks/sessions/gpu_session_v48.sh
# Prediction (H100, v43: backward 103.5 and 126.8 ms): 5-15 % off both backwards; forwards unchanged.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 200 > $OUT/clocks.csv 2>&1 &
rm -rf /tmp/dkdv64 && cp -r src /tmp/dkdv64 && python3 - <<'PY'
import json
path = "/tmp/dkdv64/na3d/configs/sm90.json"
table = json.load(open(path))
for entry in table["forward"]:
    if entry["bucket"] == "dit_large_window":
        entry["strided"]["dkdv_q_positions"] = 64
open(path, "w").write(json.dumps(table, indent=1) + "\n")
PY
echo "=== 1. GPU tests of the strided paths with the variant"
timeout 200 env PYTHONPATH=/tmp/dkdv64 python3 -m pytest -q -n 4 -m gpu -k "stride or strided or block_sparse" \
  tests > $OUT/gpu_tests.log 2>&1; echo "tests rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests.log
echo "=== 2. A/B, alternating"
for round in 1 2 3; do
  for t in base:src dkdv64:/tmp/dkdv64; do
    [ $SECONDS -gt 540 ] && break
    timeout 80 env PYTHONPATH=${t#*:} python3 benchmarks/ab_gpu_time.py --tag ${t%%:*} --repeats 2 \
      --shapes dit-hunyuan-s2x8x8 dit-hunyuan-s2x8x16 >> $OUT/ab.jsonl 2>> $OUT/ab.err
    echo "ab ${t%%:*} rc=$? at ${SECONDS}s"
  done
done
python3 - <<'PY'
import json, os, statistics
runs = {}
for r in (json.loads(l) for l in open(os.path.join(os.environ["OUT"], "ab.jsonl")) if l.startswith("{")):
    runs.setdefault((r["name"], r["pass"]), {}).setdefault(r["tag"], []).append(r["gpu_ms"])
for key, tags in runs.items():
    print(key, {t: (round(statistics.median(v), 3), [round(x, 2) for x in v]) for t, v in tags.items()}, "ms")
PY
echo "done at ${SECONDS}s"
