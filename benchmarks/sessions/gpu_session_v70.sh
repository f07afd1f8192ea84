#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v49: ltx-stage5-small's backward in whole-clip boxes.
# Its forward takes the large window's whole_clip option (16x2x2 query boxes, 16x4x2 key boxes: the T axis
# never moves); its backward still runs the deep boxes' dQ (8x4x2/1x16x4) and the cubic dK/dV (4x4x4/2x2x16).
# By the kernels' own counts (geometry.issued_flops_ratio; dK/dV with own="keys") on its 16x80x32 grid, window
# 11x11x11, products issued per useful one, and compiled for sm90 here (launched_sass.py; key loop
# instructions per step, local accesses in it; the whole_clip backward's caps: dQ 128, dK/dV 168 registers):
#   dQ    8x4x2/1x16x4   1.875   397 instructions, 4 locals   (table)
#         16x2x2/16x4x1  1.677   417, 6                       (t3, t4)
#   dK/dV 4x4x4/2x2x16   2.730   834, 67 (64 keys x 64 queries a step)   (table)
#         16x2x2/16x4x1  1.818  1077, 91 (64 x 64)                        (t3)
#         16x2x1/16x4x1  1.666   574, 0  (32 x 64)                        (t4)
# Prediction (time ~ products x instructions per product; dK/dV about 60 % of the 1.0 ms backward): t3's
# dK/dV 0.86x the table's, t4's 0.84x (fewer spills, but 32-key boxes use the tensor cores less well);
# backward t3/base 0.90-0.95, t4/base 0.88-0.95. Forward unchanged (1.00). Then the backward GPU tests of
# the LTX shapes (bf16, fp16) on both trees.
# Usage: bash benchmarks/sessions/gpu_session_v70.sh   (no carry)
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env70.txt
W=large_window/whole_clip.backward
python3 benchmarks/table_tree.py /tmp/t3 --set "$W.dq=[[16,2,2],[16,4,1]]" --set "$W.dkdv=[[16,2,2],[16,4,1]]"
python3 benchmarks/table_tree.py /tmp/t4 --set "$W.dq=[[16,2,2],[16,4,1]]" --set "$W.dkdv=[[16,2,1],[16,4,1]]"
ab() { timeout 120 env PYTHONPATH=$2 python3 benchmarks/ab_gpu_time.py --tag $1 --repeats 5 --shapes $3 \
    >> $OUT/ab70.jsonl 2>> $OUT/ab70.err
  echo "ab $1 $3 rc=$? at ${SECONDS}s"; }
S=ltx-stage5-small
ab base src $S; ab t3 /tmp/t3/src $S; ab t4 /tmp/t4/src $S
ab t4 /tmp/t4/src $S; ab t3 /tmp/t3/src $S; ab base src $S
python3 benchmarks/ab_gpu_time.py --summarize $OUT/ab70.jsonl base t3 t4
for t in t3 t4; do
  echo "=== backward GPU tests on $t's tiles"
  timeout $(( (590 - SECONDS) / 2 )) env PYTHONPATH=/tmp/$t/src python3 -m pytest -q -m "" -n 4 -p no:cacheprovider \
    -k "stage5-small" tests/kernels/test_backward.py > $OUT/gpu_tests70_$t.log 2>&1
  echo "tests rc=$? at ${SECONDS}s"; tail -2 $OUT/gpu_tests70_$t.log
done
