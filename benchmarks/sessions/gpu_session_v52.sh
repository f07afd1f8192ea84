#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v39: the strided rows with NATTEN from this tree (dK/dV's 64-query
# boxes in), every method timed in two rounds taking turns, the clock logged; then, with the time left, Wan
# with its attention-free model beside dense and na3d (one round, no NATTEN; a results file of its own).
# Carry [".peers", ".whl"]. Usage: bash benchmarks/sessions/gpu_session_v52.sh <commit of this tree>
# (Ran once, at 912d2ab: step 1 as written; step 2 failed installing diffusers into --target /tmp/site, where
# .whl carries no numpy. Its install lines were changed after that run to gpu_session_v46.sh's.)
# Predictions (v43, v48; H100): forwards 24.3-27.4 ms at head dim 128 (x_sol 1.04-1.13), 5.2 at head dim 64,
# na3d at or below NATTEN's forward on every strided row with turns and medians; backwards about 105, 121 and
# 26 ms. Wan: attention-free about 290 ms against dense 642 (docs/video_dits.md's estimate).
set -u
export PYTHONUNBUFFERED=1
COMMIT=${1:-unknown}
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 500 > $OUT/clocks.csv 2>&1 &
echo "=== 1. strided rows with NATTEN, two rounds"
timeout 420 env PYTHONPATH=$PWD/.peers:$PWD/src python3 -m na3d.bench --group strided --backward --rounds 2 \
  --no-flex --no-reference --no-comfy --commit $COMMIT --out-dir $OUT > $OUT/strided_bench.log 2>&1
echo "bench rc=$? at ${SECONDS}s"; tail -24 $OUT/strided_bench.log
echo "=== 2. Wan, attention-free beside dense and na3d"
if [ $SECONDS -lt 440 ]; then
  # (as gpu_session_v46.sh: into the image's Python first, whose numpy .whl does not carry)
  python3 -m pip install -q --no-index --find-links .whl diffusers==0.42.1 > $OUT/pip.log 2>&1 \
    || python3 -m pip install -q --user --no-index --find-links .whl diffusers==0.42.1 >> $OUT/pip.log 2>&1 \
    || python3 -m pip install -q --no-index --find-links .whl --target /tmp/site diffusers==0.42.1 >> $OUT/pip.log 2>&1
  mkdir -p $OUT/wan
  timeout $((585 - SECONDS)) env PYTHONPATH=/tmp/site:$PWD/src python3 benchmarks/video_dit_bench.py --only wan \
    --no-natten --attention-free --commit $COMMIT --out-dir $OUT/wan > $OUT/wan_bench.log 2>&1
  echo "wan rc=$? at ${SECONDS}s"; tail -9 $OUT/wan_bench.log
else
  echo "skipped (at ${SECONDS}s)"
fi
echo "done at ${SECONDS}s"
