"""Non-finite inputs: the kernels' check, and the safe way to compute a tile again.

A kernel's products combine every key of a box with every query of a box, so an
inf or NaN in one key, value or query would reach, through a zero product (0 * inf
= NaN) or the additive mask (NaN - inf = NaN), queries whose windows do not hold
it. The kernels therefore run their loops as fast as ever and check their results
once per program, flagging a program whose results hold an inf or NaN where one
came from a non-finite input (:func:`stored_tile_nonfinite`: the tile's first row
and first column, read back). A second, small launch then reads the flags (one load
per few hundred programs when none is set) and computes the flagged programs again, the safe way
(``programs.run_programs``). A counting scan first marks NaN, in the result tile in
memory, every element that a visible non-finite operand of the final product
reaches (:func:`mark_reached`: a value for the output, a key for dQ, a query for
dK, a gradient row dO for dV); then the ``SAFE`` loop masks scores by selection and
feeds that product only the finite part of its operand (:func:`finite_part`), and
the marks are laid over its result. Elsewhere the result is what a zeroed input
would have given, bit for bit: on finite data the safe loop does the fast loop's
arithmetic, tile for tile, in the same order. Non-finite scores propagate as IEEE
arithmetic makes them (a NaN or +inf visible score makes its row NaN; a -inf one
weighs 0). The safe code lives in launches of its own so that it costs the fast
kernels no registers (ptxas sizes registers, and decides whether Hopper's products
may overlap, for a whole kernel at once).
"""

import triton
import triton.language as tl

from .. import constants
from .memory import load_rows, position_offsets, Columns
from .tiles import box_at, box_scan, first_box, next_box
from .windows import sees

# Flags a safe launch's program reads at once.
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
def stored_tile_nonfinite(base, strides, box, BOX: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Whether a non-finite input reached the result tile a program has just stored
    over its box (``box``, a ``tiles.Box`` of ``BOX`` positions; the tile at ``base``,
    a (batch, head) of a tensor with these ``strides``), read back from memory: its
    first row and its first column only.

    Why that suffices. Every result tile is a sum of products ``A @ B`` over the
    positions the program scanned (forward: ``P V``, then divided by the row sums;
    dQ: ``dS K``; dK: ``dS^T Q``; dV: ``P^T dO``), and a weight or operand holds a
    non-finite element only where a non-finite input reached it. A non-finite
    element of ``A``'s row ``r`` (a weight: reached through a score, a statistic or a
    dO row) makes row ``r`` of the result non-finite in every column: it multiplies
    every column of ``B``, and inf or NaN times any number, 0 included, is inf or
    NaN, which no later sum or rescale turns finite (the forward's row sum is then
    NaN or 0, and dividing by it keeps the row non-finite too). A non-finite element
    of ``B``'s column ``c`` (a value, a key, a query, a dO element; a hidden one
    included, at weight 0) makes column ``c`` non-finite in every row, for the same
    reason, since every row of ``A`` multiplies every scanned row of ``B``. So where a
    non-finite input reached the tile, a whole row or a whole column of it is
    non-finite, and the first column or the first row shows it. (A box's first
    position lies in the grid if any of its positions does. A dilation group's box
    past the group's end stores nothing, so what its check reads, another program's
    tile, does not matter.) A result that overflows from finite inputs is not
    flagged: the safe way computes the same arithmetic and would give it again.

    A row's and a column's length of loads after a barrier (other threads stored the
    elements), in place of one add per element of the tile. They go 32 at a time, one
    per thread of a warp (every warp the same): their addresses then depend on the
    lane alone, not on the warp, so that this code after the key loop recomputes
    nothing the loop computed (sm90: a warp index needed after the loop made LLVM
    split the loop's zero-trip edge, and ptxas then serialized the products of every
    Hopper key loop, NOTES v41)."""
    tl.debug_barrier()
    lane = tl.arange(0, 32)
    BLOCK: tl.constexpr = BOX[0] * BOX[1] * BOX[2]
    t0, h0, w0 = box.first
    bad = tl.zeros([32], tl.int1)
    for c0 in tl.static_range(0, BLOCK, 32):  # the first column, 32 positions at a time
        c = c0 + lane
        t = t0 + c // (BOX[1] * BOX[2])
        h = h0 + (c // BOX[2]) % BOX[1]
        w = w0 + c % BOX[2]
        stored = (c < BLOCK) & (t <= box.last[0]) & (h <= box.last[1]) & (w <= box.last[2])
        x = tl.load(base + position_offsets(strides, t, h, w), mask=stored, other=0.0).to(tl.float32)
        bad |= (x != x) | (tl.abs(x) == float("inf"))
    first_row = base + position_offsets(strides, t0, h0, w0)
    for d0 in tl.static_range(0, HEAD_DIM, 32):  # the first row
        d = d0 + lane
        x = tl.load(first_row + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        bad |= (x != x) | (tl.abs(x) == float("inf"))
    return tl.max(bad.to(tl.int32), 0) > 0


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
def mark_reached(OUT, out_rows, own, src_base, src_strides, nb, WINDOW_FLAGS: tl.constexpr, span,
                 HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, S_BOX: tl.constexpr, GROUP: tl.constexpr,
                 OWN_ARE_QUERIES: tl.constexpr):
    """For a program over a box of positions (its own, ``own``: a ``tiles.Box`` of
    ``ROWS`` positions) whose final product takes one row of ``src`` per scanned
    position (the forward: a value per key; dQ: a key per key; dV: a dO row per
    query; dK: a query per query): store into its result tile in memory (``OUT`` at
    row offsets ``out_rows``) NaN where a non-finite element of a visible scanned row
    reaches the element, 0 elsewhere.

    The program's scan, counting only, ``CHANNELS`` at a time so that it holds
    little, through pointers: over ``span`` in ``S_BOX`` boxes, of ``GROUP`` heads of
    ``src`` from ``src_base`` on (``src_strides``, a head apart). ``OWN_ARE_QUERIES``:
    the own positions are queries and the scanned ones keys (forward, dQ), else the
    reverse (dK/dV). Scanned positions past the span repeat its last one: counted
    twice, which the test for a count above 0 does not mind."""
    scan = box_scan(span, S_BOX)
    for c0 in tl.static_range(0, HEAD_DIM, CHANNELS):
        cols = c0 + tl.arange(0, CHANNELS)
        count = tl.zeros([ROWS, CHANNELS], tl.float32)
        base = src_base
        for _ in range(GROUP):
            i_t, i_h, i_w = first_box()
            for _ in tl.range(scan.n_steps, num_stages=1):
                c_t, c_h, c_w, st, sh, sw = box_at(scan, i_t, i_h, i_w, S_BOX)
                st = tl.minimum(st, span.t1 - 1)
                sh = tl.minimum(sh, span.h1 - 1)
                sw = tl.minimum(sw, span.w1 - 1)
                _, ok = finite_part(load_rows(base, src_strides, st, sh, sw, Columns(cols, cols < HEAD_DIM)))
                if OWN_ARE_QUERIES:
                    visible = sees(own.t, own.h, own.w, st, sh, sw, nb, WINDOW_FLAGS)
                else:
                    visible = sees(st, sh, sw, own.t, own.h, own.w, nb, WINDOW_FLAGS, True)
                count = count_nonfinite(visible, ok, count)
                i_t, i_h, i_w = next_box(scan, i_t, i_h, i_w)
            base += src_strides[4]
        tl.store(OUT + out_rows[:, None] + cols[None, :],
                 tl.where(count > 0, float("nan"), 0.0).to(OUT.dtype.element_ty),
                 mask=own.valid[:, None] & (cols[None, :] < HEAD_DIM))
    tl.debug_barrier()  # the marks are read back by other threads of the program
