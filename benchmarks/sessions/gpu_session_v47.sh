#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v38 (next session): the strided rows with NATTEN, every method timed
# in three rounds taking turns (bench --rounds 3; the speed of light's dense base as often), with the GPU's clock
# logged beside them. Carry [".peers"].
# Usage: bash benchmarks/sessions/gpu_session_v47.sh <commit of this tree>
# Prediction (v43's single measurements, H100): dit-hunyuan-s2x8x8 forward 24.4-27.4 ms against NATTEN's 26.5;
# with turns and medians, na3d's forward at or below NATTEN's on every strided row (the probe's kernel alone sat
# at 24.4 ms in most rounds); forwards within 1.15x of the speed of light.
set -u
export PYTHONUNBUFFERED=1
COMMIT=${1:-unknown}
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 200 > $OUT/clocks.csv 2>&1 &
timeout 580 env PYTHONPATH=$PWD/.peers:$PWD/src python3 -m na3d.bench --group strided --backward --rounds 3 \
  --no-flex --no-reference --no-comfy --commit $COMMIT --out-dir $OUT > $OUT/strided_bench.log 2>&1
echo "bench rc=$? at ${SECONDS}s"; tail -24 $OUT/strided_bench.log
echo "done at ${SECONDS}s"
