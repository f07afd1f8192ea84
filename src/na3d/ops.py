"""The kernels as PyTorch operators: ``torch.library`` custom ops with autograd.

``na3d::forward`` and ``na3d::backward`` wrap the Triton launchers so that
``torch.compile`` sees one opaque node per call (no graph break, shapes symbolic:
the fake implementations only describe output shapes), autograd finds the backward
through ``register_autograd``, and CUDA graphs capture them like any other op (no
host synchronization; buffers come from PyTorch's caching allocator).

Outputs are always freshly allocated contiguous tensors, whatever the inputs'
strides; the fake implementations say the same.

:func:`dispatch` is where a validated call picks its path (the public API calls
it and nothing else here). Eager calls skip the operators (their dispatch costs
more host time than a small problem's kernels): inference calls the launcher
directly, and eager calls that need a gradient go through :class:`EagerAttention`,
the same forward and backward as a plain ``torch.autograd.Function``. Whatever is
traced (``torch.compile``, AOTAutograd, ``make_fx``, fake tensors) sees the
operators. CPU tensors without the Triton interpreter take the exact PyTorch
reference.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import launch, reference


@torch.library.custom_op("na3d::forward", mutates_args=(), device_types=("cuda", "cpu"))
def forward(q: Tensor, k: Tensor, v: Tensor, kernel_size: List[int], scale: float,
            return_lse: bool, is_causal: List[bool], stride: List[int], dilation: List[int],
            assume_finite: bool = False) -> Tuple[Tensor, Tensor]:
    """Returns ``(out, lse)``; ``lse`` is empty unless ``return_lse``."""
    out, lse = launch.na3d_forward(q, k, v, kernel_size, scale, return_lse=return_lse, is_causal=is_causal,
                                   stride=stride, assume_finite=assume_finite, dilation=dilation)
    if lse is None:
        lse = q.new_empty((0,), dtype=torch.float32)
    return out, lse


@forward.register_fake
def _forward_fake(q, k, v, kernel_size, scale, return_lse, is_causal, stride, dilation, assume_finite=False):
    lse_shape = q.shape[:-1] if return_lse else (0,)
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("na3d::backward", mutates_args=(), device_types=("cuda", "cpu"))
def backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             grad_lse: Optional[Tensor], kernel_size: List[int], scale: float,
             is_causal: List[bool], stride: List[int], dilation: List[int],
             assume_finite: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """Returns ``(dq, dk, dv)`` given the gradients of ``out`` and (optionally) ``lse``."""
    dq, dk, dv = launch.na3d_backward(grad_out, q, k, v, out, lse, kernel_size, scale, grad_lse=grad_lse,
                                      is_causal=is_causal, stride=stride, assume_finite=assume_finite,
                                      dilation=dilation)
    return dq, dk, dv


@backward.register_fake
def _backward_fake(grad_out, q, k, v, out, lse, grad_lse, kernel_size, scale, is_causal, stride, dilation,
                   assume_finite=False):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, kernel_size, scale, return_lse, is_causal, stride, dilation, assume_finite = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.kernel_size = kernel_size
    ctx.scale = scale
    ctx.return_lse = return_lse
    ctx.is_causal = is_causal
    ctx.stride = stride
    ctx.dilation = dilation
    ctx.assume_finite = assume_finite


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    if grad_lse is not None and grad_lse.numel() == 0:  # the gradient of an empty lse output
        grad_lse = None
    if not ctx.return_lse:
        # Called directly without the log-sum-exp (the public API asks for it whenever
        # a gradient can flow): recompute it rather than fail.
        out, lse = forward(q, k, v, ctx.kernel_size, ctx.scale, True, ctx.is_causal, ctx.stride, ctx.dilation,
                           ctx.assume_finite)
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = backward(grad_out, q, k, v, out, lse, grad_lse, ctx.kernel_size, ctx.scale, ctx.is_causal,
                          ctx.stride, ctx.dilation, ctx.assume_finite)
    return dq, dk, dv, None, None, None, None, None, None, None


forward.register_autograd(_backward, setup_context=_setup_context)


def eager(*tensors: Tensor) -> bool:
    """True for a plain eager call: nothing traces it (no ``torch.compile``, no
    AOTAutograd / ``make_fx`` / fake-tensor mode) and the tensors are ordinary ones.
    Only then may a caller skip the operator and run the launchers itself."""
    return (not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None
            and all(type(t) in (Tensor, torch.nn.Parameter) for t in tensors))


class EagerAttention(torch.autograd.Function):
    """The operator's forward and backward for eager calls that need a gradient.

    Same launchers, same saved tensors, same backward as ``forward`` with its
    registered autograd, without the operator's dispatch, whose host time inside
    an eager ``autograd.grad`` is several times that of a small problem's backward
    kernels (``benchmarks/NOTES.md``, "Host overhead of eager autograd"). Traced
    calls (``torch.compile``, CUDA graphs under compile) keep the operator; see
    :func:`eager`.
    """

    @staticmethod
    def forward(ctx, q, k, v, kernel_size, scale, is_causal, stride, dilation, assume_finite):
        out, lse = launch.na3d_forward(q, k, v, kernel_size, scale, return_lse=True, is_causal=is_causal,
                                       stride=stride, assume_finite=assume_finite, dilation=dilation)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (kernel_size, scale, is_causal, stride, dilation, assume_finite)
        ctx.set_materialize_grads(False)  # an unused lse gets None, not a zero tensor
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        kernel_size, scale, is_causal, stride, dilation, assume_finite = ctx.args
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        if torch.is_grad_enabled():
            # create_graph=True: the backward operator, whose results raise when
            # differentiated again (there is no double backward) instead of silently
            # contributing no second-order terms.
            return (*backward(grad_out, q, k, v, out, lse, grad_lse, list(kernel_size), scale, list(is_causal),
                              list(stride), list(dilation), assume_finite), None, None, None, None, None, None)
        dq, dk, dv = launch.na3d_backward(grad_out, q, k, v, out, lse, kernel_size, scale, grad_lse=grad_lse,
                                          is_causal=is_causal, stride=stride, assume_finite=assume_finite,
                                          dilation=dilation)
        return dq, dk, dv, None, None, None, None, None, None


def dispatch(query: Tensor, key: Tensor, value: Tensor, kernel_size: Sequence[int], is_causal: Sequence[bool],
             stride: Sequence[int], dilation: Sequence[int], scale: float, return_lse: bool,
             assume_finite: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention on validated ``(B, T, H, W, NH, HD)`` queries and ``(B, T, H, W, NKV,
    HD)`` keys and values (``NKV`` divides ``NH``: query head ``n`` reads key/value
    head ``n // (NH // NKV)``), by the path that suits the call: ``out``, or
    ``(out, lse)`` with ``return_lse``. Grouped heads, causal axes, strides and
    dilation run inside the kernels, one launch per kernel.

    CUDA tensors, and CPU tensors when the kernels run in the Triton interpreter, run
    the Triton kernels: an eager call without a gradient through the launcher, an
    eager call that needs one through :class:`EagerAttention`, a traced call through
    the ``na3d::forward`` operator. Other CPU tensors get the exact PyTorch reference,
    differentiable through autograd. ``assume_finite=True`` (inputs known to be
    finite) skips the kernels' check for inf and NaN and the recomputation of the
    tiles holding them (``launch.launch_and_redo``).
    """
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if query.device.type == "cuda" or (query.device.type == "cpu" and launch.kernels_interpreted()):
        if not needs_grad and not torch.compiler.is_compiling():
            # Inference, eager: launch directly. The operator's dispatch (schema
            # checks, autograd and fake-tensor plumbing) costs tens of microseconds
            # per call, as much as a small problem's kernel.
            out, lse = launch.na3d_forward(query, key, value, kernel_size, scale, return_lse=return_lse,
                                           is_causal=is_causal, stride=stride, assume_finite=assume_finite,
                                           dilation=dilation)
            return (out, lse) if return_lse else out
        if eager(query, key, value):
            # Training, eager: autograd without the operator's dispatch (see EagerAttention).
            out, lse = EagerAttention.apply(query, key, value, tuple(kernel_size), scale, tuple(is_causal),
                                            tuple(stride), tuple(dilation), assume_finite)
            return (out, lse) if return_lse else out
        # Traced (torch.compile): the operator. The log-sum-exp is saved for the
        # backward only when a gradient can flow.
        out, lse = forward(query, key, value, list(kernel_size), scale, return_lse or needs_grad,
                           list(is_causal), list(stride), list(dilation), assume_finite)
        return (out, lse) if return_lse else out
    if key.shape[4] != query.shape[4]:  # the reference takes one key/value head per query head
        shape = (*key.shape[:4], key.shape[4], query.shape[4] // key.shape[4], key.shape[5])
        key, value = (x.unsqueeze(5).expand(shape).flatten(4, 5) for x in (key, value))
    # A non-finite input stays inside its windows only when each query's keys are its
    # window alone: one SDPA call per query then (slow, and only for such inputs).
    isolate = not assume_finite and not all(bool(torch.isfinite(t).all()) for t in (query, key, value))
    return reference.na3d_sdpa_exact(query, key, value, kernel_size, scale=scale, return_lse=return_lse,
                                     is_causal=is_causal, stride=stride, dilation=dilation, isolate=isolate)
