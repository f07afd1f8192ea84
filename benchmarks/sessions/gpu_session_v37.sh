#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v37: the Gluon sm90 forward for perfectly block-sparse calls
# (benchmarks/sm90_gluon_probe.py: exactness against the float64 oracle, then GPU time against the portable
# kernel on the strided rows), and edge-wide's backward with the one-launch redo (dQ and dK/dV) against the
# table's two launches. Make the variant tree here first:
#   .ab/bwdinprog  this tree with sm90.json medium_window's backward redo_in_program and dkdv_redo_in_program
# then run on the device carrying [".ab"].
# Predictions: the Gluon forward on dit-hunyuan-s2x8x8 from about 30.6 ms to 25-27 ms (1.1-1.15x the speed
# of light) if the two warpgroups overlap products and exponentials as v27's cycle count allows; edge-wide's
# backward default from 93.7 us towards assume_finite's 88.9 (the two redo launches' 4.8 us), less the
# registers the in-program redo costs dK/dV (255, 112 B spilled).
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
echo "=== 1. Gluon probe"
timeout 330 env PYTHONPATH=src python3 benchmarks/sm90_gluon_probe.py --out $OUT > $OUT/gluon_probe.log 2>&1
echo "probe rc=$? at ${SECONDS}s"; grep -E '"check": "FAIL"|exact|gpu_ms|error' $OUT/gluon_probe.log | cut -c1-400
echo "=== 2. edge-wide backward in program"
for round in 1 2; do
  for t in new:src bwdinprog:.ab/bwdinprog/src; do
    [ $SECONDS -gt 560 ] && break
    timeout 40 env PYTHONPATH=${t#*:} python3 benchmarks/ab_gpu_time.py --tag ${t%%:*} --repeats 3 --shapes edge-wide \
      >> $OUT/ab_edge_bwd.jsonl 2>> $OUT/ab.err; echo "ab ${t%%:*} rc=$? at ${SECONDS}s"
  done
done
[ $SECONDS -lt 560 ] && timeout 30 env PYTHONPATH=src python3 benchmarks/ab_gpu_time.py --tag newaf --repeats 3 \
  --shapes edge-wide --assume-finite >> $OUT/ab_edge_bwd.jsonl 2>> $OUT/ab.err
python3 - <<'PY'
import json, os, statistics
path = os.path.join(os.environ["OUT"], "ab_edge_bwd.jsonl")
runs = {}
for r in (json.loads(l) for l in open(path) if l.startswith("{")):
    runs.setdefault((r["name"], r["pass"]), {}).setdefault(r["tag"], []).append(r["gpu_ms"] * 1000)
for key, tags in runs.items():
    print(key, {t: round(statistics.median(v), 2) for t, v in tags.items()}, "us")
PY
echo "done at ${SECONDS}s"
