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

import triton
import triton.language as tl

from .. import constants

# Every tl.dot says input_precision="ieee": float32 inputs then get true float32
# products (PyTorch's default for float32 matmul, not TF32); for 16-bit inputs the
# option changes nothing, and unlike "tf32" every backend (NVIDIA and AMD) accepts it.

from .common import (box_at, box_of_program, box_offsets, box_steps, count_nonfinite, descriptor_origin,
                     dilation_group, finite_part, first_box, grid_position, has_nonfinite, head_base, head_columns,
                     key_scan_masks, key_scan_visible, key_value_bases, load_rows, mark_reached, MASK_NONE, next_box,
                     nonfinite_rows, position_offsets, position_rows, program_box, queries_seeing, query_program,
                     run_programs, sees, step_mask_bias, store_query_tile)

LOG2_E = tl.constexpr(constants.LOG2_E)


@triton.jit
def stats_index(batch, head, heads, t, h, w, place, DIL_T: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr):
    """Element index (int64) of the lse of positions ``(t, h, w)`` of one (batch,
    head) in ``STATS``, positions of the dilation group ``place``
    (``kernels.common.dilation_group``); their delta is the next element."""
    T, H, W, t, h, w = grid_position(t, h, w, place, DIL_T, DIL_H, DIL_W)
    return ((((batch.to(tl.int64) * heads + head) * T + t) * H + h) * W + w) * 4


@triton.jit
def query_statistics(O, DO, LSE, DLSE, STATS, o_strides, do_strides, batch, head, heads, t, h, w, valid, place, d,
                     d_ok, HAS_DLSE: tl.constexpr, STORE: tl.constexpr, DIL_T: tl.constexpr, DIL_H: tl.constexpr,
                     DIL_W: tl.constexpr):
    """A box of queries' dO rows and statistics (module docstring): ``(do, lse2,
    delta)``, ``lse2`` the lse in log2 units and ``delta = rowsum(dO * O) - dlse``;
    with ``STORE`` also written to ``STATS`` where ``valid``. Positions ``(t, h, w)``
    of the dilation group ``place`` (int64); O and DO that group's (``dilation_group``)."""
    do = load_rows(head_base(DO, do_strides, batch, head), do_strides, t, h, w, d, d_ok)
    o = load_rows(head_base(O, o_strides, batch, head), o_strides, t, h, w, d, d_ok)
    rows = position_rows(batch.to(tl.int64), head.to(tl.int64), heads, t, h, w, place, DIL_T, DIL_H, DIL_W)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + rows)
    lse2 = tl.load(LSE + rows) * LOG2_E
    if STORE:
        stats = STATS + stats_index(batch, head, heads, t, h, w, place, DIL_T, DIL_H, DIL_W)
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
    ASSUME_FINITE: tl.constexpr, REDO: tl.constexpr,
):
    """Grid: (query tiles * GROUP, key/value heads, batch), as the forward kernel's
    (``GROUP``: query heads per key/value head). One program: dQ of a Q_T x Q_H x Q_W
    box of queries, scanning the union of their windows in KV_T x KV_H x KV_W key boxes.
    It also writes ``STATS`` (see the module docstring) for the dK/dV kernel that
    runs next. ``USE_TMA``: key and value boxes through tensor descriptors, as in
    the forward kernel. ``MASK_T/H/W``: as in the forward kernel (the launcher
    picks anything but ``MASK_PER_STEP`` only for a positive scale, so a masked
    score scales to -inf). ``FLAGS``, ``REDO``, ``DIL_T/H/W``: as in the forward
    kernel (``STATS`` stays in full-grid order).

    """
    run_programs(dq_tile, (Q, K, V, O, DO, LSE, DLSE, STATS, DQ, K_DESC, V_DESC,
                           (q_strides, k_strides, v_strides, o_strides, do_strides, dq_strides),
                           T, H, W, (KT, KH, KW, ST, SH, SW), (tiles_h, tiles_w), qk_scale, scale, HEAD_DIM, BLOCK_D,
                           (Q_T, Q_H, Q_W), (KV_T, KV_H, KV_W), (CAUSAL_T, CAUSAL_H, CAUSAL_W, STRIDED),
                           (MASK_T, MASK_H, MASK_W), (DIL_T, DIL_H, DIL_W), GROUP, HAS_DLSE, USE_TMA),
                 FLAGS, n_tiles, heads, n_programs, GROUP, False, ASSUME_FINITE, REDO)



@triton.jit
def dq_tile(
    tile, head, batch, heads, Q, K, V, O, DO, LSE, DLSE, STATS, DQ, K_DESC, V_DESC, strides, T, H, W, window, tiling,
    qk_scale, scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, Q_BOX: tl.constexpr, KV_BOX: tl.constexpr,
    WINDOW_FLAGS: tl.constexpr, MASKS: tl.constexpr, DILATION: tl.constexpr, GROUP: tl.constexpr,
    HAS_DLSE: tl.constexpr, USE_TMA: tl.constexpr, SAFE: tl.constexpr,
    ASSUME_FINITE: tl.constexpr,
):
    """One dQ program's work (and its statistics, unless ``SAFE``), ``head`` a query
    head (its keys and values: head ``head // GROUP``), the kernel's arguments
    grouped (``kernels.common``'s docstring). Returns whether
    its dQ holds an inf or NaN. ``SAFE``: the dQ elements a visible non-finite key
    reaches are first marked NaN in DQ, the tile is computed by the safe loop, and
    the marks are laid over it (``kernels.common``). Dilated: as the forward's tile."""
    # Rows past the grid's end repeat the last position and are not stored (as in
    # the forward kernel).
    T, H, W, place, tensors, qt, qh, qw, q_valid, union, d, d_ok, q = query_program(
        tile, batch, head, (Q, K, V, O, DO, DQ), strides, T, H, W, window, tiling, HEAD_DIM, BLOCK_D, Q_BOX,
        WINDOW_FLAGS, DILATION)
    _, K, V, O, DO, DQ = tensors
    _, k_strides, v_strides, o_strides, do_strides, dq_strides = strides
    BLOCK_Q: tl.constexpr = Q_BOX[0] * Q_BOX[1] * Q_BOX[2]
    # (The safe way would store the same statistics again.)
    do, lse2, delta = query_statistics(O, DO, LSE, DLSE, STATS, o_strides, do_strides, batch, head, heads,
                                       qt.to(tl.int64), qh.to(tl.int64), qw.to(tl.int64), q_valid, place, d, d_ok,
                                       HAS_DLSE, not SAFE, *DILATION)

    kv_head, k_base, v_base = key_value_bases(K, V, k_strides, v_strides, batch, head, GROUP)
    if SAFE:
        mark_reached(head_base(DQ, dq_strides, batch, head), position_offsets(dq_strides, qt, qh, qw), q_valid,
                     k_base, k_strides, qt, qh, qw, T, H, W, *window, *union,
                     HEAD_DIM, BLOCK_Q, *KV_BOX, *WINDOW_FLAGS, 1, True)
    dq = dq_scan(q, do, lse2, delta, K_DESC, V_DESC, k_base, v_base, k_strides, v_strides,
                 batch, kv_head, qt, qh, qw, T, H, W, *window,
                 *union, qk_scale, d, d_ok, descriptor_origin(place, *DILATION),
                 (heads // GROUP) * HEAD_DIM, HEAD_DIM, BLOCK_D, BLOCK_Q, *KV_BOX,
                 *WINDOW_FLAGS, USE_TMA, *MASKS, SAFE)
    return store_query_tile(DQ, dq_strides, batch, head, qt, qh, qw, q_valid, dq, d, d_ok, SAFE, ASSUME_FINITE, scale)


@triton.jit
def dq_scan(q, do, lse2, delta, K_DESC, V_DESC, k_base, v_base, k_strides, v_strides,
            batch, kv_head, qt, qh, qw, T, H, W, KT, KH, KW, ST, SH, SW,
            ut0, ut1, uh0, uh1, uw0, uw1, qk_scale, d, d_ok, origin, kv_channels,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
            KV_T: tl.constexpr, KV_H: tl.constexpr, KV_W: tl.constexpr,
            CAUSAL_T: tl.constexpr, CAUSAL_H: tl.constexpr, CAUSAL_W: tl.constexpr, STRIDED: tl.constexpr,
            USE_TMA: tl.constexpr, MASK_T: tl.constexpr, MASK_H: tl.constexpr, MASK_W: tl.constexpr,
            SAFE: tl.constexpr):
    """The dQ kernel's scan: dQ unscaled. ``SAFE``: the safe loop
    (``kernels.common``): masks by selection (window bits where they fit), ``dS``
    too (a non-finite ``dP`` of a hidden key stays out), and multiplies ``dS`` by
    the keys' finite part; not pipelined."""
    BLOCK_KV: tl.constexpr = KV_T * KV_H * KV_W
    steps_h, steps_w, n_steps = box_steps(ut0, ut1, uh0, uh1, uw0, uw1, KV_T, KV_H, KV_W)
    dq = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    off_t, off_h, off_w = box_offsets(KV_T, KV_H, KV_W)
    NO_MASK: tl.constexpr = (MASK_T == MASK_NONE and MASK_H == MASK_NONE and MASK_W == MASK_NONE) and not SAFE
    ON_PRODUCT: tl.constexpr = MASK_T + MASK_H + MASK_W > 0 and not SAFE and not NO_MASK
    windows, fixed_bias, bits = key_scan_masks(
        qt, qh, qw, T, H, W, KT, KH, KW, ST, SH, SW, ut0, uh0, uw0, off_t, off_h, off_w, CAUSAL_T, CAUSAL_H,
        CAUSAL_W, STRIDED, MASK_T, MASK_H, MASK_W, KV_T, KV_H, KV_W, BLOCK_Q, BLOCK_KV, ON_PRODUCT, SAFE,
        float("-inf"))
    i_t, i_h, i_w = first_box()
    for _ in tl.range(n_steps, num_stages=1 if SAFE else None):
        c_t, c_h, c_w, kt, kh, kw = box_at(i_t, i_h, i_w, ut0, uh0, uw0, off_t, off_h, off_w,
                                           KV_T, KV_H, KV_W)
        if USE_TMA and not SAFE:
            # (origin, kv_channels: the dilation group's place, see load_key_box)
            corner = [batch, c_t, c_h + origin[0], c_w + origin[1], kv_head * HEAD_DIM + origin[2] * kv_channels]
            k = K_DESC.load(corner).reshape(BLOCK_KV, BLOCK_D)
            v = V_DESC.load(corner).reshape(BLOCK_KV, BLOCK_D)
        else:
            # Keys past the union repeat its last position and are masked (load_key_box).
            pt = tl.minimum(kt, ut1 - 1).to(tl.int64)
            ph = tl.minimum(kh, uh1 - 1).to(tl.int64)
            pw = tl.minimum(kw, uw1 - 1).to(tl.int64)
            k = load_rows(k_base, k_strides, pt, ph, pw, d, d_ok)
            v = load_rows(v_base, v_strides, pt, ph, pw, d, d_ok)
        if ON_PRODUCT:
            bias = step_mask_bias(fixed_bias, kt, kh, kw, *windows, bits[0] >> (i_t * KV_T), bits[1] >> (i_h * KV_H),
                                  bits[2] >> (i_w * KV_W), off_t, off_h, off_w, MASK_T, MASK_H, MASK_W)
            s = tl.dot(q, tl.trans(k), bias, input_precision="ieee")
            p = tl.math.exp2(s * qk_scale - lse2[:, None])
        elif NO_MASK:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
            p = tl.math.exp2(s * qk_scale - lse2[:, None])
        else:
            visible = key_scan_visible(qt, qh, qw, kt, kh, kw, windows, bits, i_t, i_h, i_w, off_t, off_h, off_w,
                                       T, H, W, KT, KH, KW, ST, SH, SW, CAUSAL_T, CAUSAL_H, CAUSAL_W, STRIDED,
                                       MASK_T, MASK_H, MASK_W, KV_T, KV_H, KV_W, BLOCK_Q, BLOCK_KV, SAFE)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
            p = tl.where(visible, tl.math.exp2(s * qk_scale - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = p * (dp - delta[:, None])
        if SAFE:
            ds = tl.where(visible, ds, 0.0)
            k, _ = finite_part(k)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision="ieee")
        i_t, i_h, i_w = next_box(i_t, i_h, i_w, steps_h, steps_w)
    return dq


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
    ASSUME_FINITE: tl.constexpr, REDO: tl.constexpr,
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
    launch flagged are computed again the safe way (``kernels.common``), each by
    one of the G programs in turn; where no flag is set (finite inputs), each
    program reads its share of the flags and ends.
    """
    FULL_PAIRS: tl.constexpr = MASK_T == MASK_NONE and MASK_H == MASK_NONE and MASK_W == MASK_NONE
    run_programs(dkdv_tile, (Q, K, V, DO, STATS, DK, DV, DQ_ACC, Q_DESC, DO_DESC, DQ_DESC, STATS_DESC,
                             (q_strides, k_strides, v_strides, do_strides, dk_strides, dv_strides),
                             T, H, W, (KT, KH, KW, ST, SH, SW), (tiles_h, tiles_w), qk_scale, scale, HEAD_DIM, BLOCK_D,
                             (K_T, K_H, K_W), (Q_T, Q_H, Q_W), (CAUSAL_T, CAUSAL_H, CAUSAL_W, STRIDED),
                             (DIL_T, DIL_H, DIL_W), GROUP, USE_TMA, ACCUMULATE_DQ, BULK_DQ, FULL_PAIRS),
                 FLAGS, n_tiles, heads, n_programs, GROUP, True, ASSUME_FINITE, REDO)



@triton.jit
def dkdv_tile(
    tile, head, batch, heads, Q, K, V, DO, STATS, DK, DV, DQ_ACC, Q_DESC, DO_DESC, DQ_DESC, STATS_DESC, strides,
    T, H, W, window, tiling, qk_scale, scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, K_BOX: tl.constexpr,
    Q_BOX: tl.constexpr, WINDOW_FLAGS: tl.constexpr, DILATION: tl.constexpr, GROUP: tl.constexpr,
    USE_TMA: tl.constexpr, ACCUMULATE_DQ: tl.constexpr, BULK_DQ: tl.constexpr, FULL_PAIRS: tl.constexpr,
    SAFE: tl.constexpr, ASSUME_FINITE: tl.constexpr,
):
    """One dK/dV program's work: ``head`` a key/value head, its query heads
    ``head * GROUP ...`` scanned together (``dkdv_scan``), the kernel's arguments
    grouped (``kernels.common``'s docstring; ``K_BOX``: the box of keys, ``Q_BOX``:
    the scan's boxes of queries). Returns (unless ``ASSUME_FINITE``) which of its rows
    of dK or dV hold an inf or NaN. ``SAFE``: the safe way (``kernels.common``).
    Dilated: as the forward's tile, over a box of keys."""
    tile, T, H, W, place, tensors = dilation_group(tile, T, H, W, (Q, K, V, DO, DK, DV), strides, *DILATION)
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
    kt, kh, kw, k_valid, qt0, qt1, qh0, qh1, qw0, qw1 = program_box(
        tile, *tiling, T, H, W, *window, *WINDOW_FLAGS, *K_BOX, DILATION[0] * DILATION[1] * DILATION[2] > 1,
        queries_seeing)

    d, d_ok = head_columns(HEAD_DIM, BLOCK_D)
    k = load_rows(head_base(K, k_strides, batch, head), k_strides, kt, kh, kw, d, d_ok)
    v = load_rows(head_base(V, v_strides, batch, head), v_strides, kt, kh, kw, d, d_ok)
    q_head = head * GROUP  # the group's first query head
    q_base = head_base(Q, q_strides, batch, q_head)
    do_base = head_base(DO, do_strides, batch, q_head)

    if SAFE:
        # dV elements a visible non-finite dO row reaches, and dK elements a
        # visible non-finite query reaches, are first marked NaN in DV and DK.
        dk_rows = position_offsets(dk_strides, kt, kh, kw)
        dv_rows = position_offsets(dv_strides, kt, kh, kw)
        marked = ((head_base(DV, dv_strides, batch, head), dv_rows, do_base, do_strides),
                  (head_base(DK, dk_strides, batch, head), dk_rows, q_base, q_strides))
        for i in tl.static_range(2):
            out_base, out_rows, src_base, src_strides = marked[i]
            mark_reached(out_base, out_rows, k_valid, src_base, src_strides, kt, kh, kw, T, H, W, *window,
                         qt0, qt1, qh0, qh1, qw0, qw1, HEAD_DIM, BLOCK_N, *Q_BOX, *WINDOW_FLAGS, GROUP, False)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dk, dv = dkdv_scan(
        dk, dv, k, v, k_valid, q_base, do_base, STATS, DQ_ACC, Q_DESC, DO_DESC, DQ_DESC, STATS_DESC,
        q_strides, do_strides, batch, q_head, heads, batch.to(tl.int64), kt, kh, kw, T, H, W, *window,
        qt0, qt1, qh0, qh1, qw0, qw1, place, qk_scale, d, d_ok, HEAD_DIM, BLOCK_D, BLOCK_N, *Q_BOX,
        *WINDOW_FLAGS, ADD_DQ, USE_TMA, BULK_ADD_DQ, GROUP, *DILATION, FULL_PAIRS, SAFE)
    if SAFE:
        in_tile = k_valid[:, None] & d_ok[None, :]
        marks = tl.load(head_base(DV, dv_strides, batch, head) + dv_rows[:, None] + d[None, :], mask=in_tile, other=0.0)
        dv = tl.where(marks != marks, float("nan"), dv)
        marks = tl.load(head_base(DK, dk_strides, batch, head) + dk_rows[:, None] + d[None, :], mask=in_tile, other=0.0)
        dk = tl.where(marks != marks, float("nan"), dk)

    store = k_valid[:, None] & d_ok[None, :]
    dk_ptrs = (head_base(DK, dk_strides, batch, head) + position_offsets(dk_strides, kt, kh, kw)[:, None]
               + d[None, :])
    dv_ptrs = (head_base(DV, dv_strides, batch, head) + position_offsets(dv_strides, kt, kh, kw)[:, None]
               + d[None, :])
    dk = (dk * scale).to(DK.dtype.element_ty)
    dv = dv.to(DV.dtype.element_ty)
    tl.store(dk_ptrs, dk, mask=store)
    tl.store(dv_ptrs, dv, mask=store)
    # Checked as stored, row by row: the float32 accumulators are dead by then,
    # and a row's sum needs no shared memory, which keeps the loop's register
    # allocation within 4 instructions of the unchecked kernel's (a whole-tile sum
    # cost 18 and a spill: NOTES v21). A value that overflows the storage type is
    # flagged too, and merely recomputed.
    if not ASSUME_FINITE:
        return nonfinite_rows(dk) | nonfinite_rows(dv)
    return tl.zeros([BLOCK_N], tl.int1)


@triton.jit
def dkdv_scan(dk, dv, k, v, k_valid, q_base, do_base, STATS, DQ_ACC, Q_DESC, DO_DESC, DQ_DESC, STATS_DESC,
              q_strides, do_strides, batch, first_head, heads, bh,
              kt, kh, kw, T, H, W, KT, KH, KW, ST, SH, SW, qt0, qt1, qh0, qh1, qw0, qw1, place, qk_scale, d, d_ok,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
              Q_T: tl.constexpr, Q_H: tl.constexpr, Q_W: tl.constexpr,
              CAUSAL_T: tl.constexpr, CAUSAL_H: tl.constexpr, CAUSAL_W: tl.constexpr, STRIDED: tl.constexpr,
              ACCUMULATE_DQ: tl.constexpr, USE_TMA: tl.constexpr, BULK_DQ: tl.constexpr, GROUP: tl.constexpr,
              DIL_T: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr, FULL_PAIRS: tl.constexpr,
              SAFE: tl.constexpr):
    """The dK/dV kernel's scan over the query boxes that see its keys, of the
    ``GROUP`` query heads from ``first_head`` on (``q_base``, ``do_base``: that
    head's Q and dO): ``(dk, dv)`` plus their terms, dK unscaled. The heads are
    one scan, innermost: step ``s`` takes head ``first_head + s % GROUP`` and the
    box moves on after a box's last head. One loop, so that grouped heads cost the
    registers and pipeline of one head, not a loop around the scan (NOTES v24:
    that spilled), and a box's heads, adjacent in memory, are read one after the
    other. ``T, H, W`` and the positions are
    the dilation group's, ``place`` the group
    (``kernels.common.dilation_group``). ``SAFE``: the safe loop (``kernels.common``):
    ``dS`` masked by selection, the products by the finite parts of dO (for dV)
    and Q (for dK); not pipelined. ``FULL_PAIRS``: every query of every box
    scanned sees every key of the program's box, and no box runs past the scanned
    range (the launcher's ``MASK_NONE`` on all axes): the fast loop masks nothing
    (the fused backward's keeps its mask: keys past the grid must not reach dQ).

    With ``ACCUMULATE_DQ`` (the fused backward, fast loop only) each step's dQ
    terms go out at once and cannot be taken back, so they are computed the safe
    way on every step: ``dS`` masked by selection and multiplied by the keys'
    finite part, with NaN where a visible key is non-finite (the count only runs
    when the program's keys hold a non-finite element)."""
    BLOCK_M: tl.constexpr = Q_T * Q_H * Q_W
    NO_MASK: tl.constexpr = FULL_PAIRS and not SAFE and not ACCUMULATE_DQ
    steps_h, steps_w, n_steps = box_steps(qt0, qt1, qh0, qh1, qw0, qw1, Q_T, Q_H, Q_W)
    origin = descriptor_origin(place, DIL_T, DIL_H, DIL_W)
    if ACCUMULATE_DQ:
        k_finite, k_ok = finite_part(k)
        k_has_nonfinite = has_nonfinite(k)
    off_t, off_h, off_w = box_offsets(Q_T, Q_H, Q_W)
    i_t, i_h, i_w = first_box()
    for step in tl.range(n_steps * GROUP, num_stages=1 if SAFE else None):
        c_t, c_h, c_w, qt, qh, qw = box_at(i_t, i_h, i_w, qt0, qh0, qw0, off_t, off_h, off_w,
                                           Q_T, Q_H, Q_W)
        head = first_head + step % GROUP
        hd = head.to(tl.int64)
        if USE_TMA and not SAFE:
            # Every query box through descriptors. Positions past the scanned range
            # inside the grid see none of the box's keys (the mask drops them); past
            # the grid, q, dO, lse and delta read zeros, so whatever the mask says
            # their dV, dS (and so dK, dQ) terms are exact zeros. Boxes are read in
            # the dilation group's place (kernels.common.descriptor_origin).
            c_h += origin[0]
            c_w += origin[1]
            q = Q_DESC.load([batch, c_t, c_h, c_w, head * HEAD_DIM + origin[2] * heads * HEAD_DIM]).reshape(
                BLOCK_M, BLOCK_D)
            do = DO_DESC.load([batch, c_t, c_h, c_w, head * HEAD_DIM + origin[2] * heads * HEAD_DIM]).reshape(
                BLOCK_M, BLOCK_D)
            stats = STATS_DESC.load([batch * heads + head, c_t, c_h, c_w, origin[2] * 4]).reshape(BLOCK_M, 2, 2)
            lse2_pad, delta_pad = tl.split(stats)
            lse2, _ = tl.split(lse2_pad)
            delta, _ = tl.split(delta_pad)
            if not NO_MASK:
                visible = sees(qt, qh, qw, kt, kh, kw, T, H, W, KT, KH, KW, ST, SH, SW,
                               CAUSAL_T, CAUSAL_H, CAUSAL_W, STRIDED, True)
            if (DIL_T > 1 or DIL_H > 1) and not NO_MASK:
                # The descriptors fold group gt into the H axis and gh into the W axis
                # (launch.box_descriptor): there a box past its group's end reads the
                # next group's positions, not zeros, so those queries are masked out.
                # (Past the T axis' end, and past W's when only W is dilated, the
                # reads are zeros, as without dilation.)
                if DIL_T > 1 and DIL_H > 1:
                    in_group = (qh < qh1) & (qw < qw1)
                elif DIL_T > 1:
                    in_group = qh < qh1
                else:
                    in_group = qw < qw1
                visible &= in_group[None, :]
            if ACCUMULATE_DQ and not BULK_DQ:
                q_in = (qt < qt1) & (qh < qh1) & (qw < qw1)
                rows = position_rows(bh, hd, heads, qt, qh, qw, place, DIL_T, DIL_H, DIL_W)
        else:
            # Queries past the range (neighbours, or repeats of its last one) are
            # masked out: a duplicate would count twice. (With NO_MASK no box runs
            # past the range.)
            if not NO_MASK:
                q_in = (qt < qt1) & (qh < qh1) & (qw < qw1)
                qt = tl.minimum(qt, qt1 - 1)
                qh = tl.minimum(qh, qh1 - 1)
                qw = tl.minimum(qw, qw1 - 1)
            pt, ph, pw = qt.to(tl.int64), qh.to(tl.int64), qw.to(tl.int64)
            q = load_rows(q_base + (head - first_head) * q_strides[4], q_strides, pt, ph, pw, d, d_ok)
            do = load_rows(do_base + (head - first_head) * do_strides[4], do_strides, pt, ph, pw, d, d_ok)
            rows = position_rows(bh, hd, heads, pt, ph, pw, place, DIL_T, DIL_H, DIL_W)
            stats = STATS + stats_index(batch, head, heads, qt, qh, qw, place, DIL_T, DIL_H, DIL_W)
            lse2 = tl.load(stats)
            delta = tl.load(stats + 1)
            if not NO_MASK:
                visible = q_in[None, :] & sees(qt, qh, qw, kt, kh, kw, T, H, W, KT, KH, KW, ST, SH, SW,
                                               CAUSAL_T, CAUSAL_H, CAUSAL_W, STRIDED, True)
        if ACCUMULATE_DQ:
            # Keys past the grid's end (repeats of the last one) must not reach dQ.
            visible = visible & k_valid[:, None]
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
        if SAFE or ACCUMULATE_DQ:
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
                                   dq_part.reshape(1, Q_T, Q_H, Q_W, BLOCK_D))
            else:
                tl.atomic_add(DQ_ACC + rows[:, None] * BLOCK_D + d[None, :], dq_part,
                              mask=q_in[:, None] & d_ok[None, :], sem="relaxed")
        if GROUP > 1:  # the box's last head: the next box
            n_t, n_h, n_w = next_box(i_t, i_h, i_w, steps_h, steps_w)
            box_done = step % GROUP == GROUP - 1
            i_t = tl.where(box_done, n_t, i_t)
            i_h = tl.where(box_done, n_h, i_h)
            i_w = tl.where(box_done, n_w, i_w)
        else:
            i_t, i_h, i_w = next_box(i_t, i_h, i_w, steps_h, steps_w)
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
    d, d_ok = head_columns(HEAD_DIM, BLOCK_D)
    # (Positions are independent here: the full grid, whatever the dilation.)
    query_statistics(O, DO, LSE, DLSE, STATS, o_strides, do_strides, batch, head, tl.num_programs(1), qt.to(tl.int64),
                     qh.to(tl.int64), qw.to(tl.int64), q_valid, (T, H, W, T, H, W), d, d_ok, HAS_DLSE, True, 1, 1, 1)
