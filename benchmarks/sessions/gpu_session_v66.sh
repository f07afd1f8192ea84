#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v45: the medium window's dK/dV at head dim 128 (dit-small-window).
# Compiled for sm90 here (launched_sass.py, NOTES v45): the table's dK/dV (1,4,16) keys / (2,2,16) queries on 4 warps,
# 2 stages: 842 instructions per step, 21 local accesses, 3.72 products issued per useful one on dit-small-window.
# Trees (table_tree.py edits of medium_window's backward), GPU time by graph replay, two rounds alternating:
#   base   this tree
#   w8     (2,4,16)/(2,2,16) on 8 warps, 2 stages: 767 instructions, 1 local access, 3.81 issued per useful
#   st1    the table's boxes at 1 stage: 829, 6, 3.72
#   k128   (4,4,8)/(2,4,8) on 8 warps, 2 stages (the large DiT window's): 852, 1, 4.54
# Then this tree's head-dim-128 and Gluon GPU tests (nothing since b05e90f and 41fe32e ran on a GPU), and the
# head-dim-128 GPU tests (dit_regime: 5x7x7 takes the medium window) with w8's table.
# Usage: bash benchmarks/sessions/gpu_session_v66.sh   (no carry)
# Prediction: w8 5-10 % off the dK/dV kernel, 3-6 % off dit-small-window's backward; st1 0-2 %; k128 slower
# (22 % more products); every test passes. A winner goes into a head-dim-65-128 bucket of its own before medium_window (whose
# backward is edge-wide's at head dim 64).
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
B=medium_window.backward
python3 benchmarks/table_tree.py /tmp/w8 --set "$B.dkdv=[[2,4,16],[2,2,16]]" --set $B.dkdv_num_warps=8 --set $B.dkdv_num_stages=2
python3 benchmarks/table_tree.py /tmp/st1 --set $B.dkdv_num_stages=1
python3 benchmarks/table_tree.py /tmp/k128 --set "$B.dkdv=[[4,4,8],[2,4,8]]" --set $B.dkdv_num_warps=8 --set $B.dkdv_num_stages=2
ab() { [ $SECONDS -gt 420 ] && echo "skipped (at ${SECONDS}s): $*" && return
  timeout 100 env PYTHONPATH=$2 python3 benchmarks/ab_gpu_time.py --tag $1 --repeats 3 --shapes dit-small-window \
    >> $OUT/ab.jsonl 2>> $OUT/ab.err
  echo "ab $1 rc=$? at ${SECONDS}s"; }
ab base src; ab w8 /tmp/w8/src; ab st1 /tmp/st1/src; ab k128 /tmp/k128/src
ab k128 /tmp/k128/src; ab st1 /tmp/st1/src; ab w8 /tmp/w8/src; ab base src
python3 benchmarks/ab_gpu_time.py --summarize $OUT/ab.jsonl base w8 st1 k128
echo "=== this tree's GPU tests of what changed since the last GPU run: head dim 128 at 3x5x5 and 3x7x7 in the small
# window's forward and the medium window's backward (b05e90f), the Gluon forward's flag renamed (41fe32e)"
timeout 200 env PYTHONPATH=src python3 -m pytest -q -m "" -n 4 -p no:cacheprovider -k "dit_regime or sm90" \
  tests/kernels/test_backward.py tests/kernels/test_sm90_forward.py > $OUT/gpu_tests_tree.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests_tree.log
echo "=== head-dim-128 GPU tests, w8"
timeout $((590 - SECONDS)) env PYTHONPATH=/tmp/w8/src python3 -m pytest -q -m "" -n 4 -p no:cacheprovider -k "dit_regime" \
  tests/kernels/test_backward.py > $OUT/gpu_tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests.log
