#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v45: the short and small windows' dK/dV without a register cap, and
# the default's cost on the final tree.
# Trees, GPU time by graph replay (benchmarks/ab_gpu_time.py), two rounds in alternating order:
#   new      this tree: sm90.json's short_window and small_window backwards without dkdv_maxnreg (v56 on an H100:
#            ltx-stage1 0.975x, stage3 0.989x, stage4-tile 0.972x, feature-base 0.987x against the cap of 168)
#   capped   this tree with the cap of 168 back (the table before)
#   af       this tree, assume_finite
#   324      324d74b (carried in .ab/324), issue 34's reference for the small shapes
# On the LTX rows but stage5-tile (the large window's, unchanged, and 95 ms a pass), feature-base, and two
# head-dim-128 shapes of these buckets (no benchmark row has one): 3x5x5 and 3x7x7.
# Then the backward's and the non-finite GPU tests of this tree (all but stage5-tile; the head-dim-128 test now
# has the 3x5x5 and 3x7x7 kernels).
# Usage: bash benchmarks/sessions/gpu_session_v64.sh   (carry .ab/324: `git archive 324d74b src | tar -x -C .ab/324`)
# Prediction: new / capped as v56 on the LTX backwards (0.97-0.99), forwards 1.0; at head dim 128 the cap of 168
# spills more (the accumulators alone are 2 x 64 fp32 per thread), so new / capped 0.85-0.95 there.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
python3 benchmarks/table_tree.py /tmp/capped --set short_window.backward.dkdv_maxnreg=168 \
  --set small_window.backward.dkdv_maxnreg=168
SHAPES="--shapes ltx-stage1 ltx-stage3 ltx-stage4-tile ltx-stage5-small edge-wide feature-base
  --spec hd128-3x5x5:1,24,48,64,8,128:3,5,5 --spec hd128-3x7x7:1,18,32,48,16,128:3,7,7"
ab() { [ $SECONDS -gt 330 ] && echo "skipped (at ${SECONDS}s): $*" && return
  timeout 100 env PYTHONPATH=$2 python3 benchmarks/ab_gpu_time.py --tag $1 --repeats 3 $SHAPES ${3:-} \
    >> $OUT/ab.jsonl 2>> $OUT/ab.err
  echo "ab $1 rc=$? at ${SECONDS}s"; }
ab new src; ab capped /tmp/capped/src; ab af src --assume-finite; ab 324 .ab/324/src
ab 324 .ab/324/src; ab af src --assume-finite; ab capped /tmp/capped/src; ab new src
python3 - <<'PY'
import json, statistics, os
d = {}
for r in (json.loads(l) for l in open(os.path.join(os.environ["OUT"], "ab.jsonl")) if l.startswith("{")):
    d.setdefault((r["name"], r["pass"]), {}).setdefault(r["tag"], []).append(r["gpu_ms"])
tags = ("new", "capped", "af", "324")
nan = float("nan")
print(f"{'shape':<18}{'pass':>5}" + "".join(f"{t:>10}" for t in tags) + "  new/capped new/af new/324")
for (n, p), t in d.items():
    m = {k: statistics.median(v) for k, v in t.items()}
    g = lambda k: m.get(k, nan)
    print(f"{n:<18}{p:>5}" + "".join(f"{g(k):>10.4f}" for k in tags)
          + "".join(f"{g('new') / g(k):>10.3f}" for k in tags[1:]))
PY
echo "=== the backward's and non-finite GPU tests of this tree"
timeout $((590 - SECONDS)) env PYTHONPATH=src python3 -m pytest -q -m "" -n 4 -p no:cacheprovider -k "not stage5-tile" \
  tests/kernels/test_backward.py tests/kernels/test_nonfinite.py > $OUT/gpu_tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests.log
