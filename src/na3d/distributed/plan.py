"""The halo plan: which keys a slab of queries needs, and who sends what.

A global axis of length ``L`` is cut into contiguous slabs, one per rank in rank
order. The functions here are pure integer geometry on :mod:`na3d.geometry`'s
windows (dilation 1, non-causal, stride 1); :mod:`na3d.distributed.halo` turns them
into point-to-point messages and :mod:`na3d.distributed.traffic` into byte counts.
"""

from typing import List, NamedTuple, Sequence, Tuple

from ..geometry import window_start


class HaloTransfer(NamedTuple):
    """Positions ``[start, stop)`` (global) of ``sender``'s slab that ``receiver`` needs."""

    sender: int
    receiver: int
    start: int
    stop: int


def _check_axis(length: int, kernel_size: int) -> None:
    if not isinstance(kernel_size, int) or isinstance(kernel_size, bool) or kernel_size < 1:
        raise ValueError(f"kernel_size={kernel_size!r} must be a positive int")
    if kernel_size > length:
        raise ValueError(f"kernel_size={kernel_size} must not exceed the axis length {length}")


def keys_needed(first: int, stop: int, length: int, kernel_size: int) -> Tuple[int, int]:
    """Half-open key range ``[u0, u1)`` that the queries ``[first, stop)`` see together.

    ``u0 = window_start(first)`` and ``u1 = window_start(stop - 1) + K``: the union of
    their windows (:func:`na3d.geometry.union_of_windows`, with a half-open query range). Because
    windows shift inward at the borders, ``u0`` can lie up to ``K - 1`` positions
    before ``first`` (and ``u1`` up to ``K - 1`` after ``stop``): the queries near
    a border see deeper into the axis than ``K // 2``.

    The range always contains ``[first, stop)`` and is at least ``K`` long. Attention
    computed on the sub-axis ``[u0, u1)`` alone, with window starts clamped to that
    sub-axis, gives every query of ``[first, stop)`` exactly its global window:
    ``window_start(i - u0, u1 - u0, K) + u0 == window_start(i, L, K)``. That is what
    lets a rank compute its slab from its slab plus the halo it receives.

    Example:
        >>> keys_needed(0, 4, 16, 5), keys_needed(4, 8, 16, 5)   # a border slab sees deeper
        ((0, 6), (2, 10))
    """
    _check_axis(length, kernel_size)
    if not 0 <= first < stop <= length:
        raise ValueError(f"query range [first, stop) = [{first}, {stop}) must be non-empty and "
                         f"inside [0, {length})")
    return (window_start(first, length, kernel_size),
            window_start(stop - 1, length, kernel_size) + kernel_size)


def queries_within(first: int, stop: int, length: int, kernel_size: int) -> Tuple[int, int]:
    """Queries of ``[first, stop)`` whose whole window lies inside ``[first, stop)``.

    Returns a half-open range (empty when ``first == stop`` comes back): window starts
    never decrease with the query index, so these queries are contiguous. A rank can
    compute them from its own slab alone, before any halo has arrived.

    Example:
        >>> queries_within(0, 8, 16, 5), queries_within(4, 8, 16, 5)
        ((0, 6), (4, 4))
    """
    _check_axis(length, kernel_size)
    if not 0 <= first < stop <= length:
        raise ValueError(f"query range [first, stop) = [{first}, {stop}) must be non-empty and "
                         f"inside [0, {length})")
    inside = [i for i in range(first, stop)
              if window_start(i, length, kernel_size) >= first
              and window_start(i, length, kernel_size) + kernel_size <= stop]
    if not inside:
        return first, first
    return inside[0], inside[-1] + 1


def slab_bounds(slab_sizes: Sequence[int]) -> List[Tuple[int, int]]:
    """``[start, stop)`` of each slab when an axis is cut into ``slab_sizes``, in order.

    Example:
        >>> slab_bounds([3, 5, 2])
        [(0, 3), (3, 8), (8, 10)]
    """
    bounds = []
    start = 0
    for rank, size in enumerate(slab_sizes):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"slab_sizes[{rank}]={size!r}: every slab must be a positive int")
        bounds.append((start, start + size))
        start += size
    return bounds


def halo_exchange_plan(slab_sizes: Sequence[int], kernel_size: int) -> List[HaloTransfer]:
    """Every message of a halo exchange along one axis cut into ``slab_sizes``.

    Receiver ``r`` with slab ``[a, b)`` needs keys ``keys_needed(a, b, L, K)``; each
    other rank ``s`` sends exactly the intersection of that range with its own slab,
    nothing more. A thin slab near a border can need data from several ranks on one
    side, so every pair is considered, not just neighbors. For each receiver, its
    incoming pieces and its own slab tile its key range in rank order.

    Returns the non-empty transfers ordered by (receiver, sender).

    Example:
        >>> halo_exchange_plan([4, 4], 5)
        [HaloTransfer(sender=1, receiver=0, start=4, stop=6), HaloTransfer(sender=0, receiver=1, start=2, stop=4)]
    """
    if len(slab_sizes) == 0:
        raise ValueError("slab_sizes must name at least one slab")
    bounds = slab_bounds(slab_sizes)
    length = bounds[-1][1]
    _check_axis(length, kernel_size)
    plan = []
    for receiver, (a, b) in enumerate(bounds):
        u0, u1 = keys_needed(a, b, length, kernel_size)
        for sender, (sa, sb) in enumerate(bounds):
            lo, hi = max(u0, sa), min(u1, sb)
            if sender != receiver and lo < hi:
                plan.append(HaloTransfer(sender, receiver, lo, hi))
    return plan
