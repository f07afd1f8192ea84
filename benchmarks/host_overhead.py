"""Host overhead per call on a small shape (edge-wide, bf16), on a CUDA GPU:
the public API, the torch.library operators and the launchers, forward and
backward, timed with the benchmark's Timer and as host time per call in a loop;
then again after a FlexAttention compile in the same process, with a profile.

    python benchmarks/host_overhead.py [--fresh-only]
"""
import cProfile, io, os, pstats, sys, time
sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "src")]
import torch
import na3d
from na3d import launch
from na3d.tools.common import Timer

dev = torch.device("cuda")
timer = Timer(dev)
shape, ks = (1, 4, 8, 128, 8, 64), (3, 5, 27)
scale = 64 ** -0.5
g = torch.Generator(device=dev).manual_seed(0)
q, k, v, do = (torch.randn(shape, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(4))
leaves = [x.clone().requires_grad_() for x in (q, k, v)]
out = na3d.na3d(*leaves, ks, scale=scale)
o, lse = launch.na3d_forward(q, k, v, ks, scale, return_lse=True)

def host_us(fn, n=300):
    fn(); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6

cases = {
    "fwd api": lambda: na3d.na3d(q, k, v, ks, scale=scale),
    "fwd launch": lambda: launch.na3d_forward(q, k, v, ks, scale),
    "fwd op": lambda: torch.ops.na3d.forward(q, k, v, list(ks), scale, False, [False] * 3, [1] * 3, [1] * 3),
    "bwd autograd": lambda: torch.autograd.grad(out, leaves, do, retain_graph=True),
    "bwd op": lambda: torch.ops.na3d.backward(do, q, k, v, o, lse, None, list(ks), scale, [False] * 3, [1] * 3, [1] * 3),
    "bwd launch": lambda: launch.na3d_backward(do, q, k, v, o, lse, ks, scale),
}

def report(tag):
    for name, fn in cases.items():
        print(f"{tag:12} {name:14} gpu-timer {timer(fn, min_runs=50) * 1e3:8.1f} us   host {host_us(fn):8.1f} us", flush=True)

report("fresh")
if "--fresh-only" in sys.argv:
    sys.exit(0)
from torch.nn.attention.flex_attention import flex_attention
from na3d.tools.flex_baseline import neighborhood_block_mask, to_flex_layout
torch._dynamo.reset()
bm = neighborhood_block_mask(shape[1:4], ks, 128, device=dev)
fq, fk, fv = (to_flex_layout(x) for x in (q, k, v))
fl = torch.compile(flex_attention, dynamic=False)
fl(fq, fk, fv, block_mask=bm, scale=scale)
torch.cuda.synchronize()
report("after-flex")
import threading
print("threads:", [t.name for t in threading.enumerate()])
for name in ("fwd api", "bwd autograd"):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(300):
        cases[name]()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    print(f"=== profile {name} (300 calls)\n" + s.getvalue()[-4500:])
