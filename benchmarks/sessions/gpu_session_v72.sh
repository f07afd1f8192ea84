#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v49 "Next": the head-dim-128 large window's dK/dV in 64-key boxes.
# By the dK/dV kernel's own count (geometry.issued_flops_ratio(..., own="keys")), products issued per useful one:
#                     table 4x4x8/2x4x8 (8 warps)  alt 4x8x4/2x8x4  2x8x4/4x4x4 (4 warps)  2x8x4/2x8x4 (4 warps)
#   dit-hunyuan       1.669                        1.720            1.448                  1.555
#   dit-wan           3.097                        2.734 (taken)    2.569                  2.279
# Compiled for sm90 here (launched_sass.py; dK/dV key loop instructions per step per warp, local accesses in it):
#   table (8 warps, 128 keys x 64 queries a step): hunyuan 852 (1), wan (its alternative) 896 (2)
#   t61 (4 warps, 64 x 64, one stage): hunyuan 947 (17), wan 1032 (26); 255 registers
#   t62 (the same, two stages): hunyuan 988 (20), wan 989 (18)
# So per product about 10 % more issued instructions and some spills, against 13 % (hunyuan) and 17 % (wan) fewer
# products. v49 found the products ranking pairs better than the instructions; prediction: backward t61/base
# 0.93-1.00 on both rows, t62 about the same; forwards 1.0. Then the backward GPU tests of the winner's tree.
# Trees: t6S: dit_large_window's backward dK/dV 2x8x4/4x4x4 with the alternative 2x8x4/2x8x4, 4 warps, S stages.
# Usage: bash benchmarks/sessions/gpu_session_v72.sh   (no carry)
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env72.txt
for st in 1 2; do
  python3 benchmarks/table_tree.py /tmp/t6$st --set "dit_large_window.backward.dkdv=[[2,8,4],[4,4,4]]" \
    --set "dit_large_window.backward.dkdv_alternatives=[[[2,8,4],[2,8,4]]]" \
    --set dit_large_window.backward.dkdv_num_warps=4 --set dit_large_window.backward.dkdv_num_stages=$st
done
ab() { [ $SECONDS -gt 420 ] && echo "skipped (at ${SECONDS}s): $*" && return
  timeout 120 env PYTHONPATH=$2 python3 benchmarks/ab_gpu_time.py --tag $1 --repeats 3 --shapes $3 \
    >> $OUT/ab72.jsonl 2>> $OUT/ab72.err
  echo "ab $1 $3 rc=$? at ${SECONDS}s"; }
ab base src dit-wan; ab t61 /tmp/t61/src dit-wan; ab t62 /tmp/t62/src dit-wan
ab t62 /tmp/t62/src dit-wan; ab t61 /tmp/t61/src dit-wan; ab base src dit-wan
ab base src dit-hunyuan; ab t61 /tmp/t61/src dit-hunyuan; ab t62 /tmp/t62/src dit-hunyuan
python3 benchmarks/ab_gpu_time.py --summarize $OUT/ab72.jsonl base t61 t62
for t in t61 t62; do
  echo "=== backward GPU tests on $t's tiles"
  timeout $(( (590 - SECONDS) / 2 )) env PYTHONPATH=/tmp/$t/src python3 -m pytest -q -m "" -n 4 -p no:cacheprovider \
    -k "dit_regime or head_dim_128" tests/kernels/test_backward.py tests/kernels/test_head_dim_128_table.py \
    > $OUT/gpu_tests72_$t.log 2>&1
  echo "tests rc=$? at ${SECONDS}s"; tail -2 $OUT/gpu_tests72_$t.log
done
