"""Context parallelism by halo exchange: :func:`sharded_na3d` and :func:`halo_exchange`.

Each rank receives, by point-to-point messages, the keys and values its queries need
from the other ranks' slabs (the "halo", :mod:`na3d.distributed.plan`), then attends
locally. Traffic per rank depends on the kernel, not on the slab: K and V of
``K // 2`` positions to each neighbor (more ranks are involved only when slabs are
thinner than the halo).

Differentiable: the exchange is a pair of ``torch.autograd.Function``
(:class:`_StartHaloExchange`, :class:`_FinishHaloExchange`); in backward the
gradients of the halo (dK, dV at positions other ranks own) travel back to their
owners and are summed there, while dQ never leaves its rank.
"""

import math
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..api import na3d
from .layout import SlabLayout, slab_layout
from .plan import halo_exchange_plan, keys_needed, queries_within


def _global_rank(group, group_rank: int) -> int:
    """P2P peers are named by global rank; the plan speaks group ranks."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def _stages_through_host(group, device: torch.device) -> bool:
    """True when ``group`` carries ``device``'s tensors with gloo and they are not CPU tensors.

    Gloo's collectives take CUDA tensors (they copy through host memory themselves),
    but its point-to-point ``send``/``recv`` hand the tensor's pointer to the TCP
    transport as host memory: device tensors must be copied to the host first.
    """
    if device.type == "cpu":
        return False
    for part in str(dist.get_backend(group)).lower().split(","):
        kind, _, backend = part.strip().rpartition(":")   # "gloo" or "cuda:gloo"
        if backend == "gloo" and kind in ("", device.type):
            return True
    return False


class _HostStaging:
    """Point-to-point messages of device tensors through host copies (gloo with CUDA tensors).

    ``sends`` and ``receives`` are replaced by host tensors; the object returned by
    :meth:`after` is waited on like the messages' works, and copies each received host
    tensor into its device tensor once every message has completed. Only for backends
    that cannot send device memory (:func:`_stages_through_host`); NCCL sends directly.
    """

    def __init__(self, sends, receives):
        self.sends = [(peer, t.to("cpu")) for peer, t in sends]
        self.targets = [t for _, t in receives]
        self.receives = [(peer, torch.empty(t.shape, dtype=t.dtype)) for peer, t in receives]
        self.works: List = []

    def after(self, works) -> "_HostStaging":
        self.works = list(works)
        return self

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        for target, (_, host) in zip(self.targets, self.receives):
            target.copy_(host)
        self.works, self.targets, self.sends, self.receives = [], [], [], []


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
        plan = halo_exchange_plan(layout.slab_sizes, layout.kernel)
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
        """Post the messages; returns what to ``wait()`` on (receives are complete after it)."""
        staged = None
        if (sends or receives) and _stages_through_host(self.group, self.device):
            staged = _HostStaging(sends, receives)
            sends, receives = staged.sends, staged.receives
        ops = [dist.P2POp(dist.isend, t, _global_rank(self.group, peer), self.group) for peer, t in sends]
        ops += [dist.P2POp(dist.irecv, t, _global_rank(self.group, peer), self.group) for peer, t in receives]
        works = dist.batch_isend_irecv(ops) if ops else []
        if staged is not None:
            return [staged.after(works)]
        return works

    def _empty(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=self.dtype, device=self.device)

    def _pack_rows(self, pieces, key: torch.Tensor, value: torch.Tensor, origin: int) -> torch.Tensor:
        """A flat buffer laid out like ``pieces``, holding the K and V rows of each
        piece's positions; ``origin`` is the global position of ``key``'s first row."""
        flat = self._empty(self._total(pieces))
        for piece in pieces:
            _, start, stop, _, _ = piece
            packed = self._view(flat, piece)
            packed[0].copy_(key.narrow(self.dim, start - origin, stop - start))
            packed[1].copy_(value.narrow(self.dim, start - origin, stop - start))
        return flat

    # -- forward ------------------------------------------------------------------

    def start(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Post every send and receive; return the (still filling) receive buffer."""
        send = self._pack_rows(self.outgoing, key, value, self.layout.slab[0])
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
        grad_received = self._pack_rows(self.incoming, grad_key_ext, grad_value_ext, u0)
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


def halo_exchange(key: torch.Tensor, value: torch.Tensor, kernel_size: Union[int, Sequence[int]], *,
                  group: Optional[dist.ProcessGroup] = None, shard_dim: int = 1,
                  slab_sizes: Optional[Sequence[int]] = None) -> Tuple[torch.Tensor, torch.Tensor, Tuple[int, int]]:
    """K and V over this rank's key range, gathered from the ranks that own them.

    The communication half of :func:`sharded_na3d`, on its own. Collective: every
    rank of ``group`` calls it with matching arguments.

    Args:
        key: this rank's slab ``(B, n_rank, H, W, NKV, HD)`` (for ``shard_dim=1``;
            likewise along H or W) of the global key tensor, slabs contiguous and
            in rank order.
        value: key's shape, dtype and device.
        kernel_size: int or ``(KT, KH, KW)``, ``1 <= K <= global size`` per axis.
        group: the process group (default: the world).
        shard_dim: 1 (T), 2 (H) or 3 (W).
        slab_sizes: every rank's slab size along ``shard_dim``; learned with one small
            ``all_gather`` when None.

    Returns:
        ``(key_ext, value_ext, (u0, u1))``: K and V at the global positions
        ``[u0, u1)`` along ``shard_dim`` that this rank's queries need
        (:func:`na3d.distributed.plan.keys_needed`). Differentiable: the gradients
        of the halo positions go back to their owners.

    Raises:
        TypeError, ValueError: on every rank, if any rank's arguments are wrong.
        RuntimeError: ``torch.distributed`` is not initialized.
    """
    group, layout = slab_layout({"key": key, "value": value}, kernel_size, shard_dim, group, slab_sizes)
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
    (:func:`na3d.distributed.plan.keys_needed` says why).

    Wasted work: :func:`na3d.na3d` needs ``query.shape == key.shape``, so the queries
    are padded with zero rows up to the key range, and the kernel computes those rows
    only for them to be dropped: ``(u1 - u0) / (stop - first) - 1`` extra work, about
    ``(K - 1) / slab`` away from the borders. A query-offset argument to na3d (queries
    ``[first, stop)`` against keys starting at ``u0``) removes the padding: this is the
    one function to change then.
    """
    dim, a = layout.shard_dim, layout.slab[0]
    u0, u1 = keys_needed(first, stop, layout.length, layout.kernel)
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


def sharded_na3d(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 kernel_size: Union[int, Sequence[int]], *, group: Optional[dist.ProcessGroup] = None,
                 shard_dim: int = 1, slab_sizes: Optional[Sequence[int]] = None, overlap: bool = False,
                 **na3d_kwargs) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """This rank's slab of ``na3d(Q, K, V, kernel_size)`` for tensors sharded over ``group``.

    Each rank receives exactly the K/V positions its queries need that other ranks
    own (:func:`na3d.distributed.plan.halo_exchange_plan`) and sends exactly the
    parts of its own slab the others need, with one ``batch_isend_irecv``; then it
    attends locally. Collective, forward and backward: every rank of ``group`` calls
    it with matching arguments and runs backward through the result.

    Args:
        query: this rank's slab ``(B, n_rank, H, W, NH, HD)`` (for ``shard_dim=1``;
            likewise along H or W) of the global query, slabs contiguous and in rank
            order, any sizes ``>= 1``. Dtypes, head dims and strides as
            :func:`na3d.na3d`.
        key: the same slab of the global key, query's shape (equal head counts).
        value: the same slab of the global value, query's shape.
        kernel_size: int or ``(KT, KH, KW)``, ``1 <= K <= global size`` per axis.
        group: the process group (default: the world). NCCL with CUDA tensors (one
            device per rank, ``torch.cuda.set_device`` called), gloo with CPU ones
            (or CUDA ones, messages staged through host memory: slow, for checks).
        shard_dim: the sharded axis, 1 (T), 2 (H) or 3 (W).
        slab_sizes: every rank's slab size along ``shard_dim``, in rank order; when
            None they are learned with one small ``all_gather``, which also checks the
            arguments agree across ranks.
        overlap: compute the queries whose windows lie in the own slab
            (:func:`na3d.distributed.plan.queries_within`) while the halo is in
            flight, then the two border strips. Off by default: with today's
            zero-padded queries (see :func:`_attend_rows`) that costs three padded
            calls instead of one, more than the transfer it hides on NVLink for video
            shapes (``docs/distributed.md``). Backward does not overlap.
        **na3d_kwargs: ``scale`` and ``return_lse`` go to :func:`na3d.na3d`;
            ``stride``, ``dilation`` and ``is_causal`` only at their defaults.

    Returns:
        What :func:`na3d.na3d` returns, for this rank's slab: ``out`` of query's
        shape, or ``(out, lse)``. Differentiable: the halo's gradients travel back to
        the ranks that own it and are summed there.

    Raises:
        TypeError, ValueError: on every rank, if any rank's arguments are wrong (a
            rank that rejects its own arguments tells the others, so none waits in a
            collective).
        NotImplementedError: ``stride``, ``dilation`` or ``is_causal`` other than
            their defaults.
        RuntimeError: ``torch.distributed`` is not initialized.

    Non-finite inputs: as :func:`na3d.na3d`.

    Example (``examples/context_parallel.py``; under ``torchrun --nproc-per-node 2``)::

        dist.init_process_group("gloo")                       # "nccl" for CUDA tensors
        rank, world = dist.get_rank(), dist.get_world_size()
        sizes = na3d.distributed.even_slab_sizes(q.shape[1], world)
        start = sum(sizes[:rank])
        local = [t[:, start:start + sizes[rank]] for t in (q, k, v)]   # this rank's frames
        out = sharded_na3d(*local, (3, 5, 5), shard_dim=1)   # == na3d(q, k, v, (3, 5, 5))[:, start:...]
    """
    group, layout = slab_layout({"query": query, "key": key, "value": value}, kernel_size, shard_dim, group,
                                slab_sizes, na3d_kwargs, overlap)
    dim = layout.shard_dim
    a, b = layout.slab
    u0, _ = layout.key_range
    exchange = _HaloExchange(layout, group, key)
    received = _StartHaloExchange.apply(exchange, key, value)

    interior = (a, a)
    if overlap:
        interior = queries_within(a, b, layout.length, layout.kernel)
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
