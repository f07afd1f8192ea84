"""Context-parallel 3D neighborhood attention on ``torch.distributed``.

Each rank of a process group holds a contiguous slab of the global
``(B, T, H, W, NH, HD)`` tensors along one spatial dimension (``shard_dim`` 1 = T,
2 = H, 3 = W), slabs in rank order, possibly uneven, each at least one position
thick. Two ways to compute this rank's slab of exactly the single-device result:

* :func:`sharded_na3d` (halo exchange): each rank receives, by point-to-point
  messages, the keys and values its queries need from the other ranks' slabs (the
  "halo", computed by :mod:`na3d.geometry`), then attends locally. Traffic per rank
  depends on the kernel, not on the slab: K and V of ``K // 2`` positions to each
  neighbor (more ranks are involved only when slabs are thinner than the halo).
* :func:`head_parallel_na3d` (Ulysses-style): an all-to-all turns position slabs into
  head groups, so each rank holds the whole grid for ``NH / world`` heads, runs
  :func:`na3d.na3d` unchanged, and a second all-to-all brings the output back.
  Traffic per rank is about ``4 * (world - 1) / world`` slabs (q, k, v, then the
  output), whatever the kernel.

``docs/distributed.md`` compares the two; :func:`halo_plan` and
:func:`head_parallel_bytes` compute the bytes behind that comparison, and
``python -m na3d.distributed`` prints the table for the LTX stage-5 shape.

Both are differentiable. The halo exchange is a pair of ``torch.autograd.Function``
(:class:`_StartHaloExchange`, :class:`_FinishHaloExchange`): in backward the
gradients of the halo (dK, dV at positions other ranks own) travel back to their
owners and are summed there, while dQ never leaves its rank. Backward is collective:
every rank of the group must run backward through the result (as with DDP).

Arguments must match across ranks (kernel_size, shard_dim, the shape outside
``shard_dim``, na3d's keyword arguments). Slab sizes are gathered once per call with
one small ``all_gather`` of ints, which also carries a flag for "this rank rejected
its arguments", so a bad argument on one rank raises on every rank instead of leaving
the others waiting in a collective. Passing ``slab_sizes`` skips that gather (and
with it the cross-rank checks).

Backends: NCCL with CUDA tensors (``torch.cuda.set_device`` called per rank), gloo
with CPU tensors. Gradients flow through whatever :func:`na3d.na3d` differentiates
with on that device (its backward kernels on GPUs); the communication half of the
backward is the same everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from . import geometry
from .api import na3d

SHARDABLE_DIMS = {1: "T", 2: "H", 3: "W"}
FORWARDED_NA3D_KWARGS = ("stride", "dilation", "is_causal", "scale", "return_lse")

# Layout of the int64 vector every rank contributes to the metadata all_gather.
_META_FLAG, _META_SHARD_DIM, _META_KERNEL, _META_SHAPE = 0, 1, 2, 5
_META_LENGTH = 11


# ----------------------------------------------------------------------------------
# Arguments and the slab layout
# ----------------------------------------------------------------------------------

def _kernel_triple(kernel_size) -> Tuple[int, int, int]:
    def is_int(x):
        return isinstance(x, int) and not isinstance(x, bool)

    if is_int(kernel_size):
        return (kernel_size,) * 3
    if isinstance(kernel_size, (tuple, list)) and len(kernel_size) == 3 and all(map(is_int, kernel_size)):
        return tuple(kernel_size)
    raise TypeError(f"kernel_size={kernel_size!r} must be an int or a tuple of 3 ints")


def _check_na3d_kwargs(na3d_kwargs: Mapping) -> None:
    """Only what na3d accepts, and only what the halo geometry covers."""
    for name in na3d_kwargs:
        if name not in FORWARDED_NA3D_KWARGS:
            raise TypeError(f"unexpected keyword argument {name!r}; na3d keyword arguments are "
                            f"{', '.join(FORWARDED_NA3D_KWARGS)}")
    # The halo plan is the dilation-1, non-causal, stride-1 geometry; other settings
    # would need other key ranges, so refuse them here even once na3d accepts them.
    for name, neutral in (("stride", 1), ("dilation", 1), ("is_causal", False)):
        if name in na3d_kwargs:
            value = na3d_kwargs[name]
            values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
            if any(type(x) is not type(neutral) for x in values):
                kind = type(neutral).__name__
                raise TypeError(f"{name}={value!r} must be a {kind} or a tuple of 3 {kind}s")
            if any(x != neutral for x in values):
                raise NotImplementedError(f"{name}={value!r}: the distributed functions support only "
                                          f"{name}={neutral!r}")


def _local_problem(tensors: Mapping[str, torch.Tensor], kernel_size, shard_dim, na3d_kwargs: Mapping,
                   overlap: bool = False) -> Optional[Exception]:
    """The first thing wrong with this rank's own arguments, or None.

    Returned rather than raised so that the rank can still join the metadata gather
    and tell the others (who would otherwise wait for it forever).
    """
    try:
        _check_na3d_kwargs(na3d_kwargs)
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap={overlap!r} must be a bool")
        _kernel_triple(kernel_size)
        if not isinstance(shard_dim, int) or isinstance(shard_dim, bool):
            raise TypeError(f"shard_dim={shard_dim!r} must be an int (1 = T, 2 = H, 3 = W)")
        if shard_dim not in SHARDABLE_DIMS:
            raise ValueError(f"shard_dim={shard_dim} must be 1 (T), 2 (H) or 3 (W) of (B, T, H, W, NH, HD)")
        reference_name, reference = None, None
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 6:
                raise ValueError(f"{name} must have rank 6 (B, T, H, W, NH, HD); got {name}.shape={tuple(t.shape)}")
            if reference is None:
                reference_name, reference = name, t
                continue
            if t.shape != reference.shape:
                raise ValueError(f"{reference_name} and {name} must have the same shape; got "
                                 f"{tuple(reference.shape)} and {tuple(t.shape)}")
            if t.dtype != reference.dtype:
                raise TypeError(f"{reference_name} and {name} must share one dtype; got {reference.dtype} and {t.dtype}")
            if t.device != reference.device:
                raise ValueError(f"{reference_name} and {name} must be on one device; got "
                                 f"{reference.device} and {t.device}")
        if reference.shape[shard_dim] < 1:
            raise ValueError(f"{reference_name}.shape[{shard_dim}] = 0: every rank's slab along shard_dim "
                             "must be at least one position thick")
    except (TypeError, ValueError, NotImplementedError) as problem:
        return problem
    return None


@dataclass(frozen=True)
class SlabLayout:
    """How the global tensors are cut: this rank's slab and everybody's sizes."""

    rank: int
    slab_sizes: Tuple[int, ...]
    shard_dim: int
    global_shape: Tuple[int, ...]      # (B, T, H, W, NH, HD)
    kernel_size: Tuple[int, int, int]

    @property
    def world_size(self) -> int:
        return len(self.slab_sizes)

    @property
    def length(self) -> int:
        """Global length of the sharded axis."""
        return self.global_shape[self.shard_dim]

    @property
    def kernel(self) -> int:
        """Kernel size along the sharded axis."""
        return self.kernel_size[self.shard_dim - 1]

    @property
    def bounds(self) -> List[Tuple[int, int]]:
        return geometry.slab_bounds(self.slab_sizes)

    @property
    def slab(self) -> Tuple[int, int]:
        """``[a, b)``: this rank's positions along the sharded axis."""
        return self.bounds[self.rank]

    @property
    def key_range(self) -> Tuple[int, int]:
        """``[u0, u1)``: the keys this rank's queries need."""
        a, b = self.slab
        return geometry.keys_needed(a, b, self.length, self.kernel)


def _collective_device(group, example) -> torch.device:
    """Where the small metadata tensor lives: next to the data, or where the backend wants it."""
    if isinstance(example, torch.Tensor):
        return example.device
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _resolve_group(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
    if group is None:
        group = dist.group.WORLD
    if dist.get_rank(group) < 0:
        raise ValueError(f"group={group!r}: this process is not a member of the group")
    return group


def _slab_layout(
    tensors: Mapping[str, torch.Tensor],
    kernel_size,
    shard_dim,
    group,
    slab_sizes: Optional[Sequence[int]],
    na3d_kwargs: Optional[Mapping] = None,
    overlap: bool = False,
) -> SlabLayout:
    """Validate the arguments on every rank and agree on the slab sizes."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    problem = _local_problem(tensors, kernel_size, shard_dim, na3d_kwargs or {}, overlap)
    example = next(iter(tensors.values()))
    first_name = next(iter(tensors))

    if slab_sizes is None:
        meta = [0] * _META_LENGTH
        if problem is not None:
            meta[_META_FLAG] = 1
        else:
            meta[_META_SHARD_DIM] = shard_dim
            meta[_META_KERNEL:_META_KERNEL + 3] = _kernel_triple(kernel_size)
            meta[_META_SHAPE:_META_SHAPE + 6] = example.shape
        device = _collective_device(group, example)
        mine = torch.tensor(meta, dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=group)
        rows = [g.tolist() for g in gathered]
        rejected = [r for r, row in enumerate(rows) if row[_META_FLAG]]
        if problem is not None:
            raise problem
        if rejected:
            raise ValueError(f"rank(s) {rejected} of the group rejected their arguments (the error is raised "
                             "there); every rank must pass matching, valid arguments")
        if len({row[_META_SHARD_DIM] for row in rows}) > 1:
            raise ValueError(f"shard_dim differs across ranks: {[row[_META_SHARD_DIM] for row in rows]}")
        kernels = [tuple(row[_META_KERNEL:_META_KERNEL + 3]) for row in rows]
        if len(set(kernels)) > 1:
            raise ValueError(f"kernel_size differs across ranks: {kernels}")
        shapes = [row[_META_SHAPE:_META_SHAPE + 6] for row in rows]
        outside = {tuple(s[:shard_dim] + s[shard_dim + 1:]) for s in shapes}
        if len(outside) > 1:
            raise ValueError(f"{first_name}.shape must agree across ranks outside shard_dim={shard_dim}; "
                             f"got {[tuple(s) for s in shapes]}")
        sizes = tuple(s[shard_dim] for s in shapes)
    else:
        if problem is not None:
            raise problem
        if not isinstance(slab_sizes, (tuple, list)) or len(slab_sizes) != world:
            raise ValueError(f"slab_sizes={slab_sizes!r} must be a list of {world} ints, one per rank of the group")
        if any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in slab_sizes):
            raise ValueError(f"slab_sizes={slab_sizes!r}: every slab must be a positive int")
        if slab_sizes[rank] != example.shape[shard_dim]:
            raise ValueError(f"slab_sizes[{rank}]={slab_sizes[rank]} does not match this rank's "
                             f"{first_name}.shape[{shard_dim}]={example.shape[shard_dim]}")
        sizes = tuple(slab_sizes)

    ks = _kernel_triple(kernel_size)
    global_shape = list(example.shape)
    global_shape[shard_dim] = sum(sizes)
    for axis, k, size in zip("THW", ks, global_shape[1:4]):
        if not 1 <= k <= size:
            raise ValueError(f"kernel_size={ks}: along {axis} it must be between 1 and the global size {size}")
    return SlabLayout(rank, sizes, shard_dim, tuple(global_shape), ks)


def _global_rank(group, group_rank: int) -> int:
    """P2P peers are named by global rank; the plan speaks group ranks."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


# ----------------------------------------------------------------------------------
# Halo exchange
# ----------------------------------------------------------------------------------

class _HaloExchange:
    """One halo exchange of (K, V) along the sharded axis: plan, buffers, messages.

    Every message packs the K and V pieces for one peer into one contiguous run of a
    single flat buffer (``[2, piece]``), so a call posts at most one send and one
    receive per peer, and NCCL gets contiguous tensors whatever the input strides.
    """

    def __init__(self, layout: SlabLayout, group, example: torch.Tensor):
        self.layout = layout
        self.group = group
        self.dim = layout.shard_dim
        self.slab_shape = tuple(example.shape)
        self.dtype, self.device = example.dtype, example.device
        plan = geometry.halo_exchange_plan(layout.slab_sizes, layout.kernel)
        self.incoming = self._pack([(t.sender, t.start, t.stop) for t in plan if t.receiver == layout.rank])
        self.outgoing = self._pack([(t.receiver, t.start, t.stop) for t in plan if t.sender == layout.rank])
        self.works: List = []
        self.send_buffer: Optional[torch.Tensor] = None

    def _piece_shape(self, positions: int) -> Tuple[int, ...]:
        shape = list(self.slab_shape)
        shape[self.dim] = positions
        return (2, *shape)

    def _pack(self, pieces):
        """``(peer, start, stop, offset, numel)`` for each piece, at consecutive offsets."""
        packed, offset = [], 0
        for peer, start, stop in pieces:
            numel = math.prod(self._piece_shape(stop - start))
            packed.append((peer, start, stop, offset, numel))
            offset += numel
        return packed

    @staticmethod
    def _total(pieces) -> int:
        return sum(p[4] for p in pieces)

    def _view(self, flat: torch.Tensor, piece) -> torch.Tensor:
        _, start, stop, offset, numel = piece
        return flat.narrow(0, offset, numel).view(self._piece_shape(stop - start))

    def _post(self, sends: Sequence[Tuple[int, torch.Tensor]], receives: Sequence[Tuple[int, torch.Tensor]]):
        ops = [dist.P2POp(dist.isend, t, _global_rank(self.group, peer), self.group) for peer, t in sends]
        ops += [dist.P2POp(dist.irecv, t, _global_rank(self.group, peer), self.group) for peer, t in receives]
        return dist.batch_isend_irecv(ops) if ops else []

    def _empty(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=self.dtype, device=self.device)

    # -- forward ------------------------------------------------------------------

    def start(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Post every send and receive; return the (still filling) receive buffer."""
        a = self.layout.slab[0]
        send = self._empty(self._total(self.outgoing))
        for piece in self.outgoing:
            _, start, stop, _, _ = piece
            packed = self._view(send, piece)
            packed[0].copy_(key.narrow(self.dim, start - a, stop - start))
            packed[1].copy_(value.narrow(self.dim, start - a, stop - start))
        received = self._empty(self._total(self.incoming))
        self.send_buffer = send  # must outlive the sends
        self.works = self._post(
            [(p[0], send.narrow(0, p[3], p[4])) for p in self.outgoing],
            [(p[0], received.narrow(0, p[3], p[4])) for p in self.incoming])
        return received

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []
        self.send_buffer = None

    def assemble(self, key, value, received) -> Tuple[torch.Tensor, torch.Tensor]:
        """K and V over this rank's key range: received pieces and the own slab, in rank order."""
        rank = self.layout.rank
        lower = [self._view(received, p) for p in self.incoming if p[0] < rank]
        upper = [self._view(received, p) for p in self.incoming if p[0] > rank]
        keys = [p[0] for p in lower] + [key] + [p[0] for p in upper]
        values = [p[1] for p in lower] + [value] + [p[1] for p in upper]
        return torch.cat(keys, self.dim), torch.cat(values, self.dim)

    # -- backward -----------------------------------------------------------------

    def split_gradients(self, grad_key_ext, grad_value_ext):
        """Own-slab part of dK/dV, and the halo part packed like the receive buffer."""
        a, b = self.layout.slab
        u0 = self.layout.key_range[0]
        grad_received = self._empty(self._total(self.incoming))
        for piece in self.incoming:
            _, start, stop, _, _ = piece
            packed = self._view(grad_received, piece)
            packed[0].copy_(grad_key_ext.narrow(self.dim, start - u0, stop - start))
            packed[1].copy_(grad_value_ext.narrow(self.dim, start - u0, stop - start))
        return (grad_key_ext.narrow(self.dim, a - u0, b - a),
                grad_value_ext.narrow(self.dim, a - u0, b - a),
                grad_received)

    def return_gradients(self, grad_received: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Send halo gradients back to their owners; sum what comes back for our own pieces."""
        grad_received = grad_received.contiguous()
        grad_sent = self._empty(self._total(self.outgoing))
        works = self._post(
            [(p[0], grad_received.narrow(0, p[3], p[4])) for p in self.incoming],
            [(p[0], grad_sent.narrow(0, p[3], p[4])) for p in self.outgoing])
        for work in works:
            work.wait()
        a = self.layout.slab[0]
        grad_key = torch.zeros(self.slab_shape, dtype=self.dtype, device=self.device)
        grad_value = torch.zeros_like(grad_key)
        # The same positions can have gone to several ranks (thin slabs): add, never copy.
        for piece in self.outgoing:
            _, start, stop, _, _ = piece
            packed = self._view(grad_sent, piece)
            grad_key.narrow(self.dim, start - a, stop - start).add_(packed[0])
            grad_value.narrow(self.dim, start - a, stop - start).add_(packed[1])
        return grad_key, grad_value


class _StartHaloExchange(torch.autograd.Function):
    """Forward: post the halo messages. Backward: route halo gradients to their owners."""

    @staticmethod
    def forward(ctx, exchange: _HaloExchange, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        ctx.exchange = exchange
        return exchange.start(key, value)

    @staticmethod
    def backward(ctx, grad_received):
        grad_key, grad_value = ctx.exchange.return_gradients(grad_received)
        return None, grad_key, grad_value


class _FinishHaloExchange(torch.autograd.Function):
    """Forward: wait for the halo and assemble K/V over the key range. Backward: split."""

    @staticmethod
    def forward(ctx, exchange: _HaloExchange, key, value, received):
        ctx.exchange = exchange
        exchange.wait()
        return exchange.assemble(key, value, received)

    @staticmethod
    def backward(ctx, grad_key_ext, grad_value_ext):
        grad_key, grad_value, grad_received = ctx.exchange.split_gradients(grad_key_ext, grad_value_ext)
        return None, grad_key, grad_value, grad_received


def halo_exchange(
    key: torch.Tensor,
    value: torch.Tensor,
    kernel_size,
    *,
    group=None,
    shard_dim: int = 1,
    slab_sizes: Optional[Sequence[int]] = None,
) -> Tuple[torch.Tensor, torch.Tensor, Tuple[int, int]]:
    """K and V of this rank's key range, gathered from the ranks that own them.

    Returns ``(key_ext, value_ext, (u0, u1))``: the global positions ``[u0, u1)`` along
    ``shard_dim`` that this rank's queries need (:func:`na3d.geometry.keys_needed`).
    Differentiable: gradients of the halo positions go back to their owners.
    This is the communication half of :func:`sharded_na3d`, on its own.
    """
    group = _resolve_group(group)
    layout = _slab_layout({"key": key, "value": value}, kernel_size, shard_dim, group, slab_sizes)
    exchange = _HaloExchange(layout, group, key)
    received = _StartHaloExchange.apply(exchange, key, value)
    key_ext, value_ext = _FinishHaloExchange.apply(exchange, key, value, received)
    return key_ext, value_ext, layout.key_range


def _attend_rows(query, key_ext, value_ext, key_start: int, first: int, stop: int,
                 layout: SlabLayout, na3d_kwargs):
    """na3d output for this rank's queries at global positions ``[first, stop)``.

    ``key_ext``/``value_ext`` hold the keys ``[key_start, key_start + len)`` along the
    sharded axis, a superset of ``keys_needed(first, stop)``. Attention runs on that
    sub-grid alone, whose clamped windows equal the global ones for these queries
    (:func:`na3d.geometry.keys_needed` says why).

    Wasted work: :func:`na3d.na3d` needs ``query.shape == key.shape``, so the queries
    are padded with zero rows up to the key range, and the kernel computes those rows
    only for them to be dropped: ``(u1 - u0) / (stop - first) - 1`` extra work, about
    ``(K - 1) / slab`` away from the borders. A query-offset argument to na3d (queries
    ``[first, stop)`` against keys starting at ``u0``) removes the padding: this is the
    one function to change then.
    """
    dim, a = layout.shard_dim, layout.slab[0]
    u0, u1 = geometry.keys_needed(first, stop, layout.length, layout.kernel)
    key_sub = key_ext.narrow(dim, u0 - key_start, u1 - u0)
    value_sub = value_ext.narrow(dim, u0 - key_start, u1 - u0)
    rows = query.narrow(dim, first - a, stop - first)
    if (u0, u1) != (first, stop):
        def zeros(n):
            shape = list(rows.shape)
            shape[dim] = n
            return rows.new_zeros(shape)

        rows = torch.cat([zeros(first - u0), rows, zeros(u1 - stop)], dim)
    result = na3d(rows, key_sub, value_sub, layout.kernel_size, **na3d_kwargs)
    if isinstance(result, tuple):  # (out, lse): the same rows of both
        return tuple(r.narrow(dim, first - u0, stop - first) for r in result)
    return result.narrow(dim, first - u0, stop - first)


def _concat_rows(parts, dim: int):
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(group, dim) for group in zip(*parts))
    return torch.cat(parts, dim)


def sharded_na3d(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kernel_size,
    *,
    group=None,
    shard_dim: int = 1,
    slab_sizes: Optional[Sequence[int]] = None,
    overlap: bool = False,
    **na3d_kwargs,
):
    """This rank's slab of ``na3d(Q, K, V, kernel_size)`` on tensors sharded over ``group``.

    ``query``, ``key``, ``value``: this rank's ``(B, n_rank, H, W, NH, HD)`` slab (for
    ``shard_dim=1``; likewise for H or W) of the global tensors, slabs contiguous and
    in rank order, any sizes >= 1. ``slab_sizes`` (one int per rank) skips the small
    all_gather that otherwise learns them. ``na3d_kwargs`` (``scale``,
    ``return_lse``; ``stride``, ``dilation``, ``is_causal`` at their defaults only)
    go to :func:`na3d.na3d`. Returns what na3d returns, for this rank's slab.

    Each rank receives exactly the K/V positions its queries need that other ranks
    own (:func:`na3d.geometry.halo_exchange_plan`) and sends exactly the parts of its
    own slab the others need, with one ``batch_isend_irecv``.

    ``overlap=True`` posts the exchange, computes the queries whose windows lie in
    the own slab (:func:`na3d.geometry.queries_within`) while the halo is in flight,
    then the two border strips. With today's zero-padded queries (see
    :func:`_attend_rows`) that costs three padded calls instead of one, about
    ``2 * (K - 1)`` extra query positions of compute along ``shard_dim``, which is
    more than the transfer it hides on NVLink for video shapes
    (``docs/distributed.md``), so it is off by default. Once na3d takes a query
    offset the split costs nothing and overlap should become the default. Backward
    does not overlap: the halo gradients are exchanged after the local backward.
    """
    group = _resolve_group(group)
    layout = _slab_layout({"query": query, "key": key, "value": value}, kernel_size, shard_dim, group,
                          slab_sizes, na3d_kwargs, overlap)
    dim = layout.shard_dim
    a, b = layout.slab
    u0, _ = layout.key_range
    exchange = _HaloExchange(layout, group, key)
    received = _StartHaloExchange.apply(exchange, key, value)

    interior = (a, a)
    if overlap:
        interior = geometry.queries_within(a, b, layout.length, layout.kernel)
    if interior[0] < interior[1]:
        # Needs only the own slab: runs while the halo messages are in flight.
        interior_rows = _attend_rows(query, key, value, a, *interior, layout, na3d_kwargs)

    key_ext, value_ext = _FinishHaloExchange.apply(exchange, key, value, received)
    if interior[0] >= interior[1]:
        return _attend_rows(query, key_ext, value_ext, u0, a, b, layout, na3d_kwargs)
    parts = []
    if a < interior[0]:
        parts.append(_attend_rows(query, key_ext, value_ext, u0, a, interior[0], layout, na3d_kwargs))
    parts.append(interior_rows)
    if interior[1] < b:
        parts.append(_attend_rows(query, key_ext, value_ext, u0, interior[1], b, layout, na3d_kwargs))
    return _concat_rows(parts, dim)


# ----------------------------------------------------------------------------------
# Head parallelism (Ulysses-style all-to-all)
# ----------------------------------------------------------------------------------

class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` on flat tensors; its gradient is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, send_counts: List[int], receive_counts: List[int], group):
        ctx.counts, ctx.group = (send_counts, receive_counts), group
        out = flat.new_empty(sum(receive_counts))
        dist.all_to_all_single(out, flat.contiguous(), output_split_sizes=receive_counts,
                               input_split_sizes=send_counts, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        send_counts, receive_counts = ctx.counts
        grad_in = grad_out.new_empty(sum(send_counts))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), output_split_sizes=send_counts,
                               input_split_sizes=receive_counts, group=ctx.group)
        return grad_in, None, None, None


def _slabs_to_heads(x: torch.Tensor, layout: SlabLayout, group) -> torch.Tensor:
    """``(B, n_rank.., NH, *tail)`` position slab -> ``(B, full grid, NH / world, *tail)``.

    Rank ``j`` receives heads ``[j * nh, (j + 1) * nh)`` of every slab.
    """
    world, dim = layout.world_size, layout.shard_dim
    heads = x.shape[4]
    per_rank = x.unflatten(4, (world, heads // world)).movedim(4, 0).contiguous()
    chunk_shape = list(per_rank.shape[1:])
    chunk_numel = math.prod(chunk_shape)
    receive_shapes = []
    for size in layout.slab_sizes:
        shape = list(chunk_shape)
        shape[dim] = size
        receive_shapes.append(shape)
    receive_counts = [math.prod(s) for s in receive_shapes]
    flat = _AllToAll.apply(per_rank.reshape(-1), [chunk_numel] * world, receive_counts, group)
    pieces = [p.view(s) for p, s in zip(flat.split(receive_counts), receive_shapes)]
    return torch.cat(pieces, dim)


def _heads_to_slabs(x: torch.Tensor, layout: SlabLayout, group) -> torch.Tensor:
    """Inverse of :func:`_slabs_to_heads`: ``(B, full grid, nh, *tail)`` -> own slab, all heads."""
    world, dim = layout.world_size, layout.shard_dim
    slabs = [s.contiguous().reshape(-1) for s in x.split(list(layout.slab_sizes), dim)]
    send_counts = [s.numel() for s in slabs]
    own_shape = list(x.shape)
    own_shape[dim] = layout.slab_sizes[layout.rank]
    own_numel = math.prod(own_shape)
    flat = _AllToAll.apply(torch.cat(slabs), send_counts, [own_numel] * world, group)
    per_rank = flat.view(world, *own_shape)            # (world, B, n_rank.., nh, *tail)
    return per_rank.movedim(0, 4).flatten(4, 5)        # heads j * nh .. came from rank j


def head_parallel_na3d(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kernel_size,
    *,
    group=None,
    shard_dim: int = 1,
    slab_sizes: Optional[Sequence[int]] = None,
    **na3d_kwargs,
):
    """Same contract as :func:`sharded_na3d`, computed head-parallel (Ulysses-style).

    One all-to-all sends each rank all positions of ``NH / world`` heads (q, k and v
    in one message per peer), :func:`na3d.na3d` runs unchanged on the full grid, and
    a second all-to-all returns each rank its slab with all heads. Needs ``NH``
    divisible by the group size; exact for any kernel, with no padded queries, but
    moves about four slabs per rank per pass whatever the kernel
    (:func:`head_parallel_bytes`), and each rank holds the full grid of its heads.
    """
    group = _resolve_group(group)
    layout = _slab_layout({"query": query, "key": key, "value": value}, kernel_size, shard_dim, group,
                          slab_sizes, na3d_kwargs)
    heads = layout.global_shape[4]
    if heads % layout.world_size:
        raise ValueError(f"query has {heads} heads (query.shape[4]), which the {layout.world_size} ranks "
                         "of the group cannot split evenly; use sharded_na3d")
    qkv = _slabs_to_heads(torch.stack([query, key, value], dim=5), layout, group)
    q_heads, k_heads, v_heads = qkv.unbind(5)
    result = na3d(q_heads, k_heads, v_heads, layout.kernel_size, **na3d_kwargs)
    if isinstance(result, tuple):  # (out, lse): lse has no head-dim axis
        out, lse = result
        lse = _heads_to_slabs(lse.unsqueeze(-1), layout, group).squeeze(-1)
        return _heads_to_slabs(out, layout, group), lse
    return _heads_to_slabs(result, layout, group)


# ----------------------------------------------------------------------------------
# Traffic accounting
# ----------------------------------------------------------------------------------

def even_slab_sizes(length: int, parts: int) -> Tuple[int, ...]:
    """``length`` cut into ``parts`` slabs differing by at most one (larger ones first)."""
    if not isinstance(parts, int) or isinstance(parts, bool) or not 1 <= parts <= length:
        raise ValueError(f"parts={parts!r} must be an int between 1 and length={length}")
    return tuple(length // parts + (1 if r < length % parts else 0) for r in range(parts))


@dataclass(frozen=True)
class HaloPlan:
    """Traffic of one :func:`sharded_na3d` forward (backward moves the same bytes back)."""

    shard_dim: int
    slab_sizes: Tuple[int, ...]
    transfers: Tuple[geometry.HaloTransfer, ...]
    key_ranges: Tuple[Tuple[int, int], ...]
    kv_bytes_per_position: int           # K and V of one position along shard_dim
    sent_bytes: Tuple[int, ...]          # per rank
    received_bytes: Tuple[int, ...]      # per rank
    padded_query_overhead: Tuple[float, ...]  # extra query rows computed / own rows, per rank


def _normalize_sizes(global_shape: Sequence[int], slab_sizes, shard_dim: int) -> Tuple[int, ...]:
    if shard_dim not in SHARDABLE_DIMS:
        raise ValueError(f"shard_dim={shard_dim!r} must be 1 (T), 2 (H) or 3 (W)")
    if len(global_shape) != 6:
        raise ValueError(f"global_shape={tuple(global_shape)} must be (B, T, H, W, NH, HD)")
    length = global_shape[shard_dim]
    if isinstance(slab_sizes, int) and not isinstance(slab_sizes, bool):
        return even_slab_sizes(length, slab_sizes)
    sizes = tuple(slab_sizes)
    if sum(sizes) != length:
        raise ValueError(f"slab_sizes={sizes} must add up to global_shape[{shard_dim}]={length}")
    geometry.slab_bounds(sizes)  # positive ints
    return sizes


def halo_plan(
    global_shape: Sequence[int],
    kernel_size,
    slab_sizes: Union[int, Sequence[int]],
    *,
    shard_dim: int = 1,
    dtype: torch.dtype = torch.bfloat16,
) -> HaloPlan:
    """Bytes each rank sends and receives in :func:`sharded_na3d`'s forward exchange.

    ``slab_sizes``: one int per rank, or the number of ranks for an even split
    (:func:`even_slab_sizes`). Counts exactly the messages :func:`sharded_na3d` posts.
    """
    sizes = _normalize_sizes(global_shape, slab_sizes, shard_dim)
    ks = _kernel_triple(kernel_size)
    kernel = ks[shard_dim - 1]
    element = torch.empty((), dtype=dtype).element_size()
    per_position = 2 * math.prod(global_shape) // global_shape[shard_dim] * element
    transfers = tuple(geometry.halo_exchange_plan(sizes, kernel))
    sent, received = [0] * len(sizes), [0] * len(sizes)
    for t in transfers:
        sent[t.sender] += (t.stop - t.start) * per_position
        received[t.receiver] += (t.stop - t.start) * per_position
    bounds = geometry.slab_bounds(sizes)
    ranges = tuple(geometry.keys_needed(a, b, global_shape[shard_dim], kernel) for a, b in bounds)
    overhead = tuple(((u1 - u0) - (b - a)) / (b - a) for (u0, u1), (a, b) in zip(ranges, bounds))
    return HaloPlan(shard_dim, sizes, transfers, ranges, per_position, tuple(sent), tuple(received), overhead)


def head_parallel_bytes(
    global_shape: Sequence[int],
    slab_sizes: Union[int, Sequence[int]],
    *,
    shard_dim: int = 1,
    dtype: torch.dtype = torch.bfloat16,
) -> Tuple[int, ...]:
    """Bytes each rank sends in :func:`head_parallel_na3d`'s forward (both all-to-alls).

    Rank r sends q, k, v of its slab for the other ranks' heads, then the output of
    its heads at the other ranks' positions; backward sends the same amounts (dO
    first, then dQ, dK, dV). Counts only what leaves the rank. Valid when the head
    count divides by the number of ranks (otherwise head_parallel_na3d refuses).
    """
    sizes = _normalize_sizes(global_shape, slab_sizes, shard_dim)
    world = len(sizes)
    if global_shape[4] % world:
        raise ValueError(f"global_shape={tuple(global_shape)}: {global_shape[4]} heads do not split "
                         f"evenly over {world} ranks")
    element = torch.empty((), dtype=dtype).element_size()
    length = global_shape[shard_dim]
    per_position_all_heads = math.prod(global_shape) // length * element
    per_position_per_rank_heads = per_position_all_heads // world
    return tuple(3 * n * per_position_per_rank_heads * (world - 1)          # q, k, v out
                 + (length - n) * per_position_per_rank_heads               # output back
                 for n in sizes)


LTX_STAGE5_SHAPE = (1, 79, 192, 192, 4, 64)
LTX_STAGE5_KERNEL = (11, 11, 11)


def traffic_table(
    global_shape: Sequence[int] = LTX_STAGE5_SHAPE,
    kernel_size=LTX_STAGE5_KERNEL,
    world_sizes: Sequence[int] = (2, 4, 8),
    shard_dims: Sequence[int] = (1, 2),
    dtype: torch.dtype = torch.bfloat16,
) -> str:
    """Markdown table: halo vs all-to-all bytes each rank sends in one forward (the doc's table)."""
    mib = float(1 << 20)
    lines = ["| split | ranks | slab sizes | halo sent per rank, MiB (rank 0, 1, ...) "
             "| all-to-all sent per rank, MiB (max) | halo / all-to-all (max) "
             "| padded-query overhead (max) |",
             "|---|---|---|---|---|---|---|"]
    for shard_dim in shard_dims:
        for world in world_sizes:
            plan = halo_plan(global_shape, kernel_size, world, shard_dim=shard_dim, dtype=dtype)
            sizes = plan.slab_sizes
            halo = ", ".join(f"{b / mib:.0f}" for b in plan.sent_bytes)
            if global_shape[4] % world == 0:
                a2a_max = max(head_parallel_bytes(global_shape, sizes, shard_dim=shard_dim, dtype=dtype))
                a2a, ratio = f"{a2a_max / mib:.0f}", f"{max(plan.sent_bytes) / a2a_max:.2f}"
            else:
                a2a, ratio = f"n/a ({global_shape[4]} heads)", "n/a"
            lines.append(
                f"| {SHARDABLE_DIMS[shard_dim]} | {world} | {', '.join(map(str, sizes))} | {halo} | {a2a} "
                f"| {ratio} | {max(plan.padded_query_overhead):.0%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(traffic_table())
