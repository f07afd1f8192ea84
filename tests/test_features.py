"""NATTEN's features beyond the base case: even kernels, dilation, causal axes,
strides, grouped-query attention, return_lse and merging, na1d/na2d.

Random configurations (a new seed per case) through the kernels (the Triton
interpreter on a CPU-only machine, the compiled kernels on a GPU) and through the
PyTorch reference path, against the float64 oracle; the oracle itself is checked
against NATTEN where NATTEN is installed.
"""

import itertools
import random

import pytest
import torch

import na3d
from na3d import launch
from helpers import assert_grads_match_oracle, assert_matches_oracle, make_qkv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS_RUN = DEVICE == "cuda" or launch.kernels_interpreted()
# The interpreter mishandles bf16 arithmetic, so bf16 runs on the GPU only.
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


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


def qkv_for(shape, kv_heads, dtype, seed):
    q, k, v = make_qkv(shape, dtype, device=DEVICE, seed=seed)
    return q, k[..., :kv_heads, :], v[..., :kv_heads, :]


def on_reference_path(monkeypatch):
    """Force CPU calls onto the PyTorch reference, as without the interpreter."""
    monkeypatch.setattr(launch, "kernels_interpreted", lambda: False)


# --------------------------------------------------------------------------------
# The oracle is NATTEN's definition
# --------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_oracle_equals_natten(seed):
    natten = pytest.importorskip("natten")
    shape, kv_heads, kernel, dilation, _, stride = random_config(100 + seed, min_kernel=2)  # NATTEN rejects 1
    causal = tuple(random.Random(seed).choice([False, True]) for _ in range(3))
    q, k, v = (t.cpu().float() for t in qkv_for(shape, kv_heads, torch.float32, seed))
    want = natten.na3d(q, k, v, kernel_size=kernel, dilation=dilation, is_causal=causal, stride=stride)
    got = na3d.na3d_brute_force(q, k, v, kernel, dilation=dilation, is_causal=causal, compute_dtype=torch.float64,
                                stride=stride)
    torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------
# Kernels (interpreter or GPU)
# --------------------------------------------------------------------------------

kernels_only = pytest.mark.skipif(not KERNELS_RUN, reason="no GPU and the Triton interpreter is not active")


@kernels_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(5))
def test_forward_random_features(seed, dtype):
    shape, kv_heads, kernel, dilation, causal, stride = random_config(seed)
    q, k, v = qkv_for(shape, kv_heads, dtype, seed)
    out = na3d.na3d(q, k, v, kernel, stride=stride, dilation=dilation, is_causal=causal, scale=0.3)
    assert_matches_oracle(out.cpu(), q.cpu(), k.cpu(), v.cpu(), kernel, 0.3, dilation, causal, stride)


@kernels_only
@pytest.mark.parametrize("seed", range(4))
def test_backward_random_features(seed):
    shape, kv_heads, kernel, dilation, causal, stride = random_config(50 + seed, max_len=7)
    q, k, v = qkv_for(shape, kv_heads, torch.float32, seed)
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = na3d.na3d(*leaves, kernel, stride=stride, dilation=dilation, is_causal=causal, scale=0.3)
    (out * grad_out).sum().backward()
    assert_grads_match_oracle([t.grad for t in leaves], q, k, v, grad_out, kernel, 0.3, dilation=dilation,
                              is_causal=causal, stride=stride)


CAUSAL_FLAGS = list(itertools.product([False, True], repeat=3))


@kernels_only
@pytest.mark.parametrize("causal", CAUSAL_FLAGS, ids=lambda c: "".join("c" if x else "-" for x in c))
def test_causal_flags_forward_and_backward(causal):
    """Every combination of causal axes, on odd sizes with an even and an odd kernel
    and a kernel equal to its axis, forward (with lse) and backward."""
    shape, kernel = (2, 5, 6, 7, 2, 16), (2, 3, 7)
    q, k, v = make_qkv(shape, torch.float32, device=DEVICE, seed=sum(causal) + 20)
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(21)).to(DEVICE)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = na3d.na3d(*leaves, kernel, is_causal=causal, return_lse=True)
    assert_matches_oracle(out.detach().cpu(), q.cpu(), k.cpu(), v.cpu(), kernel, 0.25, is_causal=causal)
    _, want_lse = na3d.na3d_brute_force(q.cpu(), k.cpu(), v.cpu(), kernel, is_causal=causal, return_lse=True)
    torch.testing.assert_close(lse.detach().cpu().double(), want_lse, rtol=0, atol=1e-5)
    (out * grad_out).sum().backward()
    assert_grads_match_oracle([t.grad for t in leaves], q, k, v, grad_out, kernel, 0.25, is_causal=causal)


@kernels_only
@pytest.mark.parametrize("causal", [(True, False, False), (False, True, True)])
def test_causal_kernel_tiles(causal):
    """Causal windows through tiles cut by the grid's end and larger than an axis."""
    from na3d.configs import BackwardConfig, ForwardConfig
    from helpers import poisoned_like

    shape, kernel = (1, 3, 9, 10, 1, 16), (3, 4, 5)
    q, k, v = make_qkv(shape, torch.float32, device=DEVICE, seed=31)
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(32)).to(DEVICE)
    for fwd in (ForwardConfig((4, 2, 2), (1, 4, 4), 4, 1), ForwardConfig((1, 2, 8), (2, 1, 8), 4, 1)):
        out = poisoned_like(q)
        out, lse = launch.na3d_forward(q, k, v, kernel, 0.25, need_lse=True, out=out, config=fwd,
                                       is_causal=causal)
        assert_matches_oracle(out.cpu(), q.cpu(), k.cpu(), v.cpu(), kernel, 0.25, is_causal=causal)
    bwd = BackwardConfig((4, 4, 1), (1, 2, 8), (1, 2, 8), (4, 1, 4), 4, 1)
    grads = tuple(poisoned_like(t) for t in (q, k, v))
    launch.na3d_backward(grad_out, q, k, v, out, lse, kernel, 0.25, grads=grads, config=bwd, is_causal=causal)
    assert_grads_match_oracle(grads, q, k, v, grad_out, kernel, 0.25, is_causal=causal)


@kernels_only
@pytest.mark.parametrize("kernel", [(2, 2, 2), (4, 1, 6), (2, 3, 4)])
def test_even_kernels(kernel):
    shape = (1, 5, 6, 7, 2, 16)
    q, k, v = make_qkv(shape, torch.float32, device=DEVICE, seed=sum(kernel))
    out = na3d.na3d(q, k, v, kernel)
    assert_matches_oracle(out.cpu(), q.cpu(), k.cpu(), v.cpu(), kernel, 0.25)


@kernels_only
def test_mqa_and_gqa_views_are_not_copied(monkeypatch):
    shape, kernel = (1, 3, 4, 5, 4, 16), (3, 3, 3)
    q, k, v = make_qkv(shape, torch.float32, device=DEVICE, seed=3)
    seen = []
    real = launch.na3d_forward

    def spy(qq, kk, vv, *args, **kwargs):
        seen.append((kk.stride(4), kk.data_ptr()))
        return real(qq, kk, vv, *args, **kwargs)

    monkeypatch.setattr(launch, "na3d_forward", spy)
    k1, v1 = k[..., :1, :], v[..., :1, :]
    out = na3d.na3d(q, k1, v1, kernel)
    assert seen == [(0, k1.data_ptr())], "MQA must read the one key head through a zero-stride view"
    assert_matches_oracle(out.cpu(), q.cpu(), k1.cpu(), v1.cpu(), kernel, 0.25)


@kernels_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_lse_with_features(dtype):
    shape, kv_heads, kernel, dilation = (1, 6, 5, 8, 4, 16), 2, (2, 3, 3), (2, 1, 2)
    q, k, v = qkv_for(shape, kv_heads, dtype, 9)
    out, lse = na3d.na3d(q, k, v, kernel, dilation=dilation, return_lse=True)
    _, want = na3d.na3d_brute_force(q.cpu(), k.cpu(), v.cpu(), kernel, dilation=dilation, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == shape[:5]
    torch.testing.assert_close(lse.cpu().double(), want, rtol=0, atol=2e-3 if dtype == torch.float16 else 1e-5)


# --------------------------------------------------------------------------------
# The PyTorch reference path (CPU without the interpreter)
# --------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_reference_path_random_features(seed, monkeypatch):
    on_reference_path(monkeypatch)
    shape, kv_heads, kernel, dilation, causal, stride = random_config(200 + seed)
    q, k, v = (t.cpu() for t in qkv_for(shape, kv_heads, torch.float32, seed))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = na3d.na3d(*leaves, kernel, stride=stride, dilation=dilation, is_causal=causal, return_lse=True)
    want, want_lse = na3d.na3d_brute_force(q, k, v, kernel, dilation=dilation, is_causal=causal, return_lse=True,
                                           stride=stride)
    torch.testing.assert_close(out.double(), want.double(), rtol=0, atol=2e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=2e-6)
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(14))
    (out * grad_out).sum().backward()
    assert_grads_match_oracle([t.grad for t in leaves], q, k, v, grad_out, kernel, shape[-1] ** -0.5,
                              dilation=dilation, is_causal=causal, stride=stride)


@pytest.mark.parametrize("causal", CAUSAL_FLAGS[1:], ids=lambda c: "".join("c" if x else "-" for x in c))
def test_reference_path_causal_flags(causal, monkeypatch):
    on_reference_path(monkeypatch)
    shape, kernel = (1, 6, 5, 7, 2, 16), (3, 2, 4)
    q, k, v = make_qkv(shape, torch.float32, seed=40)
    out, lse = na3d.na3d(q, k, v, kernel, is_causal=causal, return_lse=True)
    want, want_lse = na3d.na3d_brute_force(q, k, v, kernel, is_causal=causal, return_lse=True)
    torch.testing.assert_close(out.double(), want.double(), rtol=0, atol=2e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=2e-6)


# --------------------------------------------------------------------------------
# Merging, and the 1-D / 2-D entry points
# --------------------------------------------------------------------------------

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


def test_na1d_na2d_match_na3d_and_natten():
    gen = torch.Generator().manual_seed(5)
    x1 = [torch.randn(2, 13, 2, 16, generator=gen) for _ in range(3)]
    o1, l1 = na3d.na1d(*x1, 4, dilation=2, return_lse=True)
    w1 = na3d.na3d_brute_force(*(t[:, None, None] for t in x1), (1, 1, 4), dilation=(1, 1, 2))[:, 0, 0]
    assert o1.shape == x1[0].shape and l1.shape == x1[0].shape[:3]
    torch.testing.assert_close(o1.double(), w1.double(), rtol=0, atol=2e-6)
    x2 = [torch.randn(1, 7, 9, 2, 16, generator=gen) for _ in range(3)]
    o2 = na3d.na2d(*x2, (3, 4))
    w2 = na3d.na3d_brute_force(*(t[:, None] for t in x2), (1, 3, 4))[:, 0]
    torch.testing.assert_close(o2.double(), w2.double(), rtol=0, atol=2e-6)
    natten = pytest.importorskip("natten")
    torch.testing.assert_close(o1, natten.na1d(*x1, 4, dilation=2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o2, natten.na2d(*x2, (3, 4)), rtol=1e-5, atol=1e-5)


def test_lower_rank_errors_name_their_layout():
    x = torch.randn(1, 5, 2, 16)
    with pytest.raises(ValueError, match=r"na2d: query must have rank 5 \(B, X, Y, NH, HD\)"):
        na3d.na2d(x, x, x, 3)
    with pytest.raises(TypeError, match="kernel_size"):
        na3d.na1d(x, x, x, (3, 3))


def test_causal_matches_natten():
    natten = pytest.importorskip("natten")
    gen = torch.Generator().manual_seed(41)
    q, k, v = (torch.randn(1, 6, 5, 7, 2, 16, generator=gen) for _ in range(3))
    for causal in CAUSAL_FLAGS[1:]:
        got = na3d.na3d(q, k, v, (3, 2, 4), dilation=(1, 2, 1), is_causal=causal)
        want = natten.na3d(q, k, v, kernel_size=(3, 2, 4), dilation=(1, 2, 1), is_causal=causal)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


STRIDE_CASES = [((2, 3, 4), (1, 3, 2), (False, False, False)), ((3, 4, 5), (3, 2, 5), (True, False, False)),
                ((2, 5, 3), (2, 4, 3), (False, True, True))]


@kernels_only
@pytest.mark.parametrize("kernel,stride,causal", STRIDE_CASES)
def test_strides_forward_and_backward(kernel, stride, causal):
    """Strides (even, odd, equal to the kernel), with and without causal axes,
    through the kernels, forward (with lse) and backward."""
    shape = (2, 7, 9, 8, 2, 16)
    q, k, v = make_qkv(shape, torch.float32, device=DEVICE, seed=sum(stride))
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(22)).to(DEVICE)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = na3d.na3d(*leaves, kernel, stride=stride, is_causal=causal, return_lse=True)
    assert_matches_oracle(out.detach().cpu(), q.cpu(), k.cpu(), v.cpu(), kernel, 0.25, is_causal=causal,
                          stride=stride)
    _, want_lse = na3d.na3d_brute_force(q.cpu(), k.cpu(), v.cpu(), kernel, is_causal=causal, return_lse=True,
                                        stride=stride)
    torch.testing.assert_close(lse.detach().cpu().double(), want_lse, rtol=0, atol=1e-5)
    (out * grad_out).sum().backward()
    assert_grads_match_oracle([t.grad for t in leaves], q, k, v, grad_out, kernel, 0.25, is_causal=causal,
                              stride=stride)


def test_strides_match_natten():
    natten = pytest.importorskip("natten")
    gen = torch.Generator().manual_seed(42)
    q, k, v = (torch.randn(1, 7, 9, 8, 2, 16, generator=gen) for _ in range(3))
    for kernel, stride, causal in STRIDE_CASES:
        got = na3d.na3d(q, k, v, kernel, stride=stride, is_causal=causal)
        want = natten.na3d(q, k, v, kernel_size=kernel, stride=stride, is_causal=causal)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def dense_with_extra_tokens(q, k, v, ek, ev, kernel, scale, **features):
    """float64 oracle: masked dense attention over the grid plus the extra tokens."""
    B, T, H, W, NH, HD = q.shape
    n, group = T * H * W, NH // k.shape[4]
    keys = torch.cat([k.reshape(B, n, -1, HD), ek], 1).double().repeat_interleave(group, 2).transpose(1, 2)
    vals = torch.cat([v.reshape(B, n, -1, HD), ev], 1).double().repeat_interleave(group, 2).transpose(1, 2)
    mask = torch.cat([na3d.geometry.neighborhood_mask((T, H, W), kernel, features.get("dilation"),
                                                      features.get("is_causal"), stride=features.get("stride")),
                      torch.ones(n, ek.shape[1], dtype=torch.bool)], 1)
    s = (q.reshape(B, n, NH, HD).double().transpose(1, 2) @ keys.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    out = (torch.softmax(s, -1) @ vals).transpose(1, 2).reshape(q.shape)
    return out, torch.logsumexp(s, -1).transpose(1, 2).reshape(q.shape[:5])


@pytest.mark.parametrize("path", ["kernels", "reference"])
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_additional_keys_forward_and_backward(path, kv_heads, monkeypatch):
    if path == "reference":
        on_reference_path(monkeypatch)
    elif not KERNELS_RUN:
        pytest.skip("no GPU and the Triton interpreter is not active")
    device = DEVICE if path == "kernels" else "cpu"
    shape, kernel, features = (2, 3, 5, 6, 2, 16), (3, 3, 4), dict(is_causal=(True, False, False), stride=(1, 2, 1))
    q, k, v = make_qkv(shape, torch.float32, device=device, seed=43)
    k, v = k[..., :kv_heads, :], v[..., :kv_heads, :]
    gen = torch.Generator().manual_seed(44)
    ek, ev = (torch.randn(2, 5, kv_heads, 16, generator=gen).to(device) for _ in range(2))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, ek, ev)]
    out, lse = na3d.na3d(*leaves[:3], kernel, additional_keys=leaves[3], additional_values=leaves[4],
                         return_lse=True, **features)
    ref = [t.detach().cpu().double().requires_grad_() for t in (q, k, v, ek, ev)]
    want, want_lse = dense_with_extra_tokens(*ref, kernel, 0.25, **features)
    torch.testing.assert_close(out.detach().cpu().double(), want.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.detach().cpu().double(), want_lse.detach(), rtol=0, atol=1e-5)
    grad_out = torch.randn(shape, generator=gen)
    (out * grad_out.to(device)).sum().backward()
    (want * grad_out.double()).sum().backward()
    for got, exp in zip(leaves, ref):
        torch.testing.assert_close(got.grad.cpu().double(), exp.grad, rtol=0, atol=5e-5)


def test_additional_keys_match_natten_and_are_validated():
    gen = torch.Generator().manual_seed(45)
    q, k, v = (torch.randn(1, 4, 5, 6, 2, 16, generator=gen) for _ in range(3))
    ek, ev = (torch.randn(1, 7, 2, 16, generator=gen) for _ in range(2))
    with pytest.raises(ValueError, match="together"):
        na3d.na3d(q, k, v, 3, additional_keys=ek)
    with pytest.raises(ValueError, match=r"additional_values must have shape \(B, S, NKV, HD\)"):
        na3d.na3d(q, k, v, 3, additional_keys=ek, additional_values=ev[..., :8])
    with pytest.raises(ValueError, match="same number of tokens"):
        na3d.na3d(q, k, v, 3, additional_keys=ek, additional_values=ev[:, :3])
    natten = pytest.importorskip("natten")
    got = na3d.na3d(q, k, v, (3, 2, 4), additional_keys=ek, additional_values=ev)
    want = natten.na3d(q, k, v, kernel_size=(3, 2, 4), additional_keys=ek, additional_values=ev)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    x = [torch.randn(1, 11, 2, 16, generator=gen) for _ in range(3)]
    torch.testing.assert_close(na3d.na1d(*x, 3, additional_keys=ek, additional_values=ev),
                               natten.na1d(*x, 3, additional_keys=ek, additional_values=ev), rtol=1e-5, atol=1e-5)
