"""FlexAttention baseline: PyTorch's ``flex_attention`` with a neighborhood BlockMask.

What people use for neighborhood attention today, and what the benchmark compares
against. Tokens are flattened row-major over (T, H, W), as the LTX-2.5 decoder's
flex processor does.

``create_block_mask`` evaluates the mask at every (query, key) pair, which for the
2.9M-token stage-5 shape is ~8.5e12 evaluations. This module builds the same
BlockMask from the geometry instead: a block of consecutive tokens is a few runs
along W, and whether a pair of runs has some (or only) visible pairs follows from
the window bounds. ``tests/tools/test_flex_baseline.py`` checks it equals
``create_block_mask`` on small shapes.
"""

from __future__ import annotations

import math
from typing import Sequence, Tuple

import torch

from .. import geometry


def _block_runs(shape: Tuple[int, int, int], block: int, device) -> Tuple[torch.Tensor, ...]:
    """Per block of ``block`` consecutive tokens: its runs (t, h, w_first, w_last, valid)."""
    T, H, W = shape
    n = T * H * W
    n_blocks = -(-n // block)
    runs = -(-block // W) + 1
    starts = torch.arange(n_blocks, device=device) * block
    ends = torch.clamp(starts + block, max=n) - 1
    row0 = starts // W
    r = torch.arange(runs, device=device)
    row = row0[:, None] + r[None, :]                      # (t, h) row index of each run
    first = torch.maximum(row * W, starts[:, None])
    last = torch.minimum(row * W + W - 1, ends[:, None])
    valid = first <= last
    row = torch.where(valid, row, row0[:, None])
    first = torch.where(valid, first, starts[:, None])
    last = torch.where(valid, last, starts[:, None])
    return row // H, row % H, first - row * W, last - row * W, valid


def neighborhood_block_mask(
    shape: Sequence[int],
    kernel_size: Sequence[int],
    block_size: int = 128,
    device="cuda",
    q_chunk: int = 1024,
):
    """``BlockMask`` of 3D neighborhood attention over a row-major flattened grid.

    Exact: a block is listed as partial iff some (query, key) pair in it is visible,
    and as full iff every pair is, the same classification ``create_block_mask``
    makes, at a cost linear in the number of block pairs that can touch.
    """
    from torch.nn.attention.flex_attention import BlockMask

    T, H, W = (int(x) for x in shape)
    KT, KH, KW = (int(x) for x in kernel_size)
    n = T * H * W
    n_blocks = -(-n // block_size)
    qt, qh, qwa, qwb, qv = _block_runs((T, H, W), block_size, device)
    st = geometry.window_start(qt, T, KT)
    sh = geometry.window_start(qh, H, KH)
    swa = geometry.window_start(qwa, W, KW)   # window start of the run's first query
    swb = geometry.window_start(qwb, W, KW)   # ... and of its last query
    kt, kh, kwa, kwb, kv = _block_runs((T, H, W), block_size, device)

    # Candidate key blocks per query block: between the first and the last key any
    # query of the block can see.
    lo = torch.where(qv, (st * H + sh) * W + swa, n).amin(1)
    hi = torch.where(qv, ((st + KT - 1) * H + sh + KH - 1) * W + swb + KW - 1, -1).amax(1)
    first_block = lo // block_size
    span = int((hi // block_size - first_block).max().item()) + 1

    partial = torch.zeros(n_blocks, n_blocks, dtype=torch.bool, device=device)
    full = torch.zeros(n_blocks, n_blocks, dtype=torch.bool, device=device)
    for c0 in range(0, n_blocks, q_chunk):
        qs = slice(c0, min(c0 + q_chunk, n_blocks))
        cand = (first_block[qs, None] + torch.arange(span, device=device)).clamp(max=n_blocks - 1)
        # Broadcast: [q block, candidate, q run, k run]
        Q = lambda x: x[qs][:, None, :, None]  # noqa: E731
        K = lambda x: x[cand][:, :, None, :]   # noqa: E731
        in_t = (K(kt) >= Q(st)) & (K(kt) < Q(st) + KT)
        in_h = (K(kh) >= Q(sh)) & (K(kh) < Q(sh) + KH)
        w_any = (K(kwa) < Q(swb) + KW) & (K(kwb) >= Q(swa))
        w_all = (K(kwa) >= Q(swb)) & (K(kwb) < Q(swa) + KW)
        pair_valid = Q(qv) & K(kv)
        any_pair = (pair_valid & in_t & in_h & w_any).flatten(2).any(2)
        all_pairs = (~pair_valid | (in_t & in_h & w_all)).flatten(2).all(2)
        # The last block may be cut short by the end of the grid; it is never listed
        # as full (flex would evaluate its padding), only as partial.
        all_pairs &= ~(cand == n_blocks - 1) | (n % block_size == 0)
        if qs.stop == n_blocks and n % block_size:
            all_pairs[-1] = False
        rows = torch.arange(qs.start, qs.stop, device=device)[:, None].expand_as(cand)
        partial[rows, cand] |= any_pair & ~all_pairs
        full[rows, cand] |= all_pairs
    return BlockMask.from_kv_blocks(
        *_to_indices(partial), *_to_indices(full),
        BLOCK_SIZE=block_size, mask_mod=neighborhood_mask_mod((T, H, W), (KT, KH, KW)),
        seq_lengths=(n, n))


def _to_indices(dense: torch.Tensor):
    num = dense.sum(1, dtype=torch.int32)
    order = torch.argsort((~dense).to(torch.int8), dim=1, stable=True).to(torch.int32)
    return num[None, None], order[None, None]


def neighborhood_mask_mod(shape: Sequence[int], kernel_size: Sequence[int]):
    """FlexAttention ``mask_mod``: query and key token indices over the row-major grid."""
    T, H, W = shape
    KT, KH, KW = kernel_size

    def mask_mod(b, h, q_idx, kv_idx):
        q_t, q_h, q_w = q_idx // (H * W), (q_idx // W) % H, q_idx % W
        k_t, k_h, k_w = kv_idx // (H * W), (kv_idx // W) % H, kv_idx % W
        s_t = geometry.window_start(q_t, T, KT)
        s_h = geometry.window_start(q_h, H, KH)
        s_w = geometry.window_start(q_w, W, KW)
        return ((k_t >= s_t) & (k_t < s_t + KT) & (k_h >= s_h) & (k_h < s_h + KH)
                & (k_w >= s_w) & (k_w < s_w + KW))

    return mask_mod


def flex_na3d(q, k, v, block_mask, scale: float, flex_fn=None) -> torch.Tensor:
    """Neighborhood attention through ``flex_attention`` on ``(B, NH, N, HD)`` tensors."""
    if flex_fn is None:
        from torch.nn.attention.flex_attention import flex_attention as flex_fn
    return flex_fn(q, k, v, block_mask=block_mask, scale=scale)


def to_flex_layout(x: torch.Tensor) -> torch.Tensor:
    """``(B, T, H, W, NH, HD)`` -> contiguous ``(B, NH, T*H*W, HD)``."""
    B, T, H, W, NH, HD = x.shape
    return x.reshape(B, T * H * W, NH, HD).transpose(1, 2).contiguous()


def from_flex_layout(x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    B, T, H, W, NH, HD = shape
    return x.transpose(1, 2).reshape(B, T, H, W, NH, x.shape[-1])


def block_mask_bytes(n_tokens: int, block_size: int = 128) -> int:
    """Bytes of the dense (partial + full) block index tables the BlockMask holds."""
    nb = math.ceil(n_tokens / block_size)
    return 2 * nb * nb * 4
