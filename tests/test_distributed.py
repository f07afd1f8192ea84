"""Context-parallel na3d (halo exchange and head-parallel) against the single-process result.

The multi-process tests spawn one gloo group per world size (2, 3, 4) and run many
cases inside it, because spawning is the expensive part on a 2-core machine. Every
rank builds the same global tensors from a seed; rank 0 computes the single-process
na3d result and its autograd gradients and broadcasts them; every rank compares its
slab (max abs diff <= 1e-5 in float32). na3d itself runs whatever it runs on the CPU:
with ``TRITON_INTERPRET=1`` (set by conftest, inherited by the spawned processes)
that is the Triton kernels in the interpreter, forward and backward.

A failing rank raises; ``torch.multiprocessing.spawn`` then stops the others and
re-raises here with the rank's traceback.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import na3d
from na3d import distributed as nadist
from na3d import geometry, launch

TOLERANCE = 1e-5
LTX = nadist.LTX_STAGE5_SHAPE


# ----------------------------------------------------------------------------------
# Spawning
# ----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str, suite: str) -> None:
    torch.set_num_threads(1)  # world processes share 2 cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        SUITES[suite](rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Every check passed: leave without the interpreter's shutdown. Under load the
    # CPU build's gloo sometimes aborts in its destructors at exit ("terminate
    # called without an active exception", no Python frame on any thread), which
    # would fail a run whose checks all passed. A failing check still raises above
    # and reaches mp.spawn as before.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(world: int, suite: str, backend: str = "gloo") -> None:
    mp.spawn(_worker, args=(world, _free_port(), backend, suite), nprocs=world, join=True)


# ----------------------------------------------------------------------------------
# One case, run on every rank
# ----------------------------------------------------------------------------------

def _global_tensors(shape, seed, device):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(device) for _ in range(4)]  # q, k, v, dout


class _CountSent:
    """Wraps ``dist.batch_isend_irecv`` to count the elements this rank sends."""

    def __init__(self):
        self.original = dist.batch_isend_irecv
        self.elements = 0

    def __call__(self, ops):
        self.elements += sum(op.tensor.numel() for op in ops if op.op.__name__ == "isend")
        return self.original(ops)

    def __enter__(self):
        dist.batch_isend_irecv = self
        return self

    def __exit__(self, *exc):
        dist.batch_isend_irecv = self.original


def _needed_positions(length, kernel, receiver_slab, owner_slab):
    """Brute force: positions of ``owner_slab`` seen by some query of ``receiver_slab``."""
    mask = geometry.mask_1d(length, kernel)
    (ra, rb), (oa, ob) = receiver_slab, owner_slab
    return int(mask[ra:rb, oa:ob].any(0).sum())


def _expected_sent_elements(rank, shape, kernel_size, shard_dim, sizes):
    """Elements of K and V this rank must send in forward, and send back in backward."""
    bounds = nadist.slab_bounds(sizes)
    length, kernel = shape[shard_dim], kernel_size[shard_dim - 1]
    per_position = 2 * torch.Size(shape).numel() // length
    forward = sum(_needed_positions(length, kernel, bounds[r], bounds[rank])
                  for r in range(len(sizes)) if r != rank)
    backward = sum(_needed_positions(length, kernel, bounds[rank], bounds[r])
                   for r in range(len(sizes)) if r != rank)
    return forward * per_position, backward * per_position


def _max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


def _single_process_result(rank, q, k, v, dout, kernel_size, grad, na3d_kwargs):
    """na3d on the global tensors (and its gradients), computed by rank 0 and broadcast.

    Every rank could compute it, but the ranks share two cores: once is enough.
    Returns ``[out]``, ``[out, lse]`` or ``[out, dq, dk, dv]``.
    """
    lse_shape = q.shape[:-1]
    if grad:
        shapes = [(q.shape, q.dtype)] * 4
    elif na3d_kwargs.get("return_lse"):
        shapes = [(q.shape, q.dtype), (lse_shape, torch.float32)]
    else:
        shapes = [(q.shape, q.dtype)]
    if rank == 0:
        if grad:
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            out = na3d.na3d(qg, kg, vg, kernel_size, **na3d_kwargs)
            (out * dout).sum().backward()
            result = [out.detach(), qg.grad, kg.grad, vg.grad]
        else:
            with torch.no_grad():
                out = na3d.na3d(q, k, v, kernel_size, **na3d_kwargs)
            result = list(out) if isinstance(out, tuple) else [out]
        result = [t.contiguous() for t in result]
    else:
        result = [torch.empty(shape, dtype=dtype, device=q.device) for shape, dtype in shapes]
    for t in result:
        dist.broadcast(t, src=0)
    return result


def check_case(rank, shape, kernel_size, shard_dim, sizes, *, head_parallel=False, overlap=False,
               grad=True, pass_sizes=False, count=False, device="cpu", tolerance=TOLERANCE, seed=0,
               **na3d_kwargs):
    """This rank's slab of the distributed result equals the single-process one."""
    assert sum(sizes) == shape[shard_dim]
    q, k, v, dout = _global_tensors(shape, seed, device)
    a, b = nadist.slab_bounds(sizes)[rank]

    def mine(t):
        return t.narrow(shard_dim, a, b - a).detach().clone()

    kwargs = dict(shard_dim=shard_dim, slab_sizes=list(sizes) if pass_sizes else None, **na3d_kwargs)
    if head_parallel:
        run = nadist.head_parallel_na3d
    else:
        run = nadist.sharded_na3d
        kwargs["overlap"] = overlap
    label = (f"rank {rank}: shape={shape} kernel={kernel_size} shard_dim={shard_dim} sizes={sizes} "
             f"head_parallel={head_parallel} overlap={overlap} grad={grad}")

    want = _single_process_result(rank, q, k, v, dout, kernel_size, grad, na3d_kwargs)
    rows = [w.narrow(shard_dim, a, b - a) for w in want]
    if not grad:
        with torch.no_grad():
            got = run(mine(q), mine(k), mine(v), kernel_size, **kwargs)
        got = list(got) if isinstance(got, tuple) else [got]
        assert len(got) == len(rows) and got[0].shape == mine(q).shape, label
        for name, g_, w in zip(("output", "lse"), got, rows):
            assert _max_diff(g_, w) <= tolerance, f"{label} ({name})"
        return

    ql, kl, vl = (mine(t).requires_grad_() for t in (q, k, v))
    with _CountSent() as sent_forward:
        got = run(ql, kl, vl, kernel_size, **kwargs)
    with _CountSent() as sent_backward:
        (got * mine(dout)).sum().backward()

    for name, g_, w in zip(("output", "dq", "dk", "dv"), (got, ql.grad, kl.grad, vl.grad), rows):
        assert _max_diff(g_, w) <= tolerance, f"{label} ({name})"
    if count:
        forward, backward = _expected_sent_elements(rank, shape, kernel_size, shard_dim, sizes)
        assert sent_forward.elements == forward, f"{label}: sent {sent_forward.elements}, needed {forward}"
        assert sent_backward.elements == backward, f"{label}: sent back {sent_backward.elements}, needed {backward}"


def check_halo_exchange(rank, shape, kernel_size, shard_dim, sizes, device="cpu"):
    """halo_exchange alone: K/V over the key range, and halo gradients summed by owners."""
    _, k, v, _ = _global_tensors(shape, 1, device)
    bounds = nadist.slab_bounds(sizes)
    a, b = bounds[rank]
    length, kernel = shape[shard_dim], kernel_size[shard_dim - 1]
    kl = k.narrow(shard_dim, a, b - a).clone().requires_grad_()
    vl = v.narrow(shard_dim, a, b - a).clone().requires_grad_()
    k_ext, v_ext, (u0, u1) = nadist.halo_exchange(kl, vl, kernel_size, shard_dim=shard_dim)
    assert (u0, u1) == nadist.keys_needed(a, b, length, kernel)
    assert torch.equal(k_ext, k.narrow(shard_dim, u0, u1 - u0))
    assert torch.equal(v_ext, v.narrow(shard_dim, u0, u1 - u0))
    # Position j's gradient is 1 from every rank whose key range holds j (times 1 or 2).
    (k_ext.sum() + 2 * v_ext.sum()).backward()
    holders = torch.zeros(length, device=device)
    for ra, rb in bounds:
        lo, hi = nadist.keys_needed(ra, rb, length, kernel)
        holders[lo:hi] += 1
    view = [1] * 6
    view[shard_dim] = b - a
    expected = holders[a:b].reshape(view).expand_as(kl)
    assert torch.equal(kl.grad, expected) and torch.equal(vl.grad, 2 * expected)


# ----------------------------------------------------------------------------------
# Suites: one per spawned group
# ----------------------------------------------------------------------------------

def suite_world2(rank, world):
    # The grad=False cases below are meant to run the Triton kernel (interpreted).
    assert torch.cuda.is_available() or launch.kernels_interpreted(), "TRITON_INTERPRET did not reach the workers"
    small = (1, 7, 4, 4, 2, 8)
    check_case(rank, small, (5, 3, 3), 1, (5, 2), count=True)                 # uneven, along T
    check_case(rank, small, (5, 3, 3), 1, (5, 2), overlap=True, count=True)   # overlap schedule
    check_case(rank, (1, 3, 9, 4, 2, 8), (3, 5, 3), 2, (2, 7), pass_sizes=True, count=True)  # along H
    check_case(rank, (2, 3, 4, 6, 2, 8), (3, 3, 5), 3, (3, 3), count=True, scale=0.3)        # along W
    check_case(rank, small, (5, 3, 3), 1, (3, 4), head_parallel=True)
    check_case(rank, (1, 4, 6, 4, 2, 8), (3, 5, 3), 2, (5, 1), head_parallel=True)
    # The Triton kernel (interpreted) through the halo, with the logsumexp too.
    check_case(rank, (1, 6, 4, 4, 1, 8), (5, 3, 3), 1, (2, 4), grad=False, return_lse=True)
    check_case(rank, (1, 6, 4, 4, 1, 8), (3, 3, 3), 1, (4, 2), grad=False, return_lse=True, overlap=True)
    check_case(rank, (1, 6, 4, 4, 2, 8), (5, 3, 3), 1, (4, 2), grad=False, return_lse=True,
               head_parallel=True)
    check_halo_exchange(rank, (1, 7, 3, 3, 1, 8), (5, 3, 3), 1, (1, 6))
    check_validation(rank, world)


def suite_world3(rank, world):
    thin = (1, 6, 3, 4, 1, 8)
    # Slabs thinner than the halo: rank 0 needs keys from both other ranks.
    check_case(rank, thin, (5, 3, 3), 1, (1, 1, 4), count=True)
    check_case(rank, thin, (5, 3, 3), 1, (1, 1, 4), overlap=True, pass_sizes=True)
    check_case(rank, (1, 3, 11, 3, 1, 8), (3, 7, 3), 2, (5, 2, 4), overlap=True, count=True)
    # Rank 1 gets all three parts of the overlap schedule: interior, lower and upper strips.
    check_case(rank, (1, 12, 3, 3, 1, 8), (3, 3, 3), 1, (3, 6, 3), overlap=True, count=True)
    check_case(rank, (1, 3, 4, 5, 1, 8), (3, 3, 5), 3, (1, 3, 1), count=True)
    check_case(rank, (1, 5, 4, 3, 3, 8), (3, 3, 3), 1, (1, 3, 1), head_parallel=True)
    check_halo_exchange(rank, (1, 4, 7, 2, 1, 8), (3, 5, 1), 2, (2, 4, 1))


def suite_world4(rank, world):
    # One-position slabs with K = 5 along T, then along H.
    check_case(rank, (1, 6, 3, 3, 1, 8), (5, 3, 3), 1, (1, 1, 1, 3), count=True)
    check_case(rank, (1, 3, 5, 3, 1, 8), (3, 5, 3), 2, (1, 1, 1, 2), count=True, overlap=True)
    check_case(rank, (1, 9, 3, 3, 1, 8), (5, 3, 3), 1, (3, 2, 1, 3), count=True)
    check_case(rank, (1, 5, 3, 3, 4, 8), (5, 3, 3), 1, (2, 1, 1, 1), head_parallel=True)
    check_halo_exchange(rank, (1, 5, 3, 2, 1, 8), (5, 1, 1), 1, (1, 1, 1, 2))


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


SUITES = {"world2": suite_world2, "world3": suite_world3, "world4": suite_world4}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_distributed_matches_single_process(world):
    _spawn(world, f"world{world}")


# ----------------------------------------------------------------------------------
# GPU: NCCL, forward and backward
# ----------------------------------------------------------------------------------

def suite_nccl(rank, world):
    # The sharded run tiles a different (padded) grid than the single-GPU one, so
    # float32 sums run in another order: a looser bound than on the CPU.
    gpu = dict(device="cuda", tolerance=1e-4)
    check_case(rank, (1, 9, 16, 16, 2, 64), (5, 7, 7), 1, (6, 3), grad=False, **gpu)
    check_case(rank, (1, 9, 16, 16, 2, 64), (5, 7, 7), 2, (3, 13), grad=False, overlap=True, **gpu)
    check_case(rank, (1, 5, 16, 16, 2, 64), (5, 7, 7), 1, (1, 4), grad=False, **gpu)
    check_case(rank, (1, 9, 16, 16, 2, 64), (5, 7, 7), 1, (4, 5), grad=False, head_parallel=True, **gpu)
    # Backward through the GPU kernels (na3d's backward) and the NCCL halo-gradient return.
    check_case(rank, (1, 9, 16, 16, 2, 64), (5, 7, 7), 1, (2, 7), count=True, **gpu)
    check_case(rank, (1, 9, 16, 16, 2, 64), (5, 7, 7), 2, (10, 6), overlap=True, **gpu)
    check_case(rank, (1, 9, 16, 16, 2, 64), (5, 7, 7), 1, (4, 5), head_parallel=True, **gpu)
    check_halo_exchange(rank, (1, 7, 8, 8, 2, 64), (5, 3, 3), 1, (1, 6), device="cuda")


SUITES["nccl"] = suite_nccl


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                    reason="needs 2 CUDA devices and NCCL")
def test_nccl_two_gpus():
    _spawn(2, "nccl", backend="nccl")


# ----------------------------------------------------------------------------------
# Single-process checks: arguments and the traffic accounting
# ----------------------------------------------------------------------------------

def test_needs_an_initialized_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    q = torch.randn(1, 3, 4, 4, 2, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        nadist.sharded_na3d(q, q, q, 3)


def test_even_slab_sizes():
    assert nadist.even_slab_sizes(79, 8) == (10,) * 7 + (9,)
    assert nadist.even_slab_sizes(10, 4) == (3, 3, 2, 2)
    with pytest.raises(ValueError, match="parts"):
        nadist.even_slab_sizes(3, 4)


@pytest.mark.parametrize("shard_dim", [1, 2, 3])
def test_halo_plan_counts_exactly_what_queries_need(shard_dim):
    shape = (2, 13, 11, 9, 3, 16)
    kernel_size = (5, 7, 3)
    uneven = {1: (1, 1, 2, 1, 8), 2: (1, 1, 2, 1, 6), 3: (1, 1, 2, 1, 4)}[shard_dim]
    for sizes in (3, uneven):  # an even split into 3, and thin uneven slabs
        plan = nadist.halo_plan(shape, kernel_size, sizes, shard_dim=shard_dim, dtype=torch.float32)
        for rank in range(len(plan.slab_sizes)):
            forward, backward = _expected_sent_elements(rank, shape, kernel_size, shard_dim, plan.slab_sizes)
            assert plan.sent_bytes[rank] == 4 * forward
            assert plan.received_bytes[rank] == 4 * backward


def test_halo_plan_ltx_numbers():
    """The doc's table: T split 4 of the LTX stage-5 shape, by hand."""
    row = 192 * 192 * 4 * 64 * 2          # one T position of K or V, bf16
    plan = nadist.halo_plan(LTX, (11, 11, 11), 4, shard_dim=1)
    assert plan.slab_sizes == (20, 20, 20, 19)
    assert plan.kv_bytes_per_position == 2 * row
    # Ranks 1, 2 send 5 positions to each neighbor; 0 and 3 to their one neighbor.
    assert plan.sent_bytes == (10 * row, 20 * row, 20 * row, 10 * row)
    assert plan.key_ranges == ((0, 25), (15, 45), (35, 65), (55, 79))
    a2a = nadist.head_parallel_bytes(LTX, 4, shard_dim=1)
    # q, k, v of 20 positions for 3 heads out, then 59 positions of 1 head's output.
    assert a2a[0] == (3 * 20 * 3 + 59) * row // 4


def test_head_parallel_bytes_total_matches_a_hand_count():
    shape = (1, 8, 4, 4, 2, 8)
    sent = nadist.head_parallel_bytes(shape, (3, 5), shard_dim=1, dtype=torch.float32)
    per_position_one_head = 4 * 4 * 8 * 4
    assert sent == ((3 * 3 + 5) * per_position_one_head, (3 * 5 + 3) * per_position_one_head)


def test_traffic_table_has_every_split():
    table = nadist.traffic_table()
    assert table.count("\n") == 1 + 6
    assert "n/a (4 heads)" in table
