"""Device-side helpers shared by the Triton kernels.

They are the kernels' copies of ``na3d.geometry`` (kept in step with it by
``tests/test_geometry.py``) plus the box bookkeeping every kernel starts with.
A ``CAUSAL`` flag is a compile-time constant: a causal axis costs nothing on the
others, and the non-causal code is unchanged by it. So is ``STRIDED`` (some axis
has a NATTEN stride > 1): without it the stride arguments are never read and the
code is that of stride 1. So are the dilations ``DIL_T/H/W``: at dilation 1 the
code is that of a kernel without them (:func:`dilation_group`).

The kernels take their arguments one by one (the launch's signature) and hand
them to their tile functions (:func:`run_programs`) grouped, as tuples:
``strides`` (one (b, t, h, w, n) tuple per tensor, in the tensors' order),
``window = (KT, KH, KW, ST, SH, SW)``, ``tiling = (tiles_h, tiles_w)``, and the
compile-time ``Q_BOX``/``KV_BOX``/``K_BOX`` (a box's T, H, W sizes),
``WINDOW_FLAGS = (CAUSAL_T, CAUSAL_H, CAUSAL_W, STRIDED)``, ``MASKS = (MASK_T,
MASK_H, MASK_W)`` and ``DILATION = (DIL_T, DIL_H, DIL_W)``. A tuple goes on into
the helpers spread (``*window``) or indexed (``Q_BOX[0]``): in Triton 3.6 a tuple
of constants unpacked by an assignment is no longer constant.
"""

import triton
import triton.language as tl

from .. import constants


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
def box_of_program(tile, tiles_h, tiles_w, T, H, W,
                   BOX_T: tl.constexpr, BOX_H: tl.constexpr, BOX_W: tl.constexpr, DILATED: tl.constexpr = False):
    """The BOX_T x BOX_H x BOX_W box of grid positions that program ``tile`` owns
    (tiles numbered row-major over the grid).

    Returns the box's first corner ``(t0, h0, w0)``, the coordinates of its
    positions (row-major inside the box) and which of them lie inside the grid.
    Positions past the grid's end are replaced by the last one along that axis:
    loads through them stay in bounds and their windows are non-empty; the caller
    stores nothing for them.

    ``DILATED``: the grid is a dilation group's sub-grid, tiled as the largest
    group's (:func:`dilation_group`), so a box may start past this group's end
    (groups differ in length by one). Such a program takes the group's last box
    along that axis instead and marks none of its positions inside: its windows
    are real ones, and it stores nothing.
    """
    t0 = (tile // (tiles_w * tiles_h)) * BOX_T
    h0 = ((tile // tiles_w) % tiles_h) * BOX_H
    w0 = (tile % tiles_w) * BOX_W
    if DILATED:
        last_t = ((T - 1) // BOX_T) * BOX_T
        last_h = ((H - 1) // BOX_H) * BOX_H
        last_w = ((W - 1) // BOX_W) * BOX_W
        box_in_grid = (t0 <= last_t) & (h0 <= last_h) & (w0 <= last_w)
        t0 = tl.minimum(t0, last_t)
        h0 = tl.minimum(h0, last_h)
        w0 = tl.minimum(w0, last_w)
    r = tl.arange(0, BOX_T * BOX_H * BOX_W)
    t = t0 + r // (BOX_H * BOX_W)
    h = h0 + (r // BOX_W) % BOX_H
    w = w0 + r % BOX_W
    inside = (t < T) & (h < H) & (w < W)
    if DILATED:
        inside = inside & box_in_grid
    return t0, h0, w0, tl.minimum(t, T - 1), tl.minimum(h, H - 1), tl.minimum(w, W - 1), inside


@triton.jit
def dilation_group(tile, T, H, W, tensors, strides, DIL_T: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr):
    """NATTEN's dilation, in one launch. With dilation ``d`` an axis of length ``L``
    splits into ``d`` groups by ``index % d``, group ``g`` holding positions
    ``g + d * i`` for ``i < ceil((L - g) / d)``, and attention runs at dilation 1
    inside each group (``geometry.window_bounds``). A program works inside one
    group's sub-grid: its boxes, windows and scans are in the group's own
    coordinates, and memory is reached through the group's view of each tensor
    (its first position, and strides times the dilation, which the launcher
    passes: ``launch.group_strides``) and :func:`grid_position` (the full grid's
    own arrays: lse, statistics).

    ``tile`` numbers (box, group) pairs, the groups innermost (neighbouring
    programs read interleaved, so neighbouring, memory), the boxes over the largest
    group's sub-grid (``ceil(L / d)`` per axis; see :func:`box_of_program`).
    ``tensors``: ``(B, T, H, W, N, C)`` tensors, ``strides`` theirs (b, t, h, w, n).
    Returns ``(tile, T, H, W, place, tensors)``: the box's number in its group, the
    group's lengths, ``place = (T, H, W, gt, gh, gw)`` (the full grid's lengths and
    the group), and the tensors moved to the group's first position. At dilation
    1 the arguments come back as they are (``place`` then holds placeholders that
    nothing reads)."""
    GROUPS: tl.constexpr = DIL_T * DIL_H * DIL_W
    if GROUPS == 1:
        place = (T, H, W, T, H, W)
    else:
        g = tile % GROUPS
        gt = g // (DIL_H * DIL_W)
        gh = (g // DIL_W) % DIL_H
        gw = g % DIL_W
        place = (T, H, W, gt, gh, gw)
        tile = tile // GROUPS
        T = (T - gt + DIL_T - 1) // DIL_T
        H = (H - gh + DIL_H - 1) // DIL_H
        W = (W - gw + DIL_W - 1) // DIL_W
        moved = ()
        for i in tl.static_range(len(tensors)):
            # (the strides are the group's: the tensor's t, h, w strides times the dilation)
            moved = moved + (tensors[i] + gt.to(tl.int64) * (strides[i][1] // DIL_T)
                             + gh.to(tl.int64) * (strides[i][2] // DIL_H)
                             + gw.to(tl.int64) * (strides[i][3] // DIL_W),)
        tensors = moved
    return tile, T, H, W, place, tensors


@triton.jit
def descriptor_origin(place, DIL_T: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr):
    """Where a dilation group ``place`` (:func:`dilation_group`) starts in a tensor
    descriptor that folds the groups (``launch.box_descriptor``): ``(h, w, g)``, its
    offsets along the descriptor's H and W axes, and its index along the channel
    axis, in positions (times a position's channels). ``(0, 0, 0)`` at dilation 1."""
    if DIL_T * DIL_H * DIL_W == 1:
        origin = (0, 0, 0)
    else:
        T, H, W, gt, gh, gw = place
        origin = (gt * (H // DIL_H), gh * (W // DIL_W), gw)
    return origin


@triton.jit
def grid_position(t, h, w, place, DIL_T: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr):
    """Positions ``(t, h, w)`` of a dilation group ``place`` (:func:`dilation_group`)
    in the full grid, and the full grid's lengths: ``(T, H, W, t, h, w)``."""
    T, H, W, gt, gh, gw = place
    if DIL_T > 1:
        t = gt + DIL_T * t
    if DIL_H > 1:
        h = gh + DIL_H * h
    if DIL_W > 1:
        w = gw + DIL_W * w
    return T, H, W, t, h, w


@triton.jit
def position_rows(batch, head, heads, t, h, w, place, DIL_T: tl.constexpr, DIL_H: tl.constexpr,
                  DIL_W: tl.constexpr):
    """Element index (int64) of ``(batch, t, h, w, head)`` in a contiguous ``(B, T, H,
    W, heads)`` array of the full grid (the lse, its gradient, the one-pass
    backward's dQ buffer in rows), for positions ``(t, h, w)`` of the group
    ``place``."""
    T, H, W, t, h, w = grid_position(t, h, w, place, DIL_T, DIL_H, DIL_W)
    return (((batch.to(tl.int64) * T + t) * H + h) * W + w) * heads + head


@triton.jit
def box_offsets(BOX_T: tl.constexpr, BOX_H: tl.constexpr, BOX_W: tl.constexpr):
    """Coordinates of the positions of a BOX_T x BOX_H x BOX_W box, row-major, from
    its first corner (constant divisions: shifts and masks)."""
    c = tl.arange(0, BOX_T * BOX_H * BOX_W)
    return c // (BOX_H * BOX_W), (c // BOX_W) % BOX_H, c % BOX_W


@triton.jit
def program_box(tile, tiles_h, tiles_w, T, H, W, KT, KH, KW, ST, SH, SW,
                CAUSAL_T: tl.constexpr, CAUSAL_H: tl.constexpr, CAUSAL_W: tl.constexpr, STRIDED: tl.constexpr,
                B_T: tl.constexpr, B_H: tl.constexpr, B_W: tl.constexpr, DILATED: tl.constexpr,
                scanned_range: tl.constexpr):
    """A program's own box of positions: their coordinates ``(t, h, w)`` and which
    are in the grid (:func:`box_of_program`), and the range its scan covers, ``[s0,
    s1)`` per axis, by ``scanned_range``: :func:`union_of_windows` for a box of
    queries (the forward, dQ: one box of keys, since window ends never decrease
    with the query index), :func:`queries_seeing` for a box of keys (dK/dV).
    Returns ``(t, h, w, valid, s_t0, s_t1, s_h0, s_h1, s_w0, s_w1)``."""
    tl.static_assert(B_T * B_H * B_W >= 16, "tl.dot needs boxes of at least 16 positions")
    t0, h0, w0, t, h, w, valid = box_of_program(tile, tiles_h, tiles_w, T, H, W, B_T, B_H, B_W, DILATED)
    s_t0, s_t1 = scanned_range(t0, tl.minimum(t0 + B_T, T) - 1, T, KT, ST, CAUSAL_T, STRIDED)
    s_h0, s_h1 = scanned_range(h0, tl.minimum(h0 + B_H, H) - 1, H, KH, SH, CAUSAL_H, STRIDED)
    s_w0, s_w1 = scanned_range(w0, tl.minimum(w0 + B_W, W) - 1, W, KW, SW, CAUSAL_W, STRIDED)
    return t, h, w, valid, s_t0, s_t1, s_h0, s_h1, s_w0, s_w1


@triton.jit
def query_program(tile, batch, head, tensors, strides, T, H, W, window, tiling, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, Q_BOX: tl.constexpr, WINDOW_FLAGS: tl.constexpr, DILATION: tl.constexpr):
    """The set-up of a program over a box of queries (the forward, dQ), from the
    kernel's grouped arguments (module docstring): the program's dilation group
    (:func:`dilation_group`; ``tensors`` moved there, Q first), its box and the
    union of the box's windows (:func:`program_box`), the head's columns
    (:func:`head_columns`) and the box's queries of ``(batch, head)``. Returns
    ``(T, H, W, place, tensors, qt, qh, qw, q_valid, union, d, d_ok, q)``, the
    lengths the group's, ``union = (ut0, ut1, uh0, uh1, uw0, uw1)``."""
    tile, T, H, W, place, tensors = dilation_group(tile, T, H, W, tensors, strides, *DILATION)
    qt, qh, qw, q_valid, ut0, ut1, uh0, uh1, uw0, uw1 = program_box(
        tile, *tiling, T, H, W, *window, *WINDOW_FLAGS, *Q_BOX, DILATION[0] * DILATION[1] * DILATION[2] > 1,
        union_of_windows)
    d, d_ok = head_columns(HEAD_DIM, BLOCK_D)
    q = load_rows(head_base(tensors[0], strides[0], batch, head), strides[0], qt, qh, qw, d, d_ok)
    return T, H, W, place, tensors, qt, qh, qw, q_valid, (ut0, ut1, uh0, uh1, uw0, uw1), d, d_ok, q


@triton.jit
def box_steps(t0, t1, h0, h1, w0, w1, B_T: tl.constexpr, B_H: tl.constexpr, B_W: tl.constexpr):
    """A row-major scan over ``[t0, t1) x [h0, h1) x [w0, w1)`` in boxes of
    ``B_T x B_H x B_W``: ``(steps_h, steps_w, n_steps)``, boxes per row and slab
    (:func:`next_box`) and in all."""
    steps_h = tl.cdiv(h1 - h0, B_H)
    steps_w = tl.cdiv(w1 - w0, B_W)
    return steps_h, steps_w, tl.cdiv(t1 - t0, B_T) * steps_h * steps_w


@triton.jit
def box_at(i_t, i_h, i_w, t0, h0, w0, off_t, off_h, off_w, B_T: tl.constexpr, B_H: tl.constexpr,
           B_W: tl.constexpr):
    """Box ``(i_t, i_h, i_w)`` of that scan: its corner ``(c_t, c_h, c_w)`` and the
    coordinates of its positions (``off_*``: :func:`box_offsets`)."""
    c_t = t0 + i_t * B_T
    c_h = h0 + i_h * B_H
    c_w = w0 + i_w * B_W
    return c_t, c_h, c_w, c_t + off_t, c_h + off_h, c_w + off_w


@triton.jit
def first_box():
    """Box indices ``(i_t, i_h, i_w)`` of a scan's first box (:func:`next_box` counts
    on from them)."""
    return tl.zeros([], tl.int32), tl.zeros([], tl.int32), tl.zeros([], tl.int32)


@triton.jit
def next_box(i_t, i_h, i_w, steps_h, steps_w):
    """One step of a row-major scan over boxes, ``steps_h`` x ``steps_w`` boxes per
    t slab: box indices ``(i_t, i_h, i_w)`` of the next box.

    Counting with carries instead of dividing the step number: a division by a
    run-time value costs ~20 instructions per thread, and there were three per step.
    The last box along an axis may run past the scanned range: the caller clamps
    coordinates for its loads and masks the extra positions.
    """
    i_w += 1
    wrap_w = i_w == steps_w
    i_w = tl.where(wrap_w, 0, i_w)
    i_h = tl.where(wrap_w, i_h + 1, i_h)
    wrap_h = i_h == steps_h
    i_h = tl.where(wrap_h, 0, i_h)
    i_t = tl.where(wrap_h, i_t + 1, i_t)
    return i_t, i_h, i_w


# How a kernel masks the window along one axis (``MASK_T/H/W``; the launcher picks,
# see ``launch.mask_modes``):
MASK_PER_STEP = tl.constexpr(constants.MASK_PER_STEP)  # compare positions on every step (the plain mask)
MASK_BITS = tl.constexpr(constants.MASK_BITS)          # on every step, from per-query window bits shifted to the step
MASK_FIXED = tl.constexpr(constants.MASK_FIXED)        # once per program: the scan never moves along this axis
MASK_NONE = tl.constexpr(constants.MASK_NONE)          # never: every query of every box sees every key of every
                                                       # box it scans (the launcher proves it for the call's grid:
                                                       # geometry.block_sparse_axis)
# With MASK_NONE on all three axes the scan's loop runs without masks, as dense attention's does.


@triton.jit
def in_window(key, start, stop):
    """Boolean [queries, keys]: key position ``key[j]`` lies in ``[start[i], stop[i])``."""
    return (key[None, :] >= start[:, None]) & (key[None, :] < stop[:, None])


@triton.jit
def axes_in_window(ok, kt, kh, kw, st, et, sh, eh, sw, ew,
                   MODE_T: tl.constexpr, MODE_H: tl.constexpr, MODE_W: tl.constexpr, WHICH: tl.constexpr):
    """``ok`` and, along each axis whose mode is ``WHICH``, the position compares:
    keys ``(kt, kh, kw)`` against the query windows ``[s, e)``."""
    if MODE_T == WHICH:
        ok &= in_window(kt, st, et)
    if MODE_H == WHICH:
        ok &= in_window(kh, sh, eh)
    if MODE_W == WHICH:
        ok &= in_window(kw, sw, ew)
    return ok


@triton.jit
def window_bits(start, stop, origin, MODE: tl.constexpr):
    """Per query, its window ``[start, stop)`` as int32 bits from ``origin`` (bit j:
    position ``origin + j``; needs ``origin <= start`` and ``stop - origin <= 31``),
    for a ``MASK_BITS`` axis; zeros (unused) otherwise."""
    if MODE == MASK_BITS:
        return ((1 << (stop - origin)) - 1) & ~((1 << (start - origin)) - 1)
    return tl.zeros_like(start)


@triton.jit
def fixed_mask_bias(kt, kh, kw, st, et, sh, eh, sw, ew,
                    MODE_T: tl.constexpr, MODE_H: tl.constexpr, MODE_W: tl.constexpr,
                    ROWS: tl.constexpr, COLS: tl.constexpr, MASKED: tl.constexpr = float("-inf")):
    """The window mask along the ``MASK_FIXED`` axes only, as a [queries, keys] float32
    matrix of 0 (visible) and ``MASKED``: keys ``(kt, kh, kw)`` of the one box scanned
    along those axes, query windows ``[s, e)`` per axis."""
    ok = axes_in_window(tl.full([ROWS, COLS], 1, tl.int1), kt, kh, kw, st, et, sh, eh, sw, ew,
                        MODE_T, MODE_H, MODE_W, MASK_FIXED)
    return tl.where(ok, 0.0, MASKED)


@triton.jit
def step_mask_bias(fixed_bias, kt, kh, kw, st, et, sh, eh, sw, ew, bt, bh, bw, off_t, off_h, off_w,
                   MODE_T: tl.constexpr, MODE_H: tl.constexpr, MODE_W: tl.constexpr,
                   MASKED: tl.constexpr = float("-inf")):
    """``fixed_bias`` with this step's keys ``(kt, kh, kw)`` also masked along the axes
    that move: one select per score (none when every axis is fixed). ``bt/bh/bw``:
    on ``MASK_BITS`` axes, each query's window bits shifted to this step's first key
    (``off_*``: the keys' offsets in the scanned box); per-step compares elsewhere."""
    if MODE_T >= MASK_FIXED and MODE_H >= MASK_FIXED and MODE_W >= MASK_FIXED:  # (nothing moves)
        return fixed_bias
    ok = step_visible(kt, kh, kw, st, et, sh, eh, sw, ew, bt, bh, bw, off_t, off_h, off_w,
                      MODE_T, MODE_H, MODE_W, fixed_bias.shape[0], fixed_bias.shape[1])
    return tl.where(ok, fixed_bias, MASKED)


@triton.jit
def step_visible(kt, kh, kw, st, et, sh, eh, sw, ew, bt, bh, bw, off_t, off_h, off_w,
                 MODE_T: tl.constexpr, MODE_H: tl.constexpr, MODE_W: tl.constexpr,
                 ROWS: tl.constexpr, COLS: tl.constexpr):
    """Boolean [queries, keys]: this step's keys lie in the query windows along the
    ``MASK_BITS`` and ``MASK_PER_STEP`` axes (``MASK_FIXED`` axes not tested); see
    :func:`step_mask_bias`."""
    ok = tl.full([ROWS, COLS], 1, tl.int1)
    # One word of the bit-masked axes' shifted windows, then one test. Testing each
    # axis' bit on its own compiles to fewer instructions where all three axes use
    # bits, but takes more registers.
    if MODE_T == MASK_BITS or MODE_H == MASK_BITS or MODE_W == MASK_BITS:
        bits = tl.full([ROWS, COLS], 1, tl.int32)
        if MODE_T == MASK_BITS:
            bits &= bt[:, None] >> off_t[None, :]
        if MODE_H == MASK_BITS:
            bits &= bh[:, None] >> off_h[None, :]
        if MODE_W == MASK_BITS:
            bits &= bw[:, None] >> off_w[None, :]
        ok &= bits != 0
    return axes_in_window(ok, kt, kh, kw, st, et, sh, eh, sw, ew, MODE_T, MODE_H, MODE_W, MASK_PER_STEP)


@triton.jit
def key_scan_masks(qt, qh, qw, T, H, W, KT, KH, KW, ST, SH, SW, ut0, uh0, uw0, off_t, off_h, off_w,
                   CAUSAL_T: tl.constexpr, CAUSAL_H: tl.constexpr, CAUSAL_W: tl.constexpr, STRIDED: tl.constexpr,
                   MASK_T: tl.constexpr, MASK_H: tl.constexpr, MASK_W: tl.constexpr,
                   KV_T: tl.constexpr, KV_H: tl.constexpr, KV_W: tl.constexpr,
                   BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, ON_PRODUCT: tl.constexpr, SAFE: tl.constexpr,
                   MASKED: tl.constexpr):
    """What a scan over key boxes (forward, dQ) computes once for its masks:
    ``(windows, fixed_bias, bits)``. ``windows``: the queries' ``(st, et, sh, eh, sw,
    ew)``; with ``ON_PRODUCT`` the fixed axes' part of the mask (``MASKED`` where it
    hides) and the ``MASK_BITS`` axes' window bits; in the safe loop (``SAFE``) window
    bits on every axis where they fit (a fixed axis' union fits its key box, so its
    bits fit when the box does), which hold fewer registers than the fixed part.
    Values a mode does not use are placeholders that the compiler drops."""
    tl.static_assert(BLOCK_KV >= 16, "tl.dot needs boxes of at least 16 keys")
    SAFE_BITS: tl.constexpr = SAFE and (MASK_T + MASK_H + MASK_W > 0)
    if ON_PRODUCT or SAFE_BITS:
        st, et = window_bounds(qt, T, KT, ST, CAUSAL_T, STRIDED)
        sh, eh = window_bounds(qh, H, KH, SH, CAUSAL_H, STRIDED)
        sw, ew = window_bounds(qw, W, KW, SW, CAUSAL_W, STRIDED)
        windows = (st, et, sh, eh, sw, ew)
    else:
        windows = (qt, qt, qt, qt, qt, qt)
    fixed_bias = tl.zeros([1, 1], tl.float32)
    if ON_PRODUCT:
        fixed_bias = fixed_mask_bias(ut0 + off_t, uh0 + off_h, uw0 + off_w, st, et, sh, eh, sw, ew,
                                     MASK_T, MASK_H, MASK_W, BLOCK_Q, BLOCK_KV, MASKED)
        bits = (window_bits(st, et, ut0, MASK_T), window_bits(sh, eh, uh0, MASK_H), window_bits(sw, ew, uw0, MASK_W))
    elif SAFE_BITS:
        SAFE_T: tl.constexpr = MASK_BITS if MASK_T == MASK_BITS or MASK_T == MASK_FIXED and KV_T < 32 else MASK_PER_STEP
        SAFE_H: tl.constexpr = MASK_BITS if MASK_H == MASK_BITS or MASK_H == MASK_FIXED and KV_H < 32 else MASK_PER_STEP
        SAFE_W: tl.constexpr = MASK_BITS if MASK_W == MASK_BITS or MASK_W == MASK_FIXED and KV_W < 32 else MASK_PER_STEP
        bits = (window_bits(st, et, ut0, SAFE_T), window_bits(sh, eh, uh0, SAFE_H), window_bits(sw, ew, uw0, SAFE_W))
    else:
        bits = (qt, qt, qt)
    return windows, fixed_bias, bits


@triton.jit
def key_scan_visible(qt, qh, qw, kt, kh, kw, windows, bits, i_t, i_h, i_w, off_t, off_h, off_w,
                     T, H, W, KT, KH, KW, ST, SH, SW,
                     CAUSAL_T: tl.constexpr, CAUSAL_H: tl.constexpr, CAUSAL_W: tl.constexpr, STRIDED: tl.constexpr,
                     MASK_T: tl.constexpr, MASK_H: tl.constexpr, MASK_W: tl.constexpr,
                     KV_T: tl.constexpr, KV_H: tl.constexpr, KV_W: tl.constexpr,
                     BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, SAFE: tl.constexpr):
    """Boolean [queries, keys] for one step of a scan over key boxes that masks its
    scores by selection (no mask on the product): from the window bits of
    :func:`key_scan_masks` in the safe loop, by comparing positions otherwise."""
    if SAFE and (MASK_T + MASK_H + MASK_W > 0):  # (the modes of key_scan_masks' bits)
        SAFE_T: tl.constexpr = MASK_BITS if MASK_T == MASK_BITS or MASK_T == MASK_FIXED and KV_T < 32 else MASK_PER_STEP
        SAFE_H: tl.constexpr = MASK_BITS if MASK_H == MASK_BITS or MASK_H == MASK_FIXED and KV_H < 32 else MASK_PER_STEP
        SAFE_W: tl.constexpr = MASK_BITS if MASK_W == MASK_BITS or MASK_W == MASK_FIXED and KV_W < 32 else MASK_PER_STEP
        st, et, sh, eh, sw, ew = windows
        return step_visible(kt, kh, kw, st, et, sh, eh, sw, ew, bits[0] >> (i_t * KV_T), bits[1] >> (i_h * KV_H),
                            bits[2] >> (i_w * KV_W), off_t, off_h, off_w, SAFE_T, SAFE_H, SAFE_W, BLOCK_Q, BLOCK_KV)
    return sees(qt, qh, qw, kt, kh, kw, T, H, W, KT, KH, KW, ST, SH, SW, CAUSAL_T, CAUSAL_H, CAUSAL_W, STRIDED)


@triton.jit
def load_key_box(DESC, base, batch, c_t, c_h, c_w, kv_head, kt, kh, kw, ut1, uh1, uw1, strides,
                 d, d_ok, origin, kv_channels, HEAD_DIM: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr,
                 FROM_DESC: tl.constexpr):
    """One step's box of keys (or values) ``[BLOCK_KV, BLOCK_D]`` of a scan over the
    union ``[u0, u1)``: through the tensor descriptor from the box's corner (in the
    dilation group at ``origin``, :func:`descriptor_origin`; ``kv_channels``: the
    channels of a position), or through pointers, where keys past the union (the
    last step along an axis) load a repeat of its last position (outside every
    window of the program's queries, so the mask drops them)."""
    if FROM_DESC:
        return DESC.load([batch, c_t, c_h + origin[0], c_w + origin[1],
                          kv_head * HEAD_DIM + origin[2] * kv_channels]).reshape(BLOCK_KV, BLOCK_D)
    offs = (tl.minimum(kt, ut1 - 1).to(tl.int64) * strides[1] + tl.minimum(kh, uh1 - 1).to(tl.int64) * strides[2]
            + tl.minimum(kw, uw1 - 1).to(tl.int64) * strides[3])
    return tl.load(base + offs[:, None] + d[None, :], mask=d_ok[None, :], other=0.0)


@triton.jit
def sees(qt, qh, qw, kt, kh, kw, T, H, W, KT, KH, KW, ST, SH, SW,
         CAUSAL_T: tl.constexpr, CAUSAL_H: tl.constexpr, CAUSAL_W: tl.constexpr, STRIDED: tl.constexpr,
         KEYS_FIRST: tl.constexpr = False):
    """Boolean [queries, keys] matrix: query (qt, qh, qw)[i] sees key (kt, kh, kw)[j];
    with ``KEYS_FIRST`` its transpose, [keys, queries], built directly."""
    st, et = window_bounds(qt, T, KT, ST, CAUSAL_T, STRIDED)
    sh, eh = window_bounds(qh, H, KH, SH, CAUSAL_H, STRIDED)
    sw, ew = window_bounds(qw, W, KW, SW, CAUSAL_W, STRIDED)
    if KEYS_FIRST:  # (one return: Triton wants one result type per function)
        seen = ((kt[:, None] >= st[None, :]) & (kt[:, None] < et[None, :])
                & (kh[:, None] >= sh[None, :]) & (kh[:, None] < eh[None, :])
                & (kw[:, None] >= sw[None, :]) & (kw[:, None] < ew[None, :]))
    else:
        seen = ((kt[None, :] >= st[:, None]) & (kt[None, :] < et[:, None])
                & (kh[None, :] >= sh[:, None]) & (kh[None, :] < eh[:, None])
                & (kw[None, :] >= sw[:, None]) & (kw[None, :] < ew[:, None]))
    return seen


@triton.jit
def head_columns(HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The columns of a head's row in a tile, ``BLOCK_D`` (a power of two), and
    which of them exist (``< HEAD_DIM``; the others are padding, loaded as 0)."""
    d = tl.arange(0, BLOCK_D)
    return d, d < HEAD_DIM


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
def load_rows(base, strides, t, h, w, cols, cols_ok):
    """``[positions, len(cols)]`` rows of one (batch, head) of a ``(B, T, H, W, NH,
    HD)`` tensor: ``base`` points at that batch and head (:func:`head_base`),
    ``(t, h, w)`` are coordinates (in bounds), ``cols``/``cols_ok`` the head-dim
    columns and which of them exist (the others read 0)."""
    return tl.load(base + position_offsets(strides, t, h, w)[:, None] + cols[None, :],
                   mask=cols_ok[None, :], other=0.0)


# Non-finite inputs. A kernel's products combine every key of a box with every
# query of a box, so an inf or NaN in one key, value or query would reach, through
# a zero product (0 * inf = NaN) or the additive mask (NaN - inf = NaN), queries
# whose windows do not hold it. The kernels therefore run their loops as fast as
# ever and check their results once per program (one add per element), flagging
# a program whose results hold an inf or NaN. A second, small kernel then reads
# the flags (one load per few hundred programs when none is set) and computes the
# flagged programs again, the safe way. A counting scan first marks NaN, in the
# result tile in memory, every element that a visible non-finite operand of the
# final product reaches (a value for the output, a key for dQ, a query for dK, a
# gradient row dO for dV); then the ``SAFE`` loop masks scores by selection and
# feeds that product only the finite part of its operand (non-finite elements
# zeroed), and the marks are laid over its result. Elsewhere the result is what
# a zeroed input would have given, bit for bit: on finite data the safe loop does
# the fast loop's arithmetic, tile for tile, in the same order. Non-finite scores
# propagate as IEEE arithmetic makes them (a NaN or +inf visible score makes its
# row NaN; a -inf one weighs 0). The safe code lives in kernels of its own so that
# it costs the fast kernels no registers (ptxas sizes registers, and decides
# whether Hopper's products may overlap, for a whole kernel at once).

# Flags a safe kernel's program reads at once.
FLAG_BLOCK = tl.constexpr(constants.FLAG_BLOCK)
# Channels per pass of the counting scan (its count accumulators stay small).
CHANNELS = tl.constexpr(16)


@triton.jit
def has_nonfinite(x):
    """True (a scalar) when some element of the 2-D tile ``x`` is inf or NaN. One add
    per element: a NaN or inf anywhere makes the total non-finite (finite totals
    that overflow count too, and merely cost a safe recomputation)."""
    total = tl.sum(tl.sum(x.to(tl.float32), 1), 0)
    return (total != total) | (tl.abs(total) == float("inf"))


@triton.jit
def run_programs(tile_fn: tl.constexpr, args, FLAGS, n_tiles, heads, n_programs,
                 GROUP: tl.constexpr, PER_KEY_HEAD: tl.constexpr, ASSUME_FINITE: tl.constexpr,
                 REDO: tl.constexpr):
    """A kernel's body, shared by the three: which tile, head and batch element each
    program computes, ``tile_fn(tile, head, batch, heads, *args, SAFE, ASSUME_FINITE)``,
    and its non-finite flag.

    ``heads`` counts query heads, ``GROUP`` of them per key/value head. Programs run
    per query head (forward, dQ: the grid's first axis holds a box's GROUP query
    heads side by side, so that they read their key/value head's boxes close
    together in time) or, with ``PER_KEY_HEAD``, per key/value head (dK/dV: the grid
    is over key/value heads). The flag of program ``(tile, head, batch)`` is
    ``FLAGS[tile + n_tiles * (head + grid heads * batch)]``.

    First launch (``REDO`` off): the program's tile the fast way; unless
    ``ASSUME_FINITE``, its flag: per query head, 1 where the returned scalar says the tile holds an inf
    or NaN, else 0; per key/value head, 0 first and then 1 from the threads of the
    rows ``tile_fn`` returns as non-finite, after a barrier (a row's test needs no
    shared memory, which keeps the dK/dV loop's registers as they were).

    Second launch (``REDO``, a grid (G,), any G): the flagged programs, the safe way,
    each by one of the G programs in turn; where no flag is set (finite inputs), each
    program reads its share of the flags, ``FLAG_BLOCK`` at a time, and ends. (The
    safe way sets no flag: its tile function is called with ``ASSUME_FINITE`` on.)"""
    if PER_KEY_HEAD:
        grid_heads = heads // GROUP
    else:
        grid_heads = heads
    if REDO:
        for start in range(tl.program_id(0) * FLAG_BLOCK, n_programs, tl.num_programs(0) * FLAG_BLOCK):
            block = start + tl.arange(0, FLAG_BLOCK)
            if tl.max(tl.load(FLAGS + block, mask=block < n_programs, other=0).to(tl.int32), 0) != 0:
                for program in range(start, tl.minimum(start + FLAG_BLOCK, n_programs)):
                    if tl.load(FLAGS + program) != 0:
                        tile_fn(program % n_tiles, (program // n_tiles) % grid_heads,
                                program // (n_tiles * grid_heads), heads, *args, True, True)
    elif PER_KEY_HEAD:
        head = tl.program_id(1)
        batch = tl.program_id(2)
        tile = tl.program_id(0)
        flag = FLAGS + tile + n_tiles * (head + grid_heads * batch.to(tl.int64))
        if not ASSUME_FINITE:
            tl.store(flag, tl.zeros([], tl.int8))
        rows = tile_fn(tile, head, batch, tl.num_programs(1) * GROUP, *args, False, ASSUME_FINITE)
        if not ASSUME_FINITE:
            tl.debug_barrier()  # no 0 lands after a 1
            tl.store(flag + tl.zeros_like(rows).to(tl.int64), tl.full(rows.shape, 1, tl.int8), mask=rows)
    else:
        head = tl.program_id(1) * GROUP + tl.program_id(0) % GROUP
        batch = tl.program_id(2)
        tile = tl.program_id(0) // GROUP
        nonfinite = tile_fn(tile, head, batch, tl.num_programs(1) * GROUP, *args, False, ASSUME_FINITE)
        if not ASSUME_FINITE:
            tl.store(FLAGS + tile + n_tiles * (head + grid_heads * batch.to(tl.int64)), nonfinite.to(tl.int8))


@triton.jit
def store_query_tile(OUT, out_strides, batch, head, qt, qh, qw, valid, x, d, d_ok, SAFE: tl.constexpr,
                     ASSUME_FINITE: tl.constexpr, scale=None):
    """A program's result over its box of queries (the forward's output, dQ):
    ``x`` (times ``scale``, if given) stored into ``OUT`` at (batch, head) and the
    positions ``(qt, qh, qw)`` that are ``valid``, in OUT's dtype. With ``SAFE``
    the NaN marks that :func:`mark_reached` stored there first are laid over it.
    Returns (unless ``ASSUME_FINITE``) whether ``x`` holds an inf or NaN."""
    base = head_base(OUT, out_strides, batch, head)
    if SAFE:
        marks = tl.load(base + position_offsets(out_strides, qt, qh, qw)[:, None] + d[None, :],
                        mask=valid[:, None] & d_ok[None, :], other=0.0)
        x = tl.where(marks != marks, float("nan"), x)
    ptrs = base + position_offsets(out_strides, qt, qh, qw)[:, None] + d[None, :]
    if not ASSUME_FINITE:
        nonfinite = has_nonfinite(x)
    else:
        nonfinite = tl.zeros([], tl.int1)
    if scale is not None:
        x = x * scale
    tl.store(ptrs, x.to(OUT.dtype.element_ty), mask=valid[:, None] & d_ok[None, :])
    return nonfinite


@triton.jit
def nonfinite_rows(x):
    """Per row of the 2-D tile ``x``: whether it holds an inf or NaN (as
    :func:`has_nonfinite`, one sum per row). A row's sum stays within the threads
    that hold the row, where the whole tile's needs shared memory and a barrier."""
    total = tl.sum(x.to(tl.float32), 1)
    return (total != total) | (tl.abs(total) == float("inf"))


@triton.jit
def finite_part(x):
    """``x`` with its non-finite elements replaced by 0, and which elements were
    finite."""
    ok = tl.abs(x.to(tl.float32)) < float("inf")
    return tl.where(ok, x, tl.zeros_like(x)), ok


@triton.jit
def count_nonfinite(visible, ok, count):
    """``count`` plus, per (row of ``visible``, column of ``ok``), how many visible
    operands along the reduced axis are non-finite: ``visible @ (~ok)`` on the
    tensor cores (0/1 values, exact)."""
    return tl.dot(visible.to(tl.float16), tl.where(ok, 0.0, 1.0).to(tl.float16), count, input_precision="ieee")


@triton.jit
def mark_reached(OUT, out_rows, own_valid, src_base, src_strides, pt, ph, pw, T, H, W, KT, KH, KW, ST, SH, SW,
                 s_t0, s_t1, s_h0, s_h1, s_w0, s_w1, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
                 S_T: tl.constexpr, S_H: tl.constexpr, S_W: tl.constexpr,
                 CAUSAL_T: tl.constexpr, CAUSAL_H: tl.constexpr, CAUSAL_W: tl.constexpr,
                 STRIDED: tl.constexpr, GROUP: tl.constexpr, OWN_ARE_QUERIES: tl.constexpr):
    """For a program over a box of positions (its own, ``(pt, ph, pw)``: ``ROWS`` of
    them, those in the grid ``own_valid``) whose final product takes one row of
    ``src`` per scanned position (the forward: a value per key; dQ: a key per key;
    dV: a dO row per query; dK: a query per query): store into its result tile in
    memory (``OUT`` at row offsets ``out_rows``) NaN where a non-finite element of a
    visible scanned row reaches the element, 0 elsewhere.

    The program's scan, counting only, ``CHANNELS`` at a time so that it holds
    little, through pointers: over ``[s0, s1)`` per axis in ``S_T x S_H x S_W`` boxes,
    of ``GROUP`` heads of ``src`` from ``src_base`` on (``src_strides``, a head
    apart). ``OWN_ARE_QUERIES``: the own positions are queries and the scanned ones
    keys (forward, dQ), else the reverse (dK/dV). Scanned positions past the range
    repeat its last one: counted twice, which the test for a count above 0 does
    not mind."""
    steps_h, steps_w, n_steps = box_steps(s_t0, s_t1, s_h0, s_h1, s_w0, s_w1, S_T, S_H, S_W)
    off_t, off_h, off_w = box_offsets(S_T, S_H, S_W)
    for c0 in tl.static_range(0, HEAD_DIM, CHANNELS):
        cols = c0 + tl.arange(0, CHANNELS)
        count = tl.zeros([ROWS, CHANNELS], tl.float32)
        base = src_base
        for _ in range(GROUP):
            i_t, i_h, i_w = first_box()
            for _ in tl.range(n_steps, num_stages=1):
                c_t, c_h, c_w, st, sh, sw = box_at(i_t, i_h, i_w, s_t0, s_h0, s_w0, off_t, off_h, off_w, S_T, S_H, S_W)
                st = tl.minimum(st, s_t1 - 1)
                sh = tl.minimum(sh, s_h1 - 1)
                sw = tl.minimum(sw, s_w1 - 1)
                _, ok = finite_part(load_rows(base, src_strides, st, sh, sw, cols, cols < HEAD_DIM))
                if OWN_ARE_QUERIES:
                    visible = sees(pt, ph, pw, st, sh, sw, T, H, W, KT, KH, KW, ST, SH, SW,
                                   CAUSAL_T, CAUSAL_H, CAUSAL_W, STRIDED)
                else:
                    visible = sees(st, sh, sw, pt, ph, pw, T, H, W, KT, KH, KW, ST, SH, SW,
                                   CAUSAL_T, CAUSAL_H, CAUSAL_W, STRIDED, True)
                count = count_nonfinite(visible, ok, count)
                i_t, i_h, i_w = next_box(i_t, i_h, i_w, steps_h, steps_w)
            base += src_strides[4]
        tl.store(OUT + out_rows[:, None] + cols[None, :],
                 tl.where(count > 0, float("nan"), 0.0).to(OUT.dtype.element_ty),
                 mask=own_valid[:, None] & (cols[None, :] < HEAD_DIM))
    tl.debug_barrier()  # the marks are read back by other threads of the program
