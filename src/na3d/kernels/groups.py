"""NATTEN's dilation, in one launch: a program works inside one dilation group.

With dilation ``d`` an axis of length ``L`` splits into ``d`` groups by ``index %
d``, group ``g`` holding positions ``g + d * i`` for ``i < ceil((L - g) / d)``, and
attention runs at dilation 1 inside each group (``geometry.window_bounds``). A
program's boxes, windows and scans are in its group's own coordinates; memory is
reached through the group's view of each tensor (its first position, and strides
times the dilation, which the launcher passes: ``launch.group_strides``) and
:func:`grid_position` (the full grid's own arrays: lse, statistics). At dilation 1
every function here is the identity, and the code that of a kernel without
dilation. ``DILATION = (DIL_T, DIL_H, DIL_W)`` is a compile-time tuple.
"""

from typing import NamedTuple

import triton
import triton.language as tl


class Place(NamedTuple):
    """A program's dilation group: the full grid's lengths and the group's index
    along each axis (placeholders at dilation 1, which nothing reads)."""
    T: tl.tensor
    H: tl.tensor
    W: tl.tensor
    gt: tl.tensor
    gh: tl.tensor
    gw: tl.tensor


@triton.jit
def dilation_group(tile, T, H, W, tensors, strides, DILATION: tl.constexpr):
    """The dilation group of program ``tile``.

    ``tile`` numbers (box, group) pairs, the groups innermost (neighbouring
    programs read interleaved, so neighbouring, memory), the boxes over the largest
    group's sub-grid (``ceil(L / d)`` per axis; see ``tiles.box_of_program``).
    ``tensors``: ``(B, T, H, W, N, C)`` tensors, ``strides`` theirs (b, t, h, w, n).
    Returns ``(tile, T, H, W, place, tensors)``: the box's number in its group, the
    group's lengths, its :class:`Place`, and the tensors moved to the group's first
    position. At dilation 1 the arguments come back as they are."""
    GROUPS: tl.constexpr = DILATION[0] * DILATION[1] * DILATION[2]
    if GROUPS == 1:
        place = Place(T, H, W, T, H, W)
    else:
        g = tile % GROUPS
        gt = g // (DILATION[1] * DILATION[2])
        gh = (g // DILATION[2]) % DILATION[1]
        gw = g % DILATION[2]
        place = Place(T, H, W, gt, gh, gw)
        tile = tile // GROUPS
        T = (T - gt + DILATION[0] - 1) // DILATION[0]
        H = (H - gh + DILATION[1] - 1) // DILATION[1]
        W = (W - gw + DILATION[2] - 1) // DILATION[2]
        moved = ()
        for i in tl.static_range(len(tensors)):
            # (the strides are the group's: the tensor's t, h, w strides times the dilation)
            moved = moved + (tensors[i] + gt.to(tl.int64) * (strides[i][1] // DILATION[0])
                             + gh.to(tl.int64) * (strides[i][2] // DILATION[1])
                             + gw.to(tl.int64) * (strides[i][3] // DILATION[2]),)
        tensors = moved
    return tile, T, H, W, place, tensors


@triton.jit
def descriptor_origin(place, DILATION: tl.constexpr):
    """Where the dilation group ``place`` starts in a tensor descriptor that folds the
    groups (``launch.box_descriptor``): ``(h, w, g)``, its offsets along the
    descriptor's H and W axes, and its index along the channel axis, in positions
    (times a position's channels). ``(0, 0, 0)`` at dilation 1."""
    if DILATION[0] * DILATION[1] * DILATION[2] == 1:
        origin = (0, 0, 0)
    else:
        origin = (place.gt * (place.H // DILATION[1]), place.gh * (place.W // DILATION[2]), place.gw)
    return origin


@triton.jit
def grid_position(t, h, w, place, DILATION: tl.constexpr):
    """Positions ``(t, h, w)`` of the dilation group ``place`` in the full grid:
    ``(t, h, w)``."""
    if DILATION[0] > 1:
        t = place.gt + DILATION[0] * t
    if DILATION[1] > 1:
        h = place.gh + DILATION[1] * h
    if DILATION[2] > 1:
        w = place.gw + DILATION[2] * w
    return t, h, w


@triton.jit
def position_rows(batch, head, heads, t, h, w, place, DILATION: tl.constexpr):
    """Element index (int64) of ``(batch, t, h, w, head)`` in a contiguous ``(B, T, H,
    W, heads)`` array of the full grid (the lse, its gradient, the one-pass
    backward's dQ buffer in rows), for positions ``(t, h, w)`` of the group
    ``place``."""
    t, h, w = grid_position(t, h, w, place, DILATION)
    return (((batch.to(tl.int64) * place.T + t) * place.H + h) * place.W + w) * heads + head
