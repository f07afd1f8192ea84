"""Head-parallel na3d (``head_parallel_na3d``) against the single-process result.

A gloo group of 2 CPU processes in the default run, 3 and 4 in the slow one; NCCL on
two GPUs. See ``ranks.py`` for how a case runs.
"""

import pytest

from ranks import by_world, check_case, on_two_gpus, spawn


def head_parallel_world2(rank, world):
    small = (1, 7, 4, 4, 2, 8)
    check_case(rank, small, (5, 3, 3), 1, (3, 4), head_parallel=True)
    check_case(rank, (1, 4, 6, 4, 2, 8), (3, 5, 3), 2, (5, 1), head_parallel=True)
    # The Triton kernel (interpreted) on the gathered heads, with the logsumexp too.
    check_case(rank, (1, 6, 4, 4, 2, 8), (5, 3, 3), 1, (4, 2), grad=False, return_lse=True,
               head_parallel=True)


def head_parallel_world3(rank, world):
    check_case(rank, (1, 5, 4, 3, 3, 8), (3, 3, 3), 1, (1, 3, 1), head_parallel=True)


def head_parallel_world4(rank, world):
    check_case(rank, (1, 5, 3, 3, 4, 8), (5, 3, 3), 1, (2, 1, 1, 1), head_parallel=True)


@pytest.mark.parametrize("world,suite", by_world(head_parallel_world2, head_parallel_world3, head_parallel_world4))
def test_head_parallel_na3d_matches_single_process(world, suite):
    spawn(world, suite)


def head_parallel_nccl(rank, world):
    gpu = dict(device="cuda", tolerance=1e-4)
    check_case(rank, (1, 9, 16, 16, 2, 64), (5, 7, 7), 1, (4, 5), grad=False, head_parallel=True, **gpu)
    check_case(rank, (1, 9, 16, 16, 2, 64), (5, 7, 7), 1, (4, 5), head_parallel=True, **gpu)


@on_two_gpus
def test_nccl_two_gpus():
    spawn(2, head_parallel_nccl, backend="nccl")
