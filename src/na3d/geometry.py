"""Neighborhood geometry: the one place that says which keys a query sees.

Every other part of the package (references, kernel launchers, tests, benchmark
accounting) asks this module; nobody re-derives the window formula. The Triton
kernels carry a device copy of :func:`window_start` (``kernels/common.py``), and a
test checks the two agree on every (index, length, kernel) of a sweep.

Definitions follow NATTEN (``natten/backends/flex.py``), per dimension of length
``L`` with kernel size ``K`` and dilation 1, non-causal:

* a query at index ``i`` sees keys ``[s, s + K)`` with
  ``s = clamp(i - K // 2, 0, L - K)``: centered where possible and shifted inward at
  the borders, so every query sees exactly ``K`` keys (``K // 2`` left and
  ``K // 2 - 1`` right of the center for even ``K``: the same formula covers it);
* a 3-D neighborhood is the product of three such 1-D windows.

Causal axes (NATTEN's definition: the ``K`` positions ending at the query, clipped
at 0) and dilation are written here too. The Triton kernels compute every dilation
group's windows at dilation 1 in the group's own coordinates (its positions
``g + d * i`` renumbered ``i``), so their device copies need only the dilation-1
formulas; the grid of groups is ``kernels/common.py``'s ``dilation_group``.
"""

from __future__ import annotations

from typing import Sequence, Tuple, Union

import torch

IntOrTensor = Union[int, torch.Tensor]


def _clamp(x: IntOrTensor, lo: IntOrTensor, hi: IntOrTensor) -> IntOrTensor:
    if isinstance(x, torch.Tensor):
        lo = torch.as_tensor(lo, dtype=x.dtype, device=x.device)
        hi = torch.as_tensor(hi, dtype=x.dtype, device=x.device)
        return torch.minimum(torch.maximum(x, lo), hi)
    return min(max(x, lo), hi)


def window_start(index: IntOrTensor, length: int, kernel_size: int) -> IntOrTensor:
    """First key index of the window of query ``index`` (dilation 1, non-causal).

    ``clamp(index - K // 2, 0, L - K)``. Works on Python ints and integer tensors.
    """
    return _clamp(index - kernel_size // 2, 0, length - kernel_size)


def stride_leader(index: IntOrTensor, length: int, stride: int, is_causal: bool = False) -> IntOrTensor:
    """The query whose window query ``index`` shares under NATTEN's ``stride``.

    An axis is cut into groups of ``stride`` consecutive queries; every query of a
    group uses the window of its leader: the group's center (the right one of the
    two for an even stride), or its last query on a causal axis, clipped to the
    axis. Stride 1 makes every query its own leader.
    """
    offset = stride - 1 if is_causal else stride // 2
    leader = (index // stride) * stride + offset
    if isinstance(leader, torch.Tensor):
        return torch.clamp(leader, max=length - 1)
    return min(leader, length - 1)


def window_bounds(
    index: IntOrTensor,
    length: int,
    kernel_size: int,
    dilation: int = 1,
    is_causal: bool = False,
    stride: int = 1,
) -> Tuple[IntOrTensor, IntOrTensor]:
    """Half-open key range ``[start, stop)`` seen by query ``index``, step ``dilation``.

    With dilation ``d`` the axis splits into ``d`` groups by ``index % d``; inside a
    group (its own length ``ceil((L - g) / d)``) the window is the dilation-1 window
    of the query's position in the group. Causal: the ``K`` positions ending at the
    query itself, clipped at 0 (fewer keys near the start). With ``stride`` the
    window is that of the query's :func:`stride_leader` inside its group (NATTEN's
    definition; on a causal axis only the start moves, the window still ends at the
    query). ``stop`` is exclusive and always ``start + d * count`` for the
    ``count`` keys seen.
    """
    d = dilation
    group = index % d
    pos = index // d
    group_len = (length - group + d - 1) // d
    leader = stride_leader(pos, group_len, stride, is_causal) if stride != 1 else pos
    if is_causal:
        first = _clamp(leader - kernel_size + 1, 0, pos)
        last = pos + 1
    else:
        first = _clamp(leader - kernel_size // 2, 0, group_len - kernel_size)
        last = first + kernel_size
    return group + first * d, group + last * d


def union_of_windows(first: int, last: int, length: int, kernel_size: int,
                     is_causal: bool = False, stride: int = 1) -> Tuple[int, int]:
    """``[start, stop)`` covering the windows of queries ``first..last`` (inclusive).

    Both ends of a window never decrease with the query index (dilation 1, causal or
    not, any stride), so the union of the windows of a contiguous run of queries is
    itself contiguous: from the first query's start to the last query's stop.
    """
    return (window_bounds(first, length, kernel_size, 1, is_causal, stride)[0],
            window_bounds(last, length, kernel_size, 1, is_causal, stride)[1])


def union_width_bound(box: int, kernel_size: int, is_causal: bool = False, stride: int = 1) -> int:
    """An upper bound, over every axis length and box position, of the width of
    :func:`union_of_windows` for a run of ``box`` consecutive queries.

    Window starts move by at most as much as the stride leaders do (a clamp only
    narrows the gap), and the leaders of ``box`` consecutive queries lie at most
    ``box - 1 + stride - 1`` apart; a window is ``kernel_size`` wide. On a causal
    axis the union ends at the last query and starts no earlier than
    ``kernel_size - 1`` before the first, whatever the stride. The bound does not
    depend on the axis length, so a kernel specialized on it does not have to be
    recompiled when the length changes.
    """
    if is_causal:
        return box - 1 + kernel_size
    return box - 1 + (stride - 1) + kernel_size


def queries_seeing(first_key: int, last_key: int, length: int, kernel_size: int,
                   is_causal: bool = False, stride: int = 1) -> Tuple[int, int]:
    """``[first, stop)``: the queries whose windows contain a key of ``first_key..last_key``.

    The dual of :func:`union_of_windows`, used by the backward pass for dK/dV: query
    ``i`` sees some key of the run iff ``first_key - K + 1 <= s(i) <= last_key``, and
    ``s`` never decreases, so those queries are contiguous. With ``h = K // 2`` and
    ``s(i) = clamp(i - h, 0, L - K)``: the first is 0 if ``first_key < K`` and
    ``first_key - K + 1 + h`` otherwise; the last is ``L - 1`` if
    ``last_key >= L - K`` and ``last_key + h`` otherwise.

    Causal: query ``i`` sees ``[max(i - K + 1, 0), i]``, so key ``j`` is seen by
    queries ``j .. j + K - 1`` (clipped at ``L - 1``).

    With a stride ``s``, query ``i`` has its leader's window. Non-causal: the
    leaders that see the run are the stride-1 answer ``[lo, hi)``, and the queries
    are the groups whose leader ``g * s + s // 2`` lies in it. Causal: queries from
    ``first_key`` on whose leader ``g * s + s - 1`` is at most ``last_key + K - 1``.
    """
    s = stride
    if is_causal:
        if s == 1 or last_key + kernel_size >= length:
            return first_key, min(last_key + kernel_size, length)
        return first_key, min(length, ((last_key + kernel_size - s) // s + 1) * s)
    half = kernel_size // 2
    lowest_start = first_key - kernel_size + 1
    first = 0 if lowest_start <= 0 else lowest_start + half
    stop = length if last_key >= length - kernel_size else last_key + half + 1
    if s == 1:
        return first, stop
    first = -(-max(first - s // 2, 0) // s) * s
    stop = length if stop >= length else min(length, -(-max(stop - s // 2, 0) // s) * s)
    return first, stop


def mask_1d(
    length: int,
    kernel_size: int,
    dilation: int = 1,
    is_causal: bool = False,
    device: Union[str, torch.device, None] = None,
    stride: int = 1,
) -> torch.Tensor:
    """Boolean ``[length, length]`` matrix: ``[i, j]`` is True iff query i sees key j."""
    i = torch.arange(length, device=device)
    start, stop = window_bounds(i, length, kernel_size, dilation, is_causal, stride)
    j = torch.arange(length, device=device)
    inside = (j[None, :] >= start[:, None]) & (j[None, :] < stop[:, None])
    return inside & ((j[None, :] - start[:, None]) % dilation == 0)


def neighborhood_mask(
    shape: Sequence[int],
    kernel_size: Sequence[int],
    dilation: Sequence[int] = None,
    is_causal: Sequence[bool] = None,
    device: Union[str, torch.device, None] = None,
    stride: Sequence[int] = None,
) -> torch.Tensor:
    """Boolean ``[N, N]`` mask over the flattened grid (row-major), N = prod(shape).

    For brute-force references on tiny shapes only: it is quadratic in N.
    """
    nd = len(shape)
    dilation = tuple(dilation) if dilation is not None else (1,) * nd
    is_causal = tuple(is_causal) if is_causal is not None else (False,) * nd
    stride = tuple(stride) if stride is not None else (1,) * nd
    mask = None
    for d in range(nd):
        m = mask_1d(shape[d], kernel_size[d], dilation[d], is_causal[d], device=device, stride=stride[d])
        # This dimension's query axis goes to position d, its key axis to nd + d.
        view = [1] * (2 * nd)
        view[d] = shape[d]
        view[nd + d] = shape[d]
        m = m.reshape(view)
        mask = m if mask is None else mask & m
    n = 1
    for s in shape:
        n *= s
    return mask.expand(*shape, *shape).reshape(n, n)


def tile_key_pairs_1d(length: int, kernel_size: int, q_tile: int, kv_tile: int, is_causal: bool = False) -> int:
    """Query-key pairs a tiled kernel computes along one dimension.

    Queries are cut into runs of ``q_tile``; each run scans the union of its
    windows in steps of ``kv_tile`` keys (the last step may run past the union).
    The 3-D count is the product of the three 1-D counts, so
    ``prod(tile_key_pairs_1d) / prod(useful_pairs_1d)`` is the ratio of issued to
    useful QK^T products of a kernel tiled that way.
    """
    total = 0
    for first in range(0, length, q_tile):
        last = min(first + q_tile, length) - 1
        start, stop = union_of_windows(first, last, length, kernel_size, is_causal)
        n_kv = -(-(stop - start) // kv_tile)
        total += q_tile * n_kv * kv_tile
    return total


def useful_pairs_1d(length: int, kernel_size: int, is_causal: bool = False) -> int:
    """Query-key pairs inside the windows along one dimension: ``L * K``, or on a
    causal axis, whose windows are clipped at 0, the sum of ``min(i + 1, K)``."""
    if not is_causal:
        return length * kernel_size
    return sum(min(i + 1, kernel_size) for i in range(length))


def issued_flops_ratio(
    shape: Sequence[int],
    kernel_size: Sequence[int],
    q_tile: Sequence[int],
    kv_tile: Sequence[int],
    is_causal: Sequence[bool] = (False, False, False),
) -> float:
    """Ratio of QK^T (and PV) products issued by a box-tiled kernel to useful ones."""
    issued = 1.0
    useful = 1.0
    for L, K, qt, kt, c in zip(shape, kernel_size, q_tile, kv_tile, is_causal):
        issued *= tile_key_pairs_1d(L, K, qt, kt, c)
        useful *= useful_pairs_1d(L, K, c)
    return issued / useful
