#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v44: what is left of the default's cost on the LTX backwards.
# Trees, GPU time by graph replay (benchmarks/ab_gpu_time.py, the LTX rows), two rounds in alternating order:
#   base      ac67719 (carried in .ab/base): the dK/dV check on float32, the flag's zero stored before the tile
#   new       this tree: the flag's address and zero after the tile (the dK/dV key loop as the unchecked one's on
#             stage 3: 920 instructions, was 925; stage 1 local accesses 69 -> 61 per step)
#   ipdq      this tree, sm90.json's medium_window backward with redo_in_program and dq_maxnreg 128: edge-wide's dQ
#             redoes a flagged tile in its own program (no second launch; 128 registers, 4 programs per SM, one
#             wave of 512; the fast loop 275 instructions against 279, no local access in it)
#   ipdq_pdl  ipdq with dependent_launch (the dK/dV kernel's second launch as a programmatic dependent)
#   af        this tree, assume_finite
# Then the non-finite GPU tests of ipdq (the redo-in-program fuzz forces every kernel in program anyway).
# Usage: bash benchmarks/sessions/gpu_session_v63.sh   (carry .ab/base: `git archive ac67719 src | tar -x -C .ab/base`)
# Prediction: new / base 0.99-1.0 on the backwards of stages 1-3, 1.0 elsewhere; ipdq on edge-wide's backward
# one second launch (about 2.7 us) less: about 90.5 us, 1.02x af (was 1.049); ipdq_pdl about 89.5 (1.01x); the
# other rows do not take the medium window: unchanged.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
edits="--set medium_window.backward.redo_in_program=true --set medium_window.backward.dq_maxnreg=128"
python3 benchmarks/table_tree.py /tmp/ipdq $edits
python3 benchmarks/table_tree.py /tmp/ipdq_pdl $edits --set dependent_launch=true
ab() { [ $SECONDS -gt 420 ] && echo "skipped (at ${SECONDS}s): $*" && return
  timeout 100 env PYTHONPATH=$2 python3 benchmarks/ab_gpu_time.py --tag $1 --repeats 3 ${3:-} >> $OUT/ab.jsonl 2>> $OUT/ab.err
  echo "ab $1 rc=$? at ${SECONDS}s"; }
ab base .ab/base/src; ab new src; ab ipdq /tmp/ipdq/src; ab ipdq_pdl /tmp/ipdq_pdl/src; ab af src --assume-finite
ab af src --assume-finite; ab ipdq_pdl /tmp/ipdq_pdl/src; ab ipdq /tmp/ipdq/src; ab new src; ab base .ab/base/src
python3 - <<'PY'
import json, statistics, os
d = {}
for r in (json.loads(l) for l in open(os.path.join(os.environ["OUT"], "ab.jsonl")) if l.startswith("{")):
    d.setdefault((r["name"], r["pass"]), {}).setdefault(r["tag"], []).append(r["gpu_ms"])
tags = ("base", "new", "ipdq", "ipdq_pdl", "af")
nan = float("nan")
print(f"{'shape':<18}{'pass':>5}" + "".join(f"{t:>10}" for t in tags) + "   then each over af")
for (n, p), t in d.items():
    m = {k: statistics.median(v) for k, v in t.items()}
    g = lambda k: m.get(k, nan)
    print(f"{n:<18}{p:>5}" + "".join(f"{g(k):>10.4f}" for k in tags) + "  " + "".join(f"{g(k) / g('af'):>7.3f}" for k in tags[:4]))
PY
echo "=== non-finite GPU tests of ipdq"
timeout $((585 - SECONDS)) env PYTHONPATH=/tmp/ipdq/src python3 -m pytest -q -m "" -n 4 -p no:cacheprovider \
  -k "not stage5-tile" tests/kernels/test_nonfinite.py > $OUT/gpu_tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests.log
