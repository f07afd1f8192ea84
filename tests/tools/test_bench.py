"""The benchmark (``na3d.tools.bench``): the README's main command works on a machine without a
GPU (a CPU demonstration); its accounting, table and plot; on a GPU, its timers and rows."""

import json
import math

import pytest
import torch

from na3d import geometry
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
    ltx, dit, strided, every = bench_shapes(), bench_shapes("dit"), bench_shapes("strided"), bench_shapes("all")
    # The default is the LTX group: the tuner, the GPU tests and the A/B scripts keep their shapes.
    assert bench_shapes("ltx") == ltx and [s["name"] for s in ltx][0] == "ltx-stage1" and len(ltx) == 6
    assert [s["name"] for s in dit] == ["dit-hunyuan", "dit-wan", "dit-small-window"]
    assert every == ltx + dit + strided
    # Strided rows: NATTEN's showcase stride, a stride larger than any box, and head dim 64.
    assert [s["stride"] for s in strided] == [[2, 8, 8], [2, 8, 16], [4, 4, 8]]
    assert {s["shape"][-1] for s in strided} == {64, 128}
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
    # Each backward kernel's issued products, counted as it scans (dK/dV from its key boxes).
    dq_box, dkdv_box = bwd["config"]["dq"], bwd["config"]["dkdv"]
    assert bwd["flops_issued_ratio"] == {
        "dq": round(geometry.issued_flops_ratio((2, 3, 4), (1, 3, 3), *dq_box), 3),
        "dkdv": round(geometry.issued_flops_ratio((2, 3, 4), (1, 3, 3), *dkdv_box, own="keys"), 3)}
    bench.add_bwd_over_fwd(bwd, fwd)
    assert set(bwd["fwd_plus_bwd"]["ms"]) == {"na3d", "natten_hopper"}


def test_methods_take_turns_over_rounds():
    """time_in_rounds: each round times every method once, the order rotating; the
    medians are kept; a method that raises is reported once and left out after."""
    calls, errors = [], []
    times = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 4.0, 6.0])}

    def measure(method):
        calls.append(method)
        if method == "c":
            raise RuntimeError("out of memory")
        return next(times[method])

    medians, per_round = bench.time_in_rounds(["a", "b", "c"], measure, 3, lambda m, e: errors.append((m, str(e))))
    assert calls == ["a", "b", "c", "b", "a", "a", "b"]  # c failed in round 1 and is not asked again
    assert medians == {"a": 2.0, "b": 5.0} and per_round == {"a": [3.0, 1.0, 2.0], "b": [5.0, 4.0, 6.0]}
    assert errors == [("c", "out of memory")]
    row = {"ms": {}}
    bench.record_times(row, medians, per_round, 3)
    assert row == {"ms": {"a": 2.0, "b": 5.0}, "ms_rounds": per_round}
    with pytest.raises(ValueError):  # the caller's on_error may raise (na3d's own failure)
        bench.time_in_rounds(["a"], lambda m: (_ for _ in ()).throw(ValueError("x")), 2,
                             lambda m, e: (_ for _ in ()).throw(e))


def test_strided_rows_carry_their_stride_and_speed_of_light(monkeypatch):
    """A strided shape: na3d, its oracle and the peer (na3d standing in for NATTEN, which
    must receive the stride: its error equals na3d's only then) run with the stride;
    the rows record it, the speed of light from the spec's dense times and each
    method's time over it; flex and comfy-kitchen are skipped (no strided windows)."""
    import na3d

    monkeypatch.setattr(peers, "natten_configs", lambda q, backward=False: [
        {"backward_q_tile_shape": (1, 2, 2)} if backward else {"q_tile_shape": (1, 2, 2)}])
    monkeypatch.setattr(peers, "natten_hopper", lambda q, k, v, kernel_size, scale, stride=(1, 1, 1), **config:
                        na3d.na3d(q, k, v, kernel_size, scale=scale, stride=stride))

    def timer(fn, min_runs=1, target_ms=0, max_runs=1):
        fn()
        return 2.0

    spec = {"name": "small-s122", "group": "strided", "shape": [1, 2, 4, 4, 1, 64], "kernel_size": [1, 3, 3],
            "stride": [1, 2, 2], "dense_ms": {"fwd": 9.0, "bwd": 18.0}}
    ceilings = {"copy_tbs": 4.0, "dense_attn_tflops": 300.0}
    methods = ["na3d", "natten_hopper", "comfy_cuda", "flex"]
    fwd = bench.forward_row(spec, timer, ceilings, "cpu", methods, rounds=2, dtype=torch.float16)
    assert fwd["ms_rounds"] == {"na3d": [2.0, 2.0], "natten_hopper": [2.0, 2.0]}
    assert fwd["stride"] == [1, 2, 2] and fwd["natten_hopper_max_abs_err"] == fwd["max_abs_err"]
    assert fwd["speed_of_light_ms"] == 9.0 * 9 / 32 and fwd["x_speed_of_light"]["na3d"] == round(2.0 / (9 * 9 / 32), 3)
    assert fwd["skipped"]["comfy_cuda"] == "no stride" and "strided" in fwd["skipped"]["flex"]
    bwd = bench.backward_row(spec, timer, ceilings, "cpu", methods, dtype=torch.float16,
                             natten_forward_config=fwd["natten_hopper_config"])
    assert bwd["stride"] == [1, 2, 2] and bwd["speed_of_light_ms"] == 18.0 * 9 / 32
    assert bwd["natten_hopper_max_abs_err"] == bwd["max_abs_err"]
    assert 0 <= bwd["full_products_share"]["dq"] <= 1 and 0 <= fwd["full_products_share"] <= 1


def test_gpu_time_takes_its_turn_in_the_rounds():
    """With a GPU timer, na3d's GPU time is measured in every round beside the eager
    timings (its turn rotating with theirs) and kept as their median (``gpu_ms``, and
    ``gpu_ms_rounds`` over more than one round); in one round it comes last, as before."""
    calls = []

    def timer(fn, min_runs=1, target_ms=0, max_runs=1):
        fn()
        calls.append("eager")
        return 2.0

    gpu_times = iter([3.0, 5.0, 4.0, 9.0, 6.0, 1.0])

    def gpu_timer(fn, min_runs=1, target_ms=0, max_runs=1):
        fn()
        calls.append("gpu")
        return next(gpu_times)

    spec = {"name": "small", "shape": [1, 2, 4, 4, 1, 16], "kernel_size": [1, 3, 3]}
    ceilings = {"copy_tbs": 4.0, "dense_attn_tflops": 300.0}
    fwd = bench.forward_row(spec, timer, ceilings, "cpu", ["na3d"], rounds=2, dtype=torch.float32,
                            gpu_timer=gpu_timer)
    assert calls == ["eager", "gpu", "gpu", "eager"]
    assert fwd["gpu_ms_rounds"] == {"na3d": [3.0, 5.0]} and fwd["gpu_ms"] == {"na3d": 4.0}
    assert set(fwd["ms"]) == {"na3d"} and bench.GPU_TIME not in fwd.get("ms_rounds", {})
    # The backward's GPU time: forward + backward minus the forward, per round.
    bwd = bench.backward_row(spec, timer, ceilings, "cpu", ["na3d"], dtype=torch.float32, gpu_timer=gpu_timer)
    assert bwd["gpu_ms"] == {"na3d": 4.0 - 9.0} and "gpu_ms_rounds" not in bwd
    assert bench.GPU_TIME not in bwd["ms"] and calls[-2:] == ["gpu", "gpu"]


def test_features_and_their_row_names():
    assert list(bench.FEATURES) == ["gqa-8on2", "mqa", "dilation-122", "dilation-222", "causal-t", "causal-thw", "lse"]
    bases = bench.feature_bases()
    assert [b["name"] for b in bases] == ["feature-base", "ltx-stage3", "feature-hd128"]
    assert bases[0]["shape"] == [1, 24, 48, 64, 8, 64] and bases[0]["kernel_size"] == [3, 5, 5]
    assert bases[2]["shape"] == [1, 24, 48, 64, 8, 128] and bases[2]["kernel_size"] == [9, 11, 11]
    assert {b["shape"][4] for b in bases} == {8}  # 8 query heads: 8 on 2 and 8 on 1
    # Every feature runs on every base (dilation (2,2,2) fits each grid).
    assert not [(f, b["name"]) for f, a in bench.FEATURES.items() for b in bases if bench.feature_skip_reason(b, a)]
    # The feature bases are not benchmark shapes: the tuner and the tests do not pick them up.
    assert not {"feature-base", "feature-hd128"} & {s["name"] for s in bench_shapes("all")}
    assert [b["name"] for b in bench.feature_bases(["ltx-stage3"])] == ["ltx-stage3"]
    with pytest.raises(ValueError, match="ltx-stage1"):
        bench.feature_bases(["ltx-stage1"])
    assert bench.feature_row_name("gqa-8on2", "ltx-stage3") == "feature-gqa-8on2/ltx-stage3"
    # Unique per (feature, base): merging by (name, pass) keeps every one.
    names = {bench.feature_row_name(f, b["name"]) for f in bench.FEATURES for b in bases}
    assert len(names) == len(bench.FEATURES) * len(bases)
    assert not any(bench.feature_skip_reason(b, args) for b in bases for args in bench.FEATURES.values())


def test_features_invalid_on_a_base_are_skipped():
    spec = {"name": "small", "shape": [1, 4, 8, 16, 3, 64], "kernel_size": [3, 5, 5]}
    reasons = {f: bench.feature_skip_reason(spec, args) for f, args in bench.FEATURES.items()}
    assert "do not divide the 3 query heads" in reasons["gqa-8on2"]
    assert reasons["dilation-122"] == "kernel * dilation beyond the size: H 5 * 2 > 8"
    assert reasons["dilation-222"] == "kernel * dilation beyond the size: T 3 * 2 > 4, H 5 * 2 > 8"
    assert {f for f, r in reasons.items() if r is None} == {"mqa", "causal-t", "causal-thw", "lse"}


def scripted_timer(times):
    """A timer that calls ``fn`` once (so the call runs) and returns the next of ``times``."""
    times = iter(times)

    def timer(fn, min_runs=10, target_ms=300.0, max_runs=200):
        fn()
        return next(times)
    return timer


def test_feature_rows_compare_the_feature_with_the_plain_call(monkeypatch):
    """feature_row on the CPU (the kernels in the interpreter), timers scripted: the
    plain call takes full heads and no keywords, the feature's the sliced key/value
    heads and its keywords; vs_plain is feature over plain, eager and by GPU time (for
    the backward: forward + backward minus forward)."""
    import na3d

    seen = []

    def recording_na3d(q, k, v, kernel_size, **kwargs):
        seen.append((k.shape[4], v.shape[4], kwargs))
        return na3d.na3d(q, k, v, kernel_size, **kwargs)
    monkeypatch.setattr(bench, "na3d", recording_na3d)
    spec = {"name": "small", "shape": [1, 2, 3, 4, 8, 8], "kernel_size": [1, 3, 3]}
    row = bench.feature_row(spec, "gqa-8on2", "fwd", scripted_timer([2.0, 3.0]), "cpu",
                            gpu_timer=scripted_timer([1.0, 1.25]), dtype=torch.float32)
    assert {(nk, nv, tuple(kw)) for nk, nv, kw in seen} == {(8, 8, ()), (2, 2, ())}
    assert row["name"] == "feature-gqa-8on2/small" and row["base"] == "small" and row["pass"] == "fwd"
    assert row["args"] == {"kv_heads": 2} and row["shape"] == spec["shape"] and row["kernel_size"] == [1, 3, 3]
    assert row["ms"] == {"plain": 2.0, "feature": 3.0} and row["gpu_ms"] == {"plain": 1.0, "feature": 1.25}
    assert row["vs_plain"] == {"na3d": 1.5, "na3d_gpu": 1.25}

    seen.clear()
    # bwd: the GPU timer is called for forward + backward, then the forward, per call.
    row = bench.feature_row(spec, "lse", "bwd", scripted_timer([4.0, 5.0]), "cpu",
                            gpu_timer=scripted_timer([5.0, 1.0, 9.0, 3.0]), dtype=torch.float32)
    assert {kw.get("return_lse", False) for _, _, kw in seen} == {False, True}
    assert row["args"] == {"return_lse": True} and row["pass"] == "bwd"
    assert row["ms"] == {"plain": 4.0, "feature": 5.0} and row["gpu_ms"] == {"plain": 4.0, "feature": 6.0}
    assert row["vs_plain"] == {"na3d": 1.25, "na3d_gpu": 1.5}

    # Without a GPU timer: the eager ratio only. Dilation's arguments as the results file has them.
    spec = {"name": "small", "shape": [1, 2, 4, 4, 8, 8], "kernel_size": [1, 2, 2]}
    row = bench.feature_row(spec, "dilation-122", "fwd", scripted_timer([2.0, 2.5]), "cpu", dtype=torch.float32)
    assert row["args"] == {"dilation": [1, 2, 2]} and seen[-1][2] == {"dilation": (1, 2, 2)}
    assert "gpu_ms" not in row and row["vs_plain"] == {"na3d": 1.25}


def test_feature_backward_differentiates_the_sliced_heads():
    """A bwd feature call's run takes the gradients of the leaves it was called on: for
    MQA, dk and dv have the one key/value head."""
    spec = {"name": "small", "shape": [1, 2, 3, 4, 8, 8], "kernel_size": [1, 3, 3]}
    calls = bench.feature_calls(spec, bench.FEATURES["mqa"], "bwd", "cpu", dtype=torch.float32)
    plain, feature = calls["plain"][0](), calls["feature"][0]()
    assert [g.shape[4] for g in plain] == [8, 8, 8] and [g.shape[4] for g in feature] == [8, 1, 1]


def test_kernel_events_are_counted_without_copies():
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    newer = [SimpleNamespace(activity_type=kind, name="x") for kind in ("kernel", "gpu_memset", "cuda_runtime")]
    assert [bench.is_kernel_event(e) for e in newer] == [True, False, False]
    older = [SimpleNamespace(device_type=DeviceType.CUDA, is_user_annotation=False, name="na3d_fwd_kernel"),
             SimpleNamespace(device_type=DeviceType.CUDA, is_user_annotation=False, name="Memset (Device)"),
             SimpleNamespace(device_type=DeviceType.CUDA, is_user_annotation=True, name="na3d::forward"),
             SimpleNamespace(device_type=DeviceType.CPU, is_user_annotation=False, name="cudaLaunchKernel")]
    assert [bench.is_kernel_event(e) for e in older] == [True, False, False, False]


def test_feature_rows_merge_beside_the_shape_rows(capsys):
    """--features writes into the results file there: its shape rows and fields are kept,
    a feature row measured again replaces its old one; the shape tables leave feature
    rows out, the feature table shows them."""
    shape_fwd = {"name": "ltx-stage3", "pass": "fwd", "ms": {"na3d": 0.5}, "x_floor": {"na3d": 2.0},
                 "floor_ms": 0.25}
    shape_bwd = dict(shape_fwd, **{"pass": "bwd"})
    old = {"name": "feature-mqa/ltx-stage3", "feature": "mqa", "base": "ltx-stage3", "pass": "fwd",
           "ms": {"plain": 1.0, "feature": 2.0}, "vs_plain": {"na3d": 2.0}}
    other = dict(old, name="feature-lse/ltx-stage3", feature="lse")
    new = dict(old, ms={"plain": 0.5, "feature": 0.75}, gpu_ms={"plain": 0.25, "feature": 0.5},
               vs_plain={"na3d": 1.5, "na3d_gpu": 2.0}, launches={"plain": 2, "feature": 3}, commit="b")
    fields = {"commit": "a", "ceilings": {"copy_tbs": 4.0}}
    result = bench.merged_results(fields, [shape_fwd, shape_bwd, old, other], [new], complete=False)
    assert result["commit"] == "a" and result["ceilings"] == {"copy_tbs": 4.0}
    assert result["rows"] == [shape_fwd, shape_bwd, other, new] and "incomplete" in result
    assert "incomplete" not in bench.merged_results(fields, [], [new], complete=True)
    assert [r["name"] for r in result["rows"] if bench.is_shape_row(r)] == ["ltx-stage3", "ltx-stage3"]
    bench.print_feature_table([new, other])
    head, *lines = capsys.readouterr().out.splitlines()
    assert head.split()[:4] == ["feature", "base", "pass", "plain"]
    assert lines[0].split() == ["mqa", "ltx-stage3", "fwd", "0.5000", "0.7500", "1.500", "0.2500", "0.5000",
                                "2.000", "2/3"]
    assert lines[1].split()[-3:] == ["nan", "nan", "-"]


def test_feature_arguments():
    args = bench.build_parser().parse_args(["--features", "--backward", "--shapes", "ltx-stage3"])
    assert args.features and args.backward and args.shapes == ["ltx-stage3"]
    assert not bench.build_parser().parse_args([]).features


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


@pytest.mark.gpu
def test_feature_rows_replay_the_backward_in_graphs():
    """feature_row's backward GPU time by graph replay, after its eager timings of the
    retained graphs: the capture must not meet those graphs' leaves (values are not
    asserted: timings are not tested)."""
    device = torch.device("cuda")
    spec = {"name": "small", "shape": [1, 4, 6, 10, 4, 64], "kernel_size": [3, 3, 5]}
    timer, gpu_timer = Timer(device, flush_bytes=1 << 20), Timer(device, flush_bytes=1 << 20, graphs=True)
    for feature in ("gqa-8on2", "lse", "dilation-122"):
        row = bench.feature_row(spec, feature, "bwd", timer, device, gpu_timer=gpu_timer)
        assert set(row["gpu_ms"]) == {"plain", "feature"}
        assert all(math.isfinite(ms) for ms in row["gpu_ms"].values())


def test_write_merged_results_keeps_the_files_fields_and_other_rows(tmp_path):
    """A new file gets the given fields; one already there keeps its own fields and its
    rows not measured again (same name and pass replaced), and loses "incomplete"."""
    path = tmp_path / "sub" / "h100.json"
    first = {"name": "a", "pass": "fwd", "ms": 1.0}
    bench.write_merged_results(str(path), [first], {"device": "X", "commit": "1"}, complete=False)
    written = json.loads(path.read_text())
    assert written["device"] == "X" and written["rows"] == [first] and "incomplete" in written
    again, other = dict(first, ms=2.0), {"name": "b", "pass": "fwd+bwd", "ms": 3.0}
    bench.write_merged_results(str(path), [again, other], {"device": "Y", "commit": "2"}, complete=True)
    written = json.loads(path.read_text())
    assert written["device"] == "X" and written["commit"] == "1" and "incomplete" not in written
    assert written["rows"] == [again, other]
