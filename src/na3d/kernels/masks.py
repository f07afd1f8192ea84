"""The window mask of a scan over key boxes (the forward, dQ).

How a kernel masks the window along one axis, ``MASKS = (MASK_T, MASK_H, MASK_W)``
(compile-time; the launcher picks, see ``launch.mask_modes``; the values are
``na3d.constants``'):

* ``MASK_PER_STEP``: compare positions on every step (the plain mask);
* ``MASK_BITS``: on every step, from per-query window bits shifted to the step;
* ``MASK_FIXED``: once per program: the scan never moves along this axis;
* ``MASK_NONE``: never: every query of every box sees every key of every box it
  scans (the launcher proves it for the call's grid: ``geometry.block_sparse_axis``).
  With ``MASK_NONE`` on all three axes the scan's loop runs without masks, as dense
  attention's does.
"""

from typing import NamedTuple

import triton
import triton.language as tl

from .. import constants
from .windows import query_windows, sees

MASK_PER_STEP = tl.constexpr(constants.MASK_PER_STEP)
MASK_BITS = tl.constexpr(constants.MASK_BITS)
MASK_FIXED = tl.constexpr(constants.MASK_FIXED)
MASK_NONE = tl.constexpr(constants.MASK_NONE)


class ScanMasks(NamedTuple):
    """What a scan over key boxes computes once for its masks (:func:`key_scan_masks`):
    the queries' windows ``(st, et, sh, eh, sw, ew)``, the fixed axes' part of the
    mask as a [queries, keys] bias, and per-axis window bits."""
    windows: tl.tensor
    fixed_bias: tl.tensor
    bits: tl.tensor


@triton.constexpr_function
def no_mask(mask_t, mask_h, mask_w, safe):
    """Whether a scan's fast loop masks nothing (``MASK_NONE`` on every axis; the safe
    loop always selects)."""
    return mask_t == MASK_NONE.value and mask_h == MASK_NONE.value and mask_w == MASK_NONE.value and not safe


@triton.jit
def in_window(key, start, stop):
    """Boolean [queries, keys]: key position ``key[j]`` lies in ``[start[i], stop[i])``."""
    return (key[None, :] >= start[:, None]) & (key[None, :] < stop[:, None])


@triton.jit
def axes_in_window(ok, kt, kh, kw, windows, MODES: tl.constexpr, WHICH: tl.constexpr):
    """``ok`` and, along each axis whose mode is ``WHICH``, the position compares:
    keys ``(kt, kh, kw)`` against the query windows ``(st, et, sh, eh, sw, ew)``."""
    if MODES[0] == WHICH:
        ok &= in_window(kt, windows[0], windows[1])
    if MODES[1] == WHICH:
        ok &= in_window(kh, windows[2], windows[3])
    if MODES[2] == WHICH:
        ok &= in_window(kw, windows[4], windows[5])
    return ok


@triton.jit
def window_bits(start, stop, origin, MODE: tl.constexpr):
    """Per query, its window ``[start, stop)`` as int32 bits from ``origin`` (bit j:
    position ``origin + j``; needs ``origin <= start`` and ``stop - origin <= 31``),
    for a ``MASK_BITS`` axis; zeros (unused) otherwise."""
    if MODE == MASK_BITS:
        return ((1 << (stop - origin)) - 1) & ~((1 << (start - origin)) - 1)
    return tl.zeros_like(start)


@triton.constexpr_function
def safe_mode(mode, box_side):
    """The safe loop's mode along an axis whose fast mode is ``mode`` (key boxes of
    ``box_side`` along it): window bits where they fit (a fixed axis' union fits its
    key box, so its bits fit when the box does), compares elsewhere."""
    return MASK_BITS.value if mode == MASK_BITS.value or mode == MASK_FIXED.value and box_side < 32 \
        else MASK_PER_STEP.value


@triton.jit
def fixed_mask_bias(kt, kh, kw, windows, MASKS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                    MASKED: tl.constexpr):
    """The window mask along the ``MASK_FIXED`` axes only, as a [queries, keys] float32
    matrix of 0 (visible) and ``MASKED``: keys ``(kt, kh, kw)`` of the one box scanned
    along those axes."""
    ok = axes_in_window(tl.full([ROWS, COLS], 1, tl.int1), kt, kh, kw, windows, MASKS, MASK_FIXED)
    return tl.where(ok, 0.0, MASKED)


@triton.jit
def step_visible(kt, kh, kw, windows, bt, bh, bw, scan, MODES: tl.constexpr, ROWS: tl.constexpr,
                 COLS: tl.constexpr):
    """Boolean [queries, keys]: this step's keys ``(kt, kh, kw)`` lie in the query
    windows along the ``MASK_BITS`` and ``MASK_PER_STEP`` axes (``MASK_FIXED`` axes
    not tested). ``bt/bh/bw``: on ``MASK_BITS`` axes, each query's window bits
    shifted to this step's first key (``scan``: the keys' offsets in the box)."""
    ok = tl.full([ROWS, COLS], 1, tl.int1)
    # One word of the bit-masked axes' shifted windows, then one test. Testing each
    # axis' bit on its own compiles to fewer instructions where all three axes use
    # bits, but takes more registers.
    if MODES[0] == MASK_BITS or MODES[1] == MASK_BITS or MODES[2] == MASK_BITS:
        bits = tl.full([ROWS, COLS], 1, tl.int32)
        if MODES[0] == MASK_BITS:
            bits &= bt[:, None] >> scan.off_t[None, :]
        if MODES[1] == MASK_BITS:
            bits &= bh[:, None] >> scan.off_h[None, :]
        if MODES[2] == MASK_BITS:
            bits &= bw[:, None] >> scan.off_w[None, :]
        ok &= bits != 0
    return axes_in_window(ok, kt, kh, kw, windows, MODES, MASK_PER_STEP)


@triton.jit
def key_scan_masks(q, nb, WINDOW_FLAGS: tl.constexpr, scan, MASKS: tl.constexpr, KV_BOX: tl.constexpr,
                   BLOCK_Q: tl.constexpr, ON_PRODUCT: tl.constexpr, SAFE: tl.constexpr, MASKED: tl.constexpr):
    """The :class:`ScanMasks` of a program's box of queries ``q`` (a ``tiles.Box``)
    scanning key boxes (``scan``: a ``tiles.BoxScan``). With ``ON_PRODUCT`` the fixed
    axes' part of the mask (``MASKED`` where it hides) and the ``MASK_BITS`` axes'
    window bits; in the safe loop (``SAFE``) window bits where they fit
    (:func:`safe_mode`), which hold fewer registers than the fixed part. Values a
    mode does not use are placeholders that the compiler drops."""
    BLOCK_KV: tl.constexpr = KV_BOX[0] * KV_BOX[1] * KV_BOX[2]
    tl.static_assert(BLOCK_KV >= 16, "tl.dot needs boxes of at least 16 keys")
    SAFE_BITS: tl.constexpr = SAFE and (MASKS[0] + MASKS[1] + MASKS[2] > 0)
    if ON_PRODUCT or SAFE_BITS:
        windows = query_windows(q.t, q.h, q.w, nb, WINDOW_FLAGS)
    else:
        windows = (q.t, q.t, q.t, q.t, q.t, q.t)
    fixed_bias = tl.zeros([1, 1], tl.float32)
    if ON_PRODUCT:
        fixed_bias = fixed_mask_bias(scan.t0 + scan.off_t, scan.h0 + scan.off_h, scan.w0 + scan.off_w, windows,
                                     MASKS, BLOCK_Q, BLOCK_KV, MASKED)
        bits = (window_bits(windows[0], windows[1], scan.t0, MASKS[0]),
                window_bits(windows[2], windows[3], scan.h0, MASKS[1]),
                window_bits(windows[4], windows[5], scan.w0, MASKS[2]))
    elif SAFE_BITS:
        bits = (window_bits(windows[0], windows[1], scan.t0, safe_mode(MASKS[0], KV_BOX[0])),
                window_bits(windows[2], windows[3], scan.h0, safe_mode(MASKS[1], KV_BOX[1])),
                window_bits(windows[4], windows[5], scan.w0, safe_mode(MASKS[2], KV_BOX[2])))
    else:
        bits = (q.t, q.t, q.t)
    return ScanMasks(windows, fixed_bias, bits)


@triton.jit
def step_mask_bias(masks, kt, kh, kw, i_t, i_h, i_w, scan, MASKS: tl.constexpr, KV_BOX: tl.constexpr,
                   MASKED: tl.constexpr = float("-inf")):
    """The additive mask of step ``(i_t, i_h, i_w)`` (keys ``(kt, kh, kw)``): the fixed
    part of :func:`key_scan_masks` with this step's keys also masked along the axes
    that move, one select per score (none when every axis is fixed), handed to the
    QK^T product as its accumulator."""
    bt = masks.bits[0] >> (i_t * KV_BOX[0])
    bh = masks.bits[1] >> (i_h * KV_BOX[1])
    bw = masks.bits[2] >> (i_w * KV_BOX[2])
    if MASKS[0] >= MASK_FIXED and MASKS[1] >= MASK_FIXED and MASKS[2] >= MASK_FIXED:  # (nothing moves)
        return masks.fixed_bias
    ok = step_visible(kt, kh, kw, masks.windows, bt, bh, bw, scan, MASKS, masks.fixed_bias.shape[0],
                      masks.fixed_bias.shape[1])
    return tl.where(ok, masks.fixed_bias, MASKED)


@triton.jit
def key_scan_visible(q, kt, kh, kw, masks, i_t, i_h, i_w, scan, nb, WINDOW_FLAGS: tl.constexpr, MASKS: tl.constexpr,
                     KV_BOX: tl.constexpr, BLOCK_Q: tl.constexpr, SAFE: tl.constexpr):
    """Boolean [queries, keys] for one step of a scan over key boxes that masks its
    scores by selection (no mask on the product): from the window bits of
    :func:`key_scan_masks` in the safe loop, by comparing positions otherwise."""
    if SAFE and (MASKS[0] + MASKS[1] + MASKS[2] > 0):  # (the modes of key_scan_masks' bits)
        return step_visible(kt, kh, kw, masks.windows, masks.bits[0] >> (i_t * KV_BOX[0]),
                            masks.bits[1] >> (i_h * KV_BOX[1]), masks.bits[2] >> (i_w * KV_BOX[2]), scan,
                            (safe_mode(MASKS[0], KV_BOX[0]), safe_mode(MASKS[1], KV_BOX[1]),
                             safe_mode(MASKS[2], KV_BOX[2])), BLOCK_Q, KV_BOX[0] * KV_BOX[1] * KV_BOX[2])
    return sees(q.t, q.h, q.w, kt, kh, kw, nb, WINDOW_FLAGS)
