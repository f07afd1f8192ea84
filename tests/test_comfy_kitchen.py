"""na3d as a comfy-kitchen backend (``na3d.comfy_kitchen``).

After ``register()``, ``comfy_kitchen.na3d`` (ComfyUI's call) dispatches to na3d and
equals comfy-kitchen's own eager backend, on the CPU, with comfy-kitchen's semantics
(kernels clamped to their axis, ``is_causal`` None or a bare bool, ``scale`` None);
calls na3d cannot take go to the next backend; ``unregister()`` gives the previous
backend back. na3d runs its Triton kernels in the interpreter here (the CPU test
session's default); comfy-kitchen's eager backend is its PyTorch reference.
"""

import pytest
import torch

comfy_kitchen = pytest.importorskip("comfy_kitchen")

from comfy_kitchen.registry import registry  # noqa: E402

import na3d.comfy_kitchen as backend  # noqa: E402


@pytest.fixture
def registered():
    before = backend.unregister()
    yield backend.register()
    backend.unregister()
    assert registry._priority == before


@pytest.fixture
def calls(monkeypatch):
    """The calls that reached na3d's backend function (through the registry, which looks it up by name)."""
    seen = []
    original = backend.na3d

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(backend, "na3d", spy)
    return seen


def qkv(shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=gen).to(dtype) for _ in range(3))


def eager(*args):
    with comfy_kitchen.use_backend("eager"):
        return comfy_kitchen.na3d(*args)


def chosen(q, kernel_size=(3, 3, 3), is_causal=(False, False, False), scale=None):
    kwargs = dict(q=q, k=q, v=q, kernel_size=list(kernel_size), is_causal=list(is_causal), scale=scale)
    return registry.get_capable_backend("na3d", kwargs)


CASES = [
    # shape (B, T, H, W, NH, HD), kernel_size, is_causal, scale
    ((1, 4, 5, 6, 2, 16), [3, 3, 5], None, None),
    ((2, 3, 4, 5, 2, 8), [7, 3, 9], None, 0.5),             # T and W kernels clamp to the axis
    ((1, 5, 4, 6, 1, 16), [3, 2, 4], [True, False, False], None),  # causal time, even kernels
    ((1, 4, 4, 5, 2, 16), 9, True, 1.0),                     # a bare int and a bare bool: every axis
]


@pytest.mark.parametrize("shape, kernel_size, is_causal, scale", CASES)
def test_registered_na3d_equals_comfy_eager(shape, kernel_size, is_causal, scale, registered, calls):
    q, k, v = qkv(shape)
    assert registered[0] == "na3d"
    assert chosen(q) == "na3d"
    out = comfy_kitchen.na3d(q, k, v, kernel_size, is_causal, scale)
    assert len(calls) == 1, "comfy_kitchen.na3d did not reach na3d"
    ref = eager(q, k, v, kernel_size, is_causal, scale)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_half_precision_and_strided_views(registered, calls):
    """float16, and q/k/v as slices of one fused projection (strided; na3d takes them as they are)."""
    fused = torch.randn(1, 4, 5, 6, 3, 2, 16, generator=torch.Generator().manual_seed(1)).half()
    q, k, v = fused.unbind(4)
    out = comfy_kitchen.na3d(q, k, v, [3, 3, 3])
    assert len(calls) == 1
    ref = eager(q.float(), k.float(), v.float(), [3, 3, 3])
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3)


def test_calls_na3d_cannot_take_go_to_the_next_backend(registered, calls):
    q, k, v = qkv((1, 3, 4, 5, 2, 4))  # head dim 4: not a multiple of 8
    assert chosen(q) == "eager"
    out = comfy_kitchen.na3d(q, k, v, [3, 3, 3])
    assert not calls
    torch.testing.assert_close(out, eager(q, k, v, [3, 3, 3]))
    q64 = qkv((1, 3, 4, 5, 2, 8), torch.float64)[0]
    assert registry.validate_backend_for_call("na3d", "na3d", dict(q=q64, k=q64, v=q64)).failed_param == "q"
    q = qkv((1, 3, 4, 5, 2, 8))[0]
    for kwargs in (dict(scale=float("inf")), dict(k=q[..., :1, :]), dict(kernel_size=[3, 0, 3])):
        call = dict(dict(q=q, k=q, v=q, kernel_size=[3, 3, 3], is_causal=[False] * 3, scale=None), **kwargs)
        assert not registry.validate_backend_for_call("na3d", "na3d", call).success, kwargs


def test_unregister_gives_the_previous_backend_back(calls):
    q, k, v = qkv((1, 3, 4, 5, 2, 16))
    before = backend.unregister()
    previous = chosen(q)
    try:
        backend.register()
        backend.register()  # twice: still first once, and the order before the first call is kept
        assert registry._priority.count("na3d") == 1 and chosen(q) == "na3d"
    finally:
        assert backend.unregister() == before
    assert chosen(q) == previous != "na3d"
    comfy_kitchen.na3d(q, k, v, [3, 3, 3])
    assert not calls
    with pytest.raises(comfy_kitchen.BackendNotFoundError):
        with comfy_kitchen.use_backend("na3d"):
            pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_registered_na3d_on_the_gpu_matches_comfy_cuda(registered, calls):
    """An LTX stage-1-like call in bf16: na3d answers, within bf16 rounding of comfy-kitchen's CUDA kernel
    (when it loads here) and of a float32 run of comfy's eager backend."""
    shape = (1, 6, 16, 24, 8, 64)
    q, k, v = (x.cuda() for x in qkv(shape, torch.bfloat16))
    out = comfy_kitchen.na3d(q, k, v, [3, 7, 7], None, 1.0)
    assert len(calls) == 1
    ref = eager(q.float(), k.float(), v.float(), [3, 7, 7], None, 1.0)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    if "cuda" in registry._backends and registry.validate_backend_for_call(
            "cuda", "na3d", dict(q=q, k=k, v=v, kernel_size=[3, 7, 7], is_causal=[False] * 3, scale=1.0)).success:
        with comfy_kitchen.use_backend("cuda"):
            theirs = comfy_kitchen.na3d(q, k, v, [3, 7, 7], None, 1.0)
        torch.testing.assert_close(out.float(), theirs.float(), rtol=2e-2, atol=2e-2)
