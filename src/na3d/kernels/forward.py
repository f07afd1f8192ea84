"""Forward kernel: flash-style 3D neighborhood attention over box tiles."""

import triton
import triton.language as tl

# Every tl.dot says input_precision="ieee": float32 inputs then get true float32
# products (PyTorch's default for float32 matmul, not TF32); for 16-bit inputs the
# option changes nothing, and unlike "tf32" every backend (NVIDIA and AMD) accepts it.

from .. import constants
from .groups import position_rows
from .masks import key_scan_masks, key_scan_visible, no_mask, step_mask_bias
from .memory import load_key_box
from .nonfinite import finite_part
from .programs import program_keys, query_program, run_programs, store_query_tile
from .softmax import online_softmax_step
from .tiles import box_at, box_scan, first_box, first_masked_box, next_box, next_masked_box, split_scan

LN_2 = tl.constexpr(constants.LN_2)


@triton.jit(do_not_specialize=["T", "H", "W", "tiles_h", "tiles_w", "n_tiles", "n_programs"])
def na3d_fwd_kernel(
    Q, K, V, O, LSE, K_DESC, V_DESC, FLAGS, q_strides, k_strides, v_strides, o_strides,
    T, H, W, KT, KH, KW, ST, SH, SW, tiles_h, tiles_w, n_tiles, heads, n_programs, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    Q_T: tl.constexpr, Q_H: tl.constexpr, Q_W: tl.constexpr, KV_T: tl.constexpr, KV_H: tl.constexpr, KV_W: tl.constexpr,
    CAUSAL_T: tl.constexpr, CAUSAL_H: tl.constexpr, CAUSAL_W: tl.constexpr, STRIDED: tl.constexpr,
    RETURN_LSE: tl.constexpr, SCALE_SIGN: tl.constexpr, USE_TMA: tl.constexpr,
    MASK_T: tl.constexpr, MASK_H: tl.constexpr, MASK_W: tl.constexpr, GROUP: tl.constexpr,
    DIL_T: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr, ASSUME_FINITE: tl.constexpr,
    REDO: tl.constexpr, PDL: tl.constexpr = False, REDO_IN_PROGRAM: tl.constexpr = False,
    SPLIT_FULL: tl.constexpr = False,
):
    """Grid: (query tiles * GROUP, key/value heads, batch). One program: a
    Q_T x Q_H x Q_W box of queries of one (batch, head), against the union of their
    windows, scanned in KV_T x KV_H x KV_W boxes of keys with an online softmax
    (log2 domain, fp32).

    ``GROUP``: query heads per key/value head (grouped-query attention; 1 for
    multi-head). Query head ``n`` reads key/value head ``n // GROUP``; the GROUP
    programs of a box of queries that share a key/value head are adjacent in the
    grid, so that its keys and values are read from memory once and from L2 after.
    ``heads`` counts query heads.

    ``DIL_T/H/W``: NATTEN's dilation. The query tiles are then (box, dilation group)
    pairs over the largest group's sub-grid (``kernels.groups``), and
    the stride tuples a group's (``launch.group_strides``: t, h, w times the dilation).

    ``qk_scale`` is the softmax scale times log2(e), ``SCALE_SIGN`` its sign (-1, 0,
    1). LSE, when stored, is the natural log-sum-exp per query, float32, contiguous
    ``(B, T, H, W, NH)``.

    ``USE_TMA``: K and V boxes come through the tensor descriptors ``K_DESC``/``V_DESC``
    (Hopper's copy engine; 5-D ``(B, T, H, W, NH * HEAD_DIM)`` views, block
    ``(1, KV_T, KV_H, KV_W, HEAD_DIM)``), which saves the per-element address
    arithmetic and registers. Boxes then start at the scan position itself: a box
    running past the union reads the neighbouring keys (zeros past the tensor's
    end), which the mask drops. Without it the descriptors are never read.

    ``MASK_T/H/W`` (``kernels.masks``): how each axis' part of the window mask is
    applied. ``MASK_FIXED``: the launcher guarantees that along this axis every
    program's union fits one key box (``geometry.union_width_bound``), so the scan
    never moves there and that part is the same on every step; it is computed once,
    as an additive 0 / -inf matrix, and handed to the QK^T product as its
    accumulator, so the tensor cores add it. Each step then selects only on the
    axes that move (one select per score instead of two), written straight into the
    accumulator: ``MASK_BITS`` axes by testing per-query window bits shifted to the
    step, ``MASK_PER_STEP`` ones by comparing positions. With no ``MASK_FIXED`` axis
    (or a zero scale) the kernel masks the scores after the product instead.

    ``FLAGS``: int8 per program (``tile + n_tiles * (head + heads * batch)``), set to
    1 where the program's output holds an inf or NaN (``kernels.nonfinite``: the
    second launch, ``REDO``, computes those tiles again the safe way), 0
    elsewhere.

    ``REDO``: the second launch, on a grid (G,), any G: the programs the first
    launch flagged are computed again the safe way (``kernels.programs``), each by
    one of the G programs in turn; where no flag is set (finite inputs), each
    program reads its share of the flags and ends. ``PDL``: the second launch
    overlaps the first one's end (programmatic dependent launch, Hopper on;
    ``programs.run_programs``).
    ``REDO_IN_PROGRAM``: no second launch: a program whose tile holds an inf or NaN
    computes it again the safe way itself (``programs.run_programs``).

    ``SPLIT_FULL``: each program scans first the key boxes that all its queries see
    whole, without a mask, then the others, masked as above (``tiles.FullBoxes``).
    """
    run_programs(forward_tile, (Q, K, V, O, LSE, K_DESC, V_DESC, (q_strides, k_strides, v_strides, o_strides),
                                T, H, W, (KT, KH, KW, ST, SH, SW), (tiles_h, tiles_w), qk_scale, HEAD_DIM, BLOCK_D,
                                (Q_T, Q_H, Q_W), (KV_T, KV_H, KV_W), (CAUSAL_T, CAUSAL_H, CAUSAL_W, STRIDED),
                                (MASK_T, MASK_H, MASK_W), (DIL_T, DIL_H, DIL_W), GROUP, RETURN_LSE, SCALE_SIGN,
                                USE_TMA, SPLIT_FULL),
                 FLAGS, n_tiles, heads, n_programs, GROUP, False, ASSUME_FINITE, REDO, PDL, REDO_IN_PROGRAM)


@triton.jit
def forward_tile(
    tile, head, batch, heads, Q, K, V, O, LSE, K_DESC, V_DESC, strides, T, H, W, window, tiling, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, Q_BOX: tl.constexpr, KV_BOX: tl.constexpr,
    WINDOW_FLAGS: tl.constexpr, MASKS: tl.constexpr, DILATION: tl.constexpr, GROUP: tl.constexpr,
    RETURN_LSE: tl.constexpr, SCALE_SIGN: tl.constexpr, USE_TMA: tl.constexpr, SPLIT_FULL: tl.constexpr,
    SAFE: tl.constexpr, ASSUME_FINITE: tl.constexpr,
):
    """One program's work: the output (and lse) of one box of queries of one
    (batch, head), ``head`` a query head (its keys and values: head ``head // GROUP``).
    The kernel's arguments come grouped (``kernels.programs``' docstring).
    Returns (unless ``ASSUME_FINITE``) whether the output holds an inf or NaN. ``SAFE``: the
    safe way (``kernels.nonfinite``): the outputs a visible non-finite value reaches
    are first marked NaN in O, the tile is computed by the safe loop, and the
    marks are laid over it. Dilated: the box lies in one dilation group, whose
    sub-grid and tensors stand for the full ones from here on."""
    prog = query_program(tile, batch, head, (Q, K, V, O), strides, T, H, W, window, tiling, HEAD_DIM, BLOCK_D, Q_BOX,
                         WINDOW_FLAGS, DILATION)
    _, K, V, O = prog.tensors
    _, k_strides, v_strides, o_strides = strides
    box = prog.box
    BLOCK_Q: tl.constexpr = Q_BOX[0] * Q_BOX[1] * Q_BOX[2]
    keys = program_keys(prog, batch, head, heads, K, V, K_DESC, V_DESC, k_strides, v_strides, O, o_strides, HEAD_DIM,
                        BLOCK_Q, KV_BOX, WINDOW_FLAGS, DILATION, GROUP, True, SAFE)
    acc, m_i, l_i = forward_scan(prog.q, keys, box, prog.nb, prog.union, qk_scale, prog.cols, HEAD_DIM, BLOCK_D,
                                 BLOCK_Q, KV_BOX, WINDOW_FLAGS, MASKS, SCALE_SIGN, USE_TMA, SPLIT_FULL, SAFE)
    nonfinite = store_query_tile(O, o_strides, batch, head, box, acc / l_i[:, None], prog.cols, SAFE, ASSUME_FINITE)
    if RETURN_LSE:
        lse_rows = position_rows(batch, head, heads, box.t, box.h, box.w, prog.place, DILATION)
        # m_i is in log2 units of the scaled scores; convert to natural log.
        tl.store(LSE + lse_rows, (m_i + tl.math.log2(l_i)) * LN_2, mask=box.valid)
    # (A NaN lse comes with a NaN output row.)
    return nonfinite


@triton.jit
def forward_scan(q, keys, box, nb, union, qk_scale, cols, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_Q: tl.constexpr, KV_BOX: tl.constexpr, WINDOW_FLAGS: tl.constexpr, MASKS: tl.constexpr,
                 SCALE_SIGN: tl.constexpr, USE_TMA: tl.constexpr, SPLIT_FULL: tl.constexpr, SAFE: tl.constexpr):
    """The scan of one program's union of windows (``union``, a ``tiles.Span``) in
    key boxes read from ``keys`` (a ``memory.KeyBoxes``), for the queries ``q`` of
    ``box``: ``(acc, m, l)``, the unnormalized output, row maximum and sum (log2
    domain). ``SAFE``: the safe loop (``kernels.nonfinite``): masks by selection,
    multiplies by the values' finite part; not pipelined, so that it adds no shared
    memory. ``SPLIT_FULL``: the key boxes every query sees whole first, in a loop
    without a mask, then the others (``tiles.FullBoxes``; the safe loop in the same
    order; a zero scale, or a scan with nothing to mask, does not split)."""
    scan = box_scan(union, KV_BOX)
    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    # Scores the mask drops: -inf, or +inf when the scale is negative (the row
    # "maximum" is then taken as a minimum of the raw scores: softmax).
    MASKED: tl.constexpr = float("inf") if SCALE_SIGN < 0 else float("-inf")
    # (A zero scale has no scores to add the bias to: it keeps the plain mask; so
    # does the safe loop, which must select, not add, the mask.)
    NO_MASK: tl.constexpr = no_mask(MASKS[0], MASKS[1], MASKS[2], SAFE)
    ON_PRODUCT: tl.constexpr = (MASKS[0] + MASKS[1] + MASKS[2] > 0) and SCALE_SIGN != 0 and not SAFE and not NO_MASK
    MASK_SCORES: tl.constexpr = not ON_PRODUCT and not NO_MASK
    SPLIT: tl.constexpr = SPLIT_FULL and SCALE_SIGN != 0 and not no_mask(MASKS[0], MASKS[1], MASKS[2], False)
    masks = key_scan_masks(box, nb, WINDOW_FLAGS, scan, MASKS, KV_BOX, BLOCK_Q, ON_PRODUCT, SAFE, MASKED)
    full, n_masked = split_scan(box, scan, nb, WINDOW_FLAGS, KV_BOX, SPLIT)
    if SPLIT:
        i_t, i_h, i_w = first_box()
        for _ in tl.range(full.scan.n_steps, num_stages=1 if SAFE else None):
            acc, m_i, l_i = forward_step(q, keys, box, nb, union, full.scan, masks, i_t, i_h, i_w, acc, m_i, l_i,
                                         qk_scale, cols, HEAD_DIM, BLOCK_D, BLOCK_Q, KV_BOX, WINDOW_FLAGS, MASKS,
                                         SCALE_SIGN, USE_TMA, SAFE, MASKED, False, False)
            i_t, i_h, i_w = next_box(full.scan, i_t, i_h, i_w)
    i_t, i_h, i_w = first_masked_box(full, SPLIT)
    for _ in tl.range(n_masked, num_stages=1 if SAFE else None):
        acc, m_i, l_i = forward_step(q, keys, box, nb, union, scan, masks, i_t, i_h, i_w, acc, m_i, l_i, qk_scale,
                                     cols, HEAD_DIM, BLOCK_D, BLOCK_Q, KV_BOX, WINDOW_FLAGS, MASKS, SCALE_SIGN,
                                     USE_TMA, SAFE, MASKED, ON_PRODUCT, MASK_SCORES)
        i_t, i_h, i_w = next_masked_box(scan, full, i_t, i_h, i_w, SPLIT)
    return acc, m_i, l_i


@triton.jit
def forward_step(q, keys, box, nb, union, scan, masks, i_t, i_h, i_w, acc, m_i, l_i, qk_scale, cols,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, KV_BOX: tl.constexpr,
                 WINDOW_FLAGS: tl.constexpr, MASKS: tl.constexpr, SCALE_SIGN: tl.constexpr, USE_TMA: tl.constexpr,
                 SAFE: tl.constexpr, MASKED: tl.constexpr, ON_PRODUCT: tl.constexpr, MASK_SCORES: tl.constexpr):
    """One step of :func:`forward_scan`: key box ``(i_t, i_h, i_w)`` of ``scan``, masked
    on the product (``ON_PRODUCT``), by selection (``MASK_SCORES``) or not at all;
    ``(acc, m, l)`` brought up to date."""
    BLOCK_KV: tl.constexpr = KV_BOX[0] * KV_BOX[1] * KV_BOX[2]
    c_t, c_h, c_w, kt, kh, kw = box_at(scan, i_t, i_h, i_w, KV_BOX)
    k = load_key_box(keys, False, c_t, c_h, c_w, kt, kh, kw, union, cols, HEAD_DIM, BLOCK_KV, BLOCK_D,
                     USE_TMA and not SAFE)
    if ON_PRODUCT:
        bias = step_mask_bias(masks, kt, kh, kw, i_t, i_h, i_w, scan, MASKS, KV_BOX, MASKED)
        s = tl.dot(q, tl.trans(k), bias, input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
        if MASK_SCORES:
            visible = key_scan_visible(box, kt, kh, kw, masks, i_t, i_h, i_w, scan, nb, WINDOW_FLAGS, MASKS,
                                       KV_BOX, BLOCK_Q, SAFE)
    p, alpha, m_new, l_i = online_softmax_step(s, visible if MASK_SCORES else None, m_i, l_i, qk_scale,
                                               SCALE_SIGN, MASK_SCORES)
    v = load_key_box(keys, True, c_t, c_h, c_w, kt, kh, kw, union, cols, HEAD_DIM, BLOCK_KV, BLOCK_D,
                     USE_TMA and not SAFE)
    if SAFE:
        v, _ = finite_part(v)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    return acc, m_new, l_i
