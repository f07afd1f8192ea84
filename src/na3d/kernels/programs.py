"""A kernel's programs: which tile, head and batch element each computes, the two
launches (fast, then the safe way where flagged: ``nonfinite``), and the set-up
and end of a program over a box of queries.

Every kernel takes its arguments one by one (the launch's signature) and hands
them to its tile function through :func:`run_programs` grouped: ``strides`` (one
(b, t, h, w, n) tuple per tensor, in the tensors' order), ``window = (KT, KH, KW,
ST, SH, SW)``, ``tiling = (tiles_h, tiles_w)`` and the compile-time ``Q_BOX`` /
``KV_BOX`` / ``K_BOX`` (a box's T, H, W sizes), ``WINDOW_FLAGS = (CAUSAL_T, CAUSAL_H,
CAUSAL_W, STRIDED)`` (``windows``), ``MASKS = (MASK_T, MASK_H, MASK_W)``
(``masks``) and ``DILATION = (DIL_T, DIL_H, DIL_W)`` (``groups``). A tuple of
constants goes on as a call's argument, indexed (``Q_BOX[0]``) where used: in
Triton 3.6 one assigned to a variable, or returned, is no longer constant. Tuples
of run-time values are named (``windows.Neighborhood``, ``tiles.Box``, ...).
"""

from typing import NamedTuple

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .groups import descriptor_origin, dilation_group
from .memory import head_base, head_columns, key_value_bases, KeyBoxes, load_rows, position_offsets
from .nonfinite import FLAG_BLOCK, has_nonfinite, mark_reached
from .tiles import program_box
from .windows import Neighborhood


class QueryProgram(NamedTuple):
    """A program over a box of queries (:func:`query_program`): the geometry in its
    dilation group (``windows.Neighborhood``), the group (``groups.Place``), the
    tensors moved there, its box of queries (``tiles.Box``), the union of their
    windows (``tiles.Span``), the head's columns (``memory.Columns``) and the
    queries."""
    nb: tl.tensor
    place: tl.tensor
    tensors: tl.tensor
    box: tl.tensor
    union: tl.tensor
    cols: tl.tensor
    q: tl.tensor


@triton.jit
def run_programs(tile_fn: tl.constexpr, args, FLAGS, n_tiles, heads, n_programs,
                 GROUP: tl.constexpr, PER_KEY_HEAD: tl.constexpr, ASSUME_FINITE: tl.constexpr,
                 REDO: tl.constexpr, PDL: tl.constexpr, REDO_IN_PROGRAM: tl.constexpr = False):
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
    ``ASSUME_FINITE``, its flag: per query head, 1 where the returned scalar says the
    tile holds an inf or NaN, else 0; per key/value head, 0 first and then 1 from the
    threads of the rows ``tile_fn`` returns as non-finite, after a barrier (a row's
    test needs no shared memory, which keeps the dK/dV loop's registers as they were).

    Second launch (``REDO``, a grid (G,), any G): the flagged programs, the safe way,
    each by one of the G programs in turn; where no flag is set (finite inputs), each
    program reads its share of the flags, ``FLAG_BLOCK`` at a time, and ends. (The
    safe way sets no flag: its tile function is called with ``ASSUME_FINITE`` on.)

    ``PDL`` (Hopper on, ``launch.launch_and_redo``): the second launch is a
    programmatic dependent launch. Each first-launch program lets it start at once
    (``griddepcontrol.launch_dependents``: the second grid may launch once every
    program of the first has started, into the slots of finished ones), and the
    second waits for the first to end and its memory to settle
    (``griddepcontrol.wait``) before reading a flag. Its launch then overlaps the
    first launch's last programs instead of following them.

    ``REDO_IN_PROGRAM``: one launch: a program whose tile holds an inf or NaN
    computes it again the safe way itself, at once (no flags, no second launch). The
    safe code then shares the fast kernel's registers and shared memory (ptxas sizes
    them for the whole kernel), which is why it is a table's choice."""
    if PER_KEY_HEAD:
        grid_heads = heads // GROUP
    else:
        grid_heads = heads
    if REDO:
        if PDL:
            gdc_wait()
        for start in range(tl.program_id(0) * FLAG_BLOCK, n_programs, tl.num_programs(0) * FLAG_BLOCK):
            block = start + tl.arange(0, FLAG_BLOCK)
            if tl.max(tl.load(FLAGS + block, mask=block < n_programs, other=0).to(tl.int32), 0) != 0:
                for program in range(start, tl.minimum(start + FLAG_BLOCK, n_programs)):
                    if tl.load(FLAGS + program) != 0:
                        tile_fn(program % n_tiles, (program // n_tiles) % grid_heads,
                                program // (n_tiles * grid_heads), heads, *args, True, True)
    elif PER_KEY_HEAD:
        if PDL and not ASSUME_FINITE and not REDO_IN_PROGRAM:
            gdc_launch_dependents()
        head = tl.program_id(1)
        batch = tl.program_id(2)
        tile = tl.program_id(0)
        flag = FLAGS + tile + n_tiles * (head + grid_heads * batch.to(tl.int64))
        if not ASSUME_FINITE and not REDO_IN_PROGRAM:
            tl.store(flag, tl.zeros([], tl.int8))
        rows = tile_fn(tile, head, batch, tl.num_programs(1) * GROUP, *args, False, ASSUME_FINITE)
        if not ASSUME_FINITE:
            if REDO_IN_PROGRAM:
                if tl.max(rows.to(tl.int32), 0) != 0:
                    tile_fn(tile, head, batch, tl.num_programs(1) * GROUP, *args, True, True)
            else:
                tl.debug_barrier()  # no 0 lands after a 1
                tl.store(flag + tl.zeros_like(rows).to(tl.int64), tl.full(rows.shape, 1, tl.int8), mask=rows)
    else:
        if PDL and not ASSUME_FINITE and not REDO_IN_PROGRAM:
            gdc_launch_dependents()
        head = tl.program_id(1) * GROUP + tl.program_id(0) % GROUP
        batch = tl.program_id(2)
        tile = tl.program_id(0) // GROUP
        nonfinite = tile_fn(tile, head, batch, tl.num_programs(1) * GROUP, *args, False, ASSUME_FINITE)
        if not ASSUME_FINITE:
            if REDO_IN_PROGRAM:
                if nonfinite:
                    tile_fn(tile, head, batch, tl.num_programs(1) * GROUP, *args, True, True)
            else:
                tl.store(FLAGS + tile + n_tiles * (head + grid_heads * batch.to(tl.int64)), nonfinite.to(tl.int8))


@triton.jit
def query_program(tile, batch, head, tensors, strides, T, H, W, window, tiling, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, Q_BOX: tl.constexpr, WINDOW_FLAGS: tl.constexpr, DILATION: tl.constexpr):
    """The set-up of a program over a box of queries (the forward, dQ): its
    :class:`QueryProgram`, ``tensors`` (Q first) moved to its dilation group."""
    tile, T, H, W, place, tensors = dilation_group(tile, T, H, W, tensors, strides, DILATION)
    nb = Neighborhood(T, H, W, *window)
    box, union = program_box(tile, tiling, nb, WINDOW_FLAGS, Q_BOX, DILATION[0] * DILATION[1] * DILATION[2] > 1,
                             True)
    cols = head_columns(HEAD_DIM, BLOCK_D)
    q = load_rows(head_base(tensors[0], strides[0], batch, head), strides[0], box.t, box.h, box.w, cols)
    return QueryProgram(nb, place, tensors, box, union, cols, q)


@triton.jit
def program_keys(prog, batch, head, heads, K, V, K_DESC, V_DESC, k_strides, v_strides, OUT, out_strides,
                 HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, KV_BOX: tl.constexpr, WINDOW_FLAGS: tl.constexpr,
                 DILATION: tl.constexpr, GROUP: tl.constexpr, MARK_FROM_VALUES: tl.constexpr, SAFE: tl.constexpr):
    """Where a :class:`QueryProgram` of query head ``head`` reads its keys and values
    (``memory.KeyBoxes``; K, V moved to its dilation group). ``SAFE``: first the marks
    of ``nonfinite.mark_reached`` in its result ``OUT``, from the values
    (``MARK_FROM_VALUES``: the forward's output) or the keys (dQ)."""
    kv_head, k_base, v_base = key_value_bases(K, V, k_strides, v_strides, batch, head, GROUP)
    if SAFE:
        box = prog.box
        mark_reached(head_base(OUT, out_strides, batch, head), position_offsets(out_strides, box.t, box.h, box.w),
                     box, v_base if MARK_FROM_VALUES else k_base, v_strides if MARK_FROM_VALUES else k_strides,
                     prog.nb, WINDOW_FLAGS, prog.union, HEAD_DIM, BLOCK_Q, KV_BOX, 1, True)
    return KeyBoxes(K_DESC, V_DESC, k_base, v_base, k_strides, v_strides, batch, kv_head,
                    descriptor_origin(prog.place, DILATION), (heads // GROUP) * HEAD_DIM)


@triton.jit
def store_query_tile(OUT, out_strides, batch, head, box, x, cols, SAFE: tl.constexpr, ASSUME_FINITE: tl.constexpr,
                     scale=None):
    """A program's result over its box of queries (the forward's output, dQ):
    ``x`` (times ``scale``, if given) stored into ``OUT`` at (batch, head) and the
    box's positions that are valid, in OUT's dtype. With ``SAFE`` the NaN marks that
    ``nonfinite.mark_reached`` stored there first are laid over it. Returns (unless
    ``ASSUME_FINITE``) whether ``x`` holds an inf or NaN."""
    base = head_base(OUT, out_strides, batch, head)
    if SAFE:
        marks = tl.load(base + position_offsets(out_strides, box.t, box.h, box.w)[:, None] + cols.d[None, :],
                        mask=box.valid[:, None] & cols.ok[None, :], other=0.0)
        x = tl.where(marks != marks, float("nan"), x)
    ptrs = base + position_offsets(out_strides, box.t, box.h, box.w)[:, None] + cols.d[None, :]
    if not ASSUME_FINITE:
        nonfinite = has_nonfinite(x)
    else:
        nonfinite = tl.zeros([], tl.int1)
    if scale is not None:
        x = x * scale
    tl.store(ptrs, x.to(OUT.dtype.element_ty), mask=box.valid[:, None] & cols.ok[None, :])
    return nonfinite
