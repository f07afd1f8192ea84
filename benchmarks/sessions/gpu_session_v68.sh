#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v46 "Next on a GPU" item 1: the DiT rows from this tree with NATTEN
# (the README's DiT rows are 54653c9's; the configurations of these three shapes have not changed since, the
# kernels only in the dK/dV kernel's non-finite check, ac67719).
#   python -m na3d.bench --backward --group dit --no-flex, all methods in one process; results into $OUT
#   (commit them as results/<card>-dit-<sha>.json with the .png, and the README's DiT rows from them).
# Usage: carry [".peers"]; PYTHONPATH=$PWD/.peers bash benchmarks/sessions/gpu_session_v68.sh <commit of this tree>
# Expected (54653c9 on an H100, v58): na3d forward 55.2 / 2.10 / 4.46 ms GPU time on dit-hunyuan / dit-wan /
# dit-small-window, backward 176 / 8.11 / 15.7 (dit-small-window's backward spread 15.3-17.5 between repeats
# in v66: the clock at the power cap); NATTEN's forward+backward about 334 / 17 / 41 ms.
set -u
export PYTHONUNBUFFERED=1
COMMIT=${1:-unknown}
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
timeout 585 env PYTHONPATH=src:${PYTHONPATH:-} python3 -m na3d.bench --backward --group dit --no-flex \
  --commit $COMMIT --out-dir $OUT > $OUT/bench.log 2>&1
echo "bench rc=$? at ${SECONDS}s"; tail -14 $OUT/bench.log
