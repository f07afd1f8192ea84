#!/usr/bin/env bash
# One GPU session: tune (optional), benchmark, GPU tests. Logs and results go to $OUT.
#   bash benchmarks/gpu_session.sh [wheels] [tune] [bench] [test] [decoder]
# (env: NA3D_COMMIT, TUNE_ARGS, BENCH_ARGS, TEST_ARGS, DECODER_ARGS, and *_S time limits)
# TEST_ARGS defaults to the default test run; the GPU tests alone: TEST_ARGS="-m gpu tests".
# Each step has its own time limit so one slow step cannot starve the others.
set -u
OUT=${OUT:-/tmp/na3d-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
COMMIT=${NA3D_COMMIT:-unknown}
steps=" $* "
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"
if [[ -d .whl && $steps == *" wheels "* ]]; then
  # Optional packages the GPU image lacks (diffusers), carried as wheels: only the missing ones install.
  echo "=== wheels"; python3 -m pip install -q --no-index --find-links .whl diffusers==0.42.1 2>&1 | tail -2 \
    || python3 -m pip install -q --user --no-index --find-links .whl diffusers==0.42.1 2>&1 | tail -2
  python3 -c "import diffusers; print('diffusers', diffusers.__version__)"
fi
if [[ $steps == *" tune "* ]]; then
  echo "=== tune"; timeout ${TUNE_S:-240} python3 -m na3d.tools.tune --write --log "$OUT/tune.json" ${TUNE_ARGS:-} > "$OUT/tune.log" 2>&1
  echo "tune rc=$?"; grep -E "bucket|WRONG|failed|budget" "$OUT/tune.log" | tail -30
  cp src/na3d/configs/sm90.json "$OUT/sm90.json"
fi
if [[ $steps == *" bench "* ]]; then
  echo "=== bench"; timeout ${BENCH_S:-300} python3 -m na3d.bench --commit "$COMMIT" --out-dir "$OUT" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; tail -14 "$OUT/bench.log"
fi
if [[ $steps == *" test "* ]]; then
  echo "=== test"; timeout ${TEST_S:-240} python3 -m pytest -v --tb=short -rfE --timeout 120 ${TEST_ARGS:-tests} > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?"; tail -15 "$OUT/pytest.log"
fi
if [[ $steps == *" decoder "* ]]; then
  echo "=== decoder"; timeout ${DECODER_S:-120} python3 -m na3d.tools.bench_decoder ${DECODER_ARGS:-} > "$OUT/decoder.log" 2>&1
  echo "decoder rc=$?"; tail -8 "$OUT/decoder.log"
fi
