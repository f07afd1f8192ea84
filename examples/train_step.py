"""Training with na3d: a small video attention block, a few optimizer steps, gradients checked.

    python examples/train_step.py                          # CPU: the exact PyTorch reference
    python examples/train_step.py --device cuda            # GPU: the Triton forward and backward
    python examples/train_step.py --device cuda --compile  # ... under torch.compile(fullgraph=True)

na3d is differentiable everywhere (the Triton backward kernels on a GPU, autograd
through the reference on a CPU) and is a ``torch.library`` op, so ``torch.compile``
traces it without a graph break.
"""

import argparse

import torch
from torch import nn

import na3d


class NeighborhoodAttentionBlock(nn.Module):
    """Pre-norm residual block: LayerNorm, fused QKV projection, na3d, output projection."""

    def __init__(self, dim: int, heads: int, kernel_size=(3, 5, 5), causal_time: bool = True):
        super().__init__()
        self.heads, self.kernel_size = heads, kernel_size
        self.is_causal = (causal_time, False, False)
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, H, W, C)
        q, k, v = (t.unflatten(-1, (self.heads, -1)) for t in self.qkv(self.norm(x)).chunk(3, dim=-1))
        y = na3d.na3d(q, k, v, self.kernel_size, is_causal=self.is_causal)
        return x + self.out(y.flatten(-2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="torch.compile the block (fullgraph)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.compile and device.type != "cuda":
        # On a CPU na3d runs its PyTorch reference (Python loops over boxes), which
        # torch.compile does not trace as one graph; the kernels' operator it does.
        parser.error("--compile needs --device cuda")
    torch.manual_seed(0)

    dim, heads = 64, 4
    block = NeighborhoodAttentionBlock(dim, heads).to(device)
    model = torch.compile(block, fullgraph=True) if args.compile else block
    optimizer = torch.optim.AdamW(block.parameters(), lr=3e-3)
    x = torch.randn(2, 5, 8, 8, dim, device=device)
    target = torch.randn_like(x)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    for step in range(args.steps):
        with autocast:
            loss = nn.functional.mse_loss(model(x).float(), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}")

    # na3d's gradients against those of its dense float64 oracle, on one attention call.
    shape = (1, 5, 8, 8, heads, dim // heads)
    leaves = [torch.randn(shape, device=device, requires_grad=True) for _ in range(3)]
    grad_out = torch.randn(shape, device=device)
    got = torch.autograd.grad(na3d.na3d(*leaves, (3, 5, 5)), leaves, grad_out)
    oracle_leaves = [t.detach().cpu().double().requires_grad_() for t in leaves]
    want = torch.autograd.grad(na3d.na3d_brute_force(*oracle_leaves, (3, 5, 5)), oracle_leaves,
                               grad_out.cpu().double())
    errors = [(g.cpu().double() - w).abs().max().item() for g, w in zip(got, want)]
    print("dq, dk, dv max abs error vs float64 oracle: " + ", ".join(f"{e:.1e}" for e in errors))


if __name__ == "__main__":
    main()
