"""The public API (``na3d.na3d``, ``na1d``, ``na2d``, ``na3d_flash_attn``).

Validation: bad input raises ValueError/TypeError naming the argument, before any
launch. Features (NATTEN's beyond the base case: even kernels, dilation, causal
axes, strides, grouped-query attention, return_lse, additional keys, na1d/na2d):
random configurations (a new seed per case) through the kernels (the Triton
interpreter on a CPU-only machine, the compiled kernels on a GPU, where bf16 joins)
and through the PyTorch reference path, against the float64 oracle, and against
NATTEN itself on its CPU backend.
"""

import doctest
import itertools

import pytest
import torch

import na3d
from na3d import api, launch, reference
from helpers import assert_grads_match_oracle, assert_matches_oracle, make_qkv, random_config, slow_except


@pytest.fixture
def qkv():
    return tuple(torch.randn(1, 3, 4, 5, 2, 16) for _ in range(3))


@pytest.fixture
def no_launch(monkeypatch):
    """Any launch during a validation test is a failure: checks must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("a kernel or reference ran before validation finished")

    monkeypatch.setattr(launch, "na3d_forward", refuse)
    monkeypatch.setattr(reference, "na3d_sdpa_exact", refuse)


def call(q, k, v, kernel_size=3, **kw):
    return na3d.na3d(q, k, v, kernel_size, **kw)


@pytest.mark.usefixtures("no_launch")
class TestValidation:
    """Bad input raises ValueError/TypeError naming the argument, before any launch."""

    def test_not_a_tensor(self, qkv):
        q, k, v = qkv
        with pytest.raises(TypeError, match="key must be a torch.Tensor"):
            call(q, k.numpy(), v)

    @pytest.mark.parametrize("shape", [(3, 4, 5, 2, 16), (1, 1, 3, 4, 5, 2, 16)])
    def test_wrong_rank(self, qkv, shape):
        q, k, v = qkv
        with pytest.raises(ValueError, match=r"query must have rank 6.*query.shape="):
            call(torch.randn(shape), k, v)

    def test_shapes_differ(self, qkv):
        q, k, v = qkv
        with pytest.raises(ValueError, match="every dimension but the heads"):
            call(q, k, torch.randn(1, 3, 4, 5, 1, 16))          # key and value heads differ
        with pytest.raises(ValueError, match="every dimension but the heads"):
            call(q, torch.randn(1, 3, 4, 6, 2, 16), v)
        with pytest.raises(ValueError, match="every dimension but the heads"):
            call(q, k[..., :8], v[..., :8])                     # head dims differ
        with pytest.raises(ValueError, match=r"query heads \(2\) must be a multiple of key/value heads \(3\)"):
            x = torch.randn(1, 3, 4, 5, 3, 16)
            call(q, x, x)

    def test_dtypes_differ_or_unsupported(self, qkv):
        q, k, v = qkv
        with pytest.raises(TypeError, match="share one dtype"):
            call(q, k.half(), v)
        with pytest.raises(TypeError, match=r"query.dtype=torch.float64 is not supported"):
            call(q.double(), k.double(), v.double())
        with pytest.raises(TypeError, match="not supported"):
            call(q.to(torch.int32), k, v)

    def test_devices_differ(self, qkv):
        q, k, v = qkv
        with pytest.raises(ValueError, match="one device"):
            call(q, k.to("meta"), v)

    @pytest.mark.parametrize("kernel_size,pattern", [
        (0, "must be at least 1"),
        (-1, "must be at least 1"),
        ((3, 3, 7), "along W the kernel must be at least 1 and kernel \\* dilation at most the input size 5; got 7"),
        ((5, 3, 3), "along T"),
        ((3, 5, 3), "along H the kernel must be at least 1 and kernel \\* dilation at most the input size 4"),
        ((3, 3), "tuple of 3"),
        ((3, 3, 3, 3), "tuple of 3"),
        (3.0, "must be an int"),
        ((3, 3, True), "tuple of 3"),
        ("3", "must be an int"),
    ])
    def test_bad_kernel_size(self, qkv, kernel_size, pattern):
        q, k, v = qkv
        with pytest.raises((ValueError, TypeError), match=pattern):
            call(q, k, v, kernel_size)

    @pytest.mark.parametrize("head_dim", [4, 12, 264, 512])
    def test_unsupported_head_dim(self, head_dim):
        q = torch.randn(1, 3, 3, 3, 1, head_dim)
        with pytest.raises(ValueError, match=f"head dim {head_dim}"):
            call(q, q, q)

    def test_innermost_stride(self, qkv):
        q, k, v = qkv
        bad = torch.randn(1, 3, 4, 5, 2, 32)[..., ::2]
        with pytest.raises(ValueError, match=r"value must have innermost stride 1.*stride\(\)="):
            call(q, k, bad)

    def test_scale_and_flags(self, qkv):
        q, k, v = qkv
        with pytest.raises(TypeError, match="scale"):
            call(q, k, v, scale="0.1")
        with pytest.raises(TypeError, match="scale"):
            call(q, k, v, scale=float("nan"))
        with pytest.raises(TypeError, match="return_lse"):
            call(q, k, v, return_lse=1)
        with pytest.raises(TypeError, match="is_causal"):
            call(q, k, v, is_causal=(True, False))
        with pytest.raises(TypeError, match="dilation"):
            call(q, k, v, dilation=(1, 1))

    def test_bad_dilation(self, qkv):
        q, k, v = qkv
        with pytest.raises(ValueError, match=r"dilation=\(1, 1, 0\): along W it must be at least 1"):
            call(q, k, v, 1, dilation=(1, 1, 0))
        with pytest.raises(ValueError, match=r"kernel \* dilation at most the input size 5; got 3 \* 2"):
            call(q, k, v, 3, dilation=(1, 1, 2))

    @pytest.mark.parametrize("stride,message", [(0, "at least 1"), ((1, 4, 1), "at most the kernel size 3"),
                                                ((1, 2), "tuple of 3 ints"), (1.5, "must be an int")])
    def test_stride_is_validated(self, qkv, stride, message):
        q, k, v = qkv
        with pytest.raises((ValueError, TypeError), match=message):
            call(q, k, v, 3, stride=stride)

    def test_grad_is_never_dropped(self, qkv, monkeypatch):
        q, k, v = qkv
        monkeypatch.undo()
        out = call(q.clone().requires_grad_(), k, v)
        assert out.requires_grad and out.grad_fn is not None

    def test_flash_attn_validates_too(self, qkv):
        q, k, v = qkv
        with pytest.raises(ValueError, match="kernel_size"):
            na3d.na3d_flash_attn(q, k, v, (3, 3, 9))

    def test_even_kernels_are_accepted(self, qkv, monkeypatch):
        monkeypatch.undo()
        q, k, v = qkv
        assert call(q, k, v, (2, 4, 4)).shape == q.shape

    def test_numpy_scalars_are_accepted(self, qkv, monkeypatch):
        # NumPy integers and bools wherever Python ones are (kernel sizes read from an
        # array, flags from a config parsed by NumPy).
        np = pytest.importorskip("numpy")
        monkeypatch.undo()
        q, k, v = qkv
        want = call(q, k, v, (3, 3, 3), dilation=1, is_causal=(True, False, False), scale=0.25, return_lse=True)
        got = call(q, k, v, np.int64(3), dilation=np.int32(1), is_causal=(np.bool_(True), False, np.False_),
                   scale=np.float32(0.25), return_lse=np.bool_(True))
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        assert na3d.na1d(q[:, 0, 0], k[:, 0, 0], v[:, 0, 0], np.uint8(3)).shape == q[:, 0, 0].shape
        with pytest.raises(TypeError, match="kernel_size"):
            call(q, k, v, np.float64(3))
        with pytest.raises(TypeError, match="is_causal"):
            call(q, k, v, 3, is_causal=np.int64(1))

    @pytest.mark.parametrize("shape", [(0, 3, 4, 5, 2, 16), (1, 0, 4, 5, 2, 16), (2, 3, 0, 5, 2, 16),
                                       (1, 3, 4, 0, 2, 16)])
    def test_empty_batch_or_grid_gives_an_empty_result(self, shape):
        # One rule: an empty batch or grid gives an empty result (and empty gradients);
        # the kernel size is not compared with an empty grid's lengths.
        x = torch.randn(shape, requires_grad=True)
        out, lse = call(x, x, x, (3, 3, 3), return_lse=True)
        assert out.shape == x.shape and lse.shape == x.shape[:-1] and lse.dtype == torch.float32
        out.sum().backward()
        assert x.grad.shape == x.shape

    @pytest.mark.parametrize("shape,pattern", [((1, 3, 4, 5, 0, 16), "query must have at least one head"),
                                               ((0, 3, 4, 5, 2, 0), "head dim 0"),
                                               ((1, 0, 4, 5, 2, 12), "head dim 12")])
    def test_invalid_shapes_raise_even_when_empty(self, shape, pattern):
        x = torch.randn(shape)
        with pytest.raises(ValueError, match=pattern):
            call(x, x, x)

    def test_zero_key_heads_raise(self, qkv):
        q, _, _ = qkv
        empty_heads = torch.randn(1, 3, 4, 5, 0, 16)
        with pytest.raises(ValueError, match="key must have at least one head"):
            call(q, empty_heads, empty_heads)

    def test_empty_grid_still_checks_kernel_range(self):
        x = torch.randn(1, 0, 4, 5, 2, 16)
        with pytest.raises(ValueError, match="at least 1"):
            call(x, x, x, (3, 0, 3))


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS_RUN = DEVICE == "cuda" or launch.kernels_interpreted()
# The interpreter mishandles bf16 arithmetic, so bf16 runs on the GPU only.
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def qkv_for(shape, kv_heads, dtype, seed):
    q, k, v = make_qkv(shape, dtype, device=DEVICE, seed=seed)
    return q, k[..., :kv_heads, :], v[..., :kv_heads, :]


def on_reference_path(monkeypatch):
    """Force CPU calls onto the PyTorch reference, as without the interpreter."""
    monkeypatch.setattr(launch, "kernels_interpreted", lambda: False)


# --------------------------------------------------------------------------------
# Features through the kernels (interpreter or GPU)
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
@pytest.mark.parametrize("seed", slow_except([(seed,) for seed in range(4)], keep=(0, 2, 3)))
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
def causal_id(flags):
    return "".join("c" if x else "-" for x in flags)


@pytest.mark.parametrize("causal", slow_except([(c,) for c in CAUSAL_FLAGS], keep=(4,),
                                               ids=[causal_id(c) for c in CAUSAL_FLAGS]))
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
@pytest.mark.parametrize("kernel", [(2, 2, 2), (4, 1, 6), (2, 3, 4)])
def test_even_kernels(kernel):
    shape = (1, 5, 6, 7, 2, 16)
    q, k, v = make_qkv(shape, torch.float32, device=DEVICE, seed=sum(kernel))
    out = na3d.na3d(q, k, v, kernel)
    assert_matches_oracle(out.cpu(), q.cpu(), k.cpu(), v.cpu(), kernel, 0.25)


@kernels_only
@pytest.mark.parametrize("kv_heads", [1, 2], ids=["mqa", "gqa"])
def test_mqa_and_gqa_run_in_one_launch_on_the_key_value_heads(kv_heads, monkeypatch):
    """The kernels map each query head to its key/value head: one forward call on
    the key and value tensors as given (no per-head split, no copy)."""
    shape, kernel = (1, 3, 4, 5, 4, 16), (3, 3, 3)
    q, k, v = make_qkv(shape, torch.float32, device=DEVICE, seed=3)
    seen = []
    real = launch.na3d_forward

    def spy(qq, kk, vv, *args, **kwargs):
        seen.append((qq.data_ptr(), kk.data_ptr(), vv.data_ptr(), kk.shape[4]))
        return real(qq, kk, vv, *args, **kwargs)

    monkeypatch.setattr(launch, "na3d_forward", spy)
    k1, v1 = k[..., :kv_heads, :], v[..., :kv_heads, :]
    out = na3d.na3d(q, k1, v1, kernel)
    assert seen == [(q.data_ptr(), k1.data_ptr(), v1.data_ptr(), kv_heads)]
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


@pytest.mark.parametrize("causal", CAUSAL_FLAGS[1:], ids=causal_id)
def test_reference_path_causal_flags(causal, monkeypatch):
    on_reference_path(monkeypatch)
    shape, kernel = (1, 6, 5, 7, 2, 16), (3, 2, 4)
    q, k, v = make_qkv(shape, torch.float32, seed=40)
    out, lse = na3d.na3d(q, k, v, kernel, is_causal=causal, return_lse=True)
    want, want_lse = na3d.na3d_brute_force(q, k, v, kernel, is_causal=causal, return_lse=True)
    torch.testing.assert_close(out.double(), want.double(), rtol=0, atol=2e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=2e-6)

# --------------------------------------------------------------------------------
# The 1-D / 2-D entry points, NATTEN, strides, additional keys
# --------------------------------------------------------------------------------

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


@pytest.mark.slow
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
@pytest.mark.slow
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


@pytest.mark.slow
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


ADDITIONAL_KEYS_CASES = [(path, kv_heads) for kv_heads in (2, 1) for path in ("kernels", "reference")]


@pytest.mark.parametrize("path,kv_heads", slow_except(
    ADDITIONAL_KEYS_CASES, keep=(0, 1, 3), ids=[f"{kv_heads}-{path}" for path, kv_heads in ADDITIONAL_KEYS_CASES]))
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


GPU_FEATURES = [
    dict(kernel=(3, 7, 7), is_causal=(True, False, False)),
    dict(kernel=(3, 5, 5), is_causal=(True, True, True)),
    dict(kernel=(2, 4, 6), is_causal=(False, True, False)),
    dict(kernel=(3, 5, 5), dilation=(1, 2, 3)),
    dict(kernel=(4, 3, 5), dilation=(2, 1, 1), is_causal=(True, False, False)),
    dict(kernel=(3, 7, 7), kv_heads=1),
    dict(kernel=(5, 5, 5), kv_heads=2, is_causal=(False, False, True)),
    dict(kernel=(7, 15, 19), is_causal=(True, False, False)),
    dict(kernel=(3, 7, 7), stride=(1, 2, 3)),
    dict(kernel=(4, 5, 6), stride=(2, 5, 4), is_causal=(True, False, False)),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", GPU_FEATURES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()).replace(" ", ""))
def test_features_forward_and_backward(case, dtype):
    """Causal axes, dilation and GQA at 16-bit on the GPU kernels (the tables' real
    configs), forward and backward, against float32 autograd through the brute force;
    tolerance from the same brute force run at the test dtype."""
    case = dict(case)
    kernel, kv_heads = case.pop("kernel"), case.pop("kv_heads", 4)
    shape = (2, 8, 16, 20, 4, 64)
    q, k, v = make_qkv(shape, dtype, device="cuda", seed=7)
    k, v = k[..., :kv_heads, :], v[..., :kv_heads, :]
    grad_out = torch.randn(shape, dtype=dtype, device="cuda")
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = na3d.na3d(*leaves, kernel, **case)
    out.backward(grad_out)

    def brute(dt, compute_dtype):
        ref = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        o = na3d.na3d_brute_force(*ref, kernel, compute_dtype=compute_dtype, **case)
        o.backward(grad_out.to(dt))
        return [o] + [t.grad for t in ref]

    oracle = brute(torch.float32, torch.float32)
    same_math = brute(dtype, None)
    for name, got, want, pt in zip(("out", "dq", "dk", "dv"), [out] + [t.grad for t in leaves], oracle, same_math):
        assert not torch.isnan(got).any(), f"{name} has NaNs"
        err = (got.float() - want.float()).abs().max().item()
        tol = 2 * (pt.float() - want.float()).abs().max().item() + 2 * torch.finfo(dtype).eps * max(
            1.0, want.abs().max().item())
        assert err <= tol, f"{name}: max abs error {err:.3e} > tolerance {tol:.3e}"


def test_docstring_examples():
    assert doctest.testmod(api).failed == 0


def test_assume_finite_is_validated_and_changes_nothing_on_finite_inputs(qkv, monkeypatch):
    # The opt-out of the non-finite check: a bool; on finite inputs the same results,
    # bit for bit (the check only decides whether a tile is computed again).
    q, k, v = qkv
    with pytest.raises(TypeError, match="assume_finite"):
        call(q, k, v, assume_finite=1)
    monkeypatch.undo()
    want = call(q, k, v, (3, 3, 3), return_lse=True)
    got = call(q, k, v, (3, 3, 3), return_lse=True, assume_finite=True)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    flash = na3d.na3d_flash_attn(q * 0.25, k, v, 3, assume_finite=True)
    assert torch.equal(flash, na3d.na3d_flash_attn(q * 0.25, k, v, 3))
