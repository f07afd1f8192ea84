#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v38: the final tree's strided rows with NATTEN, and the Gluon
# forward's non-finite check through the launcher (default against assume_finite, alternating), and the
# kernel with the turn passed once a warpgroup's scores are done (TURN_AFTER_SCORES; prediction: 0-3 %).
# Carry [".peers"] (NATTEN 0.21.7 Hopper FNA, ../shared/peers/README.md).
# Usage: bash benchmarks/sessions/gpu_session_v43.sh <commit of this tree>
# Predictions (v42, H100): dit-hunyuan-s2x8x8 and s2x8x16 forwards about 24.3 ms GPU time (1.04x the speed of
# light; NATTEN about 26.8 and 46), video-hd64-s4x4x8 about 5.2 ms (1.12x); backwards unchanged (105, 128, 26.6 ms).
set -u
export PYTHONUNBUFFERED=1
COMMIT=${1:-unknown}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee $OUT/env.txt
echo "=== 1. launcher: default against assume_finite (Gluon forward), alternating"
timeout 150 env PYTHONPATH=src python3 benchmarks/sm90_gluon_probe.py --out $OUT --skip-check --variants "" "TURN_AFTER_SCORES=1" \
  --rounds 3 > $OUT/gluon_probe.log 2>&1
echo "probe rc=$? at ${SECONDS}s"
python3 - <<'PY'
import json, os, statistics
runs = {}
for r in (json.loads(l) for l in open(os.path.join(os.environ["OUT"], "sm90_gluon_probe.jsonl")) if l.startswith("{")):
    if "round" in r:
        key = ("kernel " + r["variant"]) if r["method"] == "gluon" else ("af" if r["assume_finite"] else "default")
        runs.setdefault(r["row"], {}).setdefault(key, []).append(r["gpu_ms"])
for row, keys in runs.items():
    print(row, {k: (round(statistics.median(v), 3), [round(x, 2) for x in v]) for k, v in keys.items()})
PY
echo "=== 2. strided rows with NATTEN, this tree, one process"
timeout $((560 - SECONDS)) env PYTHONPATH=$PWD/.peers:$PWD/src python3 -m na3d.bench --group strided --backward \
  --no-flex --no-reference --no-comfy --commit $COMMIT --out-dir $OUT > $OUT/strided_bench.log 2>&1
echo "bench rc=$? at ${SECONDS}s"; tail -22 $OUT/strided_bench.log
echo "done at ${SECONDS}s"
