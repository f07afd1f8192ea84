"""Context-parallel na3d: each rank holds a slab of frames, and gets exactly its rows of the result.

    torchrun --standalone --nproc-per-node 2 examples/context_parallel.py                 # gloo, CPU
    torchrun --standalone --nproc-per-node 2 examples/context_parallel.py --device cuda   # NCCL, a GPU per rank

Every rank draws the same global q, k, v (same seed), keeps its slab along T (the
frames; ``--shard-dim`` 2 or 3 for H or W) and runs both methods of
``na3d.distributed``: the halo exchange (``sharded_na3d``) and the head-parallel
all-to-all (``head_parallel_na3d``). Each rank compares its rows of the outputs and
of the gradients with single-process ``na3d`` on the full tensors.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

import na3d
from na3d.distributed import even_slab_sizes, head_parallel_na3d, sharded_na3d


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (gloo, default) or cuda (NCCL)")
    parser.add_argument("--shard-dim", type=int, default=1, choices=(1, 2, 3), help="1 = T, 2 = H, 3 = W")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("start it with torchrun, e.g. torchrun --standalone --nproc-per-node 2 " + __file__)

    if args.device == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dim = args.shard_dim

    # The global problem, the same on every rank. The heads must divide by the number
    # of ranks for head_parallel_na3d; sharded_na3d takes any.
    shape, kernel = (1, 12, 10, 12, 4 * world, 32), (3, 5, 5)
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(shape, generator=gen).to(device) for _ in range(4))

    # This rank's slab: contiguous, in rank order (uneven sizes are fine).
    sizes = even_slab_sizes(shape[dim], world)
    start = sum(sizes[:rank])

    def slab(t: torch.Tensor) -> torch.Tensor:
        return t.narrow(dim, start, sizes[rank])

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    full = na3d.na3d(*leaves, kernel)
    want = torch.autograd.grad(full, leaves, grad_out)
    for name, method in (("sharded_na3d (halo exchange)", sharded_na3d),
                         ("head_parallel_na3d (all-to-all)", head_parallel_na3d)):
        local = [slab(t).detach().requires_grad_() for t in (q, k, v)]
        out = method(*local, kernel, shard_dim=dim)
        grads = torch.autograd.grad(out, local, slab(grad_out))  # collective: every rank runs it
        err = max([(out - slab(full)).abs().max().item()]
                  + [(g - slab(w)).abs().max().item() for g, w in zip(grads, want)])
        print(f"rank {rank}/{world}: {name}: slab {tuple(out.shape)}, max abs difference to single-process "
              f"na3d (output, dq, dk, dv) {err:.1e}", flush=True)
        # float32 on both sides, the same windows: only the summation order differs.
        assert err < 1e-5, f"{name}: rank {rank} differs from single-process na3d by {err:.1e}"
    # Every rank done with its collectives before any tears its group down: a rank
    # that destroys its gloo group while the other's last exchange is in flight
    # can abort that one ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Every check passed. Under load, the CPU build's gloo sometimes aborts in its
    # destructors at interpreter exit ("terminate called without an active
    # exception", after the group was destroyed): leave without them, as the
    # multi-process tests do (tests/distributed/ranks.py). A failed check raises
    # above and exits non-zero.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
