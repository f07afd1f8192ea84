#!/usr/bin/env bash
# One device call, NOTES v38: v45 again with the backward choosing its tiles by products alone (the Gluon
# weight is the forward's: the aligned boxes made Wan's training step 1574 against 1367 ms in v45).
# borders clip the aligned boxes) runs the Gluon forward. Carry [".whl", ".peers"] (as gpu_session_v44.sh).
# Usage: bash benchmarks/sessions/gpu_session_v45.sh <commit of this tree>
# Prediction (H100; v44: dense 636.3 ms, na3d_strided 328.8): the strided forward's attention from about 1.25
# to 0.9 ms a block, so about 318 ms (2.0x dense); its training step about 10 ms less.
set -u
export PYTHONUNBUFFERED=1
COMMIT=${1:-unknown}
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 200 > $OUT/clocks.csv 2>&1 &
python3 -m pip install -q --no-index --find-links .whl diffusers==0.42.1 > $OUT/pip.log 2>&1 \
  || python3 -m pip install -q --user --no-index --find-links .whl diffusers==0.42.1 >> $OUT/pip.log 2>&1 \
  || python3 -m pip install -q --no-index --find-links .whl --target /tmp/site diffusers==0.42.1 >> $OUT/pip.log 2>&1
export PYTHONPATH=/tmp/site:$PWD/.peers:$PWD/src
echo "=== 2. wan-1.3b-step"
mkdir -p $OUT/results && cp benchmarks/results/h100.json $OUT/results/  # (rows merge into it)
timeout 300 python3 benchmarks/video_dit_bench.py --only wan --commit $COMMIT --out-dir $OUT/results \
  > $OUT/wan_bench.log 2>&1
echo "wan rc=$? at ${SECONDS}s"; tail -8 $OUT/wan_bench.log
echo "done at ${SECONDS}s"
