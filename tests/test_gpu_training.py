"""GPU: gradients on the benchmark shapes, torch.compile, CUDA graphs.

Skipped without a CUDA/ROCm device.
"""

import pytest
import torch

import na3d
from na3d.tools.common import bench_shapes
from helpers import make_qkv

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def reference_grads(q, k, v, grad_out, kernel, scale, dtype, chunks=8):
    """Autograd through the grouped-SDPA reference at ``dtype``, W chunk by W chunk
    (``w_offset``), so the saved tensors of only one chunk are alive at a time."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    W = q.shape[3]
    step = max(1, -(-W // chunks))
    for w0 in range(0, W, step):
        w1 = min(W, w0 + step)
        out = na3d.na3d_sdpa_exact(leaves[0][:, :, :, w0:w1], leaves[1], leaves[2], kernel, scale=scale,
                                   w_offset=w0)
        out.backward(grad_out[:, :, :, w0:w1].to(dtype))
    return [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("spec", bench_shapes(), ids=lambda s: s["name"])
def test_gradients_on_benchmark_shapes(spec, dtype):
    shape, kernel = tuple(spec["shape"]), tuple(spec["kernel_size"])
    scale = shape[-1] ** -0.5
    q, k, v = make_qkv(shape, dtype, device="cuda", seed=2)
    grad_out = torch.randn(shape, dtype=dtype, device="cuda")
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    na3d.na3d(*leaves, kernel).backward(grad_out)
    oracle = reference_grads(q, k, v, grad_out, kernel, scale, torch.float32)
    same_math = reference_grads(q, k, v, grad_out, kernel, scale, dtype)
    for name, leaf, want, pt in zip(("dq", "dk", "dv"), leaves, oracle, same_math):
        err = (leaf.grad.float() - want).abs().max().item()
        tol = 2 * (pt.float() - want).abs().max().item() + 2 * torch.finfo(dtype).eps * max(
            1.0, want.abs().max().item())
        assert err <= tol, f"{name}: max abs error {err:.3e} > tolerance {tol:.3e}"


class Block(torch.nn.Module):
    """A neighborhood-attention block as a video model has it: fused QKV, na3d, output."""

    def __init__(self, channels=128, heads=2, kernel=(3, 3, 3)):
        super().__init__()
        self.qkv = torch.nn.Linear(channels, 3 * channels)
        self.out = torch.nn.Linear(channels, channels)
        self.heads, self.kernel = heads, kernel

    def forward(self, x):
        B, T, H, W, C = x.shape
        q, k, v = (t.unflatten(-1, (self.heads, C // self.heads)) for t in self.qkv(x).chunk(3, dim=-1))
        return x + self.out(na3d.na3d(q, k, v, self.kernel).flatten(-2))


def test_compile_fullgraph_no_recompiles_across_resolutions():
    torch._dynamo.reset()
    block = Block().cuda().to(torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for T, H, W in [(4, 6, 8), (5, 7, 9), (3, 9, 12), (6, 5, 17)]:
            x = torch.randn(2, T, H, W, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            y = compiled(x)
            y.float().square().mean().backward()
            x2 = x.detach().clone().requires_grad_()
            y2 = block(x2)
            y2.float().square().mean().backward()
            torch.testing.assert_close(y, y2, rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(x.grad, x2.grad, rtol=2e-2, atol=2e-2)


def test_cuda_graph_capture_and_replay_forward_and_backward():
    shape, kernel = (1, 6, 16, 24, 4, 64), (3, 5, 5)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def step():
        out = na3d.na3d(q, k, v, kernel)
        return (out,) + torch.autograd.grad(out, (q, k, v), grad_out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: compile the kernels, fill the allocator
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        with torch.no_grad():
            for t in (q, k, v, grad_out):
                t.copy_(torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        eager = step()
        for a, b in zip(static, eager):
            assert torch.equal(a, b)
