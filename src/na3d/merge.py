"""Merging attention computed over disjoint sets of keys.

Attention of one query over keys ``K1 + K2`` equals a weighted mix of its attention
over ``K1`` and over ``K2``, weighted by their softmax normalizers: with natural-log
log-sum-exps ``lse_i``, ``out = sum_i exp(lse_i - lse) * out_i`` and
``lse = log(sum_i exp(lse_i))``. That is how a neighborhood is combined with extra
tokens (text, registers) or how partial results of a split computation are joined.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch


def merge_attentions(outputs: Sequence[torch.Tensor], lse_tensors: Sequence[torch.Tensor]
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge attention outputs over disjoint key sets into the attention over their union.

    ``outputs``: two or more tensors ``(..., NH, HD)`` of one shape and dtype (for
    example na3d's ``(B, T, H, W, NH, HD)``); ``lse_tensors``: their natural-log
    log-sum-exps ``(..., NH)`` (``return_lse=True``). Returns ``(output, lse)``: the
    output in the inputs' dtype, the lse in float32. Arithmetic is float32; the
    result is differentiable with respect to every output and lse (na3d's backward
    takes the gradient of its lse), like ``natten.merge_attentions`` but for any
    number of leading dimensions.
    """
    if not isinstance(outputs, (list, tuple)) or not isinstance(lse_tensors, (list, tuple)):
        raise TypeError("outputs and lse_tensors must be lists (or tuples) of tensors")
    if len(outputs) < 2 or len(outputs) != len(lse_tensors):
        raise ValueError(f"need at least two outputs and one lse per output; got {len(outputs)} outputs "
                         f"and {len(lse_tensors)} lse tensors")
    first = outputs[0]
    for i, (out, lse) in enumerate(zip(outputs, lse_tensors)):
        if not isinstance(out, torch.Tensor) or not isinstance(lse, torch.Tensor):
            raise TypeError(f"outputs[{i}] and lse_tensors[{i}] must be tensors")
        if out.shape != first.shape or out.dtype != first.dtype or out.device != first.device:
            raise ValueError(f"outputs[{i}] has shape {tuple(out.shape)}, dtype {out.dtype}, device "
                             f"{out.device}; outputs[0] has {tuple(first.shape)}, {first.dtype}, {first.device}")
        if lse.shape != first.shape[:-1] or lse.device != first.device:
            raise ValueError(f"lse_tensors[{i}].shape={tuple(lse.shape)} must be outputs' shape without "
                             f"the head dim, {tuple(first.shape[:-1])}, on {first.device}")
    lses = torch.stack([lse.float() for lse in lse_tensors])
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - lse)
    merged = sum(w.unsqueeze(-1) * out.float() for w, out in zip(weights, outputs))
    return merged.to(first.dtype), lse
