#!/bin/bash
# Tune the head-dim-128 large-window bucket (dit_large_window in configs/sm90.json) on
# the H200 from the candidates screened by compiling for sm90 (benchmarks/NOTES.md
# v20: no spills, no serialized warpgroup products), then time the video-DiT rows.
#
#   bash benchmarks/tune_dit.sh            # writes the table and logs under ${OUT:-.}
#
# Forward and dQ pairs are (query box / key box); dK/dV pairs (key box / query box).
# dK/dV runs one pipeline stage: with two or more ptxas serializes its products at
# head dim 128. --fused also times each dK/dV candidate as the one-pass backward.
# About 8 minutes on an H200 (compiling dominates); the table is rewritten after
# each pass, so a cut run keeps the forward's choice.
set -u
OUT=${OUT:-.}
export PYTHONPATH=${PYTHONPATH:-}:$PWD/src
python -m na3d.tools.tune --shapes dit-hunyuan dit-wan --buckets dit_large_window \
  --backward --tma-only --fused --write --log "$OUT/tune_dit_large.json" \
  --pairs 2x8x4/2x4x4 2x8x4/1x8x4 2x8x4/2x8x2 4x8x2/1x2x16 2x8x8/2x4x4 2x4x4/2x4x4 4x4x4/2x2x16 \
  --launch 4,2 8,2 2,2 \
  --bwd-launch 4,2 8,2 \
  --dkdv-pairs 4x4x4/2x4x4 2x4x8/4x8x1 4x4x8/8x4x1 2x2x16/2x8x2 4x4x4/2x2x16 \
  --dkdv-launch 4,1 8,1 2>&1 | tee "$OUT/tune_dit_large.log"
cp src/na3d/configs/sm90.json "$OUT/sm90.json"
