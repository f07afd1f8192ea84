#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v39: the short-window dK/dV boxes of 32 keys (v35: a third fewer
# products than today's (2,8,4)/(2,4,8), plain or dilated, if 32-row products keep two thirds of the 64-row
# rate), by the tuner on ltx-stage3 and ltx-stage4-tile; dQ also with the forward's 32-query boxes (2,4,4)/(1,8,8). Every candidate's
# gradients are checked against the float32 kernels before it is timed (CUDA-graph replay, GPU time).
# No carry needed. Usage: bash benchmarks/sessions/gpu_session_v51.sh
# Prediction: a 32-key box on 2 warps (mma.sync) at 2/3 of the 64-row rate breaks even; LTX bwd/fwd is
# 3.18-3.25 today (issue 33 asks <= 3.0): a winner 5-15 % faster on dK/dV (about 60 % of the backward) would
# bring stages 3-4 to about 3.0-3.1.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 500 > $OUT/clocks.csv 2>&1 &
timeout 560 env PYTHONPATH=src python3 -m na3d.tools.tune --buckets short_window --shapes ltx-stage3 ltx-stage4-tile \
  --no-forward --backward --graph-timing --budget-s 480 --pairs 2x4x8/4x4x4 2x4x4/1x8x8 --bwd-launch 4,2 1,3 2,3 \
  --dkdv-pairs 2x4x4/1x8x8 2x4x4/4x2x8 2x4x4/1x4x8 2x4x4/2x2x8 2x8x4/2x4x8 --dkdv-launch 2,2 2,3 4,2 1,3 4,3 \
  --log $OUT/tune.json > $OUT/tune.log 2>&1
echo "tune rc=$? at ${SECONDS}s"; grep -v "^ " $OUT/tune.log | grep -i "bucket\|wrong\|failed" | tail -20
python3 - <<'PY'
import json, os
path = os.path.join(os.environ["OUT"], "tune.json")
if os.path.exists(path):
    for key, times in json.load(open(path))["results"].items():
        best = sorted(times.items(), key=lambda kv: kv[1])[:6]
        print(key, [(k, round(v, 4)) for k, v in best])
PY
echo "done at ${SECONDS}s"
