"""The sm90 table's head-dim-128 buckets (the video-DiT regime), run as the table
states them, against the float64 oracle.

Their backward runs without register caps (``benchmarks/NOTES.md`` v20; its dK/dV boxes
and stages from the tuner, v41). Each configuration a bucket
states (its main one and its alternatives: the forward, the two-kernel backward and
the one-pass backward) runs here on a grid its boxes cut at every
border, with the windows shifted inward there. Interpreter on a machine without a
GPU (fp16), compiled on a GPU (bf16 and fp16).
"""

import dataclasses

import pytest
import torch

from na3d import configs, launch
from helpers import assert_grads_match_oracle, assert_matches_oracle, make_qkv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not launch.kernels_interpreted(),
    reason="no GPU and the Triton interpreter is not active")

# (grid, kernel) per bucket: the grid a little larger than the kernel (every query's
# window shifted at some border). The kernel (4x11x11, 484 keys) is below the
# bucket's range of 1000+, to keep the interpreter's run short; the tiles and code
# paths are the same (test_backward.py's DiT test runs a kernel of 1152 keys on the
# GPU).
CASES = {"dit_large_window": ((5, 12, 13), (4, 11, 11))}


def head_dim_128_options():
    """(bucket name, option name, option) of every head-dim-128 bucket in the sm90 table."""
    found = []
    for entry in configs.load_table("sm90")["forward"]:
        when = entry.get("when", {})
        if when.get("head_dim_min", 0) > 64 and when.get("head_dim_max") == 128:
            found += [(entry["bucket"], name, option) for name, option in configs.bucket_options(entry)]
    return found


OPTIONS = head_dim_128_options()
OPTIONS_BY_NAME = {name: option for _, name, option in OPTIONS}
DTYPES = [torch.bfloat16, torch.float16] if DEVICE == "cuda" else [torch.float16]


def test_table_has_head_dim_128_buckets():
    assert {bucket for bucket, _, _ in OPTIONS} == set(CASES)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bucket,name,option", [
    # In the interpreter a bucket's alternatives run in the slow run (a minute of CPU
    # between them); on a GPU every option runs.
    pytest.param(b, n, o, id=f"{b}-{n}", marks=pytest.mark.slow if DEVICE == "cpu" and n != b else ())
    for b, n, o in OPTIONS])
def test_head_dim_128_configs_match_oracle(bucket, name, option, dtype):
    grid, kernel = CASES[bucket]
    shape = (1, *grid, 1, 128)
    scale = 128 ** -0.5
    q, k, v = make_qkv(shape, dtype, device=DEVICE, seed=3)
    grad_out = make_qkv(shape, dtype, device=DEVICE, seed=4)[0]
    fwd = configs.ForwardConfig(tuple(option["q_tile"]), tuple(option["kv_tile"]), option["num_warps"],
                                option["num_stages"], name, option.get("tma", True), option.get("maxnreg"),
                                bool(option.get("fixed_mask", True)))
    out = torch.full_like(q, float("nan"))
    out, lse = launch.na3d_forward(q, k, v, kernel, scale, out=out, return_lse=True, config=fwd)
    assert_matches_oracle(out, q, k, v, kernel, scale)
    bwd = configs.fit_backward(option["backward"], grid, kernel, name)
    # The table's tiles as stated: the grid is large enough that fitting keeps them.
    assert (bwd.dq_q_tile, bwd.dq_kv_tile) == tuple(map(tuple, option["backward"]["dq"]))
    assert (bwd.dkdv_k_tile, bwd.dkdv_q_tile) == tuple(map(tuple, option["backward"]["dkdv"]))
    variants = {bwd, dataclasses.replace(bwd, fused=not bwd.fused)}
    if DEVICE == "cuda":  # the entry's other dK/dV pairs (on the CPU: test_backward's TABLE_PAIRS, slow run)
        variants |= {dataclasses.replace(bwd, dkdv_k_tile=tuple(k_box), dkdv_q_tile=tuple(q_box))
                     for k_box, q_box in option["backward"].get("dkdv_alternatives", ())}
        variants |= {dataclasses.replace(bwd, dq_q_tile=tuple(q_box), dq_kv_tile=tuple(k_box))
                     for q_box, k_box in option["backward"].get("dq_alternatives", ())}
    for variant in variants:
        grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
        launch.na3d_backward(grad_out, q, k, v, out, lse, kernel, scale, grads=grads, config=variant)
        assert_grads_match_oracle(grads, q, k, v, grad_out, kernel, scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kernel", [(3, 5, 5), (3, 7, 7)], ids=str)
def test_short_windows_at_head_dim_128_take_a_later_buckets_backward(kernel, dtype):
    # sm90's short and small windows keep their boxes for head dims up to 64; at 128
    # the call runs the small window's forward and the medium window's backward (the
    # small window's backward entry holds only up to 64: NOTES v45), a mix no other
    # test runs. As the table chooses it, on a grid its boxes cut at every border.
    grid = (4, 9, 10)
    fwd = configs.forward_config("sm90", grid, kernel, 128, dtype)
    bwd = configs.backward_config("sm90", grid, kernel, 128, dtype)
    assert (fwd.bucket, bwd.bucket) == ("small_window", "medium_window")
    shape, scale = (1, *grid, 1, 128), 128 ** -0.5
    q, k, v = make_qkv(shape, dtype, device=DEVICE, seed=5)
    grad_out = make_qkv(shape, dtype, device=DEVICE, seed=6)[0]
    out, lse = launch.na3d_forward(q, k, v, kernel, scale, out=torch.full_like(q, float("nan")), return_lse=True,
                                   config=fwd)
    assert_matches_oracle(out, q, k, v, kernel, scale)
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    launch.na3d_backward(grad_out, q, k, v, out, lse, kernel, scale, grads=grads, config=bwd)
    assert_grads_match_oracle(grads, q, k, v, grad_out, kernel, scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_head_dim_128_mqa_backward_as_the_table_states_it(dtype):
    # MQA (four query heads on one key/value head) through the large window's backward as
    # the table states it, its dK/dV head split included (dkdv_head_split: each key box's
    # programs take a share of the query heads and their float32 partial sums add up after;
    # measured on an H100, NOTES v51).
    bucket = "dit_large_window"
    grid, kernel = CASES[bucket]
    option = dict(OPTIONS_BY_NAME[bucket])
    bwd = configs.fit_backward(option["backward"], grid, kernel, bucket)
    assert bwd.dkdv_head_split == option["backward"].get("dkdv_head_split", 1) > 1
    shape, scale = (1, *grid, 4, 128), 128 ** -0.5
    q, k, v = make_qkv(shape, dtype, device=DEVICE, seed=7)
    k, v = k[..., :1, :], v[..., :1, :]
    grad_out = make_qkv(shape, dtype, device=DEVICE, seed=8)[0]
    out, lse = launch.na3d_forward(q, k, v, kernel, scale, out=torch.full_like(q, float("nan")), return_lse=True,
                                   config=configs.forward_config("sm90", grid, kernel, 128, dtype))
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    launch.na3d_backward(grad_out, q, k, v, out, lse, kernel, scale, grads=grads, config=bwd)
    assert_grads_match_oracle(grads, q, k, v, grad_out, kernel, scale, forward=(out, lse))
