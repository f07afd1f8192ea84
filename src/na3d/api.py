"""Public API: argument normalization, validation and dispatch.

Every check runs before anything is launched; a bad argument raises ``ValueError``
or ``TypeError`` naming the argument, its value and what is allowed.

Dispatch by device:

* CUDA (and ROCm) tensors run the Triton kernels;
* CPU tensors run the same Triton kernels under the Triton interpreter when it is
  active (``TRITON_INTERPRET=1`` set before ``na3d`` is imported; that is how CI
  tests them), and otherwise the exact PyTorch reference
  (:func:`na3d.reference.na3d_sdpa_exact`), so results are right without a GPU.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import torch

from . import launch, ops, reference

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 256
MAX_GRID_YZ = 65535  # CUDA's limit on grid dimensions y and z (heads, batch)

IntOrTriple = Union[int, Sequence[int]]
BoolOrTriple = Union[bool, Sequence[bool]]


def _triple(value, name: str, kind: type) -> tuple:
    """Normalize an int/bool or a 3-sequence of them into a 3-tuple."""
    def ok(x):
        if kind is bool:
            return isinstance(x, bool)
        return isinstance(x, int) and not isinstance(x, bool)

    if ok(value):
        return (value,) * 3
    if isinstance(value, (tuple, list)) and len(value) == 3 and all(ok(x) for x in value):
        return tuple(value)
    article = "an" if kind is int else "a"
    raise TypeError(f"{name}={value!r} must be {article} {kind.__name__} or a tuple of 3 {kind.__name__}s")


def _check_tensors(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 6:
            raise ValueError(f"{name} must have rank 6 (B, T, H, W, NH, HD); got {name}.shape={tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}.dtype={t.dtype} is not supported; allowed: bfloat16, float16, float32")
    if not (query.shape == key.shape == value.shape):
        raise ValueError(
            "query, key and value must have the same shape (B, T, H, W, NH, HD); got "
            f"query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}")
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


def _check_kernel_size(kernel_size: IntOrTriple, spatial: Sequence[int]) -> Tuple[int, int, int]:
    ks = _triple(kernel_size, "kernel_size", int)
    for axis, k, size in zip("THW", ks, spatial):
        if k < 1 or k > size:
            raise ValueError(f"kernel_size={ks}: along {axis} it must be between 1 and the input size "
                             f"{size}; got {k}")
        if k % 2 == 0:
            raise ValueError(f"kernel_size={ks}: even kernel sizes are not supported yet (along {axis}: {k}); "
                             "use odd sizes")
    return ks


def _run(query, key, value, kernel_size, scale: float, return_lse: bool):
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if query.numel() == 0:
        out = torch.empty_like(query)
        lse = torch.empty(query.shape[:-1], dtype=torch.float32, device=query.device)
        return (out, lse) if return_lse else out
    if query.device.type == "cuda" or (query.device.type == "cpu" and launch.kernels_interpreted()):
        # The log-sum-exp is saved for the backward only when a gradient can flow.
        out, lse = ops.forward(query, key, value, list(kernel_size), scale, return_lse or needs_grad)
        return (out, lse) if return_lse else out
    if return_lse:
        raise NotImplementedError("return_lse=True is not available on the CPU reference path yet")
    return reference.na3d_sdpa_exact(query, key, value, kernel_size, scale=scale)


def na3d(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kernel_size: IntOrTriple,
    stride: IntOrTriple = 1,
    dilation: IntOrTriple = 1,
    is_causal: BoolOrTriple = False,
    scale: Optional[float] = None,
    return_lse: bool = False,
):
    """3D neighborhood attention with NATTEN's signature and semantics.

    ``query``, ``key``, ``value``: ``(B, T, H, W, NH, HD)``, any strides with innermost
    stride 1. Each query attends to the ``KT x KH x KW`` keys of its window, shifted
    inward at the borders (``natten.na3d``'s definition). ``scale=None`` means
    ``HD ** -0.5``. Returns the output (query's shape and dtype) and, with
    ``return_lse=True``, also the natural-log logsumexp ``(B, T, H, W, NH)`` float32.

    Differentiable (Triton backward kernels; the CPU reference through autograd),
    and a ``torch.library`` op, so ``torch.compile`` and CUDA graphs take it.

    Not yet supported (raise ``NotImplementedError``): ``stride != 1``,
    ``dilation != 1``, ``is_causal`` true along any axis.
    """
    _check_tensors(query, key, value)
    ks = _check_kernel_size(kernel_size, query.shape[1:4])
    if _triple(stride, "stride", int) != (1, 1, 1):
        raise NotImplementedError(f"stride={stride}: only stride 1 is supported")
    if _triple(dilation, "dilation", int) != (1, 1, 1):
        raise NotImplementedError(f"dilation={dilation}: only dilation 1 is supported yet")
    if any(_triple(is_causal, "is_causal", bool)):
        raise NotImplementedError(f"is_causal={is_causal}: causal masks are not supported yet")
    if scale is None:
        scale = query.shape[-1] ** -0.5
    elif not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise TypeError(f"scale={scale!r} must be a finite float or None")

    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse={return_lse!r} must be a bool")
    return _run(query, key, value, ks, float(scale), return_lse)


def na3d_flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size: IntOrTriple) -> torch.Tensor:
    """3D neighborhood attention on pre-scaled queries (scale 1.0).

    The seed API of the LTX-2.5 decoder: ``q`` already multiplied by ``HD ** -0.5``.
    Same layout, windows and device policy as :func:`na3d`.
    """
    return na3d(q, k, v, kernel_size, scale=1.0)
