"""The references: the brute force against NATTEN, the grouped-SDPA reference against the
brute force, its memory budget and planner."""

import doctest
import math
import random

import pytest
import torch

import na3d
from na3d import reference
from helpers import make_qkv, random_config

SHAPES = [
    # (B, T, H, W, NH, HD), kernel
    ((2, 5, 6, 7, 3, 16), (3, 3, 5)),
    ((1, 3, 5, 9, 2, 16), (3, 5, 9)),      # kernel = dimension
    ((1, 4, 4, 4, 2, 8), (1, 1, 1)),       # kernel 1
    ((1, 6, 7, 11, 2, 32), (5, 3, 7)),
    ((3, 5, 5, 5, 1, 16), (5, 5, 5)),
    ((1, 1, 1, 13, 1, 8), (1, 1, 13)),
]


@pytest.mark.parametrize("seed", range(6))
def test_oracle_equals_natten(seed):
    natten = pytest.importorskip("natten")
    shape, kv_heads, kernel, dilation, _, stride = random_config(100 + seed, min_kernel=2)  # NATTEN rejects 1
    causal = tuple(random.Random(seed).choice([False, True]) for _ in range(3))
    q, k, v = make_qkv(shape, torch.float32, seed=seed)
    k, v = k[..., :kv_heads, :], v[..., :kv_heads, :]
    want = natten.na3d(q, k, v, kernel_size=kernel, dilation=dilation, is_causal=causal, stride=stride)
    got = na3d.na3d_brute_force(q, k, v, kernel, dilation=dilation, is_causal=causal, compute_dtype=torch.float64,
                                stride=stride)
    torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,kernel", SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "fused_qkv"])
def test_sdpa_exact_equals_brute_force(shape, kernel, layout):
    q, k, v = make_qkv(shape, torch.float64, layout, seed=hash((shape, kernel)) % 1000)
    want = na3d.na3d_brute_force(q, k, v, kernel, scale=0.3)
    got = reference.na3d_sdpa_exact(q, k, v, kernel, scale=0.3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape,kernel", SHAPES)
def test_sdpa_exact_small_budget_splits_and_stays_exact(shape, kernel):
    q, k, v = make_qkv(shape, torch.float64, seed=3)
    want = na3d.na3d_brute_force(q, k, v, kernel)
    need = reference._box_bytes(1, math.prod(kernel), 1, shape[-1], 8)
    got = reference.na3d_sdpa_exact(q, k, v, kernel, memory_budget=need)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("w_offset,w_count", [(0, 3), (2, 3), (4, 7), (10, 1), (0, 11)])
def test_sdpa_exact_w_offset_gives_rows_of_full_result(w_offset, w_count):
    shape, kernel = (2, 4, 5, 11, 2, 16), (3, 3, 7)
    q, k, v = make_qkv(shape, torch.float64, seed=w_offset)
    full = na3d.na3d_brute_force(q, k, v, kernel)
    sub = q[:, :, :, w_offset:w_offset + w_count]
    budget = reference._box_bytes(2, 2 * math.prod(kernel), 1, 16, 8)  # forces narrow query boxes
    got = reference.na3d_sdpa_exact(sub, k, v, kernel, w_offset=w_offset, memory_budget=budget)
    torch.testing.assert_close(got, full[:, :, :, w_offset:w_offset + w_count], rtol=1e-12, atol=1e-12)


def test_sdpa_exact_rejects_w_offset_outside():
    q, k, v = make_qkv((1, 3, 3, 5, 1, 8), torch.float64)
    with pytest.raises(ValueError, match="w_offset"):
        reference.na3d_sdpa_exact(q[:, :, :, :3], k, v, (3, 3, 3), w_offset=3)


@pytest.mark.parametrize("dilation,causal,stride", [((1, 2, 3), (False, True, False), (1, 1, 2)),
                                                    ((2, 2, 2), (True, False, False), (1, 2, 1))])
def test_sdpa_exact_dilation_equals_brute_force(dilation, causal, stride):
    """Dilation groups of unequal lengths (7 frames by 2, 10 columns by 3), with lse."""
    shape, kernel = (2, 7, 6, 10, 2, 16), (3, 3, 3)
    q, k, v = make_qkv(shape, torch.float64, seed=sum(dilation))
    features = dict(dilation=dilation, is_causal=causal, stride=stride)
    got, got_lse = reference.na3d_sdpa_exact(q, k, v, kernel, return_lse=True, **features)
    want, want_lse = na3d.na3d_brute_force(q, k, v, kernel, return_lse=True, **features)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_lse.double(), want_lse, rtol=0, atol=2e-6)  # (float32 lse)


def test_sdpa_exact_dilation_needs_the_whole_grid():
    q, k, v = make_qkv((1, 3, 4, 6, 1, 8), torch.float64)
    with pytest.raises(ValueError, match="dilation"):
        reference.na3d_sdpa_exact(q[:, :, :, :3], k, v, (3, 2, 3), dilation=(1, 2, 2))


def test_budget_below_one_query_raises():
    q, k, v = make_qkv((1, 3, 3, 5, 1, 8), torch.float64)
    with pytest.raises(ValueError, match="memory_budget"):
        reference.na3d_sdpa_exact(q, k, v, (3, 3, 3), memory_budget=100)


@pytest.mark.parametrize("shape,kernel,heads,elt,budget", [
    ((79, 192, 192), (11, 11, 11), 4, 2, 1 << 30),   # ltx-stage5-tile
    ((40, 96, 96), (3, 5, 5), 8, 2, 1 << 30),
    ((18, 32, 48), (3, 7, 7), 32, 4, 1 << 24),
    ((4, 8, 128), (3, 5, 27), 8, 2, 1 << 22),
    ((3, 3, 300), (3, 3, 3), 512, 2, 1 << 20),       # budget forces head chunks
])
@pytest.mark.parametrize("w_count", [None, 2])
def test_plan_fits_budget_with_real_kv_footprint(shape, kernel, heads, elt, budget, w_count):
    """The plan's worst box, with its true union of windows, fits the budget.

    A run of queries narrower than the kernel still needs a whole window of keys:
    the check recomputes every box's key count from the geometry module.
    """
    T, H, W = shape
    w_range = (0, W) if w_count is None else (W - w_count, W)
    ranges = [(0, T), (0, H), w_range]
    classes = tuple(reference._classes_1d(a, b, L, K) for (a, b), L, K in zip(ranges, shape, kernel))
    ext, bsz, hsz = reference._plan_tiles(classes, shape, kernel, 1, heads, 64, elt, budget, True)
    worst_nk = 1
    for cls, e, L, K in zip(classes, ext, shape, kernel):
        longest = 0
        for lo, hi in cls:
            for a in range(lo, hi, e):
                b = min(a + e, hi) - 1
                s0, s1 = na3d.geometry.union_of_windows(a, b, L, K)
                assert s1 - s0 >= K
                longest = max(longest, s1 - s0)
        worst_nk *= longest
    assert reference._box_bytes(math.prod(ext), worst_nk, bsz * hsz, 64, elt) <= budget


def test_masks_are_not_cached_across_calls():
    q, k, v = make_qkv((1, 4, 5, 6, 1, 8), torch.float64)
    reference.na3d_sdpa_exact(q, k, v, (3, 3, 3))
    cached = [name for name in dir(reference) if hasattr(getattr(reference, name), "cache_info")]
    for name in cached:  # only pure integer planning is memoized, never tensors
        fn = getattr(reference, name)
        assert name in ("_plan_tiles", "_max_union_1d"), name
        assert fn.cache_info().maxsize is not None


@pytest.mark.slow
def test_sdpa_exact_differentiates():
    q, k, v = make_qkv((1, 3, 4, 5, 2, 8), torch.float64, seed=5)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(
        lambda a, b, c: reference.na3d_sdpa_exact(a, b, c, (3, 3, 3)), (q, k, v), eps=1e-6, atol=1e-6)


def test_docstring_examples():
    assert doctest.testmod(reference).failed == 0


@pytest.mark.parametrize("where", ["key", "value", "query"])
@pytest.mark.parametrize("features", [dict(), dict(stride=(1, 2, 2), is_causal=(True, False, False)),
                                      dict(dilation=(1, 2, 1))], ids=["plain", "strided-causal", "dilated"])
def test_isolated_reference_keeps_a_nan_inside_its_windows(where, features):
    # A NaN reaches exactly the outputs and gradients whose windows hold it: the
    # gathered oracle's NaNs, position for position (without ``isolate`` a key or
    # value can reach the whole box of queries whose union of windows holds it).
    shape, kernel = (1, 5, 6, 7, 2, 8), (3, 3, 3)
    gen = torch.Generator().manual_seed(3)
    q, k, v, grad_out = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(4))
    {"key": k, "value": v, "query": q}[where][0, 2, 3, 3, 1, 5] = float("nan")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = na3d.na3d_sdpa_exact(*leaves, kernel, isolate=True, **features)
    out.backward(grad_out)
    oracle_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    oracle = na3d.na3d_windowed(*oracle_leaves, kernel, **features)
    oracle.backward(grad_out)
    assert torch.equal(out.isnan(), oracle.isnan()) and out.isnan().any()
    for got, want in zip(leaves, oracle_leaves):
        assert torch.equal(got.grad.isnan(), want.grad.isnan())
    fine = ~oracle.isnan()
    assert torch.allclose(out[fine], oracle[fine], atol=1e-12)


def test_public_call_on_the_reference_path_isolates_non_finite_inputs(monkeypatch):
    # The CPU path without the interpreter (ops.dispatch): a non-finite input makes it
    # isolate; finite inputs keep the grouped calls.
    from na3d import launch, reference
    monkeypatch.setattr(launch, "kernels_interpreted", lambda: False)
    seen = []
    real = reference.na3d_sdpa_exact
    monkeypatch.setattr(reference, "na3d_sdpa_exact", lambda *a, **kw: seen.append(kw["isolate"]) or real(*a, **kw))
    q, k, v = (torch.randn(1, 4, 5, 6, 2, 8) for _ in range(3))
    na3d.na3d(q, k, v, 3)
    k[0, 1, 1, 1, 0, 0] = float("inf")
    out = na3d.na3d(q, k, v, 3)
    na3d.na3d(q, k, v, 3, assume_finite=True)
    assert seen == [False, True, False]
    assert torch.equal(out.isnan(), na3d.na3d_windowed(q, k, v, (3, 3, 3)).isnan())
