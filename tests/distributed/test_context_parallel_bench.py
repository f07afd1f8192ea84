"""The pure parts of ``benchmarks/context_parallel_bench.py``: row names, the efficiency and
overlap arithmetic, the tolerance rule, the fault checks and the rows. Fast, no process
group (the script itself runs under torchrun in CI: ``.ci/run``, 2 and 3 gloo processes)."""

import importlib.util
import math
import os

import pytest
import torch

from na3d.reference import na3d_windowed

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "context_parallel_bench.py")
_spec = importlib.util.spec_from_file_location("context_parallel_bench", _PATH)
cpb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpb)


def test_row_names_keep_the_gpu_rows_apart():
    assert cpb.row_name("ltx-stage5", cpb.run_label(4, "cuda", "nccl", 4)) == "cp-ltx-stage5-4gpu"
    assert cpb.row_name("dit-hunyuan", cpb.run_label(8, "cuda", "nccl", 8), shard_dim=3) == "cp-dit-hunyuan-8gpu-W"
    # N processes sharing fewer GPUs (gloo), or on the CPU: never the rows the issue asks for.
    assert cpb.run_label(4, "cuda", "gloo", 1) == "4rank-1gpu-gloo"
    assert cpb.run_label(2, "cuda", "gloo", 2) == "2rank-2gpu-gloo"
    assert cpb.run_label(3, "cpu", "gloo", 0) == "3rank-cpu"


def test_scaling_efficiency():
    assert cpb.scaling_efficiency(100.0, 4, 25.0) == 1.0
    assert cpb.scaling_efficiency(100.0, 4, 50.0) == 0.5
    assert cpb.scaling_efficiency(None, 4, 50.0) is None
    assert cpb.scaling_efficiency(100.0, 4, 0.0) is None


def test_overlap_fraction():
    assert cpb.overlap_fraction(step_ms=10.0, compute_ms=8.0, comm_ms=2.0) == 0.0        # one after the other
    assert cpb.overlap_fraction(step_ms=8.0, compute_ms=8.0, comm_ms=2.0) == 1.0         # comm hidden
    assert cpb.overlap_fraction(step_ms=9.0, compute_ms=8.0, comm_ms=2.0) == 0.5
    assert cpb.overlap_fraction(step_ms=12.0, compute_ms=8.0, comm_ms=2.0) == -1.0       # slower than serial
    assert cpb.overlap_fraction(step_ms=8.0, compute_ms=8.0, comm_ms=0.0) is None


def test_tolerance_is_twice_the_single_error_plus_a_band():
    eps = torch.finfo(torch.bfloat16).eps
    assert cpb.tolerance(0.01, 0.5, torch.bfloat16) == pytest.approx(0.02 + 2 * eps)
    assert cpb.tolerance(0.01, 4.0, torch.bfloat16) == pytest.approx(0.02 + 8 * eps)


def test_compare_judges_against_the_oracle():
    gen = torch.Generator().manual_seed(0)
    oracle = [torch.randn(2, 3, 4, generator=gen) for _ in range(2)]
    single = [o.to(torch.bfloat16) for o in oracle]
    same = cpb.compare(single, oracle, single, ["out", "dq"], torch.bfloat16)
    assert same["within_tolerance"] and same["bitwise_equal_to_single"]
    assert same["max_abs_diff_vs_single"] == {"out": 0.0, "dq": 0.0}
    assert same["max_abs_err"] == same["single_max_abs_err"]
    off = [single[0], single[1] + same["tolerance"]["dq"] * 4]
    result = cpb.compare(off, oracle, single, ["out", "dq"], torch.bfloat16)
    assert not result["within_tolerance"] and not result["bitwise_equal_to_single"]
    nan = [single[0].clone(), single[1]]
    nan[0][0, 0, 0] = float("nan")
    assert not cpb.compare(nan, oracle, single, ["out", "dq"], torch.bfloat16)["within_tolerance"]


@pytest.mark.parametrize("shape,kernel,position", [
    ((1, 9, 5, 6, 2, 8), (5, 3, 5), (0, 5, 2, 3, 0)),      # interior, odd kernels
    ((1, 7, 4, 6, 2, 8), (4, 2, 3), (0, 0, 3, 5, 1)),      # a corner, even kernels
])
def test_expected_nan_masks_are_what_ieee_arithmetic_over_the_windows_gives(shape, kernel, position):
    """The contract's NaN positions, by geometry, against the gathered float64 oracle."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(4))
    k[tuple(position) + (0,)] = float("nan")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = na3d_windowed(*leaves, kernel)
    grads = torch.autograd.grad(out, leaves, do)
    expected = cpb.expected_nan_masks(shape, kernel, position)
    for name, t in zip(("out", "dq", "dk", "dv"), (out, *grads)):
        assert torch.equal(cpb.nan_positions(t), expected[name]), name
        assert expected[name].any()


def test_nan_check():
    shape, kernel, position = (1, 9, 5, 6, 2, 8), (5, 3, 5), (0, 5, 2, 3, 0)
    expected = cpb.expected_nan_masks(shape, kernel, position)
    single = []
    for name in ("out", "dq", "dk", "dv"):
        t = torch.zeros(shape)
        t[expected[name]] = float("nan")
        single.append(t)
    names = ["out", "dq", "dk", "dv"]
    same = cpb.nan_check([t.clone() for t in single], single, names, expected, (5, 4), 1)
    assert same["passed"] and same["nan_ranks_out"] == [0, 1]
    assert same["nan_count"]["out"] == int(expected["out"].sum()) * shape[-1]
    # One more NaN in dk, on the other head: neither the contract's nor the single device's.
    leaked = [t.clone() for t in single]
    leaked[2][0, 0, 0, 0, 1, 0] = float("nan")
    result = cpb.nan_check(leaked, single, names, expected, (5, 4), 1)
    assert not result["passed"]
    assert result["as_expected"] == {"out": True, "dq": True, "dk": False, "dv": True}
    assert result["matches_single"]["dk"] is False
    # A finite difference elsewhere is measured, not judged.
    shifted = [t + 0.5 for t in single]
    assert cpb.nan_check(shifted, single, names, expected, (5, 4), 1)["max_abs_diff_finite_vs_single"]["dq"] == 0.5


def test_planned_bytes_and_passes():
    shape, kernel, sizes = (1, 9, 4, 4, 2, 8), (5, 3, 3), (5, 4)
    halo = cpb.planned_bytes("halo", shape, kernel, sizes, 1, torch.float32)
    position = 2 * 4 * 4 * 2 * 8 * 4          # K and V of one T position, float32
    assert halo == {"fwd": [2 * position, 2 * position], "bwd": [2 * position, 2 * position]}
    assert cpb.planned_bytes("halo_overlap", shape, kernel, sizes, 1, torch.float32) == halo
    a2a = cpb.planned_bytes("head_parallel", shape, kernel, sizes, 1, torch.float32)
    chunk = position // 2 // 2               # one position of one head of q (or k, v, out)
    assert a2a == {"fwd": [(3 * 5 + 4) * chunk, (3 * 4 + 5) * chunk], "bwd": [(5 + 3 * 4) * chunk, (4 + 3 * 5) * chunk]}
    assert cpb.planned_bytes("head_parallel", (1, 9, 4, 4, 3, 8), kernel, sizes, 1, torch.float32) is None
    assert cpb.bytes_of_pass(a2a, "fwd") == a2a["fwd"]
    assert cpb.bytes_of_pass(a2a, "fwd+bwd") == [a + b for a, b in zip(a2a["fwd"], a2a["bwd"])]
    assert cpb.bytes_of_pass(None, "fwd") is None


def _check(err):
    names = ["out", *cpb.GRAD_NAMES]
    return {"max_abs_err": dict.fromkeys(names, err), "tolerance": dict.fromkeys(names, 0.01),
            "single_max_abs_err": dict.fromkeys(names, 0.004), "max_abs_diff_vs_single": dict.fromkeys(names, 0.0),
            "within_tolerance": err <= 0.01}


def test_shape_rows():
    spec = dict(shape=(1, 66, 128, 192, 4, 64), kernel_size=(11, 11, 11))
    timing = {"fwd": {"ms": 10.0, "compute_ms": 8.0, "comm_ms": 3.0},
              "fwd+bwd": {"ms": 30.0, "compute_ms": 25.0, "comm_ms": 5.0}}
    planned = {"fwd": [100, 200], "bwd": [120, 180]}
    measured = {"single_ms": {"fwd": 18.0, "fwd+bwd": 50.0}, "skipped": {"halo_overlap": "ValueError: x"},
                "oracle": "na3d float32",
                "methods": {
                    "halo": {"passes": timing, "bytes": planned, "planned": planned,
                             "check": {"fwd": _check(0.002), "fwd+bwd": _check(0.005)}},
                    "head_parallel": {"passes": timing, "bytes": {"fwd": [1, 2], "bwd": [3, 4]}, "planned": planned,
                                      "check": {"fwd": _check(0.002), "fwd+bwd": _check(0.02)}}}}
    context = dict(device="NVIDIA H100 80GB HBM3", backend="nccl", world_size=2, gpus=2, slab_sizes=[33, 33])
    fwd, step = cpb.shape_rows("cp-ltx-stage5-2gpu", spec, context, measured)
    assert (fwd["name"], fwd["pass"], step["pass"]) == ("cp-ltx-stage5-2gpu", "fwd", "fwd+bwd")
    assert fwd["device"] == "NVIDIA H100 80GB HBM3" and fwd["world_size"] == 2 and fwd["slab_sizes"] == [33, 33]
    assert fwd["ms"] == {"halo": 10.0, "head_parallel": 10.0} and fwd["single_gpu_ms"] == 18.0
    assert fwd["scaling_efficiency"]["halo"] == 0.9
    assert fwd["overlap"]["halo"] == pytest.approx(1 / 3, abs=1e-3)      # (8 + 3 - 10) / 3
    assert fwd["exposed_comm_ms"]["halo"] == 2.0
    assert step["scaling_efficiency"]["halo"] == round(50 / 60, 4) and step["overlap"]["halo"] == 0.0
    assert fwd["bytes_sent"]["halo"] == {"planned": [100, 200], "measured": [100, 200], "as_planned": True}
    assert step["halo_bytes"] == {"planned": [220, 380], "measured": [220, 380], "as_planned": True}
    assert step["bytes_sent"]["head_parallel"]["as_planned"] is False
    assert step["within_tolerance"] == {"halo": True, "head_parallel": False}
    assert step["tolerance"]["dk"] == 0.01 and step["single_gpu_max_abs_err"]["out"] == 0.004
    assert step["skipped"] == {"halo_overlap": "ValueError: x"} and step["oracle"] == "na3d float32"
    assert all(math.isfinite(x) for x in step["ms"].values())


def test_fault_grid_does_not_divide():
    for world in (2, 3, 4, 8):
        spec = cpb.fault_spec(world, tiny=False)
        assert spec["shape"][1] % world and spec["shape"][4] % world == 0 and spec["indivisible_heads"] % world
        assert all(k <= s for k, s in zip(spec["kernel_size"], spec["shape"][1:4]))
        tiny = cpb.fault_spec(world, tiny=True)
        assert tiny["shape"][1] % world and all(k <= s for k, s in zip(tiny["kernel_size"], tiny["shape"][1:4]))


def test_shapes():
    full = cpb.shape_specs(tiny=False)
    assert full["ltx-stage5"] == dict(shape=(1, 66, 128, 192, 4, 64), kernel_size=(11, 11, 11))
    assert full["dit-hunyuan"] == dict(shape=(1, 30, 48, 80, 24, 128), kernel_size=(18, 24, 24))
    assert sorted(cpb.shape_specs(tiny=True)) == ["tiny-dit", "tiny-ltx"]


def test_float32_oracle_falls_back_to_the_sdpa_reference(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    q, k, v, do = (torch.randn(1, 5, 4, 6, 2, 16, generator=gen).to(torch.bfloat16) for _ in range(4))
    kernel = (3, 3, 5)
    first, name = cpb.float32_oracle(q, k, v, do, kernel)
    assert name == "na3d float32" and all(t.dtype == torch.float32 for t in first)
    second, name = cpb.float32_oracle(q, k, v, do, kernel, kind="sdpa")
    assert name == "na3d_sdpa_exact float32"
    for a, b in zip(first, second):
        assert (a - b).abs().max() < 1e-5

    def fails(*args, **kwargs):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(cpb.na3d, "na3d", fails)
    third, name = cpb.float32_oracle(q, k, v, do, kernel)
    assert name == "na3d_sdpa_exact float32"
    assert all(torch.equal(a, b) for a, b in zip(second, third))


def test_nccl_with_fewer_gpus_than_ranks_names_the_alternatives(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    parser = cpb.build_parser()
    with pytest.raises(SystemExit):
        cpb.setup(parser.parse_args([]), parser)
    message = capsys.readouterr().err
    assert "Duplicate GPU" in message and "--backend gloo" in message and "--device cpu --tiny" in message


def test_the_cpu_mode_needs_tiny_shapes(capsys):
    parser = cpb.build_parser()
    with pytest.raises(SystemExit):
        cpb.setup(parser.parse_args(["--device", "cpu"]), parser)
    assert "--tiny" in capsys.readouterr().err
