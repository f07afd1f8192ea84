#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v49-v50: the table's new backward pairs on the GPU, dQ's pairs by the
# same count, and issue 34's A/B of the default on the final tree.
# 1. GPU tests, on t5's tree (this tree's dK/dV pairs, and t5's dQ pairs): the gradients of the LTX shapes whose
#    pairs changed (bf16, fp16), the head-dim-128 regime and table (every dK/dV and dQ alternative there).
# 2. Trees, GPU time by graph replay, two rounds in alternating order:
#      new   this tree
#      t5    dQ pairs of the tables' own box sizes with fewer products (geometry.issued_flops_ratio, the forward's
#            count, which is dQ's): small_window's alternative 2x4x8/4x1x16 (ltx-stage1 4.39 -> 4.03), short_window's
#            pair 2x8x4/4x2x8 (ltx-stage3 5.12 -> 4.91, stage4-tile 5.12 -> 4.98), medium_window's alternative
#            2x8x4/1x2x16 (dit-small-window 3.01 -> 2.59; edge-wide keeps its pair), dit_large_window's 2x8x4/2x8x2
#            (dit-wan 2.07 -> 1.92; dit-hunyuan keeps its pair). Compiled for sm90 here (launched_sass.py), dQ key
#            loop instructions per step: 423 -> 399 (stage1), 423 -> 397 (short), 393 -> 329 (dit-small-window),
#            369 -> 368 (dit-wan).
#      af    this tree, assume_finite (issue 34: the default within 1.02x of it on every LTX row)
#      324   324d74b (carry .ab/324), issue 34's reference: no LTX row slower by more than 2 %
#    on the LTX rows but stage5-tile, dit-small-window and dit-wan; then prev (8190087: the table before v49,
#    carry .ab/prev) against new on two head-dim-128 shapes of the medium window's backward (no benchmark row):
#    hd128-3x5x5 (dK/dV 1x4x16/2x2x16 -> 1x8x8/2x8x4: 13.08 -> 9.81 products) and hd128-3x7x7 (-> 2x8x4/2x2x16:
#    8.22 -> 6.29).
# Prediction: backward t5/new 0.96-0.98 on stages 1, 3 and 4, 0.88-0.92 on dit-small-window, 0.97-0.98 on
# dit-wan, 1.0 on edge-wide and stage5-small (same pairs); new/prev 0.80-0.90 on both head-dim-128 backwards;
# new/af as v64 (1.00-1.02; edge-wide 1.04); forwards 1.0.
# Usage: bash benchmarks/sessions/gpu_session_v71.sh   (carry .ab/324 and .ab/prev:
#        `git archive 324d74b src | tar -x -C .ab/324`, `git archive 8190087 src | tar -x -C .ab/prev`)
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env71.txt
python3 benchmarks/table_tree.py /tmp/t5 --set "small_window.backward.dq_alternatives=[[[2,4,8],[4,1,16]]]" \
  --set "short_window.backward.dq=[[2,8,4],[4,2,8]]" --set "medium_window.backward.dq_alternatives=[[[2,8,4],[1,2,16]]]" \
  --set "dit_large_window.backward.dq_alternatives=[[[2,8,4],[2,8,2]]]"
echo "=== backward GPU tests on t5's tree"
timeout 200 env PYTHONPATH=/tmp/t5/src python3 -m pytest -q -m "" -n 4 -p no:cacheprovider \
  -k "ltx-stage1 or ltx-stage3 or edge-wide or dit_regime or head_dim_128" \
  tests/kernels/test_backward.py tests/kernels/test_head_dim_128_table.py > $OUT/gpu_tests71.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests71.log
ab() { [ $SECONDS -gt 540 ] && echo "skipped (at ${SECONDS}s): $*" && return
  timeout 90 env PYTHONPATH=$2 python3 benchmarks/ab_gpu_time.py --tag $1 --repeats 3 $3 ${4:-} \
    >> $OUT/ab71.jsonl 2>> $OUT/ab71.err
  echo "ab $1 ${4:-} rc=$? at ${SECONDS}s"; }
S="--shapes ltx-stage1 ltx-stage3 ltx-stage4-tile ltx-stage5-small edge-wide dit-small-window dit-wan"
H="--spec hd128-3x5x5:1,24,48,64,8,128:3,5,5 --spec hd128-3x7x7:1,18,32,48,16,128:3,7,7"
ab new src "$S"; ab t5 /tmp/t5/src "$S"; ab af src "$S" --assume-finite; ab 324 .ab/324/src "$S"
ab 324 .ab/324/src "$S"; ab af src "$S" --assume-finite; ab t5 /tmp/t5/src "$S"; ab new src "$S"
ab prev .ab/prev/src "$H"; ab new src "$H"; ab new src "$H"; ab prev .ab/prev/src "$H"
python3 benchmarks/ab_gpu_time.py --summarize $OUT/ab71.jsonl new t5 af 324 prev
