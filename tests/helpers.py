"""Shared test helpers: input layouts, the derived-tolerance comparison, poisoning,
random feature configurations, a tiny LTX-2.5 decoder config."""

from __future__ import annotations

import math
import random

import pytest
import torch

import na3d

LAYOUTS = ("contiguous", "fused_qkv", "fused_heads", "heads_first")


def make_qkv(shape, dtype, layout="contiguous", device="cpu", seed=0):
    """q, k, v of ``shape = (B, T, H, W, NH, HD)`` laid out as a model would hand them over.

    * ``contiguous``: three separate tensors;
    * ``fused_qkv``: slices of one ``(B, T, H, W, 3 * NH * HD)`` projection, split on
      the last dim (what ``Linear(C, 3C)`` gives);
    * ``fused_heads``: ``(B, T, H, W, NH, 3, HD)`` indexed on dim -2;
    * ``heads_first``: ``(B, NH, T, H, W, HD)`` tensors permuted to heads-last.
    """
    B, T, H, W, NH, HD = shape
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*s):
        return torch.randn(*s, generator=g, dtype=torch.float32).to(dtype=dtype, device=device)

    if layout == "contiguous":
        return tuple(rand(*shape) for _ in range(3))
    if layout == "fused_qkv":
        x = rand(B, T, H, W, 3 * NH * HD)
        return tuple(t.unflatten(-1, (NH, HD)) for t in x.split(NH * HD, dim=-1))
    if layout == "fused_heads":
        x = rand(B, T, H, W, NH, 3, HD)
        return x[..., 0, :], x[..., 1, :], x[..., 2, :]
    if layout == "heads_first":
        return tuple(rand(B, NH, T, H, W, HD).permute(0, 2, 3, 4, 1, 5) for _ in range(3))
    raise ValueError(layout)


def tolerance(q, k, v, kernel_size, scale, oracle, dilation=(1, 1, 1), is_causal=(False, False, False),
              stride=(1, 1, 1)):
    """Allowed max abs error: twice PyTorch's own error at q's dtype, plus a rounding band.

    PyTorch's error is that of the same dense masked attention computed with tensors
    of q's dtype (``compute_dtype=None``), measured against the float64 oracle.
    """
    same_math = na3d.na3d_brute_force(q, k, v, kernel_size, scale=scale, dilation=dilation, is_causal=is_causal,
                                      compute_dtype=None, stride=stride)
    torch_err = (same_math.double() - oracle).abs().max().item()
    band = 2 * torch.finfo(q.dtype).eps * max(1.0, oracle.abs().max().item())
    return 2 * torch_err + band


def assert_matches_oracle(out, q, k, v, kernel_size, scale, dilation=(1, 1, 1), is_causal=(False, False, False),
                          stride=(1, 1, 1)):
    oracle = na3d.na3d_brute_force(q, k, v, kernel_size, scale=scale, dilation=dilation, is_causal=is_causal,
                                   stride=stride)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any(), "output has NaNs: an element was never written"
    err = (out.double() - oracle).abs().max().item()
    tol = tolerance(q, k, v, kernel_size, scale, oracle, dilation, is_causal, stride)
    assert err <= tol, f"max abs error {err:.3e} > tolerance {tol:.3e}"
    return err


def slow_except(cases, keep, ids=None):
    """``cases`` for ``pytest.mark.parametrize`` (each a tuple of the argument values),
    every case whose index is not in ``keep`` marked ``slow``: the default run takes a
    representative few, CI all of them. ``ids``: one per case, or None for pytest's."""
    return [pytest.param(*case, marks=() if i in keep else pytest.mark.slow, id=None if ids is None else str(ids[i]))
            for i, case in enumerate(cases)]


def poisoned_like(x):
    return torch.full_like(x, float("nan"))


def default_scale(q):
    return q.shape[-1] ** -0.5


def numel(shape):
    return math.prod(shape)


def grads_of(fn, q, k, v, grad_out):
    """(dq, dk, dv) of ``sum(fn(q, k, v) * grad_out)``, on fresh leaf copies."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(grad_out)
    return [t.grad for t in leaves]


def flash_style_grads(q, k, v, grad_out, kernel_size, scale, grad_lse=None, dilation=(1, 1, 1),
                      is_causal=(False, False, False), stride=(1, 1, 1), forward=None):
    """dq, dk, dv by the flash-attention backward formulas, in PyTorch at q's dtype.

    Matrix products take q's dtype (as the kernels' tensor-core inputs do), softmax
    statistics float32: ``P = exp(S - lse)``, ``delta = rowsum(dO * O)``,
    ``dS = P (dO V^T - delta + dlse)``. This is "the same math" whose error against
    the float64 oracle sets the kernels' tolerance.

    ``forward``: None, or the ``(out, lse)`` a forward produced, which the backward
    then reads as the kernels' backward does (``P`` from that lse, ``delta`` from that
    out) instead of computing its own. Their rounding is part of the backward's inputs:
    an lse off by one ulp scales a whole row of ``P`` by ``1 + 1e-7`` (fp32), and where
    one key dominates a row that moves a gradient element by far more than the
    backward's own arithmetic does (NOTES v43).
    """
    B, T, H, W, NH, HD = q.shape
    n, dt = T * H * W, q.dtype
    mask = na3d.geometry.neighborhood_mask((T, H, W), kernel_size, dilation, is_causal, device=q.device,
                                           stride=stride)
    group = NH // k.shape[4]

    def hf(x):
        return x.reshape(B, n, x.shape[-2], x.shape[-1]).transpose(1, 2)

    qf, dof = hf(q), hf(grad_out)
    kf, vf = (hf(x).repeat_interleave(group, dim=1) for x in (k, v))
    s = (qf @ kf.transpose(-1, -2)).float() * scale
    s = s.masked_fill(~mask, float("-inf"))
    if forward is None:
        p = torch.exp(s - torch.logsumexp(s, -1, keepdim=True))
        o = p.to(dt) @ vf
    else:
        out, lse = (x.to(q.device) for x in forward)
        p = torch.exp(s - lse.reshape(B, n, NH).transpose(1, 2).unsqueeze(-1).float())
        o = hf(out)
    delta = (dof.float() * o.float()).sum(-1, keepdim=True)
    if grad_lse is not None:
        delta = delta - grad_lse.reshape(B, n, NH).transpose(1, 2).unsqueeze(-1).float()
    ds = p * ((dof @ vf.transpose(-1, -2)).float() - delta)
    dq = (ds.to(dt) @ kf).float() * scale
    dk = (ds.to(dt).transpose(-1, -2) @ qf).float() * scale
    dv = p.to(dt).transpose(-1, -2) @ dof

    def back(x, heads=NH):
        if heads != NH:  # grouped-query attention: key/value heads sum their query heads
            x = x.unflatten(1, (heads, group)).sum(2)
        return x.transpose(1, 2).reshape(B, T, H, W, heads, x.shape[-1]).to(dt)

    return back(dq), back(dk.float(), k.shape[4]), back(dv.float(), k.shape[4])


def oracle_grads(q, k, v, grad_out, kernel_size, scale, grad_lse=None, dilation=(1, 1, 1),
                 is_causal=(False, False, False), stride=(1, 1, 1)):
    """float64 autograd through the brute force, for ``sum(out * dO) + sum(lse * dlse)``."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, lse = na3d.na3d_brute_force(*leaves, kernel_size, scale=scale, dilation=dilation, is_causal=is_causal,
                                     return_lse=True, stride=stride)
    loss = (out * grad_out.double()).sum()
    if grad_lse is not None:
        loss = loss + (lse * grad_lse.double()).sum()
    loss.backward()
    return [t.grad for t in leaves]


def assert_lse_matches_oracle(lse, q, k, v, kernel_size, scale, dilation=(1, 1, 1), is_causal=(False, False, False),
                              stride=(1, 1, 1)):
    """A forward's float32 log-sum-exp against the float64 oracle's: twice the error of
    PyTorch's float32 logsumexp over the same scores at q's dtype, plus a float32
    rounding band."""
    kw = dict(scale=scale, dilation=dilation, is_causal=is_causal, stride=stride, return_lse=True)
    want = na3d.na3d_brute_force(q.double(), k.double(), v.double(), kernel_size, **kw)[1]
    same = na3d.na3d_brute_force(q, k, v, kernel_size, compute_dtype=None, **kw)[1]
    assert lse.shape == want.shape and lse.dtype == torch.float32, (lse.shape, want.shape, lse.dtype)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(lse.cpu()), finite), "lse is non-finite where the oracle's is finite, or back"
    err = (lse.cpu().double() - want)[finite].abs().max().item()
    tol = 2 * (same.double() - want)[finite].abs().max().item() + 2 * torch.finfo(torch.float32).eps * max(
        1.0, want[finite].abs().max().item())
    assert err <= tol, f"lse: max abs error {err:.3e} > tolerance {tol:.3e}"


def assert_grads_match_oracle(grads, q, k, v, grad_out, kernel_size, scale, grad_lse=None, dilation=(1, 1, 1),
                              is_causal=(False, False, False), stride=(1, 1, 1), forward=None):
    """Kernel gradients against float64 autograd through the brute force.

    Tolerance per tensor: twice the error of the same math (``flash_style_grads`` at
    q's dtype), plus a rounding band. Everything is compared on the CPU.

    ``forward``: the ``(out, lse)`` the backward was given. The same math then reads
    them too (its error carries their rounding, as the kernels' does); first, each
    is checked against the oracle at its own derived tolerance, so a wrong forward
    cannot widen the backward's.
    """
    grads = [g.cpu() for g in grads]
    q, k, v, grad_out = (t.cpu() for t in (q, k, v, grad_out))
    grad_lse = grad_lse.cpu() if grad_lse is not None else None
    if forward is not None:
        forward = tuple(x.cpu() for x in forward)
        assert_matches_oracle(forward[0], q, k, v, kernel_size, scale, dilation, is_causal, stride)
        assert_lse_matches_oracle(forward[1], q, k, v, kernel_size, scale, dilation, is_causal, stride)
    oracle = oracle_grads(q, k, v, grad_out, kernel_size, scale, grad_lse, dilation, is_causal, stride)
    same = flash_style_grads(q, k, v, grad_out, kernel_size, scale, grad_lse, dilation, is_causal, stride, forward)
    errors = {}
    for name, g, want, pt in zip(("dq", "dk", "dv"), grads, oracle, same):
        assert g.shape == want.shape and g.dtype == q.dtype, (name, g.shape, want.shape, g.dtype)
        assert not torch.isnan(g).any(), f"{name} has NaNs"
        err = (g.double() - want).abs().max().item()
        tol = 2 * (pt.double() - want).abs().max().item() + 2 * torch.finfo(q.dtype).eps * max(
            1.0, want.abs().max().item())
        assert err <= tol, f"{name}: max abs error {err:.3e} > tolerance {tol:.3e}"
        errors[name] = err
    return errors


def random_config(seed, max_len=9, min_kernel=1):
    """(shape, kv_heads, kernel, dilation, causal, stride) with kernel * dilation <= size
    and 1 <= stride <= kernel per axis."""
    rng = random.Random(seed)
    spatial, kernel, dilation, causal, stride = [], [], [], [], []
    for _ in range(3):
        d = rng.choice([1, 1, 2, 3])
        k = rng.randint(min_kernel, 4)
        L = rng.randint(k * d, max(k * d, max_len))
        spatial.append(L)
        kernel.append(k)
        dilation.append(d)
        causal.append(rng.random() < 0.4)
        stride.append(rng.randint(1, k) if rng.random() < 0.5 else 1)
    kv_heads = rng.choice([1, 2])
    heads = kv_heads * rng.choice([1, 2])
    shape = (rng.choice([1, 2]), *spatial, heads, 16)
    return shape, kv_heads, tuple(kernel), tuple(dilation), tuple(causal), tuple(stride)


# A small LTX-2.5 diffusion decoder (diffusers' LTX2VideoDiffusionDecoderModel), but
# complete: every stage, multi-head attention (head_dim 16: the RoPE splits it 4/6/6
# over T/H/W), kernels shifted inward along every axis, one of size 1, and non-cubic
# ones. The stage grids are 4x2x3, 4x4x6, 7x4x6, 13x8x12 and, at stage 5, 9x16x24 for
# a latent of 1x8x2x2x3.
TINY_CONFIG = dict(
    latent_channels=8,
    patch_size=2,
    decoder_head_dim=16,
    decoder_stage_channels=(64, 32, 32, 32, 32),
    decoder_stage_depths=(1, 1, 1, 1, 2),
    decoder_stage_kernels=((3, 1, 3), (3, 3, 5), (3, 3, 3), (3, 3, 3)),
    decoder_upsample_channel_reductions=(2, 1, 1, 1),
    decoder_stage5_kernel=(5, 5, 7),
    decoder_t_emb_dim=32,
    spatial_compression_ratio=16,
)
