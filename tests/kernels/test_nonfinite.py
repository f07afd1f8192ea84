"""Non-finite inputs stay inside their windows.

An inf or NaN placed in a query, key or value must reach exactly the outputs,
log-sum-exps and gradients that IEEE arithmetic over the windows gives it (the
gathered float64 oracle ``na3d_windowed``), and every other element must equal,
bit for bit, what the same kernels give with that input zeroed. The fuzz test
draws shapes, kernels, causal axes, strides, scales, tilings (every window-mask
mode), descriptor and pointer loads and both backward paths at random; the
public-API fuzz adds dilation, GQA and even kernels. On a machine without a GPU
the kernels run in the Triton interpreter (fp16/fp32); on a GPU they run compiled
in bf16, and ``test_benchmark_shapes_on_gpu`` covers the benchmark shapes.
"""

import math
import random

import pytest
import torch

import na3d
from na3d import geometry, launch
from na3d.configs import BackwardConfig, ForwardConfig
from na3d.reference import na3d_windowed
from helpers import assert_grads_match_oracle, make_qkv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.skipif(DEVICE == "cpu" and not launch.kernels_interpreted(),
                       reason="no GPU and the Triton interpreter is not active"),
    # The interpreter's reductions warn on all-NaN rows; that is the point here.
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
]
# bf16 needs the GPU: the interpreter computes bf16 dots wrongly.
DTYPES = (torch.bfloat16,) if DEVICE == "cuda" else (torch.float16, torch.float32)

# Tilings and the window-mask mode each gives per axis T, H, W (F: once per
# program, B: window bits, P: per-step compares; launch.mask_modes), with the
# kernels they suit: (q_tile, kv_tile, kernel, causal, stride).
TILINGS = [
    ((2, 2, 4), (4, 4, 8), (3, 3, 5), (False, False, False), (1, 1, 1)),   # FFF: one step
    ((2, 2, 4), (1, 4, 8), (3, 3, 5), (False, False, False), (1, 1, 1)),   # BFF
    ((1, 4, 4), (1, 2, 16), (3, 5, 5), (False, False, False), (1, 1, 1)),  # BBF
    ((2, 4, 4), (4, 2, 4), (3, 3, 3), (True, False, False), (1, 1, 1)),    # FBB, causal T
    ((2, 2, 4), (1, 4, 8), (3, 4, 5), (False, False, True), (1, 2, 2)),    # BBF, stride and causal W
    ((2, 2, 8), (2, 2, 16), (3, 5, 9), (False, False, False), (1, 1, 2)),  # W fixed by its length
    ((1, 4, 4), (1, 2, 16), (3, 3, 3), (False, True, False), (1, 1, 1)),   # plain mask (fixed_mask off)
]
SPECIALS = (float("nan"), float("inf"), float("-inf"))


def inject(tensors, rng, count):
    """Copies of ``tensors`` (a dict q/k/v) with ``count`` random elements set to
    inf or NaN, and copies with those elements zeroed."""
    bad = {n: t.clone() for n, t in tensors.items()}
    zero = {n: t.clone() for n, t in tensors.items()}
    for _ in range(count):
        name = rng.choice("qkv")
        index = tuple(rng.randrange(s) for s in tensors[name].shape)
        bad[name][index] = rng.choice(SPECIALS)
        zero[name][index] = 0.0
    return bad, zero


def kernel_results(x, kernel, scale, causal, stride, fwd_cfg, bwd_cfg, grad_out):
    """(out, lse, dq, dk, dv) of the kernels, outputs poisoned before each launch."""
    out = torch.full_like(x["q"], float("nan"))
    lse = torch.full(x["q"].shape[:-1], float("nan"), device=x["q"].device)
    out, lse = launch.na3d_forward(x["q"], x["k"], x["v"], kernel, scale, return_lse=True, out=out,
                                   config=fwd_cfg, is_causal=causal, stride=stride)
    grads = tuple(torch.full_like(t, float("nan")) for t in (x["q"], x["k"], x["v"]))
    launch.na3d_backward(grad_out, x["q"], x["k"], x["v"], out, lse, kernel, scale, grads=grads, config=bwd_cfg,
                         is_causal=causal, stride=stride)
    return (out, lse, *grads)


def oracle_results(x, kernel, scale, grad_out, **geometry_args):
    """The gathered float64 oracle's (out, lse, dq, dk, dv) for ``sum(out * grad_out)``."""
    leaves = [x[n].detach().cpu().double().requires_grad_() for n in "qkv"]
    out, lse = na3d_windowed(*leaves, kernel, scale, return_lse=True, **geometry_args)
    grads = torch.autograd.grad((out * grad_out.cpu().double()).sum(), leaves)
    return (out.detach(), lse.detach(), *grads)


def assert_isolated(got, zeroed, oracle, oracle_zeroed):
    """Non-finite exactly where the oracle is; bit for bit the zeroed-input run
    wherever the inputs set to inf/NaN cannot reach (the oracle's results with and
    without them are equal there: a row of the gathered oracle depends on its
    window alone)."""
    for name, g, z, o, oz in zip(("out", "lse", "dq", "dk", "dv"), got, zeroed, oracle, oracle_zeroed):
        g, z = g.cpu(), z.cpu()
        finite = torch.isfinite(g)
        want = torch.isfinite(o)
        assert torch.equal(finite, want), (
            f"{name}: {int((~finite & want).sum())} elements non-finite that the oracle keeps finite, "
            f"{int((finite & ~want).sum())} finite that it makes non-finite")
        unreached = o == oz
        assert torch.equal(g[unreached], z[unreached]), (
            f"{name}: elements out of the non-finite inputs' reach differ from the zeroed-input run")


# A quick sample by default (fixed, bit-masked and per-step axes, causal, the plain
# mask, the one-pass backward: the tilings of seeds 1, 3 and 6); the whole sweep is
# marked slow (seed 0, one step over all keys, among them).
QUICK_SEEDS = (1, 3, 6)
FUZZ_SEEDS = [s if s in QUICK_SEEDS else pytest.param(s, marks=pytest.mark.slow) for s in range(28)]


@pytest.mark.parametrize("seed", FUZZ_SEEDS)
def test_fuzz_kernels(seed):
    fuzz_kernels(seed, in_program=False)


# The same problems with each program computing its own flagged tile again, in the
# one launch (configs' redo_in_program): the same results, bit for bit where finite.
# (Seed 3 by default; seed 0, its other default until now, took three times as long.)
@pytest.mark.parametrize("seed", [s if s == 3 else pytest.param(s, marks=pytest.mark.slow) for s in range(14)])
def test_fuzz_kernels_redo_in_program(seed):
    fuzz_kernels(seed, in_program=True)


def fuzz_kernels(seed, in_program):
    rng = random.Random(seed)
    q_tile, kv_tile, kernel, causal, stride = TILINGS[seed % len(TILINGS)]
    grid = tuple(rng.randint(k, k + 3) for k in kernel)
    # B > 1 or two heads on small grids only: the interpreter runs every program.
    shape = (rng.choice((1, 2)) if math.prod(grid) <= 150 else 1, *grid,
             rng.choice((1, 2)) if math.prod(grid) <= 150 else 1, 16)
    dtype = DTYPES[seed % len(DTYPES)]
    layout = rng.choice(("contiguous", "fused_heads"))  # descriptor loads where 16-bit, pointers otherwise
    scale = rng.choice((0.3, 0.3, -0.6, 0.0))
    fixed = seed % len(TILINGS) != len(TILINGS) - 1
    tma = rng.random() < 0.7
    fwd_cfg = ForwardConfig(q_tile, kv_tile, 4, 2, tma=tma, fixed_mask=fixed, redo_in_program=in_program)
    bwd_cfg = BackwardConfig(q_tile, kv_tile, (2, 2, 4), (1, 2, 8), 4, 2, fused=seed % 3 == 0, tma=tma,
                             fixed_mask=fixed, redo_in_program=in_program, dkdv_redo_in_program=in_program)
    q, k, v = make_qkv(shape, dtype, layout, device=DEVICE, seed=seed)
    grad_out = make_qkv(shape, dtype, device=DEVICE, seed=seed + 100)[0]
    bad, zero = inject({"q": q, "k": k, "v": v}, rng, rng.randint(1, 3))
    args = (kernel, scale, causal, stride, fwd_cfg, bwd_cfg, grad_out)
    got = kernel_results(bad, *args)
    zeroed = kernel_results(zero, *args)
    assert_isolated(got, zeroed, oracle_results(bad, kernel, scale, grad_out, is_causal=causal, stride=stride),
                    oracle_results(zero, kernel, scale, grad_out, is_causal=causal, stride=stride))
    # The zeroed run itself is right: against the float64 oracle, derived tolerances (its
    # out and lse first, then the gradients with the same math reading them).
    if not bwd_cfg.fused:
        assert_grads_match_oracle(zeroed[2:], *(zero[n] for n in "qkv"), grad_out, kernel, scale,
                                  is_causal=causal, stride=stride, forward=zeroed[:2])


@pytest.mark.parametrize("seed", [pytest.param(s, marks=pytest.mark.slow) if s >= 2 else s for s in range(10)])
def test_fuzz_public_api(seed):
    # Dilation, grouped-query attention, even kernels and causal axes through the
    # public API (its own configurations), forward and autograd.
    rng = random.Random(1000 + seed)
    dilation = tuple(rng.choice((1, 1, 2)) for _ in range(3))
    kernel = tuple(rng.choice((2, 3)) for _ in range(3))
    causal = tuple(rng.random() < 0.3 for _ in range(3))
    grid = tuple(k * d + rng.randint(0, 3) for k, d in zip(kernel, dilation))
    heads, kv_heads = rng.choice(((2, 2), (2, 1), (4, 2)))
    dtype = DTYPES[seed % len(DTYPES)]
    q = make_qkv((1, *grid, heads, 16), dtype, device=DEVICE, seed=seed)[0]
    k, v = make_qkv((1, *grid, kv_heads, 16), dtype, device=DEVICE, seed=seed + 50)[:2]
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)
    bad, zero = inject({"q": q, "k": k, "v": v}, rng, rng.randint(1, 2))

    def run(x):
        leaves = [x[n].detach().clone().requires_grad_() for n in "qkv"]
        out, lse = na3d.na3d(*leaves, kernel, dilation=dilation, is_causal=causal, scale=0.3, return_lse=True)
        grads = torch.autograd.grad((out * grad_out).sum(), leaves)
        return (out.detach(), lse.detach(), *grads)

    assert_isolated(run(bad), run(zero),
                    oracle_results(bad, kernel, 0.3, grad_out, dilation=dilation, is_causal=causal),
                    oracle_results(zero, kernel, 0.3, grad_out, dilation=dilation, is_causal=causal))


def test_one_nan_key_reaches_only_its_window():
    # The reported case: one NaN key on a 1-D sequence and on 3-D grids; the rows
    # whose windows hold it turn NaN, no other.
    for shape, kernel in (((1, 1, 1, 64, 1, 16), (1, 1, 3)), ((1, 8, 16, 16, 1, 16), (3, 3, 3)),
                          ((1, 4, 5, 6, 1, 16), (3, 3, 3))):
        q, k, v = make_qkv(shape, DTYPES[0], device=DEVICE, seed=3)
        k[0, 0, 0, 0, 0, 0] = float("nan")
        out, _ = launch.na3d_forward(q, k, v, kernel, 0.25)
        rows = (~torch.isfinite(out)).any(-1)[0, ..., 0].cpu()
        sees = [torch.zeros(L, dtype=torch.bool) for L in shape[1:4]]
        for axis, L, K in zip(range(3), shape[1:4], kernel):
            first, stop = geometry.queries_seeing(0, 0, L, K)
            sees[axis][first:stop] = True
        want = sees[0][:, None, None] & sees[1][None, :, None] & sees[2][None, None, :]
        assert torch.equal(rows, want), (shape, int(rows.sum()), int(want.sum()))


# -- the benchmark shapes, on a GPU ---------------------------------------------------

def expected_nonfinite(shape, kernel, which, position, channel):
    """Per result (out, lse, dq, dk, dv), a boolean tensor of the elements one NaN in
    ``which`` (q/k/v) at grid ``position``, head 0 of batch 0, channel ``channel``
    makes non-finite: from the geometry alone (boxes of queries seeing a position,
    unions of windows), for large shapes where the oracle does not fit."""
    B, T, H, W, NH, HD = shape

    def box(ranges, channels=None):
        m = torch.zeros(B, T, H, W, NH, dtype=torch.bool)
        m[0, ranges[0][0]:ranges[0][1], ranges[1][0]:ranges[1][1], ranges[2][0]:ranges[2][1], 0] = True
        return m

    def rows(m, channels=None):
        full = m[..., None].expand(B, T, H, W, NH, HD).clone()
        if channels is not None:
            full[..., [c for c in range(HD) if c != channels]] = False
        return full

    sizes = (T, H, W)
    point = [(p, p + 1) for p in position]
    seeing = [geometry.queries_seeing(p, p, L, K) for p, L, K in zip(position, sizes, kernel)]
    window = [geometry.union_of_windows(p, p, L, K) for p, L, K in zip(position, sizes, kernel)]
    reach = [geometry.union_of_windows(a, b - 1, L, K) for (a, b), L, K in zip(seeing, sizes, kernel)]
    none = torch.zeros(B, T, H, W, NH, dtype=torch.bool)
    if which == "k":   # its scores: every row that sees it, and every key those rows see
        return rows(box(seeing)), box(seeing), rows(box(seeing)), rows(box(reach)), rows(box(reach))
    if which == "v":   # one channel of the outputs; dP of the rows that see it
        return rows(box(seeing), channel), none, rows(box(seeing)), rows(box(reach)), rows(none)
    # q: its own row, and every key of its window
    return rows(box(point)), box(point), rows(box(point)), rows(box(window)), rows(box(window))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU")
@pytest.mark.parametrize("which", "qkv")
@pytest.mark.parametrize("name", ["ltx-stage1", "ltx-stage3", "ltx-stage4-tile", "ltx-stage5-tile",
                                  "ltx-stage5-small", "edge-wide"])
def test_benchmark_shapes_on_gpu(name, which):
    from na3d.tools.common import bench_shapes

    spec = next(s for s in bench_shapes() if s["name"] == name)
    shape, kernel = tuple(spec["shape"]), tuple(spec["kernel_size"])
    rng = random.Random(name + which)
    q, k, v = make_qkv(shape, torch.bfloat16, "fused_qkv", device="cuda", seed=7)
    grad_out = make_qkv(shape, torch.bfloat16, device="cuda", seed=8)[0]
    position = tuple(rng.randrange(L) for L in shape[1:4])
    if rng.random() < 0.5:  # a border position half of the time
        position = tuple(rng.choice((0, L - 1)) for L in shape[1:4])
    channel = rng.randrange(shape[5])
    x = {"q": q, "k": k, "v": v}
    bad, zero = ({n: t.clone() for n, t in x.items()} for _ in range(2))
    bad[which][(0, *position, 0, channel)] = float("nan")
    zero[which][(0, *position, 0, channel)] = 0.0
    scale = shape[5] ** -0.5

    def run(y):
        out, lse = launch.na3d_forward(y["q"], y["k"], y["v"], kernel, scale, return_lse=True)
        return (out, lse, *launch.na3d_backward(grad_out, y["q"], y["k"], y["v"], out, lse, kernel, scale))

    got, zeroed = run(bad), run(zero)
    for result, g, z, want in zip(("out", "lse", "dq", "dk", "dv"), got, zeroed,
                                  expected_nonfinite(shape, kernel, which, position, channel)):
        nonfinite = ~torch.isfinite(g).cpu()
        assert torch.equal(nonfinite, want), (result, int(nonfinite.sum()), int(want.sum()))
        assert torch.equal(g[~nonfinite.cuda()], z[~nonfinite.cuda()]), result
