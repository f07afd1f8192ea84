"""Non-finite inputs: the kernels' check, and the safe way to compute a tile again.

A kernel's products combine every key of a box with every query of a box, so an
inf or NaN in one key, value or query would reach, through a zero product (0 * inf
= NaN) or the additive mask (NaN - inf = NaN), queries whose windows do not hold
it. The kernels therefore run their loops as fast as ever and check their results
once per program (one add per element), flagging a program whose results hold an
inf or NaN. A second, small launch then reads the flags (one load per few hundred
programs when none is set) and computes the flagged programs again, the safe way
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
from .memory import load_rows, Columns
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
