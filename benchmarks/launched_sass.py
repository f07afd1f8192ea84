"""What a call launches on sm90, compiled here (no GPU needed), at any revision.

    python benchmarks/launched_sass.py ROOT --shape B T H W NH HD --kernel KT KH KW [--assume-finite] [--backward]
        [--redo-in-program] [--dump DIR] [--kv-heads N]

Imports ``na3d`` from ``ROOT/src`` (a checkout or ``git archive`` of any revision),
makes its launchers believe the tensors sit on an sm90 GPU (the sm90 table, 132
SMs) and runs ``launch.na3d_forward`` (and ``na3d_backward``) on CPU tensors of
the shape, bf16. Each kernel launch is compiled instead of run: Triton's own
launcher binds the arguments, so the specialization (divisibility, constants) is a
real launch's. Prints, per launch, the PTX lines, SASS instructions, the key
loops' lengths (``sass_loop.key_loops``) and the local loads and stores in the
first of them (spills inside the loop), the shared memory and ptxas's register
and spill counts. ``--dump DIR`` also writes each launch's SASS there
(``<kernel>.sass``, ``<kernel>.redo.sass`` for a second launch), to compare
opcode by opcode. Used to compare the
code two revisions launch for one benchmark shape (NOTES v33: edge-wide at 324d74b
and now).
"""

import argparse
import inspect
import os
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)


def pretend_sm90(sms: int = 132):
    """Make Triton bind and compile launches for sm90 and na3d's launchers answer as on an
    H100/H200 (the sm90 table, ``sms`` SMs) on a machine without a GPU; returns
    ``na3d.launch`` (imported from the first na3d on ``sys.path``)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class Sm90Driver:
        """Enough of a driver for Triton to bind and compile a launch for sm90."""
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    driver.set_active(Sm90Driver())
    import na3d.launch as launch

    # The launchers' device queries (older trees keep them elsewhere).
    for name in ("na3d.device", "na3d.configs", "na3d.launch"):
        module = sys.modules.get(name)
        for attr, value in (("device_arch", "sm90"), ("_arch", "sm90"), ("sm_count", sms)):
            if module is not None and hasattr(module, attr):
                setattr(module, attr, lambda *_a, _v=value, **_k: _v)
        if module is not None and hasattr(module, "kernels_interpreted"):
            module.kernels_interpreted = lambda: False
    return launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", help="a tree whose src/ holds the na3d to compile")
    parser.add_argument("--shape", type=int, nargs=6, required=True, metavar=("B", "T", "H", "W", "NH", "HD"))
    parser.add_argument("--kernel", type=int, nargs=3, required=True, metavar=("KT", "KH", "KW"))
    parser.add_argument("--assume-finite", action="store_true", help="(trees that have it) no non-finite check")
    parser.add_argument("--backward", action="store_true", help="also the backward's launches")
    parser.add_argument("--redo-in-program", action="store_true",
                        help="(trees that have it) every kernel in one launch, redoing flagged tiles in program")
    parser.add_argument("--dump", metavar="DIR", default=None, help="write each launch's SASS into DIR")
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="grouped-query attention: k and v sliced to their first KV_HEADS heads (views, as "
                             "the benchmark's features pass them; 1: MQA)")
    args = parser.parse_args()

    sys.path.insert(0, os.path.join(os.path.abspath(args.root), "src"))
    import torch
    import triton
    import triton.runtime.jit as jit

    launch = pretend_sm90()

    if args.redo_in_program:
        one_launch = launch.launch_and_redo

        def launch_and_redo(*call_args, **kwargs):
            return one_launch(*call_args[:9], in_program=True)
        launch.launch_and_redo = launch_and_redo

    compiled = []

    def compile_instead(self, grid):
        def run(*call_args, **kwargs):
            compiled.append((self.fn.__name__, kwargs, self.run(*call_args, grid=grid, warmup=True, **kwargs)))
        return run

    jit.JITFunction.__getitem__ = compile_instead

    generator = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(args.shape, generator=generator).to(torch.bfloat16) for _ in range(4))
    if args.kv_heads is not None:
        k, v = k[..., :args.kv_heads, :], v[..., :args.kv_heads, :]
    params = inspect.signature(launch.na3d_forward).parameters
    extra = {"assume_finite": True} if args.assume_finite and "assume_finite" in params else {}
    lse_flag = "return_lse" if "return_lse" in params else "need_lse"
    scale = args.shape[-1] ** -0.5
    out, lse = launch.na3d_forward(q, k, v, tuple(args.kernel), scale, **{lse_flag: True}, **extra)
    if args.backward:
        launch.na3d_backward(grad_out, q, k, v, out, lse, tuple(args.kernel), scale, **extra)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sass_loop import key_loops

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    for name, kwargs, kernel in compiled:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
        instructions, loops = key_loops(sass)
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, f"{name}{'.redo' if kwargs.get('REDO') else ''}.sass"), "w") as f:
                f.write(sass)
        registers = ptxas_registers(kernel.asm["ptx"], os.path.dirname(nvdisasm))
        local = sum(" LDL" in f" {text}" or " STL" in f" {text}" for text in loops[0]) if loops else 0
        print(f"{name}{' (second launch)' if kwargs.get('REDO') else ''}: warps {kwargs.get('num_warps')}, "
              f"PTX {len(kernel.asm['ptx'].splitlines())} lines, SASS {len(instructions)} instructions, "
              f"key loops {[len(body) for body in loops]} ({local} local accesses in the first), "
              f"shared {kernel.metadata.shared} B, {registers}")


def ptxas_registers(ptx: str, bin_dir: str) -> str:
    """ptxas's register and spill report for ``ptx`` (sm_90a), as one line."""
    import re
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        report = subprocess.run([os.path.join(bin_dir, "ptxas"), "-v", "--gpu-name", "sm_90a", path, "-o",
                                 os.path.join(tmp, "k.cubin")], capture_output=True, text=True).stderr
    used = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return (f"{used.group(1) if used else '?'} registers, "
            f"spills {spills.group(1) + '/' + spills.group(2) if spills else '?'} B")


if __name__ == "__main__":
    main()
