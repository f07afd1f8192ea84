"""The benchmark's FlexAttention BlockMask equals create_block_mask's, and flex agrees."""

import pytest
import torch

import na3d
from na3d.tools import flex_baseline
from helpers import make_qkv

flex_attention = pytest.importorskip("torch.nn.attention.flex_attention")


@pytest.mark.parametrize("shape,kernel,block", [
    ((3, 5, 7), (3, 3, 5), 16),
    ((4, 4, 20), (3, 3, 7), 32),
    ((2, 9, 5), (1, 5, 5), 16),     # W smaller than a block: many runs per block
    ((5, 3, 3), (5, 3, 3), 16),     # kernel = grid: every pair visible
    ((3, 4, 10), (1, 1, 1), 16),
])
def test_block_mask_equals_create_block_mask(shape, kernel, block):
    n = shape[0] * shape[1] * shape[2]
    mask_mod = flex_baseline.neighborhood_mask_mod(shape, kernel)
    want = flex_attention.create_block_mask(mask_mod, None, None, n, n, device="cpu", BLOCK_SIZE=block)
    got = flex_baseline.neighborhood_block_mask(shape, kernel, block, device="cpu", q_chunk=3)

    def dense(bm, name):
        num, idx = getattr(bm, f"{name}_num_blocks")[0, 0], getattr(bm, f"{name}_indices")[0, 0]
        out = torch.zeros(idx.shape, dtype=torch.bool)
        for r in range(out.shape[0]):
            out[r, idx[r, :int(num[r])]] = True
        return out

    assert torch.equal(got.to_dense(), want.to_dense()), "different blocks visited"
    full_got, full_want = dense(got, "full_kv"), dense(want, "full_kv")
    if n % block == 0:
        assert torch.equal(full_got, full_want)
        assert torch.equal(dense(got, "kv"), dense(want, "kv"))
    else:  # blocks cut by the grid's end are only ever partial here
        assert not (full_got & ~full_want).any()
        cut = n // block
        keep = torch.ones_like(full_got)
        keep[cut, :] = False
        keep[:, cut] = False
        assert torch.equal(full_got & keep, full_want & keep)


def test_flex_attention_with_block_mask_is_exact():
    shape, kernel = (1, 3, 4, 6, 2, 16), (3, 3, 5)
    q, k, v = make_qkv(shape, torch.float32, seed=8)
    bm = flex_baseline.neighborhood_block_mask(shape[1:4], kernel, 16, device="cpu")
    out = flex_baseline.flex_na3d(*(flex_baseline.to_flex_layout(t) for t in (q, k, v)), bm, scale=0.25)
    out = flex_baseline.from_flex_layout(out, shape)
    want = na3d.na3d_brute_force(q, k, v, kernel, scale=0.25)
    torch.testing.assert_close(out.double(), want.double(), rtol=1e-5, atol=1e-5)
