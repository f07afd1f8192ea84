#!/bin/bash
# The head-dim-128 large-window bucket's dK/dV pass (dit_large_window in configs/sm90.json), which
# tune_dit.sh's run on an H100 did not finish (../shared/measurements/2026-12-05-h100/tune_dit_large.log:
# five pairs at 4 warps timed, 179-453 ms on dit-hunyuan; the 8-warp candidates not reached). The forward
# and dQ keep the table's tiles (one dQ candidate, timed as the baseline's part); dK/dV tries boxes of
# 128 keys on 8 warps (two warpgroups of 64 key rows) beside the table's pair, one pipeline stage.
#
#   OUT=... bash benchmarks/tune_dit_dkdv.sh [--write]    # one device call, under 10 minutes
#
# Products issued per useful one on dit-hunyuan (geometry.issued_flops_ratio, key box / query box):
# 4x4x4/2x2x16 (the table) 1.765, 4x4x8/8x4x1 1.412, 4x4x8/2x4x8 1.525, 2x8x8/2x4x8 1.543.
set -u
OUT=${OUT:-.}
export PYTHONPATH=${PYTHONPATH:-}:$PWD/src
timeout ${TUNE_S:-560} python3 -m na3d.tools.tune --shapes dit-hunyuan dit-wan --buckets dit_large_window \
  --backward --no-forward --tma-only --pairs 2x8x4/2x4x4 --bwd-launch 4,2 \
  --dkdv-pairs 4x4x4/2x2x16 4x4x8/8x4x1 4x4x8/2x4x8 2x8x8/2x4x8 --dkdv-launch 8,1 4,1 \
  --log "$OUT/tune_dit_dkdv.json" "$@" 2>&1 | tee "$OUT/tune_dit_dkdv.log"
cp src/na3d/configs/sm90.json "$OUT/sm90.json"
