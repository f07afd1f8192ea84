#!/bin/bash
# The head-dim-128 large-window bucket's dK/dV pass (dit_large_window in configs/sm90.json), which
# tune_dit.sh's run on an H100 did not finish (../shared/measurements/2026-12-05-h100/tune_dit_large.log:
# five pairs at 4 warps timed, 179-453 ms on dit-hunyuan; the 8-warp candidates not reached). The forward
# and dQ keep the table's tiles; the tuner times the table's dK/dV first, then boxes of 128 keys on 8 warps
# (two warpgroups of 64 key rows).
#
#   OUT=... bash benchmarks/tune_dit_dkdv.sh [--write]    # one device call, under 10 minutes
#
# Screened by compiling for sm90 here (NOTES v40; key box / query box, warps, stages: products issued per
# useful one on dit-hunyuan, registers, programs per SM, key-loop instructions, local loads and stores
# per step):
#   the table's 4x4x4/2x2x16, 4, 1: 1.765, 255, 2, 861, 15 (it spills)
#   4x4x8/2x4x8, 8, 2:             1.525, 255, 1, 850, 0
#   4x4x8/2x4x8, 8, 1:             1.525, 255, 1, 863, 13
#   4x4x8/8x4x1, 8, 1:             1.412, 255, 1, 545, 0 (32-query boxes: half the products per step)
#   2x8x8/1x8x8, 8, 1:             1.548, 255, 1, 907, 5
# (Those "products issued per useful one" are the forward's count with the boxes swapped; the dK/dV kernel
# issues 1.669 with both the table's pair and 4x4x8/2x4x8: NOTES v48.)
# Prediction: 4x4x8/2x4x8 on 8 warps and 2 stages about 15 % faster dK/dV than the table's (14 % fewer
# products, no spills, the same instructions per product), the backward about 8 % (179 -> ~165 ms).
set -u
OUT=${OUT:-.}
export PYTHONPATH=${PYTHONPATH:-}:$PWD/src
timeout ${TUNE_S:-560} python3 -m na3d.tools.tune --shapes dit-hunyuan dit-wan --buckets dit_large_window \
  --backward --no-forward --tma-only --pairs 2x8x4/2x4x4 --bwd-launch 4,2 \
  --dkdv-pairs 4x4x8/2x4x8 4x4x8/8x4x1 2x8x8/1x8x8 --dkdv-launch 8,2 8,1 \
  --log "$OUT/tune_dit_dkdv.json" "$@" 2>&1 | tee "$OUT/tune_dit_dkdv.log"
cp src/na3d/configs/sm90.json "$OUT/sm90.json"
