"""Backward kernels.

All recompute the attention probabilities from the forward's log-sum-exp:
``P = exp(scale * Q K^T - lse)`` on visible pairs, ``dP = dO V^T``,
``dS = P * (dP - delta)`` with ``delta = rowsum(dO * O) - dlse``. Then
``dQ = scale * dS K``, ``dK = scale * dS^T Q``, ``dV = P^T dO``.

Per-query statistics go through one float32 buffer ``STATS``, contiguous
``(B, NH, T, H, W, 4)``: ``lse * log2(e)``, ``delta``, two unused. Head-major and
16 bytes per position, so the dK/dV kernel can read a box of them through a tensor
descriptor (block ``(1, Q_T, Q_H, Q_W, 4)`` over ``(B NH, T, H, W, 4)``) instead of
computing a 64-bit address per query and step.

Two ways to run them:

* deterministic, no atomics: dQ over query boxes (it also writes ``STATS``), then
  dK/dV over key boxes. Every output element is written by exactly one program,
  which sums its contributions in a fixed order. Seven tile products per (query
  box, key box) pair: both kernels recompute ``Q K^T`` and ``dO V^T``.
* fused: ``STATS`` first, then the dK/dV kernel with ``ACCUMULATE_DQ``: it also
  adds each step's ``dS^T K`` into a float32 dQ buffer with atomic adds. Five
  tile products per pair, but the order of the float32 additions into dQ varies
  from run to run (results differ in the last bits).
"""

from typing import NamedTuple

import triton
import triton.language as tl

from .. import constants

# Every tl.dot says input_precision="ieee": float32 inputs then get true float32
# products (PyTorch's default for float32 matmul, not TF32); for 16-bit inputs the
# option changes nothing, and unlike "tf32" every backend (NVIDIA and AMD) accepts it.

from .groups import descriptor_origin, dilation_group, grid_position, Place, position_rows
from .masks import key_scan_masks, key_scan_visible, no_mask, step_mask_bias
from .memory import head_base, head_columns, load_rows, position_offsets
from .nonfinite import count_nonfinite, finite_part, has_nonfinite, mark_reached, nonfinite_rows
from .programs import program_keys, query_program, run_programs, store_query_tile
from .tiles import (box_at, box_of_program, box_scan, box_steps, first_box, first_masked_box, next_box,
                    next_masked_box, program_box, split_scan)
from .windows import Neighborhood, sees

LOG2_E = tl.constexpr(constants.LOG2_E)


class QueryBoxes(NamedTuple):
    """Where a dK/dV program reads its boxes of queries: the tensor descriptors of Q,
    dO and ``STATS`` (``USE_TMA``), and through pointers the group's first query
    head of Q and dO (``memory.head_base``), their strides, and ``STATS``."""
    Q_DESC: tl.tensor
    DO_DESC: tl.tensor
    STATS_DESC: tl.tensor
    q_base: tl.tensor
    do_base: tl.tensor
    q_strides: tl.tensor
    do_strides: tl.tensor
    STATS: tl.tensor


@triton.jit
def stats_index(batch, head, heads, t, h, w, place, DILATION: tl.constexpr):
    """Element index (int64) of the lse of positions ``(t, h, w)`` of one (batch,
    head) in ``STATS``, positions of the dilation group ``place``
    (``kernels.groups``); their delta is the next element."""
    t, h, w = grid_position(t, h, w, place, DILATION)
    return ((((batch.to(tl.int64) * heads + head) * place.T + t) * place.H + h) * place.W + w) * 4


@triton.jit
def query_statistics(O, DO, LSE, DLSE, STATS, o_strides, do_strides, batch, head, heads, t, h, w, valid, place, cols,
                     HAS_DLSE: tl.constexpr, STORE: tl.constexpr, DILATION: tl.constexpr):
    """A box of queries' dO rows and statistics (module docstring): ``(do, lse2,
    delta)``, ``lse2`` the lse in log2 units and ``delta = rowsum(dO * O) - dlse``;
    with ``STORE`` also written to ``STATS`` where ``valid``. Positions ``(t, h, w)``
    of the dilation group ``place`` (int64); O and DO that group's (``kernels.groups``)."""
    do = load_rows(head_base(DO, do_strides, batch, head), do_strides, t, h, w, cols)
    o = load_rows(head_base(O, o_strides, batch, head), o_strides, t, h, w, cols)
    rows = position_rows(batch.to(tl.int64), head.to(tl.int64), heads, t, h, w, place, DILATION)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + rows)
    lse2 = tl.load(LSE + rows) * LOG2_E
    if STORE:
        stats = STATS + stats_index(batch, head, heads, t, h, w, place, DILATION)
        tl.store(stats, lse2, mask=valid)
        tl.store(stats + 1, delta, mask=valid)
    return do, lse2, delta


@triton.jit(do_not_specialize=["T", "H", "W", "tiles_h", "tiles_w", "n_tiles", "n_programs"])
def na3d_bwd_dq_kernel(
    Q, K, V, O, DO, LSE, DLSE, STATS, DQ, K_DESC, V_DESC, FLAGS,
    q_strides, k_strides, v_strides, o_strides, do_strides, dq_strides,
    T, H, W, KT, KH, KW, ST, SH, SW, tiles_h, tiles_w, n_tiles, heads, n_programs, qk_scale, scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    Q_T: tl.constexpr, Q_H: tl.constexpr, Q_W: tl.constexpr, KV_T: tl.constexpr, KV_H: tl.constexpr, KV_W: tl.constexpr,
    CAUSAL_T: tl.constexpr, CAUSAL_H: tl.constexpr, CAUSAL_W: tl.constexpr, STRIDED: tl.constexpr,
    HAS_DLSE: tl.constexpr, USE_TMA: tl.constexpr, MASK_T: tl.constexpr, MASK_H: tl.constexpr, MASK_W: tl.constexpr,
    GROUP: tl.constexpr, DIL_T: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    ASSUME_FINITE: tl.constexpr, REDO: tl.constexpr, PDL: tl.constexpr = False,
    REDO_IN_PROGRAM: tl.constexpr = False,
    SPLIT_FULL: tl.constexpr = False,
):
    """Grid: (query tiles * GROUP, key/value heads, batch), as the forward kernel's
    (``GROUP``: query heads per key/value head). One program: dQ of a Q_T x Q_H x Q_W
    box of queries, scanning the union of their windows in KV_T x KV_H x KV_W key boxes.
    It also writes ``STATS`` (see the module docstring) for the dK/dV kernel that
    runs next. ``USE_TMA``: key and value boxes through tensor descriptors, as in
    the forward kernel. ``MASK_T/H/W``: as in the forward kernel (the launcher
    picks anything but ``MASK_PER_STEP`` only for a positive scale, so a masked
    score scales to -inf). ``FLAGS``, ``REDO``, ``DIL_T/H/W``: as in the forward
    kernel (``STATS`` stays in full-grid order). ``PDL``, ``SPLIT_FULL``,
    ``REDO_IN_PROGRAM``: as in the forward kernel.

    """
    run_programs(dq_tile, (Q, K, V, O, DO, LSE, DLSE, STATS, DQ, K_DESC, V_DESC,
                           (q_strides, k_strides, v_strides, o_strides, do_strides, dq_strides),
                           T, H, W, (KT, KH, KW, ST, SH, SW), (tiles_h, tiles_w), qk_scale, scale, HEAD_DIM, BLOCK_D,
                           (Q_T, Q_H, Q_W), (KV_T, KV_H, KV_W), (CAUSAL_T, CAUSAL_H, CAUSAL_W, STRIDED),
                           (MASK_T, MASK_H, MASK_W), (DIL_T, DIL_H, DIL_W), GROUP, HAS_DLSE, USE_TMA, SPLIT_FULL),
                 FLAGS, n_tiles, heads, n_programs, GROUP, False, ASSUME_FINITE, REDO, PDL, REDO_IN_PROGRAM)



@triton.jit
def dq_tile(
    tile, head, batch, heads, Q, K, V, O, DO, LSE, DLSE, STATS, DQ, K_DESC, V_DESC, strides, T, H, W, window, tiling,
    qk_scale, scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, Q_BOX: tl.constexpr, KV_BOX: tl.constexpr,
    WINDOW_FLAGS: tl.constexpr, MASKS: tl.constexpr, DILATION: tl.constexpr, GROUP: tl.constexpr,
    HAS_DLSE: tl.constexpr, USE_TMA: tl.constexpr, SPLIT_FULL: tl.constexpr, SAFE: tl.constexpr,
    ASSUME_FINITE: tl.constexpr,
):
    """One dQ program's work (and its statistics, unless ``SAFE``), ``head`` a query
    head (its keys and values: head ``head // GROUP``), the kernel's arguments
    grouped (``kernels.programs``' docstring). Returns whether its dQ holds an inf or
    NaN. ``SAFE``: the dQ elements a visible non-finite key reaches are first marked
    NaN in DQ, the tile is computed by the safe loop, and the marks are laid over it
    (``kernels.nonfinite``). Dilated: as the forward's tile."""
    # Rows past the grid's end repeat the last position and are not stored (as in
    # the forward kernel).
    prog = query_program(tile, batch, head, (Q, K, V, O, DO, DQ), strides, T, H, W, window, tiling, HEAD_DIM,
                         BLOCK_D, Q_BOX, WINDOW_FLAGS, DILATION)
    _, K, V, O, DO, DQ = prog.tensors
    _, k_strides, v_strides, o_strides, do_strides, dq_strides = strides
    box = prog.box
    BLOCK_Q: tl.constexpr = Q_BOX[0] * Q_BOX[1] * Q_BOX[2]
    # (The safe way would store the same statistics again.)
    do, lse2, delta = query_statistics(O, DO, LSE, DLSE, STATS, o_strides, do_strides, batch, head, heads,
                                       box.t.to(tl.int64), box.h.to(tl.int64), box.w.to(tl.int64), box.valid,
                                       prog.place, prog.cols, HAS_DLSE, not SAFE, DILATION)

    keys = program_keys(prog, batch, head, heads, K, V, K_DESC, V_DESC, k_strides, v_strides, DQ, dq_strides,
                        HEAD_DIM, BLOCK_Q, KV_BOX, WINDOW_FLAGS, DILATION, GROUP, False, SAFE)
    dq = dq_scan(prog.q, do, lse2, delta, keys, box, prog.nb, prog.union, qk_scale, prog.cols, HEAD_DIM, BLOCK_D,
                 BLOCK_Q, KV_BOX, WINDOW_FLAGS, MASKS, USE_TMA, SPLIT_FULL, SAFE)
    return store_query_tile(DQ, dq_strides, batch, head, box, dq, prog.cols, SAFE, ASSUME_FINITE, scale)


@triton.jit
def dq_scan(q, do, lse2, delta, keys, box, nb, union, qk_scale, cols, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_Q: tl.constexpr, KV_BOX: tl.constexpr, WINDOW_FLAGS: tl.constexpr, MASKS: tl.constexpr,
            USE_TMA: tl.constexpr, SPLIT_FULL: tl.constexpr, SAFE: tl.constexpr):
    """The dQ kernel's scan of the union of the windows of ``box`` (``union``) in key
    boxes read from ``keys`` (a ``memory.KeyBoxes``): dQ unscaled. ``SAFE``: the safe
    loop (``kernels.nonfinite``): masks by selection (window bits where they fit),
    ``dS`` too (a non-finite ``dP`` of a hidden key stays out), and multiplies ``dS``
    by the keys' finite part; not pipelined. ``SPLIT_FULL``: the key boxes every
    query sees whole first, in a loop without a mask, then the others, as the
    forward's scan (the safe loop in the same order)."""
    scan = box_scan(union, KV_BOX)
    dq = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    NO_MASK: tl.constexpr = no_mask(MASKS[0], MASKS[1], MASKS[2], SAFE)
    ON_PRODUCT: tl.constexpr = MASKS[0] + MASKS[1] + MASKS[2] > 0 and not SAFE and not NO_MASK
    SPLIT: tl.constexpr = SPLIT_FULL and not no_mask(MASKS[0], MASKS[1], MASKS[2], False)
    masks = key_scan_masks(box, nb, WINDOW_FLAGS, scan, MASKS, KV_BOX, BLOCK_Q, ON_PRODUCT, SAFE, float("-inf"))
    full, n_masked = split_scan(box, scan, nb, WINDOW_FLAGS, KV_BOX, SPLIT)
    if SPLIT:
        i_t, i_h, i_w = first_box()
        for _ in tl.range(full.scan.n_steps, num_stages=1 if SAFE else None):
            dq = dq_step(q, do, lse2, delta, keys, box, nb, union, full.scan, masks, i_t, i_h, i_w, dq, qk_scale,
                         cols, HEAD_DIM, BLOCK_D, BLOCK_Q, KV_BOX, WINDOW_FLAGS, MASKS, USE_TMA, SAFE, False, True)
            i_t, i_h, i_w = next_box(full.scan, i_t, i_h, i_w)
    i_t, i_h, i_w = first_masked_box(full, SPLIT)
    for _ in tl.range(n_masked, num_stages=1 if SAFE else None):
        dq = dq_step(q, do, lse2, delta, keys, box, nb, union, scan, masks, i_t, i_h, i_w, dq, qk_scale, cols,
                     HEAD_DIM, BLOCK_D, BLOCK_Q, KV_BOX, WINDOW_FLAGS, MASKS, USE_TMA, SAFE, ON_PRODUCT, NO_MASK)
        i_t, i_h, i_w = next_masked_box(scan, full, i_t, i_h, i_w, SPLIT)
    return dq


@triton.jit
def dq_step(q, do, lse2, delta, keys, box, nb, union, scan, masks, i_t, i_h, i_w, dq, qk_scale, cols,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, KV_BOX: tl.constexpr,
            WINDOW_FLAGS: tl.constexpr, MASKS: tl.constexpr, USE_TMA: tl.constexpr, SAFE: tl.constexpr,
            ON_PRODUCT: tl.constexpr, NO_MASK: tl.constexpr):
    """One step of :func:`dq_scan`: key box ``(i_t, i_h, i_w)`` of ``scan``, masked on
    the product (``ON_PRODUCT``), not at all (``NO_MASK``) or by selection; ``dq``
    brought up to date."""
    BLOCK_KV: tl.constexpr = KV_BOX[0] * KV_BOX[1] * KV_BOX[2]
    c_t, c_h, c_w, kt, kh, kw = box_at(scan, i_t, i_h, i_w, KV_BOX)
    if USE_TMA and not SAFE:
        # (the dilation group's place, see memory.load_key_box)
        corner = [keys.batch, c_t, c_h + keys.origin[0], c_w + keys.origin[1],
                  keys.head * HEAD_DIM + keys.origin[2] * keys.channels]
        k = keys.K_DESC.load(corner).reshape(BLOCK_KV, BLOCK_D)
        v = keys.V_DESC.load(corner).reshape(BLOCK_KV, BLOCK_D)
    else:
        # Keys past the union repeat its last position and are masked (memory.load_key_box).
        pt = tl.minimum(kt, union.t1 - 1).to(tl.int64)
        ph = tl.minimum(kh, union.h1 - 1).to(tl.int64)
        pw = tl.minimum(kw, union.w1 - 1).to(tl.int64)
        k = load_rows(keys.k_base, keys.k_strides, pt, ph, pw, cols)
        v = load_rows(keys.v_base, keys.v_strides, pt, ph, pw, cols)
    if ON_PRODUCT:
        bias = step_mask_bias(masks, kt, kh, kw, i_t, i_h, i_w, scan, MASKS, KV_BOX)
        s = tl.dot(q, tl.trans(k), bias, input_precision="ieee")
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
    elif NO_MASK:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
    else:
        visible = key_scan_visible(box, kt, kh, kw, masks, i_t, i_h, i_w, scan, nb, WINDOW_FLAGS, MASKS, KV_BOX,
                                   BLOCK_Q, SAFE)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
        p = tl.where(visible, tl.math.exp2(s * qk_scale - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision="ieee")
    ds = p * (dp - delta[:, None])
    if SAFE:
        if not NO_MASK:
            ds = tl.where(visible, ds, 0.0)
        k, _ = finite_part(k)
    return tl.dot(ds.to(k.dtype), k, dq, input_precision="ieee")


@triton.jit(do_not_specialize=["T", "H", "W", "tiles_h", "tiles_w", "n_tiles", "n_programs"])
def na3d_bwd_dkdv_kernel(
    Q, K, V, DO, STATS, DK, DV, DQ_ACC, Q_DESC, DO_DESC, DQ_DESC, STATS_DESC, FLAGS,
    q_strides, k_strides, v_strides, do_strides, dk_strides, dv_strides,
    T, H, W, KT, KH, KW, ST, SH, SW, tiles_h, tiles_w, n_tiles, heads, n_programs, qk_scale, scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    K_T: tl.constexpr, K_H: tl.constexpr, K_W: tl.constexpr, Q_T: tl.constexpr, Q_H: tl.constexpr, Q_W: tl.constexpr,
    CAUSAL_T: tl.constexpr, CAUSAL_H: tl.constexpr, CAUSAL_W: tl.constexpr, STRIDED: tl.constexpr,
    ACCUMULATE_DQ: tl.constexpr, USE_TMA: tl.constexpr, BULK_DQ: tl.constexpr,
    MASK_T: tl.constexpr, MASK_H: tl.constexpr, MASK_W: tl.constexpr,
    GROUP: tl.constexpr, DIL_T: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    ASSUME_FINITE: tl.constexpr, REDO: tl.constexpr, PDL: tl.constexpr = False,
    REDO_IN_PROGRAM: tl.constexpr = False,
    SPLIT_FULL: tl.constexpr = False,
):
    """Grid: (key tiles, key/value heads, batch). One program: dK and dV of a
    K_T x K_H x K_W box of keys, scanning the queries that see any of them (one box
    of queries, see ``queries_seeing``) in Q_T x Q_H x Q_W boxes, of each of the
    ``GROUP`` query heads that read its key/value head (grouped-query attention:
    each box's heads one after the other, the group's sum in a fixed order,
    without atomics). ``heads`` counts query heads.

    With ``ACCUMULATE_DQ`` (the fused backward) each step also adds its ``dS^T K``
    (unscaled) atomically into ``DQ_ACC``: float32, contiguous
    ``(B, T, H, W, NH, BLOCK_D)``, zero before the launch. Without it ``DQ_ACC`` is
    never touched. ``USE_TMA``: query and dO boxes through tensor descriptors
    (block ``(1, Q_T, Q_H, Q_W, HEAD_DIM)``), as in the forward kernel, and their
    statistics through ``STATS_DESC`` (module docstring); positions past the grid
    then read zeros for all four, so their terms are exact zeros without a range
    mask (dilated: the descriptors fold the groups, ``launch.box_descriptor``, and
    past a group's end the mask drops the next group's positions). Without it
    ``STATS_DESC`` is never read. ``MASK_T/H/W``: ``MASK_NONE`` on all three axes
    where the launcher has proven every (key box, query box) pair full
    (``geometry.block_sparse_axis``): the loop then masks nothing; any other
    value masks every step. ``BULK_DQ``
    (with ``ACCUMULATE_DQ``): the dQ additions as one bulk reduction per step
    through ``DQ_DESC`` (over ``DQ_ACC`` as ``(B, T, H, W, NH * BLOCK_D)``, same
    box) instead of an atomic per element; rows of queries outside the scanned
    range add exact zeros (their ``dS`` is masked to 0). ``FLAGS``, ``REDO``: as in the
    forward kernel; the second launch adds no dQ terms (the fused kernel adds them
    the safe way on every step). ``DIL_T/H/W``: as in the forward kernel, key tiles
    for query tiles (``DQ_ACC`` and ``STATS`` stay in full-grid order).

    ``REDO``: the second launch, on a grid (G,), any G: the programs the first
    launch flagged are computed again the safe way (``kernels.programs``), each by
    one of the G programs in turn; where no flag is set (finite inputs), each
    program reads its share of the flags and ends. ``PDL``, ``REDO_IN_PROGRAM``: as in
    the forward kernel. ``SPLIT_FULL``: the query boxes that see every key of the box first, in a loop
    without the window mask, then the others (``dkdv_scan``).
    """
    FULL_PAIRS: tl.constexpr = no_mask(MASK_T, MASK_H, MASK_W, False)
    run_programs(dkdv_tile, (Q, K, V, DO, STATS, DK, DV, DQ_ACC, Q_DESC, DO_DESC, DQ_DESC, STATS_DESC,
                             (q_strides, k_strides, v_strides, do_strides, dk_strides, dv_strides),
                             T, H, W, (KT, KH, KW, ST, SH, SW), (tiles_h, tiles_w), qk_scale, scale, HEAD_DIM, BLOCK_D,
                             (K_T, K_H, K_W), (Q_T, Q_H, Q_W), (CAUSAL_T, CAUSAL_H, CAUSAL_W, STRIDED),
                             (DIL_T, DIL_H, DIL_W), GROUP, USE_TMA, ACCUMULATE_DQ, BULK_DQ, FULL_PAIRS, SPLIT_FULL),
                 FLAGS, n_tiles, heads, n_programs, GROUP, True, ASSUME_FINITE, REDO, PDL, REDO_IN_PROGRAM)



@triton.jit
def dkdv_tile(
    tile, head, batch, heads, Q, K, V, DO, STATS, DK, DV, DQ_ACC, Q_DESC, DO_DESC, DQ_DESC, STATS_DESC, strides,
    T, H, W, window, tiling, qk_scale, scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, K_BOX: tl.constexpr,
    Q_BOX: tl.constexpr, WINDOW_FLAGS: tl.constexpr, DILATION: tl.constexpr, GROUP: tl.constexpr,
    USE_TMA: tl.constexpr, ACCUMULATE_DQ: tl.constexpr, BULK_DQ: tl.constexpr, FULL_PAIRS: tl.constexpr,
    SPLIT_FULL: tl.constexpr, SAFE: tl.constexpr, ASSUME_FINITE: tl.constexpr,
):
    """One dK/dV program's work: ``head`` a key/value head, its query heads
    ``head * GROUP ...`` scanned together (``dkdv_scan``), the kernel's arguments
    grouped (``kernels.programs``' docstring; ``K_BOX``: the box of keys, ``Q_BOX``:
    the scan's boxes of queries). Returns (unless ``ASSUME_FINITE``) which of its rows
    of dK or dV hold an inf or NaN. ``SAFE``: the safe way (``kernels.nonfinite``).
    Dilated: as the forward's tile, over a box of keys."""
    tile, T, H, W, place, tensors = dilation_group(tile, T, H, W, (Q, K, V, DO, DK, DV), strides, DILATION)
    Q, K, V, DO, DK, DV = tensors
    q_strides, k_strides, v_strides, do_strides, dk_strides, dv_strides = strides
    BLOCK_N: tl.constexpr = K_BOX[0] * K_BOX[1] * K_BOX[2]
    BLOCK_M: tl.constexpr = Q_BOX[0] * Q_BOX[1] * Q_BOX[2]
    tl.static_assert(BLOCK_M >= 16, "tl.dot needs tiles of at least 16")  # (BLOCK_N: program_box)
    # The safe way adds no dQ terms: the fused kernel's first launch added them the
    # safe way already.
    ADD_DQ: tl.constexpr = ACCUMULATE_DQ and not SAFE
    BULK_ADD_DQ: tl.constexpr = BULK_DQ and not SAFE
    # Keys past the grid's end repeat the last position; their dK/dV rows are not
    # stored, and no stored dK/dV row depends on them (dQ would: see below).
    nb = Neighborhood(T, H, W, *window)
    keys, span = program_box(tile, tiling, nb, WINDOW_FLAGS, K_BOX, DILATION[0] * DILATION[1] * DILATION[2] > 1,
                             False)

    cols = head_columns(HEAD_DIM, BLOCK_D)
    k = load_rows(head_base(K, k_strides, batch, head), k_strides, keys.t, keys.h, keys.w, cols)
    v = load_rows(head_base(V, v_strides, batch, head), v_strides, keys.t, keys.h, keys.w, cols)
    q_head = head * GROUP  # the group's first query head
    q_base = head_base(Q, q_strides, batch, q_head)
    do_base = head_base(DO, do_strides, batch, q_head)

    if SAFE:
        # dV elements a visible non-finite dO row reaches, and dK elements a
        # visible non-finite query reaches, are first marked NaN in DV and DK.
        dk_rows = position_offsets(dk_strides, keys.t, keys.h, keys.w)
        dv_rows = position_offsets(dv_strides, keys.t, keys.h, keys.w)
        marked = ((head_base(DV, dv_strides, batch, head), dv_rows, do_base, do_strides),
                  (head_base(DK, dk_strides, batch, head), dk_rows, q_base, q_strides))
        for i in tl.static_range(2):
            out_base, out_rows, src_base, src_strides = marked[i]
            mark_reached(out_base, out_rows, keys, src_base, src_strides, nb, WINDOW_FLAGS, span, HEAD_DIM, BLOCK_N,
                         Q_BOX, GROUP, False)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dk, dv = dkdv_scan(
        dk, dv, k, v, keys, QueryBoxes(Q_DESC, DO_DESC, STATS_DESC, q_base, do_base, q_strides, do_strides, STATS),
        DQ_ACC, DQ_DESC, batch, q_head, heads, batch.to(tl.int64), nb, span, place, qk_scale, cols, HEAD_DIM, BLOCK_D,
        BLOCK_N, Q_BOX, WINDOW_FLAGS, DILATION, GROUP, ADD_DQ, USE_TMA, BULK_ADD_DQ, FULL_PAIRS, SPLIT_FULL, SAFE)
    if SAFE:
        in_tile = keys.valid[:, None] & cols.ok[None, :]
        marks = tl.load(head_base(DV, dv_strides, batch, head) + dv_rows[:, None] + cols.d[None, :], mask=in_tile,
                        other=0.0)
        dv = tl.where(marks != marks, float("nan"), dv)
        marks = tl.load(head_base(DK, dk_strides, batch, head) + dk_rows[:, None] + cols.d[None, :], mask=in_tile,
                        other=0.0)
        dk = tl.where(marks != marks, float("nan"), dk)

    store = keys.valid[:, None] & cols.ok[None, :]
    dk_ptrs = (head_base(DK, dk_strides, batch, head) + position_offsets(dk_strides, keys.t, keys.h, keys.w)[:, None]
               + cols.d[None, :])
    dv_ptrs = (head_base(DV, dv_strides, batch, head) + position_offsets(dv_strides, keys.t, keys.h, keys.w)[:, None]
               + cols.d[None, :])
    dk = dk * scale
    # Checked row by row (a row's sum needs no shared memory, which keeps the loop's
    # register allocation within 4 instructions of the unchecked kernel's; a
    # whole-tile sum cost 18 and a spill: NOTES v21), on the float32 results before
    # their conversion, both tiles in one sum: an inf or NaN in either makes its
    # row's total non-finite. (Checked after the conversion, each stored element
    # was converted back, one at a time: about 210 more instructions a program,
    # NOTES v44.) A conversion that overflows the storage type is the exact result's
    # rounding and needs no recomputation.
    if not ASSUME_FINITE:
        nonfinite = nonfinite_rows(dk + dv)
    else:
        nonfinite = tl.zeros([BLOCK_N], tl.int1)
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=store)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=store)
    return nonfinite


@triton.jit
def dkdv_scan(dk, dv, k, v, keys, queries, DQ_ACC, DQ_DESC, batch, first_head, heads, bh, nb, span, place, qk_scale,
              cols, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, Q_BOX: tl.constexpr,
              WINDOW_FLAGS: tl.constexpr, DILATION: tl.constexpr, GROUP: tl.constexpr, ACCUMULATE_DQ: tl.constexpr,
              USE_TMA: tl.constexpr, BULK_DQ: tl.constexpr, FULL_PAIRS: tl.constexpr, SPLIT_FULL: tl.constexpr,
              SAFE: tl.constexpr):
    """The dK/dV kernel's scan over ``span``, the query boxes that see its keys
    (``keys``, a ``tiles.Box``; ``k``, ``v`` theirs), of the ``GROUP`` query heads from
    ``first_head`` on, read from ``queries`` (:class:`QueryBoxes`): ``(dk, dv)`` plus
    their terms, dK unscaled. The heads are one scan, innermost: step ``s`` takes
    head ``first_head + s % GROUP`` and the box moves on after a box's last head. One
    loop, so that grouped heads cost the registers and pipeline of one head, not a
    loop around the scan (NOTES v24: that spilled), and a box's heads, adjacent in
    memory, are read one after the other. ``nb`` and the positions are the dilation
    group's, ``place`` the group (``kernels.groups``). ``SAFE``: the safe loop
    (``kernels.nonfinite``): ``dS`` masked by selection, the products by the finite
    parts of dO (for dV) and Q (for dK); not pipelined. ``FULL_PAIRS``: every query
    of every box scanned sees every key of the program's box, and no box runs past
    the scanned range (the launcher's ``MASK_NONE`` on all axes): the fast loop masks
    nothing (the fused backward's keeps its mask: keys past the grid must not reach
    dQ). ``SPLIT_FULL`` (otherwise): the query boxes that see every key of the box
    (``tiles.full_boxes``) first, in a loop without the window mask (the fused
    backward's masks only keys past the grid), then the others, masked, as the
    forward's scan splits (the safe loop in the same order).

    With ``ACCUMULATE_DQ`` (the fused backward, fast loop only) each step's dQ
    terms go out at once (into ``DQ_ACC``, through ``DQ_DESC`` with ``BULK_DQ``) and
    cannot be taken back, so they are computed the safe way on every step: ``dS``
    masked by selection and multiplied by the keys' finite part, with NaN where a
    visible key is non-finite (the count only runs when the program's keys hold a
    non-finite element)."""
    NO_MASK: tl.constexpr = FULL_PAIRS and not SAFE and not ACCUMULATE_DQ
    SPLIT: tl.constexpr = SPLIT_FULL and not FULL_PAIRS
    # (The scan's steps before the rest of the set-up: this order of the code is the
    # one whose compiled kernels were measured.)
    steps = box_steps(span, Q_BOX)
    origin = descriptor_origin(place, DILATION)
    if ACCUMULATE_DQ:
        k_finite, k_ok = finite_part(k)
        k_has_nonfinite = has_nonfinite(k)
    else:  # (unused)
        k_finite, k_ok, k_has_nonfinite = k, k, False
    scan = box_scan(span, Q_BOX, steps)
    full, n_masked = split_scan(keys, scan, nb, WINDOW_FLAGS, Q_BOX, SPLIT, False)
    if SPLIT:
        i_t, i_h, i_w = first_box()
        for step in tl.range(full.scan.n_steps * GROUP, num_stages=1 if SAFE else None):
            dk, dv = dkdv_step(dk, dv, k, v, k_finite, k_ok, k_has_nonfinite, keys, queries, DQ_ACC, DQ_DESC, batch,
                               first_head, heads, bh, nb, span, place, origin, full.scan, i_t, i_h, i_w, step,
                               qk_scale, cols, HEAD_DIM, BLOCK_D, BLOCK_N, Q_BOX, WINDOW_FLAGS, DILATION, GROUP,
                               ACCUMULATE_DQ, USE_TMA, BULK_DQ, SAFE, True)
            i_t, i_h, i_w = next_query_box(full.scan, full, i_t, i_h, i_w, step, GROUP, False)
    i_t, i_h, i_w = first_masked_box(full, SPLIT)
    for step in tl.range(n_masked * GROUP, num_stages=1 if SAFE else None):
        dk, dv = dkdv_step(dk, dv, k, v, k_finite, k_ok, k_has_nonfinite, keys, queries, DQ_ACC, DQ_DESC, batch,
                           first_head, heads, bh, nb, span, place, origin, scan, i_t, i_h, i_w, step, qk_scale,
                           cols, HEAD_DIM, BLOCK_D, BLOCK_N, Q_BOX, WINDOW_FLAGS, DILATION, GROUP, ACCUMULATE_DQ,
                           USE_TMA, BULK_DQ, SAFE, NO_MASK)
        i_t, i_h, i_w = next_query_box(scan, full, i_t, i_h, i_w, step, GROUP, SPLIT)
    return dk, dv


@triton.jit
def next_query_box(scan, full, i_t, i_h, i_w, step, GROUP: tl.constexpr, SPLIT: tl.constexpr):
    """Box indices after step ``step`` of :func:`dkdv_scan`'s loop over ``scan``: the
    next box (past the full boxes ``full`` if ``SPLIT``) after a box's last head."""
    if GROUP > 1:
        n_t, n_h, n_w = next_masked_box(scan, full, i_t, i_h, i_w, SPLIT)
        box_done = step % GROUP == GROUP - 1
        i_t = tl.where(box_done, n_t, i_t)
        i_h = tl.where(box_done, n_h, i_h)
        i_w = tl.where(box_done, n_w, i_w)
    else:
        i_t, i_h, i_w = next_masked_box(scan, full, i_t, i_h, i_w, SPLIT)
    return i_t, i_h, i_w


@triton.jit
def dkdv_step(dk, dv, k, v, k_finite, k_ok, k_has_nonfinite, keys, queries, DQ_ACC, DQ_DESC, batch, first_head, heads,
              bh, nb, span, place, origin, scan, i_t, i_h, i_w, step, qk_scale, cols, HEAD_DIM: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, Q_BOX: tl.constexpr, WINDOW_FLAGS: tl.constexpr,
              DILATION: tl.constexpr, GROUP: tl.constexpr, ACCUMULATE_DQ: tl.constexpr, USE_TMA: tl.constexpr,
              BULK_DQ: tl.constexpr, SAFE: tl.constexpr, NO_MASK: tl.constexpr):
    """One step of :func:`dkdv_scan`: query box ``(i_t, i_h, i_w)`` of ``scan``, head
    ``first_head + step % GROUP``; ``(dk, dv)`` brought up to date. ``NO_MASK``: every
    query of the box sees every key of the program's and lies in the scanned range
    (only keys past the grid are masked, from the fused backward's dQ)."""
    BLOCK_M: tl.constexpr = Q_BOX[0] * Q_BOX[1] * Q_BOX[2]
    c_t, c_h, c_w, qt, qh, qw = box_at(scan, i_t, i_h, i_w, Q_BOX)
    head = first_head + step % GROUP
    hd = head.to(tl.int64)
    if USE_TMA and not SAFE:
        # Every query box through descriptors. Positions past the scanned range
        # inside the grid see none of the box's keys (the mask drops them); past
        # the grid, q, dO, lse and delta read zeros, so whatever the mask says
        # their dV, dS (and so dK, dQ) terms are exact zeros. Boxes are read in
        # the dilation group's place (groups.descriptor_origin).
        c_h += origin[0]
        c_w += origin[1]
        q = queries.Q_DESC.load([batch, c_t, c_h, c_w, head * HEAD_DIM + origin[2] * heads * HEAD_DIM]).reshape(
            BLOCK_M, BLOCK_D)
        do = queries.DO_DESC.load([batch, c_t, c_h, c_w, head * HEAD_DIM + origin[2] * heads * HEAD_DIM]).reshape(
            BLOCK_M, BLOCK_D)
        stats = queries.STATS_DESC.load([batch * heads + head, c_t, c_h, c_w, origin[2] * 4]).reshape(BLOCK_M, 2, 2)
        lse2_pad, delta_pad = tl.split(stats)
        lse2, _ = tl.split(lse2_pad)
        delta, _ = tl.split(delta_pad)
        if not NO_MASK:
            visible = sees(qt, qh, qw, keys.t, keys.h, keys.w, nb, WINDOW_FLAGS, True)
        if (DILATION[0] > 1 or DILATION[1] > 1) and not NO_MASK:
            # The descriptors fold group gt into the H axis and gh into the W axis
            # (launch.box_descriptor): there a box past its group's end reads the
            # next group's positions, not zeros, so those queries are masked out.
            # (Past the T axis' end, and past W's when only W is dilated, the
            # reads are zeros, as without dilation.)
            if DILATION[0] > 1 and DILATION[1] > 1:
                in_group = (qh < span.h1) & (qw < span.w1)
            elif DILATION[0] > 1:
                in_group = qh < span.h1
            else:
                in_group = qw < span.w1
            visible &= in_group[None, :]
        if ACCUMULATE_DQ and not BULK_DQ:
            q_in = (qt < span.t1) & (qh < span.h1) & (qw < span.w1)
            rows = position_rows(bh, hd, heads, qt, qh, qw, place, DILATION)
    else:
        # Queries past the range (neighbours, or repeats of its last one) are
        # masked out: a duplicate would count twice. (With NO_MASK no box runs
        # past the range.)
        if not NO_MASK:
            q_in = (qt < span.t1) & (qh < span.h1) & (qw < span.w1)
            qt = tl.minimum(qt, span.t1 - 1)
            qh = tl.minimum(qh, span.h1 - 1)
            qw = tl.minimum(qw, span.w1 - 1)
        elif ACCUMULATE_DQ:
            q_in = tl.full([BLOCK_M], True, tl.int1)
        pt, ph, pw = qt.to(tl.int64), qh.to(tl.int64), qw.to(tl.int64)
        q = load_rows(queries.q_base + (head - first_head) * queries.q_strides[4], queries.q_strides, pt, ph, pw,
                      cols)
        do = load_rows(queries.do_base + (head - first_head) * queries.do_strides[4], queries.do_strides, pt, ph,
                       pw, cols)
        rows = position_rows(bh, hd, heads, pt, ph, pw, place, DILATION)
        stats = queries.STATS + stats_index(batch, head, heads, qt, qh, qw, place, DILATION)
        lse2 = tl.load(stats)
        delta = tl.load(stats + 1)
        if not NO_MASK:
            visible = q_in[None, :] & sees(qt, qh, qw, keys.t, keys.h, keys.w, nb, WINDOW_FLAGS, True)
    if ACCUMULATE_DQ:
        # Keys past the grid's end (repeats of the last one) must not reach dQ.
        if NO_MASK:
            visible = tl.broadcast_to(keys.valid[:, None], [BLOCK_N, BLOCK_M])
        else:
            visible = visible & keys.valid[:, None]
    s_t = tl.dot(k, tl.trans(q), input_precision="ieee")
    if NO_MASK:
        p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])
    else:
        p_t = tl.where(visible, tl.math.exp2(s_t * qk_scale - lse2[None, :]), 0.0)
    if SAFE:
        do_operand, _ = finite_part(do)
        q_operand, _ = finite_part(q)
    else:
        do_operand = do
        q_operand = q
    dv = tl.dot(p_t.to(do.dtype), do_operand, dv, input_precision="ieee")
    dp_t = tl.dot(v, tl.trans(do), input_precision="ieee")
    ds_t = p_t * (dp_t - delta[None, :])
    if ACCUMULATE_DQ or (SAFE and not NO_MASK):
        ds_t = tl.where(visible, ds_t, 0.0)
    dk = tl.dot(ds_t.to(q.dtype), q_operand, dk, input_precision="ieee")
    if ACCUMULATE_DQ:
        dq_part = tl.dot(tl.trans(ds_t.to(q.dtype)), k_finite, input_precision="ieee")
        if k_has_nonfinite:
            dq_part = tl.where(count_nonfinite(tl.trans(visible), k_ok,
                                               tl.zeros([BLOCK_M, BLOCK_D], tl.float32)) > 0,
                               float("nan"), dq_part)
        if BULK_DQ:
            DQ_DESC.atomic_add([batch, c_t, c_h, c_w, head * BLOCK_D + origin[2] * heads * BLOCK_D],
                               dq_part.reshape(1, Q_BOX[0], Q_BOX[1], Q_BOX[2], BLOCK_D))
        else:
            tl.atomic_add(DQ_ACC + rows[:, None] * BLOCK_D + cols.d[None, :], dq_part,
                          mask=q_in[:, None] & cols.ok[None, :], sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["T", "H", "W", "tiles_h", "tiles_w"])
def na3d_bwd_delta_kernel(
    O, DO, LSE, DLSE, STATS, o_strides, do_strides, T, H, W, tiles_h, tiles_w,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, Q_T: tl.constexpr, Q_H: tl.constexpr, Q_W: tl.constexpr,
    HAS_DLSE: tl.constexpr,
):
    """Grid: (query tiles, heads, batch). ``STATS`` (module docstring: lse in log2
    units and ``delta = rowsum(dO * O) - dlse``) for a box of queries, for the fused
    kernel."""
    head = tl.program_id(1)
    batch = tl.program_id(2)
    _, _, _, qt, qh, qw, q_valid = box_of_program(tl.program_id(0), tiles_h, tiles_w, T, H, W, Q_T, Q_H, Q_W)
    cols = head_columns(HEAD_DIM, BLOCK_D)
    # (Positions are independent here: the full grid, whatever the dilation.)
    query_statistics(O, DO, LSE, DLSE, STATS, o_strides, do_strides, batch, head, tl.num_programs(1), qt.to(tl.int64),
                     qh.to(tl.int64), qw.to(tl.int64), q_valid, Place(T, H, W, T, H, W), cols, HAS_DLSE, True,
                     (1, 1, 1))
