"""The Triton backward kernels against float64 autograd.

Interpreter on a machine without a GPU (fp16 and fp32), compiled on a GPU, where the
``gpu`` tests add bf16 gradients on the LTX benchmark shapes and, on a reduced grid,
in the video-DiT regime (head dim 128, large windows).
"""

import dataclasses

import pytest
import torch

import na3d
from na3d import launch
from na3d.configs import BackwardConfig, ForwardConfig
from na3d.tools.common import bench_shapes
from helpers import (LAYOUTS, assert_grads_match_oracle, assert_matches_oracle, grads_of, make_qkv, poisoned_like,
                     slow_except)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not launch.kernels_interpreted(),
    reason="no GPU and the Triton interpreter is not active")

AWKWARD = [
    ((1, 5, 6, 7, 2, 32), (3, 3, 5)),
    ((2, 3, 5, 9, 1, 16), (3, 5, 9)),      # kernel = dimension, B > 1
    ((1, 4, 4, 4, 2, 16), (1, 1, 1)),      # kernel 1
    ((1, 2, 3, 21, 1, 16), (1, 3, 11)),
    ((1, 1, 1, 19, 1, 48), (1, 1, 7)),     # head dim not a power of two
]


def kernel_grads(q, k, v, grad_out, kernel, scale, config=None, poison=True):
    out, lse = launch.na3d_forward(q, k, v, kernel, scale, return_lse=True)
    bufs = tuple(torch.full_like(t, float("nan")) for t in (q, k, v)) if poison else None
    return launch.na3d_backward(grad_out, q, k, v, out, lse, kernel, scale, grads=bufs, config=config)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("shape,kernel", slow_except(AWKWARD, keep=(0, 2, 3, 4)))
def test_backward_awkward_shapes(shape, kernel, dtype):
    q, k, v = make_qkv(shape, dtype, device=DEVICE, seed=sum(shape))
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    grads = kernel_grads(q, k, v, grad_out, kernel, 0.3)
    assert_grads_match_oracle(grads, q, k, v, grad_out, kernel, 0.3)


BWD_TILINGS = [
    BackwardConfig((1, 2, 8), (1, 1, 16), (1, 2, 8), (1, 1, 16), 4, 1),
    BackwardConfig((4, 4, 4), (2, 2, 4), (4, 4, 4), (2, 2, 4), 4, 1),   # boxes larger than T = 3
    BackwardConfig((2, 8, 1), (1, 16, 1), (8, 2, 1), (1, 1, 16), 4, 1),
    BackwardConfig((1, 1, 16), (4, 2, 2), (1, 16, 1), (4, 4, 1), 4, 1),
]


@pytest.mark.parametrize("config", slow_except([(c,) for c in BWD_TILINGS], keep=(1,), ids=range(len(BWD_TILINGS))))
def test_backward_tilings_cut_by_borders(config):
    shape, kernel = (1, 3, 9, 7, 1, 16), (3, 5, 3)
    q, k, v = make_qkv(shape, torch.float32, device=DEVICE, seed=5)
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    grads = kernel_grads(q, k, v, grad_out, kernel, 0.25, config=config)
    assert_grads_match_oracle(grads, q, k, v, grad_out, kernel, 0.25)


# The sm90 table's backward pairs chosen by each kernel's own product count (NOTES v49),
# on grids their borders cut: the whole-clip boxes (dQ and dK/dV; T spans the clip), the
# small window's dK/dV 1x8x8/1x4x16, the medium window's dK/dV 1x8x8/2x8x4 and 2x8x4/2x2x16
# with dQ 2x8x4/1x2x16, the head-dim-128 large window's dK/dV 4x8x4/2x8x4 with dQ 2x8x4/2x8x2.
TABLE_PAIRS = [
    ((1, 13, 6, 5, 2, 16), (11, 5, 3), BackwardConfig((16, 2, 2), (16, 4, 1), (16, 2, 2), (16, 4, 1), 4, 2)),
    ((1, 3, 10, 18, 1, 16), (3, 7, 7), BackwardConfig((2, 4, 8), (4, 4, 4), (1, 8, 8), (1, 4, 16), 4, 2)),
    ((2, 4, 9, 40, 1, 16), (3, 5, 27), BackwardConfig((4, 4, 4), (4, 2, 4), (1, 8, 8), (2, 8, 4), 4, 2)),
    ((1, 7, 11, 9, 1, 32), (5, 7, 7), BackwardConfig((2, 8, 4), (1, 2, 16), (2, 8, 4), (2, 2, 16), 4, 2)),
    ((1, 9, 13, 10, 2, 16), (7, 9, 9), BackwardConfig((2, 8, 4), (2, 8, 2), (4, 8, 4), (2, 8, 4), 4, 2)),
]


@pytest.mark.parametrize("shape,kernel,config", slow_except(TABLE_PAIRS, keep=(0,), ids=range(len(TABLE_PAIRS))))
def test_backward_table_pairs(shape, kernel, config):
    q, k, v = make_qkv(shape, torch.float16, device=DEVICE, seed=sum(shape))
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(torch.float16).to(DEVICE)
    grads = kernel_grads(q, k, v, grad_out, kernel, 0.3, config=config)
    assert_grads_match_oracle(grads, q, k, v, grad_out, kernel, 0.3)


DESCRIPTOR_CASES = [(layout, tma, fused) for layout in ("contiguous", "fused_qkv", "heads_first")
                    for tma in (False, True) for fused in (False, True)]


@pytest.mark.parametrize("layout,tma,fused", slow_except(
    DESCRIPTOR_CASES, keep=(6,), ids=[f"{fused}-{tma}-{layout}" for layout, tma, fused in DESCRIPTOR_CASES]))
def test_backward_descriptor_and_pointer_loads(layout, tma, fused):
    # The dQ kernel's key/value boxes and the dK/dV kernel's query/dO boxes load
    # through tensor descriptors where the layout allows (and the config asks),
    # through pointers otherwise; boxes overrun the grid and the scanned ranges.
    # Fused: dQ is added by bulk reductions (descriptors) or per-element atomics.
    shape, kernel = (2, 3, 5, 7, 2, 16), (3, 3, 5)
    q, k, v = make_qkv(shape, torch.float16, layout, device=DEVICE, seed=17)
    assert launch.tma_layout_ok(q, k, v) == (layout != "heads_first")
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(18)).to(torch.float16).to(DEVICE)
    config = BackwardConfig((2, 2, 4), (1, 2, 8), (2, 2, 4), (1, 2, 8), 4, 1, fused=fused, tma=tma)
    grads = kernel_grads(q, k, v, grad_out, kernel, 0.25, config=config)
    assert_grads_match_oracle(grads, q, k, v, grad_out, kernel, 0.25)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_autograd_through_public_api_on_strided_views(layout):
    shape, kernel = (2, 3, 4, 5, 2, 16), (3, 3, 3)
    q, k, v = make_qkv(shape, torch.float32, layout, device=DEVICE, seed=3)
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    grads = grads_of(lambda a, b, c: na3d.na3d(a, b, c, kernel), q, k, v, grad_out)
    assert_grads_match_oracle(grads, q, k, v, grad_out, kernel, 16 ** -0.5)


def test_gradient_flows_into_a_fused_projection():
    B, T, H, W, NH, HD = 1, 3, 4, 5, 2, 16
    gen = torch.Generator().manual_seed(6)
    fused = torch.randn(B, T, H, W, 3 * NH * HD, generator=gen).to(DEVICE).requires_grad_()
    q, k, v = (x.unflatten(-1, (NH, HD)) for x in fused.split(NH * HD, dim=-1))
    grad_out = torch.randn(B, T, H, W, NH, HD, generator=gen).to(DEVICE)
    (na3d.na3d_flash_attn(q, k, v, 3) * grad_out).sum().backward()
    grads = [g.unflatten(-1, (NH, HD)) for g in fused.grad.split(NH * HD, dim=-1)]
    assert_grads_match_oracle(grads, q.detach(), k.detach(), v.detach(), grad_out, (3, 3, 3), 1.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gradient_through_lse(dtype):
    shape, kernel = (1, 3, 5, 6, 2, 16), (3, 3, 5)
    q, k, v = make_qkv(shape, dtype, device=DEVICE, seed=4)
    gen = torch.Generator().manual_seed(7)
    grad_out = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    grad_lse = torch.randn(shape[:5], generator=gen).to(DEVICE)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = na3d.na3d(*leaves, kernel, return_lse=True)
    ((out.float() * grad_out.float()).sum() + (lse * grad_lse).sum()).backward()
    assert_grads_match_oracle([t.grad for t in leaves], q, k, v, grad_out, kernel, 16 ** -0.5, grad_lse)


def test_backward_is_deterministic():
    shape, kernel = (1, 3, 5, 7, 2, 16), (3, 3, 5)
    q, k, v = make_qkv(shape, torch.float16, device=DEVICE, seed=1)
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(12)).half().to(DEVICE)
    a = kernel_grads(q, k, v, grad_out, kernel, 0.25)
    b = kernel_grads(q, k, v, grad_out, kernel, 0.25)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# The fused backward (dQ by atomic adds): same oracle, awkward shapes and tilings.
FUSED = [dataclasses.replace(c, fused=True) for c in BWD_TILINGS[:3]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("shape,kernel", slow_except(AWKWARD[:2] + AWKWARD[4:], keep=(0, 2)))
def test_fused_backward_awkward_shapes(shape, kernel, dtype):
    q, k, v = make_qkv(shape, dtype, device=DEVICE, seed=sum(shape))
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    config = dataclasses.replace(launch.backward_config(q, kernel), fused=True)
    grads = kernel_grads(q, k, v, grad_out, kernel, 0.3, config=config)
    assert_grads_match_oracle(grads, q, k, v, grad_out, kernel, 0.3)


@pytest.mark.parametrize("config", slow_except([(c,) for c in FUSED], keep=(1,), ids=range(len(FUSED))))
@pytest.mark.parametrize("causal", [(False, False, False), (True, False, True)], ids=["plain", "causal"])
def test_fused_backward_tilings_with_lse_gradient(config, causal):
    shape, kernel = (2, 3, 9, 7, 1, 16), (3, 5, 3)
    q, k, v = make_qkv(shape, torch.float32, device=DEVICE, seed=5)
    gen = torch.Generator().manual_seed(8)
    grad_out = torch.randn(shape, generator=gen).to(DEVICE)
    grad_lse = torch.randn(shape[:5], generator=gen).to(DEVICE)
    out, lse = launch.na3d_forward(q, k, v, kernel, 0.25, return_lse=True, is_causal=causal)
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    launch.na3d_backward(grad_out, q, k, v, out, lse, kernel, 0.25, grad_lse=grad_lse, grads=grads,
                         config=config, is_causal=causal)
    assert_grads_match_oracle(grads, q, k, v, grad_out, kernel, 0.25, grad_lse, is_causal=causal)


@pytest.mark.slow
@pytest.mark.parametrize("config", BWD_TILINGS, ids=range(len(BWD_TILINGS)))
def test_statistics_through_descriptors_on_tilings_cut_by_borders(config, monkeypatch):
    """16-bit inputs with packed heads: dK/dV reads q, dO and the per-query statistics
    through tensor descriptors (positions past the grid read zeros, no range mask);
    the same inputs through pointers (``tma=False``) take the masked path. Both match
    the oracle, on boxes cut by the borders and larger than T."""
    from na3d.kernels import backward as kernels

    shape, kernel = (1, 3, 9, 7, 2, 16), (3, 5, 3)
    q, k, v = make_qkv(shape, torch.float16, device=DEVICE, seed=6)
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(11)).to(torch.float16).to(DEVICE)
    flags = []
    real = kernels.na3d_bwd_dkdv_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch_(*args, **kwargs):
                if not kwargs["REDO"]:  # (the second launch recomputes flagged programs only)
                    flags.append(kwargs["USE_TMA"])
                return real[grid](*args, **kwargs)
            return launch_

    monkeypatch.setattr(kernels, "na3d_bwd_dkdv_kernel", Spy())
    through_descriptors = kernel_grads(q, k, v, grad_out, kernel, 0.25, config=config)
    through_pointers = kernel_grads(q, k, v, grad_out, kernel, 0.25, config=dataclasses.replace(config, tma=False))
    assert flags == [launch.tma_layout_ok(q, grad_out), False]
    assert_grads_match_oracle(through_descriptors, q, k, v, grad_out, kernel, 0.25)
    assert_grads_match_oracle(through_pointers, q, k, v, grad_out, kernel, 0.25)


def test_fused_backward_falls_back_to_fewer_stages_when_shared_memory_runs_out(monkeypatch):
    """The one-pass dK/dV kernel stages dQ too: where a config's dK/dV stages do not
    fit the GPU's shared memory (head dim 128, 128-key boxes, two stages on an H100),
    the launch that does not fit fails before it runs and the backward runs with
    fewer stages, remembered for that config. Here the launch fails as a GPU's would
    for any stage count above one."""
    from triton.runtime.errors import OutOfResources

    shape, kernel = (1, 3, 4, 5, 1, 16), (3, 3, 3)
    q, k, v = make_qkv(shape, torch.float16, device=DEVICE, seed=9)
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(13)).to(torch.float16).to(DEVICE)
    config = dataclasses.replace(BWD_TILINGS[0], fused=True, dkdv_num_stages=3)
    real = launch.dkdv_launch
    stages = []

    def dkdv_launch(kernel_fn, tiles, NH, B, cfg, *args):
        stages.append(cfg.dkdv_stages)
        if cfg.dkdv_stages > 1:
            raise OutOfResources(246824, 232448, "shared memory")
        return real(kernel_fn, tiles, NH, B, cfg, *args)

    monkeypatch.setattr(launch, "dkdv_launch", dkdv_launch)
    monkeypatch.setattr(launch, "_FUSED_DKDV_STAGES", {})
    grads = kernel_grads(q, k, v, grad_out, kernel, 0.25, config)
    assert stages == [3, 2, 1]
    assert_grads_match_oracle(grads, q, k, v, grad_out, kernel, 0.25)
    kernel_grads(q, k, v, grad_out, kernel, 0.25, config)
    assert stages == [3, 2, 1, 1]  # remembered


def test_deterministic_mode_overrides_the_fused_backward(monkeypatch):
    """Under torch.use_deterministic_algorithms(True) the atomic-free kernels run."""
    from na3d.kernels import backward as kernels

    shape, kernel = (1, 3, 4, 5, 1, 16), (3, 3, 3)
    q, k, v = make_qkv(shape, torch.float32, device=DEVICE, seed=9)
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(13)).to(DEVICE)
    config = dataclasses.replace(BWD_TILINGS[0], fused=True)
    launched = []
    for name in ("na3d_bwd_dq_kernel", "na3d_bwd_dkdv_kernel"):
        real = getattr(kernels, name)

        class Spy:
            def __init__(self, real, name):
                self.real, self.name = real, name

            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    atomic = " (atomic dQ)" if kwargs.get("ACCUMULATE_DQ") else ""
                    if not kwargs["REDO"]:  # (the second launch recomputes flagged programs only)
                        launched.append(self.name + atomic)
                    return self.real[grid](*args, **kwargs)
                return launch

        monkeypatch.setattr(kernels, name, Spy(real, name))
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        grads = kernel_grads(q, k, v, grad_out, kernel, 0.25, config=config)
    finally:
        torch.use_deterministic_algorithms(before)
    assert launched == ["na3d_bwd_dq_kernel", "na3d_bwd_dkdv_kernel"]
    assert_grads_match_oracle(grads, q, k, v, grad_out, kernel, 0.25)
    launched.clear()
    kernel_grads(q, k, v, grad_out, kernel, 0.25, config=config)
    assert launched == ["na3d_bwd_dkdv_kernel (atomic dQ)"]


# dQ boxes whose key box covers every program's union along some axes (the mask of
# those axes computed once per program, the others from window bits, as in the
# forward): (dQ query box, key box, kernel, causal, stride, expected modes T, H, W).
DQ_MASK_CASES = [
    ((2, 2, 4), (4, 4, 8), (3, 3, 5), (False, False, False), (1, 1, 1), "FFF"),
    ((1, 4, 4), (1, 2, 16), (3, 5, 5), (False, False, False), (1, 1, 1), "BBF"),
    ((2, 4, 4), (4, 2, 4), (3, 3, 3), (True, False, False), (1, 1, 1), "FBB"),
    ((2, 2, 4), (1, 4, 8), (3, 4, 5), (False, False, True), (1, 2, 2), "BBF"),
]


# dQ boxes spanning an axis no longer than the key box (T = 5 <= 8, W = 9 <= 16):
# masked once per program there (launch.mask_modes' ``lengths``).
DQ_SHORT_AXIS_CASES = [
    ((8, 2, 2), (8, 2, 4), (3, 3, 5), (False, False, False), (1, 1, 1), "FBB"),
    ((2, 2, 8), (2, 2, 16), (3, 5, 9), (True, False, False), (1, 1, 2), "BBF"),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(DQ_SHORT_AXIS_CASES)))
def test_backward_dq_mask_fixed_on_axes_no_longer_than_the_key_box(case):
    q_tile, kv_tile, kernel, causal, stride, expected = DQ_SHORT_AXIS_CASES[case]
    shape = (2, 5, 7, 9, 1, 16)
    modes = launch.mask_modes(q_tile, kv_tile, kernel, causal, stride, True, shape[1:4])
    assert "".join("PBF"[modes[f"MASK_{axis}"]] for axis in "THW") == expected
    check_dq_case(q_tile, kv_tile, kernel, causal, stride, 0.3, shape, torch.float16 if case % 2 else torch.float32,
                  seed=71 + case)


def check_dq_case(q_tile, kv_tile, kernel, causal, stride, scale, shape, dtype, seed):
    """Gradients with dQ on these tiles (and a gradient into lse) against the oracle."""
    q, k, v = make_qkv(shape, dtype, device=DEVICE, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    grad_out = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    grad_lse = torch.randn(shape[:5], generator=gen).to(DEVICE)
    config = BackwardConfig(q_tile, kv_tile, (2, 2, 4), (1, 2, 8), 4, 2)
    out, lse = launch.na3d_forward(q, k, v, kernel, scale, return_lse=True, is_causal=causal, stride=stride)
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    launch.na3d_backward(grad_out, q, k, v, out, lse, kernel, scale, grad_lse=grad_lse, grads=grads,
                         config=config, is_causal=causal, stride=stride)
    assert_grads_match_oracle(grads, q, k, v, grad_out, kernel, scale, grad_lse, is_causal=causal, stride=stride)


@pytest.mark.parametrize("case,scale", slow_except([(i, 0.3) for i in range(len(DQ_MASK_CASES))]
                                                 + [(0, -0.7), (1, 0.0)], keep=(2,)))
def test_backward_dq_mask_fixed_along_some_axes(case, scale):
    # Odd grid sizes, B > 1 (case 0), a gradient into lse; fp16 cases load boxes
    # through descriptors. A scale <= 0 keeps the plain mask (a masked score times
    # it would not be -inf): same results either way.
    q_tile, kv_tile, kernel, causal, stride, expected = DQ_MASK_CASES[case]
    modes = launch.mask_modes(q_tile, kv_tile, kernel, causal, stride)
    assert "".join("PBF"[modes[f"MASK_{axis}"]] for axis in "THW") == expected
    shape = (2 if case == 0 else 1, 5, 7, 9, 1, 16)
    check_dq_case(q_tile, kv_tile, kernel, causal, stride, scale, shape, torch.float16 if case % 2 else torch.float32,
                  seed=41 + case)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [(True, False, False), (False, True, True)])
def test_causal_kernel_tiles(causal):
    """Causal windows through tiles cut by the grid's end and larger than an axis."""
    shape, kernel = (1, 3, 9, 10, 1, 16), (3, 4, 5)
    q, k, v = make_qkv(shape, torch.float32, device=DEVICE, seed=31)
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(32)).to(DEVICE)
    for fwd in (ForwardConfig((4, 2, 2), (1, 4, 4), 4, 1), ForwardConfig((1, 2, 8), (2, 1, 8), 4, 1)):
        out = poisoned_like(q)
        out, lse = launch.na3d_forward(q, k, v, kernel, 0.25, return_lse=True, out=out, config=fwd,
                                       is_causal=causal)
        assert_matches_oracle(out.cpu(), q.cpu(), k.cpu(), v.cpu(), kernel, 0.25, is_causal=causal)
    bwd = BackwardConfig((4, 4, 1), (1, 2, 8), (1, 2, 8), (4, 1, 4), 4, 1)
    grads = tuple(poisoned_like(t) for t in (q, k, v))
    launch.na3d_backward(grad_out, q, k, v, out, lse, kernel, 0.25, grads=grads, config=bwd, is_causal=causal)
    assert_grads_match_oracle(grads, q, k, v, grad_out, kernel, 0.25, is_causal=causal)


# --------------------------------------------------------------------------------
# GPU: bf16/fp16 gradients on the LTX benchmark shapes; the DiT regime at head dim 128
# --------------------------------------------------------------------------------

def reference_grads(q, k, v, grad_out, kernel, scale, dtype, chunks=8):
    """Autograd through the grouped-SDPA reference at ``dtype``, W chunk by W chunk
    (``w_offset``), so the saved tensors of only one chunk are alive at a time."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    W = q.shape[3]
    step = max(1, -(-W // chunks))
    for w0 in range(0, W, step):
        w1 = min(W, w0 + step)
        out = na3d.na3d_sdpa_exact(leaves[0][:, :, :, w0:w1], leaves[1], leaves[2], kernel, scale=scale,
                                   w_offset=w0)
        out.backward(grad_out[:, :, :, w0:w1].to(dtype))
    return [t.grad for t in leaves]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("spec", bench_shapes("ltx"), ids=lambda s: s["name"])
def test_gradients_on_benchmark_shapes(spec, dtype):
    shape, kernel = tuple(spec["shape"]), tuple(spec["kernel_size"])
    scale = shape[-1] ** -0.5
    q, k, v = make_qkv(shape, dtype, device="cuda", seed=2)
    grad_out = torch.randn(shape, dtype=dtype, device="cuda")
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    na3d.na3d(*leaves, kernel).backward(grad_out)
    assert_grads_near_reference([t.grad for t in leaves], q, k, v, grad_out, kernel, scale)


def assert_grads_near_reference(grads, q, k, v, grad_out, kernel, scale):
    """Gradients against the float32 reference's: within twice the error of the
    reference run at q's dtype (the same math), plus a rounding band."""
    dtype = q.dtype
    oracle = reference_grads(q, k, v, grad_out, kernel, scale, torch.float32)
    same_math = reference_grads(q, k, v, grad_out, kernel, scale, dtype)
    for name, grad, want, pt in zip(("dq", "dk", "dv"), grads, oracle, same_math):
        err = (grad.float() - want).abs().max().item()
        tol = 2 * (pt.float() - want).abs().max().item() + 2 * torch.finfo(dtype).eps * max(
            1.0, want.abs().max().item())
        assert err <= tol, f"{name}: max abs error {err:.3e} > tolerance {tol:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [(3, 5, 5), (3, 7, 7), (5, 7, 7), (8, 12, 12)], ids=str)
def test_dit_regime_head_dim_128(kernel):
    """The video-DiT shapes (``bench_shapes("dit")``: head dim 128, windows of
    hundreds to thousands of keys) on a grid small enough for the float32 oracle:
    bf16 forward and gradients through the public op. (8, 12, 12): even kernels,
    two of them spanning their whole axis. (3, 5, 5) and (3, 7, 7): the LTX
    buckets' boxes at head dim 128 (their dK/dV without a register cap)."""
    shape, dtype = (1, 8, 12, 16, 2, 128), torch.bfloat16
    scale = shape[-1] ** -0.5
    q, k, v = make_qkv(shape, dtype, device="cuda", seed=11)
    grad_out = make_qkv(shape, dtype, device="cuda", seed=12)[0]
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = na3d.na3d(*leaves, kernel)
    oracle = na3d.na3d_sdpa_exact(q.float(), k.float(), v.float(), kernel, scale=scale)
    same_math = na3d.na3d_sdpa_exact(q, k, v, kernel, scale=scale)
    err = (out.float() - oracle).abs().max().item()
    tol = 2 * (same_math.float() - oracle).abs().max().item() + 2 * torch.finfo(dtype).eps * max(
        1.0, oracle.abs().max().item())
    assert err <= tol, f"forward: max abs error {err:.3e} > tolerance {tol:.3e}"
    out.backward(grad_out)
    assert_grads_near_reference([t.grad for t in leaves], q, k, v, grad_out, kernel, scale)
