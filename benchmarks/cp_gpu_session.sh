#!/usr/bin/env bash
# Context parallel on real GPUs (benchmarks/context_parallel_bench.py): one session on a host
# with several GPUs. Logs and results (<card>.json, rows cp-*) go to $OUT.
#   bash benchmarks/cp_gpu_session.sh [env] [tiny] [2] [4] [8] [gloo1]
#     env    the GPUs, how they are linked, the versions
#     tiny   the tiny shapes on 2 GPUs, NCCL: the code path in a few seconds
#     2 4 8  both shapes (ltx-stage5, dit-hunyuan), both methods, the faults, on N GPUs, NCCL
#     gloo1  2 processes sharing GPU 0 over gloo (CUDA tensors through host memory): the code
#            path on one GPU; its times say nothing about NCCL
# (default: env tiny 2 4 8; a count above the GPUs present is skipped). Each step has its
# own time limit (env: N2_S, N4_S, N8_S, TINY_S, GLOO1_S, in seconds) so that one slow step
# cannot starve the others; CP_ARGS adds arguments to every run (e.g. "--methods halo
# halo_overlap head_parallel" or "--shard-dim 3"), NA3D_COMMIT names the measured tree.
set -u
OUT=${OUT:-/tmp/na3d-cp-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# NVLink multicast off (NCCL, PyTorch, NVSHMEM): it serves reductions, not the point-to-point
# and all-to-all traffic here, and on a shared host its multicast objects can leave the GPUs
# unusable for others. The script sets the same defaults; these keep them for any child.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
COMMIT=${NA3D_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
steps=" ${*:-env tiny 2 4 8} "
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
bench() {  # bench NAME SECONDS NPROC ARGS...
  local name=$1 limit=$2 nproc=$3
  shift 3
  echo "=== $name ($nproc processes, limit ${limit}s)"
  timeout "$limit" torchrun --standalone --nproc-per-node "$nproc" benchmarks/context_parallel_bench.py \
    --out-dir "$OUT" --commit "$COMMIT" "$@" ${CP_ARGS:-} > "$OUT/cp-$name.log" 2>&1
  echo "$name rc=$?"
  grep -E "tolerance|NaN|refused|skipped|passed|FAILED|Error|error" "$OUT/cp-$name.log" | grep -v "^W" | tail -30
  sed -n '/^row /,/^rows merged/p' "$OUT/cp-$name.log"
}
if [[ $steps == *" env "* ]]; then
  echo "=== env"
  { nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.sm --format=csv
    nvidia-smi topo -m
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
    env | grep -E "^(NCCL|TORCH_SYMM|NVSHMEM)_" ; } 2>&1 | tee "$OUT/cp-env.txt"
fi
if [[ $steps == *" tiny "* ]]; then
  if (( gpus >= 2 )); then bench tiny "${TINY_S:-240}" 2 --tiny; else echo "tiny: skipped ($gpus GPU)"; fi
fi
for n in 2 4 8; do
  if [[ $steps == *" $n "* ]]; then
    limit_var="N${n}_S"
    if (( gpus >= n )); then bench "${n}gpu" "${!limit_var:-540}" "$n"; else echo "${n}gpu: skipped ($gpus GPUs)"; fi
  fi
done
if [[ $steps == *" gloo1 "* ]]; then
  CUDA_VISIBLE_DEVICES=0 bench gloo1 "${GLOO1_S:-480}" 2 --backend gloo --shapes ltx-stage5 --runs 2
fi
