"""The offline tuner's logic (``na3d.tools.tune``) on the CPU, with made-up timings.

Measuring needs a GPU; choosing, recording and the time budget do not: the
measurement functions are replaced by ones that time the candidates as a test says.
"""

import argparse

import pytest
import torch

from na3d import configs, geometry
from na3d.tools import tune
from na3d.tools.common import Timer, bench_shapes

CPU_TIMER = Timer(torch.device("cpu"), flush_bytes=16)


def test_tuner_records_its_timing_method():
    cpu = torch.device("cpu")
    assert tune.timing_method(Timer(cpu, flush_bytes=16)) == "eager, L2 flushed"
    assert tune.timing_method(Timer(cpu, flush_bytes=16, graphs=True)) == "GPU time, CUDA-graph replay"


def test_budget_always_tries_the_first_candidate():
    assert list(tune.Budget(None).tried([1, 2, 3], "shape")) == [1, 2, 3]
    assert list(tune.Budget(-1.0).tried([1, 2, 3], "shape")) == [1]


def bucket_and_members(kernel_size):
    """A copy of the sm90 bucket serving ``kernel_size`` at head dim 64, and its benchmark shapes."""
    for entry in configs.load_table("sm90")["forward"]:
        if configs.matches(entry.get("when", {}), 64, kernel_size, torch.bfloat16):
            break
    members = [s for s in bench_shapes() if tuple(s["kernel_size"]) == kernel_size]
    return dict(entry), members


def test_forward_tuning_records_the_fastest_candidate(monkeypatch):
    entry, members = bucket_and_members((3, 5, 5))
    seen = []

    def measure(spec, candidates, timer, device, budget):
        seen.append(candidates)
        return {tune.config_key(c): 0.5 if c is candidates[-1] else 1.0 for c in candidates}

    monkeypatch.setattr(tune, "measure", measure)
    args = argparse.Namespace(launch=["4,2", "8,2"], top=2, maxnreg=None, pairs=None, tma_only=False)
    results = tune.tune_forward(entry, members, args, CPU_TIMER, torch.device("cpu"), tune.Budget(None))
    winner = seen[0][-1]
    assert len(seen) == len(members) and set(results) == {s["name"] for s in members}
    assert (entry["q_tile"], entry["kv_tile"]) == (list(winner.q_tile), list(winner.kv_tile))
    assert (entry["num_warps"], entry["num_stages"]) == (winner.num_warps, winner.num_stages)
    assert entry["measured"] == {s["name"]: {"ms": 0.5, "best_ms": 0.5, "timing": "eager, L2 flushed"}
                                 for s in members}


def test_forward_tuning_keeps_a_narrowed_cap_to_its_members(monkeypatch):
    # The medium window's cap (128 registers) holds for head dims up to 64: edge-wide is
    # tuned with it, dit-small-window (head dim 128) is left out rather than measured capped.
    entry, _ = bucket_and_members((3, 5, 27))
    assert entry["bucket"] == "medium_window" and entry["maxnreg_when"] == {"head_dim_max": 64}
    members = [s for s in bench_shapes("all") if s["name"] in ("edge-wide", "dit-small-window")]
    assert len(members) == 2
    measured = []

    def measure(spec, candidates, timer, device, budget):
        measured.append(spec["name"])
        assert {c.maxnreg for c in candidates} == {128}
        return {tune.config_key(c): 1.0 for c in candidates}

    monkeypatch.setattr(tune, "measure", measure)
    args = argparse.Namespace(launch=["4,2"], top=1, maxnreg=None, pairs=None, tma_only=True)
    results = tune.tune_forward(entry, members, args, CPU_TIMER, torch.device("cpu"), tune.Budget(None))
    assert measured == ["edge-wide"] and set(results) == {"edge-wide"}


def test_backward_tuning_picks_dq_then_dkdv(monkeypatch):
    """Step one times dQ tilings with the current dK/dV, step two dK/dV tilings with
    the chosen dQ; the bucket's backward entry records both and their times."""
    entry, members = bucket_and_members((3, 5, 5))
    calls = []

    def measure_backward(spec, candidates, current, timer, device, budget, fit, fit_spec):
        calls.append(candidates)
        step = 1 if len(calls) <= len(members) else 2
        fast = 0.5 if step == 1 else 0.25
        return {tune.backward_key(c): fast if c is candidates[-1] else 1.0 for c in candidates}

    monkeypatch.setattr(tune, "measure_backward", measure_backward)
    args = argparse.Namespace(bwd_launch=["4,1", "4,2"], top=2, pairs=None, dkdv_pairs=None, dkdv_launch=None,
                              fused=False)
    results = tune.tune_backward(entry, members, "sm90", args, CPU_TIMER, torch.device("cpu"), tune.Budget(None))
    assert len(calls) == 2 * len(members)
    dq, dkdv = calls[0][-1], calls[-1][-1]
    # Step two runs every dK/dV candidate with step one's dQ.
    assert all((c.dq_q_tile, c.dq_kv_tile, c.num_warps) == (dq.dq_q_tile, dq.dq_kv_tile, dq.num_warps)
               for c in calls[-1])
    chosen = entry["backward"]
    assert chosen["dq"] == [list(dq.dq_q_tile), list(dq.dq_kv_tile)]
    assert (chosen["num_warps"], chosen["num_stages"]) == (dq.num_warps, dq.num_stages)
    assert chosen["dkdv"] == [list(dkdv.dkdv_k_tile), list(dkdv.dkdv_q_tile)]
    assert (chosen["dkdv_num_warps"], chosen["dkdv_num_stages"]) == (dkdv.dkdv_warps, dkdv.dkdv_stages)
    for s in members:
        assert chosen["measured"][s["name"]] == {"ms": 0.25, "best_ms": 0.25, "before_ms": 1.0,
                                                 "timing": "eager, L2 flushed"}
    assert set(results) == {s["name"] + step for s in members for step in ("/dq", "/dkdv")}


def test_dkdv_candidates_are_ranked_by_the_dkdv_kernels_count():
    """dK/dV's candidates are (key box, query box) pairs ranked by the products that
    kernel issues; its best pair on dit-wan's grid is not among the forward's pairs."""
    grid, kernel = (21, 30, 52), (9, 15, 15)
    pairs = tune.dkdv_tile_candidates(grid, kernel, top=4)
    def issued(k, q):
        return geometry.issued_flops_ratio(grid, kernel, k, q, own="keys")
    ratios = [issued(k, q) for k, q in pairs[:4]]
    assert ratios == sorted(ratios)
    best = min(issued(k, q) for k, q in pairs)
    assert best == pytest.approx(ratios[0]) and best < issued((4, 4, 8), (2, 4, 8))
    assert pairs[0] not in tune.tile_candidates(grid, kernel, top=4)


def test_tile_pairs_from_the_command_line():
    assert tune.tile_pair("2x8x4/2x4x4") == ((2, 8, 4), (2, 4, 4))
    for bad in ("2x8x3/2x4x4", "2x8x4", "2x8/2x4x4", "a/b"):
        try:
            tune.tile_pair(bad)
        except argparse.ArgumentTypeError as exc:
            assert bad in str(exc)
        else:
            raise AssertionError(bad)


def test_backward_tuning_with_given_pairs_launches_and_the_fused_pass(monkeypatch):
    """--pairs and --dkdv-pairs replace the geometry's candidates, --dkdv-launch the
    dK/dV kernel's settings, and --fused adds each dK/dV candidate as the one-pass
    backward; a fused winner is recorded as such."""
    entry, members = bucket_and_members((3, 5, 5))
    calls = []

    def measure_backward(spec, candidates, current, timer, device, budget, fit, fit_spec):
        calls.append(candidates)
        return {tune.backward_key(c): 0.5 if c.fused and c.dkdv_warps == 8 else 1.0 for c in candidates}

    monkeypatch.setattr(tune, "measure_backward", measure_backward)
    args = argparse.Namespace(bwd_launch=["4,2"], dkdv_launch=["4,1", "8,1"], top=2, fused=True,
                              pairs=[((2, 8, 4), (2, 4, 4))], dkdv_pairs=[((4, 4, 8), (8, 4, 1))])
    tune.tune_backward(entry, members, "sm90", args, CPU_TIMER, torch.device("cpu"), tune.Budget(None))
    dq_step, dkdv_step = calls[0], calls[-1]
    assert {(c.dq_q_tile, c.dq_kv_tile, c.num_warps, c.num_stages) for c in dq_step[1:]} == {
        ((2, 8, 4), (2, 4, 4), 4, 2)}
    assert {(c.dkdv_k_tile, c.dkdv_q_tile, c.dkdv_warps, c.dkdv_stages, c.fused) for c in dkdv_step[1:]} == {
        ((4, 4, 8), (8, 4, 1), w, 1, f) for w in (4, 8) for f in (False, True)}
    chosen = entry["backward"]
    assert chosen["fused"] is True and chosen["dkdv_num_warps"] == 8 and chosen["dkdv"] == [[4, 4, 8], [8, 4, 1]]


def test_tuning_keeps_the_tables_splits(monkeypatch):
    """A bucket's split_full / dkdv_split_full, redo_in_program /
    dkdv_redo_in_program and dkdv_head_split are not searched: every candidate runs with
    them (the times are those of the kernels the table will run), and the entries
    written keep them."""
    entry, members = bucket_and_members((3, 5, 5))
    entry["split_full"] = 0.3
    entry["redo_in_program"] = True
    entry["backward"] = dict(entry["backward"], split_full=0.35, dkdv_split_full=0.4, redo_in_program=True,
                             dkdv_redo_in_program=True, dkdv_head_split=2)
    seen = []

    def measure(spec, candidates, timer, device, budget):
        seen.extend(candidates)
        return {tune.config_key(c): 0.5 if c is candidates[-1] else 1.0 for c in candidates}

    def measure_backward(spec, candidates, current, timer, device, budget, fit, fit_spec):
        seen.extend(candidates)
        return {tune.backward_key(c): 0.5 if c is candidates[-1] else 1.0 for c in candidates}

    monkeypatch.setattr(tune, "measure", measure)
    monkeypatch.setattr(tune, "measure_backward", measure_backward)
    args = argparse.Namespace(launch=["4,2"], bwd_launch=["4,2"], top=1, maxnreg=None, pairs=None, tma_only=True,
                              dkdv_pairs=None, dkdv_launch=None, fused=False)
    tune.tune_forward(entry, members, args, CPU_TIMER, torch.device("cpu"), tune.Budget(None))
    tune.tune_backward(entry, members, "sm90", args, CPU_TIMER, torch.device("cpu"), tune.Budget(None))
    forwards = [c for c in seen if isinstance(c, configs.ForwardConfig)]
    backwards = [c for c in seen if isinstance(c, configs.BackwardConfig)]
    assert forwards and all(c.split_full == 0.3 and c.redo_in_program for c in forwards)
    assert backwards and all((c.split_full, c.dkdv_split_full) == (0.35, 0.4) for c in backwards)
    assert all(c.redo_in_program and c.dkdv_redo_in_program and c.dkdv_head_split == 2 for c in backwards)
    assert entry["split_full"] == 0.3 and entry["redo_in_program"] is True
    assert entry["backward"]["dkdv_head_split"] == 2
    assert (entry["backward"]["split_full"], entry["backward"]["dkdv_split_full"]) == (0.35, 0.4)
    assert entry["backward"]["redo_in_program"] is True and entry["backward"]["dkdv_redo_in_program"] is True
