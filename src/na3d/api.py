"""Public API: argument normalization and validation (:func:`na3d.ops.dispatch`
picks the path; grouped-query attention, causal axes, strides and dilation run
inside the kernels).

Every check runs before anything is launched; a bad argument raises ``ValueError``
or ``TypeError`` naming the argument, its value and what is allowed.

Dispatch by device:

* CUDA (and ROCm) tensors run the Triton kernels;
* CPU tensors run the same Triton kernels under the Triton interpreter when it is
  active (``TRITON_INTERPRET=1`` set before ``na3d`` is imported; that is how CI
  tests them), and otherwise the exact PyTorch reference
  (:func:`na3d.reference.na3d_sdpa_exact`), so results are right without a GPU.
"""

import math
import numbers
from typing import Optional, Sequence, Tuple, Union

import numpy as np
import torch

from . import ops
from .merge import merge_attentions

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 256
MAX_GRID_YZ = 65535  # CUDA's limit on grid dimensions y and z (heads, batch)

# Per-axis arguments: one value for every axis, or a tuple of one per axis ((T, H, W) for na3d).
IntOrTuple = Union[int, Sequence[int]]
BoolOrTuple = Union[bool, Sequence[bool]]


def _is_bool(x) -> bool:
    """A Python or NumPy bool (``numpy.bool_`` is not a ``bool`` subclass)."""
    return isinstance(x, (bool, np.bool_))


def _is_int(x) -> bool:
    """A Python or NumPy integer (``numbers.Integral``), bools excluded."""
    return isinstance(x, numbers.Integral) and not _is_bool(x)


def _ntuple(value, n: int, name: str, kind: type) -> tuple:
    """Normalize an int/bool or an n-sequence of them into an n-tuple of Python
    ints/bools (NumPy scalars are accepted wherever Python ones are)."""
    ok = _is_bool if kind is bool else _is_int

    if ok(value):
        return (kind(value),) * n
    if isinstance(value, (tuple, list)) and len(value) == n and all(ok(x) for x in value):
        return tuple(kind(x) for x in value)
    article = "an" if kind is int else "a"
    raise TypeError(f"{name}={value!r} must be {article} {kind.__name__} or a tuple of {n} {kind.__name__}s")


def _triple(value, name: str, kind: type) -> tuple:
    return _ntuple(value, 3, name, kind)


def _check_tensors(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 6:
            raise ValueError(f"{name} must have rank 6 (B, T, H, W, NH, HD); got {name}.shape={tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}.dtype={t.dtype} is not supported; allowed: bfloat16, float16, float32")
    if key.shape != value.shape or query.shape[:4] != key.shape[:4] or query.shape[5] != key.shape[5]:
        raise ValueError(
            "query (B, T, H, W, NH, HD) and key, value (B, T, H, W, NKV, HD) must agree in every "
            f"dimension but the heads; got query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}, "
            f"value.shape={tuple(value.shape)}")
    for name, t in (("query", query), ("key", key)):
        if t.shape[4] == 0:
            raise ValueError(f"{name} must have at least one head (NH >= 1); got {name}.shape={tuple(t.shape)}")
    if query.shape[4] % key.shape[4]:
        raise ValueError(f"query heads ({query.shape[4]}) must be a multiple of key/value heads "
                         f"({key.shape[4]}) for grouped-query attention")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must share one dtype; got {query.dtype}, {key.dtype}, {value.dtype}")
    if not (query.device == key.device == value.device):
        raise ValueError(
            f"query, key and value must be on one device; got {query.device}, {key.device}, {value.device}")
    head_dim = query.shape[-1]
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {head_dim} (query.shape[-1]) is not supported; "
                         f"allowed: multiples of 8 from 8 to {MAX_HEAD_DIM}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name} must have innermost stride 1 (any other strides are fine); "
                             f"got {name}.stride()={t.stride()}")
    B, NH = query.shape[0], query.shape[4]
    if B > MAX_GRID_YZ or NH > MAX_GRID_YZ:
        raise ValueError(f"batch ({B}) and heads ({NH}) must each be at most {MAX_GRID_YZ}")


def _check_kernel_size(kernel_size: IntOrTuple, dilation: IntOrTuple,
                       spatial: Sequence[int]) -> Tuple[Tuple[int, int, int], Tuple[int, int, int]]:
    """Kernel sizes and dilations as triples, checked against the grid ``spatial``.
    An empty grid (some axis of length 0) has no windows to check: only the
    arguments' own ranges are (its result is empty)."""
    ks = _triple(kernel_size, "kernel_size", int)
    dil = _triple(dilation, "dilation", int)
    empty = 0 in tuple(spatial)
    for axis, k, d, size in zip("THW", ks, dil, spatial):
        if d < 1:
            raise ValueError(f"dilation={dil}: along {axis} it must be at least 1; got {d}")
        if k < 1 or (k * d > size and not empty):
            raise ValueError(f"kernel_size={ks}, dilation={dil}: along {axis} the kernel must be at least 1 "
                             f"and kernel * dilation at most the input size {size}; got {k} * {d}")
    return ks, dil


def _check_stride(stride: IntOrTuple, kernel_size: Sequence[int]) -> Tuple[int, int, int]:
    st = _triple(stride, "stride", int)
    for axis, s, k in zip("THW", st, kernel_size):
        if not 1 <= s <= k:
            raise ValueError(f"stride={st}: along {axis} it must be at least 1 and at most the kernel size {k}; "
                             f"got {s}")
    return st


def _empty_result(query, key, value, return_lse: bool):
    """The result for an empty batch or grid: empty tensors of the right shapes,
    still connected to the inputs so that autograd gives (empty) gradients."""
    tie = (query.sum() + key.sum() + value.sum()).to(query.dtype) * 0
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device) + tie
    if not return_lse:
        return out
    return out, torch.zeros(query.shape[:-1], dtype=torch.float32, device=query.device) + tie.float()


def na3d(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kernel_size: IntOrTuple,
    stride: IntOrTuple = 1,
    dilation: IntOrTuple = 1,
    is_causal: BoolOrTuple = False,
    scale: Optional[float] = None,
    additional_keys: Optional[torch.Tensor] = None,
    additional_values: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    assume_finite: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """3D neighborhood attention: each query attends to the ``KT x KH x KW`` keys around it.

    ``natten.na3d``'s signature and definition. Along an axis of length ``L`` with
    kernel ``K``, query ``i`` sees keys ``[s, s + K)`` with
    ``s = clamp(i - K // 2, 0, L - K)``: centered where possible, shifted inward at the
    borders, so every query sees exactly ``K`` keys; the 3D window is the product of
    the three. Per-axis arguments (int or 3-tuple) are in ``(T, H, W)`` order; Python
    and NumPy scalars are accepted alike.

    Args:
        query: ``(B, T, H, W, NH, HD)``; dtype bfloat16, float16 or float32 (fp32
            accumulation always); ``HD`` a multiple of 8 from 8 to 256; ``B`` and
            ``NH`` at most 65535. Any strides with innermost stride 1: views of a
            fused QKV projection go in without copies.
        key: ``(B, T, H, W, NKV, HD)``, query's dtype and device. ``NKV`` divides
            ``NH`` (grouped-query attention: query head ``n`` uses key/value head
            ``n // (NH // NKV)``).
        value: key's shape, query's dtype and device.
        kernel_size: ``K`` per axis, ``1 <= K`` and ``K * dilation <= size`` (T, H or
            W). Odd or even: an even ``K`` puts ``K // 2`` keys left of the center
            and ``K // 2 - 1`` right.
        stride: ``1 <= stride <= kernel_size`` per axis: each group of ``stride``
            consecutive queries shares the window of its center (the right one for
            an even stride), or of its last query on a causal axis. The output keeps
            the input's size.
        dilation: ``d >= 1`` per axis: the axis splits into ``d`` groups by
            ``index % d`` and attention runs inside each.
        is_causal: bool per axis: a causal axis sees the ``K`` positions ending at
            the query, ``[i - K + 1, i]`` clipped at 0 (fewer keys near the start),
            e.g. ``(True, False, False)`` for causal time.
        scale: multiplies ``query @ key^T``; any finite float, ``None`` for
            ``HD ** -0.5``.
        additional_keys: optional ``(B, S, NKV, HD)``, query's dtype and device,
            ``S >= 1``: tokens every query also attends to (text, registers), merged
            with the neighborhood through the log-sum-exps. Given together with
            ``additional_values`` (same shape).
        additional_values: see ``additional_keys``.
        return_lse: also return each query's natural-log log-sum-exp of its scores.
        assume_finite: the caller guarantees that query, key and value hold no inf
            or NaN: the kernels skip their check for them, and the recomputation
            that keeps a non-finite input inside its windows (a few percent of the
            GPU time on the shortest windows, see the README). With a non-finite
            input the results are then undefined beyond the windows holding it.

    Returns:
        ``out``: a new contiguous tensor of query's shape and dtype; with
        ``return_lse=True``, ``(out, lse)`` with ``lse`` float32 ``(B, T, H, W, NH)``.
        Differentiable with respect to query, key, value and the additional tokens,
        through ``out`` and ``lse``. An empty batch or grid (``B == 0`` or an axis of
        length 0) gives empty results (and empty gradients).

    Raises:
        TypeError, ValueError: before anything runs, naming the argument: not a
            tensor, wrong rank, shapes, dtypes or devices that disagree, an
            unsupported dtype or head dim, no heads (``NH`` or ``NKV`` 0), innermost
            stride not 1, a kernel size, stride or dilation out of range, a
            non-finite scale.

    Devices: CUDA (and ROCm) tensors run the Triton kernels, forward and backward;
    ``torch.compile(fullgraph=True)`` and CUDA graphs take them as they are. CPU
    tensors run the same kernels in the Triton interpreter when ``TRITON_INTERPRET=1``
    was set before ``import na3d``, and otherwise the exact PyTorch reference
    (:func:`na3d.na3d_sdpa_exact`, differentiable through autograd).

    Non-finite inputs: an inf or NaN in a query, key or value reaches exactly the
    outputs, log-sum-exps and gradients whose windows hold it, as IEEE arithmetic
    over each window gives them; every other element is what a zero in its place
    would give, bit for bit (the README's "non-finite inputs" row). On the CPU
    without the interpreter, the reference path computes each query on its own
    when an input is not finite (exact and isolated, but one SDPA call per query:
    slow on large grids). ``assume_finite=True`` drops the guarantee for speed.

    Example:
        >>> import torch, na3d
        >>> q, k, v = (torch.randn(1, 4, 6, 8, 2, 16) for _ in range(3))
        >>> na3d.na3d(q, k, v, kernel_size=(3, 3, 5)).shape
        torch.Size([1, 4, 6, 8, 2, 16])
        >>> out, lse = na3d.na3d(q, k, v, 3, is_causal=(True, False, False), return_lse=True)
        >>> lse.shape, lse.dtype
        (torch.Size([1, 4, 6, 8, 2]), torch.float32)
    """
    _check_tensors(query, key, value)
    ks, dil = _check_kernel_size(kernel_size, dilation, query.shape[1:4])
    st = _check_stride(stride, ks)
    causal = _triple(is_causal, "is_causal", bool)
    if scale is None:
        scale = query.shape[-1] ** -0.5
    elif not isinstance(scale, numbers.Real) or _is_bool(scale) or not math.isfinite(scale):
        raise TypeError(f"scale={scale!r} must be a finite float or None")
    if not _is_bool(return_lse):
        raise TypeError(f"return_lse={return_lse!r} must be a bool")
    if not _is_bool(assume_finite):
        raise TypeError(f"assume_finite={assume_finite!r} must be a bool")
    return_lse, assume_finite = bool(return_lse), bool(assume_finite)
    _check_additional(query, key, additional_keys, additional_values)
    if query.shape[0] == 0 or 0 in query.shape[1:4]:
        # An empty batch or grid: an empty result (the extra tokens, if any, have
        # no query to attend to).
        return _empty_result(query, key, value, return_lse)
    if additional_keys is None:
        # The path a validated call takes (the kernels, their operator, or the reference).
        return ops.dispatch(query, key, value, ks, causal, st, dil, float(scale), return_lse, assume_finite)
    out, lse = ops.dispatch(query, key, value, ks, causal, st, dil, float(scale), True, assume_finite)
    extra_out, extra_lse = _attend_additional(query, additional_keys, additional_values, float(scale))
    out, lse = merge_attentions([out, extra_out], [lse, extra_lse])
    return (out, lse) if return_lse else out


def _check_additional(query, key, additional_keys, additional_values) -> None:
    if (additional_keys is None) != (additional_values is None):
        raise ValueError("additional_keys and additional_values must be given together (or neither)")
    if additional_keys is None:
        return
    B, NKV, HD = query.shape[0], key.shape[4], query.shape[5]
    for name, t in (("additional_keys", additional_keys), ("additional_values", additional_values)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4 or t.shape[0] != B or t.shape[2] != NKV or t.shape[3] != HD or t.shape[1] < 1:
            raise ValueError(f"{name} must have shape (B, S, NKV, HD) = ({B}, S >= 1, {NKV}, {HD}) like key's "
                             f"batch, heads and head dim; got {name}.shape={tuple(t.shape)}")
        if t.dtype != query.dtype or t.device != query.device:
            raise ValueError(f"{name} must have query's dtype and device ({query.dtype}, {query.device}); "
                             f"got {t.dtype}, {t.device}")
    if additional_keys.shape[1] != additional_values.shape[1]:
        raise ValueError(f"additional_keys and additional_values must have the same number of tokens; got "
                         f"{additional_keys.shape[1]} and {additional_values.shape[1]}")


def _attend_additional(query, keys, values, scale: float, score_budget: int = 1 << 26):
    """Dense attention of every query over the additional tokens: ``(out, lse)`` in
    na3d's layouts, float32 softmax, differentiable. Queries go in chunks so that
    the float32 scores stay under ``score_budget`` elements."""
    B, T, H, W, NH, HD = query.shape
    S, NKV = keys.shape[1], keys.shape[2]
    if NH != NKV:  # grouped-query attention: the extra tokens are few, repeating them is cheap
        keys, values = (x.repeat_interleave(NH // NKV, dim=2) for x in (keys, values))
    q = query.reshape(B, T * H * W, NH, HD)
    kf, vf = keys.float(), values.float()
    chunk = max(1, score_budget // max(1, B * NH * S))
    outs, lses = [], []
    for n0 in range(0, q.shape[1], chunk):
        scores = torch.einsum("bnhd,bshd->bhns", q[:, n0:n0 + chunk].float(), kf) * scale
        lse = torch.logsumexp(scores, dim=-1)
        outs.append(torch.einsum("bhns,bshd->bnhd", torch.exp(scores - lse[..., None]), vf))
        lses.append(lse.transpose(1, 2))
    out = torch.cat(outs, 1).reshape(B, T, H, W, NH, HD).to(query.dtype)
    return out, torch.cat(lses, 1).reshape(B, T, H, W, NH)


def na3d_flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size: IntOrTuple,
                    assume_finite: bool = False) -> torch.Tensor:
    """3D neighborhood attention on pre-scaled queries: :func:`na3d` with ``scale=1.0``.

    The LTX-2.5 decoder's call: ``q`` already multiplied by ``HD ** -0.5``.

    Args:
        q: ``(B, T, H, W, NH, HD)``, pre-scaled; dtype bfloat16, float16 or float32;
            ``HD`` a multiple of 8 from 8 to 256; innermost stride 1.
        k: ``(B, T, H, W, NKV, HD)`` with ``NKV`` dividing ``NH``; q's dtype and device.
        v: k's shape, q's dtype and device.
        kernel_size: int or ``(KT, KH, KW)``, ``1 <= K <= size`` per axis.
        assume_finite: as in :func:`na3d`.

    Returns:
        The output, q's shape and dtype; differentiable.

    Errors, devices and non-finite inputs: as :func:`na3d`.

    Example:
        >>> import torch, na3d
        >>> q, k, v = (torch.randn(1, 4, 6, 8, 2, 16) for _ in range(3))
        >>> out = na3d.na3d_flash_attn(q * 16 ** -0.5, k, v, (3, 3, 5))
        >>> torch.allclose(out, na3d.na3d(q, k, v, (3, 3, 5)), atol=1e-6)
        True
    """
    return na3d(q, k, v, kernel_size, scale=1.0, assume_finite=assume_finite)


def _lower_rank(fn_name: str, rank: int, layout: str, query, key, value, kernel_size, stride, dilation,
                is_causal, scale, return_lse, additional_keys=None, additional_values=None, assume_finite=False):
    """na1d / na2d as na3d on views with unit leading spatial axes (no copies)."""
    n = rank - 3
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn_name}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{fn_name}: {name} must have rank {rank} {layout}; got {name}.shape={tuple(t.shape)}")
    pad = (1,) * (3 - n)
    ks = pad + _ntuple(kernel_size, n, "kernel_size", int)
    st = pad + _ntuple(stride, n, "stride", int)
    dil = pad + _ntuple(dilation, n, "dilation", int)
    causal = (False,) * (3 - n) + _ntuple(is_causal, n, "is_causal", bool)
    lift = (slice(None),) + (None,) * (3 - n)
    result = na3d(query[lift], key[lift], value[lift], ks, st, dil, causal, scale, additional_keys,
                  additional_values, return_lse=return_lse, assume_finite=assume_finite)
    drop = (slice(None),) + (0,) * (3 - n)
    if return_lse:
        return result[0][drop], result[1][drop]
    return result[drop]


def na1d(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kernel_size: IntOrTuple,
         stride: IntOrTuple = 1, dilation: IntOrTuple = 1, is_causal: BoolOrTuple = False,
         scale: Optional[float] = None, additional_keys: Optional[torch.Tensor] = None,
         additional_values: Optional[torch.Tensor] = None,
         return_lse: bool = False,
         assume_finite: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """1D neighborhood attention over a sequence, ``natten.na1d``'s signature.

    Query ``i`` of a sequence of length ``L`` sees keys ``[s, s + K)``,
    ``s = clamp(i - K // 2, 0, L - K)``. Runs :func:`na3d`'s kernels on
    ``(B, 1, 1, L, NH, HD)`` views (no copies).

    Args:
        query: ``(B, L, NH, HD)``; dtype bfloat16, float16 or float32; ``HD`` a
            multiple of 8 from 8 to 256; innermost stride 1.
        key: ``(B, L, NKV, HD)`` with ``NKV`` dividing ``NH``; query's dtype, device.
        value: key's shape.
        kernel_size: int (or a 1-tuple), ``1 <= K`` and ``K * dilation <= L``.
        stride: ``1 <= stride <= kernel_size``: groups of ``stride`` queries share a
            window.
        dilation: ``>= 1``.
        is_causal: a causal sequence sees ``[i - K + 1, i]`` clipped at 0.
        scale: any finite float; ``None`` for ``HD ** -0.5``.
        additional_keys: optional ``(B, S, NKV, HD)`` tokens every query also attends
            to, given with ``additional_values`` of the same shape.
        additional_values: see ``additional_keys``.
        return_lse: also return the float32 log-sum-exp ``(B, L, NH)``.
        assume_finite: as in :func:`na3d`.

    Returns:
        ``out`` (query's shape and dtype), or ``(out, lse)``; differentiable.

    Errors, devices and non-finite inputs: as :func:`na3d` (errors name
    ``na1d``'s layout).

    Example:
        >>> import torch, na3d
        >>> x = torch.randn(2, 50, 4, 32)
        >>> na3d.na1d(x, x, x, kernel_size=7, is_causal=True).shape
        torch.Size([2, 50, 4, 32])
    """
    return _lower_rank("na1d", 4, "(B, L, NH, HD)", query, key, value, kernel_size, stride, dilation,
                       is_causal, scale, return_lse, additional_keys, additional_values, assume_finite)


def na2d(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kernel_size: IntOrTuple,
         stride: IntOrTuple = 1, dilation: IntOrTuple = 1, is_causal: BoolOrTuple = False,
         scale: Optional[float] = None, additional_keys: Optional[torch.Tensor] = None,
         additional_values: Optional[torch.Tensor] = None, return_lse: bool = False,
         assume_finite: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """2D neighborhood attention over an image, ``natten.na2d``'s signature.

    Each query sees the ``KX x KY`` keys around it, windows shifted inward at the
    borders. Runs :func:`na3d`'s kernels on ``(B, 1, X, Y, NH, HD)`` views (no copies).
    Per-axis arguments are an int or a pair in ``(X, Y)`` order. Errors, devices and
    non-finite inputs: as :func:`na3d` (errors name ``na2d``'s layout).

    Args:
        query: ``(B, X, Y, NH, HD)``; dtype bfloat16, float16 or float32; ``HD`` a
            multiple of 8 from 8 to 256; innermost stride 1.
        key: ``(B, X, Y, NKV, HD)`` with ``NKV`` dividing ``NH``; query's dtype and
            device.
        value: key's shape.
        kernel_size: per axis ``1 <= K`` and ``K * dilation <= size``.
        stride: per axis ``1 <= stride <= kernel_size``.
        dilation: per axis ``>= 1``.
        is_causal: per axis.
        scale: any finite float; ``None`` for ``HD ** -0.5``.
        additional_keys: optional ``(B, S, NKV, HD)``, with ``additional_values``.
        additional_values: see ``additional_keys``.
        return_lse: also return the float32 log-sum-exp ``(B, X, Y, NH)``.
        assume_finite: as in :func:`na3d`.

    Returns:
        ``out`` (query's shape and dtype), or ``(out, lse)``; differentiable.

    Example:
        >>> import torch, na3d
        >>> img = torch.randn(1, 12, 16, 2, 32)
        >>> na3d.na2d(img, img, img, kernel_size=(3, 5), dilation=(1, 2)).shape
        torch.Size([1, 12, 16, 2, 32])
    """
    return _lower_rank("na2d", 5, "(B, X, Y, NH, HD)", query, key, value, kernel_size, stride, dilation,
                       is_causal, scale, return_lse, additional_keys, additional_values, assume_finite)
