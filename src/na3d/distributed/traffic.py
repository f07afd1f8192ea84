"""Traffic of the two context-parallel methods, counted without running them.

:func:`halo_plan` counts the bytes each rank sends and receives in
:func:`na3d.distributed.sharded_na3d`'s exchange, :func:`head_parallel_bytes` those of
:func:`na3d.distributed.head_parallel_na3d`'s all-to-alls, and :func:`traffic_table`
puts them side by side (``docs/distributed.md``'s table; ``python -m
na3d.distributed`` prints it).
"""

import math
from dataclasses import dataclass
from typing import Sequence, Tuple, Union

import torch

from .layout import SHARDABLE_DIMS, kernel_triple
from .plan import HaloTransfer, halo_exchange_plan, keys_needed, slab_bounds


def even_slab_sizes(length: int, parts: int) -> Tuple[int, ...]:
    """``length`` cut into ``parts`` slabs differing by at most one (larger ones first).

    ``1 <= parts <= length``, else ``ValueError``.

    Example:
        >>> even_slab_sizes(79, 4)
        (20, 20, 20, 19)
    """
    if not isinstance(parts, int) or isinstance(parts, bool) or not 1 <= parts <= length:
        raise ValueError(f"parts={parts!r} must be an int between 1 and length={length}")
    return tuple(length // parts + (1 if r < length % parts else 0) for r in range(parts))


@dataclass(frozen=True)
class HaloPlan:
    """Traffic of one :func:`na3d.distributed.sharded_na3d` forward. The backward moves the
    same messages the other way (halo gradients back to their owners): in it each rank
    sends its forward ``received_bytes``."""

    shard_dim: int
    slab_sizes: Tuple[int, ...]
    transfers: Tuple[HaloTransfer, ...]
    key_ranges: Tuple[Tuple[int, int], ...]
    kv_bytes_per_position: int           # K and V of one position along shard_dim
    sent_bytes: Tuple[int, ...]          # per rank, forward
    received_bytes: Tuple[int, ...]      # per rank, forward (= sent in the backward)
    padded_query_overhead: Tuple[float, ...]  # extra query rows computed / own rows, per rank


def _normalize_sizes(global_shape: Sequence[int], slab_sizes, shard_dim: int) -> Tuple[int, ...]:
    if shard_dim not in SHARDABLE_DIMS:
        raise ValueError(f"shard_dim={shard_dim!r} must be 1 (T), 2 (H) or 3 (W)")
    if len(global_shape) != 6:
        raise ValueError(f"global_shape={tuple(global_shape)} must be (B, T, H, W, NH, HD)")
    length = global_shape[shard_dim]
    if isinstance(slab_sizes, int) and not isinstance(slab_sizes, bool):
        return even_slab_sizes(length, slab_sizes)
    sizes = tuple(slab_sizes)
    if sum(sizes) != length:
        raise ValueError(f"slab_sizes={sizes} must add up to global_shape[{shard_dim}]={length}")
    slab_bounds(sizes)  # positive ints
    return sizes


def halo_plan(global_shape: Sequence[int], kernel_size: Union[int, Sequence[int]],
              slab_sizes: Union[int, Sequence[int]], *, shard_dim: int = 1,
              dtype: torch.dtype = torch.bfloat16) -> HaloPlan:
    """Bytes each rank sends and receives in :func:`na3d.distributed.sharded_na3d`'s forward.

    Counts exactly the messages ``sharded_na3d`` posts; its backward sends the same
    messages back, so a rank sends its ``received_bytes`` in the backward. Pure arithmetic: no process group, no device.

    Args:
        global_shape: ``(B, T, H, W, NH, HD)`` of the whole problem.
        kernel_size: int or ``(KT, KH, KW)``, ``1 <= K <= size`` per axis.
        slab_sizes: one int per rank, adding up to ``global_shape[shard_dim]``, or the
            number of ranks for an even split (:func:`even_slab_sizes`).
        shard_dim: 1 (T), 2 (H) or 3 (W).
        dtype: the element type of K and V.

    Returns:
        A :class:`HaloPlan`: the transfers, each rank's key range, bytes sent and
        received per rank, and the padded-query overhead per rank.

    Raises:
        ValueError: a shape, kernel, slab list or shard_dim out of range.

    Example:
        >>> plan = halo_plan((1, 79, 192, 192, 4, 64), (11, 11, 11), 4)   # LTX stage 5, bf16
        >>> plan.slab_sizes, plan.key_ranges[1]
        ((20, 20, 20, 19), (15, 45))
        >>> [b >> 20 for b in plan.sent_bytes]   # MiB per rank
        [180, 360, 360, 180]
    """
    sizes = _normalize_sizes(global_shape, slab_sizes, shard_dim)
    ks = kernel_triple(kernel_size)
    kernel = ks[shard_dim - 1]
    element = torch.empty((), dtype=dtype).element_size()
    per_position = 2 * math.prod(global_shape) // global_shape[shard_dim] * element
    transfers = tuple(halo_exchange_plan(sizes, kernel))
    sent, received = [0] * len(sizes), [0] * len(sizes)
    for t in transfers:
        sent[t.sender] += (t.stop - t.start) * per_position
        received[t.receiver] += (t.stop - t.start) * per_position
    bounds = slab_bounds(sizes)
    ranges = tuple(keys_needed(a, b, global_shape[shard_dim], kernel) for a, b in bounds)
    overhead = tuple(((u1 - u0) - (b - a)) / (b - a) for (u0, u1), (a, b) in zip(ranges, bounds))
    return HaloPlan(shard_dim, sizes, transfers, ranges, per_position, tuple(sent), tuple(received), overhead)


def head_parallel_bytes(global_shape: Sequence[int], slab_sizes: Union[int, Sequence[int]], *,
                        shard_dim: int = 1, dtype: torch.dtype = torch.bfloat16,
                        backward: bool = False) -> Tuple[int, ...]:
    """Bytes each rank sends in :func:`na3d.distributed.head_parallel_na3d`'s forward (both all-to-alls).

    Rank r sends q, k, v of its slab for the other ranks' heads, then the output of
    its heads at the other ranks' positions. The backward runs the reverse
    all-to-alls (dO first, then dQ, dK, dV): each rank sends what it received in the
    forward, ``backward=True`` counts that. With even slabs the two are equal; with
    uneven ones a thicker slab sends more in the forward and less in the backward.
    Counts only what leaves the rank. Valid when the head count divides by the number
    of ranks (otherwise head_parallel_na3d refuses).

    Arguments as :func:`halo_plan` (without a kernel: the traffic does not depend on
    it). Raises ``ValueError`` when ``NH`` does not divide by the number of ranks.

    Example:
        >>> [b >> 20 for b in head_parallel_bytes((1, 79, 192, 192, 4, 64), 4)]   # MiB per rank
        [1075, 1075, 1075, 1039]
    """
    sizes = _normalize_sizes(global_shape, slab_sizes, shard_dim)
    world = len(sizes)
    if global_shape[4] % world:
        raise ValueError(f"global_shape={tuple(global_shape)}: {global_shape[4]} heads do not split "
                         f"evenly over {world} ranks")
    element = torch.empty((), dtype=dtype).element_size()
    length = global_shape[shard_dim]
    per_position_all_heads = math.prod(global_shape) // length * element
    per_position_per_rank_heads = per_position_all_heads // world
    if backward:
        return tuple(n * per_position_per_rank_heads * (world - 1)          # dO out
                     + 3 * (length - n) * per_position_per_rank_heads       # dQ, dK, dV back
                     for n in sizes)
    return tuple(3 * n * per_position_per_rank_heads * (world - 1)          # q, k, v out
                 + (length - n) * per_position_per_rank_heads               # output back
                 for n in sizes)


LTX_STAGE5_SHAPE = (1, 79, 192, 192, 4, 64)
LTX_STAGE5_KERNEL = (11, 11, 11)


def traffic_table(global_shape: Sequence[int] = LTX_STAGE5_SHAPE,
                  kernel_size: Union[int, Sequence[int]] = LTX_STAGE5_KERNEL,
                  world_sizes: Sequence[int] = (2, 4, 8), shard_dims: Sequence[int] = (1, 2),
                  dtype: torch.dtype = torch.bfloat16) -> str:
    """Markdown table: halo vs all-to-all bytes each rank sends in one forward (the doc's table).

    One row per ``shard_dim`` of ``shard_dims`` and number of ranks of ``world_sizes``
    (even splits); arguments otherwise as :func:`halo_plan`.

    Example:
        >>> print(traffic_table(world_sizes=(2,), shard_dims=(1,)).splitlines()[-1])
        | T | 2 | 40, 39 | 180, 180 | 1431 | 0.13 | 13% |
    """
    mib = float(1 << 20)
    lines = ["| split | ranks | slab sizes | halo sent per rank, MiB (rank 0, 1, ...) "
             "| all-to-all sent per rank, MiB (max) | halo / all-to-all (max) "
             "| padded-query overhead (max) |",
             "|---|---|---|---|---|---|---|"]
    for shard_dim in shard_dims:
        for world in world_sizes:
            plan = halo_plan(global_shape, kernel_size, world, shard_dim=shard_dim, dtype=dtype)
            sizes = plan.slab_sizes
            halo = ", ".join(f"{b / mib:.0f}" for b in plan.sent_bytes)
            if global_shape[4] % world == 0:
                a2a_max = max(head_parallel_bytes(global_shape, sizes, shard_dim=shard_dim, dtype=dtype))
                a2a, ratio = f"{a2a_max / mib:.0f}", f"{max(plan.sent_bytes) / a2a_max:.2f}"
            else:
                a2a, ratio = f"n/a ({global_shape[4]} heads)", "n/a"
            lines.append(
                f"| {SHARDABLE_DIMS[shard_dim]} | {world} | {', '.join(map(str, sizes))} | {halo} | {a2a} "
                f"| {ratio} | {max(plan.padded_query_overhead):.0%} |")
    return "\n".join(lines)
