"""merge_attentions: attention over disjoint key sets merged into attention over their union."""

import doctest

import pytest
import torch

import na3d
from na3d import merge
from helpers import make_qkv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_merge_neighborhood_with_extra_tokens():
    """Neighborhood attention merged with attention over extra (e.g. text) tokens
    equals attention over the union, forward and backward."""
    shape, kernel, extra = (1, 3, 4, 5, 2, 16), (3, 3, 3), 7
    B, T, H, W, NH, HD = shape
    n = T * H * W
    q, k, v = make_qkv(shape, torch.float32, device=DEVICE, seed=12)
    gen = torch.Generator().manual_seed(13)
    ek, ev = (torch.randn(B, extra, NH, HD, generator=gen).to(DEVICE) for _ in range(2))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, ek, ev)]
    lq, lk, lv, lek, lev = leaves
    out_na, lse_na = na3d.na3d(lq, lk, lv, kernel, return_lse=True)
    scores = torch.einsum("bthwnd,bend->bthwne", lq, lek) * HD ** -0.5
    lse_x = torch.logsumexp(scores, -1)
    out_x = torch.einsum("bthwne,bend->bthwnd", torch.softmax(scores, -1), lev)
    out, lse = na3d.merge_attentions([out_na, out_x], [lse_na, lse_x])
    grad_out = torch.randn(shape, generator=gen).to(DEVICE)
    (out * grad_out).sum().backward()

    # Oracle: dense float64 attention over the grid plus the extra tokens.
    ref = [t.detach().double().cpu().requires_grad_() for t in (q, k, v, ek, ev)]
    rq, rk, rv, rek, rev = ref
    keys = torch.cat([rk.reshape(B, n, NH, HD), rek], 1).transpose(1, 2)
    vals = torch.cat([rv.reshape(B, n, NH, HD), rev], 1).transpose(1, 2)
    mask = torch.cat([na3d.geometry.neighborhood_mask((T, H, W), kernel), torch.ones(n, extra, dtype=torch.bool)], 1)
    s = (rq.reshape(B, n, NH, HD).transpose(1, 2) @ keys.transpose(-1, -2)) * HD ** -0.5
    s = s.masked_fill(~mask, float("-inf"))
    want = (torch.softmax(s, -1) @ vals).transpose(1, 2).reshape(shape)
    want_lse = torch.logsumexp(s, -1).transpose(1, 2).reshape(shape[:5])
    (want * grad_out.double().cpu()).sum().backward()
    torch.testing.assert_close(out.double().cpu(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double().cpu(), want_lse, rtol=0, atol=1e-5)
    for got, exp in zip(leaves, ref):
        torch.testing.assert_close(got.grad.double().cpu(), exp.grad, rtol=0, atol=5e-5)


def test_merge_attentions_validates():
    a = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="at least two"):
        na3d.merge_attentions([a], [a[..., 0]])
    with pytest.raises(ValueError, match="lse_tensors\\[1\\]"):
        na3d.merge_attentions([a, a], [a[..., 0], a])
    with pytest.raises(TypeError):
        na3d.merge_attentions(a, a)


def test_docstring_examples():
    assert doctest.testmod(merge).failed == 0
