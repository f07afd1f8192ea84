"""Merging attention computed over disjoint sets of keys.

Attention of one query over keys ``K1 + K2`` equals a weighted mix of its attention
over ``K1`` and over ``K2``, weighted by their softmax normalizers: with natural-log
log-sum-exps ``lse_i``, ``out = sum_i exp(lse_i - lse) * out_i`` and
``lse = log(sum_i exp(lse_i))``. That is how a neighborhood is combined with extra
tokens (text, registers) or how partial results of a split computation are joined.
"""

from typing import Sequence, Tuple

import torch


def merge_attentions(outputs: Sequence[torch.Tensor], lse_tensors: Sequence[torch.Tensor]
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge attention outputs over disjoint key sets into the attention over their union.

    Like ``natten.merge_attentions``, for any number of leading dimensions: with
    ``lse = log(sum_i exp(lse_i))``, ``out = sum_i exp(lse_i - lse) * out_i``, in
    float32.

    Args:
        outputs: two or more tensors ``(..., NH, HD)`` of one shape, dtype and device
            (for example na3d's ``(B, T, H, W, NH, HD)``); any floating dtype.
        lse_tensors: one per output, ``(..., NH)`` (the outputs' shape without the
            head dim), on the same device: their natural-log log-sum-exps, as
            ``na3d.na3d(..., return_lse=True)`` returns them; any floating dtype.

    Returns:
        ``(output, lse)``: the output in the inputs' dtype, the lse in float32.
        Differentiable with respect to every output and lse (na3d's backward takes
        the gradient of its lse). Works on any device (plain PyTorch).

    Raises:
        TypeError: not lists or tuples of tensors.
        ValueError: fewer than two outputs, a count, shape, dtype or device that
            disagrees.

    Non-finite inputs: an lse of ``-inf`` (a query with no key in that set) gives
    its output weight 0, as long as some other set has keys for the query; a NaN
    propagates.

    Example:
        >>> import torch, na3d
        >>> q, k, v = (torch.randn(1, 4, 6, 8, 2, 16) for _ in range(3))
        >>> text_k, text_v = torch.randn(1, 5, 2, 16), torch.randn(1, 5, 2, 16)
        >>> local, local_lse = na3d.na3d(q, k, v, 3, return_lse=True)
        >>> scores = torch.einsum("bthwnd,bsnd->bthwns", q, text_k) * 16 ** -0.5
        >>> text = torch.einsum("bthwns,bsnd->bthwnd", scores.softmax(-1), text_v)
        >>> out, lse = na3d.merge_attentions([local, text], [local_lse, scores.logsumexp(-1)])
        >>> both = na3d.na3d(q, k, v, 3, additional_keys=text_k, additional_values=text_v)
        >>> torch.allclose(out, both, atol=1e-5)
        True
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
