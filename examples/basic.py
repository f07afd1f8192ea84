"""na3d in a few calls: the NATTEN-style API, per-axis options, log-sum-exps, fused projections.

    python examples/basic.py                  # CPU: the exact PyTorch reference
    python examples/basic.py --device cuda    # GPU: the Triton kernels (bfloat16)

Each result is checked against na3d's dense float64 oracle (``na3d_brute_force``).
"""

import argparse

import torch

import na3d


def check(name: str, got: torch.Tensor, q, k, v, kernel_size, **options) -> None:
    """Print the largest difference to the float64 dense oracle (on the CPU)."""
    want = na3d.na3d_brute_force(q.cpu(), k.cpu(), v.cpu(), kernel_size, **options)
    err = (got.detach().cpu().double() - want).abs().max().item()
    print(f"{name:<48} out {tuple(got.shape)}  max abs error vs float64 oracle {err:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)

    # (batch, frames, height, width, heads, head dim): heads last, as a Linear layer makes them.
    shape = (1, 6, 10, 12, 4, 32)
    q, k, v = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(3))

    # A 3 x 5 x 5 window per query (T, H, W order), shifted inward at the borders; scale HD ** -0.5.
    out = na3d.na3d(q, k, v, kernel_size=(3, 5, 5))
    check("na3d(q, k, v, (3, 5, 5))", out, q, k, v, (3, 5, 5))

    # Per-axis options: causal in time, dilated in width, a stride in height.
    options = dict(is_causal=(True, False, False), dilation=(1, 1, 2), stride=(1, 2, 1))
    out = na3d.na3d(q, k, v, (3, 5, 5), **options)
    check("causal T, dilation 2 along W, stride 2 along H", out, q, k, v, (3, 5, 5), **options)

    # Grouped-query attention: key/value with fewer heads (a divisor of the query's).
    k2, v2 = k[..., :2, :], v[..., :2, :]
    out = na3d.na3d(q, k2, v2, (3, 5, 5))
    check("4 query heads over 2 key/value heads", out, q, k2, v2, (3, 5, 5))

    # The log-sum-exp, and extra tokens every query also attends to (text, registers).
    out, lse = na3d.na3d(q, k, v, (3, 5, 5), return_lse=True)
    print(f"{'return_lse=True':<48} lse {tuple(lse.shape)} {lse.dtype}")
    extra_k, extra_v = (torch.randn(1, 7, 4, 32, generator=gen).to(device, dtype) for _ in range(2))
    out = na3d.na3d(q, k, v, (3, 5, 5), additional_keys=extra_k, additional_values=extra_v)
    print(f"{'additional_keys / additional_values':<48} out {tuple(out.shape)}")

    # A fused QKV projection: strided views go in as they are, no copies.
    proj = torch.nn.Linear(128, 3 * 128, device=device, dtype=dtype)
    x = torch.randn(1, 6, 10, 12, 128, generator=gen).to(device, dtype)
    with torch.no_grad():
        q, k, v = (t.unflatten(-1, (4, 32)) for t in proj(x).chunk(3, dim=-1))
        out = na3d.na3d(q, k, v, (3, 5, 5))
    check("views of a fused QKV projection", out, q, k, v, (3, 5, 5))

    # 1D and 2D neighborhoods run on the same kernels.
    seq = torch.randn(2, 50, 4, 32, generator=gen).to(device, dtype)
    out = na3d.na1d(seq, seq, seq, kernel_size=7)
    print(f"{'na1d on (B, L, NH, HD)':<48} out {tuple(out.shape)}")


if __name__ == "__main__":
    main()
