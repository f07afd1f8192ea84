"""Grouped-query and multi-query attention inside the kernels (``GROUP`` query heads
per key/value head): the forward, both backward paths (dK/dV summing its group's
query heads in a fixed order, and the one-pass backward), key/value boxes through
tensor descriptors and through pointers, and the second launch that recomputes
tiles holding an inf or NaN, against the float64 oracle.
"""

import dataclasses

import pytest
import torch

from na3d import configs, launch
from na3d.reference import na3d_windowed
from helpers import assert_grads_match_oracle, assert_matches_oracle, make_qkv, slow_except

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not launch.kernels_interpreted(),
    reason="no GPU and the Triton interpreter is not active")

# (shape, key/value heads, kernel, layout): odd sizes, B > 1, a kernel equal to its axis.
CASES = [
    ((2, 3, 4, 5, 4, 16), 2, (3, 3, 5), "contiguous"),
    ((1, 3, 5, 4, 3, 16), 1, (2, 5, 3), "contiguous"),      # multi-query, even kernel
    ((1, 2, 4, 7, 4, 32), 1, (2, 3, 3), "heads_first"),     # pointer loads (strided heads)
    ((1, 2, 5, 6, 8, 16), 2, (1, 3, 6), "contiguous"),
]
FWD = configs.ForwardConfig((1, 4, 4), (1, 2, 8), 4, 2)
BWD = configs.BackwardConfig((1, 4, 4), (1, 2, 8), (1, 4, 4), (1, 2, 8), 4, 1)


def grouped(shape, kv_heads, layout, dtype, seed):
    q, k, v = make_qkv(shape, dtype, layout=layout, device=DEVICE, seed=seed)
    return q, k[..., :kv_heads, :], v[..., :kv_heads, :]


# Each case with each backward: the two-kernel one and the one-pass one (``fused``).
RUNS = [(case, dtype, fused) for case in CASES for dtype in (torch.float32, torch.float16) for fused in (False, True)]
# The default run: GQA and MQA, B > 1, an even kernel, strided heads; each backward.
KEEP = [RUNS.index(run) for run in ((CASES[0], torch.float16, True), (CASES[1], torch.float32, False),
                                    (CASES[2], torch.float32, True))]


@pytest.mark.parametrize("case,dtype,fused", slow_except(
    RUNS, keep=KEEP, ids=[f"{CASES.index(c)}-{str(d)[6:]}-{'one-pass' if f else 'two-kernel'}" for c, d, f in RUNS]))
def test_grouped_heads_forward_and_backward(case, dtype, fused):
    shape, kv_heads, kernel, layout = case
    q, k, v = grouped(shape, kv_heads, layout, dtype, seed=sum(shape))
    grad_out = make_qkv(shape, dtype, device=DEVICE, seed=7)[0]
    out = torch.full_like(q, float("nan"))
    out, lse = launch.na3d_forward(q, k, v, kernel, 0.3, out=out, return_lse=True, config=FWD)
    assert_matches_oracle(out, q, k, v, kernel, 0.3)
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    launch.na3d_backward(grad_out, q, k, v, out, lse, kernel, 0.3, grads=grads,
                         config=dataclasses.replace(BWD, fused=fused))
    assert_grads_match_oracle(grads, q, k, v, grad_out, kernel, 0.3)


# Slow, both grids (several query boxes along T and W; along H too in the larger): 15 s
# in the default run. There, test_nonfinite.test_fuzz_public_api's seeds 0 and 1 (two
# query heads per key/value head, with one key/value head and with two) keep non-finite
# inputs with grouped heads, isolated bit for bit.
@pytest.mark.slow
@pytest.mark.parametrize("shape", [(1, 3, 4, 5, 4, 16), (1, 3, 5, 6, 4, 16)], ids=["3x4x5", "3x5x6"])
def test_grouped_heads_keep_non_finite_keys_inside_their_windows(shape):
    """A NaN in one key of one key/value head: the outputs and gradients of the
    queries of its group whose window holds it are NaN; everything else equals the
    result with that key zeroed, bit for bit (the second launch's safe path with a
    group of query heads)."""
    kernel = (3, 3, 3)
    q, k, v = grouped(shape, 2, "contiguous", torch.float32, seed=5)
    grad_out = make_qkv(shape, torch.float32, device=DEVICE, seed=6)[0]
    bad = k.clone()
    bad[0, 1, 2, 3, 1, 4] = float("nan")
    clean = k.clone()
    clean[0, 1, 2, 3, 1, 4] = 0.0

    def run(keys):
        out, lse = launch.na3d_forward(q, keys, v, kernel, 0.3, return_lse=True, config=FWD)
        return (out, *launch.na3d_backward(grad_out, q, keys, v, out, lse, kernel, 0.3, config=BWD))

    got, want = run(bad), run(clean)
    # The queries whose windows hold the key, as the gathered oracle finds them
    # (key/value head 1 serves query heads 2 and 3).
    reached = na3d_windowed(q.cpu(), bad.cpu(), v.cpu(), kernel, 0.3).isnan().any(-1)
    assert reached[..., 2:].any() and not reached[..., :2].any()
    assert torch.equal(got[0].isnan().any(-1).cpu(), reached)
    for g, w in zip(got, want):
        finite = ~g.isnan()
        assert torch.equal(g[finite], w[finite])


# MQA's dK/dV split over programs (``dkdv_head_split``): each program of a key box takes
# an equal share of the query heads and writes float32 partial sums. Eight query heads
# on one key/value head, split 2, 4 and 8 (one head a program), and a split larger than
# the group (capped to it); three heads split 2 (gcd 1: no split). dK/dV against the
# oracle (their sums run in another order than the unsplit kernel's: close, not equal to
# it), dQ (another kernel) bit for bit the unsplit run's.
SPLIT_CASES = [((1, 3, 4, 5, 8, 16), (3, 3, 5), 2), ((1, 3, 4, 5, 8, 16), (3, 3, 5), 8),
               ((1, 3, 4, 5, 4, 16), (3, 3, 5), 16), ((1, 3, 5, 4, 3, 16), (2, 5, 3), 2),
               ((2, 2, 4, 7, 8, 32), (2, 3, 3), 4)]


@pytest.mark.parametrize("shape,kernel,split", slow_except(SPLIT_CASES, keep=(0, 2)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mqa_dkdv_split_over_programs(shape, kernel, split, dtype):
    q, k, v = grouped(shape, 1, "contiguous", dtype, seed=sum(shape) + split)
    grad_out = make_qkv(shape, dtype, device=DEVICE, seed=9)[0]
    out, lse = launch.na3d_forward(q, k, v, kernel, 0.3, return_lse=True, config=FWD)
    got, plain = (tuple(torch.full_like(t, float("nan")) for t in (q, k, v)) for _ in range(2))
    launch.na3d_backward(grad_out, q, k, v, out, lse, kernel, 0.3, grads=got,
                         config=dataclasses.replace(BWD, dkdv_head_split=split))
    launch.na3d_backward(grad_out, q, k, v, out, lse, kernel, 0.3, grads=plain, config=BWD)
    assert_grads_match_oracle(got, q, k, v, grad_out, kernel, 0.3, forward=(out, lse))
    assert torch.equal(got[0], plain[0])  # dQ: another kernel, untouched


def test_mqa_dkdv_split_keeps_non_finite_keys_inside_their_windows():
    """A NaN key with the split: the dK/dV rows of keys whose query heads' windows see
    a NaN score are NaN, every other element equals the split run with that key
    zeroed, bit for bit (each partial program's second launch)."""
    shape, kernel = (1, 3, 4, 5, 4, 16), (3, 3, 3)
    q, k, v = grouped(shape, 1, "contiguous", torch.float32, seed=11)
    grad_out = make_qkv(shape, torch.float32, device=DEVICE, seed=12)[0]
    bad, clean = k.clone(), k.clone()
    bad[0, 1, 2, 3, 0, 4], clean[0, 1, 2, 3, 0, 4] = float("nan"), 0.0
    split = dataclasses.replace(BWD, dkdv_head_split=2)

    def run(keys):
        out, lse = launch.na3d_forward(q, keys, v, kernel, 0.3, return_lse=True, config=FWD)
        return (out, *launch.na3d_backward(grad_out, q, keys, v, out, lse, kernel, 0.3, config=split))

    got, want = run(bad), run(clean)
    assert got[0].isnan().any() and got[2].isnan().any()
    for g, w in zip(got, want):
        finite = ~g.isnan()
        assert torch.equal(g[finite], w[finite])


def test_dkdv_head_split_is_validated():
    for bad in (0, 3, -2, 2.0):
        with pytest.raises(ValueError, match="dkdv_head_split"):
            dataclasses.replace(BWD, dkdv_head_split=bad)
