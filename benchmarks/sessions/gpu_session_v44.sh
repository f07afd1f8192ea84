#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v38: issue 32's wan-1.3b-step row from this tree (the strided
# window 8x16x16 at 2x8x8 now runs the Gluon forward), and the Gluon path's GPU tests.
# Carry [".whl", ".peers"] (.whl: diffusers 0.42.1 and the wheels it needs, from
#   pip download diffusers==0.42.1 --only-binary=:all: --python-version 3.12 --implementation cp
#   --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl)
# Usage: bash benchmarks/sessions/gpu_session_v44.sh <commit of this tree>
# Prediction (H100; b142bd8: dense 639.7 ms, na3d 9x15x15 352.6, strided 328.1): the strided forward's
# attention from about 1.27 to 0.7 ms a block (30 blocks), so about 311 ms, 2.05x dense; 9x15x15 unchanged.
set -u
export PYTHONUNBUFFERED=1
COMMIT=${1:-unknown}
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
# SM clock, power and temperature every 200 ms through the whole call (the Gluon forward's times come in two
# modes, about 24.4 and 25.8-27.4 ms at dit-hunyuan-s2x8x8, NOTES v38: is it the clock?)
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 200 > $OUT/clocks.csv 2>&1 &
python3 -m pip install -q --no-index --find-links .whl diffusers==0.42.1 > $OUT/pip.log 2>&1 \
  || python3 -m pip install -q --user --no-index --find-links .whl diffusers==0.42.1 >> $OUT/pip.log 2>&1 \
  || python3 -m pip install -q --no-index --find-links .whl --target /tmp/site diffusers==0.42.1 >> $OUT/pip.log 2>&1
export PYTHONPATH=/tmp/site:$PWD/.peers:$PWD/src
python3 -c "import diffusers; print('diffusers', diffusers.__version__)" 2>&1 | tail -1
echo "=== 1. wan-1.3b-step"
mkdir -p $OUT/results && cp benchmarks/results/h100.json benchmarks/results/h200.json $OUT/results/  # (rows merge into them)
timeout 330 python3 benchmarks/video_dit_bench.py --only wan --commit $COMMIT --out-dir $OUT/results \
  > $OUT/wan_bench.log 2>&1
echo "wan rc=$? at ${SECONDS}s"; tail -25 $OUT/wan_bench.log
echo "=== 2. GPU tests of the Gluon path and the video DiTs"
timeout $((520 - SECONDS)) python3 -m pytest -q -n 4 -m gpu tests/kernels/test_sm90_forward.py \
  tests/kernels/test_block_sparse.py tests/test_diffusers_video_dit.py > $OUT/gpu_tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests.log
echo "=== 3. the Gluon forward's two modes, with the clock log"
timeout $((590 - SECONDS)) env PYTHONPATH=src python3 benchmarks/sm90_gluon_probe.py --out $OUT --skip-check --quick \
  --variants "" --rounds 4 > $OUT/gluon_probe.log 2>&1; echo "probe rc=$? at ${SECONDS}s"
grep -o '"method": "[a-z ]*", .*"gpu_ms": [0-9.]*' $OUT/gluon_probe.log | sed 's/"kv_box.*"gpu_ms"/ gpu_ms/' | head -20
echo "done at ${SECONDS}s"
