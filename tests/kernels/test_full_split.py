"""Full boxes in a loop of their own (a config's ``split_full`` and
``dkdv_split_full``): each forward and dQ program scans first the key boxes all its
queries see whole, without a mask, then the others, masked, stepping over the full
ones (``kernels.tiles.FullBoxes``); each dK/dV program, the query boxes that see all
its keys first.

The products are the same as the one-loop kernel's, in another order, so the
outputs, lse and dQ are checked against the float64 oracle (the order changes the
rounding, not the tolerance), and the output against the one-loop kernel within
that tolerance. Each case asserts that its scans hold both full and masked boxes, so
that both loops and the step over the full boxes run. A NaN key (for dK/dV: a NaN
query) inside the full boxes checks that the safe recomputation scans in the same
order: every element it does not reach equals, bit for bit, the kernel's result
with that input zeroed.
Interpreter on the CPU (fp32 through pointers, fp16 through tensor descriptors
where the layout allows), bf16 on the GPU.
"""

import dataclasses
import math
import random

import pytest
import torch

from na3d import geometry, launch
from na3d.configs import BackwardConfig, ForwardConfig
from na3d.reference import na3d_windowed
from helpers import assert_grads_match_oracle, assert_matches_oracle, make_qkv, poisoned_like, slow_except, tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not launch.kernels_interpreted(),
    reason="no GPU and the Triton interpreter is not active")
DTYPES = (torch.bfloat16,) if DEVICE == "cuda" else (torch.float32, torch.float16)

F = False
# (shape, key/value heads, kernel, stride, dilation, causal, query box, key box, fixed_mask)
CASES = [
    # small and quick (the first in the default run): a wide W window; grouped heads with B > 1
    ((1, 2, 6, 12, 2, 16), 2, (1, 5, 9), (1, 1, 1), (1, 1, 1), (F, F, F), (1, 2, 8), (1, 4, 4), True),
    ((2, 3, 6, 12, 4, 16), 1, (1, 5, 9), (1, 1, 1), (1, 1, 1), (F, F, F), (1, 4, 4), (1, 2, 8), False),
    # deeper boxes (two frames) over several key boxes along every axis
    ((1, 5, 8, 12, 2, 16), 2, (3, 5, 9), (1, 1, 1), (1, 1, 1), (F, F, F), (2, 2, 4), (1, 2, 8), True),
    # the same with the plain per-step mask (scores masked by selection)
    ((1, 5, 8, 12, 2, 16), 2, (3, 5, 9), (1, 1, 1), (1, 1, 1), (F, F, F), (2, 2, 4), (1, 2, 8), False),
    # grouped heads, B > 1
    ((2, 3, 8, 12, 4, 16), 1, (3, 5, 9), (1, 1, 1), (1, 1, 1), (F, F, F), (1, 2, 8), (1, 4, 4), True),
    # a causal axis
    ((1, 4, 6, 8, 2, 16), 2, (2, 5, 7), (1, 1, 1), (1, 1, 1), (True, F, F), (1, 4, 4), (1, 4, 4), F),
    # a stride that is not the boxes'
    ((1, 4, 6, 8, 2, 16), 2, (2, 5, 7), (1, 3, 2), (1, 1, 1), (F, F, F), (1, 4, 4), (1, 4, 4), True),
    # dilation: full boxes inside each group
    ((1, 4, 12, 16, 2, 16), 2, (2, 5, 7), (1, 1, 1), (1, 2, 2), (F, F, F), (1, 4, 4), (1, 4, 4), True),
]
IDS = ["small", "small-gqa-batch", "deep-boxes", "per-step-mask", "gqa-batch", "causal-T", "stride-1x3x2",
       "dilated"]
# dK/dV's (key box, query box) per case: the forward's boxes swapped, except where
# that pairing has no full pair (causal-T, stride-1x3x2, dilated)
DKDV_BOXES = {5: ((1, 4, 4), (2, 2, 4)), 6: ((1, 4, 4), (2, 2, 4)), 7: ((1, 4, 4), (2, 2, 4))}


def dkdv_boxes(case):
    return DKDV_BOXES.get(case, CASES[case][6:8])


def full_share(case, own="queries"):
    shape, _, kernel, stride, dilation, causal, q_box, kv_box, _ = CASES[case]
    boxes = (q_box, kv_box) if own == "queries" else dkdv_boxes(case)
    return geometry.full_products_share(launch.group_grid(shape[1:4], dilation), kernel, *boxes, causal, stride,
                                        own)


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_cases_hold_full_and_masked_boxes(case):
    assert 0 < full_share(case) < 1, IDS[case]
    assert 0 < full_share(case, "keys") < 1, IDS[case]


def forward(case, q, k, v, scale, split):
    _, _, kernel, stride, dilation, causal, q_box, kv_box, fixed = case
    cfg = ForwardConfig(q_box, kv_box, num_warps=4, num_stages=2, fixed_mask=fixed,
                        split_full=0.0 if split else None)
    return launch.na3d_forward(q, k, v, kernel, scale, return_lse=True, out=poisoned_like(q), config=cfg,
                               is_causal=causal, stride=stride, dilation=dilation)


def gradients(case, q, k, v, out, lse, grad_out, scale, fused=False):
    """dQ and dK/dV by the split kernels (``fused``: the one-pass backward), from the
    forward's ``out`` and ``lse``."""
    _, _, kernel, stride, dilation, causal, q_box, kv_box, fixed = CASES[case]
    cfg = BackwardConfig(q_box, kv_box, *dkdv_boxes(case), num_warps=4, num_stages=2, fixed_mask=fixed,
                         split_full=0.0, dkdv_split_full=0.0, fused=fused)
    grads = tuple(poisoned_like(t) for t in (q, k, v))
    launch.na3d_backward(grad_out, q, k, v, out, lse, kernel, scale, grads=grads, config=cfg, is_causal=causal,
                         stride=stride, dilation=dilation)
    return grads


def inputs(case, dtype, seed):
    shape, kv_heads = case[:2]
    q, k, v = make_qkv(shape, dtype, device=DEVICE, seed=seed)
    return q, k[..., :kv_heads, :].contiguous(), v[..., :kv_heads, :].contiguous()


# The default run: the first case in 16 bits (descriptors); every case in every dtype in the slow run.
SPLIT_RUNS = [(case, dtype) for case in range(len(CASES)) for dtype in DTYPES]


@pytest.mark.parametrize("case,dtype", slow_except(
    SPLIT_RUNS, keep=[SPLIT_RUNS.index((0, DTYPES[-1]))], ids=[f"{IDS[c]}-{d}" for c, d in SPLIT_RUNS]))
def test_split_matches_oracle_and_one_loop(case, dtype):
    c = CASES[case]
    q, k, v = inputs(c, dtype, seed=120 + case)
    out, lse = forward(c, q, k, v, 0.3, split=True)
    one_loop, one_loop_lse = forward(c, q, k, v, 0.3, split=False)
    _, _, kernel, stride, dilation, causal = c[:6]
    qc, kc, vc = (t.cpu() for t in (q, k, v))
    assert_matches_oracle(out.cpu(), qc, kc, vc, kernel, 0.3, dilation, causal, stride)
    oracle, oracle_lse = na3d_windowed(qc, kc, vc, kernel, 0.3, dilation, causal, stride, return_lse=True)
    tol = tolerance(qc, kc, vc, kernel, 0.3, oracle, dilation, causal, stride)
    assert (out.double().cpu() - one_loop.double().cpu()).abs().max() <= 2 * tol
    # lse: within twice the one-loop kernel's own error, plus float32 rounding.
    one_loop_err = (one_loop_lse.double().cpu() - oracle_lse).abs().max().item()
    band = 4 * torch.finfo(torch.float32).eps * max(1.0, oracle_lse.abs().max().item())
    assert (lse.double().cpu() - oracle_lse).abs().max().item() <= 2 * one_loop_err + band
    grad_out = make_qkv(c[0], dtype, device=DEVICE, seed=130 + case)[0]
    grads = gradients(case, q, k, v, out, lse, grad_out, 0.3)
    assert_grads_match_oracle(grads, qc, kc, vc, grad_out.cpu(), kernel, 0.3, dilation=dilation, is_causal=causal,
                              stride=stride)


def test_split_with_a_negative_scale():
    # The masked loop masks with +inf there (the row maximum is a minimum).
    c = CASES[0]
    q, k, v = inputs(c, DTYPES[0], seed=140)
    out, _ = forward(c, q, k, v, -0.7, split=True)
    _, _, kernel, stride, dilation, causal = c[:6]
    assert_matches_oracle(out.cpu(), q.cpu(), k.cpu(), v.cpu(), kernel, -0.7, dilation, causal, stride)


@pytest.mark.parametrize("case", slow_except([(0,), (1,), (2,)], keep=(0,), ids=IDS[:3]))
def test_nan_key_in_full_boxes_stays_in_its_windows(case):
    # A key in the middle of the grid lies in the full boxes of the programs around
    # it: the safe launch recomputes them, in the split order.
    c = CASES[case]
    q, k, v = inputs(c, DTYPES[0], seed=150 + case)
    shape = c[0]
    position = (0, shape[1] // 2, shape[2] // 2, shape[3] // 2, 0, 3)
    bad, zero = k.clone(), k.clone()
    bad[position] = float("nan")
    zero[position] = 0.0
    got, got_lse = forward(c, q, bad, v, 0.3, split=True)
    zeroed, zeroed_lse = forward(c, q, zero, v, 0.3, split=True)
    _, _, kernel, stride, dilation, causal = c[:6]
    want = ~torch.isfinite(na3d_windowed(q.cpu(), bad.cpu(), v.cpu(), kernel, 0.3, dilation, causal, stride))
    nonfinite = ~torch.isfinite(got).cpu()
    assert want.any() and torch.equal(nonfinite, want)
    assert torch.equal(got[~nonfinite.to(got.device)], zeroed[~nonfinite.to(got.device)])
    rows = nonfinite.any(-1)
    assert torch.equal(got_lse[~rows.to(got.device)], zeroed_lse[~rows.to(got.device)])
    # dQ: its safe launch too (from the zeroed key's forward, so that only the key differs)
    grad_out = make_qkv(shape, DTYPES[0], device=DEVICE, seed=160 + case)[0]
    dq_bad = gradients(case, q, bad, v, zeroed, zeroed_lse, grad_out, 0.3)[0]
    dq_zero = gradients(case, q, zero, v, zeroed, zeroed_lse, grad_out, 0.3)[0]
    hit = ~torch.isfinite(dq_bad)
    assert hit.cpu().any() and torch.equal(hit.cpu().any(-1), want.any(-1))
    assert torch.equal(dq_bad[~hit], dq_zero[~hit])


@pytest.mark.parametrize("case", slow_except([(0,), (1,), (5,)], keep=(0,), ids=[IDS[0], IDS[1], IDS[5]]))
def test_nan_query_in_full_boxes_stays_in_its_window(case):
    # dK/dV: a query in the middle of the grid lies in the full query boxes of the
    # key programs around it. It reaches the dK and dV rows of the keys it sees
    # (of its key/value head), all of their elements; the safe launch recomputes
    # those programs in the split order, so every other element equals the result
    # with that query zeroed, bit for bit.
    c = CASES[case]
    q, k, v = inputs(c, DTYPES[0], seed=170 + case)
    shape, kv_heads, kernel, stride, dilation, causal = c[:6]
    position = (0, shape[1] // 2, shape[2] // 2, shape[3] // 2)
    bad, zero = q.clone(), q.clone()
    bad[position + (0, 3)] = float("nan")
    zero[position + (0, 3)] = 0.0
    out, lse = forward(c, zero, k, v, 0.3, split=True)
    grad_out = make_qkv(shape, DTYPES[0], device=DEVICE, seed=180 + case)[0]
    _, dk_bad, dv_bad = gradients(case, bad, k, v, out, lse, grad_out, 0.3)
    _, dk_zero, dv_zero = gradients(case, zero, k, v, out, lse, grad_out, 0.3)
    seen = geometry.neighborhood_mask(shape[1:4], kernel, dilation, causal, stride=stride)
    seen = seen[sum(p * n for p, n in zip(position[1:], (shape[2] * shape[3], shape[3], 1)))].reshape(shape[1:4])
    want = torch.zeros(dk_bad.shape, dtype=torch.bool)
    want[0, ..., 0, :] = seen[..., None]
    for bad_grad, zero_grad in ((dk_bad, dk_zero), (dv_bad, dv_zero)):
        hit = ~torch.isfinite(bad_grad)
        assert torch.equal(hit.cpu(), want)
        assert torch.equal(bad_grad[~hit], zero_grad[~hit])


@pytest.mark.parametrize("case", slow_except([(0,), (1,), (5,), (7,)], keep=(0,), ids=[IDS[i] for i in (0, 1, 5, 7)]))
def test_fused_backward_split_matches_oracle(case):
    # The one-pass backward: its full loop masks only the keys past the grid (from dQ).
    c = CASES[case]
    dtype = DTYPES[0]
    q, k, v = inputs(c, dtype, seed=190 + case)
    out, lse = forward(c, q, k, v, 0.3, split=False)
    grad_out = make_qkv(c[0], dtype, device=DEVICE, seed=200 + case)[0]
    grads = gradients(case, q, k, v, out, lse, grad_out, 0.3, fused=True)
    _, _, kernel, stride, dilation, causal = c[:6]
    assert_grads_match_oracle(grads, q.cpu(), k.cpu(), v.cpu(), grad_out.cpu(), kernel, 0.3, dilation=dilation,
                              is_causal=causal, stride=stride)


# Boxes for the fuzz below: flat, deep and one-axis ones.
FUZZ_BOXES = [(1, 4, 4), (1, 2, 8), (2, 2, 4), (1, 1, 16), (2, 4, 2), (4, 2, 2), (1, 16, 1), (4, 4, 1), (2, 2, 8)]


def split_config(seed):
    """A random small problem whose forward (and dQ) and dK/dV scans both hold full and
    masked boxes: (shape, kv_heads, kernel, dilation, causal, stride, [q box, key box,
    dK/dV key box, dK/dV query box]). Odd lengths, kernel 1 and kernel = length,
    causal axes, strides, dilation, GQA and B = 2 all come up."""
    rng = random.Random(1000 + seed)
    while True:
        dilation = [rng.choice([1, 1, 1, 2]) for _ in range(3)]
        lengths = [rng.randint(3, 8) * d for d in dilation]
        kernel = [rng.choice([1, rng.randint(1, L // d), L // d, L // d]) for L, d in zip(lengths, dilation)]
        causal = [rng.random() < 0.3 for _ in range(3)]
        stride = [rng.randint(1, K) if rng.random() < 0.4 else 1 for K in kernel]
        boxes = [rng.choice(FUZZ_BOXES) for _ in range(4)]
        grid = launch.group_grid(lengths, dilation)
        shares = (geometry.full_products_share(grid, kernel, boxes[0], boxes[1], causal, stride),
                  geometry.full_products_share(grid, kernel, boxes[2], boxes[3], causal, stride, "keys"))
        every_pair_full = all(launch.block_sparse_axes(boxes[2], boxes[3], kernel, causal, stride, lengths, dilation,
                                                       own="keys"))
        kv_heads = rng.choice([1, 2])
        shape = (rng.choice([1, 2]), *lengths, kv_heads * rng.choice([1, 2]), 16)
        # (at most 1600 query rows in all: the interpreter's time grows with them)
        if all(0 < share < 1 for share in shares) and not every_pair_full and math.prod(shape[:5]) <= 1600:
            return shape, kv_heads, tuple(kernel), tuple(dilation), tuple(causal), tuple(stride), boxes


# The gradients' same-math reference reads the forward's out and lse, as the backward
# does (helpers.assert_grads_match_oracle's forward=, after checking both against the
# oracle). With a fresh logsumexp instead, seed 2 (fp32; kernel 8,5,8 over the whole
# 8x5x16 grid, dilation 1,1,2) missed on some machines: dV 2.79e-6 against 2.66e-6,
# the forward's lse rounding (NOTES v34, v43).
# Slow, every seed: the split is set in no table, and the default run keeps its fixed cases
# (test_split_matches_oracle_and_one_loop and the non-finite ones above).
@pytest.mark.slow
@pytest.mark.parametrize("seed", range(8))
def test_split_on_random_configs(seed):
    # Every kernel split (forward, dQ, dK/dV) on random small problems holding full and
    # masked boxes (split_config), fp32 through pointers or fp16 through tensor
    # descriptors; outputs and gradients against the float64 oracle.
    shape, kv_heads, kernel, dilation, causal, stride, boxes = split_config(seed)
    fixed = seed % 3 != 0
    dtype = DTYPES[seed % len(DTYPES)]
    q, k, v = make_qkv(shape, dtype, device=DEVICE, seed=400 + seed)
    k, v = k[..., :kv_heads, :].contiguous(), v[..., :kv_heads, :].contiguous()
    fwd = ForwardConfig(boxes[0], boxes[1], num_warps=4, num_stages=2, fixed_mask=fixed, split_full=0.0)
    out, lse = launch.na3d_forward(q, k, v, kernel, 0.4, return_lse=True, out=poisoned_like(q), config=fwd,
                                   is_causal=causal, stride=stride, dilation=dilation)
    bwd = BackwardConfig(boxes[0], boxes[1], boxes[2], boxes[3], num_warps=4, num_stages=2, fixed_mask=fixed,
                         split_full=0.0, dkdv_split_full=0.0)
    grad_out = make_qkv(shape, dtype, device=DEVICE, seed=500 + seed)[0]
    grads = tuple(poisoned_like(t) for t in (q, k, v))
    launch.na3d_backward(grad_out, q, k, v, out, lse, kernel, 0.4, grads=grads, config=bwd, is_causal=causal,
                         stride=stride, dilation=dilation)
    # out and lse against the oracle first (forward=), then the gradients
    assert_grads_match_oracle(grads, q.cpu(), k.cpu(), v.cpu(), grad_out.cpu(), kernel, 0.4, dilation=dilation,
                              is_causal=causal, stride=stride, forward=(out, lse))


def test_launcher_splits_above_the_configs_share():
    # dK/dV, dit-hunyuan with key boxes (4, 4, 4): about 45 % of the products in full
    # pairs with query boxes (2, 4, 4), 11 % with (2, 2, 16)
    assert launch.split_full(0.3, (30, 48, 80), (18, 24, 24), (4, 4, 4), (2, 4, 4), (F, F, F), (1, 1, 1), "keys")
    assert not launch.split_full(0.3, (30, 48, 80), (18, 24, 24), (4, 4, 4), (2, 2, 16), (F, F, F), (1, 1, 1),
                                 "keys")
    # dit-hunyuan's grid and window with the DiT forward boxes: about 46 % of the
    # products in full boxes; dit-wan's: about 9 %.
    assert launch.split_full(0.3, (30, 48, 80), (18, 24, 24), (2, 8, 4), (2, 8, 2), (F, F, F), (1, 1, 1))
    assert not launch.split_full(0.3, (21, 30, 52), (9, 15, 15), (2, 8, 4), (2, 8, 2), (F, F, F), (1, 1, 1))
    assert not launch.split_full(None, (30, 48, 80), (18, 24, 24), (2, 8, 4), (2, 8, 2), (F, F, F), (1, 1, 1))
    with pytest.raises(ValueError, match="split_full"):
        dataclasses.replace(ForwardConfig((2, 2, 4), (1, 2, 8), 4, 2), split_full=1.5)
    with pytest.raises(ValueError, match="dkdv_split_full"):
        BackwardConfig((2, 2, 4), (1, 2, 8), (2, 2, 4), (1, 2, 8), 4, 2, dkdv_split_full=-0.1)
