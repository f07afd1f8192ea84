#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v49: the final table's backward on the GPU, and dQ's boxes by the
# same count.
# 1. The GPU tests of the backward on this tree (its dK/dV pairs chosen per call, the whole-clip backward):
#    the LTX shapes' gradients (bf16, fp16), the head-dim-128 regime, the head-dim-128 table.
# 2. dQ pairs of the tables' own box sizes with fewer products (geometry.issued_flops_ratio, the forward's count,
#    which is dQ's); compiled for sm90 here (launched_sass.py), dQ key loop instructions per step, table -> t5:
#      ltx-stage1 (small_window)  2x4x8/4x4x4 -> 2x4x8/4x1x16   4.39 -> 4.03;  423 -> 399 (1 local access)
#      ltx-stage3/4 (short)       2x4x8/4x4x4 -> 2x8x4/4x2x8    5.12 -> 4.91 / 4.98;  423 -> 397
#      dit-small-window (medium)  4x4x4/4x2x4 -> 2x8x4/1x2x16   3.01 -> 2.59;  393 -> 329
#      edge-wide (medium)                                      1.85 -> 1.90;  279 -> 256
#      dit-wan (dit_large)        2x8x4/2x4x4 -> 2x8x4/2x8x2    2.07 -> 1.92;  369 -> 368
#      dit-hunyuan (dit_large)                                 1.36 -> 1.43
#    Prediction (dQ about 40 % of a backward; its time as products x instructions per step): backward t5/this:
#    ltx-stage1 0.96-0.98, ltx-stage3 and 4 0.96-0.98, dit-small-window 0.88-0.92, edge-wide 0.97-1.0,
#    dit-wan 0.97-0.98, dit-hunyuan 1.01-1.03. Forwards 1.0.
# Usage: bash benchmarks/gpu_session_v71.sh   (no carry)
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env71.txt
echo "=== backward GPU tests on this tree"
timeout 240 env PYTHONPATH=src python3 -m pytest -q -m "" -n 4 -p no:cacheprovider \
  -k "benchmark_shapes or dit_regime or head_dim_128" tests/kernels/test_backward.py tests/kernels/test_head_dim_128_table.py \
  > $OUT/gpu_tests71.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests71.log
python3 benchmarks/table_tree.py /tmp/t5 --set "small_window.backward.dq=[[2,4,8],[4,1,16]]" \
  --set "short_window.backward.dq=[[2,8,4],[4,2,8]]" --set "medium_window.backward.dq=[[2,8,4],[1,2,16]]" \
  --set "dit_large_window.backward.dq=[[2,8,4],[2,8,2]]"
ab() { [ $SECONDS -gt 520 ] && echo "skipped (at ${SECONDS}s): $*" && return
  timeout 100 env PYTHONPATH=$2 python3 benchmarks/ab_gpu_time.py --tag $1 --repeats 3 --shapes $3 \
    >> $OUT/ab71.jsonl 2>> $OUT/ab71.err
  echo "ab $1 $3 rc=$? at ${SECONDS}s"; }
S="ltx-stage1 ltx-stage3 ltx-stage4-tile edge-wide dit-small-window dit-wan"
ab this src "$S"; ab t5 /tmp/t5/src "$S"; ab t5 /tmp/t5/src "$S"; ab this src "$S"
ab this src dit-hunyuan; ab t5 /tmp/t5/src dit-hunyuan
python3 benchmarks/ab_gpu_time.py --summarize $OUT/ab71.jsonl this t5
