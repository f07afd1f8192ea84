#!/usr/bin/env bash
# Second device call of NOTES v35 (under 10 minutes). Trees as gpu_session_v35.sh's header says, plus
#   .ab/dil   this tree with short_window's dK/dV boxes (2,8,4) keys / (2,4,8) queries (NOTES v34's best
#             64/64 boxes for dilation (2,2,2); the table's are (2,4,8)/(4,4,4))
# Steps (later ones skipped once the call has run 540 s):
#   1. The kernels of one edge-wide call (forward; forward + backward) on 324d74b, ba6a957 and this tree
#      (default and assume_finite): which kernel makes this tree's forward 19 % slower than 324d74b's
#      (v35's A/B: 0.0307 against 0.0259 ms GPU time; 0.0280 with assume_finite).
#   2. Dilation (2,2,2) against the plain call, on feature-base and ltx-stage3, table boxes against .ab/dil:
#      predicted dK/dV products 1.231 -> 1.154 (feature-base), 1.165 -> 1.098 (ltx-stage3) of plain's.
#   3. The split's bf16 GPU tests, and the GPU tests of the whole tree (-m gpu, stage-5 tiles aside).
#      (As first run in v35, step 3 lacked PYTHONPATH=src and failed to import; it was rerun by hand.)
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
late() { [ $SECONDS -gt 540 ] && echo "skipped (at ${SECONDS}s): $*" && return 0; return 1; }
kl() { late kl $1 && return; timeout 60 env PYTHONPATH=$2 python3 benchmarks/kernel_list.py --tag $1 --shapes edge-wide \
  ${3:-} >> $OUT/kernels.jsonl 2>> $OUT/kernels.err; echo "kl $1 ${3:-} rc=$? at ${SECONDS}s"; }
echo "=== 1. edge-wide kernels"
kl a324 .ab/324d74b/src; kl aba6 .ab/ba6a957/src; kl new src; kl newaf src --assume-finite
kl a324b .ab/324d74b/src --backward; kl newb src --backward
abx() { late abx $1 && return; timeout 60 env PYTHONPATH=$2 python3 benchmarks/ab_gpu_time.py --tag $1 --repeats 3 \
  --shapes feature-base ltx-stage3 ${3:-} >> $OUT/ab_dil.jsonl 2>> $OUT/ab_dil.err; echo "abx $1 ${3:-} rc=$? at ${SECONDS}s"; }
echo "=== 2. dilation (2,2,2) with other dK/dV boxes"
abx table src; abx table src "--dilation 2 2 2"; abx boxes .ab/dil/src "--dilation 2 2 2"; abx boxes .ab/dil/src
abx boxes .ab/dil/src "--dilation 2 2 2"; abx table src "--dilation 2 2 2"
echo "=== 3. GPU tests"
if ! late split tests; then
  timeout 110 env PYTHONPATH=src python3 -m pytest -q -n 4 -m "" -x tests/kernels/test_full_split.py > $OUT/split_tests.log 2>&1
  echo "split tests rc=$? at ${SECONDS}s"; tail -2 $OUT/split_tests.log; fi
if ! late gpu tests; then
  timeout $((585 - SECONDS)) env PYTHONPATH=src python3 -m pytest -q -n 4 -m gpu -k "not ltx-stage5-tile" tests > $OUT/gpu_tests.log 2>&1
  echo "gpu tests rc=$? at ${SECONDS}s"; tail -4 $OUT/gpu_tests.log; fi
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
for r in (json.loads(l) for l in open(out + "/kernels.jsonl") if l.startswith("{")):
    print(f"{r['tag']:<7}{r['per_call']:>5.1f} {r['us']:>9.2f} us  {r['kernel']}")
d = {}
for r in (json.loads(l) for l in open(out + "/ab_dil.jsonl") if l.startswith("{")):
    d.setdefault((r["name"], r["pass"]), {}).setdefault(r["tag"], []).append(r["gpu_ms"])
for key, tags in d.items():
    print(key, {t: [round(x, 4) for x in v] for t, v in tags.items()})
PY
echo "done at ${SECONDS}s"
