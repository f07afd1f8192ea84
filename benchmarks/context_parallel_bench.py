"""Context-parallel na3d on several GPUs: both methods, forward and backward, checked and timed.

    torchrun --standalone --nproc-per-node N benchmarks/context_parallel_bench.py \\
        [--shapes ltx-stage5 dit-hunyuan] [--methods halo head_parallel] [--out-dir DIR]

One process per GPU, NCCL, bf16 (``benchmarks/cp_gpu_session.sh`` runs N = 2, 4 and 8;
``docs/distributed.md``, "On GPUs", says what the rows hold). Shapes:

* ``ltx-stage5``: the LTX-2.5 decoder's stage-5 grid of a 121-frame 768x1152 decode,
  1x66x128x192, 4 heads of 64, kernel (11, 11, 11);
* ``dit-hunyuan``: HunyuanVideo's latent as in ``bench_shapes.json``, 1x30x48x80, 24 heads
  of 128, kernel (18, 24, 24).

Every rank draws the same global q, k, v and dO (same seed) and keeps its slab along
``--shard-dim`` (T by default; slabs from ``even_slab_sizes``, uneven where the length does
not divide). Per shape and method (``halo``: ``sharded_na3d``; ``halo_overlap``: the same
with ``overlap=True``; ``head_parallel``: ``head_parallel_na3d``):

* **Check.** Each rank runs its slab forward and backward; the output and dq, dk, dv
  slabs are gathered on rank 0 and compared there with the single-device result on the
  full tensors. Rank 0 computes, once per shape, the float32 oracle (``na3d`` on the
  inputs cast to float32: true float32 products on GPUs; ``--oracle sdpa``, or if that
  fails, the grouped-SDPA reference the benchmark uses) and the single-device ``na3d``
  at the run's dtype. Tolerance per tensor, as in the tests: twice the single-device
  result's own error against the oracle (the same math at the dtype), plus a rounding
  band of ``2 * eps * max(1, max |oracle|)``.
* **Time** per pass (``fwd`` without autograd; ``fwd+bwd``: forward, then
  ``torch.autograd.grad``), the median over ``--runs`` runs of the slowest rank's time:
  ranks meet at a barrier and synchronize before every run, CUDA events around it.
  ``single_gpu_ms``: ``na3d`` on the full tensors on rank 0's device alone, the same way.
  ``scaling_efficiency = single_gpu_ms / (N * ms)``.
* **Bytes** each rank sends: planned (``halo_plan``, ``head_parallel_bytes``) and
  measured (the point-to-point and all-to-all calls counted during the check).
* **Overlap**: ``compute_ms`` (the ``na3d`` calls the method makes, with their shapes,
  replayed without any communication), ``comm_ms`` (the method with its ``na3d`` calls
  replaced by ``q + k + v``: messages, packing, padding and reshapes only),
  ``overlap = (compute_ms + comm_ms - ms) / min(compute_ms, comm_ms)``: 0 when the two
  run one after the other, 1 when the shorter one is hidden entirely, negative when the
  step is slower than their sum. ``exposed_comm_ms = ms - compute_ms``.

Faults (row ``cp-faults-...``), on a grid whose T (``4 N + 1``) does not divide by N:
uneven slabs against the single-device result (same tolerance rule); one rank's key slab
holding a NaN at its first position (seen by the rank below through the halo): the NaN
positions of the output and of dq, dk, dv must equal, exactly, those of the single-device
result on the same input and those na3d's contract gives (the queries whose windows hold
the key; for dk, dv every key of those queries' windows); and a head count that does not
divide by N, which ``head_parallel_na3d`` must refuse with a ``ValueError`` on every rank.
On the CPU without the interpreter, na3d's reference path computes each query on its own
when an input is not finite, so the check is judged there too.

Rows (rank 0) are merged into ``<out-dir>/<card>.json`` (``h100.json``; rows of the same
name and pass replaced, each row stamped with its device, commit and versions):
``cp-<shape>-<N>gpu`` (``fwd`` and ``fwd+bwd``) for NCCL with one GPU per rank.

Other modes, to prove the code path before a multi-GPU machine is there:

* ``--device cpu --tiny``: gloo on the CPU, tiny shapes (``tiny-ltx``, ``tiny-dit``: an
  odd and an even kernel), ``na3d``'s CPU path (rows ``cp-<shape>-<N>rank-cpu``, written
  to a temporary folder unless ``--out-dir``). Runs in seconds under
  ``torchrun --standalone --nproc-per-node 2`` (or 3: uneven slabs).
* ``--backend gloo`` on CUDA: N processes sharing fewer GPUs (NCCL refuses two ranks on
  one GPU: "Duplicate GPU detected"). Gloo moves CUDA tensors through host memory
  (``na3d.distributed`` stages the halo's point-to-point messages itself), so its times say
  nothing about NCCL: rows ``cp-<shape>-<N>rank-<G>gpu-gloo``. ``--tiny`` works on CUDA too.

``NCCL_NVLS_ENABLE=0`` (and PyTorch's and NVSHMEM's multicast switches) are set before the
process group starts unless already set: NVLink multicast serves reductions, not the
point-to-point and all-to-all traffic here, and on a shared host its multicast objects can
leave the GPUs unusable for others. The launch commands set them too.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

# Before torch.distributed starts NCCL (see the docstring).
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import na3d  # noqa: E402
from na3d import geometry, launch  # noqa: E402
from na3d.distributed import (even_slab_sizes, halo_plan, head_parallel_bytes, head_parallel_na3d,  # noqa: E402
                              sharded_na3d, slab_bounds)
from na3d.distributed import halo as halo_module  # noqa: E402
from na3d.distributed import head_parallel as head_parallel_module  # noqa: E402
from na3d.reference import na3d_sdpa_exact  # noqa: E402
from na3d.tools.bench import device_slug, git_commit, reference_grads, write_merged_results  # noqa: E402
from na3d.tools.common import bench_shapes, log  # noqa: E402

GRAD_NAMES = ("dq", "dk", "dv")
AXES = {1: "T", 2: "H", 3: "W"}
METHODS = ("halo", "halo_overlap", "head_parallel")
DEFAULT_METHODS = ("halo", "head_parallel")


def _dit_hunyuan() -> dict:
    spec = next(s for s in bench_shapes("dit") if s["name"] == "dit-hunyuan")
    return dict(shape=tuple(spec["shape"]), kernel_size=tuple(spec["kernel_size"]))


def shape_specs(tiny: bool) -> Dict[str, dict]:
    """The shapes by name: the issue's two, or tiny ones for the CPU (an odd and an even kernel)."""
    if tiny:
        return {"tiny-ltx": dict(shape=(1, 7, 6, 8, 6, 16), kernel_size=(3, 5, 5)),
                "tiny-dit": dict(shape=(1, 6, 5, 8, 6, 32), kernel_size=(4, 4, 6))}
    return {"ltx-stage5": dict(shape=(1, 66, 128, 192, 4, 64), kernel_size=(11, 11, 11)),
            "dit-hunyuan": _dit_hunyuan()}


def fault_spec(world: int, tiny: bool) -> dict:
    """The fault grid: T = 4 N + 1 (never divisible by N >= 2), 2 N heads (head-parallel
    still splits them), and the head count N + 1 that it cannot split."""
    t = 4 * world + 1
    if tiny:
        return dict(shape=(1, t, 5, 6, 2 * world, 16), kernel_size=(5, 3, 5), indivisible_heads=world + 1)
    return dict(shape=(1, t, 32, 48, 2 * world, 64), kernel_size=(5, 7, 7), indivisible_heads=world + 1)


# ---------------------------------------------------------------------------------------
# Pure parts: names, arithmetic, comparisons (tests/distributed/test_context_parallel_bench.py)
# ---------------------------------------------------------------------------------------

def run_label(world: int, device_type: str, backend: str, gpus: int) -> str:
    """``<N>gpu`` for NCCL with a GPU per rank (the rows the issue asks for); otherwise
    ``<N>rank-cpu`` or ``<N>rank-<G>gpu-<backend>``, so those rows never replace them."""
    if device_type == "cpu":
        return f"{world}rank-cpu"
    if backend == "nccl" and gpus == world:
        return f"{world}gpu"
    return f"{world}rank-{gpus}gpu-{backend}"


def row_name(shape_name: str, label: str, shard_dim: int = 1) -> str:
    """``cp-<shape>-<label>``, with ``-H`` or ``-W`` when the slabs are not along T."""
    return f"cp-{shape_name}-{label}" + ("" if shard_dim == 1 else f"-{AXES[shard_dim]}")


def scaling_efficiency(single_ms: Optional[float], world: int, ms: Optional[float]) -> Optional[float]:
    """``single_ms / (world * ms)``: 1 when N GPUs are N times as fast as one."""
    if not single_ms or not ms or ms <= 0:
        return None
    return single_ms / (world * ms)


def overlap_fraction(step_ms: float, compute_ms: float, comm_ms: float) -> Optional[float]:
    """Share of the shorter of compute and communication hidden behind the other:
    ``(compute + comm - step) / min(compute, comm)``; 0 for serial, 1 for fully hidden,
    negative when the step is slower than the serial sum. None without both parts."""
    shorter = min(compute_ms, comm_ms)
    if shorter <= 0:
        return None
    return (compute_ms + comm_ms - step_ms) / shorter


def tolerance(single_err: float, oracle_absmax: float, dtype: torch.dtype) -> float:
    """Twice the single-device result's error at ``dtype``, plus a rounding band (the tests' rule)."""
    return 2 * single_err + 2 * torch.finfo(dtype).eps * max(1.0, oracle_absmax)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    wide = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
    return (a.to(wide) - b.to(wide)).abs().max().item()


def compare(got: Sequence[torch.Tensor], oracle: Sequence[torch.Tensor], single: Sequence[torch.Tensor],
            names: Sequence[str], dtype: torch.dtype) -> dict:
    """Errors of the distributed result ``got`` and of the single-device ``single`` against
    the float32 ``oracle``, per tensor, the tolerance each, and whether all are within it."""
    result = {"max_abs_err": {}, "tolerance": {}, "single_max_abs_err": {}, "max_abs_diff_vs_single": {},
              "bitwise_equal_to_single": True}
    for name, g, o, s in zip(names, got, oracle, single):
        single_err = _max_abs(s, o)
        result["max_abs_err"][name] = _max_abs(g, o)
        result["single_max_abs_err"][name] = single_err
        result["tolerance"][name] = tolerance(single_err, o.abs().max().item(), dtype)
        result["max_abs_diff_vs_single"][name] = _max_abs(g, s)
        result["bitwise_equal_to_single"] &= bool(torch.equal(g, s))
    # (NaN compares as not within: a NaN error is never <= a tolerance.)
    result["within_tolerance"] = all(result["max_abs_err"][n] <= result["tolerance"][n] for n in names)
    return result


def expected_nan_masks(shape: Sequence[int], kernel_size: Sequence[int], position: Sequence[int]) -> dict:
    """Where a NaN in the key at ``position`` ``(b, t, h, w, head)`` must reach, by IEEE
    arithmetic over each window (na3d's contract for non-finite inputs): ``(B, T, H, W,
    NH)`` bools (a NaN anywhere in the head dim) for ``out`` and ``dq`` (the queries whose
    window holds the key) and ``dk``, ``dv`` (every key in the windows of those queries:
    their probabilities are NaN). Windows are products of 1-D windows, so both sets are
    products of 1-D sets."""
    b, t, h, w, head = position
    queries, keys = [], []
    for length, k, p in zip(shape[1:4], kernel_size, (t, h, w)):
        sees = geometry.mask_1d(length, k)       # [query, key]
        queries.append(sees[:, p])
        keys.append(sees[sees[:, p]].any(0))

    def product(axes):
        mask = torch.zeros(tuple(shape[:5]), dtype=torch.bool)
        mask[b, :, :, :, head] = axes[0][:, None, None] & axes[1][None, :, None] & axes[2][None, None, :]
        return mask

    out, key_mask = product(queries), product(keys)
    return {"out": out, "dq": out.clone(), "dk": key_mask, "dv": key_mask.clone()}


def nan_positions(t: torch.Tensor) -> torch.Tensor:
    """``(B, T, H, W, NH)`` bools: a NaN anywhere in the head dim, on the CPU."""
    return t.isnan().any(-1).cpu()


def nan_check(got: Sequence[torch.Tensor], single: Sequence[torch.Tensor], names: Sequence[str],
              expected: dict, slab_sizes: Sequence[int], shard_dim: int) -> dict:
    """NaN positions of the distributed result against the contract's (``expected``) and
    against the single-device result on the same input (exactly, every element), the
    ranks whose output slab holds a NaN, and the largest difference where both are finite.
    ``passed``: all of them equal."""
    as_expected = {n: bool(torch.equal(nan_positions(g), expected[n])) for n, g in zip(names, got)}
    matches_single = {n: bool(torch.equal(g.isnan(), s.isnan())) for n, g, s in zip(names, got, single)}
    out_nan = nan_positions(got[0])
    ranks = [r for r, (a, b) in enumerate(slab_bounds(slab_sizes)) if out_nan.narrow(shard_dim, a, b - a).any()]
    finite = {}
    for n, g, s in zip(names, got, single):
        both = torch.isfinite(g) & torch.isfinite(s)
        finite[n] = _max_abs(g[both], s[both]) if both.any() else 0.0
    return {"as_expected": as_expected, "matches_single": matches_single,
            "nan_count": {n: int(g.isnan().sum()) for n, g in zip(names, got)}, "nan_ranks_out": ranks,
            "max_abs_diff_finite_vs_single": finite,
            "passed": all(as_expected.values()) and all(matches_single.values())}


def planned_bytes(method: str, shape, kernel_size, slab_sizes, shard_dim: int, dtype) -> Optional[dict]:
    """Bytes each rank sends, as planned: ``{"fwd": [per rank], "bwd": [per rank]}`` (in the
    backward a rank sends what it received in the forward); None where the method refuses."""
    sizes = list(slab_sizes)
    if method.startswith("halo"):
        plan = halo_plan(shape, kernel_size, sizes, shard_dim=shard_dim, dtype=dtype)
        return {"fwd": list(plan.sent_bytes), "bwd": list(plan.received_bytes)}
    try:
        return {pas: list(head_parallel_bytes(shape, sizes, shard_dim=shard_dim, dtype=dtype, backward=pas == "bwd"))
                for pas in ("fwd", "bwd")}
    except ValueError:
        return None


def bytes_of_pass(counts: Optional[dict], pas: str) -> Optional[List[int]]:
    """Per-rank bytes of ``fwd`` or of ``fwd+bwd`` (the sum) from ``{"fwd": [...], "bwd": [...]}``."""
    if counts is None:
        return None
    if pas == "fwd":
        return list(counts["fwd"])
    return [a + b for a, b in zip(counts["fwd"], counts["bwd"])]


def _round(x, digits: int = 5):
    return None if x is None else round(x, digits)


def shape_rows(name: str, spec: dict, context: dict, measured: dict) -> List[dict]:
    """The ``fwd`` and ``fwd+bwd`` rows of one shape from what was measured.

    ``measured``: ``single_ms`` {pass: ms}; ``methods`` {method: {"passes": {pass: {"ms",
    "compute_ms", "comm_ms"}}, "bytes" and "planned": {"fwd": [per rank], "bwd": [per
    rank]} (sent, measured and planned), "check": {pass: compare()}}}; ``skipped``
    {method: why}.
    ``context``: ``world``, ``shard_dim``, ``slab_sizes``, ``dtype`` (str) and the stamp
    fields (device, backend, gpus, ...), copied into every row.
    """
    world = context["world_size"]
    rows = []
    for pas in ("fwd", "fwd+bwd"):
        row = dict(name=name, **{"pass": pas}, shape=list(spec["shape"]), kernel_size=list(spec["kernel_size"]),
                   **context)
        single = measured["single_ms"].get(pas)
        row.update(ms={}, single_gpu_ms=_round(single), scaling_efficiency={}, compute_ms={}, comm_ms={},
                   overlap={}, exposed_comm_ms={}, bytes_sent={}, max_abs_err={}, tolerance={},
                   max_abs_diff_vs_single={}, within_tolerance={})
        for method, m in measured["methods"].items():
            timing = m["passes"][pas]
            ms = timing["ms"]
            row["ms"][method] = _round(ms)
            row["scaling_efficiency"][method] = _round(scaling_efficiency(single, world, ms), 4)
            row["compute_ms"][method] = _round(timing["compute_ms"])
            row["comm_ms"][method] = _round(timing["comm_ms"])
            row["overlap"][method] = _round(overlap_fraction(ms, timing["compute_ms"], timing["comm_ms"]), 3)
            row["exposed_comm_ms"][method] = _round(ms - timing["compute_ms"])
            planned, sent = bytes_of_pass(m["planned"], pas), bytes_of_pass(m["bytes"], pas)
            row["bytes_sent"][method] = {"planned": planned, "measured": sent, "as_planned": planned == sent}
            check = m["check"][pas]
            row["max_abs_err"][method] = {k: float(f"{v:.3e}") for k, v in check["max_abs_err"].items()}
            row["max_abs_diff_vs_single"][method] = {k: float(f"{v:.3e}")
                                                    for k, v in check["max_abs_diff_vs_single"].items()}
            row["within_tolerance"][method] = check["within_tolerance"]
            row["tolerance"] = {k: float(f"{v:.3e}") for k, v in check["tolerance"].items()}
            row["single_gpu_max_abs_err"] = {k: float(f"{v:.3e}") for k, v in check["single_max_abs_err"].items()}
        if measured.get("oracle"):
            row["oracle"] = measured["oracle"]
        if "halo" in row["bytes_sent"]:
            row["halo_bytes"] = row["bytes_sent"]["halo"]
        if measured.get("skipped"):
            row["skipped"] = dict(measured["skipped"])
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------
# Running under a process group
# ---------------------------------------------------------------------------------------

class Run:
    """Where this rank runs: group, device, dtype; barriers, gathers and the step timer."""

    def __init__(self, device: torch.device, dtype: torch.dtype, backend: str, runs: int, shard_dim: int):
        self.device, self.dtype, self.backend, self.runs, self.shard_dim = device, dtype, backend, runs, shard_dim
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def _elapsed_ms(self, fn: Callable) -> float:
        self.sync()
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(self.device)
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def time_all(self, fn: Callable) -> float:
        """Median over runs of the slowest rank's time (every rank calls it; barrier first)."""
        fn()  # warm-up: compilation, allocator, communicators
        times = []
        for _ in range(self.runs):
            self.barrier()
            times.append(self._elapsed_ms(fn))
        slowest = torch.tensor(times, dtype=torch.float64, device=self.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return statistics.median(slowest.tolist())

    def time_alone(self, fn: Callable) -> float:
        """Median time of ``fn`` on this rank alone (no collectives)."""
        fn()
        return statistics.median(self._elapsed_ms(fn) for _ in range(self.runs))

    def gather(self, t: torch.Tensor, sizes: Sequence[int]) -> Optional[torch.Tensor]:
        """This rank's slab of a global tensor -> the global tensor on rank 0 (None elsewhere)."""
        dim, largest = self.shard_dim, max(sizes)
        t = t.detach().contiguous()
        if t.shape[dim] < largest:
            pad = list(t.shape)
            pad[dim] = largest - t.shape[dim]
            t = torch.cat([t, t.new_zeros(pad)], dim)
        parts = [torch.empty_like(t) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(t, parts, dst=0)
        if self.rank != 0:
            return None
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim)

    def gather_ints(self, values: Sequence[int]) -> List[List[int]]:
        mine = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine)
        return [e.tolist() for e in every]


class SentBytes:
    """Counts the bytes this rank sends through ``batch_isend_irecv`` (the halo) and
    ``all_to_all_single`` (head-parallel; what stays on the rank is not counted)."""

    def __init__(self):
        self.bytes = 0

    def __enter__(self):
        self._p2p, self._a2a = dist.batch_isend_irecv, dist.all_to_all_single

        def p2p(ops):
            self.bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops
                              if op.op.__name__ == "isend")
            return self._p2p(ops)

        def a2a(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            rank, world = dist.get_rank(group), dist.get_world_size(group)
            splits = input_split_sizes or [input.numel() // world] * world
            self.bytes += (sum(splits) - splits[rank]) * input.element_size()
            return self._a2a(output, input, output_split_sizes=output_split_sizes,
                             input_split_sizes=input_split_sizes, group=group, async_op=async_op)

        dist.batch_isend_irecv, dist.all_to_all_single = p2p, a2a
        return self

    def __exit__(self, *exc):
        dist.batch_isend_irecv, dist.all_to_all_single = self._p2p, self._a2a


@contextlib.contextmanager
def attention_replaced(fn: Callable):
    """The distributed modules call ``fn`` instead of ``na3d.na3d`` (their only attention)."""
    modules = (halo_module, head_parallel_module)
    saved = [m.na3d for m in modules]
    for m in modules:
        m.na3d = fn
    try:
        yield
    finally:
        for m, original in zip(modules, saved):
            m.na3d = original


def no_attention(q, k, v, kernel_size, **kwargs):
    """Stand-in for na3d (the communication-only time): differentiable, nearly free."""
    return q + k + v


class RecordedCalls:
    """Records the ``na3d`` calls a method makes (shapes, kernel, keyword arguments)."""

    def __init__(self):
        self.calls: List[Tuple[tuple, tuple, tuple, dict]] = []

    def __call__(self, q, k, v, kernel_size, **kwargs):
        self.calls.append((tuple(q.shape), tuple(k.shape), tuple(kernel_size), dict(kwargs)))
        return na3d.na3d(q, k, v, kernel_size, **kwargs)


def method_call(method: str) -> Callable:
    if method == "halo":
        return lambda *a, **kw: sharded_na3d(*a, overlap=False, **kw)
    if method == "halo_overlap":
        return lambda *a, **kw: sharded_na3d(*a, overlap=True, **kw)
    if method == "head_parallel":
        return head_parallel_na3d
    raise ValueError(f"method {method!r}: one of {METHODS}")


def global_tensors(shape, dtype, device, seed: int) -> List[torch.Tensor]:
    """q, k, v, dO: the same on every rank (same seed, same kind of device)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=dtype, device=device) for _ in range(4)]


def _forward_backward(inputs, grad, kernel_size) -> List[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = na3d.na3d(*leaves, kernel_size)
    grads = torch.autograd.grad(out, leaves, grad)
    return [out.detach(), *grads]


def single_device(q, k, v, do, kernel_size) -> List[torch.Tensor]:
    """[out, dq, dk, dv] of na3d on the full tensors, at their dtype."""
    return _forward_backward((q, k, v), do, kernel_size)


def float32_oracle(q, k, v, do, kernel_size, kind: str = "na3d") -> Tuple[List[torch.Tensor], str]:
    """[out, dq, dk, dv] in float32, and what computed them: na3d on the inputs cast to
    float32 (true float32 products on GPUs), or, with ``kind="sdpa"`` or when that fails,
    the benchmark's float32 grouped-SDPA reference (``na3d_sdpa_exact``, and
    ``reference_grads`` W chunk by W chunk)."""
    if kind == "na3d":
        try:
            return _forward_backward([t.float() for t in (q, k, v)], do.float(), kernel_size), "na3d float32"
        except Exception as exc:  # e.g. a float32 configuration this device cannot hold
            log(f"  float32 na3d failed ({type(exc).__name__}: {str(exc)[:200]}): the float32 grouped-SDPA "
                "reference instead")
            if q.device.type == "cuda":
                torch.cuda.empty_cache()
    with torch.no_grad():
        out = na3d_sdpa_exact(q.float(), k.float(), v.float(), kernel_size)
    grads = reference_grads(q, k, v, do, kernel_size, q.shape[-1] ** -0.5)
    return [out, *grads], "na3d_sdpa_exact float32"


def step(fn: Callable, leaves: Sequence[torch.Tensor], do: torch.Tensor) -> Callable:
    """forward + backward (``torch.autograd.grad``) of ``fn(*leaves)``."""
    def run():
        out = fn(*leaves)
        return torch.autograd.grad(out, leaves, do)
    return run


def forward_only(fn: Callable, inputs: Sequence[torch.Tensor]) -> Callable:
    def run():
        with torch.no_grad():
            return fn(*inputs)
    return run


class Bench:
    def __init__(self, run: Run, args, label: str):
        self.run, self.args, self.label = run, args, label

    def slabs(self, tensors, sizes):
        a, b = slab_bounds(sizes)[self.run.rank]
        return [t.narrow(self.run.shard_dim, a, b - a).clone() for t in tensors]

    def check(self, method: str, kernel_size, q, k, v, do, sizes):
        """This rank's slab forward and backward (sizes learned by the call's gather), the
        bytes sent in each; returns ([out, dq, dk, dv] on rank 0 or None, fwd bytes, bwd bytes)."""
        call = method_call(method)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        with SentBytes() as forward:
            out = call(*leaves, kernel_size, shard_dim=self.run.shard_dim)
        with SentBytes() as backward:
            grads = torch.autograd.grad(out, leaves, do)
        gathered = [self.run.gather(t, sizes) for t in (out, *grads)]
        return (gathered if self.run.rank == 0 else None), forward.bytes, backward.bytes

    def timings(self, method: str, kernel_size, q, k, v, do, sizes) -> dict:
        """ms, compute_ms and comm_ms of each pass, slowest rank, medians."""
        run, dim = self.run, self.run.shard_dim
        call = method_call(method)

        def fn(*t):
            return call(*t, kernel_size, shard_dim=dim, slab_sizes=list(sizes))

        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        result = {"fwd": {}, "fwd+bwd": {}}
        result["fwd"]["ms"] = run.time_all(forward_only(fn, (q, k, v)))
        result["fwd+bwd"]["ms"] = run.time_all(step(fn, leaves, do))
        recorder = RecordedCalls()
        with attention_replaced(recorder), torch.no_grad():
            fn(q, k, v)
        gen = torch.Generator(device=run.device).manual_seed(1)
        calls = []
        for q_shape, k_shape, ks, kwargs in recorder.calls:
            tensors = [torch.randn(s, generator=gen, dtype=run.dtype, device=run.device)
                       for s in (q_shape, k_shape, k_shape, q_shape)]
            calls.append((tensors, ks, kwargs))

        def compute(backward: bool):
            def go():
                for (cq, ck, cv, cdo), ks, kwargs in calls:
                    if backward:
                        ls = [t.detach().requires_grad_() for t in (cq, ck, cv)]
                        torch.autograd.grad(na3d.na3d(*ls, ks, **kwargs), ls, cdo)
                    else:
                        with torch.no_grad():
                            na3d.na3d(cq, ck, cv, ks, **kwargs)
            return go

        result["fwd"]["compute_ms"] = run.time_all(compute(False))
        result["fwd+bwd"]["compute_ms"] = run.time_all(compute(True))
        calls = None  # (freed; compute's closures read it)
        with attention_replaced(no_attention):
            result["fwd"]["comm_ms"] = run.time_all(forward_only(fn, (q, k, v)))
            result["fwd+bwd"]["comm_ms"] = run.time_all(step(fn, leaves, do))
        return result

    def shape(self, name: str, spec: dict, methods: Sequence[str], context: dict) -> Tuple[List[dict], bool]:
        run, args = self.run, self.args
        shape, ks, dim = tuple(spec["shape"]), tuple(spec["kernel_size"]), run.shard_dim
        sizes = even_slab_sizes(shape[dim], run.world)
        full = global_tensors(shape, run.dtype, run.device, args.seed)
        q, k, v, do = self.slabs(full, sizes)
        measured = {"single_ms": {}, "methods": {}, "skipped": {}}
        oracle = single = None
        if run.rank == 0:
            log(f"[{name}] {shape} kernel {ks}, slabs {sizes} along {AXES[dim]}: float32 oracle and "
                "single-device na3d on rank 0")
            oracle, measured["oracle"] = float32_oracle(*full, ks, args.oracle)
            single = single_device(*full, ks)
            measured["single_ms"]["fwd"] = run.time_alone(forward_only(lambda *t: na3d.na3d(*t, ks), full[:3]))
            leaves = [t.detach().clone().requires_grad_() for t in full[:3]]
            measured["single_ms"]["fwd+bwd"] = run.time_alone(step(lambda *t: na3d.na3d(*t, ks), leaves, full[3]))
            del leaves
        del full
        self.free()
        run.barrier()
        passed = True
        for method in methods:
            try:
                got, fwd_bytes, bwd_bytes = self.check(method, ks, q, k, v, do, sizes)
            except ValueError as exc:  # raised on every rank alike (e.g. heads not divisible by N)
                measured["skipped"][method] = f"{type(exc).__name__}: {exc}"
                if run.rank == 0:
                    log(f"  {method}: skipped: {measured['skipped'][method]}")
                continue
            entry = {"bytes": {"fwd": [r[0] for r in run.gather_ints([fwd_bytes])],
                               "bwd": [r[0] for r in run.gather_ints([bwd_bytes])]},
                     "planned": planned_bytes(method, shape, ks, sizes, dim, run.dtype)}
            if run.rank == 0:
                entry["check"] = {"fwd": compare(got[:1], oracle[:1], single[:1], ["out"], run.dtype),
                                  "fwd+bwd": compare(got, oracle, single, ["out", *GRAD_NAMES], run.dtype)}
                ok = entry["check"]["fwd+bwd"]["within_tolerance"]
                as_planned = entry["bytes"] == entry["planned"]
                passed &= ok and as_planned
                log(f"  {method}: {'within' if ok else 'OUTSIDE'} tolerance: max abs err "
                    + ", ".join(f"{n} {e:.2e} (tol {entry['check']['fwd+bwd']['tolerance'][n]:.2e})"
                                for n, e in entry["check"]["fwd+bwd"]["max_abs_err"].items())
                    + f"; bytes sent {'as planned' if as_planned else 'NOT AS PLANNED'}: fwd {entry['bytes']['fwd']},"
                      f" bwd {entry['bytes']['bwd']}")
            del got
            self.free()
            entry["passes"] = self.timings(method, ks, q, k, v, do, sizes)
            if run.rank == 0:
                p = entry["passes"]
                log(f"  {method}: fwd {p['fwd']['ms']:.3f} ms, fwd+bwd {p['fwd+bwd']['ms']:.3f} ms "
                    f"(compute {p['fwd+bwd']['compute_ms']:.3f}, comm {p['fwd+bwd']['comm_ms']:.3f}); "
                    f"single device fwd+bwd {measured['single_ms']['fwd+bwd']:.3f} ms")
            measured["methods"][method] = entry
            self.free()
        rows = shape_rows(row_name(name, self.label, dim), spec, dict(context, slab_sizes=list(sizes)), measured) \
            if run.rank == 0 else []
        return rows, passed

    def faults(self, methods: Sequence[str], context: dict) -> Tuple[List[dict], bool]:
        """Uneven slabs, a NaN on one rank, and a head count head-parallel cannot split."""
        run, args = self.run, self.args
        spec = fault_spec(run.world, args.tiny)
        shape, ks, dim = tuple(spec["shape"]), tuple(spec["kernel_size"]), run.shard_dim
        if dim != 1:  # (the fault grid is uneven along T; its other axes are cut as they come)
            shape = tuple(s if i != dim else 4 * run.world + 1 for i, s in enumerate(spec["shape"]))
        sizes = even_slab_sizes(shape[dim], run.world)
        row = dict(name=row_name("faults", self.label, dim), **{"pass": "fwd+bwd"}, shape=list(shape),
                   kernel_size=list(ks), slab_sizes=list(sizes), **context, uneven={}, nan={}, passed=True)
        if run.rank == 0:
            log(f"[faults] {shape} kernel {ks}, slabs {sizes} along {AXES[dim]}")
        full = global_tensors(shape, run.dtype, run.device, args.seed + 1)

        # 1. Uneven slabs: the same tolerance rule as the shape rows.
        oracle = single = None
        if run.rank == 0:
            oracle, row["oracle"] = float32_oracle(*full, ks, args.oracle)
            single = single_device(*full, ks)
        slabs = self.slabs(full, sizes)
        for method in methods:
            got, _, _ = self.check(method, ks, *slabs, sizes)
            if run.rank == 0:
                c = compare(got, oracle, single, ["out", *GRAD_NAMES], run.dtype)
                row["uneven"][method] = {"within_tolerance": c["within_tolerance"],
                                         "max_abs_err": c["max_abs_err"], "tolerance": c["tolerance"]}
                row["passed"] &= c["within_tolerance"]
                log(f"  uneven slabs, {method}: {'within' if c['within_tolerance'] else 'OUTSIDE'} tolerance")

        # 2. A NaN in one rank's key slab, at its first position: the rank below sees it
        # through the halo (or, head-parallel, the rank holding head 0).
        poisoned_rank = run.world // 2
        a = slab_bounds(sizes)[poisoned_rank][0]
        position = [0, 0, 0, 0, 0]
        position[dim] = a
        for axis in (1, 2, 3):
            if axis != dim:
                position[axis] = shape[axis] // 2
        full[1][tuple(position) + (0,)] = float("nan")
        names = ["out", *GRAD_NAMES]
        judged = True  # (every path of na3d keeps a non-finite input inside its windows)
        row["nan"] = {"poisoned": {"tensor": "key", "rank": poisoned_rank, "position": position + [0]},
                      "judged": judged}
        expected = expected_nan_masks(shape, ks, position) if run.rank == 0 else None
        if run.rank == 0:
            single = single_device(*full, ks)
            row["nan"]["single_as_expected"] = {n: bool(torch.equal(nan_positions(t), expected[n]))
                                                for n, t in zip(names, single)}
            if judged:
                row["passed"] &= all(row["nan"]["single_as_expected"].values())
        slabs = self.slabs(full, sizes)
        for method in methods:
            got, _, _ = self.check(method, ks, *slabs, sizes)
            if run.rank == 0:
                result = nan_check(got, single, names, expected, sizes, dim)
                row["nan"][method] = result
                if judged:
                    row["passed"] &= result["passed"]
                log(f"  NaN on rank {poisoned_rank}, {method}: NaN positions "
                    f"{'as expected' if all(result['as_expected'].values()) else 'NOT AS EXPECTED'}, "
                    f"{'equal to' if all(result['matches_single'].values()) else 'DIFFERENT FROM'} the single-device "
                    f"ones (output NaN on ranks {result['nan_ranks_out']})" + ("" if judged else "; not judged here"))
        del full, slabs, oracle, single
        self.free()

        # 3. Heads that do not split over the ranks: head-parallel refuses, on every rank.
        heads_shape = list(shape)
        heads_shape[4] = spec["indivisible_heads"]
        q, k, v, _ = self.slabs(global_tensors(tuple(heads_shape), run.dtype, run.device, args.seed), sizes)
        try:
            head_parallel_na3d(q, k, v, ks, shard_dim=dim)
            error = None
        except ValueError as exc:
            error = f"{type(exc).__name__}: {exc}"
        raised = run.gather_ints([error is not None])
        row["indivisible_heads"] = {"heads": heads_shape[4], "error": error,
                                    "raised_on_ranks": [r for r, (x,) in enumerate(raised) if x]}
        ok = all(x for (x,) in raised) and error is not None and "heads" in error
        row["passed"] &= ok
        if run.rank == 0:
            log(f"  {heads_shape[4]} heads over {run.world} ranks, head_parallel: "
                f"{'refused on every rank' if ok else 'NOT refused'}: {error}")
        return ([row] if run.rank == 0 else []), row["passed"]

    def free(self) -> None:
        if self.run.device.type == "cuda":
            torch.cuda.empty_cache()


def print_table(rows: List[dict]) -> None:
    if not any(r.get("ms") for r in rows):
        return
    log(f"\n{'row':<34}{'pass':>8}{'method':>15}{'ms':>10}{'1 dev ms':>10}{'eff':>7}{'overlap':>9}"
        f"{'MiB sent (max)':>16}{'ok':>4}")
    for r in rows:
        for method, ms in r.get("ms", {}).items():
            sent = r["bytes_sent"][method]["measured"]
            eff, ovl = r["scaling_efficiency"].get(method), r["overlap"].get(method)
            log(f"{r['name']:<34}{r['pass']:>8}{method:>15}{ms:>10.3f}{r['single_gpu_ms'] or float('nan'):>10.3f}"
                f"{eff if eff is not None else float('nan'):>7.3f}{ovl if ovl is not None else float('nan'):>9.3f}"
                f"{max(sent) / 2 ** 20:>16.2f}{'y' if r['within_tolerance'][method] else 'N':>4}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=None,
                        help="ltx-stage5 and/or dit-hunyuan (default both; none with a bare --shapes: the "
                             "faults only); with --tiny: tiny-ltx, tiny-dit")
    parser.add_argument("--methods", nargs="*", default=list(DEFAULT_METHODS), choices=METHODS,
                        help="halo (sharded_na3d), halo_overlap (overlap=True), head_parallel")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                        help="default: nccl on cuda, gloo on cpu. gloo on cuda lets N processes share fewer GPUs")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU mode; also a quick GPU check)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--shard-dim", type=int, choices=(1, 2, 3), default=1, help="1 = T (default), 2 = H, 3 = W")
    parser.add_argument("--runs", type=int, default=None, help="timed runs per measurement (default 5; --tiny 2)")
    parser.add_argument("--oracle", choices=("na3d", "sdpa"), default="na3d",
                        help="the float32 reference: na3d on float32 inputs (default; falls back to sdpa if it "
                             "fails) or the grouped-SDPA reference (na3d_sdpa_exact, reference_grads)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-faults", action="store_true", help="skip the fault checks")
    parser.add_argument("--out-dir", default=None,
                        help="where <card>.json goes (default benchmarks/results on CUDA, a temporary folder on CPU)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--commit", default=None, help="git sha of the measured tree (default: git rev-parse)")
    parser.add_argument("--timeout-min", type=float, default=30.0, help="process group timeout, minutes")
    return parser


def setup(args, parser) -> Tuple[torch.device, str, int]:
    """Start the process group (unless one is running): (device, backend, GPUs in use)."""
    if args.device == "cpu":
        backend = args.backend or "gloo"
        if backend != "gloo":
            parser.error("--device cpu runs on gloo")
        if not args.tiny:
            parser.error("the full shapes take hours on a CPU: add --tiny")
        device, gpus = torch.device("cpu"), 0
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device: run with --device cpu --tiny (gloo, CPU processes)")
        backend = args.backend or "nccl"
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
        count = torch.cuda.device_count()
        if backend == "nccl" and count < local_world:
            parser.error(f"{local_world} processes on this host but {count} GPU(s): NCCL refuses two ranks on one "
                         "GPU ('Duplicate GPU detected'). Run one process per GPU, or prove the code path with "
                         "--backend gloo (CUDA tensors through host memory; ranks share the GPUs; its times mean "
                         "nothing for NCCL) or with --device cpu --tiny")
        device = torch.device("cuda", local_rank % count)
        torch.cuda.set_device(device)
        gpus = min(count, local_world)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            parser.error("start it with torchrun, e.g. torchrun --standalone --nproc-per-node 2 " + __file__)
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=args.timeout_min))
    return device, backend, gpus


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    started_here = not dist.is_initialized()
    device, backend, gpus = setup(args, parser)
    rank, world = dist.get_rank(), dist.get_world_size()
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dtype = getattr(torch, args.dtype)
    if device.type == "cpu" and dtype == torch.bfloat16 and launch.kernels_interpreted():
        parser.error("the Triton interpreter (TRITON_INTERPRET=1) computes bf16 dot products wrongly: "
                     "use --dtype float16, or run without the interpreter (na3d's exact CPU path)")
    specs = shape_specs(args.tiny)
    names = list(specs) if args.shapes is None else args.shapes
    unknown = [n for n in names if n not in specs]
    if unknown:
        parser.error(f"unknown shapes {unknown}; known{' with --tiny' if args.tiny else ''}: {list(specs)}")
    run = Run(device, dtype, backend, args.runs or (2 if args.tiny else 5), args.shard_dim)
    label = run_label(world, device.type, backend, gpus)
    card = "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device)
    import triton

    context = dict(device=card, backend=backend, world_size=world, gpus=gpus,
                   shared_gpu=device.type == "cuda" and gpus < world, shard_dim=args.shard_dim,
                   dtype=args.dtype, commit=args.commit or git_commit(), date=datetime.date.today().isoformat(),
                   torch=torch.__version__, triton=triton.__version__, python=platform.python_version())
    if device.type == "cuda":
        context["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if backend == "nccl" else None
    out_dir = args.out_dir or (os.path.join("benchmarks", "results") if device.type == "cuda"
                               else tempfile.mkdtemp(prefix="cp_bench-"))
    path = os.path.join(out_dir, f"{'cpu' if device.type == 'cpu' else device_slug(card)}.json")
    if rank == 0:
        log(f"{world} ranks, {backend}, {card} ({gpus} GPU(s)), {args.dtype}; shapes {names}; methods {args.methods}")
    bench = Bench(run, args, label)
    rows: List[dict] = []
    passed = True

    def save(complete: bool) -> None:
        if rank == 0 and not args.no_write and rows:
            write_merged_results(path, rows, dict(context, ceilings={}), complete)

    for name in names:
        new, ok = bench.shape(name, specs[name], args.methods, context)
        rows += new
        passed &= ok
        save(complete=False)
    if not args.no_faults:
        new, ok = bench.faults(args.methods, context)
        rows += new
        passed &= ok
    save(complete=True)
    if rank == 0:
        print_table(rows)
        if not args.no_write:
            log(f"\nrows merged into {path}")
        log("all checks passed" if passed else "SOME CHECKS FAILED (above)")
    run.barrier()
    if started_here:
        dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    code = main()
    # Under load, the CPU build's gloo sometimes aborts in its destructors at interpreter
    # exit ("terminate called without an active exception") after every check passed:
    # leave without them, as examples/context_parallel.py does.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
