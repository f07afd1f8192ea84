"""The halo exchange (``sharded_na3d``, ``halo_exchange``) against the single-process result.

Gloo groups of 2 CPU processes in the default run (more cases of 2 in the slow one), 3 and 4
(slabs thinner than the halo) in the slow one; NCCL on two GPUs. See ``ranks.py`` for how a case runs.
"""

import contextlib

import pytest
import torch

from na3d import launch
from na3d.distributed import halo
from ranks import by_world, check_case, check_halo_exchange, on_two_gpus, spawn


@contextlib.contextmanager
def staged_through_host():
    """Every message goes through host copies, as gloo needs for CUDA tensors (forced on CPU ones)."""
    original = halo._stages_through_host
    halo._stages_through_host = lambda group, device: True
    try:
        yield
    finally:
        halo._stages_through_host = original


def halo_world2(rank, world):
    # The default run's cases: every schedule and axis, both kernels, the host hop.
    # The grad=False case below is meant to run the Triton kernel (interpreted).
    assert torch.cuda.is_available() or launch.kernels_interpreted(), "TRITON_INTERPRET did not reach the workers"
    small = (1, 7, 4, 4, 2, 8)
    check_case(rank, small, (5, 3, 3), 1, (5, 2), overlap=True, count=True)   # uneven, along T, overlap schedule
    check_case(rank, (2, 3, 4, 6, 2, 8), (3, 3, 5), 3, (3, 3), count=True, scale=0.3)        # along W
    # The Triton kernel (interpreted) through the halo, with the logsumexp too.
    check_case(rank, (1, 6, 4, 4, 1, 8), (3, 3, 3), 1, (4, 2), grad=False, return_lse=True, overlap=True)
    check_halo_exchange(rank, (1, 7, 3, 3, 1, 8), (5, 3, 3), 1, (1, 6))
    # The host hop of gloo with CUDA tensors (forced here on CPU tensors): the same
    # rows and gradients, the same elements sent.
    with staged_through_host():
        check_case(rank, small, (5, 3, 3), 1, (5, 2), count=True)


def halo_world2_more(rank, world):
    # The slow run's further cases on 2 ranks: the plain schedule, H with the sizes
    # passed, the kernel without overlap, the host hop with it.
    assert torch.cuda.is_available() or launch.kernels_interpreted(), "TRITON_INTERPRET did not reach the workers"
    small = (1, 7, 4, 4, 2, 8)
    check_case(rank, small, (5, 3, 3), 1, (5, 2), count=True)                 # uneven, along T
    check_case(rank, (1, 3, 9, 4, 2, 8), (3, 5, 3), 2, (2, 7), pass_sizes=True, count=True)  # along H
    check_case(rank, (1, 6, 4, 4, 1, 8), (5, 3, 3), 1, (2, 4), grad=False, return_lse=True)
    with staged_through_host():
        check_case(rank, small, (5, 3, 3), 1, (5, 2), overlap=True)


def halo_world3(rank, world):
    thin = (1, 6, 3, 4, 1, 8)
    # Slabs thinner than the halo: rank 0 needs keys from both other ranks.
    check_case(rank, thin, (5, 3, 3), 1, (1, 1, 4), count=True)
    check_case(rank, thin, (5, 3, 3), 1, (1, 1, 4), overlap=True, pass_sizes=True)
    check_case(rank, (1, 3, 11, 3, 1, 8), (3, 7, 3), 2, (5, 2, 4), overlap=True, count=True)
    # Rank 1 gets all three parts of the overlap schedule: interior, lower and upper strips.
    check_case(rank, (1, 12, 3, 3, 1, 8), (3, 3, 3), 1, (3, 6, 3), overlap=True, count=True)
    check_case(rank, (1, 3, 4, 5, 1, 8), (3, 3, 5), 3, (1, 3, 1), count=True)
    check_halo_exchange(rank, (1, 4, 7, 2, 1, 8), (3, 5, 1), 2, (2, 4, 1))


def halo_world4(rank, world):
    # One-position slabs with K = 5 along T, then along H.
    check_case(rank, (1, 6, 3, 3, 1, 8), (5, 3, 3), 1, (1, 1, 1, 3), count=True)
    check_case(rank, (1, 3, 5, 3, 1, 8), (3, 5, 3), 2, (1, 1, 1, 2), count=True, overlap=True)
    check_case(rank, (1, 9, 3, 3, 1, 8), (5, 3, 3), 1, (3, 2, 1, 3), count=True)
    check_halo_exchange(rank, (1, 5, 3, 2, 1, 8), (5, 1, 1), 1, (1, 1, 1, 2))


@pytest.mark.parametrize("backend,device,staged", [
    ("gloo", "cpu", False), ("gloo", "cuda", True), ("nccl", "cuda", False),
    ("cpu:gloo,cuda:nccl", "cuda", False), ("cpu:gloo,cuda:gloo", "cuda", True), ("cpu:gloo,cuda:nccl", "cpu", False)])
def test_host_staging_only_for_device_tensors_on_gloo(monkeypatch, backend, device, staged):
    monkeypatch.setattr(halo.dist, "get_backend", lambda group=None: backend)
    assert halo._stages_through_host(None, torch.device(device)) is staged


@pytest.mark.parametrize("world,suite", by_world(halo_world2, halo_world3, halo_world4) + [
    pytest.param(2, halo_world2_more, id="world2-more", marks=pytest.mark.slow)])
def test_sharded_na3d_matches_single_process(world, suite):
    spawn(world, suite)


def halo_nccl(rank, world):
    # The sharded run tiles a different (padded) grid than the single-GPU one, so
    # float32 sums run in another order: a looser bound than on the CPU.
    gpu = dict(device="cuda", tolerance=1e-4)
    check_case(rank, (1, 9, 16, 16, 2, 64), (5, 7, 7), 1, (6, 3), grad=False, **gpu)
    check_case(rank, (1, 9, 16, 16, 2, 64), (5, 7, 7), 2, (3, 13), grad=False, overlap=True, **gpu)
    check_case(rank, (1, 5, 16, 16, 2, 64), (5, 7, 7), 1, (1, 4), grad=False, **gpu)
    # Backward through the GPU kernels (na3d's backward) and the NCCL halo-gradient return.
    check_case(rank, (1, 9, 16, 16, 2, 64), (5, 7, 7), 1, (2, 7), count=True, **gpu)
    check_case(rank, (1, 9, 16, 16, 2, 64), (5, 7, 7), 2, (10, 6), overlap=True, **gpu)
    check_halo_exchange(rank, (1, 7, 8, 8, 2, 64), (5, 3, 3), 1, (1, 6), device="cuda")


@on_two_gpus
def test_nccl_two_gpus():
    spawn(2, halo_nccl, backend="nccl")
