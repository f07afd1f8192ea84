#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v39: wan-1.3b-step with the attention-free model beside it (the
# time Wan spends outside self-attention, measured rather than estimated), dense, na3d (9x15x15) and na3d
# strided (8x16x16 at 2x8x8), two rounds taking turns. Carry [".whl"] (diffusers 0.42.1 and its
# dependencies for Python 3.12, as gpu_session_v44.sh).
# Usage: bash benchmarks/sessions/gpu_session_v50.sh <commit of this tree>
# Prediction (v46, H100: dense 642.0 ms, na3d 354.3, strided 323.0): attention-free about 290 ms (the estimate of
# docs/video_dits.md), so the forward's ceiling about 2.2x dense and, with attention at the box tiling's floor
# for 9x15x15 (1.83x the useful products, any box pair of 64 queries), about 1.94x: 2.0x not reachable there.
set -u
export PYTHONUNBUFFERED=1
COMMIT=${1:-unknown}
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 500 > $OUT/clocks.csv 2>&1 &
# (as gpu_session_v46.sh: into the image's Python first, whose numpy .whl does not carry)
python3 -m pip install -q --no-index --find-links .whl diffusers==0.42.1 > $OUT/pip.log 2>&1 \
  || python3 -m pip install -q --user --no-index --find-links .whl diffusers==0.42.1 >> $OUT/pip.log 2>&1 \
  || python3 -m pip install -q --no-index --find-links .whl --target /tmp/site diffusers==0.42.1 >> $OUT/pip.log 2>&1
export PYTHONPATH=/tmp/site:$PWD/src
mkdir -p $OUT/results  # a file of its own (no NATTEN here: the committed rows with NATTEN stay as they are)
timeout 540 python3 benchmarks/video_dit_bench.py --only wan --no-natten --attention-free --rounds 2 \
  --commit $COMMIT --out-dir $OUT/results > $OUT/wan_bench.log 2>&1
echo "wan rc=$? at ${SECONDS}s"; tail -9 $OUT/wan_bench.log
echo "done at ${SECONDS}s"
