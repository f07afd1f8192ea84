"""Boxes: which positions a program owns, and the scan over boxes of the range it
covers.

A program owns one box of grid positions (queries for the forward and dQ, keys for
dK/dV) and scans a range of the grid (:class:`Span`) in boxes of the other kind,
row-major (:class:`BoxScan`). Box sizes are compile-time tuples ``(T, H, W)``.
"""

from typing import NamedTuple

import triton
import triton.language as tl

from .windows import queries_seeing, seeing_all, seen_by_all, union_of_windows


class Span(NamedTuple):
    """A range of grid positions, ``[t0, t1) x [h0, h1) x [w0, w1)``."""
    t0: tl.tensor
    t1: tl.tensor
    h0: tl.tensor
    h1: tl.tensor
    w0: tl.tensor
    w1: tl.tensor


class Box(NamedTuple):
    """A program's own box: the coordinates of its positions (row-major inside the
    box, clamped into the grid), which of them lie inside the grid, and per axis
    its first position and its last one inside the grid, ``(t, h, w)`` each
    (scalars, the same in every thread)."""
    t: tl.tensor
    h: tl.tensor
    w: tl.tensor
    valid: tl.tensor
    first: tl.tensor
    last: tl.tensor


class BoxScan(NamedTuple):
    """A row-major scan over a :class:`Span` in boxes: its first corner, boxes per row
    and per slab and in all, and the coordinates of a box's positions from its
    corner (:func:`box_offsets`)."""
    t0: tl.tensor
    h0: tl.tensor
    w0: tl.tensor
    steps_h: tl.tensor
    steps_w: tl.tensor
    n_steps: tl.tensor
    off_t: tl.tensor
    off_h: tl.tensor
    off_w: tl.tensor


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
    group's (``groups.dilation_group``), so a box may start past this group's end
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
def scanned_range(first, last, length, kernel_size, stride, CAUSAL: tl.constexpr, STRIDED: tl.constexpr,
                  OWN_ARE_QUERIES: tl.constexpr):
    """Along one axis, the range ``[start, stop)`` that a program owning positions
    ``first..last`` scans: the union of their windows (``OWN_ARE_QUERIES``) or the
    queries that see one of them."""
    if OWN_ARE_QUERIES:
        return union_of_windows(first, last, length, kernel_size, stride, CAUSAL, STRIDED)
    return queries_seeing(first, last, length, kernel_size, stride, CAUSAL, STRIDED)


@triton.jit
def program_box(tile, tiling, nb, WINDOW_FLAGS: tl.constexpr, BOX: tl.constexpr, DILATED: tl.constexpr,
                OWN_ARE_QUERIES: tl.constexpr):
    """A program's own box (:class:`Box`, from :func:`box_of_program`; ``tiling``:
    tiles along H and W) and the :class:`Span` its scan covers: the union of the
    box's windows for a box of queries (``OWN_ARE_QUERIES``: the forward, dQ; one
    box of keys, since window ends never decrease with the query index), the
    queries that see a key of the box for a box of keys (dK/dV)."""
    tl.static_assert(BOX[0] * BOX[1] * BOX[2] >= 16, "tl.dot needs boxes of at least 16 positions")
    t0, h0, w0, t, h, w, valid = box_of_program(tile, tiling[0], tiling[1], nb.T, nb.H, nb.W, BOX[0], BOX[1], BOX[2],
                                                DILATED)
    last_t = tl.minimum(t0 + BOX[0], nb.T) - 1
    s_t0, s_t1 = scanned_range(t0, last_t, nb.T, nb.KT, nb.ST, WINDOW_FLAGS[0], WINDOW_FLAGS[3], OWN_ARE_QUERIES)
    last_h = tl.minimum(h0 + BOX[1], nb.H) - 1
    s_h0, s_h1 = scanned_range(h0, last_h, nb.H, nb.KH, nb.SH, WINDOW_FLAGS[1], WINDOW_FLAGS[3], OWN_ARE_QUERIES)
    last_w = tl.minimum(w0 + BOX[2], nb.W) - 1
    s_w0, s_w1 = scanned_range(w0, last_w, nb.W, nb.KW, nb.SW, WINDOW_FLAGS[2], WINDOW_FLAGS[3], OWN_ARE_QUERIES)
    return Box(t, h, w, valid, (t0, h0, w0), (last_t, last_h, last_w)), Span(s_t0, s_t1, s_h0, s_h1, s_w0, s_w1)


@triton.jit
def box_offsets(BOX_T: tl.constexpr, BOX_H: tl.constexpr, BOX_W: tl.constexpr):
    """Coordinates of the positions of a BOX_T x BOX_H x BOX_W box, row-major, from
    its first corner (constant divisions: shifts and masks)."""
    c = tl.arange(0, BOX_T * BOX_H * BOX_W)
    return c // (BOX_H * BOX_W), (c // BOX_W) % BOX_H, c % BOX_W


@triton.jit
def box_steps(span, BOX: tl.constexpr):
    """Boxes of ``BOX`` per row and per slab of a scan of ``span``, and in all:
    ``(steps_h, steps_w, n_steps)``."""
    steps_h = tl.cdiv(span.h1 - span.h0, BOX[1])
    steps_w = tl.cdiv(span.w1 - span.w0, BOX[2])
    return steps_h, steps_w, tl.cdiv(span.t1 - span.t0, BOX[0]) * steps_h * steps_w


@triton.jit
def box_scan(span, BOX: tl.constexpr, steps=None):
    """The :class:`BoxScan` of ``span`` in boxes of ``BOX`` (``steps``: its
    :func:`box_steps`, if computed already). The last box along an axis may run past
    the span: the caller clamps coordinates for its loads and masks the extra
    positions."""
    if steps is None:
        steps = box_steps(span, BOX)
    off_t, off_h, off_w = box_offsets(BOX[0], BOX[1], BOX[2])
    return BoxScan(span.t0, span.h0, span.w0, steps[0], steps[1], steps[2], off_t, off_h, off_w)


@triton.jit
def box_at(scan, i_t, i_h, i_w, BOX: tl.constexpr):
    """Box ``(i_t, i_h, i_w)`` of a :class:`BoxScan`: its corner ``(c_t, c_h, c_w)``
    and the coordinates of its positions."""
    c_t = scan.t0 + i_t * BOX[0]
    c_h = scan.h0 + i_h * BOX[1]
    c_w = scan.w0 + i_w * BOX[2]
    return c_t, c_h, c_w, c_t + scan.off_t, c_h + scan.off_h, c_w + scan.off_w


@triton.jit
def first_box():
    """Box indices ``(i_t, i_h, i_w)`` of a scan's first box (:func:`next_box` counts
    on from them)."""
    return tl.zeros([], tl.int32), tl.zeros([], tl.int32), tl.zeros([], tl.int32)


@triton.jit
def next_box(scan, i_t, i_h, i_w):
    """One step of a :class:`BoxScan`: box indices ``(i_t, i_h, i_w)`` of the next box.

    Counting with carries instead of dividing the step number: a division by a
    run-time value costs ~20 instructions per thread, and there were three per step.
    """
    i_w += 1
    wrap_w = i_w == scan.steps_w
    i_w = tl.where(wrap_w, 0, i_w)
    i_h = tl.where(wrap_w, i_h + 1, i_h)
    wrap_h = i_h == scan.steps_h
    i_h = tl.where(wrap_h, 0, i_h)
    i_t = tl.where(wrap_h, i_t + 1, i_t)
    return i_t, i_h, i_w


# Full boxes. Where every query of a box sees every key of another, their product
# needs no mask. A scan that splits (``SPLIT_FULL``, a table's choice) runs the
# full boxes first, in a loop of their own without the mask's arithmetic, then the
# other boxes (masked) in its usual order, stepping over the full ones. Its
# products and their order are the same in the fast and the safe loops, so the
# non-finite recomputation still matches the fast tile bit for bit.


class FullBoxes(NamedTuple):
    """The full boxes of a scan (:func:`full_boxes`): their indices in the scan,
    ``[t0, t1) x [h0, h1) x [w0, w1)`` as a :class:`Span` of box indices (empty:
    ``t0 == t1 == 0``), and the :class:`BoxScan` over them alone."""
    boxes: tl.tensor
    scan: tl.tensor


@triton.jit
def full_range(box, axis: tl.constexpr, length, kernel_size, stride, CAUSAL: tl.constexpr, STRIDED: tl.constexpr,
               OWN_ARE_QUERIES: tl.constexpr):
    """Along ``axis``, the positions every position of a program's ``box`` pairs with
    whole: the keys all its queries see (``OWN_ARE_QUERIES``), or the queries that see
    all its keys; ``[start, stop)``, from the box's first and last position in the
    grid."""
    if OWN_ARE_QUERIES:
        return seen_by_all(box.first[axis], box.last[axis], length, kernel_size, stride, CAUSAL, STRIDED)
    return seeing_all(box.first[axis], box.last[axis], length, kernel_size, stride, CAUSAL, STRIDED)


@triton.jit
def full_boxes(box, scan, nb, WINDOW_FLAGS: tl.constexpr, SCANNED_BOX: tl.constexpr, OWN_ARE_QUERIES: tl.constexpr):
    """For a program's ``box`` (a :class:`Box`: of queries for the forward and dQ,
    ``OWN_ARE_QUERIES``; of keys for dK/dV) scanning boxes of the other kind (``scan``):
    the :class:`FullBoxes`, those paired whole with every position of ``box``.

    Per axis, :func:`full_range` in whole boxes of the scan. Along W the full range
    stops one box short of the scan's last box, so that stepping over it
    (:func:`first_masked_box`, :func:`next_masked_box`) never ends a row."""
    a, b = full_range(box, 0, nb.T, nb.KT, nb.ST, WINDOW_FLAGS[0], WINDOW_FLAGS[3], OWN_ARE_QUERIES)
    t0, t1 = tl.cdiv(a - scan.t0, SCANNED_BOX[0]), (b - scan.t0) // SCANNED_BOX[0]
    a, b = full_range(box, 1, nb.H, nb.KH, nb.SH, WINDOW_FLAGS[1], WINDOW_FLAGS[3], OWN_ARE_QUERIES)
    h0, h1 = tl.cdiv(a - scan.h0, SCANNED_BOX[1]), (b - scan.h0) // SCANNED_BOX[1]
    a, b = full_range(box, 2, nb.W, nb.KW, nb.SW, WINDOW_FLAGS[2], WINDOW_FLAGS[3], OWN_ARE_QUERIES)
    w0, w1 = tl.cdiv(a - scan.w0, SCANNED_BOX[2]), tl.minimum((b - scan.w0) // SCANNED_BOX[2], scan.steps_w - 1)
    # (a >= the scan's start: the scan starts at the first position's range. b may
    # lie before it where the range is empty; the division then gives 0 or less.)
    empty = (t1 <= t0) | (h1 <= h0) | (w1 <= w0)
    t0 = tl.where(empty, 0, t0)
    t1 = tl.where(empty, 0, t1)
    inner = BoxScan(scan.t0 + t0 * SCANNED_BOX[0], scan.h0 + h0 * SCANNED_BOX[1], scan.w0 + w0 * SCANNED_BOX[2],
                    h1 - h0, w1 - w0, (t1 - t0) * (h1 - h0) * (w1 - w0), scan.off_t, scan.off_h, scan.off_w)
    return FullBoxes(Span(t0, t1, h0, h1, w0, w1), inner)


@triton.jit
def split_scan(box, scan, nb, WINDOW_FLAGS: tl.constexpr, SCANNED_BOX: tl.constexpr, SPLIT: tl.constexpr,
               OWN_ARE_QUERIES: tl.constexpr = True):
    """A scan over boxes, split (``SPLIT``) or not: its :class:`FullBoxes`
    (:func:`full_boxes`; a placeholder unless split) and the number of the other
    boxes, which the masked loop scans."""
    if SPLIT:
        full = full_boxes(box, scan, nb, WINDOW_FLAGS, SCANNED_BOX, OWN_ARE_QUERIES)
        n_masked = scan.n_steps - full.scan.n_steps
    else:
        full = FullBoxes(Span(scan.t0, scan.t0, scan.h0, scan.h0, scan.w0, scan.w0), scan)
        n_masked = scan.n_steps
    return full, n_masked


@triton.jit
def skip_full(full, i_t, i_h, i_w):
    """Box indices ``(i_t, i_h, i_w)`` of a scan, moved past the :class:`FullBoxes`
    ``full`` where they reach its first box of a row (to the row's first box after
    them, which exists: :func:`full_boxes`)."""
    f = full.boxes
    jump = (i_t >= f.t0) & (i_t < f.t1) & (i_h >= f.h0) & (i_h < f.h1) & (i_w == f.w0)
    return i_t, i_h, tl.where(jump, f.w1, i_w)


@triton.jit
def first_masked_box(full, SPLIT: tl.constexpr):
    """The masked loop's first box: the scan's first, past the full boxes if split."""
    i_t, i_h, i_w = first_box()
    if SPLIT:
        i_t, i_h, i_w = skip_full(full, i_t, i_h, i_w)
    return i_t, i_h, i_w


@triton.jit
def next_masked_box(scan, full, i_t, i_h, i_w, SPLIT: tl.constexpr):
    """The masked loop's next box (:func:`next_box`), past the full boxes if split."""
    i_t, i_h, i_w = next_box(scan, i_t, i_h, i_w)
    if SPLIT:
        i_t, i_h, i_w = skip_full(full, i_t, i_h, i_w)
    return i_t, i_h, i_w
