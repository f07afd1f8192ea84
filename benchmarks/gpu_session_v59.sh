#!/usr/bin/env bash
# One short device call (NOTES v43): the test files whose gradient tolerance now reads the forward's
# out and lse (tests/helpers.py, forward=) run on the GPU in bf16, every seed (-m ""), compiled kernels.
# Usage: [LIMIT=240] bash benchmarks/gpu_session_v59.sh   (no carry)
# Expected: every case passes (as with the fresh-logsumexp reference on GPUs so far); a case cut by LIMIT
# shows as not run in the verbose log, never as a pass.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=src
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
git log -1 --format=%h 2>/dev/null | tee $OUT/commit.txt
timeout ${LIMIT:-240} python3 -m pytest -v -m "" -n 8 -p no:cacheprovider \
  tests/kernels/test_nonfinite.py tests/kernels/test_full_split.py > $OUT/gpu_tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"
grep -c " PASSED" $OUT/gpu_tests.log; grep -E " (FAILED|ERROR)" $OUT/gpu_tests.log | head; tail -3 $OUT/gpu_tests.log
