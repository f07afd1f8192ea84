#!/usr/bin/env bash
# A short device call (the session's last 220 s of device time): gpu_session_v47.sh reduced to
# dit-hunyuan-s2x8x8's forward row, three rounds taking turns, clock logged. Carry [".peers"].
# Usage: bash benchmarks/gpu_session_v47a.sh <commit of this tree>
# Prediction: na3d's forward median at or below NATTEN's (v43 single measurements: 27.45 against 26.52 ms; the
# probe's kernel alone 24.4 ms in most rounds).
set -u
export PYTHONUNBUFFERED=1
COMMIT=${1:-unknown}
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 200 > $OUT/clocks.csv 2>&1 &
timeout 140 env PYTHONPATH=$PWD/.peers:$PWD/src python3 -m na3d.bench --shapes dit-hunyuan-s2x8x8 --rounds 3 \
  --no-flex --no-reference --no-comfy --commit $COMMIT --out-dir $OUT > $OUT/strided_bench.log 2>&1
echo "bench rc=$? at ${SECONDS}s"; tail -8 $OUT/strided_bench.log
python3 -c "
import json, glob
for f in glob.glob('$OUT/*.json'):
    for r in json.load(open(f))['rows']:
        print(r['name'], r['pass'], 'ms', r['ms'], 'rounds', r.get('ms_rounds'), 'sol', r.get('speed_of_light_ms'), 'gpu', r.get('gpu_ms'))
"
