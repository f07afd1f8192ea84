"""na3d as a comfy-kitchen backend: ComfyUI's ``comfy_kitchen.na3d`` calls run na3d.

    import na3d.comfy_kitchen
    na3d.comfy_kitchen.register()     # comfy_kitchen.na3d(q, k, v, kernel_size, is_causal, scale) now runs na3d
    na3d.comfy_kitchen.unregister()   # back to comfy-kitchen's own backends, in their previous order

Needs ``comfy-kitchen`` (``pip install comfy-kitchen``; 0.2.40 has ``na3d`` and the
backend registry). ComfyUI runs the LTX-2 decoder's neighborhood attention through
``comfy_kitchen.na3d``, a ``torch.library`` op that asks comfy-kitchen's registry
(``comfy_kitchen.registry``) for the first backend, in priority order, whose
constraints accept the call, and calls that backend's ``na3d`` function. This module
is such a backend: :func:`register` adds it with
``registry.register(name, module, capabilities)`` (``capabilities`` maps a function
name to a ``FunctionConstraints``: dtypes, devices, call rules) and puts it first
with ``registry.set_priority``. comfy-kitchen has no call that reads the priority or
removes a backend: :func:`register` reads the list from the registry's
``_priority`` attribute (to restore it later), and :func:`unregister` restores that
list and disables the backend (``registry.disable``), so that only an explicit
``comfy_kitchen.use_backend("na3d")`` would name it again, and refuses.

comfy-kitchen's semantics are kept where they differ from :func:`na3d.na3d`'s:

* a kernel larger than an axis clamps to that axis (na3d raises instead); on a
  causal axis a window longer than the axis sees every earlier position either way;
* ``kernel_size`` an int or 3 ints, ``is_causal`` None (non-causal), a bare bool or
  3 bools, ``scale`` None for ``head_dim ** -0.5``;
* q, k and v of one shape, dtype and device (no grouped-query heads); the output
  in v's dtype (q's: they are one).

Calls na3d cannot take fail its constraints and go to the next backend in priority
order (comfy-kitchen's CUDA, Triton or eager one): another dtype (float64), a head
dim that is not a multiple of 8 from 8 to 256, more than 65535 batch entries or
heads (or no head), a device other than CUDA (or ROCm) and the CPU, a CUDA device older than
compute capability 8.0, a non-finite scale. On the CPU na3d runs its exact PyTorch
reference (or its kernels in the Triton interpreter when ``TRITON_INTERPRET=1``).
comfy-kitchen's ``na3d`` has no backward; neither has this backend's entry (use
:func:`na3d.na3d` for gradients).
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import List, Optional

import torch

try:
    from comfy_kitchen.constraints import ExactDims, FunctionConstraints, ParamConstraint, ValidationResult
    from comfy_kitchen.registry import registry
except ImportError as error:
    raise ImportError("na3d.comfy_kitchen needs comfy-kitchen (0.2.40 or later, with na3d and its backend "
                      "registry): pip install comfy-kitchen") from error

from . import api

__all__ = ["BACKEND", "CONSTRAINTS", "na3d", "register", "unregister"]

BACKEND = "na3d"
MAX_BATCH_OR_HEADS = api.MAX_GRID_YZ

# The priority list register() replaced, restored by unregister(); None while not registered.
_previous_priority: Optional[List[str]] = None


def _axis_triple(value, kind: type) -> list:
    if isinstance(value, kind) or (kind is int and isinstance(value, numbers.Integral) and not isinstance(value, bool)):
        return [kind(value)] * 3
    return [kind(x) for x in value]


def na3d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size, is_causal=None,
         scale: Optional[float] = None) -> torch.Tensor:
    """comfy-kitchen's ``na3d`` on na3d: ``(B, T, H, W, NH, HD)`` q, k, v of one shape.

    What the registry calls for ``comfy_kitchen.na3d`` once :func:`register` ran (and
    what may be called directly): ``kernel_size`` an int or ``[kt, kh, kw]``, each
    clamped to its axis; ``is_causal`` None, a bool or three; ``scale`` None for
    ``head_dim ** -0.5``. Returns a new tensor of q's shape and dtype.
    """
    kernel = _axis_triple(kernel_size, int)
    causal = [False] * 3 if is_causal is None else _axis_triple(is_causal, bool)
    # comfy-kitchen clamps a kernel to its axis; an empty axis keeps 1 (the result is empty).
    kernel = [max(1, min(size, length)) for size, length in zip(kernel, q.shape[1:4])]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return api.na3d(q, k, v, kernel, is_causal=causal, scale=scale)


def _call_rule(kwargs) -> ValidationResult:
    """What na3d takes beyond the dtypes and ranks: one shape for q, k, v; head dim; batch and heads; scale;
    the window's arguments; on CUDA, compute capability 8.0 or later."""
    q = kwargs.get("q")
    for name in ("k", "v"):
        other = kwargs.get(name)
        if q is not None and other is not None:
            if tuple(other.shape) != tuple(q.shape) or other.dtype != q.dtype or other.device != q.device:
                return ValidationResult.fail(name, f"must have q's shape, dtype and device {tuple(q.shape)}, "
                                                   f"{q.dtype}, {q.device}")
    if q is not None:
        head_dim = q.shape[-1]
        if head_dim % 8 or not 8 <= head_dim <= api.MAX_HEAD_DIM:
            return ValidationResult.fail("q", f"head_dim {head_dim}: na3d takes multiples of 8 from 8 to "
                                              f"{api.MAX_HEAD_DIM}")
        if q.shape[0] > MAX_BATCH_OR_HEADS or not 1 <= q.shape[4] <= MAX_BATCH_OR_HEADS:
            return ValidationResult.fail("q", f"batch must be at most {MAX_BATCH_OR_HEADS} and heads from 1 to "
                                              f"{MAX_BATCH_OR_HEADS}")
        if q.device.type == "cuda" and not torch.version.hip and torch.cuda.get_device_capability(q.device) < (8, 0):
            return ValidationResult.fail("__hardware__", "na3d's kernels need compute capability 8.0 or later")
    kernel_size, is_causal, scale = kwargs.get("kernel_size"), kwargs.get("is_causal"), kwargs.get("scale")
    if kernel_size is not None:
        sizes = [kernel_size] if isinstance(kernel_size, numbers.Integral) else list(kernel_size)
        if len(sizes) not in (1, 3) or not all(isinstance(s, numbers.Integral) and s >= 1 for s in sizes):
            return ValidationResult.fail("kernel_size", f"must be a positive int or 3 of them, got {kernel_size!r}")
    if is_causal is not None and not isinstance(is_causal, bool) and len(is_causal) != 3:
        return ValidationResult.fail("is_causal", f"must be None, a bool or 3 bools, got {is_causal!r}")
    if scale is not None and (not isinstance(scale, numbers.Real) or not math.isfinite(scale)):
        return ValidationResult.fail("scale", f"must be None or a finite float, got {scale!r}")
    return ValidationResult.ok()


_DTYPES = frozenset(api.SUPPORTED_DTYPES)
CONSTRAINTS = FunctionConstraints(
    params={name: ParamConstraint(dtypes=_DTYPES, shape_rules=(ExactDims(6),)) for name in ("q", "k", "v")},
    default_devices=frozenset({"cuda", "cpu"}),
    call_rules=(_call_rule,),
)


def register() -> List[str]:
    """Register na3d as comfy-kitchen's first backend for ``na3d``; returns the new priority order.

    Existing callers of ``comfy_kitchen.na3d`` then run na3d, unchanged; calls na3d
    cannot take (see the module docstring) go to the next backend. Calling it again
    keeps na3d first and remembers the order from before the first call.
    """
    global _previous_priority
    registry.register(BACKEND, sys.modules[__name__], {"na3d": CONSTRAINTS})
    registry.enable(BACKEND)
    current = _priority()
    if _previous_priority is None:
        _previous_priority = [name for name in current if name != BACKEND]
    registry.set_priority([BACKEND] + [name for name in current if name != BACKEND])
    return _priority()


def unregister() -> List[str]:
    """Undo :func:`register`: the priority order from before it, na3d disabled; returns that order.

    Does nothing (but return the order) if na3d is not registered.
    """
    global _previous_priority
    if _previous_priority is not None:
        registry.set_priority(_previous_priority)
        registry.disable(BACKEND)
        _previous_priority = None
    return _priority()


def _priority() -> List[str]:
    priority = getattr(registry, "_priority", None)
    if not isinstance(priority, list):
        raise RuntimeError("this comfy-kitchen's registry has no _priority list to read the backend order from; "
                           "na3d.comfy_kitchen was written against comfy-kitchen 0.2.40")
    return list(priority)
