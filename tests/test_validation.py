"""Bad input raises ValueError/TypeError naming the argument, before any launch."""

import pytest
import torch

import na3d
from na3d import launch, reference


@pytest.fixture
def qkv():
    return tuple(torch.randn(1, 3, 4, 5, 2, 16) for _ in range(3))


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Any launch during these tests is a failure: checks must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("a kernel or reference ran before validation finished")

    monkeypatch.setattr(launch, "na3d_forward", refuse)
    monkeypatch.setattr(reference, "na3d_sdpa_exact", refuse)


def call(q, k, v, kernel_size=3, **kw):
    return na3d.na3d(q, k, v, kernel_size, **kw)


def test_not_a_tensor(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match="key must be a torch.Tensor"):
        call(q, k.numpy(), v)


@pytest.mark.parametrize("shape", [(3, 4, 5, 2, 16), (1, 1, 3, 4, 5, 2, 16)])
def test_wrong_rank(qkv, shape):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"query must have rank 6.*query.shape="):
        call(torch.randn(shape), k, v)


def test_shapes_differ(qkv):
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


def test_dtypes_differ_or_unsupported(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match="share one dtype"):
        call(q, k.half(), v)
    with pytest.raises(TypeError, match=r"query.dtype=torch.float64 is not supported"):
        call(q.double(), k.double(), v.double())
    with pytest.raises(TypeError, match="not supported"):
        call(q.to(torch.int32), k, v)


def test_devices_differ(qkv):
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
def test_bad_kernel_size(qkv, kernel_size, pattern):
    q, k, v = qkv
    with pytest.raises((ValueError, TypeError), match=pattern):
        call(q, k, v, kernel_size)


@pytest.mark.parametrize("head_dim", [4, 12, 264, 512])
def test_unsupported_head_dim(head_dim):
    q = torch.randn(1, 3, 3, 3, 1, head_dim)
    with pytest.raises(ValueError, match=f"head dim {head_dim}"):
        call(q, q, q)


def test_innermost_stride(qkv):
    q, k, v = qkv
    bad = torch.randn(1, 3, 4, 5, 2, 32)[..., ::2]
    with pytest.raises(ValueError, match=r"value must have innermost stride 1.*stride\(\)="):
        call(q, k, bad)


def test_scale_and_flags(qkv):
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


def test_bad_dilation(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"dilation=\(1, 1, 0\): along W it must be at least 1"):
        call(q, k, v, 1, dilation=(1, 1, 0))
    with pytest.raises(ValueError, match=r"kernel \* dilation at most the input size 5; got 3 \* 2"):
        call(q, k, v, 3, dilation=(1, 1, 2))


@pytest.mark.parametrize("stride,message", [(0, "at least 1"), ((1, 4, 1), "at most the kernel size 3"),
                                            ((1, 2), "tuple of 3 ints"), (1.5, "must be an int")])
def test_stride_is_validated(qkv, stride, message):
    q, k, v = qkv
    with pytest.raises((ValueError, TypeError), match=message):
        call(q, k, v, 3, stride=stride)


def test_grad_is_never_dropped(qkv, monkeypatch):
    q, k, v = qkv
    monkeypatch.undo()
    out = call(q.clone().requires_grad_(), k, v)
    assert out.requires_grad and out.grad_fn is not None


def test_flash_attn_validates_too(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="kernel_size"):
        na3d.na3d_flash_attn(q, k, v, (3, 3, 9))


def test_even_kernels_are_accepted(qkv, monkeypatch):
    monkeypatch.undo()
    q, k, v = qkv
    assert call(q, k, v, (2, 4, 4)).shape == q.shape


def test_register_caps_in_configs():
    # A cap is None or a multiple of 8 the compiler accepts; unset, no keyword is
    # passed (AMD's backend rejects it); table entries carry it into the configs.
    from na3d import configs

    with pytest.raises(ValueError, match="maxnreg"):
        configs.ForwardConfig((1, 4, 4), (1, 4, 4), 4, 2, maxnreg=100)
    with pytest.raises(ValueError, match="dkdv_maxnreg"):
        configs.BackwardConfig((1, 4, 4), (1, 4, 4), (1, 4, 4), (1, 4, 4), 4, 1, dkdv_maxnreg=512)
    assert configs.maxnreg_option(None) == {}
    assert configs.maxnreg_option(128) == {"maxnreg": 128}
    entry = {"dq": [[2, 4, 8], [4, 4, 4]], "dkdv": [[2, 4, 8], [4, 4, 4]], "num_warps": 4, "num_stages": 1,
             "dq_maxnreg": 128, "dkdv_maxnreg": 168}
    bwd = configs.fit_backward(entry, (8, 16, 16), (3, 5, 5))
    assert (bwd.dq_maxnreg, bwd.dkdv_maxnreg) == (128, 168)
    for arch in ("sm90", "default"):
        for bucket_kernel in ((3, 5, 5), (11, 11, 11), (3, 5, 27)):
            configs.forward_config(arch, (16, 32, 32), bucket_kernel, 64, torch.bfloat16)
            configs.backward_config(arch, (16, 32, 32), bucket_kernel, 64, torch.bfloat16)


def test_bucket_alternatives_chosen_by_issued_products():
    # The 11x11x11 bucket's alternatives replace the option before them only where
    # the T borders make them issue at least 5 % fewer products: boxes 8 frames deep
    # on clips of 13-15 frames, boxes spanning a whole 16-frame clip on
    # ltx-stage5-small (head dims up to 64: their register cap), never on the long
    # clips the cubic boxes were tuned on; the choice carries the alternative's own
    # backward tiles, and comes from geometry alone.
    from na3d import configs, geometry

    kernel = (11, 11, 11)
    small = configs.forward_config("sm90", (16, 80, 32), kernel, 64, torch.bfloat16)
    assert small.bucket == "large_window/whole_clip"
    assert (small.q_tile, small.kv_tile, small.maxnreg) == ((16, 2, 2), (16, 4, 2), 168)
    wide = configs.forward_config("sm90", (16, 80, 32), kernel, 128, torch.bfloat16)
    assert (wide.bucket, wide.q_tile, wide.kv_tile, wide.maxnreg) == ("large_window/deep_boxes", (8, 4, 2), (1, 16, 4), None)
    for head_dim in (64, 128):
        bwd = configs.backward_config("sm90", (16, 80, 32), kernel, head_dim, torch.bfloat16)
        assert (bwd.dq_q_tile, bwd.dq_kv_tile, bwd.dkdv_k_tile) == ((8, 4, 2), (1, 16, 4), (4, 4, 4))
        assert (bwd.dq_maxnreg, bwd.dkdv_maxnreg, bwd.dkdv_stages) == (128, 168, 3)
    assert configs.forward_config("sm90", (14, 64, 64), kernel, 64, torch.bfloat16).bucket == "large_window/deep_boxes"
    for shape in ((79, 192, 192), (66, 128, 192), (79, 128, 192), (24, 80, 32), (12, 64, 64)):
        cfg = configs.forward_config("sm90", shape, kernel, 64, torch.bfloat16)
        assert cfg.bucket == "large_window", shape
        assert configs.backward_config("sm90", shape, kernel, 64, torch.bfloat16).dq_q_tile == (4, 4, 4)
    bucket = next(e for e in configs.load_table("sm90")["forward"] if e["bucket"] == "large_window")
    for shape in ((13, 40, 40), (15, 80, 32), (16, 80, 32), (16, 128, 128), (22, 96, 64), (30, 48, 48), (79, 192, 192)):
        cfg = configs.forward_config("sm90", shape, kernel, 64, torch.bfloat16)
        want, best = None, None
        for name, opt in configs.bucket_options(bucket):
            ratio = geometry.issued_flops_ratio(shape, kernel, *configs.fitted_tiles(opt["q_tile"], opt["kv_tile"], shape, kernel))
            if best is None or ratio < configs.ALTERNATIVE_MARGIN * best:
                want, best = name, ratio
        assert cfg.bucket == want, (shape, want)


def test_numpy_scalars_are_accepted(qkv, monkeypatch):
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
def test_empty_batch_or_grid_gives_an_empty_result(shape):
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
def test_invalid_shapes_raise_even_when_empty(shape, pattern):
    x = torch.randn(shape)
    with pytest.raises(ValueError, match=pattern):
        call(x, x, x)


def test_zero_key_heads_raise(qkv):
    q, _, _ = qkv
    empty_heads = torch.randn(1, 3, 4, 5, 0, 16)
    with pytest.raises(ValueError, match="key must have at least one head"):
        call(q, empty_heads, empty_heads)


def test_empty_grid_still_checks_kernel_range():
    x = torch.randn(1, 0, 4, 5, 2, 16)
    with pytest.raises(ValueError, match="at least 1"):
        call(x, x, x, (3, 0, 3))
