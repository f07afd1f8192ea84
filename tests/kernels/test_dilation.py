"""NATTEN's dilation inside the kernels: every dilation group in one launch of each
kernel, a program's boxes in one group's sub-grid (``kernels/groups.py``,
``dilation_group``), against the float64 oracle.

The cases make the groups differ in length (an axis not a multiple of its
dilation), with boxes small enough that the largest group has a box more than a
smaller one along an axis (that program redoes the smaller group's last box and
stores nothing), and mix dilation with causal axes, strides, grouped heads, even
kernels, a kernel times dilation equal to its axis, B > 1 and strided layouts.
Forward with lse into poisoned buffers, both backward paths.
"""

import dataclasses

import pytest
import torch

import na3d
from na3d import configs, launch
from na3d.kernels import backward as backward_kernels
from na3d.kernels import forward as forward_kernels
from na3d.reference import na3d_windowed
from helpers import assert_grads_match_oracle, assert_matches_oracle, make_qkv, slow_except

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not launch.kernels_interpreted(),
    reason="no GPU and the Triton interpreter is not active")

# (shape, key/value heads, kernel, dilation, causal, stride, layout)
CASES = [
    ((1, 3, 9, 10, 2, 16), 2, (3, 3, 3), (1, 2, 3), (False,) * 3, (1, 1, 1), "contiguous"),   # groups 5/4 along H
    ((2, 5, 4, 9, 2, 16), 1, (2, 2, 4), (2, 2, 2), (False,) * 3, (1, 1, 1), "contiguous"),    # K * d = W, MQA
    ((1, 7, 6, 9, 4, 16), 2, (3, 2, 3), (2, 1, 3), (True, False, True), (1, 1, 2), "contiguous"),
    ((1, 4, 9, 7, 2, 32), 2, (1, 3, 3), (1, 3, 2), (False, True, False), (1, 2, 1), "heads_first"),
    ((1, 6, 5, 11, 2, 16), 2, (2, 2, 5), (3, 2, 2), (False, False, False), (2, 1, 3), "fused_heads"),
    # Every group as long, packed layouts: in 16 bits the boxes go through descriptors
    # that fold the groups (launch.box_descriptor), and run past their group's end.
    ((1, 4, 6, 8, 2, 16), 2, (2, 3, 3), (2, 2, 2), (False,) * 3, (1, 1, 1), "contiguous"),
    ((2, 6, 8, 5, 4, 32), 2, (3, 3, 3), (2, 2, 1), (True, False, False), (1, 2, 1), "contiguous"),  # GQA
    ((1, 3, 8, 6, 2, 16), 2, (3, 3, 3), (1, 2, 2), (False, False, True), (1, 1, 1), "contiguous"),
    ((1, 6, 4, 8, 2, 16), 2, (3, 3, 3), (2, 1, 2), (False,) * 3, (1, 1, 2), "contiguous"),
]
# Small boxes: several per group along every axis, and an extra one in the largest group.
FWD = configs.ForwardConfig((2, 4, 4), (1, 4, 8), 4, 2)
BWD = configs.BackwardConfig((2, 4, 4), (1, 4, 8), (2, 4, 4), (1, 4, 8), 4, 1)
# bf16 on the GPU only (the interpreter mishandles its arithmetic).
DTYPES = (torch.float32, torch.float16) + ((torch.bfloat16,) if DEVICE == "cuda" else ())
# Each case with each backward: the two-kernel one and the one-pass one (``fused``).
RUNS = [(case, dtype, fused) for case in CASES for dtype in DTYPES for fused in (False, True)]


def inputs(case, dtype, seed):
    shape, kv_heads, kernel, dilation, causal, stride, layout = case
    q, k, v = make_qkv(shape, dtype, layout=layout, device=DEVICE, seed=seed)
    return q, k[..., :kv_heads, :], v[..., :kv_heads, :]


# The default run: every dilated axis, causal W, stride on every axis, grouped heads (MQA),
# unequal groups, pointers in fp32 and fp16, and folded descriptors, each backward with
# pointers and with descriptors. Cases 0, 2 and 6 (slow) combine the same features otherwise,
# with causal T and GQA (case 6: two heads per key/value head, 20 s in the interpreter).
KEEP = [RUNS.index(run) for run in ((CASES[1], torch.float16, True), (CASES[4], torch.float32, False),
                                    (CASES[5], torch.float16, True), (CASES[7], torch.float16, True),
                                    (CASES[8], torch.float16, False))]


@pytest.mark.parametrize("case,dtype,fused", slow_except(
    RUNS, keep=KEEP + [i for i, (_, d, _) in enumerate(RUNS) if d == torch.bfloat16],
    ids=[f"{CASES.index(c)}-{str(d)[6:]}-{'one-pass' if f else 'two-kernel'}" for c, d, f in RUNS]))
def test_dilation_forward_and_backward(case, dtype, fused):
    shape, _, kernel, dilation, causal, stride, _ = case
    q, k, v = inputs(case, dtype, seed=sum(shape))
    grad_out = make_qkv(shape, dtype, device=DEVICE, seed=3)[0]
    features = dict(is_causal=causal, stride=stride, dilation=dilation)
    out = torch.full_like(q, float("nan"))
    out, lse = launch.na3d_forward(q, k, v, kernel, 0.3, out=out, return_lse=True, config=FWD, **features)
    oracle_heads = dict(dilation=dilation, is_causal=causal, stride=stride)
    assert_matches_oracle(out, q, k, v, kernel, 0.3, **oracle_heads)
    _, want_lse = na3d.na3d_brute_force(q.cpu(), k.cpu(), v.cpu(), kernel, scale=0.3, return_lse=True,
                                        **oracle_heads)
    torch.testing.assert_close(lse.cpu().double(), want_lse, rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-3)
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    launch.na3d_backward(grad_out, q, k, v, out, lse, kernel, 0.3, grads=grads,
                         config=dataclasses.replace(BWD, fused=fused), **features)
    assert_grads_match_oracle(grads, q, k, v, grad_out, kernel, 0.3, **oracle_heads)


def test_descriptors_fold_the_groups_where_the_layout_allows():
    """Which dilated layouts read through descriptors (16 bits; every dilated axis a
    multiple of its dilation and packed in the next outer one), and that a folded
    descriptor's coordinates reach the group's positions: the descriptor's view,
    indexed as the kernels index it, against the tensor itself."""
    q = make_qkv((2, 4, 6, 8, 2, 16), torch.float16, device=DEVICE)[0]
    assert launch.tma_layout_ok(q, dilation=(2, 2, 2)) == launch.tma_layout_ok(q)
    assert not launch.tma_layout_ok(q, dilation=(3, 1, 1))              # 4 frames in groups of 2 and 1
    k = q[..., :1, :]  # one of two heads: W not packed
    assert launch.tma_layout_ok(k, dilation=(2, 2, 1)) == launch.tma_layout_ok(k)
    assert not launch.tma_layout_ok(k, dilation=(1, 1, 2))
    assert launch.foldable((4, 6, 8), q.stride()[1:4], 32, (2, 3, 4))
    assert not launch.foldable((4, 6, 8), q.stride()[1:4], 32, (1, 4, 1))

    dilation, box = (2, 3, 4), (1, 2, 2)
    desc = launch.tensor_descriptor(q, box, dilation)
    view = torch.as_strided(q, desc.shape, desc.strides)  # what the descriptor addresses
    B, T, H, W, NH, HD = q.shape
    hm, wm = H // dilation[1], W // dilation[2]
    for gt, gh, gw in ((0, 0, 0), (1, 2, 3), (1, 0, 2)):
        group = q[:, gt::dilation[0], gh::dilation[1], gw::dilation[2]]
        for t, h, w, n in ((0, 0, 0, 0), (1, 1, 1, 1), (1, 0, 1, 0)):
            got = view[:, t, gt * hm + h, gh * wm + w, gw * NH * HD + n * HD:][..., :HD]
            assert torch.equal(got, group[:, t, h, w, n])


class LaunchCounter:
    """Stands in for a Triton kernel and counts its launches (the grids)."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("fused", [False, True], ids=["two-kernel", "one-pass"])
def test_dilation_runs_one_launch_per_kernel(fused, monkeypatch):
    """The public call with dilation (2, 2, 3) launches the forward kernel once and
    each backward kernel once (each with its second launch, the non-finite check's,
    whose grid is (G,)), over the whole tensors."""
    interpreted = launch.kernels_interpreted()  # (it asks the kernel's type, which the counter hides)
    monkeypatch.setattr(launch, "kernels_interpreted", lambda: interpreted)
    counters = {}
    for module, name in ((forward_kernels, "na3d_fwd_kernel"), (backward_kernels, "na3d_bwd_dq_kernel"),
                         (backward_kernels, "na3d_bwd_dkdv_kernel"), (backward_kernels, "na3d_bwd_delta_kernel")):
        counters[name] = LaunchCounter(getattr(module, name))
        monkeypatch.setattr(module, name, counters[name])
    real = launch.backward_config
    monkeypatch.setattr(launch, "backward_config",
                        lambda *a, **kw: dataclasses.replace(real(*a, **kw), fused=fused))
    shape, kernel, dilation = (1, 4, 6, 7, 2, 16), (2, 3, 2), (2, 2, 3)
    leaves = [t.requires_grad_() for t in make_qkv(shape, torch.float32, device=DEVICE, seed=8)]
    out = na3d.na3d(*leaves, kernel, dilation=dilation)
    out.sum().backward()
    first = [g for c in counters.values() for g in c.grids if len(g) == 3]
    assert len(counters["na3d_fwd_kernel"].grids) == 2  # the launch and its check's
    if fused:
        assert len(counters["na3d_bwd_delta_kernel"].grids) == 1 and not counters["na3d_bwd_dq_kernel"].grids
    else:
        assert len(counters["na3d_bwd_dq_kernel"].grids) == 2 and not counters["na3d_bwd_delta_kernel"].grids
    assert len(counters["na3d_bwd_dkdv_kernel"].grids) == 2
    assert len(first) == 3
    assert_matches_oracle(out.detach(), *(t.detach() for t in leaves), kernel, 0.25, dilation=dilation)


@pytest.mark.parametrize("shape,dtype", [((1, 4, 7, 9, 2, 16), torch.float32),   # pointers, unequal groups
                                         ((1, 4, 8, 9, 2, 16), torch.float16)],  # descriptors (16 bits)
                         ids=["pointers", "descriptors"])
def test_dilation_keeps_non_finite_values_inside_their_windows(shape, dtype):
    """A NaN in one value of one dilation group: the outputs and gradients whose
    windows hold it are NaN (they lie in its group), everything else equals the
    result with that value zeroed, bit for bit."""
    kernel, dilation = (2, 3, 3), (1, 2, 3)
    q, k, v = make_qkv(shape, dtype, device=DEVICE, seed=11)
    grad_out = make_qkv(shape, dtype, device=DEVICE, seed=12)[0]
    where = (0, 2, 3, 4, 1, 5)
    bad, clean = v.clone(), v.clone()
    bad[where] = float("nan")
    clean[where] = 0.0

    def run(values):
        out, lse = launch.na3d_forward(q, k, values, kernel, 0.3, return_lse=True, config=FWD, dilation=dilation)
        return (out, *launch.na3d_backward(grad_out, q, k, values, out, lse, kernel, 0.3, config=BWD,
                                           dilation=dilation))

    got, want = run(bad), run(clean)
    assert launch.tma_layout_ok(k, v, dilation=dilation) == (dtype == torch.float16)
    reached = na3d_windowed(q.cpu().float(), k.cpu().float(), bad.cpu().float(), kernel, 0.3,
                            dilation=dilation).isnan().any(-1)
    assert reached.any() and not reached.all()
    # Only queries of the value's group (H index odd, W index 1 mod 3) see it.
    assert not reached[:, :, 0::2].any() and not reached[:, :, :, 0::3].any()
    assert torch.equal(got[0].isnan().any(-1).cpu(), reached)
    for g, w in zip(got, want):
        finite = ~g.isnan()
        assert torch.equal(g[finite], w[finite])
