"""Smoke test of an installed na3d (a wheel in a fresh environment), run from outside the source tree.

Checks that the package and its data files were installed (the config tables and the
benchmark shapes are package data), that the op runs and is right on the CPU, and that
the commands the README and docs/distributed.md name start.
"""

import os
import subprocess
import sys
from pathlib import Path

import torch

import na3d
from na3d import configs
from na3d.tools.common import bench_shapes

source_tree = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else None
installed = Path(na3d.__file__).resolve()
print(f"na3d {na3d.__version__} from {installed}")
assert "site-packages" in installed.parts, f"not an installed copy: {installed}"
assert source_tree is None or source_tree not in installed.parents, "imported from the source tree"

# Package data: the tables (a tuned one, and the default every other GPU uses) and the shapes.
assert configs.load_table("sm90")["forward"] and configs.load_table("default")["forward"]
cfg = configs.forward_config("sm90", (18, 32, 48), (3, 7, 7), 64, torch.bfloat16)
print(f"sm90 config for ltx-stage1: bucket {cfg.bucket}, q_tile {cfg.q_tile}, kv_tile {cfg.kv_tile}")
assert [s["name"] for s in bench_shapes()][0] == "ltx-stage1"

# The op on the CPU (the exact PyTorch reference), forward and backward, against the oracle.
q, k, v = (torch.randn(1, 4, 6, 8, 2, 16, requires_grad=True) for _ in range(3))
out, lse = na3d.na3d(q, k, v, (3, 3, 5), is_causal=(True, False, False), return_lse=True)
want = na3d.na3d_brute_force(q.detach(), k.detach(), v.detach(), (3, 3, 5), is_causal=(True, False, False))
err = (out.detach().double() - want).abs().max().item()
assert err < 1e-5, err
out.sum().backward()
assert q.grad is not None and torch.isfinite(q.grad).all()
print(f"na3d on the CPU: max abs error vs float64 oracle {err:.1e}; backward ok")

# The commands the README and docs/distributed.md name.
for module in ("na3d.bench", "na3d.distributed"):
    done = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=""))
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"python -m {module}: ok ({done.stdout.strip().splitlines()[-1][:80]})")
print("smoke test passed")
