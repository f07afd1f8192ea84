"""The Triton forward kernel against the float64 oracle.

On a machine without a GPU these run in the Triton interpreter (fp16 and fp32 only:
the interpreter computes bf16 dots wrongly); on a GPU they run compiled, and the
``gpu`` tests at the end add bf16, the benchmark shapes, edge cases and huge tensors
(tolerances derived per case from the error of the same math done by PyTorch at the
test dtype, the grouped-SDPA reference run in that dtype, measured against a float32
or float64 oracle).
"""

import pytest
import torch

import na3d
from na3d import launch
from na3d.configs import ForwardConfig
from na3d.tools.common import bench_shapes
from helpers import LAYOUTS, assert_matches_oracle, make_qkv, poisoned_like, slow_except

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not launch.kernels_interpreted(),
    reason="no GPU and the Triton interpreter is not active")

AWKWARD = [
    # (B, T, H, W, NH, HD), kernel
    ((1, 5, 6, 7, 2, 32), (3, 3, 5)),      # odd sizes
    ((2, 3, 5, 9, 3, 16), (3, 5, 9)),      # kernel = dimension, B > 1
    ((1, 4, 4, 4, 2, 16), (1, 1, 1)),      # kernel 1
    ((1, 2, 3, 37, 1, 64), (1, 3, 11)),    # W not a multiple of any block, long W window
    ((2, 7, 2, 5, 2, 16), (5, 1, 3)),      # T > H, kernel 1 along H
    ((1, 1, 1, 19, 1, 48), (1, 1, 7)),     # 1-D grid, head dim not a power of two
]


def run_poisoned(q, k, v, kernel, scale, config=None, return_lse=False):
    out = poisoned_like(q)
    res, lse = launch.na3d_forward(q, k, v, kernel, scale, return_lse=return_lse, out=out, config=config)
    assert res is out
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("shape,kernel", slow_except(AWKWARD, keep=(0, 2, 3, 4, 5)))
def test_forward_awkward_shapes(shape, kernel, dtype):
    q, k, v = make_qkv(shape, dtype, device=DEVICE, seed=sum(shape) + sum(kernel))
    out, _ = run_poisoned(q, k, v, kernel, shape[-1] ** -0.5)
    assert_matches_oracle(out.cpu(), q.cpu(), k.cpu(), v.cpu(), kernel, shape[-1] ** -0.5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_strided_views_without_copies(layout):
    shape, kernel = (2, 3, 4, 6, 2, 16), (3, 3, 3)
    q, k, v = make_qkv(shape, torch.float16, layout, device=DEVICE, seed=11)
    if layout != "contiguous":
        assert not q.is_contiguous()
    out, _ = run_poisoned(q, k, v, kernel, 0.25)
    assert_matches_oracle(out.cpu(), q.cpu(), k.cpu(), v.cpu(), kernel, 0.25)


DESCRIPTOR_CASES = [(layout, possible, tma) for tma in (False, True)
                    for layout, possible in (("contiguous", True), ("fused_qkv", True),
                                             ("fused_heads", False), ("heads_first", False))]


@pytest.mark.parametrize("layout,tma_possible,tma", slow_except(
    DESCRIPTOR_CASES, keep=(3, 4), ids=[f"{tma}-{layout}-{possible}" for layout, possible, tma in DESCRIPTOR_CASES]))
def test_forward_descriptor_and_pointer_loads(layout, tma_possible, tma):
    # Key/value boxes load through tensor descriptors where the layout allows it
    # (heads packed, 16-byte strides), through pointers otherwise or when the config
    # says so; the boxes overrun the grid (zero fill) and the union (masked keys).
    shape, kernel = (2, 3, 5, 7, 2, 16), (3, 3, 5)
    q, k, v = make_qkv(shape, torch.float16, layout, device=DEVICE, seed=13)
    assert launch.tma_layout_ok(k, v) == tma_possible
    cfg = ForwardConfig((2, 2, 4), (1, 2, 8), num_warps=4, num_stages=2, tma=tma)
    out, _ = run_poisoned(q, k, v, kernel, 0.25, config=cfg)
    assert_matches_oracle(out.cpu(), q.cpu(), k.cpu(), v.cpu(), kernel, 0.25)


def test_forward_writes_strided_output():
    shape, kernel = (1, 3, 4, 6, 2, 16), (3, 3, 5)
    q, k, v = make_qkv(shape, torch.float32, device=DEVICE, seed=2)
    big = torch.full((1, 3, 4, 6, 2, 3, 16), float("nan"), device=DEVICE)
    out = big[..., 1, :]
    launch.na3d_forward(q, k, v, kernel, 0.25, out=out)
    assert_matches_oracle(out.cpu(), q.cpu(), k.cpu(), v.cpu(), kernel, 0.25)
    assert torch.isnan(big[..., 0, :]).all() and torch.isnan(big[..., 2, :]).all(), "wrote outside out"


TILINGS = [
    ((1, 2, 8), (1, 1, 16)),    # query box cut by the W border, W = 7
    ((4, 4, 4), (2, 2, 4)),     # query box larger than T = 3
    ((2, 8, 1), (1, 16, 1)),    # query box one wide: all along H
    ((1, 1, 16), (4, 2, 2)),    # key box deeper than the union along T
    ((8, 2, 1), (1, 1, 16)),
    ((8, 4, 2), (1, 16, 4)),    # the 11x11x11 bucket's deep boxes: deeper than T, key slabs one frame deep
    ((16, 2, 2), (16, 4, 2)),   # its whole-clip boxes: T = 3 fits the key box, so T is masked once
]


@pytest.mark.parametrize("q_tile,kv_tile", slow_except(TILINGS, keep=(0, 1, 2, 5, 6)))
def test_forward_tilings_cut_by_borders(q_tile, kv_tile):
    shape, kernel = (1, 3, 9, 7, 1, 16), (3, 5, 3)
    q, k, v = make_qkv(shape, torch.float32, device=DEVICE, seed=7)
    cfg = ForwardConfig(q_tile, kv_tile, num_warps=4, num_stages=1)
    out, _ = run_poisoned(q, k, v, kernel, 0.3, config=cfg)
    assert_matches_oracle(out.cpu(), q.cpu(), k.cpu(), v.cpu(), kernel, 0.3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_forward_lse(dtype):
    shape, kernel = (2, 3, 5, 6, 2, 16), (3, 3, 5)
    q, k, v = make_qkv(shape, dtype, device=DEVICE, seed=4)
    out, lse = run_poisoned(q, k, v, kernel, 0.25, return_lse=True)
    _, want = na3d.na3d_brute_force(q.cpu(), k.cpu(), v.cpu(), kernel, scale=0.25, return_lse=True)
    assert lse.shape == shape[:5] and lse.dtype == torch.float32
    torch.testing.assert_close(lse.cpu().double(), want, rtol=0, atol=2e-3 if dtype == torch.float16 else 1e-5)


@pytest.mark.parametrize("scale", [-0.7, 0.0, 1e-3])
def test_forward_scale_of_any_sign(scale):
    # The kernel takes the row maximum on unscaled scores and picks max or min by
    # the scale's sign (zero: every visible score is 0, a uniform average).
    shape, kernel = (1, 3, 5, 6, 2, 16), (3, 3, 5)
    q, k, v = make_qkv(shape, torch.float32, device=DEVICE, seed=9)
    out, lse = run_poisoned(q, k, v, kernel, scale, return_lse=True)
    assert_matches_oracle(out.cpu(), q.cpu(), k.cpu(), v.cpu(), kernel, scale)
    _, want = na3d.na3d_brute_force(q.cpu(), k.cpu(), v.cpu(), kernel, scale=scale, return_lse=True)
    torch.testing.assert_close(lse.cpu().double(), want, rtol=0, atol=1e-5)


def test_public_api_runs_kernel_and_scale_conventions():
    shape, kernel = (1, 3, 4, 5, 2, 16), (3, 3, 3)
    q, k, v = make_qkv(shape, torch.float32, device=DEVICE, seed=9)
    scale = 16 ** -0.5
    a = na3d.na3d(q, k, v, kernel)                       # scale None -> HD ** -0.5
    b = na3d.na3d_flash_attn(q * scale, k, v, kernel)    # pre-scaled queries
    c = na3d.na3d(q, k, v, 3, scale=scale)              # int kernel size
    assert_matches_oracle(a.cpu(), q.cpu(), k.cpu(), v.cpu(), kernel, scale)
    torch.testing.assert_close(a, c, rtol=0, atol=0)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_forward_is_deterministic():
    shape, kernel = (1, 3, 5, 7, 2, 16), (3, 3, 5)
    q, k, v = make_qkv(shape, torch.float16, device=DEVICE, seed=1)
    a = na3d.na3d(q, k, v, kernel)
    b = na3d.na3d(q, k, v, kernel)
    assert torch.equal(a, b)


def test_forward_with_register_cap():
    # The cap is a compile option only: same results (the interpreter ignores it).
    shape, kernel = (1, 3, 5, 7, 2, 16), (3, 3, 5)
    q, k, v = make_qkv(shape, torch.float32, device=DEVICE, seed=21)
    cfg = ForwardConfig((2, 2, 4), (1, 2, 8), num_warps=4, num_stages=2, maxnreg=128)
    out, _ = run_poisoned(q, k, v, kernel, 0.25, config=cfg)
    assert_matches_oracle(out.cpu(), q.cpu(), k.cpu(), v.cpu(), kernel, 0.25)


# Configurations whose key box covers every program's union along some axes, so the
# kernel computes that part of the mask once per program and masks the others from
# window bits (launch.mask_modes): (q_tile, kv_tile, kernel, causal, stride, the
# expected mode per axis T, H, W: F fixed, B bits, P per-step compares).
MASK_CASES = [
    ((2, 2, 4), (4, 4, 8), (3, 3, 5), (False, False, False), (1, 1, 1), "FFF"),  # one step in all
    ((2, 2, 4), (1, 4, 8), (3, 3, 5), (False, False, False), (1, 1, 1), "BFF"),
    ((1, 4, 4), (1, 2, 16), (3, 5, 5), (False, False, False), (1, 1, 1), "BBF"),
    ((2, 4, 4), (4, 2, 4), (3, 3, 3), (False, False, False), (1, 1, 1), "FBB"),
    ((2, 2, 4), (4, 4, 8), (3, 3, 5), (True, False, True), (1, 1, 1), "FFF"),    # causal axes
    ((2, 2, 4), (1, 8, 8), (3, 4, 5), (False, False, False), (1, 2, 1), "BFF"),   # a NATTEN stride
    ((2, 2, 4), (1, 4, 8), (3, 4, 5), (False, False, True), (1, 2, 2), "BBF"),    # stride and causal
]


def mode_letters(modes):
    return "".join("PBF"[modes[f"MASK_{axis}"]] for axis in "THW")


@pytest.mark.parametrize("case,scale", slow_except([(i, 0.3) for i in range(len(MASK_CASES))]
                                                 + [(0, -0.7), (0, 0.0), (1, -0.7), (1, 0.0)], keep=(3,)))
def test_forward_mask_fixed_along_some_axes(case, scale):
    # Odd grid sizes cut the boxes at every border; B > 1; fp16 cases load K/V boxes
    # through tensor descriptors, fp32 ones through pointers.
    q_tile, kv_tile, kernel, causal, stride, expected = MASK_CASES[case]
    assert mode_letters(launch.mask_modes(q_tile, kv_tile, kernel, causal, stride)) == expected
    check_mask_case(q_tile, kv_tile, kernel, causal, stride, scale, torch.float16 if case % 2 else torch.float32,
                    seed=31 + case)


def check_mask_case(q_tile, kv_tile, kernel, causal, stride, scale, dtype, seed, shape=(2, 5, 7, 9, 2, 16)):
    """The forward on these tiles against the oracle (poisoned output first)."""
    q, k, v = make_qkv(shape, dtype, device=DEVICE, seed=seed)
    cfg = ForwardConfig(q_tile, kv_tile, num_warps=4, num_stages=2)
    out = poisoned_like(q)
    launch.na3d_forward(q, k, v, kernel, scale, out=out, config=cfg, is_causal=causal, stride=stride)
    assert_matches_oracle(out.cpu(), q.cpu(), k.cpu(), v.cpu(), kernel, scale, is_causal=causal, stride=stride)


# Axes no longer than the key box: masked once per program whatever the union
# bound (launch.mask_modes' ``lengths``), on a 5x7x9 grid. (q_tile, kv_tile, kernel,
# causal, stride, modes without the lengths, modes with them).
SHORT_AXIS_CASES = [
    ((8, 2, 2), (8, 2, 4), (3, 3, 5), (False, False, False), (1, 1, 1), "PPP", "FBB"),  # boxes deeper than T
    ((16, 2, 2), (16, 4, 2), (5, 5, 7), (True, False, False), (1, 1, 1), "PPP", "FBB"),  # causal T, K = T
    ((2, 2, 4), (1, 8, 16), (3, 3, 5), (False, False, False), (1, 2, 1), "BFF", "BFF"),  # already fixed
    ((2, 2, 8), (2, 2, 16), (3, 5, 9), (False, False, False), (1, 1, 2), "PPP", "BBF"),  # W = 9 <= 16, strided
]


@pytest.mark.parametrize("case,scale", slow_except([(i, 0.3) for i in range(len(SHORT_AXIS_CASES))]
                                                 + [(0, -0.7), (1, 0.0)], keep=(0,)))
def test_forward_mask_fixed_on_axes_no_longer_than_the_key_box(case, scale):
    q_tile, kv_tile, kernel, causal, stride, bound_only, with_lengths = SHORT_AXIS_CASES[case]
    shape = (2, 5, 7, 9, 2, 16)
    assert mode_letters(launch.mask_modes(q_tile, kv_tile, kernel, causal, stride)) == bound_only
    assert mode_letters(launch.mask_modes(q_tile, kv_tile, kernel, causal, stride, True, shape[1:4])) == with_lengths
    check_mask_case(q_tile, kv_tile, kernel, causal, stride, scale, torch.float16 if case % 2 else torch.float32,
                    seed=61 + case, shape=shape)


@pytest.mark.parametrize("case,modes", slow_except([(1, (0, 2, 2)), (2, (0, 1, 2)), (3, (2, 0, 1))], keep=(2,)))
def test_forward_per_step_compares_beside_a_fixed_axis(case, modes, monkeypatch):
    # Per-step compares on a moving axis (what the launcher picks where window bits
    # would not fit 31 bits, which needs kernels larger than a test grid) together
    # with fixed and bit-masked axes.
    q_tile, kv_tile, kernel, causal, stride, _ = MASK_CASES[case]
    monkeypatch.setattr(launch, "mask_modes", lambda *args: dict(zip(("MASK_T", "MASK_H", "MASK_W"), modes)))
    shape = (1, 5, 7, 9, 2, 16)
    q, k, v = make_qkv(shape, torch.float32, device=DEVICE, seed=51 + case)
    cfg = ForwardConfig(q_tile, kv_tile, num_warps=4, num_stages=2)
    out = poisoned_like(q)
    launch.na3d_forward(q, k, v, kernel, 0.3, out=out, config=cfg, is_causal=causal, stride=stride)
    assert_matches_oracle(out.cpu(), q.cpu(), k.cpu(), v.cpu(), kernel, 0.3, is_causal=causal, stride=stride)


# --------------------------------------------------------------------------------
# GPU: bf16/fp16 on the benchmark shapes and edge cases, huge tensors
# --------------------------------------------------------------------------------

GPU_DTYPES = [torch.bfloat16, torch.float16]


def check_against_reference(q, k, v, kernel, scale, oracle_dtype=torch.float32):
    out = torch.full_like(q, float("nan"))
    launch.na3d_forward(q, k, v, kernel, scale, out=out)
    oracle = na3d.na3d_sdpa_exact(q.to(oracle_dtype), k.to(oracle_dtype), v.to(oracle_dtype), kernel, scale=scale)
    same_math = na3d.na3d_sdpa_exact(q, k, v, kernel, scale=scale)
    torch_err = (same_math.to(oracle_dtype) - oracle).abs().max().item()
    band = 2 * torch.finfo(q.dtype).eps * max(1.0, oracle.abs().max().item())
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) output elements"
    err = (out.to(oracle_dtype) - oracle).abs().max().item()
    assert err <= 2 * torch_err + band, f"max abs error {err:.3e} > 2 x {torch_err:.3e} + {band:.1e}"
    return err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("spec", bench_shapes("ltx"), ids=lambda s: s["name"])
def test_benchmark_shapes(spec, dtype):
    shape, kernel = tuple(spec["shape"]), tuple(spec["kernel_size"])
    q, k, v = make_qkv(shape, dtype, device="cuda", seed=1)
    check_against_reference(q, k, v, kernel, shape[-1] ** -0.5)


EDGE = [
    ((1, 5, 6, 7, 2, 32), (3, 3, 5)),
    ((2, 3, 5, 9, 3, 64), (3, 5, 9)),       # kernel = dimension
    ((1, 4, 4, 4, 2, 64), (1, 1, 1)),       # kernel 1
    ((1, 2, 3, 37, 1, 128), (1, 3, 11)),
    ((3, 7, 2, 5, 2, 16), (5, 1, 3)),
    ((1, 1, 1, 300, 4, 64), (1, 1, 255)),   # one long axis
    ((1, 9, 13, 11, 2, 80), (7, 13, 3)),    # head dim not a power of two
    ((1, 3, 5, 6, 1, 256), (3, 3, 3)),      # widest head dim
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("shape,kernel", EDGE)
def test_edge_cases(shape, kernel, dtype):
    q, k, v = make_qkv(shape, dtype, device="cuda", seed=sum(shape))
    check_against_reference(q, k, v, kernel, 0.3, oracle_dtype=torch.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_layouts(layout):
    shape, kernel = (2, 6, 16, 24, 4, 64), (3, 7, 7)
    q, k, v = make_qkv(shape, torch.bfloat16, layout, device="cuda", seed=3)
    check_against_reference(q, k, v, kernel, 0.125)


@pytest.mark.gpu
def test_fp32_inputs():
    shape, kernel = (1, 5, 9, 12, 2, 64), (3, 5, 5)
    q, k, v = make_qkv(shape, torch.float32, device="cuda", seed=6)
    check_against_reference(q, k, v, kernel, 0.125, oracle_dtype=torch.float64)


@pytest.mark.gpu
def test_more_than_2_31_elements():
    """A fused-QKV view whose storage spans > 2**31 elements: offsets need int64."""
    B, T, H, W, NH, HD = 1, 49, 128, 128, 16, 64
    fused = torch.empty(B, T, H, W, 3 * NH * HD, dtype=torch.bfloat16, device="cuda")
    assert fused.numel() > 2 ** 31
    fused.normal_()
    q, k, v = (x.unflatten(-1, (NH, HD)) for x in fused.split(NH * HD, dim=-1))
    kernel = (3, 3, 3)
    out = torch.full((B, T, H, W, NH, HD), float("nan"), dtype=torch.bfloat16, device="cuda")
    launch.na3d_forward(q, k, v, kernel, HD ** -0.5, out=out)
    assert not torch.isnan(out).any()
    # The last two frames only see the last three frames: a slice is an exact reference.
    tail = slice(T - 3, T)
    want = na3d.na3d_sdpa_exact(q[:, tail].float(), k[:, tail].float(), v[:, tail].float(), kernel)
    err = (out[:, T - 2:].float() - want[:, 1:]).abs().max().item()
    assert err < 2e-2, err
    del fused, out
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_lse_on_gpu():
    shape, kernel = (2, 4, 6, 9, 3, 64), (3, 5, 5)
    q, k, v = make_qkv(shape, torch.bfloat16, device="cuda", seed=2)
    out, lse = na3d.na3d(q, k, v, kernel, return_lse=True)
    _, want = na3d.na3d_brute_force(q, k, v, kernel, return_lse=True)
    torch.testing.assert_close(lse.double(), want, rtol=0, atol=2e-2)


@pytest.mark.gpu
def test_deterministic_on_gpu():
    shape, kernel = (1, 18, 32, 48, 8, 64), (3, 7, 7)
    q, k, v = make_qkv(shape, torch.bfloat16, device="cuda", seed=5)
    a = na3d.na3d_flash_attn(q, k, v, kernel)
    b = na3d.na3d_flash_attn(q, k, v, kernel)
    assert torch.equal(a, b)
