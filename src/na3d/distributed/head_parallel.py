"""Context parallelism by head-parallel all-to-all (Ulysses-style): :func:`head_parallel_na3d`.

An all-to-all turns position slabs into head groups, so each rank holds the whole
grid for ``NH / world`` heads, runs :func:`na3d.na3d` unchanged, and a second
all-to-all brings the output back. Traffic per rank is about ``4 * (world - 1) /
world`` slabs (q, k, v, then the output), whatever the kernel. Differentiable: the
gradient of an all-to-all is the reverse all-to-all.
"""

import math
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..api import na3d
from .layout import SlabLayout, slab_layout


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` on flat tensors; its gradient is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, send_counts: List[int], receive_counts: List[int], group):
        ctx.counts, ctx.group = (send_counts, receive_counts), group
        out = flat.new_empty(sum(receive_counts))
        dist.all_to_all_single(out, flat.contiguous(), output_split_sizes=receive_counts,
                               input_split_sizes=send_counts, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        send_counts, receive_counts = ctx.counts
        grad_in = grad_out.new_empty(sum(send_counts))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), output_split_sizes=send_counts,
                               input_split_sizes=receive_counts, group=ctx.group)
        return grad_in, None, None, None


def _slabs_to_heads(x: torch.Tensor, layout: SlabLayout, group) -> torch.Tensor:
    """``(B, n_rank.., NH, *tail)`` position slab -> ``(B, full grid, NH / world, *tail)``.

    Rank ``j`` receives heads ``[j * nh, (j + 1) * nh)`` of every slab.
    """
    world, dim = layout.world_size, layout.shard_dim
    heads = x.shape[4]
    per_rank = x.unflatten(4, (world, heads // world)).movedim(4, 0).contiguous()
    chunk_shape = list(per_rank.shape[1:])
    chunk_numel = math.prod(chunk_shape)
    receive_shapes = []
    for size in layout.slab_sizes:
        shape = list(chunk_shape)
        shape[dim] = size
        receive_shapes.append(shape)
    receive_counts = [math.prod(s) for s in receive_shapes]
    flat = _AllToAll.apply(per_rank.reshape(-1), [chunk_numel] * world, receive_counts, group)
    pieces = [p.view(s) for p, s in zip(flat.split(receive_counts), receive_shapes)]
    return torch.cat(pieces, dim)


def _heads_to_slabs(x: torch.Tensor, layout: SlabLayout, group) -> torch.Tensor:
    """Inverse of :func:`_slabs_to_heads`: ``(B, full grid, nh, *tail)`` -> own slab, all heads."""
    world, dim = layout.world_size, layout.shard_dim
    slabs = [s.contiguous().reshape(-1) for s in x.split(list(layout.slab_sizes), dim)]
    send_counts = [s.numel() for s in slabs]
    own_shape = list(x.shape)
    own_shape[dim] = layout.slab_sizes[layout.rank]
    own_numel = math.prod(own_shape)
    flat = _AllToAll.apply(torch.cat(slabs), send_counts, [own_numel] * world, group)
    per_rank = flat.view(world, *own_shape)            # (world, B, n_rank.., nh, *tail)
    return per_rank.movedim(0, 4).flatten(4, 5)        # heads j * nh .. came from rank j


def head_parallel_na3d(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       kernel_size: Union[int, Sequence[int]], *, group: Optional[dist.ProcessGroup] = None,
                       shard_dim: int = 1, slab_sizes: Optional[Sequence[int]] = None,
                       **na3d_kwargs) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`na3d.distributed.sharded_na3d`'s contract, computed head-parallel (Ulysses-style).

    One all-to-all sends each rank all positions of ``NH / world`` heads (q, k and v
    in one message per peer), :func:`na3d.na3d` runs unchanged on the full grid, and
    a second all-to-all returns each rank its slab with all heads. Exact for any
    kernel, with no padded queries, but it moves about four slabs per rank per pass
    whatever the kernel (:func:`na3d.distributed.head_parallel_bytes`), and each rank
    holds the full grid of its heads. Collective, forward and backward.

    Args:
        query: this rank's slab ``(B, n_rank, H, W, NH, HD)`` (for ``shard_dim=1``) of
            the global query; ``NH`` divisible by the group's size.
        key: the same slab of the global key, query's shape.
        value: the same slab of the global value, query's shape.
        kernel_size: int or ``(KT, KH, KW)``, ``1 <= K <= global size`` per axis.
        group: the process group (default: the world); NCCL or gloo.
        shard_dim: 1 (T), 2 (H) or 3 (W).
        slab_sizes: every rank's slab size, or None to learn them (one ``all_gather``).
        **na3d_kwargs: passed to :func:`na3d.na3d` (``scale``, ``return_lse``;
            ``stride``, ``dilation``, ``is_causal`` at their defaults only).

    Returns:
        What :func:`na3d.na3d` returns, for this rank's slab; differentiable (the
        gradient of an all-to-all is the reverse all-to-all).

    Raises:
        ValueError: ``NH`` does not divide by the group's size, or (on every rank) any
            rank's arguments are wrong; TypeError likewise.
        NotImplementedError, RuntimeError: as :func:`na3d.distributed.sharded_na3d`.

    Example (``examples/context_parallel.py``)::

        out = head_parallel_na3d(*local, (3, 5, 5), shard_dim=1)   # the same rows as sharded_na3d
    """
    group, layout = slab_layout({"query": query, "key": key, "value": value}, kernel_size, shard_dim, group,
                                slab_sizes, na3d_kwargs)
    heads = layout.global_shape[4]
    if heads % layout.world_size:
        raise ValueError(f"query has {heads} heads (query.shape[4]), which the {layout.world_size} ranks "
                         "of the group cannot split evenly; use sharded_na3d")
    qkv = _slabs_to_heads(torch.stack([query, key, value], dim=5), layout, group)
    q_heads, k_heads, v_heads = qkv.unbind(5)
    result = na3d(q_heads, k_heads, v_heads, layout.kernel_size, **na3d_kwargs)
    if isinstance(result, tuple):  # (out, lse): lse has no head-dim axis
        out, lse = result
        lse = _heads_to_slabs(lse.unsqueeze(-1), layout, group).squeeze(-1)
        return _heads_to_slabs(out, layout, group), lse
    return _heads_to_slabs(result, layout, group)
