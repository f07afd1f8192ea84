#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v41 "Next on a GPU" items 1 and 3 (the DiT half): this tree's
# head-dim-128 table (dK/dV retuned in 7cffdbb) and the one-pass backward's shared-memory fallback (84e8433), on
# a Hopper GPU.
#   1. GPU tests: every head-dim-128 configuration against the float64 oracle (bf16, fp16; the one-pass variant
#      included, which failed on an H200 before the fallback), the DiT backward tests and the fallback's test.
#   2. The DiT rows, forward and backward, all methods in one process with NATTEN (carry .peers):
#      python -m na3d.bench --backward --group dit, results into $OUT (commit them as results/<card>-dit-<sha>.json).
# Usage: carry [".peers"]; PYTHONPATH=$PWD/.peers bash benchmarks/sessions/gpu_session_v58.sh <commit of this tree>
# Expected: step 1 all passed (about 10 tests, about 90 s); step 2 na3d's backward GPU time on dit-hunyuan about
# 175 ms and dit-wan about 8.2 ms on an H100 (the tuner's eager timings: 175.6 and 8.19), forwards as in v40
# (about 53 and 2.0 ms), NATTEN's fwd+bwd about 334 and 17 ms (issue 33's table).
set -u
export PYTHONUNBUFFERED=1
COMMIT=${1:-unknown}
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
echo "=== 1. GPU tests"
timeout 200 env PYTHONPATH=src:${PYTHONPATH:-} python3 -m pytest -q -m "" -n 2 tests/kernels/test_head_dim_128_table.py \
  tests/kernels/test_backward.py -k "dit or falls_back or head_dim_128" > $OUT/gpu_tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests.log
echo "=== 2. DiT rows"
timeout $((585 - SECONDS)) env PYTHONPATH=src:${PYTHONPATH:-} python3 -m na3d.bench --backward --group dit --no-flex \
  --commit $COMMIT --out-dir $OUT > $OUT/bench.log 2>&1
echo "bench rc=$? at ${SECONDS}s"; tail -14 $OUT/bench.log
