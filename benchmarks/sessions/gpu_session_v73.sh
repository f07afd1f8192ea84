#!/usr/bin/env bash
# One device call (under 10 minutes): the LTX rows of the results file from this tree, with NATTEN, in two parts
# (v46 cut one run at 300 s during ltx-stage5-tile). NOTES v49 changed the backward of ltx-stage1, ltx-stage5-small
# and edge-wide; the README's LTX rows are 5f61e8c's.
#   part 1: ltx-stage1, ltx-stage3, ltx-stage4-tile; part 2: ltx-stage5-tile, ltx-stage5-small, edge-wide, merged.
#   python -m na3d.bench --backward --rounds 2 --no-flex, all methods in one process (carry .peers for NATTEN).
# Expected (v71 on an H100, GPU time, fwd / bwd ms): stage1 0.445 / 1.31, stage3 0.578 / 1.90, stage4-tile 0.98 /
# 3.09, stage5-small 0.259 / 0.83, edge-wide 0.027 / 0.086; stage5-tile as 5f61e8c (24.5 / 71.2).
# Afterwards: results/h100.json from $OUT/bench-ltx.json (set its commit; keep the rows not re-measured with their
# own commit), the README's LTX rows from it, and the DiT rows from gpu_session_v68.sh on the same tree.
# Usage: PYTHONPATH=$PWD/.peers bash benchmarks/sessions/gpu_session_v73.sh <commit of this tree>   (carry .peers)
set -u
export PYTHONUNBUFFERED=1
COMMIT=${1:-unknown}
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env73.txt
timeout 280 env PYTHONPATH=src:${PYTHONPATH:-} python3 -m na3d.bench --backward --rounds 2 --no-flex \
  --shapes ltx-stage1 ltx-stage3 ltx-stage4-tile --commit $COMMIT --out-dir $OUT/part1 > $OUT/bench-ltx-part1.log 2>&1
echo "part 1 rc=$? at ${SECONDS}s"
# Part 2 merges part 1's rows; where part 1 wrote none (cut or failed), part 2 stands alone and says so.
P1=$(ls $OUT/part1/*.json 2>/dev/null | head -1)
MERGE=(); [ -n "$P1" ] && MERGE=(--merge "$P1") || echo "part 1 wrote no JSON: part 2 without its rows"
timeout $((585 - SECONDS)) env PYTHONPATH=src:${PYTHONPATH:-} python3 -m na3d.bench --backward --rounds 2 --no-flex \
  --shapes ltx-stage5-tile ltx-stage5-small edge-wide --commit $COMMIT "${MERGE[@]}" --out-dir $OUT \
  > $OUT/bench-ltx-part2.log 2>&1
echo "part 2 rc=$? at ${SECONDS}s"; tail -12 $OUT/bench-ltx-part2.log
