"""The benchmark (``na3d.tools.bench``): the README's main command works on a machine without a
GPU (a CPU demonstration); its accounting, table and plot; on a GPU, its timers and rows."""

import math

import pytest
import torch

from na3d.tools import bench, peers
from na3d.tools.common import Timer, bench_shapes


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the benchmark itself runs")
def test_bench_without_gpu_runs_cpu_demo(capsys, tmp_path):
    assert bench.main(["--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "No GPU found" in out and "max abs error" in out
    assert not list(tmp_path.iterdir()), "no results file without a GPU"


def test_flops_and_bytes_follow_design():
    shape, kernel = (1, 18, 32, 48, 32, 64), (3, 7, 7)
    assert bench.useful_flops(shape, kernel) == 4 * 18 * 32 * 48 * 32 * 64 * 147
    assert bench.min_bytes(shape, 2) == 4 * 18 * 32 * 48 * 32 * 64 * 2


def test_plot_without_shape_rows_draws_nothing(tmp_path):
    # A decoder-only run (--decoder --no-shapes) has no fwd/bwd rows to draw.
    path = tmp_path / "h200.png"
    bench.plot([], str(path), "empty")
    assert not path.exists()


def test_plot_draws_shape_rows(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"name": "s", "pass": "fwd", "ms": {"na3d": 1.0, "flex": 3.0}, "floor_ms": 0.5}]
    path = tmp_path / "h200.png"
    bench.plot(rows, str(path), "one row")
    assert path.stat().st_size > 0


def test_table_shows_gpu_time_where_measured(capsys):
    rows = [{"name": "a", "pass": "fwd", "ms": {"na3d": 0.5}, "x_floor": {"na3d": 2.0}, "floor_ms": 0.25,
             "gpu_ms": {"na3d": 0.125}},
            {"name": "b", "pass": "bwd", "ms": {"na3d": 1.5}, "x_floor": {"na3d": 3.0}, "floor_ms": 0.5}]
    bench.print_table(rows)
    lines = capsys.readouterr().out.splitlines()
    assert "gpu ms" in lines[0]
    assert "0.1250" in lines[1] and "nan" in lines[2]


def test_bwd_rows_record_their_ratio_to_the_forward(capsys):
    fwd = {"name": "a", "pass": "fwd", "ms": {"na3d": 0.5, "flex": 2.0}, "x_floor": {"na3d": 2.0},
           "floor_ms": 0.25, "gpu_ms": {"na3d": 0.25}}
    bwd = {"name": "a", "pass": "bwd", "ms": {"na3d": 1.5, "flex": 5.0, "na3d_fused": 1.0},
           "x_floor": {"na3d": 3.0}, "floor_ms": 0.5, "gpu_ms": {"na3d": 1.0}}
    bench.add_bwd_over_fwd(bwd, fwd)
    # The fused backward has no forward of its own: no ratio for it.
    assert bwd["bwd_over_fwd"] == {"na3d": 3.0, "flex": 2.5, "na3d_gpu": 4.0}
    assert bwd["fwd_plus_bwd"] == {"ms": {"na3d": 2.0, "flex": 7.0}, "na3d_gpu_ms": 1.25,
                                   "speedup_vs": {"flex": 3.5}}
    bench.print_table([fwd, bwd])
    lines = capsys.readouterr().out.splitlines()
    assert "bwd/fwd" in lines[0] and lines[2].rstrip().endswith("3.00") and lines[1].rstrip().endswith("nan")


def test_shape_groups():
    ltx, dit, every = bench_shapes(), bench_shapes("dit"), bench_shapes("all")
    # The default is the LTX group: the tuner, the GPU tests and the A/B scripts keep their shapes.
    assert bench_shapes("ltx") == ltx and [s["name"] for s in ltx][0] == "ltx-stage1" and len(ltx) == 6
    assert [s["name"] for s in dit] == ["dit-hunyuan", "dit-wan", "dit-small-window"]
    assert every == ltx + dit
    assert {s["shape"][-1] for s in ltx} == {64} and {s["shape"][-1] for s in dit} == {128}
    assert dit[0]["shape"] == [1, 30, 48, 80, 24, 128] and dit[0]["kernel_size"] == [18, 24, 24]
    with pytest.raises(ValueError, match="group"):
        bench_shapes("training")


def test_arguments():
    args = bench.build_parser().parse_args([])
    assert args.group == "all" and not (args.no_natten or args.no_comfy or args.no_flex or args.no_reference)
    args = bench.build_parser().parse_args(["--group", "dit", "--no-natten", "--no-comfy", "--backward"])
    assert args.group == "dit" and args.no_natten and args.no_comfy and args.backward
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--group", "training"])


def test_shapes_are_chosen_within_the_group():
    assert [s["name"] for s in bench.select_shapes("all", None)] == [s["name"] for s in bench_shapes("all")]
    assert [s["name"] for s in bench.select_shapes("all", ["dit-wan", "edge-wide"])] == ["edge-wide", "dit-wan"]
    assert [s["name"] for s in bench.select_shapes("dit", [])] == [s["name"] for s in bench_shapes("dit")]
    with pytest.raises(ValueError, match="dit-wan"):
        bench.select_shapes("ltx", ["dit-wan"])


def test_method_table_lists_forward_plus_backward(capsys):
    fwd = {"name": "a", "pass": "fwd", "ms": {"na3d": 0.5, "natten_hopper": 0.75, "comfy_cuda": 1.0}}
    bwd = {"name": "a", "pass": "bwd", "ms": {"na3d": 1.5, "natten_hopper": 1.25}}
    bench.add_fwd_plus_bwd(bwd, fwd)
    assert bwd["fwd_plus_bwd"] == {"ms": {"na3d": 2.0, "natten_hopper": 2.0}, "speedup_vs": {"natten_hopper": 1.0}}
    bench.print_method_table([fwd, bwd])
    head, *lines = capsys.readouterr().out.splitlines()
    assert head.split() == ["shape", "pass", "na3d", "ms", "natten_hopper", "ms", "comfy_cuda", "ms"]
    assert [line.split() for line in lines] == [["a", "fwd", "0.5000", "0.7500", "1.0000"],
                                                ["a", "bwd", "1.5000", "1.2500", "-"],
                                                ["a", "fwd+bwd", "2.0000", "2.0000", "-"]]


def test_natten_forward_choice_times_each_configuration_briefly(monkeypatch):
    configs = [{"q_tile_shape": (4, 4, 8), "kernel_schedule": "coop"},
               {"q_tile_shape": (2, 8, 8), "kernel_schedule": "pp"}]
    monkeypatch.setattr(peers, "natten_configs", lambda q, backward=False: configs)
    calls = []

    def timer(fn, min_runs, target_ms, max_runs):
        calls.append((min_runs, max_runs))
        return {(4, 4, 8): 3.0, (2, 8, 8): 2.0}[fn.keywords["q_tile_shape"]]

    row = {"name": "a"}
    q = torch.zeros(1, 2, 2, 2, 1, 64)
    assert bench.natten_forward_choice(row, q, q, q, (1, 1, 1), 0.125, timer) == configs[1]
    assert calls == [(bench.CONFIG_TRIAL_RUNS, bench.CONFIG_TRIAL_RUNS)] * 2
    assert row["natten_hopper_config"] == {"q_tile_shape": [2, 8, 8], "kernel_schedule": "pp"}
    assert row["natten_hopper_trials"] == {"q_tile_shape=4x4x8 kernel_schedule=coop": 3.0,
                                           "q_tile_shape=2x8x8 kernel_schedule=pp": 2.0}


def test_no_natten_configuration_is_a_row_error(capsys):
    row = {"name": "a"}
    assert bench.record_choice(row, None, {}, {"q_tile_shape=4x4x8": "RuntimeError: no kernel"}) is None
    assert "no kernel" in row["errors"]["natten_hopper"] and "natten_hopper_config" not in row


def test_rows_time_a_peer_like_na3d(monkeypatch):
    """forward_row and backward_row with NATTEN stood in for by na3d itself (on the CPU:
    the kernels in the interpreter, a timer that only calls): its configurations are
    chosen per pass, the backward's with the forward's, its errors are measured against
    the same oracle as na3d's, and it enters speedup_vs and fwd_plus_bwd."""
    import na3d

    forward_configs = [{"q_tile_shape": (1, 2, 2), "kv_tile_shape": (2, 2, 2), "kernel_schedule": "coop"},
                       {"q_tile_shape": (2, 2, 2), "kv_tile_shape": (2, 2, 2), "kernel_schedule": "pp"}]
    backward_configs = [{"backward_q_tile_shape": (1, 2, 2), "backward_kv_tile_shape": (2, 2, 2)}]
    monkeypatch.setattr(peers, "natten_configs", lambda q, backward=False: backward_configs if backward
                        else forward_configs)
    monkeypatch.setattr(peers, "natten_hopper", lambda q, k, v, kernel_size, scale, **config:
                        na3d.na3d(q, k, v, kernel_size, scale=scale))

    def comfy_kernel(method):
        raise ImportError("no comfy_kitchen")
    monkeypatch.setattr(peers, "comfy_kernel", comfy_kernel)

    def timer(fn, min_runs=1, target_ms=0, max_runs=1):
        fn()
        return 2.0 if getattr(fn, "keywords", {}).get("kernel_schedule") == "coop" else 1.0

    spec = {"name": "small", "group": "dit", "shape": [1, 2, 3, 4, 1, 64], "kernel_size": [1, 3, 3]}
    ceilings = {"copy_tbs": 4.0, "dense_attn_tflops": 300.0}
    methods = ["na3d", "sdpa_exact", "natten_hopper", "comfy_cuda"]
    fwd = bench.forward_row(spec, timer, ceilings, "cpu", methods, dtype=torch.float16)
    assert fwd["natten_hopper_config"] == peers.config_json(forward_configs[1])
    assert fwd["natten_hopper_max_abs_err"] == fwd["max_abs_err"]
    assert fwd["skipped"]["sdpa_exact"].startswith("not timed on the DiT shapes")
    assert fwd["errors"]["comfy_cuda"] == "ImportError: no comfy_kitchen"
    assert set(fwd["ms"]) == {"na3d", "natten_hopper"} and set(fwd["speedup_vs"]) == {"natten_hopper"}
    bwd = bench.backward_row(spec, timer, ceilings, "cpu", methods, dtype=torch.float16,
                             natten_forward_config=fwd["natten_hopper_config"])
    assert bwd["natten_hopper_config"] == peers.config_json(dict(forward_configs[1], **backward_configs[0]))
    assert bwd["natten_hopper_max_abs_err"] == bwd["max_abs_err"]
    assert bwd["skipped"] == {"comfy_cuda": "forward only"}
    bench.add_bwd_over_fwd(bwd, fwd)
    assert set(bwd["fwd_plus_bwd"]["ms"]) == {"na3d", "natten_hopper"}


@pytest.mark.parametrize("width,used,budget,want", [
    (1, 20 << 30, 16 << 30, 1),      # one column already over the budget: stay at one
    (1, 1 << 30, 16 << 30, 4),       # grow, at most 4x per chunk
    (8, 4 << 30, 16 << 30, 32),
    (16, 8 << 30, 16 << 30, 32),     # 2x: the budget
    (16, 64 << 30, 16 << 30, 4),     # shrink
    (2, 0, 16 << 30, 8),
])
def test_reference_chunks_follow_the_memory_they_take(width, used, budget, want):
    assert bench.next_chunk_width(width, used, budget) == want


@pytest.mark.gpu
def test_graph_timer_replays_the_call():
    """``Timer(graphs=True)`` (the tuner's ``--graph-timing``) runs the captured
    call on every replay and returns a finite time (no value is asserted: timings
    are not tested)."""
    counter = torch.zeros((), device="cuda")
    ms = Timer(torch.device("cuda"), flush_bytes=1 << 20, graphs=True)(lambda: counter.add_(1), min_runs=10)
    torch.cuda.synchronize()
    assert ms == ms and abs(ms) < 1e3
    # 2 eager warm-ups, 1 on the capture's side stream, >= 10 replays (capture itself runs nothing).
    assert counter.item() >= 13


@pytest.mark.gpu
def test_bench_rows_record_gpu_time():
    """Both row builders add na3d's graph-replayed GPU time beside its eager time
    (values are not asserted: timings are not tested)."""
    device = torch.device("cuda")
    spec = {"name": "small", "shape": [1, 4, 6, 10, 2, 64], "kernel_size": [3, 3, 5]}
    ceilings = {"copy_tbs": 4.0, "dense_attn_tflops": 300.0}
    timer, gpu_timer = Timer(device, flush_bytes=1 << 20), Timer(device, flush_bytes=1 << 20, graphs=True)
    for build in (bench.forward_row, bench.backward_row):
        row = build(spec, timer, ceilings, device, ["na3d"], gpu_timer=gpu_timer)
        ms = row["gpu_ms"]["na3d"]
        assert set(row["gpu_ms"]) == {"na3d"} and math.isfinite(ms) and abs(ms) < 1e3
        assert math.isfinite(row["gpu_x_floor"]["na3d"])
