"""The operators and the dispatch around them (``na3d.ops``).

``torch.library.opcheck`` on both operators; eager calls skip the operators (the
launcher for inference, ``EagerAttention`` for training) with the same values and
gradients; anything traced sees the operators. On a GPU: ``torch.compile``
(fullgraph, no recompiles across resolutions) and CUDA graph capture.
"""

import pytest
import torch

import na3d
from na3d import launch, ops
from helpers import make_qkv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not launch.kernels_interpreted(),
    reason="no GPU and the Triton interpreter is not active")


@pytest.mark.parametrize("return_lse", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_opcheck(return_lse):
    # (Without the logsumexp in the slow run: each opcheck runs the operator a dozen times.)
    q, k, v = make_qkv((1, 3, 6, 5, 1, 16), torch.float32, device=DEVICE, seed=2)
    torch.library.opcheck(ops.forward, (q.clone().requires_grad_(), k, v, [3, 3, 3], 0.25, return_lse,
                                         [False, True, False], [1, 2, 1], [1, 2, 1]))
    if return_lse:
        out, lse = ops.forward(q, k, v, [3, 3, 3], 0.25, True, [False, True, False], [1, 2, 1], [1, 2, 1])
        torch.library.opcheck(ops.backward, (torch.randn_like(out), q, k, v, out, lse, None, [3, 3, 3], 0.25,
                                             [False, True, False], [1, 2, 1], [1, 2, 1]))


def test_eager_calls_skip_the_operator(monkeypatch):
    """Inference calls launch the kernel directly and eager calls that need a
    gradient go through ops.EagerAttention: neither dispatches the operators (whose
    host cost exceeds small kernels). Same values, same gradients as the operator."""
    q, k, v = make_qkv((1, 3, 4, 5, 2, 16), torch.float32, device=DEVICE, seed=4)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    calls = []
    for name in ("forward", "backward"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *args, _real=real, _name=name: calls.append(_name) or _real(*args))
    plain = na3d.na3d(q, k, v, 3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with_grad = na3d.na3d(*leaves, 3)
    eager_grads = torch.autograd.grad(with_grad, leaves, grad_out)
    assert calls == []
    torch.testing.assert_close(plain, with_grad.detach(), rtol=0, atol=0)

    op_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    op_out, _ = ops.forward(*op_leaves, [3, 3, 3], 16 ** -0.5, True, [False] * 3, [1] * 3, [1] * 3)
    op_grads = torch.autograd.grad(op_out, op_leaves, grad_out)
    assert calls == ["forward", "backward"]
    torch.testing.assert_close(with_grad.detach(), op_out.detach(), rtol=0, atol=0)
    for got, want in zip(eager_grads, op_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_eager_path_refuses_traced_calls():
    """Anything traced must see the operator: fake tensors and dispatch modes are
    not eager; a double backward through the eager path raises (as through the
    operator) instead of silently contributing no second-order terms."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = make_qkv((1, 3, 4, 5, 2, 16), torch.float32, device=DEVICE, seed=4)
    assert ops.eager(q, k, v)
    with FakeTensorMode() as mode:
        fq = mode.from_tensor(q)
        assert not ops.eager(fq)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = na3d.na3d(*leaves, 3)
    dq, = torch.autograd.grad(out.sum(), leaves[:1], create_graph=True)
    assert dq.requires_grad
    with pytest.raises(RuntimeError, match="no autograd formula"):
        dq.sum().backward()


@pytest.mark.parametrize("features", [{}, {"dilation": (1, 2, 1), "is_causal": (True, False, False)}],
                         ids=["plain", "dilated-causal"])
def test_compiled_call_uses_the_operator(features, monkeypatch):
    """torch.compile (fullgraph, AOTAutograd) traces the operator, not the eager path,
    and its gradients equal the eager ones (dilation too: one operator call)."""
    q, k, v = make_qkv((1, 3, 6, 5, 2, 16), torch.float32, device=DEVICE, seed=6)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(na3d.na3d(*leaves, 3, **features), leaves, grad_out)
    used = []
    real = ops.EagerAttention.apply
    monkeypatch.setattr(ops.EagerAttention, "apply", lambda *a: used.append(1) or real(*a))
    torch._dynamo.reset()
    ops_called = []
    real_forward = ops.forward
    monkeypatch.setattr(ops, "forward", lambda *a: ops_called.append(1) or real_forward(*a))
    compiled = torch.compile(lambda a, b, c: na3d.na3d(a, b, c, 3, **features), backend="aot_eager", fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad(compiled(*leaves), leaves, grad_out)
    assert used == [] and len(ops_called) == 1
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


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


@pytest.mark.gpu
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


@pytest.mark.gpu
@pytest.mark.parametrize("dilation", [(1, 1, 1), (2, 2, 2)], ids=["plain", "dilated"])
def test_cuda_graph_capture_and_replay_forward_and_backward(dilation):
    shape, kernel = (1, 6, 16, 24, 4, 64), (3, 5, 5)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def step():
        out = na3d.na3d(q, k, v, kernel, dilation=dilation)
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
