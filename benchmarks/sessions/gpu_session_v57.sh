#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v41: the non-finite check read back from the stored tile (its first
# row and first column, nonfinite.stored_tile_nonfinite) against 51edab7's check (one add per element of the
# tile, in registers). Compiled for sm90 here: the kernels' key loops as before or shorter (forward 1141 on the
# short window's one-warp programs; dQ 423 -> 416, dK/dV 925 -> 907 with 60 local accesses per step instead of
# 70), the epilogue 64 adds per thread shorter on the one-warp forward.
#   1. LTX A/B, GPU time by graph replay, trees alternating: 51edab7 (base, carried as .ab/base51/src), this tree
#      by default (new) and with assume_finite (newaf).
#   2. The non-finite tests on the GPU (bf16, compiled): the fuzz (every seed) and the benchmark shapes.
# Prepare here, then carry [".ab"]:
#   rm -rf .ab/base51 && mkdir -p .ab/base51 && git archive 51edab7 src | tar -x -C .ab/base51
# Usage: [END=560] bash benchmarks/sessions/gpu_session_v57.sh   (measured at f783a4d; the check was taken out in 90ab273, NOTES v41)
# Prediction: the default over assume_finite on the short-window forwards (stages 3 and 4) from 1.023-1.027 to
# 1.005-1.01; the backwards 0-2 % faster than base (the dK/dV loop 2 % shorter, fewer spills), edge-wide's dQ
# may lose (137 registers: 3 programs per SM instead of 4).
set -u
END=${END:-560}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 500 > $OUT/clocks.csv 2>&1 &
LTX="ltx-stage1 ltx-stage3 ltx-stage4-tile ltx-stage5-small edge-wide feature-base"
late() { [ $SECONDS -gt ${LATE:-$((END - 230))} ] && echo "skipped (at ${SECONDS}s): $*" && return 0; return 1; }
ab() { late ab $1 && return; timeout 80 env PYTHONPATH=$2 python3 benchmarks/ab_gpu_time.py --tag $1 --repeats 3 \
  --shapes $LTX ${3:-} >> $OUT/ab.jsonl 2>> $OUT/ab.err; echo "ab $1 rc=$? at ${SECONDS}s"; }
ab base .ab/base51/src; ab new src; ab newaf src --assume-finite
ab newaf src --assume-finite; ab new src; ab base .ab/base51/src
python3 - <<'PY'
import json, statistics, os
tags = ("base", "new", "newaf")
d = {}
for r in (json.loads(l) for l in open(os.path.join(os.environ["OUT"], "ab.jsonl")) if l.startswith("{")):
    d.setdefault((r["name"], r["pass"]), {}).setdefault(r["tag"], []).append(r["gpu_ms"])
print(f"{'shape':<18}{'pass':>5}" + "".join(f"{t:>9}" for t in tags) + f"{'new/base':>10}{'new/af':>8}{'base/af':>8}")
for (n, p), t in d.items():
    m = {k: statistics.median(v) for k, v in t.items()}
    nan = float("nan")
    print(f"{n:<18}{p:>5}" + "".join(f"{m.get(k, nan):>9.4f}" for k in tags)
          + f"{m.get('new', nan) / m.get('base', nan):>10.3f}{m.get('new', nan) / m.get('newaf', nan):>8.3f}"
          + f"{m.get('base', nan) / m.get('newaf', nan):>8.3f}")
PY
echo "=== 2. the non-finite tests, compiled, bf16"
timeout $((END - SECONDS)) env PYTHONPATH=src python3 -m pytest -q -m "" -n 4 tests/kernels/test_nonfinite.py \
  > $OUT/gpu_tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests.log
echo "done at ${SECONDS}s"
