#!/usr/bin/env bash
# One device call (under 10 minutes) for NOTES v33/v34's open A/Bs and their GPU tests, on the tree as it
# stands (`src`, PDL and every split off in its tables, compiled code identical to ba6a957's for the table
# configurations) against:
#   .ab/324d74b, .ab/ba6a957   issue 34's and issue 33's LTX no-regression baselines
#   .ab/split                  this tree with sm90.json's dependent_launch on and dit_large_window's
#                              split_full 0.3 (forward) / 0.35 (dQ)
# Prepare them here, then carry [".ab"]:
#   for r in 324d74b ba6a957; do mkdir -p .ab/$r && git archive $r src | tar -x -C .ab/$r; done
#   mkdir -p .ab/split && cp -r src .ab/split/ && python3 -c "import json; p='.ab/split/src/na3d/configs/sm90.json'; \
#     t=json.load(open(p)); b=[x for x in t['forward'] if x['bucket']=='dit_large_window'][0]; \
#     b['split_full']=0.3; b['backward']['split_full']=0.35; t['dependent_launch']=True; \
#     open(p,'w').write(json.dumps(t, indent=1))"
# Steps (each with its own timeout; later steps are skipped once the call has run 540 s):
#   1. dit-hunyuan, split against unsplit (new, split, split, new): predicted split/new 0.97 fwd, 0.98 bwd.
#   2. LTX rows, tags a324 / aba6 / new / newaf (assume_finite) / pdl / pdlaf, forward then reversed:
#      predicted new/a324 and new/aba6 within 1 %, pdl/new 0.99-1.00, new/newaf 1.03 on edge-wide's
#      forward (the non-finite check's second launch) and pdl/pdlaf 1.01-1.02 there.
#   3. The split's bf16 GPU tests (forward, dQ, dK/dV, fused), and the non-finite tests with PDL on.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
LTX="ltx-stage1 ltx-stage3 ltx-stage4-tile ltx-stage5-small edge-wide"
late() { [ $SECONDS -gt 540 ] && echo "skipped (at ${SECONDS}s): $*" && return 0; return 1; }
abd() { late abd $1 && return; timeout 75 env PYTHONPATH=$2 python3 benchmarks/ab_gpu_time.py --tag $1 --repeats 2 \
  --shapes dit-hunyuan >> $OUT/ab_dit.jsonl 2>> $OUT/ab_dit.err; echo "abd $1 rc=$? at ${SECONDS}s"; }
ab() { late ab $1 && return; timeout 50 env PYTHONPATH=$2 python3 benchmarks/ab_gpu_time.py --tag $1 --repeats 3 \
  --shapes $LTX ${3:-} >> $OUT/ab.jsonl 2>> $OUT/ab.err; echo "ab $1 rc=$? at ${SECONDS}s"; }
echo "=== 1. dit-hunyuan split A/B"
abd new src; abd split .ab/split/src; abd split .ab/split/src; abd new src
echo "=== 2. LTX A/B"
ab a324 .ab/324d74b/src; ab aba6 .ab/ba6a957/src; ab new src; ab newaf src --assume-finite
ab pdl .ab/split/src; ab pdlaf .ab/split/src --assume-finite
ab pdlaf .ab/split/src --assume-finite; ab pdl .ab/split/src; ab newaf src --assume-finite; ab new src
ab aba6 .ab/ba6a957/src; ab a324 .ab/324d74b/src
echo "=== 3. GPU tests"
if ! late split tests; then
  timeout 100 env PYTHONPATH=.ab/split/src python3 -m pytest -q -n 4 -m "" tests/kernels/test_full_split.py \
    > $OUT/split_tests.log 2>&1; echo "split tests rc=$?"; tail -3 $OUT/split_tests.log; fi
if ! late nonfinite tests; then
  timeout 70 env PYTHONPATH=.ab/split/src python3 -m pytest -q -n 4 -k "not ltx-stage5-tile and not ltx-stage4" \
    tests/kernels/test_nonfinite.py > $OUT/nonfinite_tests.log 2>&1; echo "nonfinite tests rc=$?"; tail -3 $OUT/nonfinite_tests.log; fi
python3 - <<'PY'
import json, statistics, os
for name, tags in (("ab_dit.jsonl", ("new", "split")), ("ab.jsonl", ("a324", "aba6", "new", "newaf", "pdl", "pdlaf"))):
    path = os.path.join(os.environ["OUT"], name)
    if not os.path.exists(path):
        continue
    d = {}
    for r in (json.loads(l) for l in open(path) if l.startswith("{")):
        d.setdefault((r["name"], r["pass"]), {}).setdefault(r["tag"], []).append(r["gpu_ms"])
    print(f"{'shape':<18}{'pass':>5}" + "".join(f"{t:>9}" for t in tags))
    for (n, p), t in d.items():
        m = {k: statistics.median(v) for k, v in t.items()}
        print(f"{n:<18}{p:>5}" + "".join(f"{m.get(k, float('nan')):>9.4f}" for k in tags))
PY
echo "done at ${SECONDS}s"
