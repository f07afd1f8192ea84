"""Arguments of the distributed functions: checked on every rank, so that a bad argument
on one rank raises on all of them instead of leaving the others waiting in a collective."""

import pytest
import torch
import torch.distributed as dist

from na3d import distributed as nadist
from ranks import spawn


def check_validation(rank, world):
    """Bad arguments raise on every rank (no rank is left waiting in a collective)."""
    shape = (1, 3, 4, 4, 2, 8)
    q = torch.randn(*shape)
    with pytest.raises(ValueError, match="shard_dim"):
        nadist.sharded_na3d(q, q, q, 3, shard_dim=4)
    with pytest.raises(ValueError, match="kernel_size"):
        nadist.sharded_na3d(q, q, q, (7, 3, 3))  # 7 > global T = 6
    with pytest.raises(ValueError, match="kernel_size differs"):
        nadist.sharded_na3d(q, q, q, (3, 3, 3) if rank else (5, 3, 3))
    with pytest.raises(ValueError, match="outside shard_dim"):
        other = torch.randn(1, 3, 4, 4 + rank, 2, 8)
        nadist.sharded_na3d(other, other, other, 3)
    # Only rank 1 is wrong; rank 0 must hear of it instead of waiting.
    bad = torch.randn(1, 3, 4, 4, 8) if rank == 1 else q
    with pytest.raises(ValueError, match="rank 6" if rank == 1 else r"rank\(s\) \[1\]"):
        nadist.sharded_na3d(bad, bad, bad, 3)
    # Passed-in slab sizes are checked locally only (no gather), so make them wrong everywhere.
    with pytest.raises(ValueError, match="slab_sizes"):
        nadist.sharded_na3d(q, q, q, 3, slab_sizes=[4, 4])
    with pytest.raises(ValueError, match="slab_sizes"):
        nadist.sharded_na3d(q, q, q, 3, slab_sizes=[3])
    with pytest.raises(ValueError, match="heads"):
        odd = torch.randn(1, 3, 4, 4, 3, 8)
        nadist.head_parallel_na3d(odd, odd, odd, 3)
    with pytest.raises(TypeError, match="window"):
        nadist.sharded_na3d(q, q, q, 3, window=3)
    with pytest.raises(TypeError, match="overlap"):
        nadist.sharded_na3d(q, q, q, 3, overlap="yes")
    with pytest.raises(NotImplementedError, match="is_causal"):
        nadist.head_parallel_na3d(q, q, q, 3, is_causal=(True, False, False))
    # A keyword argument wrong on rank 0 only: rank 1 hears of it too.
    with pytest.raises(NotImplementedError if rank == 0 else ValueError,
                       match="dilation" if rank == 0 else r"rank\(s\) \[0\]"):
        nadist.sharded_na3d(q, q, q, 3, dilation=2 if rank == 0 else 1)


def test_bad_arguments_raise_on_every_rank():
    spawn(2, check_validation)


def test_needs_an_initialized_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    q = torch.randn(1, 3, 4, 4, 2, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        nadist.sharded_na3d(q, q, q, 3)
