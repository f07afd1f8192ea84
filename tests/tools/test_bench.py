"""The benchmark (``na3d.tools.bench``): the README's main command works on a machine without a
GPU (a CPU demonstration); its accounting, table and plot; on a GPU, its timers and rows."""

import math

import pytest
import torch

from na3d.tools import bench
from na3d.tools.common import Timer


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
    bench.print_table([fwd, bwd])
    lines = capsys.readouterr().out.splitlines()
    assert "bwd/fwd" in lines[0] and lines[2].rstrip().endswith("3.00") and lines[1].rstrip().endswith("nan")


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
