"""Halo geometry for context parallelism: key ranges of query slabs and the exchange plan.

Everything is checked against brute force over the 1-D neighborhood mask, and the
fact the distributed code rests on (attention on the sub-axis of needed keys gives
each query its global window) against the exact reference.
"""

import doctest
import itertools

import pytest
import torch

import na3d
from na3d import geometry
from na3d.distributed import plan as halo_geometry

AXES = [(L, K) for L in (1, 2, 3, 5, 8, 13) for K in range(1, L + 1, 2)] + [(9, 4), (10, 6)]


def _slab_partitions(length, max_parts=4):
    """Every cut of ``range(length)`` into at most ``max_parts`` contiguous non-empty slabs."""
    for parts in range(1, min(length, max_parts) + 1):
        for cuts in itertools.combinations(range(1, length), parts - 1):
            edges = (0, *cuts, length)
            yield tuple(b - a for a, b in zip(edges[:-1], edges[1:]))


@pytest.mark.parametrize("length,kernel", AXES)
def test_keys_needed_is_the_union_of_the_windows(length, kernel):
    mask = geometry.mask_1d(length, kernel)
    for first in range(length):
        for stop in range(first + 1, length + 1):
            seen = mask[first:stop].any(0).nonzero().flatten().tolist()
            u0, u1 = halo_geometry.keys_needed(first, stop, length, kernel)
            assert seen == list(range(u0, u1))
            assert u0 <= first and stop <= u1 and u1 - u0 >= kernel


@pytest.mark.parametrize("length,kernel", AXES)
def test_sub_axis_windows_equal_the_global_ones(length, kernel):
    """Clamping windows to the sub-axis ``keys_needed(first, stop)`` changes nothing for those queries."""
    for first in range(length):
        for stop in range(first + 1, length + 1):
            u0, u1 = halo_geometry.keys_needed(first, stop, length, kernel)
            for i in range(first, stop):
                local = geometry.window_start(i - u0, u1 - u0, kernel) + u0
                assert local == geometry.window_start(i, length, kernel), (first, stop, i)


@pytest.mark.parametrize("axis", [1, 2, 3])
def test_attention_on_the_sub_grid_gives_the_global_rows(axis):
    """The same fact through attention itself: padded queries on the key sub-grid, rows sliced."""
    shape = [1, 6, 5, 7, 2, 8]
    shape[axis] = 9
    kernel_size = [3, 3, 5]
    kernel_size[axis - 1] = 5
    g = torch.Generator().manual_seed(axis)
    q, k, v = (torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(3))
    full = na3d.na3d_brute_force(q, k, v, kernel_size)
    for first, stop in [(0, 1), (0, 3), (2, 3), (3, 7), (7, 9), (8, 9), (1, 8)]:
        u0, u1 = halo_geometry.keys_needed(first, stop, 9, 5)
        padded = torch.zeros_like(q.narrow(axis, u0, u1 - u0))
        padded.narrow(axis, first - u0, stop - first).copy_(q.narrow(axis, first, stop - first))
        sub = na3d.na3d_brute_force(padded, k.narrow(axis, u0, u1 - u0), v.narrow(axis, u0, u1 - u0),
                                    kernel_size)
        got = sub.narrow(axis, first - u0, stop - first)
        assert torch.allclose(got, full.narrow(axis, first, stop - first), atol=1e-12, rtol=0)


@pytest.mark.parametrize("length,kernel", AXES)
def test_queries_within_brute_force(length, kernel):
    for first in range(length):
        for stop in range(first + 1, length + 1):
            inside = [i for i in range(first, stop)
                      if first <= geometry.window_start(i, length, kernel)
                      and geometry.window_start(i, length, kernel) + kernel <= stop]
            lo, hi = halo_geometry.queries_within(first, stop, length, kernel)
            assert list(range(lo, hi)) == inside
            assert first <= lo <= hi <= stop


@pytest.mark.parametrize("length,kernel", [(L, K) for L, K in AXES if L >= 2])
def test_halo_exchange_plan_sends_exactly_what_is_needed(length, kernel):
    mask = geometry.mask_1d(length, kernel)
    for sizes in _slab_partitions(length):
        bounds = halo_geometry.slab_bounds(sizes)
        plan = halo_geometry.halo_exchange_plan(sizes, kernel)
        assert plan == sorted(plan, key=lambda t: (t.receiver, t.sender))
        for receiver, (a, b) in enumerate(bounds):
            incoming = [t for t in plan if t.receiver == receiver]
            for sender, (sa, sb) in enumerate(bounds):
                pieces = [t for t in incoming if t.sender == sender]
                needed = [j for j in range(sa, sb) if mask[a:b, j].any()]
                if sender == receiver or not needed:
                    assert pieces == []
                    continue
                # One piece per sender, exactly the needed positions of its slab.
                assert len(pieces) == 1
                assert list(range(pieces[0].start, pieces[0].stop)) == needed
            # Received pieces and the own slab tile the key range, in rank order.
            spans = sorted([(t.start, t.stop) for t in incoming] + [(a, b)])
            u0, u1 = halo_geometry.keys_needed(a, b, length, kernel)
            assert spans[0][0] == u0 and spans[-1][1] == u1
            assert all(x[1] == y[0] for x, y in zip(spans[:-1], spans[1:]))


def test_thin_slab_at_the_border_hears_from_several_ranks():
    """Inward shift: query 0 with K = 5 sees 4 positions to its right, owned by 4 ranks."""
    plan = halo_geometry.halo_exchange_plan([1, 1, 1, 1, 1, 1], 5)
    assert [t.sender for t in plan if t.receiver == 0] == [1, 2, 3, 4]
    assert [t.sender for t in plan if t.receiver == 5] == [1, 2, 3, 4]


def test_halo_geometry_rejects_bad_input():
    with pytest.raises(ValueError, match="first, stop"):
        halo_geometry.keys_needed(3, 3, 8, 3)
    with pytest.raises(ValueError, match="first, stop"):
        halo_geometry.keys_needed(0, 9, 8, 3)
    with pytest.raises(ValueError, match="kernel_size"):
        halo_geometry.keys_needed(0, 2, 4, 5)
    with pytest.raises(ValueError, match="kernel_size"):
        halo_geometry.queries_within(0, 2, 4, 0)
    with pytest.raises(ValueError, match=r"slab_sizes\[1\]"):
        halo_geometry.slab_bounds([2, 0, 3])
    with pytest.raises(ValueError, match="slab_sizes"):
        halo_geometry.halo_exchange_plan([], 3)
    with pytest.raises(ValueError, match="kernel_size"):
        halo_geometry.halo_exchange_plan([1, 2], 5)


def test_docstring_examples():
    assert doctest.testmod(halo_geometry).failed == 0
