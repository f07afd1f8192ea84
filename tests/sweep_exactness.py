"""An exactness sweep past the tests' seeds: ``na3d.na3d`` as a user calls it (the
table's configurations) on random feature combinations, forward, lse and the three
gradients against the float64 oracle, with the tests' derived tolerances.

Not a test file (pytest does not collect it): a tool for long runs on a CPU (the Triton
interpreter) or a GPU::

    python tests/sweep_exactness.py FIRST_SEED COUNT [--big]

Each seed draws a head dim (8-64), fp32 or fp16, a layout (contiguous, fused QKV,
heads first), a scale (None, 0.3, -0.5) and the features: by default the tests'
``helpers.random_config`` (kernel 1-4, dilation 1-3, causal axes, strides, GQA/MQA,
B 1-2) on grids up to 12 per axis; with ``--big`` kernels 1-9 and dilation 1-2 on
grids up to 16 per axis (at most 1400 positions per batch element). One line per
seed; the exit status is the number of misses (at most 125).
"""

import argparse
import os
import random
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
__import__("conftest")  # the interpreter on a CPU, and its patches, as in the tests
import torch  # noqa: E402

import na3d  # noqa: E402
from helpers import (  # noqa: E402
    assert_grads_match_oracle, assert_lse_matches_oracle, assert_matches_oracle, make_qkv, random_config)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def big_config(rng):
    """Kernels 1-9, dilation 1-2, grids up to 16 per axis, at most 1400 positions."""
    dilation = [rng.choice([1, 1, 1, 2]) for _ in range(3)]
    kernel = [rng.randint(1, 9) for _ in range(3)]
    lengths = [rng.randint(k * d, max(k * d, 16)) for k, d in zip(kernel, dilation)]
    while lengths[0] * lengths[1] * lengths[2] > 1400:
        axis = max(range(3), key=lambda a: lengths[a] - kernel[a] * dilation[a])
        if lengths[axis] == kernel[axis] * dilation[axis]:
            break
        lengths[axis] -= 1
    causal = [rng.random() < 0.3 for _ in range(3)]
    stride = [rng.randint(1, k) if rng.random() < 0.4 else 1 for k in kernel]
    kv_heads = rng.choice([1, 2])
    shape = (rng.choice([1, 2]), *lengths, kv_heads * rng.choice([1, 2]), 16)
    return shape, kv_heads, tuple(kernel), tuple(dilation), tuple(causal), tuple(stride)


def check(seed, big):
    rng = random.Random(seed)
    if big:
        shape, kv_heads, kernel, dilation, causal, stride = big_config(rng)
    else:
        shape, kv_heads, kernel, dilation, causal, stride = random_config(seed, max_len=rng.choice([6, 9, 12]))
    head_dim = rng.choice([8, 16, 24, 32, 64])
    shape = shape[:5] + (head_dim,)
    dtype = rng.choice([torch.float32, torch.float16])
    layout = rng.choice(["contiguous", "fused_qkv", "heads_first"])
    scale = rng.choice([None, 0.3, -0.5])
    described = (f"seed {seed} {shape} kv{kv_heads} k{kernel} d{dilation} c{causal} s{stride} {dtype} {layout} "
                 f"scale {scale}")
    try:
        run(seed, shape, kv_heads, kernel, dilation, causal, stride, head_dim, dtype, layout, scale)
    except Exception as error:
        raise AssertionError(f"{described}: {error}") from error
    return described


def run(seed, shape, kv_heads, kernel, dilation, causal, stride, head_dim, dtype, layout, scale):
    q, k, v = make_qkv(shape, dtype, layout=layout, seed=seed, device=DEVICE)
    k, v = k[..., :kv_heads, :], v[..., :kv_heads, :]
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = na3d.na3d(*leaves, kernel, stride=stride, dilation=dilation, is_causal=causal, scale=scale,
                         return_lse=True)
    s = scale if scale is not None else head_dim ** -0.5
    qc, kc, vc = (t.cpu() for t in (q, k, v))
    assert_matches_oracle(out.detach().cpu(), qc, kc, vc, kernel, s, dilation, causal, stride)
    assert_lse_matches_oracle(lse.detach().cpu(), qc, kc, vc, kernel, s, dilation, causal, stride)
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=DEVICE)
    out.backward(grad_out)
    assert_grads_match_oracle([t.grad for t in leaves], qc, kc, vc, grad_out, kernel, s, dilation=dilation,
                              is_causal=causal, stride=stride, forward=(out.detach(), lse.detach()))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("first", type=int)
    parser.add_argument("count", type=int)
    parser.add_argument("--big", action="store_true")
    args = parser.parse_args()
    misses = 0
    for seed in range(args.first, args.first + args.count):
        start = time.time()
        try:
            line = check(seed, args.big) + ": ok"
        except Exception as error:  # noqa: BLE001 (a miss is reported, and the sweep goes on)
            misses += 1
            traceback.print_exc()
            line = f"MISS {error}"[:500]
        print(f"{line} ({time.time() - start:.1f}s)", flush=True)
    print(f"{args.count - misses} of {args.count} within tolerance", flush=True)
    sys.exit(min(misses, 125))


if __name__ == "__main__":
    main()
