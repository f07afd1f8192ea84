"""Kernel launch configurations: per-architecture JSON tables, chosen without tuning.

``configs/<arch>.json`` (``sm90``, ``gfx942``, ...) lists buckets in order; the first
bucket whose ``when`` conditions hold for a call gives its tile shapes, ``num_warps``
and ``num_stages`` (or one of the bucket's ``alternatives``, where its tiles issue
fewer products on the call's grid: see ``bucket_options``). ``configs/default.json``
serves any architecture without a table of its own. ``python -m na3d.tools.tune``
regenerates a table from measurements.

Tiles are then fitted to the input: a tile dimension at least twice the grid
dimension it covers would idle half its lanes, so it is halved and the factor moved
to another dimension, keeping the tile's size (and the compiled kernel) unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from importlib import resources
from typing import Dict, Optional, Sequence, Tuple

import torch

from . import geometry

Triple = Tuple[int, int, int]

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """Tiles and launch settings of the forward kernel. ``tma``: load key/value boxes
    through tensor descriptors where the GPU and the tensors' layout allow (see
    ``launch.tma_layout_ok``); elsewhere the kernel loads through pointers.
    ``maxnreg``: a cap on registers per thread (NVIDIA only, passed to the compiler),
    or None for the compiler's choice; a lower cap fits more programs on an SM (a
    table entry's ``"maxnreg_when"`` narrows its cap to the calls it holds for, in
    ``when``'s terms: a cap that gains an SM a program at head dim 64 spills at 128).
    ``fixed_mask``: along axes where the scan never moves (``launch.mask_modes``),
    compute the window mask once per program and let the QK^T product add it (the
    other axes then select once per score, from window bits where they fit); off
    where holding it costs more than it saves (the 1-warp boxes of short windows).
    ``split_full``: where at least this share of a call's products falls in full box
    pairs (``geometry.full_products_share``), each program scans those first, in a
    loop without the mask, then the others (``kernels.tiles.FullBoxes``); None: never.
    The masked loop then pays for stepping over the full boxes, so splitting pays
    only above a share. ``redo_in_program``: unless ``assume_finite``, a program
    whose tile holds an inf or NaN computes it again the safe way itself, in the one
    launch (``kernels.programs.run_programs``), instead of a second launch reading
    flags: no second launch on finite inputs, but the safe code's registers count in
    the kernel's (``benchmarks/launched_sass.py`` prints them). ``sm90_gluon``: the
    shared-memory slots of the Gluon sm90 forward for perfectly block-sparse calls
    (``kernels/sm90_forward.py``, with this config's boxes; a strided entry's
    ``"sm90_gluon": {"stages": N}``), which ``launch.sm90_block_sparse_slots`` takes
    where the call fits it; None: never."""
    q_tile: Triple
    kv_tile: Triple
    num_warps: int
    num_stages: int
    bucket: str = "explicit"
    tma: bool = True
    maxnreg: Optional[int] = None
    fixed_mask: bool = True
    split_full: Optional[float] = None
    redo_in_program: bool = False
    sm90_gluon: Optional[int] = None

    def __post_init__(self):
        for name in ("q_tile", "kv_tile"):
            tile = getattr(self, name)
            if len(tile) != 3 or any(x < 1 or x & (x - 1) for x in tile):
                raise ValueError(f"{name}={tile} must be three powers of two")
            if math.prod(tile) < 16:
                raise ValueError(f"{name}={tile} must hold at least 16 positions (tl.dot minimum)")
        _check_maxnreg("maxnreg", self.maxnreg)
        _check_share("split_full", self.split_full)


def _check_share(name: str, value) -> None:
    if value is not None and not (isinstance(value, (int, float)) and 0 <= value <= 1):
        raise ValueError(f"{name}={value!r} must be None or a share in [0, 1]")


def _check_maxnreg(name: str, value) -> None:
    if value is not None and (not isinstance(value, int) or not 24 <= value <= 255 or value % 8):
        raise ValueError(f"{name}={value!r} must be None or a multiple of 8 from 24 to 255")


def maxnreg_option(value: Optional[int]) -> Dict[str, int]:
    """Launch keyword for a register cap: empty when unset (backends without the
    option, AMD's among them, reject the keyword)."""
    return {} if value is None else {"maxnreg": value}


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Tiles of the two backward kernels.

    dQ scans key boxes (``dq_kv_tile``) for a box of queries (``dq_q_tile``); dK/dV
    scans query boxes (``dkdv_q_tile``) for a box of keys (``dkdv_k_tile``).
    ``num_warps``/``num_stages`` are the dQ kernel's, and the dK/dV kernel's too
    unless ``dkdv_num_warps``/``dkdv_num_stages`` say otherwise. ``fused`` selects the
    one-pass backward (dK/dV tiles and launch settings, dQ added atomically; the dQ
    query box then only sizes the ``delta`` pass); it is not deterministic, and
    ``torch.use_deterministic_algorithms(True)`` overrides it. ``tma``: as in
    :class:`ForwardConfig`, for the boxes each kernel scans; ``dq_maxnreg`` and
    ``dkdv_maxnreg``: register caps per kernel, as ``ForwardConfig.maxnreg``;
    ``fixed_mask``: as in :class:`ForwardConfig`, for the dQ kernel; ``split_full``: as
    in :class:`ForwardConfig`, for the dQ kernel, and ``dkdv_split_full`` for the dK/dV
    kernel (full pairs: query boxes that see every key of the program's box);
    ``redo_in_program`` / ``dkdv_redo_in_program``: as ``ForwardConfig.redo_in_program``,
    for the dQ kernel / the dK/dV kernel (the fused backward's too).
    ``dkdv_head_split``: with one key/value head (MQA), the two-kernel backward's dK/dV
    programs per key box (a power of two; 1: one program for all query heads). Each
    takes an equal share of the query heads and writes float32 partial dK/dV, which
    are summed after: more, shorter programs. Other calls ignore it.
    """
    dq_q_tile: Triple
    dq_kv_tile: Triple
    dkdv_k_tile: Triple
    dkdv_q_tile: Triple
    num_warps: int
    num_stages: int
    bucket: str = "explicit"
    dkdv_num_warps: Optional[int] = None
    dkdv_num_stages: Optional[int] = None
    fused: bool = False
    tma: bool = True
    dq_maxnreg: Optional[int] = None
    dkdv_maxnreg: Optional[int] = None
    fixed_mask: bool = True
    split_full: Optional[float] = None
    dkdv_split_full: Optional[float] = None
    redo_in_program: bool = False
    dkdv_redo_in_program: bool = False
    dkdv_head_split: int = 1

    @property
    def dkdv_warps(self) -> int:
        return self.dkdv_num_warps if self.dkdv_num_warps is not None else self.num_warps

    @property
    def dkdv_stages(self) -> int:
        return self.dkdv_num_stages if self.dkdv_num_stages is not None else self.num_stages

    def __post_init__(self):
        for name in ("dq_q_tile", "dq_kv_tile", "dkdv_k_tile", "dkdv_q_tile"):
            tile = getattr(self, name)
            if len(tile) != 3 or any(x < 1 or x & (x - 1) for x in tile) or math.prod(tile) < 16:
                raise ValueError(f"{name}={tile} must be three powers of two holding at least 16 positions")
        _check_maxnreg("dq_maxnreg", self.dq_maxnreg)
        _check_maxnreg("dkdv_maxnreg", self.dkdv_maxnreg)
        _check_share("split_full", self.split_full)
        _check_share("dkdv_split_full", self.dkdv_split_full)
        if not isinstance(self.dkdv_head_split, int) or self.dkdv_head_split < 1 or \
                self.dkdv_head_split & (self.dkdv_head_split - 1):
            raise ValueError(f"dkdv_head_split={self.dkdv_head_split!r} must be a power of two, 1 or more")


@functools.lru_cache(maxsize=None)
def load_table(arch: str) -> dict:
    """The JSON table for ``arch``, or the default table when there is none."""
    folder = resources.files("na3d") / "configs"
    path = folder / f"{arch}.json"
    if not path.is_file():
        path = folder / "default.json"
    return json.loads(path.read_text())


@functools.lru_cache(maxsize=None)
def dependent_second_launch(arch: str) -> bool:
    """Whether kernels on ``arch`` launch their second (non-finite) launch as a
    programmatic dependent of the first (``launch.launch_and_redo``): the table's
    ``dependent_launch``, off where it does not say."""
    return bool(load_table(arch).get("dependent_launch", False))


def matches(when: Dict, head_dim: int, kernel_size: Sequence[int], dtype: torch.dtype) -> bool:
    """Whether a table entry's ``when`` conditions hold for a call (an empty ``when`` always does)."""
    volume = math.prod(kernel_size)
    checks = {
        "head_dim_max": lambda x: head_dim <= x,
        "head_dim_min": lambda x: head_dim >= x,
        "kernel_volume_max": lambda x: volume <= x,
        "kernel_volume_min": lambda x: volume >= x,
        "kernel_w_min": lambda x: kernel_size[2] >= x,
        "dtypes": lambda x: _DTYPE_NAMES.get(dtype) in x,
    }
    for key, value in when.items():
        if key not in checks:
            raise ValueError(f"unknown condition {key!r} in a config table")
        if not checks[key](value):
            return False
    return True


def fit_tile(tile: Sequence[int], extents: Sequence[int]) -> Triple:
    """Move factors of two from tile dimensions far larger than their extent to others."""
    tile = list(tile)
    for _ in range(32):
        over = [d for d in range(3) if tile[d] > 1 and tile[d] >= 2 * extents[d]]
        room = [d for d in range(3) if tile[d] < extents[d]]
        if not over or not room:
            break
        src = over[0]
        dst = max(room, key=lambda d: extents[d] / tile[d])
        tile[src] //= 2
        tile[dst] *= 2
    return tuple(tile)


@functools.lru_cache(maxsize=1024)
def forward_config(
    arch: str,
    shape: Triple,
    kernel_size: Triple,
    head_dim: int,
    dtype: torch.dtype,
    stride: Triple = (1, 1, 1),
    is_causal: Tuple[bool, bool, bool] = (False, False, False),
    weigh_gluon: bool = True,
) -> ForwardConfig:
    """Launch configuration for the forward kernel on ``shape = (T, H, W)``.

    With a stride, a bucket's ``strided`` entry adds boxes aligned to it
    (:func:`stride_aligned_option`), and every option's products are counted with the
    stride (and causal axes) of the call. ``weigh_gluon``: an option that names the
    Gluon sm90 forward (``sm90_gluon.product_cost``) counts its products at that
    cost where every box pair is full; the backward (:func:`backward_config`), which
    has no such kernel, chooses by the products alone.

    Memoized: the choice depends only on these hashable arguments, and a call of the
    library should not pay for the table lookup again.
    """
    entry = table_entry(arch, kernel_size, head_dim, dtype)
    strided = any(s > 1 for s in stride)
    if not strided:  # (the stride-1 choice counts products as the tables were tuned with)
        is_causal = (False, False, False)
    best = None
    for name, option in bucket_options(entry, shape, kernel_size, stride, is_causal):
        if not matches(option.get("when", {}), head_dim, kernel_size, dtype):
            continue
        q_tile, kv_tile = fitted_tiles(option["q_tile"], option["kv_tile"], shape, kernel_size)
        ratio = geometry.issued_flops_ratio(shape, kernel_size, q_tile, kv_tile, is_causal, stride)
        gluon = option.get("sm90_gluon")
        if (weigh_gluon and gluon is not None and arch == "sm90" and "product_cost" in gluon
                and head_dim in (64, 128) and dtype in (torch.float16, torch.bfloat16) and not any(is_causal)
                and math.prod(q_tile) == 128
                and geometry.full_products_share(shape, kernel_size, q_tile, kv_tile, is_causal, stride) == 1.0):
            # Every box pair full, and the call inside the Gluon kernel's limits as far
            # as the table can tell (launch.sm90_block_sparse_slots checks the rest at
            # launch): on sm90 that kernel runs it, whose products cost the measured
            # fraction of the portable kernel's (so 20 % more products from boxes the
            # grid's borders clip can still be the faster choice: Wan's grid).
            ratio *= float(gluon["product_cost"])
        # (The stride-aligned option, made for the call, wins a tie.)
        if best is None or (ratio <= best[0] if name.endswith("/strided") else ratio < ALTERNATIVE_MARGIN * best[0]):
            best = (ratio, ForwardConfig(q_tile, kv_tile, option["num_warps"], option["num_stages"], name,
                                         option.get("tma", True), _register_cap(option, head_dim, kernel_size, dtype),
                                         bool(option.get("fixed_mask", True)), option.get("split_full"),
                                         bool(option.get("redo_in_program", False)),
                                         _sm90_gluon(option.get("sm90_gluon"))))
    return best[1]


def _register_cap(option: Dict, head_dim: int, kernel_size: Sequence[int], dtype: torch.dtype) -> Optional[int]:
    """An option's ``maxnreg``, where its ``maxnreg_when`` (default: always) holds for the call."""
    if "maxnreg" in option and matches(option.get("maxnreg_when", {}), head_dim, kernel_size, dtype):
        return option["maxnreg"]
    return None


def _sm90_gluon(entry: Optional[Dict]) -> Optional[int]:
    """A table's ``"sm90_gluon": {"stages": N}`` as ``ForwardConfig.sm90_gluon``."""
    return None if entry is None else int(entry["stages"])


def table_entry(arch: str, kernel_size: Sequence[int], head_dim: int, dtype: torch.dtype) -> Dict:
    """The first bucket of ``arch``'s table whose ``when`` holds for the call."""
    for entry in load_table(arch)["forward"]:
        if matches(entry.get("when", {}), head_dim, kernel_size, dtype):
            return entry
    raise ValueError(f"config table for {arch} has no bucket for head_dim={head_dim}, "
                     f"kernel_size={tuple(kernel_size)}, dtype={dtype}")


def stride_aligned_option(strided: Dict, shape: Triple, kernel_size: Triple, stride: Triple,
                          is_causal: Tuple[bool, bool, bool]) -> Dict:
    """A bucket's ``strided`` entry made a configuration for one strided call.

    The entry gives box sizes (``q_positions``, ``kv_positions``: queries and keys per
    box, powers of two; optionally ``dkdv_q_positions``, the queries per box dK/dV
    scans, else ``q_positions``) and launch settings; the box sides are chosen here, among
    all power-of-two sides, for the least work on the call's grid with its stride:
    the products issued, those in masked box pairs counted ``MASKED_COST`` times
    those in full pairs (``geometry.full_box_pairs_1d``: no mask). Where a
    box of queries fits inside one stride group along an axis, its queries share one
    window there, so key boxes that tile that window are seen whole: along every
    axis where that holds, and the kernel's sides divide it, the kernels run without
    masks (NATTEN's "perfectly block-sparse" case). The backward's boxes come the
    same way: dQ takes the forward's, dK/dV boxes of keys (``kv_positions``)
    scanning boxes of queries (``q_positions``), chosen for dK/dV's own products.
    On a grid too small for boxes of those sizes, smaller ones (at least 16
    positions); None where not even those fit."""
    q_tile, kv_tile = _aligned_boxes(shape, kernel_size, stride, is_causal, strided["q_positions"],
                                     strided["kv_positions"], "queries")
    # (dK/dV may scan smaller query boxes than the forward's: its two accumulators and
    # two score tiles per step spill at 128 by 128 with head dim 128, NOTES v38.)
    k_box, q_box = _aligned_boxes(shape, kernel_size, stride, is_causal, strided["kv_positions"],
                                  strided.get("dkdv_q_positions", strided["q_positions"]), "keys")
    if q_tile is None or k_box is None:
        return None
    option = {key: value for key, value in strided.items()
              if key not in ("q_positions", "kv_positions", "dkdv_q_positions", "why", "measured")}
    backward = dict(strided.get("backward", {}), dq=[q_tile, kv_tile], dkdv=[k_box, q_box])
    return dict(option, q_tile=q_tile, kv_tile=kv_tile, backward=backward)


@functools.lru_cache(maxsize=256)
def _aligned_boxes(shape: Triple, kernel_size: Triple, stride: Triple, is_causal: Tuple[bool, bool, bool],
                   own_positions: int, scanned_positions: int, own: str) -> Tuple[Triple, Triple]:
    # Per axis, each (own side, scanned side) pair's issued products and those in full
    # pairs (both factor per axis), then the best product of the three axes.
    def sides(axis):
        return [1 << i for i in range(8) if (1 << i) < max(2, 2 * shape[axis])]  # (fit_tile keeps these)

    largest = math.prod(sides(axis)[-1] for axis in range(3))
    own_positions, scanned_positions = min(own_positions, largest), min(scanned_positions, largest)
    if min(own_positions, scanned_positions) < 16:  # (tl.dot's smallest operand)
        return None, None

    # A product in a masked pair is counted MASKED_COST times one in a full pair.
    counts = []
    for axis in range(3):
        table = {}
        for own_side in sides(axis):
            for scanned_side in sides(axis):
                pairs = list(geometry.full_box_pairs_1d(shape[axis], kernel_size[axis], own_side, scanned_side,
                                                        is_causal[axis], stride[axis], own))
                table[own_side, scanned_side] = (sum(n for _, n in pairs), sum(n for full, n in pairs if full))
        counts.append(table)
    best = None
    for own_box in _boxes(own_positions, [sides(a) for a in range(3)]):
        for scanned_box in _boxes(scanned_positions, [sides(a) for a in range(3)]):
            issued = full = 1
            for axis in range(3):
                n, f = counts[axis][own_box[axis], scanned_box[axis]]
                issued *= n
                full *= f
            cost = full + MASKED_COST * (issued - full)
            if best is None or cost < best[0]:
                best = (cost, own_box, scanned_box)
    return best[1], best[2]


# How much more a product costs in a masked box pair than in a full one (the mask's
# compares and selects per score), in the choice of stride-aligned boxes.
MASKED_COST = 1.2


def _boxes(positions: int, sides) -> list:
    """Boxes ``(t, h, w)`` of ``positions`` positions with sides from ``sides`` (per axis)."""
    return [(t, h, positions // (t * h)) for t in sides[0] for h in sides[1]
            if positions % (t * h) == 0 and positions // (t * h) in sides[2]]


def fitted_tiles(q_tile: Sequence[int], kv_tile: Sequence[int], shape: Triple,
                 kernel_size: Triple) -> Tuple[Triple, Triple]:
    """A query box and the key box it scans, fitted to ``shape`` (see :func:`fit_tile`):
    the key box to the union of the fitted query box's windows."""
    q_tile = fit_tile(q_tile, shape)
    return q_tile, fit_tile(kv_tile, [min(L, q + K - 1) for L, q, K in zip(shape, q_tile, kernel_size)])


# An alternative replaces the option before it only if it issues at least 5 % fewer
# products: closer than that, the count does not rank configurations (their costs
# per step differ by a few percent), and the measured main option stays.
ALTERNATIVE_MARGIN = 0.95


def bucket_options(entry: Dict, shape: Optional[Triple] = None, kernel_size: Optional[Triple] = None,
                   stride: Triple = (1, 1, 1), is_causal: Tuple[bool, bool, bool] = (False, False, False)):
    """A bucket's configurations as ``(bucket name, entry)``: the entry itself, then
    its ``alternatives`` (same keys, plus a ``name``), named ``bucket/name``. An
    alternative may narrow its bucket's ``when`` with its own (a register cap sized
    for one head dim). For a strided call (``stride``, on ``shape`` with
    ``kernel_size``), last, the bucket's ``strided`` entry made a configuration
    (:func:`stride_aligned_option`), named ``bucket/strided``.

    The forward takes the option whose tiles issue the fewest products on the call's
    grid (``geometry.issued_flops_ratio`` after fitting, by the margin above): a
    choice made from the geometry alone, never by timing. Alternatives are box
    shapes the same kernel runs at about the same cost per step, which waste less
    only where the grid's borders clip their unions (the 11x11x11 bucket's boxes 8
    frames deep, on clips of 13-16 frames; its boxes spanning a whole 16-frame clip,
    which also mask T once per program)."""
    yield entry["bucket"], entry
    for alt in entry.get("alternatives", ()):
        yield f"{entry['bucket']}/{alt['name']}", alt
    if "strided" in entry and any(s > 1 for s in stride):
        option = stride_aligned_option(entry["strided"], shape, kernel_size, stride, is_causal)
        if option is not None:
            yield f"{entry['bucket']}/strided", option


@functools.lru_cache(maxsize=1024)
def backward_config(arch: str, shape: Triple, kernel_size: Triple, head_dim: int, dtype: torch.dtype,
                    stride: Triple = (1, 1, 1),
                    is_causal: Tuple[bool, bool, bool] = (False, False, False)) -> BackwardConfig:
    """Launch configuration for the backward kernels on ``shape = (T, H, W)`` (the
    arguments are :func:`forward_config`'s).

    A bucket's optional ``backward`` entry gives the tiles; without one, dQ reuses
    the forward's tiles and dK/dV their transpose (key boxes the shape of the
    forward's query boxes, scanning query boxes the shape of its key boxes), with
    fewer pipeline stages since each step loads two tiles (Q and dO) per operand.

    A ``backward`` entry's own ``when`` narrows it to the calls it holds for; for the
    others the backward is that of the next bucket down the table whose ``when`` (and
    its backward's) hold (:func:`_later_backward`): a forward's boxes that suit a head
    dim whose backward they do not (sm90's short and small windows at head dim 128,
    NOTES v45).
    """
    fwd = forward_config(arch, shape, kernel_size, head_dim, dtype, stride, is_causal, weigh_gluon=False)
    if not any(s > 1 for s in stride):
        is_causal = (False, False, False)
    table = load_table(arch)
    entry = {}
    for candidate in table["forward"]:
        if candidate["bucket"] != fwd.bucket.split("/")[0]:
            continue
        for name, option in bucket_options(candidate, shape, kernel_size, stride, is_causal):
            if name == fwd.bucket:
                # An alternative without a backward entry of its own takes its bucket's.
                entry = option if "backward" in option else dict(option, backward=candidate.get("backward"))
    bwd = entry.get("backward")
    if bwd is not None and not matches(bwd.get("when", {}), head_dim, kernel_size, dtype):
        return _later_backward(table, fwd.bucket.split("/")[0], shape, kernel_size, head_dim, dtype, stride, is_causal)
    if bwd is None:
        return BackwardConfig(fwd.q_tile, fwd.kv_tile, fwd.q_tile, fwd.kv_tile, fwd.num_warps,
                              max(1, fwd.num_stages - 1), fwd.bucket, tma=fwd.tma, fixed_mask=fwd.fixed_mask,
                              split_full=fwd.split_full, redo_in_program=fwd.redo_in_program)
    return fit_backward(bwd, shape, kernel_size, fwd.bucket, stride, is_causal)


def _later_backward(table: Dict, bucket: str, shape: Triple, kernel_size: Triple, head_dim: int,
                    dtype: torch.dtype, stride: Triple = (1, 1, 1),
                    is_causal: Tuple[bool, bool, bool] = (False, False, False)) -> BackwardConfig:
    """The ``backward`` entry of the first bucket after ``bucket`` in ``table`` whose
    ``when`` and whose backward's ``when`` hold for the call, fitted to ``shape``."""
    names = [entry["bucket"] for entry in table["forward"]]
    for entry in table["forward"][names.index(bucket) + 1:]:
        bwd = entry.get("backward")
        if (bwd is not None and matches(entry.get("when", {}), head_dim, kernel_size, dtype)
                and matches(bwd.get("when", {}), head_dim, kernel_size, dtype)):
            return fit_backward(bwd, shape, kernel_size, entry["bucket"], stride, is_causal)
    raise ValueError(f"config table: the backward of bucket {bucket!r} does not hold for head_dim={head_dim}, "
                     f"kernel_size={tuple(kernel_size)}, dtype={dtype}, and no later bucket's backward does")


def fit_backward(bwd: Dict, shape: Triple, kernel_size: Triple, bucket: str = "explicit", stride: Triple = (1, 1, 1),
                 is_causal: Tuple[bool, bool, bool] = (False, False, False)) -> BackwardConfig:
    """A table's ``backward`` entry, its tiles fitted to ``shape`` (see :func:`fit_tile`).

    ``bwd``: ``{"dq": [query box, key box], "dkdv": [key box, query box],
    "num_warps", "num_stages"}`` and optionally ``"dkdv_num_warps"``,
    ``"dkdv_num_stages"``, ``"fused"``, ``"tma"``, ``"dq_maxnreg"``, ``"dkdv_maxnreg"``, ``"fixed_mask"``,
    ``"split_full"``, ``"dkdv_split_full"``, ``"redo_in_program"``, ``"dkdv_redo_in_program"``,
    ``"dkdv_head_split"``, ``"dq_alternatives"``, ``"dkdv_alternatives"``.

    ``"dq_alternatives"`` / ``"dkdv_alternatives"``: more box pairs (``[query box, key
    box]`` / ``[key box, query box]``) for the same kernel settings. The call takes
    the pair that issues the fewest of that kernel's products on its grid
    (``geometry.issued_flops_ratio``, dK/dV with ``own="keys"``, after fitting), an
    alternative only where it issues at least 5 % fewer than the pair before
    (``ALTERNATIVE_MARGIN``): which pair of the same box sizes wastes least depends on
    how the grid's borders cut the windows (NOTES v49: on the head-dim-128 large
    window, dit-wan's grid favours the dK/dV pair 4x8x4/2x8x4, dit-hunyuan's 4x4x8/2x4x8).
    """
    dq_q, dq_kv = _fewest_products("queries", [bwd["dq"], *bwd.get("dq_alternatives", ())], shape, kernel_size,
                                   stride, is_causal)
    k_box, q_box = _fewest_products("keys", [bwd["dkdv"], *bwd.get("dkdv_alternatives", ())], shape, kernel_size,
                                    stride, is_causal)
    return BackwardConfig(dq_q, dq_kv, k_box, q_box, bwd["num_warps"], bwd["num_stages"], bucket,
                          bwd.get("dkdv_num_warps"), bwd.get("dkdv_num_stages"), bool(bwd.get("fused", False)),
                          bool(bwd.get("tma", True)), bwd.get("dq_maxnreg"), bwd.get("dkdv_maxnreg"),
                          bool(bwd.get("fixed_mask", True)), bwd.get("split_full"), bwd.get("dkdv_split_full"),
                          bool(bwd.get("redo_in_program", False)), bool(bwd.get("dkdv_redo_in_program", False)),
                          int(bwd.get("dkdv_head_split", 1)))


def _fewest_products(own: str, pairs: Sequence, shape: Triple, kernel_size: Triple, stride: Triple,
                     is_causal: Tuple[bool, bool, bool]) -> Tuple[Triple, Triple]:
    """Of one backward kernel's ``[program box, scanned box]`` pairs (``own``: ``"queries"``
    for dQ, ``"keys"`` for dK/dV), each fitted to ``shape``, the first, or a later one
    that issues ``ALTERNATIVE_MARGIN`` times fewer products than the best before it."""
    best = None
    for box, scanned in pairs:
        if own == "queries":
            box, scanned = fitted_tiles(box, scanned, shape, kernel_size)
        else:  # (a key box's queries: no more than the queries that see it)
            box = fit_tile(box, shape)
            scanned = fit_tile(scanned, [min(L, b + 2 * (K - 1)) for L, b, K in zip(shape, box, kernel_size)])
        ratio = geometry.issued_flops_ratio(shape, kernel_size, box, scanned, is_causal, stride, own=own)
        if best is None or ratio < ALTERNATIVE_MARGIN * best[0]:
            best = (ratio, box, scanned)
    return best[1], best[2]
