"""Exact PyTorch references for 3D neighborhood attention.

Three implementations of the same definition (``geometry.py``), independent of the
Triton kernels:

* :func:`na3d_brute_force`: dense attention with an ``[N, N]`` neighborhood mask,
  in any dtype (float64 for an oracle, the input dtype for "the same math at that
  precision"). Quadratic in N: tiny shapes only.
* :func:`na3d_sdpa_exact`: queries cut into boxes whose windows share one relative
  geometry; per box, the union of the windows is sliced out of K/V and one
  ``F.scaled_dot_product_attention`` call with a boolean mask does the work. Its
  extra memory stays under ``memory_budget`` for any shape. This is what CPU users
  get when the Triton interpreter is not active, and what the GPU tests and the
  benchmark compare against.

* :func:`na3d_windowed`: every query attends to exactly the keys of its window,
  gathered (no mask, no product with any other key), so an inf or NaN in an input
  reaches exactly the outputs and gradients whose windows hold it, as IEEE
  arithmetic over the window gives them. The oracle for non-finite inputs; tiny
  shapes only.

All take ``(B, T, H, W, NH, HD)`` tensors ("heads last") and differentiate
through autograd.
"""

import functools
import itertools
import math
from typing import Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from . import geometry

Triple = Tuple[int, int, int]


def na3d_brute_force(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel_size: Sequence[int],
    scale: Optional[float] = None,
    dilation: Sequence[int] = (1, 1, 1),
    is_causal: Sequence[bool] = (False, False, False),
    compute_dtype: Optional[torch.dtype] = torch.float64,
    return_lse: bool = False,
    stride: Sequence[int] = (1, 1, 1),
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Dense masked attention over the whole grid: the oracle the tests compare against.

    Builds the ``[N, N]`` neighborhood mask of :mod:`na3d.geometry` (``N = T * H *
    W``): quadratic in ``N``, for tiny shapes only. No argument checks: pass what
    :func:`na3d.na3d` would accept.

    Args:
        q: ``(B, T, H, W, NH, HD)``, any floating dtype (float64 included), any device.
        k: ``(B, T, H, W, NKV, HD)``, ``NKV`` dividing ``NH`` (repeated per group).
        v: k's shape.
        kernel_size: ``(KT, KH, KW)``, each ``K * dilation <= size``.
        scale: ``None`` for ``HD ** -0.5``.
        dilation: ``(dT, dH, dW)``, each ``>= 1``.
        is_causal: three bools, ``(T, H, W)`` order.
        compute_dtype: the dtype of the arithmetic (default float64, the oracle);
            ``None`` keeps q's dtype ("the same math at that precision").
        return_lse: also return the natural-log log-sum-exp.
        stride: ``(sT, sH, sW)``, each ``1 <= s <= K``.

    Returns:
        The output in q's dtype; with ``return_lse``, ``(out, lse)``, ``lse``
        ``(B, T, H, W, NH)`` in float32 (float64 when ``compute_dtype`` is).
        Differentiable through autograd.

    Devices: runs wherever q is (plain PyTorch). Non-finite inputs: keys outside a
    query's window are masked before the softmax, but the dense product multiplies
    every value by its probability, zero or not, so an inf or NaN value anywhere in
    the grid makes outputs NaN: give it finite inputs (na3d's own behaviour: the
    README's "non-finite inputs" row).

    Example:
        >>> import torch, na3d
        >>> q, k, v = (torch.randn(1, 4, 6, 8, 2, 16) for _ in range(3))
        >>> oracle = na3d.na3d_brute_force(q, k, v, (3, 3, 5))
        >>> oracle.dtype, (na3d.na3d(q, k, v, (3, 3, 5)).double() - oracle).abs().max().item() < 1e-5
        (torch.float32, True)
    """
    B, T, H, W, NH, HD = q.shape
    n = T * H * W
    cdt = compute_dtype or q.dtype
    scale = HD ** -0.5 if scale is None else scale
    mask = geometry.neighborhood_mask((T, H, W), kernel_size, dilation, is_causal, device=q.device, stride=stride)

    def heads_first(x):
        return x.reshape(B, n, x.shape[-2], x.shape[-1]).transpose(1, 2).to(cdt)

    qf, kf, vf = heads_first(q), heads_first(k), heads_first(v)
    if kf.shape[1] != NH:  # grouped-query attention: repeat K/V heads (reference only)
        kf = kf.repeat_interleave(NH // kf.shape[1], dim=1)
        vf = vf.repeat_interleave(NH // vf.shape[1], dim=1)
    scores = (qf @ kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = (probs @ vf).transpose(1, 2).reshape(B, T, H, W, NH, vf.shape[-1]).to(q.dtype)
    if not return_lse:
        return out
    lse = torch.logsumexp(scores.float() if cdt != torch.float64 else scores, dim=-1)
    return out, lse.transpose(1, 2).reshape(B, T, H, W, NH)


# ----------------------------------------------------------------------------------
# Grouped-SDPA exact reference
# ----------------------------------------------------------------------------------

def _classes_1d(first: int, stop: int, length: int, kernel_size: int,
                is_causal: bool = False, stride: int = 1) -> Tuple[Tuple[int, int], ...]:
    """Split queries ``[first, stop)`` into runs of one window geometry.

    Queries whose window is pinned to a border (start 0 or ``L - K``) all see the same
    keys, so each border run needs exactly ``K`` keys however long it is; interior
    queries each see their own window, their union growing with the run. Causal
    axes: the first ``K - 1`` queries (windows clipped at 0) and the rest. Strided
    axes: one class (the runs' geometries group them).
    """
    if stride != 1:
        return ((first, stop),)
    if is_causal:
        cuts = sorted({first, stop, min(max(kernel_size - 1, first), stop)})
        return tuple((a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a)
    half = kernel_size // 2
    cuts = sorted({first, stop, min(max(half + 1, first), stop),
                   min(max(length - kernel_size + half, first), stop)})
    return tuple((a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a)


def _runs_1d(classes, extent: int, length: int, kernel_size: int, is_causal: bool = False, stride: int = 1):
    """Runs of at most ``extent`` queries inside each class, grouped by geometry.

    Returns ``{geometry: [(first, stop, union_start, union_stop), ...]}`` where the
    geometry (window bounds relative to the union start, and the union length) is
    what a box's mask depends on along this dimension.
    """
    groups: Dict[tuple, list] = {}
    for lo, hi in classes:
        for a in range(lo, hi, extent):
            b = min(a + extent, hi)
            bounds = [geometry.window_bounds(i, length, kernel_size, 1, is_causal, stride) for i in range(a, b)]
            u0, u1 = bounds[0][0], bounds[-1][1]
            geo = tuple((s - u0, e - u0) for s, e in bounds) + (u1 - u0,)
            groups.setdefault(geo, []).append((a, b, u0, u1))
    return groups


@functools.lru_cache(maxsize=4096)
def _max_union_1d(lo: int, hi: int, extent: int, length: int, kernel_size: int, is_causal: bool,
                  stride: int = 1) -> int:
    """Largest union-of-windows length over the runs of ``extent`` queries tiling [lo, hi)."""
    best = 0
    for first in range(lo, hi, extent):
        last = min(first + extent, hi) - 1
        start, stop = geometry.union_of_windows(first, last, length, kernel_size, is_causal, stride)
        best = max(best, stop - start)
    return best


def _box_bytes(nq: int, nk: int, bh: int, head_dim: int, elt: int) -> int:
    """Upper bound on the temporaries of one SDPA call over ``bh`` (batch, head) pairs.

    q/k/v copies of the box, the output box, the mask (boolean, plus an additive
    float copy SDPA may make) and, for the math backend (the CPU's, and the GPU's
    fallback), scores and probabilities at up to float32 width.
    """
    acc = max(elt, 4)
    per_bh = (2 * nq + 2 * nk) * head_dim * elt + 2 * nq * nk * acc
    return bh * per_bh + nq * nk * (1 + elt)


@functools.lru_cache(maxsize=256)
def _plan_tiles(
    classes: Tuple[Tuple[Tuple[int, int], ...], ...],
    shape: Triple,
    kernel_size: Triple,
    batch: int,
    heads: int,
    head_dim: int,
    elt: int,
    memory_budget: int,
    on_gpu: bool,
    is_causal: Tuple[bool, bool, bool] = (False, False, False),
    stride: Triple = (1, 1, 1),
) -> Tuple[Triple, int, int]:
    """Pick query-box extents (t, h, w) and a (batch, head) chunk under the budget.

    Among power-of-two extents per dimension it minimizes an estimate of run time:
    a fixed cost per SDPA call plus the masked pairs it computes (the union of a box
    of queries grows with the box, so larger boxes waste more pairs but make fewer
    calls). Only candidates whose temporaries fit ``memory_budget`` are kept; the
    (batch, head) chunk shrinks if even single queries do not fit. The search space
    is finite, so the planner always ends: with an answer, or a ValueError saying
    the budget is below what one query needs.
    """
    call_cost_s, pair_rate = (30e-6, 4e13) if on_gpu else (20e-6, 2e11)
    spans = [max(b - a for a, b in cls) for cls in classes]
    options = [[1 << e for e in range(0, s.bit_length() + 1) if (1 << e) < 2 * s] for s in spans]
    chunks = [(bsz, heads) for bsz in range(batch, 0, -1) if batch % bsz == 0]
    chunks += [(1, hsz) for hsz in range(heads - 1, 0, -1)]
    n_queries = math.prod(sum(b - a for a, b in cls) for cls in classes)
    for bsz, hsz in chunks:
        best = None
        for ext in itertools.product(*options):
            unions = [
                max(_max_union_1d(a, b, e, L, K, c, st) for a, b in cls)
                for cls, e, L, K, c, st in zip(classes, ext, shape, kernel_size, is_causal, stride)
            ]
            nq, nk = math.prod(ext), math.prod(unions)
            if _box_bytes(nq, nk, bsz * hsz, head_dim, elt) > memory_budget:
                continue
            calls = math.prod(sum(-(-(b - a) // e) for a, b in cls) for cls, e in zip(classes, ext))
            calls *= (batch // bsz) * -(-heads // hsz)
            est = calls * call_cost_s + n_queries * nk * batch * heads * 4 * head_dim / pair_rate
            if best is None or est < best[0]:
                best = (est, ext)
        if best is not None:
            return best[1], bsz, hsz
    need = _box_bytes(1, math.prod(kernel_size), 1, head_dim, elt)
    raise ValueError(
        f"memory_budget={memory_budget} bytes is too small: one query of one head needs "
        f"{need} bytes of temporaries with kernel_size={tuple(kernel_size)}, head_dim={head_dim}"
    )


def _box_mask(runs, shape: Triple, kernel_size: Triple, is_causal, stride, device: torch.device) -> torch.Tensor:
    """Boolean ``[nq, nk]`` mask of a box: the product of its three 1-D band masks.

    Built from device-side aranges (no host-to-device copies, hence no sync).
    """
    full = None
    sizes_q, sizes_k = [], []
    for d, ((a, b, u0, u1), L, K, c, st) in enumerate(zip(runs, shape, kernel_size, is_causal, stride)):
        starts, stops = geometry.window_bounds(torch.arange(a, b, device=device), L, K, 1, c, st)
        key = torch.arange(u0, u1, device=device)
        m = (key[None, :] >= starts[:, None]) & (key[None, :] < stops[:, None])
        view = [1] * 6
        view[d], view[3 + d] = b - a, u1 - u0
        full = m.reshape(view) if full is None else full & m.reshape(view)
        sizes_q.append(b - a)
        sizes_k.append(u1 - u0)
    return full.expand(*sizes_q, *sizes_k).reshape(math.prod(sizes_q), math.prod(sizes_k))


def na3d_sdpa_exact(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel_size: Sequence[int],
    scale: Optional[float] = None,
    w_offset: int = 0,
    memory_budget: int = 1 << 30,
    return_lse: bool = False,
    is_causal: Sequence[bool] = (False, False, False),
    stride: Sequence[int] = (1, 1, 1),
    dilation: Sequence[int] = (1, 1, 1),
    isolate: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact neighborhood attention from grouped ``F.scaled_dot_product_attention`` calls.

    Queries are cut into boxes; per box, the union of their windows is sliced out of
    K/V and one SDPA call with a boolean mask does the work. This is what
    :func:`na3d.na3d` runs on CPU tensors when the Triton interpreter is not active,
    and what the GPU tests and the benchmark compare against. No argument checks:
    pass what :func:`na3d.na3d` would accept.

    Args:
        q: ``(B, T, H, Wq, NH, HD)``: the queries at global W positions
            ``w_offset .. w_offset + Wq - 1`` (``Wq = W`` for the whole grid); any
            floating dtype SDPA takes on q's device.
        k: ``(B, T, H, W, NH, HD)``, the full grid (equal head counts: repeat
            key/value heads for grouped-query attention).
        v: k's shape.
        kernel_size: ``(KT, KH, KW)``, each ``1 <= K <= size``.
        scale: ``None`` for ``HD ** -0.5``.
        w_offset: where q's columns start along W, ``0 <= w_offset <= W - Wq``:
            a W sub-slice of queries gets exactly those rows of the full result.
        memory_budget: bytes the temporaries of any single step (box copies, one
            mask, attention intermediates; see ``_box_bytes``) may take, on top of
            the output.
        return_lse: also return the float32 natural-log log-sum-exp
            ``(B, T, H, Wq, NH)`` (from the box's masked scores, computed once more
            for it).
        is_causal: three bools, ``(T, H, W)`` order.
        stride: ``(sT, sH, sW)``, each ``1 <= s <= K``.
        dilation: ``(dT, dH, dW)``, each ``K * d <= size``: every dilation group
            (positions ``g + d * i``) computed on its own as a strided view, the
            results interleaved back (``w_offset`` must then be 0).
        isolate: one query per SDPA call, whose keys are then exactly its window:
            an inf or NaN input reaches exactly the results whose windows hold it
            (forward and autograd), at the price of a call per query (what
            :func:`na3d.na3d` runs on the CPU when an input is not finite).

    Returns:
        The output ``(B, T, H, Wq, NH, HD)`` in q's dtype, or ``(out, lse)``.
        Differentiable through autograd.

    Raises:
        ValueError: ``w_offset`` places q outside the grid, or ``memory_budget`` is
            below what one query of one head needs.

    Boxes are visited grouped by geometry, so each mask is built once per call and
    only one is alive at a time; nothing is cached across calls. No host-device
    synchronization. Devices: wherever q is. Non-finite inputs: without
    ``isolate``, a key or value inside a box's union of windows but outside a
    query's window can reach that query (its score or weight is masked, but
    ``0 * inf`` and ``NaN - inf`` are NaN); with ``isolate``, none can.

    Example:
        >>> import torch, na3d
        >>> q, k, v = (torch.randn(1, 4, 6, 8, 2, 16) for _ in range(3))
        >>> full = na3d.na3d_sdpa_exact(q, k, v, (3, 3, 5))
        >>> cols = na3d.na3d_sdpa_exact(q[:, :, :, 2:5], k, v, (3, 3, 5), w_offset=2)
        >>> torch.allclose(cols, full[:, :, :, 2:5])
        True
    """
    B, T, H, Wq, NH, HD = q.shape
    W = k.shape[3]
    if not 0 <= w_offset <= W - Wq:
        raise ValueError(f"w_offset={w_offset} must place the {Wq} query columns inside W={W}")
    dilation = tuple(int(d) for d in dilation)
    if dilation != (1, 1, 1):
        if w_offset != 0 or Wq != W:
            raise ValueError(f"dilation={dilation} needs the whole grid of queries (w_offset=0, Wq=W); got "
                             f"w_offset={w_offset}, Wq={Wq}, W={W}")
        return _by_dilation_groups(functools.partial(
            na3d_sdpa_exact, kernel_size=kernel_size, scale=scale, memory_budget=memory_budget, return_lse=return_lse,
            is_causal=is_causal, stride=stride, isolate=isolate), q, k, v, dilation, return_lse)
    scale = HD ** -0.5 if scale is None else scale
    shape = (T, H, W)
    kernel_size = tuple(int(x) for x in kernel_size)
    is_causal = tuple(bool(c) for c in is_causal)
    stride = tuple(int(s) for s in stride)
    q_ranges = [(0, T), (0, H), (w_offset, w_offset + Wq)]
    classes = tuple(_classes_1d(a, b, L, K, c, st)
                    for (a, b), L, K, c, st in zip(q_ranges, shape, kernel_size, is_causal, stride))
    ext, bsz, hsz = _plan_tiles(classes, shape, kernel_size, B, NH, HD, q.element_size(),
                                memory_budget, q.is_cuda, is_causal, stride)
    if isolate:  # (a box of one query: its union of windows is its window)
        ext = (1, 1, 1)
    per_dim = [_runs_1d(cl, e, L, K, c, st)
               for cl, e, L, K, c, st in zip(classes, ext, shape, kernel_size, is_causal, stride)]

    # Without autograd, boxes are written into the output in place. With it, they are
    # kept and joined by one torch.cat per dimension: in-place slice writes would make
    # every box's backward copy the whole output (quadratic in the number of boxes).
    differentiable = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    out = None if differentiable else torch.empty(B, T, H, Wq, NH, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = None if differentiable or not return_lse else torch.empty(B, T, H, Wq, NH, device=q.device)
    pieces: Dict[tuple, torch.Tensor] = {}
    lse_pieces: Dict[tuple, torch.Tensor] = {}
    for groups in itertools.product(*(g.values() for g in per_dim)):
        mask = _box_mask([runs[0] for runs in groups], shape, kernel_size, is_causal, stride, q.device)
        for box in itertools.product(*groups):
            (t0, t1, ut0, ut1), (h0, h1, uh0, uh1), (w0, w1, uw0, uw1) = box
            qw0, qw1 = w0 - w_offset, w1 - w_offset
            nq = (t1 - t0) * (h1 - h0) * (w1 - w0)
            for b0 in range(0, B, bsz):
                for n0 in range(0, NH, hsz):
                    bs, ns = slice(b0, b0 + bsz), slice(n0, n0 + hsz)
                    qb = q[bs, t0:t1, h0:h1, qw0:qw1, ns]
                    kb = k[bs, ut0:ut1, uh0:uh1, uw0:uw1, ns]
                    vb = v[bs, ut0:ut1, uh0:uh1, uw0:uw1, ns]
                    nb, nh = qb.shape[0], qb.shape[4]
                    qb = qb.reshape(nb, nq, nh, HD).transpose(1, 2)
                    kb = kb.reshape(nb, -1, nh, HD).transpose(1, 2)
                    vb = vb.reshape(nb, -1, nh, vb.shape[-1]).transpose(1, 2)
                    ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)
                    ob = ob.transpose(1, 2).reshape(nb, t1 - t0, h1 - h0, w1 - w0, nh, -1)
                    box_key = (b0, n0, t0, h0, qw0)
                    if differentiable:
                        pieces[box_key] = ob
                    else:
                        out[bs, t0:t1, h0:h1, qw0:qw1, ns] = ob
                    if return_lse:
                        scores = (qb.float() @ kb.float().transpose(-1, -2)) * scale
                        lb = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
                        lb = lb.transpose(1, 2).reshape(nb, t1 - t0, h1 - h0, w1 - w0, nh)
                        if differentiable:
                            lse_pieces[box_key] = lb
                        else:
                            lse[bs, t0:t1, h0:h1, qw0:qw1, ns] = lb
        del mask
    if differentiable:
        out = _join_boxes(pieces)
        lse = _join_boxes(lse_pieces) if return_lse else None
    return (out, lse) if return_lse else out


def _by_dilation_groups(attention, q, k, v, dilation: Triple, return_lse: bool):
    """NATTEN's dilation by composition: each axis splits into ``d`` groups by
    ``index % d``; ``attention(q, k, v)`` at dilation 1 runs on each group as a
    strided view (no copy), and the groups' results are interleaved back. A causal
    axis stays causal inside each group, and strides count group positions."""
    pieces = []
    for gt, gh, gw in itertools.product(*(range(d) for d in dilation)):
        view = (slice(None), slice(gt, None, dilation[0]), slice(gh, None, dilation[1]), slice(gw, None, dilation[2]))
        pieces.append(attention(q[view], k[view], v[view]))
    if return_lse:
        return (_interleave([p[0] for p in pieces], dilation, q.shape[1:4]),
                _interleave([p[1] for p in pieces], dilation, q.shape[1:4]))
    return _interleave(pieces, dilation, q.shape[1:4])


def _interleave(pieces, dilation: Triple, spatial):
    """Inverse of the dilation split: group (gt, gh, gw) holds positions ``g + d * i``.

    Each group is padded at the end to ``ceil(L / d)`` along every axis, the groups
    are stacked, and one permute + reshape puts position ``i * d + g`` in place; the
    padding falls beyond ``L`` and is cut. Differentiable, one copy.
    """
    dt, dh, dw = dilation
    full = [-(-L // d) for L, d in zip(spatial, dilation)]
    padded = []
    for x in pieces:
        pad = []
        for axis in (3, 2, 1):  # F.pad lists the last dimensions first
            pad += [0, full[axis - 1] - x.shape[axis]]
        padded.append(F.pad(x, [0, 0] * (x.dim() - 4) + pad))
    rest = padded[0].shape[4:]
    stacked = torch.stack(padded).reshape(dt, dh, dw, padded[0].shape[0], *full, *rest)
    order = [3, 4, 0, 5, 1, 6, 2] + list(range(7, 7 + len(rest)))
    merged = stacked.permute(order).reshape(padded[0].shape[0], full[0] * dt, full[1] * dh, full[2] * dw, *rest)
    return merged[:, :spatial[0], :spatial[1], :spatial[2]]


def _join_boxes(pieces: Dict[tuple, torch.Tensor]) -> torch.Tensor:
    """Join box outputs keyed by their (b, n, t, h, w) starts into one tensor.

    The boxes tile the output, so concatenating along W, then H, T, heads and batch
    (each level in order of its starts) rebuilds it with one differentiable op per
    level.
    """
    def join(keys, level):
        if level == 5:
            return pieces[keys[0]]
        dim = (0, 4, 1, 2, 3)[level]  # batch, heads, T, H, W
        starts = sorted({key[level] for key in keys})
        parts = [join([key for key in keys if key[level] == st], level + 1) for st in starts]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

    return join(list(pieces), 0)


def na3d_windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size: Sequence[int],
                  scale: Optional[float] = None, dilation: Sequence[int] = (1, 1, 1),
                  is_causal: Sequence[bool] = (False, False, False), stride: Sequence[int] = (1, 1, 1),
                  compute_dtype: torch.dtype = torch.float64,
                  return_lse: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Attention of each query over its own window's keys only, gathered.

    Same arguments and definition as :func:`na3d_brute_force` (``dilation``,
    ``is_causal``, ``stride`` per axis in (T, H, W) order; grouped-query attention
    by repeating the key/value heads), computed in ``compute_dtype``. The window
    of every query comes from ``geometry.neighborhood_mask``; windows narrower
    than the widest (causal axes) are padded with a zero key and value whose score
    is masked by selection, so nothing outside a window enters any product, and
    gradients (autograd through the gather) likewise combine only the pairs of a
    window: an inf or NaN input reaches exactly the results whose windows hold it.
    Memory ``B * N * window * NH * HD`` elements: tiny shapes only.

    Returns the output in q's dtype, and with ``return_lse`` the natural-log
    log-sum-exp ``(B, T, H, W, NH)`` in ``compute_dtype``.

    Example:
        >>> import torch, na3d
        >>> q, k, v = (torch.randn(1, 3, 4, 5, 2, 8, dtype=torch.float64) for _ in range(3))
        >>> k[0, 0, 0, 0, 0, 0] = float("nan")
        >>> out = na3d.na3d_windowed(q, k, v, (3, 3, 3))
        >>> int(out.isnan().any(-1).sum())  # head 0's queries whose windows hold that key
        12
    """
    B, T, H, W, NH, HD = q.shape
    n = T * H * W
    scale = HD ** -0.5 if scale is None else scale
    mask = geometry.neighborhood_mask((T, H, W), kernel_size, dilation, is_causal, device=q.device, stride=stride)
    count = mask.sum(1)
    width = int(count.max())
    # Per query, the indices of its keys first (stable order), padded with index n
    # (the zero key appended below).
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices[:, :width]
    in_window = torch.arange(width, device=q.device)[None, :] < count[:, None]
    index = torch.where(in_window, order, n)

    def flat(x):
        x = x.reshape(B, n, x.shape[-2], x.shape[-1]).to(compute_dtype)
        if x.shape[2] != NH:
            x = x.repeat_interleave(NH // x.shape[2], dim=2)
        return torch.cat([x, x.new_zeros(B, 1, NH, x.shape[-1])], 1)

    kf, vf = flat(k), flat(v)
    qf = q.reshape(B, n, NH, HD).to(compute_dtype)
    keys = kf[:, index]                                   # (B, n, width, NH, HD)
    values = vf[:, index]
    scores = torch.einsum("bqnd,bqjnd->bqnj", qf, keys) * scale
    scores = torch.where(in_window[None, :, None, :], scores, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bqnj,bqjnd->bqnd", probs, values).reshape(B, T, H, W, NH, vf.shape[-1]).to(q.dtype)
    if not return_lse:
        return out
    return out, torch.logsumexp(scores, dim=-1).reshape(B, T, H, W, NH)
