"""Context-parallel 3D neighborhood attention on ``torch.distributed``.

Each rank of a process group holds a contiguous slab of the global
``(B, T, H, W, NH, HD)`` tensors along one spatial dimension (``shard_dim`` 1 = T,
2 = H, 3 = W), slabs in rank order, possibly uneven, each at least one position
thick. Two ways to compute this rank's slab of exactly the single-device result:

* :func:`sharded_na3d` (halo exchange, :mod:`.halo`): each rank receives the keys
  and values its queries need from the other ranks' slabs (the halo, planned by
  :mod:`.plan`), then attends locally. Traffic per rank depends on the kernel, not
  on the slab.
* :func:`head_parallel_na3d` (Ulysses-style all-to-all, :mod:`.head_parallel`): each
  rank gets the whole grid for ``NH / world`` heads and runs :func:`na3d.na3d`
  unchanged. Traffic per rank is about four slabs, whatever the kernel.

:func:`halo_plan`, :func:`head_parallel_bytes` and :func:`traffic_table`
(:mod:`.traffic`) count the bytes behind the comparison in ``docs/distributed.md``;
``python -m na3d.distributed`` prints the table for the LTX stage-5 shape.
``examples/context_parallel.py`` runs both under ``torchrun``.

Both are differentiable, and backward is collective: every rank of the group must
run backward through the result (as with DDP). Arguments must match across ranks
and are checked on every rank (:mod:`.layout`): a bad argument on one rank raises on
all of them instead of leaving the others waiting in a collective.

Backends: NCCL with CUDA tensors (``torch.cuda.set_device`` called per rank), gloo
with CPU tensors. Gloo also takes CUDA tensors (several ranks may then share one GPU,
which NCCL refuses): its collectives copy through host memory themselves, and the halo
exchange's point-to-point messages are staged through host copies here; for checking
code paths on fewer GPUs than ranks, not for speed. Gradients flow through whatever :func:`na3d.na3d` differentiates
with on that device (its backward kernels on GPUs); the communication half of the
backward is the same everywhere.
"""

from .halo import halo_exchange, sharded_na3d
from .head_parallel import head_parallel_na3d
from .layout import SHARDABLE_DIMS, SlabLayout
from .plan import HaloTransfer, halo_exchange_plan, keys_needed, queries_within, slab_bounds
from .traffic import (LTX_STAGE5_KERNEL, LTX_STAGE5_SHAPE, HaloPlan, even_slab_sizes, halo_plan,
                      head_parallel_bytes, traffic_table)

__all__ = ["sharded_na3d", "head_parallel_na3d", "halo_exchange", "halo_plan", "head_parallel_bytes",
           "even_slab_sizes", "traffic_table", "HaloPlan", "SlabLayout", "HaloTransfer", "halo_exchange_plan",
           "keys_needed", "queries_within", "slab_bounds", "SHARDABLE_DIMS", "LTX_STAGE5_SHAPE",
           "LTX_STAGE5_KERNEL"]
