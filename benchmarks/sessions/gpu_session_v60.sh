#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v43: the GPU tests of the largest shape (ltx-stage5-tile, about 27 GiB
# a test) at pyproject's -n auto (4 workers on a GPU machine), where tests/conftest.py now makes them take turns
# (a lock file; each returns its worker's cached memory before letting go). Without the lock, three of them at
# once ran an 80 GB card out of memory (v59).
# Usage: bash benchmarks/sessions/gpu_session_v60.sh   (no carry)
# Expected: every selected test passes, none with "out of memory"; the stage-5 tile's tests one after another
# in the log's timestamps (about 30 s each: v59's three took 82 s alone).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=src
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -lms 1000 > $OUT/memory.csv 2>&1 &
timeout 560 python3 -m pytest -v -m "" -k "stage5-tile" -p no:cacheprovider --durations=0 \
  tests/kernels/test_nonfinite.py tests/kernels/test_forward.py tests/kernels/test_backward.py > $OUT/gpu_tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"
grep -c " PASSED" $OUT/gpu_tests.log; grep -ciE "out of memory" $OUT/gpu_tests.log; tail -3 $OUT/gpu_tests.log
sort -t, -k2 -n $OUT/memory.csv | tail -1
