"""Running context-parallel checks on several processes: spawning, one case per rank.

The multi-process tests (``test_halo.py``, ``test_head_parallel.py``,
``test_layout.py``) spawn one gloo group per world size and run many cases inside
it, because spawning is the expensive part on a 2-core machine. Every rank builds the
same global tensors from a seed; rank 0 computes the single-process na3d result and
its autograd gradients and broadcasts them; every rank compares its slab (max abs
diff <= 1e-5 in float32). na3d itself runs whatever it runs on the CPU: with
``TRITON_INTERPRET=1`` (set by conftest, inherited by the spawned processes) that is
the Triton kernels in the interpreter, forward and backward.

A failing rank raises; ``torch.multiprocessing.spawn`` then stops the others and
re-raises in the test with the rank's traceback.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys

from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import na3d
from na3d import distributed as nadist
from na3d import geometry

TOLERANCE = 1e-5


# ----------------------------------------------------------------------------------
# Spawning
# ----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str, suite: Callable[[int, int], None]) -> None:
    torch.set_num_threads(1)  # world processes share 2 cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        suite(rank, world)
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


def spawn(world: int, suite: Callable[[int, int], None], backend: str = "gloo") -> None:
    """Run ``suite(rank, world)`` on ``world`` processes of one group (a module-level
    function of a test module, so that the spawned processes can import it)."""
    mp.spawn(_worker, args=(world, _free_port(), backend, suite), nprocs=world, join=True)


def by_world(suite2, suite3, suite4) -> list:
    """``(world, suite)`` cases for ``pytest.mark.parametrize``: groups of 2 ranks in the
    default run, of 3 and 4 in the slow one."""
    return [pytest.param(world, suite, id=f"world{world}", marks=() if world == 2 else pytest.mark.slow)
            for world, suite in ((2, suite2), (3, suite3), (4, suite4))]


def on_two_gpus(test):
    """A ``gpu`` test that needs two CUDA devices and NCCL."""
    needs = pytest.mark.skipif(torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                               reason="needs 2 CUDA devices and NCCL")
    return pytest.mark.gpu(needs(test))


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


def expected_sent_elements(rank, shape, kernel_size, shard_dim, sizes):
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
        forward, backward = expected_sent_elements(rank, shape, kernel_size, shard_dim, sizes)
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
