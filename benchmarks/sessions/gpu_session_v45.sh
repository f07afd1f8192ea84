#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v38: the table weighs the Gluon kernel's products (product_cost
# 0.85 in sm90.json's strided entries), so that Wan's strided window (8x16x16 at 2x8x8 on 21x30x52, whose
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
echo "=== 1. GPU tests of the Gluon path (a grid that clips every axis' last box, as Wan's)"
timeout 150 python3 -m pytest -q -n 4 -m gpu tests/kernels/test_sm90_forward.py > $OUT/gpu_tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests.log
echo "=== 2. wan-1.3b-step"
mkdir -p $OUT/results && cp benchmarks/results/h100.json $OUT/results/  # (rows merge into it)
timeout $((570 - SECONDS)) python3 benchmarks/video_dit_bench.py --only wan --commit $COMMIT --out-dir $OUT/results \
  > $OUT/wan_bench.log 2>&1
echo "wan rc=$? at ${SECONDS}s"; tail -8 $OUT/wan_bench.log
echo "done at ${SECONDS}s"
