#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v39: issue 34's rows from this tree.
#   1. The feature rows, forward and backward (`python -m na3d.bench --features --backward`), merged into the
#      committed results file (its other rows kept), GPU time by graph replay.
#   2. The LTX A/B: this tree, default and assume_finite, against 324d74b (issue 34's baseline) and ba6a957
#      (issue 33's), every LTX row (ltx-stage5-tile included), trees alternating, until 540 s.
# Prepare here, then carry [".ab"]:
#   rm -rf .ab && for r in 324d74b ba6a957; do mkdir -p .ab/$r && git archive $r src | tar -x -C .ab/$r; done
# Usage: [FEATURES_S=260] [LATE=540] bash benchmarks/sessions/gpu_session_v49.sh <commit of this tree>
#   (FEATURES_S: step 1's limit; LATE: no A/B run starts after this many seconds)
# Predictions (v24 at 843207e on an H200, v35/v37 on an H100): feature over plain by GPU time, GQA and MQA
# forwards 0.92-0.97, GQA backward 0.92-0.98, MQA backward about 1.05 on feature-base (unchanged since v24:
# its dK/dV programs are as many and as long), dilation (2,2,2) backward about 1.2 (v35's boxes; the tiling's
# floor is 1.197 / 1.134), causal 0.90-1.02. LTX: default within 1 % of assume_finite on every forward
# (edge-wide 0.99x since v37), edge-wide's backward about 1.05x; against 324d74b within 2 % except edge-wide's
# forward (about 1.06x in v37) and stage 4's backward (1.048x in v35).
set -u
export PYTHONUNBUFFERED=1
COMMIT=${1:-unknown}
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 500 > $OUT/clocks.csv 2>&1 &
echo "=== 1. feature rows"
RESULTS=benchmarks/results/h100.json
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && RESULTS=benchmarks/results/h200.json
timeout ${FEATURES_S:-260} env PYTHONPATH=src python3 -m na3d.bench --features --backward --merge $RESULTS --commit $COMMIT \
  --out-dir $OUT > $OUT/features.log 2>&1
echo "features rc=$? at ${SECONDS}s"; grep -A40 "feature" $OUT/features.log | tail -40
echo "=== 2. LTX A/B against 324d74b"
LTX="ltx-stage1 ltx-stage3 ltx-stage4-tile ltx-stage5-tile ltx-stage5-small edge-wide"
late() { [ $SECONDS -gt ${LATE:-540} ] && echo "skipped (at ${SECONDS}s): $*" && return 0; return 1; }
ab() { late ab $1 && return; timeout 80 env PYTHONPATH=$2 python3 benchmarks/ab_gpu_time.py --tag $1 --repeats 3 \
  --shapes $LTX ${3:-} >> $OUT/ab.jsonl 2>> $OUT/ab.err; echo "ab $1 rc=$? at ${SECONDS}s"; }
ab a324 .ab/324d74b/src; ab new src; ab newaf src --assume-finite; ab aba6 .ab/ba6a957/src
ab aba6 .ab/ba6a957/src; ab newaf src --assume-finite; ab new src; ab a324 .ab/324d74b/src
python3 - <<'PY'
import json, statistics, os
tags = ("a324", "aba6", "new", "newaf")
d = {}
for r in (json.loads(l) for l in open(os.path.join(os.environ["OUT"], "ab.jsonl")) if l.startswith("{")):
    d.setdefault((r["name"], r["pass"]), {}).setdefault(r["tag"], []).append(r["gpu_ms"])
print(f"{'shape':<18}{'pass':>5}" + "".join(f"{t:>9}" for t in tags) + f"{'new/a324':>10}{'new/aba6':>10}{'new/af':>8}")
for (n, p), t in d.items():
    m = {k: statistics.median(v) for k, v in t.items()}
    nan = float("nan")
    print(f"{n:<18}{p:>5}" + "".join(f"{m.get(k, nan):>9.4f}" for k in tags)
          + f"{m.get('new', nan) / m.get('a324', nan):>10.3f}{m.get('new', nan) / m.get('aba6', nan):>10.3f}"
          + f"{m.get('new', nan) / m.get('newaf', nan):>8.3f}")
PY
echo "done at ${SECONDS}s"
