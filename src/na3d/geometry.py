"""Neighborhood geometry: the one place that says which keys a query sees.

Every other part of the package (references, kernel launchers, tests, benchmark
accounting) asks this module; nobody re-derives the window formula. The Triton
kernels carry a device copy of :func:`window_start` (``kernels/windows.py``), and a
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
formulas; the grid of groups is ``kernels/groups.py``'s ``dilation_group``.
"""

from __future__ import annotations

import functools
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


def keys_seen_by_all(first: int, last: int, length: int, kernel_size: int,
                     is_causal: bool = False, stride: int = 1) -> Tuple[int, int]:
    """``[start, stop)``: the keys that every query of ``first..last`` sees (none where
    ``start >= stop``). Both window ends never decrease with the query index, so the
    intersection of the windows is ``[start(last), stop(first))``."""
    return (window_bounds(last, length, kernel_size, 1, is_causal, stride)[0],
            window_bounds(first, length, kernel_size, 1, is_causal, stride)[1])


def queries_seeing_all(first_key: int, last_key: int, length: int, kernel_size: int,
                       is_causal: bool = False, stride: int = 1) -> Tuple[int, int]:
    """``[first, stop)``: the queries that see every key of ``first_key..last_key`` (none
    where ``first >= stop``). The queries that see one key are contiguous and both
    their ends never decrease with the key (:func:`queries_seeing`), so those that see
    the whole run are the ones that see its last key and its first:
    ``[first(last_key), stop(first_key))``."""
    return (queries_seeing(last_key, last_key, length, kernel_size, is_causal, stride)[0],
            queries_seeing(first_key, first_key, length, kernel_size, is_causal, stride)[1])


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


def issued_pairs_1d(length: int, kernel_size: int, box: int, scanned_box: int, is_causal: bool = False,
                    stride: int = 1, own: str = "queries") -> int:
    """Query-key pairs a box-tiled kernel computes along one dimension.

    ``own="queries"`` (the forward, dQ): queries cut into runs of ``box``, each
    scanning the union of its windows in steps of ``scanned_box`` keys (the last
    step may run past the union; :func:`key_scans_1d`). ``own="keys"`` (dK/dV): keys
    cut into runs of ``box``, each scanning the queries that see it in steps of
    ``scanned_box`` (:func:`query_scans_1d`). The 3-D count is the product of the
    three 1-D counts (:func:`issued_flops_ratio`).
    """
    if own not in ("queries", "keys"):
        raise ValueError(f"own must be 'queries' or 'keys', got {own!r}")
    scans = key_scans_1d if own == "queries" else query_scans_1d
    return sum(box * len(steps) * scanned_box
               for _, steps in scans(length, kernel_size, box, scanned_box, is_causal, stride))


def key_scans_1d(length: int, kernel_size: int, q_tile: int, kv_tile: int, is_causal: bool = False,
                 stride: int = 1):
    """Along one axis, what a kernel over boxes of queries (the forward, dQ) scans:
    per box of ``q_tile`` queries, ``(queries, steps)``: its queries inside the axis
    and the ``[start, stop)`` of each box of ``kv_tile`` keys it visits (its union of
    windows in steps from the union's start; the last may run past the union)."""
    for first in range(0, length, q_tile):
        last = min(first + q_tile, length) - 1
        start, stop = union_of_windows(first, last, length, kernel_size, is_causal, stride)
        yield range(first, last + 1), [(c, c + kv_tile) for c in range(start, stop, kv_tile)]


def query_scans_1d(length: int, kernel_size: int, k_tile: int, q_tile: int, is_causal: bool = False,
                   stride: int = 1):
    """The dual, for a kernel over boxes of keys (dK/dV): per box of ``k_tile`` keys,
    ``(keys, steps)``: its keys inside the axis and the ``[start, stop)`` of each box
    of ``q_tile`` queries it visits (:func:`queries_seeing`, in steps from its first)."""
    for first in range(0, length, k_tile):
        last = min(first + k_tile, length) - 1
        start, stop = queries_seeing(first, last, length, kernel_size, is_causal, stride)
        yield range(first, last + 1), [(c, c + q_tile) for c in range(start, stop, q_tile)]


def full_box_pairs_1d(length: int, kernel_size: int, box: int, scanned_box: int, is_causal: bool = False,
                      stride: int = 1, own: str = "queries"):
    """Along one axis, per (program box, scanned box) pair of a tiled kernel, whether
    the pair is **full**: every query of the one sees every key of the other, and the
    scanned box lies inside the scanned range (so that it needs no mask along this
    axis), and how many products it issues (``box * scanned_box``). ``own``:
    ``"queries"`` for kernels over boxes of queries scanning keys (the forward, dQ),
    ``"keys"`` for boxes of keys scanning queries (dK/dV). Yields ``(full, products)``.

    A 3-D pair is full when it is full along every axis, and the kernels' scans are
    products of the three axes' scans, so counts over the grid factor per axis.
    Both window ends never decrease with the query index, so the keys every query
    of a run ``first..last`` sees are ``[start(last), stop(first))``."""
    if own == "queries":
        scans, scanned_range = key_scans_1d, union_of_windows
    else:
        scans, scanned_range = query_scans_1d, queries_seeing
    windows = axis_windows(length, kernel_size, is_causal, stride)
    for positions, steps in scans(length, kernel_size, box, scanned_box, is_causal, stride):
        scan_stop = scanned_range(positions[0], positions[-1], length, kernel_size, is_causal, stride)[1]
        for lo, hi in steps:
            # (A box running past the scanned range holds positions outside it.)
            full = hi <= scan_stop
            if full:
                queries, keys = (positions, range(lo, hi)) if own == "queries" else (range(lo, hi), positions)
                full = windows[queries[-1]][0] <= keys[0] and keys[-1] < windows[queries[0]][1]
            yield full, box * scanned_box


@functools.lru_cache(maxsize=1024)
def axis_windows(length: int, kernel_size: int, is_causal: bool = False, stride: int = 1) -> Tuple[Tuple[int, int]]:
    """Every query's window ``[start, stop)`` along one axis (dilation 1), memoized:
    the box searches of ``configs`` ask for the same axis many times."""
    return tuple(window_bounds(i, length, kernel_size, 1, is_causal, stride) for i in range(length))


def block_sparse_axis(lengths: Sequence[int], kernel_size: int, box: int, scanned_box: int,
                      is_causal: bool = False, stride: int = 1, own: str = "queries") -> bool:
    """True when along one axis every pair that a kernel's programs visit is full
    (:func:`full_box_pairs_1d`) on each axis length of ``lengths`` (with dilation,
    the lengths of the dilation groups: each group runs at dilation 1 in its own
    coordinates). Then that axis needs no mask at all: with stride, a box of queries
    inside one stride group shares one window, and key boxes that tile it exactly
    are seen whole (NATTEN's perfectly block-sparse case)."""
    return all(full for length in set(lengths)
               for full, _ in full_box_pairs_1d(length, kernel_size, box, scanned_box, is_causal, stride, own))


def full_products_share(shape: Sequence[int], kernel_size: Sequence[int], box: Sequence[int],
                        scanned_box: Sequence[int], is_causal: Sequence[bool] = (False, False, False),
                        stride: Sequence[int] = (1, 1, 1), own: str = "queries") -> float:
    """The share of a tiled kernel's issued products that fall in full box pairs
    (no mask needed), over the grid ``shape`` at dilation 1."""
    share = 1.0
    for L, K, b, s, c, st in zip(shape, kernel_size, box, scanned_box, is_causal, stride):
        pairs = list(full_box_pairs_1d(L, K, b, s, c, st, own))
        share *= sum(n for full, n in pairs if full) / sum(n for _, n in pairs)
    return share


def useful_pairs_1d(length: int, kernel_size: int, is_causal: bool = False) -> int:
    """Query-key pairs inside the windows along one dimension: ``L * K``, or on a
    causal axis, whose windows are clipped at 0, the sum of ``min(i + 1, K)``."""
    if not is_causal:
        return length * kernel_size
    return sum(min(i + 1, kernel_size) for i in range(length))


def issued_flops_ratio(
    shape: Sequence[int],
    kernel_size: Sequence[int],
    box: Sequence[int],
    scanned_box: Sequence[int],
    is_causal: Sequence[bool] = (False, False, False),
    stride: Sequence[int] = (1, 1, 1),
    own: str = "queries",
) -> float:
    """Ratio of QK^T (and PV) products issued by a box-tiled kernel to useful ones.

    ``own="queries"`` (the forward, dQ): boxes of ``box`` queries on a fixed grid,
    each scanning its union of windows from the union's start in boxes of
    ``scanned_box`` keys (:func:`key_scans_1d`). ``own="keys"`` (dK/dV): boxes of
    ``box`` keys, each scanning the queries that see it from the first of them in
    boxes of ``scanned_box`` queries (:func:`query_scans_1d`). The two counts differ:
    the dK/dV kernel's is not the forward's with the boxes swapped."""
    issued = 1.0
    useful = 1.0
    for L, K, b, sb, c, s in zip(shape, kernel_size, box, scanned_box, is_causal, stride):
        issued *= issued_pairs_1d(L, K, b, sb, c, s, own)
        useful *= useful_pairs_1d(L, K, c)
    return issued / useful
