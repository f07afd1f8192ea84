"""Which keys a query sees: the kernels' copy of ``na3d.geometry``.

Kept in step with ``na3d.geometry`` by ``tests/test_geometry.py``. A ``CAUSAL``
flag is a compile-time constant: a causal axis costs nothing on the others, and
the non-causal code is unchanged by it. So is ``STRIDED`` (some axis has a NATTEN
stride > 1): without it the stride arguments are never read and the code is that
of stride 1.

The call's geometry travels as two groups: a :class:`Neighborhood` (run-time
values: the grid's lengths, or a dilation group's, the kernel size and the stride)
and the compile-time ``WINDOW_FLAGS = (CAUSAL_T, CAUSAL_H, CAUSAL_W, STRIDED)`` (a kernel
builds that tuple in its call, so that its members stay constants: in Triton 3.6 a
tuple assigned to a variable, or returned, loses the constness of its members).
"""

from typing import NamedTuple

import triton
import triton.language as tl


class Neighborhood(NamedTuple):
    """The run-time geometry of a call, as a program sees it: the grid's lengths
    (a dilation group's sub-grid when dilated), the kernel size and NATTEN's stride
    per axis."""
    T: tl.tensor
    H: tl.tensor
    W: tl.tensor
    KT: tl.tensor
    KH: tl.tensor
    KW: tl.tensor
    ST: tl.tensor
    SH: tl.tensor
    SW: tl.tensor


@triton.jit
def window_start(index, length, kernel_size):
    """``na3d.geometry.window_start``: ``clamp(i - K // 2, 0, L - K)``."""
    return tl.minimum(tl.maximum(index - kernel_size // 2, 0), length - kernel_size)


@triton.jit
def window_bounds(index, length, kernel_size, stride, CAUSAL: tl.constexpr, STRIDED: tl.constexpr):
    """``na3d.geometry.window_bounds`` at dilation 1: the keys ``[start, stop)`` that
    query ``index`` sees. Causal: the ``K`` positions ending at the query, clipped at
    0. Strided: the window of the query's stride-group leader (causal: only the
    start moves)."""
    leader = index
    if STRIDED:
        if CAUSAL:
            leader = tl.minimum((index // stride) * stride + stride - 1, length - 1)
        else:
            leader = tl.minimum((index // stride) * stride + stride // 2, length - 1)
    if CAUSAL:
        start = tl.maximum(leader - kernel_size + 1, 0)
        stop = index + 1
    else:
        start = window_start(leader, length, kernel_size)
        stop = start + kernel_size
    return start, stop


@triton.jit
def union_of_windows(first, last, length, kernel_size, stride, CAUSAL: tl.constexpr, STRIDED: tl.constexpr):
    """``na3d.geometry.union_of_windows``: ``[start, stop)`` covering the windows of
    queries ``first..last``. Both window ends never decrease with the query index."""
    start, _ = window_bounds(first, length, kernel_size, stride, CAUSAL, STRIDED)
    _, stop = window_bounds(last, length, kernel_size, stride, CAUSAL, STRIDED)
    return start, stop


@triton.jit
def queries_seeing(first_key, last_key, length, kernel_size, stride, CAUSAL: tl.constexpr,
                   STRIDED: tl.constexpr):
    """``na3d.geometry.queries_seeing``: the ``[first, stop)`` queries whose windows
    contain a key of ``first_key..last_key`` (every quantity divided is >= 0)."""
    if CAUSAL:
        first = first_key
        stop = tl.minimum(last_key + kernel_size, length)
        if STRIDED:
            stop = tl.where(last_key + kernel_size >= length, length,
                            tl.minimum(length, ((last_key + kernel_size - stride) // stride + 1) * stride))
    else:
        lowest_start = first_key - kernel_size + 1
        first = tl.where(lowest_start <= 0, 0, lowest_start + kernel_size // 2)
        stop = tl.where(last_key >= length - kernel_size, length, last_key + kernel_size // 2 + 1)
        if STRIDED:
            first = tl.cdiv(tl.maximum(first - stride // 2, 0), stride) * stride
            stop = tl.where(stop >= length, length,
                            tl.minimum(length, tl.cdiv(tl.maximum(stop - stride // 2, 0), stride) * stride))
    return first, stop


@triton.jit
def seen_by_all(first, last, length, kernel_size, stride, CAUSAL: tl.constexpr, STRIDED: tl.constexpr):
    """``na3d.geometry.keys_seen_by_all``: the keys ``[start, stop)`` that every query
    of ``first..last`` sees (none where ``start >= stop``): the intersection of their
    windows, ``[start(last), stop(first))``, since both window ends never decrease
    with the query index."""
    start, _ = window_bounds(last, length, kernel_size, stride, CAUSAL, STRIDED)
    _, stop = window_bounds(first, length, kernel_size, stride, CAUSAL, STRIDED)
    return start, stop


@triton.jit
def seeing_all(first_key, last_key, length, kernel_size, stride, CAUSAL: tl.constexpr, STRIDED: tl.constexpr):
    """``na3d.geometry.queries_seeing_all``: the queries ``[first, stop)`` that see every
    key of ``first_key..last_key`` (none where ``first >= stop``): those that see its
    last key and its first, ``[first(last_key), stop(first_key))``."""
    first, _ = queries_seeing(last_key, last_key, length, kernel_size, stride, CAUSAL, STRIDED)
    _, stop = queries_seeing(first_key, first_key, length, kernel_size, stride, CAUSAL, STRIDED)
    return first, stop


@triton.jit
def query_windows(qt, qh, qw, nb, WINDOW_FLAGS: tl.constexpr):
    """The windows of queries ``(qt, qh, qw)``, per axis: ``(st, et, sh, eh, sw, ew)``
    (:func:`window_bounds`; ``nb``: a :class:`Neighborhood`)."""
    st, et = window_bounds(qt, nb.T, nb.KT, nb.ST, WINDOW_FLAGS[0], WINDOW_FLAGS[3])
    sh, eh = window_bounds(qh, nb.H, nb.KH, nb.SH, WINDOW_FLAGS[1], WINDOW_FLAGS[3])
    sw, ew = window_bounds(qw, nb.W, nb.KW, nb.SW, WINDOW_FLAGS[2], WINDOW_FLAGS[3])
    return st, et, sh, eh, sw, ew


@triton.jit
def sees(qt, qh, qw, kt, kh, kw, nb, WINDOW_FLAGS: tl.constexpr, KEYS_FIRST: tl.constexpr = False):
    """Boolean [queries, keys] matrix: query (qt, qh, qw)[i] sees key (kt, kh, kw)[j];
    with ``KEYS_FIRST`` its transpose, [keys, queries], built directly."""
    st, et, sh, eh, sw, ew = query_windows(qt, qh, qw, nb, WINDOW_FLAGS)
    if KEYS_FIRST:  # (one return: Triton wants one result type per function)
        seen = ((kt[:, None] >= st[None, :]) & (kt[:, None] < et[None, :])
                & (kh[:, None] >= sh[None, :]) & (kh[:, None] < eh[None, :])
                & (kw[:, None] >= sw[None, :]) & (kw[:, None] < ew[None, :]))
    else:
        seen = ((kt[None, :] >= st[:, None]) & (kt[None, :] < et[:, None])
                & (kh[None, :] >= sh[:, None]) & (kh[None, :] < eh[:, None])
                & (kw[None, :] >= sw[:, None]) & (kw[None, :] < ew[:, None]))
    return seen
