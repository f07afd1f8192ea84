"""Loads and addresses: rows of ``(B, T, H, W, N, C)`` tensors, boxes of keys.

Strides come per tensor as ``(b, t, h, w, n)`` tuples, so that strided views need
no copies; offsets are 64-bit.
"""

from typing import NamedTuple

import triton
import triton.language as tl


class Columns(NamedTuple):
    """The columns of a head's row in a tile (``BLOCK_D`` of them, a power of two)
    and which of them exist (``< HEAD_DIM``; the others are padding, loaded as 0)."""
    d: tl.tensor
    ok: tl.tensor


class KeyBoxes(NamedTuple):
    """Where a program reads its boxes of keys and values: the tensor descriptors
    (``USE_TMA``), the (batch, head)'s keys and values through pointers
    (:func:`head_base`) and their strides, the batch and key/value head, and the
    dilation group's place in the descriptors (``groups.descriptor_origin``; a
    position's channels, ``channels``, scale its channel index)."""
    K_DESC: tl.tensor
    V_DESC: tl.tensor
    k_base: tl.tensor
    v_base: tl.tensor
    k_strides: tl.tensor
    v_strides: tl.tensor
    batch: tl.tensor
    head: tl.tensor
    origin: tl.tensor
    channels: tl.tensor


@triton.jit
def head_columns(HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The :class:`Columns` of a head's row."""
    d = tl.arange(0, BLOCK_D)
    return Columns(d, d < HEAD_DIM)


@triton.jit
def head_base(X, strides, batch, head):
    """Where (batch, head) of a ``(B, T, H, W, N, C)`` tensor with these (b, t, h, w,
    n) ``strides`` starts (64-bit offsets)."""
    return X + batch.to(tl.int64) * strides[0] + head.to(tl.int64) * strides[4]


@triton.jit
def key_value_bases(K, V, k_strides, v_strides, batch, head, GROUP: tl.constexpr):
    """For query head ``head`` (``GROUP`` of them per key/value head): its key/value
    head, and where that head of ``batch`` starts in K and V (:func:`head_base`)."""
    kv_head = head // GROUP
    return kv_head, head_base(K, k_strides, batch, kv_head), head_base(V, v_strides, batch, kv_head)


@triton.jit
def position_offsets(strides, t, h, w):
    """Offsets (int64) of positions ``(t, h, w)`` in a tensor with these (b, t, h, w,
    n) ``strides``, from its (batch, head): :func:`head_base`."""
    return t.to(tl.int64) * strides[1] + h.to(tl.int64) * strides[2] + w.to(tl.int64) * strides[3]


@triton.jit
def load_rows(base, strides, t, h, w, cols):
    """``[positions, len(cols.d)]`` rows of one (batch, head) of a ``(B, T, H, W, NH,
    HD)`` tensor: ``base`` points at that batch and head (:func:`head_base`),
    ``(t, h, w)`` are coordinates (in bounds), ``cols`` the :class:`Columns` (the
    missing ones read 0)."""
    return tl.load(base + position_offsets(strides, t, h, w)[:, None] + cols.d[None, :],
                   mask=cols.ok[None, :], other=0.0)


@triton.jit
def load_key_box(src, VALUES: tl.constexpr, c_t, c_h, c_w, kt, kh, kw, span, cols, HEAD_DIM: tl.constexpr,
                 BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr, FROM_DESC: tl.constexpr):
    """One step's box of keys (``VALUES``: of values) ``[BLOCK_KV, BLOCK_D]`` of a scan
    over ``span`` (a ``tiles.Span``), from :class:`KeyBoxes` ``src``: through the
    tensor descriptor from the box's corner ``(c_t, c_h, c_w)``, or through pointers
    at positions ``(kt, kh, kw)``, where keys past the span (the last step along an
    axis) load a repeat of its last position (outside every window of the program's
    queries, so the mask drops them)."""
    if FROM_DESC:
        DESC = src.V_DESC if VALUES else src.K_DESC
        return DESC.load([src.batch, c_t, c_h + src.origin[0], c_w + src.origin[1],
                          src.head * HEAD_DIM + src.origin[2] * src.channels]).reshape(BLOCK_KV, BLOCK_D)
    base = src.v_base if VALUES else src.k_base
    strides = src.v_strides if VALUES else src.k_strides
    offs = (tl.minimum(kt, span.t1 - 1).to(tl.int64) * strides[1]
            + tl.minimum(kh, span.h1 - 1).to(tl.int64) * strides[2]
            + tl.minimum(kw, span.w1 - 1).to(tl.int64) * strides[3])
    return tl.load(base + offs[:, None] + cols.d[None, :], mask=cols.ok[None, :], other=0.0)
