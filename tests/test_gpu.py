"""GPU tests: bf16/fp16 on the benchmark shapes and edge cases, huge tensors.

Skipped without a CUDA/ROCm device. Tolerances are derived per case from the error
of the same math done by PyTorch at the test dtype (the grouped-SDPA reference run
in that dtype), measured against a float32 (large shapes) or float64 (small shapes)
oracle.
"""


import math

import pytest
import torch

import na3d
from na3d import launch
from na3d.tools.common import bench_shapes
from helpers import LAYOUTS, make_qkv

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

DTYPES = [torch.bfloat16, torch.float16]


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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", bench_shapes(), ids=lambda s: s["name"])
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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,kernel", EDGE)
def test_edge_cases(shape, kernel, dtype):
    q, k, v = make_qkv(shape, dtype, device="cuda", seed=sum(shape))
    check_against_reference(q, k, v, kernel, 0.3, oracle_dtype=torch.float64)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_layouts(layout):
    shape, kernel = (2, 6, 16, 24, 4, 64), (3, 7, 7)
    q, k, v = make_qkv(shape, torch.bfloat16, layout, device="cuda", seed=3)
    check_against_reference(q, k, v, kernel, 0.125)


def test_fp32_inputs():
    shape, kernel = (1, 5, 9, 12, 2, 64), (3, 5, 5)
    q, k, v = make_qkv(shape, torch.float32, device="cuda", seed=6)
    check_against_reference(q, k, v, kernel, 0.125, oracle_dtype=torch.float64)


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


def test_lse_on_gpu():
    shape, kernel = (2, 4, 6, 9, 3, 64), (3, 5, 5)
    q, k, v = make_qkv(shape, torch.bfloat16, device="cuda", seed=2)
    out, lse = na3d.na3d(q, k, v, kernel, return_lse=True)
    _, want = na3d.na3d_brute_force(q, k, v, kernel, return_lse=True)
    torch.testing.assert_close(lse.double(), want, rtol=0, atol=2e-2)


def test_deterministic_on_gpu():
    shape, kernel = (1, 18, 32, 48, 8, 64), (3, 7, 7)
    q, k, v = make_qkv(shape, torch.bfloat16, device="cuda", seed=5)
    a = na3d.na3d_flash_attn(q, k, v, kernel)
    b = na3d.na3d_flash_attn(q, k, v, kernel)
    assert torch.equal(a, b)


FEATURES = [
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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", FEATURES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()).replace(" ", ""))
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


def test_graph_timer_replays_the_call():
    """``bench.Timer(graphs=True)`` (the tuner's ``--graph-timing``) runs the captured
    call on every replay and returns a finite time (no value is asserted: timings
    are not tested)."""
    from na3d.tools.common import Timer

    counter = torch.zeros((), device="cuda")
    ms = Timer(torch.device("cuda"), flush_bytes=1 << 20, graphs=True)(lambda: counter.add_(1), min_runs=10)
    torch.cuda.synchronize()
    assert ms == ms and abs(ms) < 1e3
    # 2 eager warm-ups, 1 on the capture's side stream, >= 10 replays (capture itself runs nothing).
    assert counter.item() >= 13


def test_bench_rows_record_gpu_time():
    """Both row builders add na3d's graph-replayed GPU time beside its eager time
    (values are not asserted: timings are not tested)."""
    from na3d import bench

    device = torch.device("cuda")
    spec = {"name": "small", "shape": [1, 4, 6, 10, 2, 64], "kernel_size": [3, 3, 5]}
    ceilings = {"copy_tbs": 4.0, "dense_attn_tflops": 300.0}
    timer, gpu_timer = bench.Timer(device, flush_bytes=1 << 20), bench.Timer(device, flush_bytes=1 << 20, graphs=True)
    for build in (bench.forward_row, bench.backward_row):
        row = build(spec, timer, ceilings, device, ["na3d"], gpu_timer=gpu_timer)
        ms = row["gpu_ms"]["na3d"]
        assert set(row["gpu_ms"]) == {"na3d"} and math.isfinite(ms) and abs(ms) < 1e3
        assert math.isfinite(row["gpu_x_floor"]["na3d"])
