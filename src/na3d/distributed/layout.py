"""Arguments of the distributed functions, checked on every rank, and the slab layout.

Arguments must match across ranks (kernel_size, shard_dim, the shape outside
``shard_dim``, na3d's keyword arguments). Slab sizes are gathered once per call with
one small ``all_gather`` of ints, which also carries a flag for "this rank rejected
its arguments", so a bad argument on one rank raises on every rank instead of leaving
the others waiting in a collective. Passing ``slab_sizes`` skips that gather (and
with it the cross-rank checks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .plan import keys_needed, slab_bounds

SHARDABLE_DIMS = {1: "T", 2: "H", 3: "W"}
FORWARDED_NA3D_KWARGS = ("stride", "dilation", "is_causal", "scale", "return_lse")

# Layout of the int64 vector every rank contributes to the metadata all_gather.
_META_FLAG, _META_SHARD_DIM, _META_KERNEL, _META_SHAPE = 0, 1, 2, 5
_META_LENGTH = 11


def kernel_triple(kernel_size) -> Tuple[int, int, int]:
    def is_int(x):
        return isinstance(x, int) and not isinstance(x, bool)

    if is_int(kernel_size):
        return (kernel_size,) * 3
    if isinstance(kernel_size, (tuple, list)) and len(kernel_size) == 3 and all(map(is_int, kernel_size)):
        return tuple(kernel_size)
    raise TypeError(f"kernel_size={kernel_size!r} must be an int or a tuple of 3 ints")


def _check_na3d_kwargs(na3d_kwargs: Mapping) -> None:
    """Only what na3d accepts, and only what the halo geometry covers."""
    for name in na3d_kwargs:
        if name not in FORWARDED_NA3D_KWARGS:
            raise TypeError(f"unexpected keyword argument {name!r}; na3d keyword arguments are "
                            f"{', '.join(FORWARDED_NA3D_KWARGS)}")
    # The halo plan is the dilation-1, non-causal, stride-1 geometry; other settings
    # would need other key ranges, so refuse them here even once na3d accepts them.
    for name, neutral in (("stride", 1), ("dilation", 1), ("is_causal", False)):
        if name in na3d_kwargs:
            value = na3d_kwargs[name]
            values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
            if any(type(x) is not type(neutral) for x in values):
                kind = type(neutral).__name__
                raise TypeError(f"{name}={value!r} must be a {kind} or a tuple of 3 {kind}s")
            if any(x != neutral for x in values):
                raise NotImplementedError(f"{name}={value!r}: the distributed functions support only "
                                          f"{name}={neutral!r}")


def _local_problem(tensors: Mapping[str, torch.Tensor], kernel_size, shard_dim, na3d_kwargs: Mapping,
                   overlap: bool = False) -> Optional[Exception]:
    """The first thing wrong with this rank's own arguments, or None.

    Returned rather than raised so that the rank can still join the metadata gather
    and tell the others (who would otherwise wait for it forever).
    """
    try:
        _check_na3d_kwargs(na3d_kwargs)
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap={overlap!r} must be a bool")
        kernel_triple(kernel_size)
        if not isinstance(shard_dim, int) or isinstance(shard_dim, bool):
            raise TypeError(f"shard_dim={shard_dim!r} must be an int (1 = T, 2 = H, 3 = W)")
        if shard_dim not in SHARDABLE_DIMS:
            raise ValueError(f"shard_dim={shard_dim} must be 1 (T), 2 (H) or 3 (W) of (B, T, H, W, NH, HD)")
        reference_name, reference = None, None
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 6:
                raise ValueError(f"{name} must have rank 6 (B, T, H, W, NH, HD); got {name}.shape={tuple(t.shape)}")
            if reference is None:
                reference_name, reference = name, t
                continue
            if t.shape != reference.shape:
                raise ValueError(f"{reference_name} and {name} must have the same shape; got "
                                 f"{tuple(reference.shape)} and {tuple(t.shape)}")
            if t.dtype != reference.dtype:
                raise TypeError(f"{reference_name} and {name} must share one dtype; got {reference.dtype} and {t.dtype}")
            if t.device != reference.device:
                raise ValueError(f"{reference_name} and {name} must be on one device; got "
                                 f"{reference.device} and {t.device}")
        if reference.shape[shard_dim] < 1:
            raise ValueError(f"{reference_name}.shape[{shard_dim}] = 0: every rank's slab along shard_dim "
                             "must be at least one position thick")
    except (TypeError, ValueError, NotImplementedError) as problem:
        return problem
    return None


@dataclass(frozen=True)
class SlabLayout:
    """How the global tensors are cut: this rank's slab and everybody's sizes."""

    rank: int
    slab_sizes: Tuple[int, ...]
    shard_dim: int
    global_shape: Tuple[int, ...]      # (B, T, H, W, NH, HD)
    kernel_size: Tuple[int, int, int]

    @property
    def world_size(self) -> int:
        return len(self.slab_sizes)

    @property
    def length(self) -> int:
        """Global length of the sharded axis."""
        return self.global_shape[self.shard_dim]

    @property
    def kernel(self) -> int:
        """Kernel size along the sharded axis."""
        return self.kernel_size[self.shard_dim - 1]

    @property
    def bounds(self) -> List[Tuple[int, int]]:
        return slab_bounds(self.slab_sizes)

    @property
    def slab(self) -> Tuple[int, int]:
        """``[a, b)``: this rank's positions along the sharded axis."""
        return self.bounds[self.rank]

    @property
    def key_range(self) -> Tuple[int, int]:
        """``[u0, u1)``: the keys this rank's queries need."""
        a, b = self.slab
        return keys_needed(a, b, self.length, self.kernel)


def _collective_device(group, example) -> torch.device:
    """Where the small metadata tensor lives: next to the data, or where the backend wants it."""
    if isinstance(example, torch.Tensor):
        return example.device
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _resolve_group(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
    if group is None:
        group = dist.group.WORLD
    if dist.get_rank(group) < 0:
        raise ValueError(f"group={group!r}: this process is not a member of the group")
    return group


def slab_layout(
    tensors: Mapping[str, torch.Tensor],
    kernel_size,
    shard_dim,
    group,
    slab_sizes: Optional[Sequence[int]],
    na3d_kwargs: Optional[Mapping] = None,
    overlap: bool = False,
) -> Tuple[dist.ProcessGroup, SlabLayout]:
    """Validate the arguments on every rank and agree on the slab sizes.

    Returns the process group (``group``, or the default group for None) and the
    layout. Collective unless ``slab_sizes`` is given: every rank of the group must
    call it.
    """
    group = _resolve_group(group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    problem = _local_problem(tensors, kernel_size, shard_dim, na3d_kwargs or {}, overlap)
    example = next(iter(tensors.values()))
    first_name = next(iter(tensors))

    if slab_sizes is None:
        meta = [0] * _META_LENGTH
        if problem is not None:
            meta[_META_FLAG] = 1
        else:
            meta[_META_SHARD_DIM] = shard_dim
            meta[_META_KERNEL:_META_KERNEL + 3] = kernel_triple(kernel_size)
            meta[_META_SHAPE:_META_SHAPE + 6] = example.shape
        device = _collective_device(group, example)
        mine = torch.tensor(meta, dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=group)
        rows = [g.tolist() for g in gathered]
        rejected = [r for r, row in enumerate(rows) if row[_META_FLAG]]
        if problem is not None:
            raise problem
        if rejected:
            raise ValueError(f"rank(s) {rejected} of the group rejected their arguments (the error is raised "
                             "there); every rank must pass matching, valid arguments")
        if len({row[_META_SHARD_DIM] for row in rows}) > 1:
            raise ValueError(f"shard_dim differs across ranks: {[row[_META_SHARD_DIM] for row in rows]}")
        kernels = [tuple(row[_META_KERNEL:_META_KERNEL + 3]) for row in rows]
        if len(set(kernels)) > 1:
            raise ValueError(f"kernel_size differs across ranks: {kernels}")
        shapes = [row[_META_SHAPE:_META_SHAPE + 6] for row in rows]
        outside = {tuple(s[:shard_dim] + s[shard_dim + 1:]) for s in shapes}
        if len(outside) > 1:
            raise ValueError(f"{first_name}.shape must agree across ranks outside shard_dim={shard_dim}; "
                             f"got {[tuple(s) for s in shapes]}")
        sizes = tuple(s[shard_dim] for s in shapes)
    else:
        if problem is not None:
            raise problem
        if not isinstance(slab_sizes, (tuple, list)) or len(slab_sizes) != world:
            raise ValueError(f"slab_sizes={slab_sizes!r} must be a list of {world} ints, one per rank of the group")
        if any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in slab_sizes):
            raise ValueError(f"slab_sizes={slab_sizes!r}: every slab must be a positive int")
        if slab_sizes[rank] != example.shape[shard_dim]:
            raise ValueError(f"slab_sizes[{rank}]={slab_sizes[rank]} does not match this rank's "
                             f"{first_name}.shape[{shard_dim}]={example.shape[shard_dim]}")
        sizes = tuple(slab_sizes)

    ks = kernel_triple(kernel_size)
    global_shape = list(example.shape)
    global_shape[shard_dim] = sum(sizes)
    for axis, k, size in zip("THW", ks, global_shape[1:4]):
        if not 1 <= k <= size:
            raise ValueError(f"kernel_size={ks}: along {axis} it must be between 1 and the global size {size}")
    return group, SlabLayout(rank, sizes, shard_dim, tuple(global_shape), ks)
