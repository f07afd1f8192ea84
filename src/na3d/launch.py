"""Launchers for the Triton kernels: configuration, grid, strides, output buffers.

Only this module imports ``na3d.kernels``; the public API (``api.py``) validates
arguments before anything here runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Optional, Sequence, Tuple

import torch

from . import configs, geometry
from .constants import FLAG_BLOCK, LOG2_E, MASK_BITS, MASK_FIXED, MASK_NONE, MASK_PER_STEP
from .device import dependent_launch, device_arch, sm_count


def kernels_interpreted() -> bool:
    """True when the kernels were defined under ``TRITON_INTERPRET=1`` (CPU tensors run)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction

        from .kernels.forward import na3d_fwd_kernel
    except ImportError:  # no Triton at all: CPU calls use the PyTorch reference
        return False
    return isinstance(na3d_fwd_kernel, InterpretedFunction)


def _table_config(lookup, q: torch.Tensor, kernel_size: Sequence[int], dilation: Sequence[int],
                  stride: Sequence[int], is_causal: Sequence[bool]):
    """``lookup`` (``configs.forward_config`` or ``backward_config``) for ``q``'s device,
    head dim and dtype, and the grid the kernels tile: with dilation, the largest
    group's sub-grid (:func:`group_grid`); with a stride, boxes may follow it."""
    HD = q.shape[-1]
    return lookup(device_arch(q.device), group_grid(q.shape[1:4], dilation), tuple(kernel_size), HD, q.dtype,
                  tuple(int(s) for s in stride), tuple(bool(c) for c in is_causal))


def forward_config(q: torch.Tensor, kernel_size: Sequence[int], dilation: Sequence[int] = (1, 1, 1),
                   stride: Sequence[int] = (1, 1, 1),
                   is_causal: Sequence[bool] = (False, False, False)) -> configs.ForwardConfig:
    return _table_config(configs.forward_config, q, kernel_size, dilation, stride, is_causal)


def backward_config(q: torch.Tensor, kernel_size: Sequence[int], dilation: Sequence[int] = (1, 1, 1),
                    stride: Sequence[int] = (1, 1, 1),
                    is_causal: Sequence[bool] = (False, False, False)) -> configs.BackwardConfig:
    return _table_config(configs.backward_config, q, kernel_size, dilation, stride, is_causal)


def group_grid(spatial: Sequence[int], dilation: Sequence[int]) -> Tuple[int, int, int]:
    """The largest dilation group's sub-grid, ``ceil(L / d)`` per axis (the grid
    itself at dilation 1): the kernels tile every group as this one
    (``kernels/groups.py``, ``dilation_group``)."""
    return tuple(-(-L // d) for L, d in zip(spatial, dilation))


def tile_grid(spatial: Sequence[int], box: Sequence[int], dilation: Sequence[int]) -> Tuple[int, int, int]:
    """``(tiles_h, tiles_w, n_tiles)`` of a kernel whose programs own ``box``: boxes per
    row and per slab of :func:`group_grid`, and (box, dilation group) tiles in all."""
    tiles = [math.ceil(L / b) for L, b in zip(group_grid(spatial, dilation), box)]
    return tiles[1], tiles[2], tiles[0] * tiles[1] * tiles[2] * math.prod(dilation)


def dilation_constexprs(dilation: Sequence[int]) -> dict:
    return dict(DIL_T=int(dilation[0]), DIL_H=int(dilation[1]), DIL_W=int(dilation[2]))


def group_strides(x: torch.Tensor, dilation: Sequence[int]) -> Tuple[int, ...]:
    """A ``(B, T, H, W, N, C)`` tensor's (b, t, h, w, head) strides as those of one
    dilation group's sub-grid: t, h and w times the dilation (``kernels/groups.py``,
    ``dilation_group``). Scaled here, where Triton sees their size and passes a stride
    past 2**31 as a 64-bit integer, so that the kernels keep 32-bit strides
    otherwise."""
    sb, st, sh, sw, sn = x.stride()[:5]
    return (sb, st * dilation[0], sh * dilation[1], sw * dilation[2], sn)


def na3d_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel_size: Sequence[int],
    scale: float,
    return_lse: bool = False,
    out: Optional[torch.Tensor] = None,
    config: Optional[configs.ForwardConfig] = None,
    is_causal: Sequence[bool] = (False, False, False),
    stride: Sequence[int] = (1, 1, 1),
    assume_finite: bool = False,
    dilation: Sequence[int] = (1, 1, 1),
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run the forward kernel on validated ``(B, T, H, W, NH, HD)`` inputs.

    ``is_causal`` (per axis T, H, W) selects causal windows along that axis;
    ``stride`` NATTEN's window-sharing stride per axis; ``dilation`` NATTEN's
    dilation per axis (every dilation group in the one launch; key and value boxes
    go through descriptors only where :func:`foldable` allows). Unless
    ``assume_finite`` (inputs known to be finite), the kernel checks its tiles and
    a second launch recomputes those holding an inf or NaN so that it stays inside
    its windows (:func:`launch_and_redo`).

    ``out`` (optional, any strides with innermost stride 1) receives the result; the
    tests pass a NaN-filled one so that an element the kernel never writes shows.
    Returns ``(out, lse)``, ``lse`` float32 ``(B, T, H, W, NH)`` with ``return_lse``,
    else None.
    """
    from .kernels.forward import na3d_fwd_kernel

    B, T, H, W, NH, HD = q.shape
    KT, KH, KW = kernel_size
    group = NH // k.shape[4]  # query heads per key/value head
    cfg = config or forward_config(q, kernel_size, dilation, stride, is_causal)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((B, T, H, W, NH), dtype=torch.float32, device=q.device) if return_lse else None
    tiles_h, tiles_w, n_tiles = tile_grid((T, H, W), cfg.q_tile, dilation)
    flags = nonfinite_flags(n_tiles * NH * B, q.device)
    use_tma = cfg.tma and tma_layout_ok(k, v, dilation=dilation)
    descs = [tensor_descriptor(x, cfg.kv_tile, dilation) for x in (k, v)] if use_tma else [k, v]
    args = (q, k, v, out, lse if lse is not None else out, *descs, flags,
            *(group_strides(x, dilation) for x in (q, k, v, out)),
            T, H, W, KT, KH, KW, *stride, tiles_h, tiles_w, n_tiles, NH, flags.numel(),
            scale * LOG2_E)
    constexprs = dict(
        HEAD_DIM=HD,
        BLOCK_D=max(16, triton_next_power_of_2(HD)),
        Q_T=cfg.q_tile[0], Q_H=cfg.q_tile[1], Q_W=cfg.q_tile[2],
        KV_T=cfg.kv_tile[0], KV_H=cfg.kv_tile[1], KV_W=cfg.kv_tile[2],
        CAUSAL_T=bool(is_causal[0]), CAUSAL_H=bool(is_causal[1]), CAUSAL_W=bool(is_causal[2]),
        STRIDED=any(s != 1 for s in stride),
        RETURN_LSE=return_lse,
        SCALE_SIGN=(scale > 0) - (scale < 0),
        USE_TMA=use_tma,
        GROUP=group,
        **dilation_constexprs(dilation),
        **mask_modes(cfg.q_tile, cfg.kv_tile, kernel_size, is_causal, stride, cfg.fixed_mask,
                     group_grid((T, H, W), dilation),
                     block_sparse_axes(cfg.q_tile, cfg.kv_tile, kernel_size, is_causal, stride, (T, H, W), dilation)),
        SPLIT_FULL=split_full(cfg.split_full, group_grid((T, H, W), dilation), kernel_size, cfg.q_tile, cfg.kv_tile,
                              is_causal, stride))
    slots = sm90_block_sparse_slots(q, k, v, cfg, constexprs, scale, is_causal, dilation)
    # Where the Gluon kernel takes the call it is the fast pass, and the portable
    # kernel's second launch redoes the tiles it flagged.
    gluon = None if slots is None else functools.partial(
        sm90_block_sparse_forward, q, k, v, out, lse, flags, slots, cfg.q_tile, cfg.kv_tile, kernel_size, stride,
        scale, assume_finite)
    launch_and_redo(na3d_fwd_kernel, (n_tiles * group, NH // group, B), args, constexprs, flags, cfg.num_warps,
                    cfg.num_stages, cfg.maxnreg, assume_finite, cfg.redo_in_program, fast_pass=gluon)
    return out, lse


def sm90_block_sparse_slots(q, k, v, cfg: configs.ForwardConfig, constexprs: dict, scale: float,
                            is_causal: Sequence[bool], dilation: Sequence[int]) -> Optional[int]:
    """The slots of the Gluon sm90 forward (``kernels/sm90_forward.py``) where the call
    runs it, else None (the portable kernel). It runs where the config asks for it
    (``ForwardConfig.sm90_gluon``, a table's strided entry) and the call is inside its
    limits: an sm90 GPU (not the interpreter), 16-bit inputs that tensor descriptors
    can read, head dim 64 or 128, a positive scale, no causal axis, no dilation,
    128-query boxes and no mask on any axis (``constexprs``: the launch's mask modes;
    every pair of the config's boxes full). Its boxes are the config's."""
    if cfg.sm90_gluon is None or kernels_interpreted() or device_arch(q.device) != "sm90":
        return None
    if (q.shape[-1] not in (64, 128) or not scale > 0 or any(is_causal) or any(d != 1 for d in dilation)
            or math.prod(cfg.q_tile) != 128 or any(constexprs[f"MASK_{a}"] != MASK_NONE for a in "THW")
            or not tma_layout_ok(q, k, v)):
        return None
    return cfg.sm90_gluon


def sm90_block_sparse_forward(q, k, v, out, lse, flags, stages: int, q_box, kv_box, kernel_size, stride,
                              scale: float, assume_finite: bool, **switches) -> None:
    """Launch the Gluon sm90 forward (:func:`sm90_block_sparse_slots` said it may) with
    ``stages`` slots; unless ``assume_finite``, it sets ``flags`` (zeroed here) for the
    portable kernel's second launch. ``switches``: the kernel's measurement switches
    (``OVERLAP``, ``PINGPONG``; ``benchmarks/sm90_gluon_probe.py``)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .kernels.sm90_forward import na3d_fwd_sm90_kernel

    B, T, H, W, NH, HD = q.shape
    element = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16

    def descriptor(x, box):
        block = [1, *box, HD]
        return TensorDescriptor(x, *descriptor_view([B, T, H, W, x.shape[4] * HD], x.stride()[:4]), block,
                                gl.NVMMASharedLayout.get_default_for(block, element))

    if not assume_finite:
        flags.zero_()
    tiles = [-(-n // b) for n, b in zip((T, H, W), q_box)]
    na3d_fwd_sm90_kernel[(math.prod(tiles), NH, B)](
        descriptor(q, q_box), descriptor(k, kv_box), descriptor(v, kv_box), out, lse if lse is not None else out,
        flags, tuple(out.stride()[:5]), T, H, W, *kernel_size, *stride, tiles[1], tiles[2], NH, scale * LOG2_E,
        tuple(q_box), tuple(kv_box), NH // k.shape[4], HD, stages, lse is not None, assume_finite, num_warps=4,
        **switches)


def launch_and_redo(kernel, grid, args, constexprs: dict, flags: torch.Tensor, num_warps: int, num_stages: int,
                    maxnreg: Optional[int], assume_finite: bool, in_program: bool = False,
                    fast_pass: Optional[Callable[[], None]] = None) -> None:
    """Every kernel's two launches (``kernels/programs.py``, ``run_programs``): on
    ``grid`` the fast way, each program setting its entry of ``flags`` where its
    results hold an inf or NaN; then, on :func:`safe_grid`, ``REDO``: the flagged
    programs again, the safe way, on the same warps (so that its products are the
    first launch's, tile for tile) and one pipeline stage. ``assume_finite``: the
    first launch only, without the check. ``in_program`` (a config's
    ``redo_in_program``): one launch, each program computing its own tile again the
    safe way where it holds an inf or NaN (``REDO_IN_PROGRAM``); the flags are then
    never read.

    Where the GPU can (``device.dependent_launch``: Hopper and later) and its table
    says so (``configs.dependent_second_launch``), the second launch is a
    programmatic dependent launch: it starts while the first one's last programs
    run and waits in the kernel for their results, so that on finite inputs its
    cost is a flag read rather than a launch after the first one
    (``kernels/programs.py``). Elsewhere, and in the interpreter, the two launch in
    order.

    ``fast_pass`` (optional): another kernel's launch as the first pass (the Gluon sm90
    forward, which sets the same flags); the second launch is then in order, never in
    the program or dependent."""
    # (cached answers first: this runs on every launch)
    in_program = in_program and not assume_finite and fast_pass is None
    pdl = (not assume_finite and not in_program and fast_pass is None and dependent_launch(flags.device)
           and configs.dependent_second_launch(device_arch(flags.device)) and not kernels_interpreted())
    if fast_pass is not None:
        fast_pass()
    else:
        kernel[grid](*args, **constexprs, ASSUME_FINITE=assume_finite, REDO=False, PDL=pdl, num_warps=num_warps,
                     num_stages=num_stages, REDO_IN_PROGRAM=in_program, **configs.maxnreg_option(maxnreg))
    if not assume_finite and not in_program:
        kernel[safe_grid(flags)](*args, **constexprs, ASSUME_FINITE=False, REDO=True, PDL=pdl, num_warps=num_warps,
                                 num_stages=1, **({"launch_pdl": True} if pdl else {}))


def mask_modes(box: Sequence[int], scanned_box: Sequence[int], kernel_size: Sequence[int],
               is_causal: Sequence[bool], stride: Sequence[int], enabled: bool = True,
               lengths: Optional[Sequence[int]] = None,
               full_axes: Sequence[bool] = (False, False, False)) -> dict:
    """``MASK_T/H/W`` for a kernel whose programs own ``box`` and scan ``scanned_box``.

    ``MASK_NONE`` along the ``full_axes`` (:func:`block_sparse_axes`), where every
    (box, scanned box) pair of every program is full: nothing there is masked. With
    all three axes full the kernel's loop has no mask at all, whatever ``enabled``
    says; with some, they count as a fixed axis below (their part of the mask is
    nothing).

    ``MASK_FIXED`` along an axis where every program's union of windows fits one
    scanned box, whatever the grid (``geometry.union_width_bound``): the kernel
    computes that part of the mask once and the QK^T product adds it. If some axis
    is fixed, the others take ``MASK_BITS`` where the union fits the 31 bits of a
    per-query window mask, else ``MASK_PER_STEP``. With no fixed axis, or not
    ``enabled`` (the config's ``fixed_mask``), every axis is ``MASK_PER_STEP`` and the
    kernel masks the scores on every step.

    ``lengths``: the grid's ``(T, H, W)``. An axis no longer than the scanned box is
    fixed too, whatever the bound: every union lies inside the axis (a box that
    spans a whole 16-frame clip, scanning 16-frame key boxes). Otherwise the choice
    depends on the boxes, kernel, causality and stride only: a new grid size
    compiles a new kernel variant only where an axis crosses the scanned box's size.
    """
    bounds = [geometry.union_width_bound(b, k, bool(c), s)
              for b, k, c, s in zip(box, kernel_size, is_causal, stride)]
    fixed = [bound <= n for bound, n in zip(bounds, scanned_box)]
    if lengths is not None:
        fixed = [f or length <= n for f, length, n in zip(fixed, lengths, scanned_box)]
    if all(full_axes):
        modes = [MASK_NONE] * 3
    elif not enabled or not any(fixed) and not any(full_axes):
        modes = [MASK_PER_STEP] * 3
    else:
        modes = [MASK_NONE if full else MASK_FIXED if f else MASK_BITS if bound <= 31 else MASK_PER_STEP
                 for full, f, bound in zip(full_axes, fixed, bounds)]
    return {f"MASK_{axis}": mode for axis, mode in zip("THW", modes)}


def block_sparse_axes(box: Sequence[int], scanned_box: Sequence[int], kernel_size: Sequence[int],
                      is_causal: Sequence[bool], stride: Sequence[int], spatial: Sequence[int],
                      dilation: Sequence[int], own: str = "queries") -> Tuple[bool, bool, bool]:
    """Per axis, whether a kernel whose programs own ``box`` and scan ``scanned_box``
    (``own``: ``"queries"`` for the forward and dQ, ``"keys"`` for dK/dV) sees only
    full box pairs along it on the grid ``spatial`` (``geometry.block_sparse_axis``,
    on the length of every dilation group: the kernels run each group at dilation 1
    in its own coordinates). Exact for the call's grid, so the kernel may drop that
    axis' mask (:func:`mask_modes`)."""
    return tuple(_block_sparse_axis(tuple(sorted({-(-(L - g) // d) for g in range(d)})), K, b, n, bool(c), s, own)
                 for L, d, K, b, n, c, s in zip(spatial, dilation, kernel_size, box, scanned_box, is_causal, stride))


@functools.lru_cache(maxsize=4096)
def _block_sparse_axis(lengths, kernel_size, box, scanned_box, is_causal, stride, own):
    # (Memoized: the test walks every box of the axis, and a call should pay for it once.)
    return geometry.block_sparse_axis(lengths, kernel_size, box, scanned_box, is_causal, stride, own)


def split_full(min_share: Optional[float], spatial: Sequence[int], kernel_size: Sequence[int], box: Sequence[int],
               scanned_box: Sequence[int], is_causal: Sequence[bool], stride: Sequence[int],
               own: str = "queries") -> bool:
    """Whether a kernel whose programs own ``box`` and scan ``scanned_box`` on the grid
    ``spatial`` (a dilation group's; ``own``: as in :func:`block_sparse_axes`) splits
    its scan into full boxes and masked ones (``SPLIT_FULL``): where the config asks
    for it (``min_share``, not None) and at least that share of the products lies in
    full box pairs."""
    return min_share is not None and _full_share(tuple(spatial), tuple(kernel_size), tuple(box), tuple(scanned_box),
                                                 tuple(bool(c) for c in is_causal), tuple(stride), own) >= min_share


@functools.lru_cache(maxsize=4096)
def _full_share(spatial, kernel_size, box, scanned_box, is_causal, stride, own):
    # (Memoized as _block_sparse_axis: the count walks every box of each axis.)
    return geometry.full_products_share(spatial, kernel_size, box, scanned_box, is_causal, stride, own)


def nonfinite_flags(n_programs: int, device: torch.device) -> torch.Tensor:
    """One int8 per program of a kernel, which the kernel sets to 1 where its results
    hold an inf or NaN (every program writes its own: no zeroing needed)."""
    return torch.empty(n_programs, dtype=torch.int8, device=device)


def safe_grid(flags: torch.Tensor) -> Tuple[int]:
    """Programs of a kernel's second launch (kernels/programs.py): enough to read the
    flags in a few loads each (``FLAG_BLOCK`` a load), at most one per SM."""
    return (max(1, min(math.ceil(flags.numel() / FLAG_BLOCK), sm_count(flags.device))),)


def tma_layout_ok(*tensors: torch.Tensor, dilation: Sequence[int] = (1, 1, 1)) -> bool:
    """Can the kernels read these ``(B, T, H, W, NH, HD)`` tensors through tensor
    descriptors over ``(B, T, H, W, NH * HD)``? Needs a 16-bit dtype, a power-of-two
    head dim of 16..128, the heads of a position packed (head stride = HD), 16-byte
    aligned base and strides, and an NVIDIA GPU of compute capability 9.0 or newer
    (or the Triton interpreter, which emulates the descriptors). With dilation,
    also what :func:`tensor_descriptor` folds needs: every dilated axis a multiple
    of its dilation, and packed inside the next outer axis. Anything else (AMD,
    older GPUs, padded or odd strides) loads through pointers."""
    if not all(foldable(x.shape[1:4], x.stride()[1:4], x.shape[4] * x.shape[5], dilation) for x in tensors):
        return False
    interpreted = kernels_interpreted()
    if torch.version.hip is not None and not interpreted:
        return False
    for x in tensors:
        if x.dtype not in (torch.float16, torch.bfloat16) or (not x.is_cuda and not interpreted):
            return False
        HD = x.shape[-1]
        if HD not in (16, 32, 64, 128) or x.stride(-1) != 1 or x.stride(-2) != HD:
            return False
        if x.data_ptr() % 16 or any(st % 8 or (st <= 0 and n > 1) for st, n in zip(x.stride()[:4], x.shape)):
            return False
    return interpreted or torch.cuda.get_device_capability(tensors[0].device)[0] >= 9


def tensor_descriptor(x: torch.Tensor, box: Sequence[int], dilation: Sequence[int] = (1, 1, 1)):
    """A tensor descriptor over ``x`` as ``(B, T, H, W, NH * HD)``, loading one head's
    ``box`` of positions: block ``(1, *box, HD)``; with dilation, over one dilation
    group's positions (:func:`box_descriptor`)."""
    B, T, H, W, NH, HD = x.shape
    return box_descriptor(x, [B, T, H, W, NH * HD], x.stride()[:4], [1, *box, HD], dilation)


def foldable(lengths: Sequence[int], strides: Sequence[int], channels: int, dilation: Sequence[int]) -> bool:
    """Can :func:`box_descriptor` fold the dilation groups of a tensor with these T,
    H, W ``lengths`` and ``strides`` and ``channels`` elements per position? Each
    dilated axis must be a multiple of its dilation (every group as long, so that
    no box of a group reads past the tensor) and packed inside the next outer axis
    (W: stride = channels; H: stride = W's stride x W; T: stride = H's x H)."""
    inner = [strides[1] * lengths[1], strides[2] * lengths[2], channels]  # what T, H, W's strides must be
    return all(d == 1 or (L % d == 0 and st == want) for L, st, want, d in zip(lengths, strides, inner, dilation))


def box_descriptor(base: torch.Tensor, sizes: Sequence[int], strides: Sequence[int], block: Sequence[int],
                   dilation: Sequence[int]):
    """A tensor descriptor over ``base`` as ``(B, T, H, W, C)`` (``sizes``; ``strides``:
    B, T, H, W's, C's is 1), block ``block``. With dilation ``(dt, dh, dw)`` it is a
    view of all dilation groups at once, still 5-D: ``(B, T / dt, dt * H / dh,
    dh * W / dw, dw * C)`` with strides ``(sB, dt * sT, dh * sH, dw * sW, 1)``. Each
    group index is folded into the next inner axis, where a packed layout puts it
    (:func:`foldable`): group ``(gt, gh, gw)``'s box at ``(t, h, w)``, channel ``c``
    is at ``(t, gt * H / dh + h, gh * W / dw + w, gw * C + c)``
    (``kernels/groups.py``, ``descriptor_origin``). For a packed tensor this is a
    reshape, ``(B, T/dt, [dt, H/dh], [dh, W/dw], [dw, C])``: no two coordinates
    address one element. A box running past its group along the H axis (when T is
    dilated) or the W axis (when H is) reads the next group's positions, which the
    kernels mask; elsewhere, and past the tensor, it reads zeros. At dilation 1,
    the tensor as it is."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(base, *descriptor_view(sizes, strides, dilation), list(block))


def descriptor_view(sizes: Sequence[int], strides: Sequence[int], dilation: Sequence[int] = (1, 1, 1)):
    """The ``(sizes, strides)`` of :func:`box_descriptor`'s 5-D view (for Triton's and
    Gluon's descriptors alike)."""
    B, T, H, W, C = sizes
    dt, dh, dw = dilation
    sizes = [B, T // dt, dt * (H // dh), dh * (W // dw), dw * C]
    strides = [strides[0], dt * strides[1], dh * strides[2], dw * strides[3], 1]
    for i in range(3, -1, -1):  # a size-1 axis may carry any stride: give it a valid one
        if sizes[i] == 1:
            strides[i] = strides[i + 1] * sizes[i + 1]
    return sizes, strides


def na3d_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    kernel_size: Sequence[int],
    scale: float,
    grad_lse: Optional[torch.Tensor] = None,
    grads: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    config: Optional[configs.BackwardConfig] = None,
    is_causal: Sequence[bool] = (False, False, False),
    stride: Sequence[int] = (1, 1, 1),
    assume_finite: bool = False,
    dilation: Sequence[int] = (1, 1, 1),
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv from the forward's ``out`` and natural-log ``lse`` (float32, contiguous).

    ``grad_lse`` (optional, ``lse``'s shape) is the gradient flowing into the
    log-sum-exp when the forward returned it. ``grads`` (optional) receives the
    results (the tests pass NaN-filled buffers).

    The config's ``fused`` flag picks the kernels (see ``kernels/backward.py``):
    deterministic, two launches (dQ, which also writes the per-query statistics: lse
    and ``delta = rowsum(dO * O) - dlse``, then dK/dV); or fused, the statistics
    then one pass that adds dQ atomically into a float32 buffer. Under
    ``torch.use_deterministic_algorithms(True)`` the deterministic kernels run
    whatever the config says. ``assume_finite``, ``dilation``: as in
    :func:`na3d_forward`.
    """
    from .kernels.backward import na3d_bwd_dkdv_kernel, na3d_bwd_dq_kernel

    B, T, H, W, NH, HD = q.shape
    KT, KH, KW = kernel_size
    group = NH // k.shape[4]  # query heads per key/value head
    cfg = config or backward_config(q, kernel_size, dilation, stride, is_causal)
    if grads is None:
        grads = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    dq, dk, dv = grads
    if grad_out.stride(-1) != 1:  # e.g. the expanded ones of out.sum().backward()
        grad_out = grad_out.contiguous()
    if lse.shape != q.shape[:-1] or (grad_lse is not None and grad_lse.shape != lse.shape):
        raise ValueError(f"lse must have shape {tuple(q.shape[:-1])} (and grad_lse the same); got "
                         f"lse {tuple(lse.shape)}, grad_lse {None if grad_lse is None else tuple(grad_lse.shape)}")
    lse = lse.contiguous()
    stats = statistics_buffer(q)
    grad_lse = grad_lse.contiguous().float() if grad_lse is not None else None
    common = dict(HEAD_DIM=HD, BLOCK_D=max(16, triton_next_power_of_2(HD)),
                  CAUSAL_T=bool(is_causal[0]), CAUSAL_H=bool(is_causal[1]), CAUSAL_W=bool(is_causal[2]),
                  STRIDED=any(s != 1 for s in stride), GROUP=group, **dilation_constexprs(dilation))

    if cfg.fused and not torch.are_deterministic_algorithms_enabled():
        _fused_backward(q, k, v, out, grad_out, lse, grad_lse, stats, grads, kernel_size, stride, dilation, scale,
                        cfg, common, assume_finite)
        return dq, dk, dv
    tiles_h, tiles_w, n_tiles = tile_grid((T, H, W), cfg.dq_q_tile, dilation)
    flags = nonfinite_flags(n_tiles * NH * B, q.device)
    use_tma = cfg.tma and tma_layout_ok(k, v, dilation=dilation)
    descs = [tensor_descriptor(x, cfg.dq_kv_tile, dilation) for x in (k, v)] if use_tma else [k, v]
    args = (q, k, v, out, grad_out, lse, grad_lse if grad_lse is not None else lse, stats, dq, *descs, flags,
            *(group_strides(x, dilation) for x in (q, k, v, out, grad_out, dq)),
            T, H, W, KT, KH, KW, *stride, tiles_h, tiles_w, n_tiles, NH, flags.numel(), scale * LOG2_E, scale)
    constexprs = dict(
        Q_T=cfg.dq_q_tile[0], Q_H=cfg.dq_q_tile[1], Q_W=cfg.dq_q_tile[2],
        KV_T=cfg.dq_kv_tile[0], KV_H=cfg.dq_kv_tile[1], KV_W=cfg.dq_kv_tile[2],
        HAS_DLSE=grad_lse is not None, USE_TMA=use_tma,
        # A masked score must scale to -inf: the mask on the product only for a positive scale.
        **mask_modes(cfg.dq_q_tile, cfg.dq_kv_tile, kernel_size, is_causal, stride, cfg.fixed_mask and scale > 0,
                     group_grid((T, H, W), dilation),
                     block_sparse_axes(cfg.dq_q_tile, cfg.dq_kv_tile, kernel_size, is_causal, stride, (T, H, W),
                                       dilation)),
        SPLIT_FULL=split_full(cfg.split_full, group_grid((T, H, W), dilation), kernel_size, cfg.dq_q_tile,
                              cfg.dq_kv_tile, is_causal, stride), **common)
    launch_and_redo(na3d_bwd_dq_kernel, (n_tiles * group, NH // group, B), args, constexprs, flags, cfg.num_warps,
                    cfg.num_stages, cfg.dq_maxnreg, assume_finite, cfg.redo_in_program)

    use_tma = cfg.tma and tma_layout_ok(q, grad_out, dilation=dilation)
    descs = [tensor_descriptor(x, cfg.dkdv_q_tile, dilation) for x in (q, grad_out)] if use_tma else [q, grad_out]
    split = math.gcd(cfg.dkdv_head_split, group) if k.shape[4] == 1 else 1
    if split > 1:
        # MQA: ``split`` programs per key box, each over group // split query heads. The
        # kernel sees ``split`` key/value heads, the one head repeated (a stride-0 view),
        # and writes each program's partial dK/dV in float32; their sum is the result.
        k_heads, v_heads = (x.expand(B, T, H, W, split, HD) for x in (k, v))
        dk_parts, dv_parts = (torch.empty((B, T, H, W, split, HD), dtype=torch.float32, device=q.device)
                              for _ in range(2))
        common = dict(common, GROUP=group // split)
    else:
        k_heads, v_heads, dk_parts, dv_parts = k, v, dk, dv
    dkdv_launch(na3d_bwd_dkdv_kernel, tile_grid((T, H, W), cfg.dkdv_k_tile, dilation), NH, B, cfg,
                (q, k_heads, v_heads, grad_out, stats, dk_parts, dv_parts, dq, *descs, dq,  # dq: unused here
                 statistics_descriptor(stats, cfg.dkdv_q_tile, dilation) if use_tma else stats),
                (q, k_heads, v_heads, grad_out, dk_parts, dv_parts), (T, H, W, KT, KH, KW, *stride), scale,
                dict(ACCUMULATE_DQ=False, USE_TMA=use_tma, BULK_DQ=False, **common), assume_finite)
    if split > 1:
        dk.copy_(dk_parts.sum(4, keepdim=True))
        dv.copy_(dv_parts.sum(4, keepdim=True))
    return dq, dk, dv


def dkdv_launch(kernel, tiles, NH: int, B: int, cfg: configs.BackwardConfig, buffers, strided,
                sizes, scale: float, constexprs: dict, assume_finite: bool) -> None:
    """The dK/dV kernel's two launches (:func:`launch_and_redo`).
    ``tiles``: :func:`tile_grid` of the key boxes. ``NH``: query heads; the grid runs
    over key/value heads, ``NH // GROUP`` (``constexprs``). ``buffers``: the tensors
    and descriptors before the flags; ``strided``: the tensors whose strides follow
    (q, k, v, dO, dK, dV); ``sizes``: the grid and window sizes (T, H, W, KT, KH, KW,
    ST, SH, SW)."""
    tiles_h, tiles_w, n_tiles = tiles
    kv_heads = NH // constexprs["GROUP"]
    flags = nonfinite_flags(n_tiles * kv_heads * B, strided[0].device)
    dilation = [constexprs[f"DIL_{axis}"] for axis in "THW"]
    args = (*buffers, flags, *(group_strides(x, dilation) for x in strided), *sizes, tiles_h, tiles_w, n_tiles,
            NH, flags.numel(), scale * LOG2_E, scale)
    # No mask in the loop where every (key box, query box) pair is full; the fused
    # backward keeps its mask (keys past the grid must not reach dQ).
    T, H, W, KT, KH, KW, ST, SH, SW = sizes
    causal = [constexprs[f"CAUSAL_{axis}"] for axis in "THW"]
    full = not constexprs["ACCUMULATE_DQ"] and all(block_sparse_axes(
        cfg.dkdv_k_tile, cfg.dkdv_q_tile, (KT, KH, KW), causal, (ST, SH, SW), (T, H, W), dilation, own="keys"))
    constexprs = dict(constexprs, K_T=cfg.dkdv_k_tile[0], K_H=cfg.dkdv_k_tile[1], K_W=cfg.dkdv_k_tile[2],
                      Q_T=cfg.dkdv_q_tile[0], Q_H=cfg.dkdv_q_tile[1], Q_W=cfg.dkdv_q_tile[2],
                      **{f"MASK_{axis}": MASK_NONE if full else MASK_PER_STEP for axis in "THW"},
                      SPLIT_FULL=not full and split_full(cfg.dkdv_split_full, group_grid((T, H, W), dilation),
                                                         (KT, KH, KW), cfg.dkdv_k_tile, cfg.dkdv_q_tile, causal,
                                                         (ST, SH, SW), own="keys"))
    launch_and_redo(kernel, (n_tiles, kv_heads, B), args, constexprs, flags, cfg.dkdv_warps, cfg.dkdv_stages,
                    cfg.dkdv_maxnreg, assume_finite, cfg.dkdv_redo_in_program)


def statistics_buffer(q: torch.Tensor) -> torch.Tensor:
    """The backward's per-query statistics (``kernels/backward.py``): float32
    ``(B, NH, T, H, W, 4)``, lse in log2 units and delta, 16 bytes per position (the
    innermost extent a tensor descriptor reads at least)."""
    B, T, H, W, NH, _ = q.shape
    return torch.empty((B, NH, T, H, W, 4), dtype=torch.float32, device=q.device)


def statistics_descriptor(stats: torch.Tensor, q_box: Sequence[int], dilation: Sequence[int] = (1, 1, 1)):
    """``stats`` as ``(B NH, T, H, W, 4)``, block ``(1, *q_box, 4)`` (with dilation: as
    :func:`box_descriptor` folds it)."""
    B, NH, T, H, W, _ = stats.shape
    return box_descriptor(stats, [B * NH, T, H, W, 4], [T * H * W * 4, H * W * 4, W * 4, 4], [1, *q_box, 4],
                          dilation)


def _fused_backward(q, k, v, out, grad_out, lse, grad_lse, stats, grads, kernel_size, stride, dilation, scale, cfg,
                    common, assume_finite):
    """``stats``, then one pass over key boxes: dK/dV stored, dQ added atomically into a
    zeroed float32 buffer ``(B, T, H, W, NH, BLOCK_D)``, scaled and cast at the end."""
    from triton.runtime.errors import OutOfResources

    from .kernels.backward import na3d_bwd_delta_kernel, na3d_bwd_dkdv_kernel

    B, T, H, W, NH, HD = q.shape
    KT, KH, KW = kernel_size
    dq, dk, dv = grads
    # The statistics of every position, in full-grid order whatever the dilation.
    tiles_h, tiles_w, n_tiles = tile_grid((T, H, W), cfg.dq_q_tile, (1, 1, 1))
    na3d_bwd_delta_kernel[(n_tiles, NH, B)](
        out, grad_out, lse, grad_lse if grad_lse is not None else lse, stats,
        out.stride()[:5], grad_out.stride()[:5], T, H, W, tiles_h, tiles_w,
        HEAD_DIM=HD, BLOCK_D=common["BLOCK_D"], Q_T=cfg.dq_q_tile[0], Q_H=cfg.dq_q_tile[1], Q_W=cfg.dq_q_tile[2],
        HAS_DLSE=grad_lse is not None, num_warps=4, num_stages=1)
    dq_acc = torch.zeros((B, T, H, W, NH, common["BLOCK_D"]), dtype=torch.float32, device=q.device)
    use_tma = cfg.tma and tma_layout_ok(q, grad_out, dilation=dilation)
    # The interpreter has no bulk reductions: it adds dQ per element.
    bulk_dq = use_tma and not kernels_interpreted()
    descs = ([tensor_descriptor(x, cfg.dkdv_q_tile, dilation) for x in (q, grad_out)] if use_tma else [q, grad_out])
    descs.append(tensor_descriptor(dq_acc, cfg.dkdv_q_tile, dilation) if bulk_dq else dq_acc)
    descs.append(statistics_descriptor(stats, cfg.dkdv_q_tile, dilation) if use_tma else stats)
    # The one-pass dK/dV kernel also stages dQ for its bulk adds, so a config's
    # dK/dV stages may ask more shared memory than the GPU has where the two-kernel
    # backward's fit (head dim 128, 128-key boxes at two stages: 246824 bytes against
    # an H100's 232448). It then runs with fewer stages, found once per config by
    # compiling (a launch that does not fit fails before it runs).
    key = (cfg, HD, q.dtype, q.device)
    stages = _FUSED_DKDV_STAGES.get(key, cfg.dkdv_stages)
    while True:
        try:
            dkdv_launch(na3d_bwd_dkdv_kernel, tile_grid((T, H, W), cfg.dkdv_k_tile, dilation), NH, B,
                        dataclasses.replace(cfg, dkdv_num_stages=stages),
                        (q, k, v, grad_out, stats, dk, dv, dq_acc, *descs), (q, k, v, grad_out, dk, dv),
                        (T, H, W, KT, KH, KW, *stride), scale,
                        dict(ACCUMULATE_DQ=True, USE_TMA=use_tma, BULK_DQ=bulk_dq, **common), assume_finite)
            break
        except OutOfResources:
            if stages <= 1:
                raise
            stages -= 1
            dq_acc.zero_()  # (a failing second launch comes after the first one's dQ terms)
    _FUSED_DKDV_STAGES[key] = stages
    dq.copy_(dq_acc[..., :HD].mul_(scale))


# Stages the one-pass dK/dV kernel runs with, per (config, head dim, dtype, device),
# where the config's own did not fit shared memory (:func:`_fused_backward`).
_FUSED_DKDV_STAGES: dict = {}


def triton_next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()
