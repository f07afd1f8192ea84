"""Traffic accounting: the bytes each method moves, against hand and brute-force counts."""

import doctest

import pytest
import torch

from na3d import distributed as nadist
from na3d.distributed import traffic
from ranks import expected_sent_elements

LTX = nadist.LTX_STAGE5_SHAPE


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
            forward, backward = expected_sent_elements(rank, shape, kernel_size, shard_dim, plan.slab_sizes)
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
    # The backward's reverse all-to-alls: each rank sends what it received (dO of its
    # slab out, then dQ, dK, dV of its heads at the other slab's positions).
    back = nadist.head_parallel_bytes(shape, (3, 5), shard_dim=1, dtype=torch.float32, backward=True)
    assert back == ((3 + 3 * 5) * per_position_one_head, (5 + 3 * 3) * per_position_one_head)
    assert sum(back) == sum(sent)
    even = nadist.head_parallel_bytes(shape, (4, 4), shard_dim=1)
    assert nadist.head_parallel_bytes(shape, (4, 4), shard_dim=1, backward=True) == even


def test_traffic_table_has_every_split():
    table = nadist.traffic_table()
    assert table.count("\n") == 1 + 6
    assert "n/a (4 heads)" in table


def test_docstring_examples():
    assert doctest.testmod(traffic).failed == 0
