"""The kernels as PyTorch operators: ``torch.library`` custom ops with autograd.

``na3d::forward`` and ``na3d::backward`` wrap the Triton launchers so that
``torch.compile`` sees one opaque node per call (no graph break, shapes symbolic:
the fake implementations only describe output shapes), autograd finds the backward
through ``register_autograd``, and CUDA graphs capture them like any other op (no
host synchronization; buffers come from PyTorch's caching allocator).

Outputs are always freshly allocated contiguous tensors, whatever the inputs'
strides; the fake implementations say the same.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import launch


@torch.library.custom_op("na3d::forward", mutates_args=(), device_types=("cuda", "cpu"))
def forward(q: Tensor, k: Tensor, v: Tensor, kernel_size: List[int], scale: float,
            need_lse: bool, is_causal: List[bool], stride: List[int]) -> Tuple[Tensor, Tensor]:
    """Returns ``(out, lse)``; ``lse`` is empty unless ``need_lse``."""
    out, lse = launch.na3d_forward(q, k, v, kernel_size, scale, need_lse=need_lse, is_causal=is_causal,
                                   stride=stride)
    if lse is None:
        lse = q.new_empty((0,), dtype=torch.float32)
    return out, lse


@forward.register_fake
def _forward_fake(q, k, v, kernel_size, scale, need_lse, is_causal, stride):
    lse_shape = q.shape[:-1] if need_lse else (0,)
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("na3d::backward", mutates_args=(), device_types=("cuda", "cpu"))
def backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             grad_lse: Optional[Tensor], kernel_size: List[int], scale: float,
             is_causal: List[bool], stride: List[int]) -> Tuple[Tensor, Tensor, Tensor]:
    """Returns ``(dq, dk, dv)`` given the gradients of ``out`` and (optionally) ``lse``."""
    dq, dk, dv = launch.na3d_backward(grad_out, q, k, v, out, lse, kernel_size, scale, grad_lse=grad_lse,
                                      is_causal=is_causal, stride=stride)
    return dq, dk, dv


@backward.register_fake
def _backward_fake(grad_out, q, k, v, out, lse, grad_lse, kernel_size, scale, is_causal, stride):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, kernel_size, scale, need_lse, is_causal, stride = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.kernel_size = kernel_size
    ctx.scale = scale
    ctx.have_lse = need_lse
    ctx.is_causal = is_causal
    ctx.stride = stride


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    if grad_lse is not None and grad_lse.numel() == 0:  # the gradient of an empty lse output
        grad_lse = None
    if not ctx.have_lse:
        # Called directly without the log-sum-exp (the public API asks for it whenever
        # a gradient can flow): recompute it rather than fail.
        out, lse = forward(q, k, v, ctx.kernel_size, ctx.scale, True, ctx.is_causal, ctx.stride)
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = backward(grad_out, q, k, v, out, lse, grad_lse, ctx.kernel_size, ctx.scale, ctx.is_causal,
                          ctx.stride)
    return dq, dk, dv, None, None, None, None, None


forward.register_autograd(_backward, setup_context=_setup_context)
