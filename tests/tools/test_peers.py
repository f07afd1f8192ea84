"""The benchmark's peers (``na3d.tools.peers``): which run where and why not, the shapes
each is timed on, NATTEN's configurations as keywords of its call, and the choice of
the fastest. The calls themselves need the peers on their GPU (the benchmark's run)."""

import inspect
import json
import sys

import pytest
import torch

from na3d.tools import peers


def test_no_peer_runs_on_the_cpu_and_each_says_why():
    methods, notes = peers.available_methods("cpu")
    assert methods == []
    assert [n.split(" ")[0] for n in notes] == list(peers.METHODS)
    assert all(" skipped: " in n for n in notes)


def test_peers_left_out_by_the_caller_are_neither_probed_nor_noted(monkeypatch):
    def probe(*args):
        raise AssertionError("probed")
    monkeypatch.setattr(peers, "natten_unavailable", probe)
    monkeypatch.setattr(peers, "comfy_unavailable", probe)
    assert peers.available_methods("cuda", natten=False, comfy=False) == ([], [])


def test_missing_packages_are_notes_not_errors(monkeypatch):
    # (A None entry makes the import fail, also where the module was imported before.)
    for module in ("natten", "comfy_kitchen", "comfy_kitchen.backends", "comfy_kitchen.backends.triton"):
        monkeypatch.setitem(sys.modules, module, None)
    assert "natten is not installed" in peers.natten_unavailable("cuda")
    for method in peers.COMFY:
        assert "comfy_kitchen is not installed" in peers.comfy_unavailable(method, "cuda")
    methods, notes = peers.available_methods("cuda")
    assert methods == [] and len(notes) == 3


def test_natten_hopper_needs_compute_capability_9_0(monkeypatch):
    pytest.importorskip("natten")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert "compute capability 9.0" in peers.natten_unavailable("cuda")


def test_natten_without_its_hopper_kernels_is_a_note(monkeypatch):
    """NATTEN installed without libnatten (its CPU build, as in CI) offers no configuration."""
    natten = pytest.importorskip("natten")
    if natten.HAS_LIBNATTEN:
        pytest.skip("this NATTEN has its compiled kernels")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(peers, "_probe", lambda device: torch.zeros(1, 1, 1, 8, 1, 64, dtype=torch.bfloat16))
    assert "no hopper-fna configuration" in peers.natten_unavailable("cuda")


@pytest.mark.parametrize("method,shape,dtype,backward,runs", [
    ("natten_hopper", (1, 4, 4, 4, 2, 64), torch.bfloat16, False, True),
    ("natten_hopper", (1, 4, 4, 4, 2, 128), torch.bfloat16, True, True),
    ("natten_hopper", (1, 4, 4, 4, 2, 128), torch.float16, False, True),
    ("natten_hopper", (1, 4, 4, 4, 2, 32), torch.bfloat16, False, False),
    ("natten_hopper", (1, 4, 4, 4, 2, 64), torch.float32, False, False),
    ("comfy_cuda", (1, 4, 4, 4, 2, 64), torch.bfloat16, False, True),
    ("comfy_triton", (1, 4, 4, 4, 2, 48), torch.float16, False, True),
    ("comfy_cuda", (1, 4, 4, 4, 2, 128), torch.bfloat16, False, False),
    ("comfy_triton", (1, 4, 4, 4, 2, 128), torch.bfloat16, False, False),
    ("comfy_cuda", (1, 4, 4, 4, 2, 40), torch.bfloat16, False, False),
    ("comfy_cuda", (1, 4, 4, 4, 2, 64), torch.bfloat16, True, False),
])
def test_shapes_each_peer_is_timed_on(method, shape, dtype, backward, runs):
    reason = peers.skip_reason(method, shape, dtype, backward=backward)
    assert (reason is None) == runs, reason


def test_unknown_peer_is_an_error():
    with pytest.raises(ValueError, match="natten_hopper"):
        peers.skip_reason("natten", (1, 4, 4, 4, 2, 64), torch.bfloat16)
    with pytest.raises(ValueError, match="comfy_cuda"):
        peers.comfy_kernel("comfy")


def test_configurations_are_capped_in_natten_order():
    assert peers.capped(range(20)) == list(range(peers.MAX_CONFIGS))
    assert peers.capped([3, 1, 2]) == [3, 1, 2]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_natten_configurations_pass_natten_own_checks(monkeypatch, head_dim):
    """Every configuration NATTEN lists, as the keywords the benchmark passes
    ``natten.na3d``, is accepted by the checks ``natten.na3d`` runs on them (on the
    CPU: NATTEN told it runs on compute capability 9.0; the kernels are not called)."""
    natten = pytest.importorskip("natten")
    from natten.backends.configs import cutlass_hopper
    from natten.utils.checks import check_kernel_schedule

    monkeypatch.setattr(cutlass_hopper, "get_device_cc", lambda device: 90)
    q = torch.zeros(1, 8, 8, 8, 2, head_dim, dtype=torch.bfloat16)
    parameters = inspect.signature(natten.na3d).parameters
    forward = cutlass_hopper.get_all_forward_configs(q)
    backward = cutlass_hopper.get_all_backward_configs(q)
    assert forward and backward
    for config in forward:
        kwargs = peers.natten_forward_kwargs(config)
        assert set(kwargs) <= set(parameters)
        kwargs = peers.config_from_json(json.loads(json.dumps(peers.config_json(kwargs))))  # via a results file
        assert cutlass_hopper.check_cutlass_hopper_fna_forward_config(
            q, kwargs["q_tile_shape"], kwargs["kv_tile_shape"], check_kernel_schedule(kwargs["kernel_schedule"])
        ) == config
    for config in backward:
        kwargs = peers.natten_backward_kwargs(config)
        assert set(kwargs) <= set(parameters)
        assert cutlass_hopper.check_cutlass_hopper_fna_backward_config(
            q, kwargs["backward_q_tile_shape"], kwargs["backward_kv_tile_shape"]) == config


def test_best_config_is_the_fastest_and_failures_are_reported():
    configs = [{"q_tile_shape": (4, 4, 8), "kernel_schedule": "coop"},
               {"q_tile_shape": (2, 8, 8), "kernel_schedule": "pp"},
               {"q_tile_shape": (1, 8, 8), "kernel_schedule": "non"}]
    times = {(4, 4, 8): 2.0, (2, 8, 8): 1.5}

    def time_ms(config):
        if config["q_tile_shape"] not in times:
            raise RuntimeError("not built")
        return times[config["q_tile_shape"]]

    best, trials, errors = peers.best_config(configs, time_ms)
    assert best is configs[1]
    assert trials == {"q_tile_shape=4x4x8 kernel_schedule=coop": 2.0, "q_tile_shape=2x8x8 kernel_schedule=pp": 1.5}
    assert errors == {"q_tile_shape=1x8x8 kernel_schedule=non": "RuntimeError: not built"}
    assert peers.best_config(configs[2:], time_ms)[0] is None
    assert peers.best_config([], time_ms) == (None, {}, {})
