"""Programs per SM of every kernel a benchmark shape launches on sm90, compiled here (no GPU
needed), and where a register cap would fit one more.

    python benchmarks/occupancy_scan.py [--shapes NAME ...] [--try-caps]

For each shape of ``bench_shapes.json`` (and the feature rows' base), the launchers run with
the sm90 table as on an H100 (132 SMs) and every launch is compiled instead of run
(``launched_sass.py``'s way). Per kernel: warps, registers (ptxas), shared memory, programs
per SM as each of them allows (65536 registers per SM, allocated per warp in steps of 8 per
thread; 228 KiB of shared memory, 1 KiB of it reserved per program; 64 warps; 32 programs)
and the grid's programs in waves of those. Registers are the limit where they allow fewer
programs than shared memory does; ``--try-caps`` then compiles the kernel again capped at the
most registers that fit one more program and counts the local loads and stores in its key
loops (``loops/local``: each key loop's instructions and its local loads and stores per step) (a cap that spills there costs more than it gains; NOTES v40: edge-wide's forward went
from three programs per SM to four with a cap of 128 and ran 8 % faster). (``kernel_resources.py``
compiles the table's choice for a shape with arguments of its own; this compiles the launches the
launchers make, mask modes and all, and tries the caps.)
"""

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "src"), HERE]

REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024
SHARED_RESERVED = 1024
WARPS_PER_SM = 64
PROGRAMS_PER_SM = 32
SMS = 132


def programs_per_sm(registers: int, shared: int, warps: int) -> dict:
    """How many programs of a kernel one SM holds, by each resource."""
    per_thread = -(-registers // 8) * 8
    return {"registers": REGISTERS_PER_SM // (per_thread * 32 * warps),
            "shared": SHARED_PER_SM // (shared + SHARED_RESERVED),
            "warps": WARPS_PER_SM // warps, "programs": PROGRAMS_PER_SM}


def cap_for(programs: int, warps: int) -> int:
    """The most registers per thread (a multiple of 8) that fit ``programs`` programs."""
    return (REGISTERS_PER_SM // (programs * 32 * warps)) // 8 * 8


def ptxas_report(ptx: str, bin_dir: str):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        cubin = os.path.join(tmp, "k.cubin")
        report = subprocess.run([os.path.join(bin_dir, "ptxas"), "-v", "--gpu-name", "sm_90a", path, "-o", cubin],
                                capture_output=True, text=True).stderr
        sass = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", cubin], capture_output=True, text=True,
                              check=True).stdout
    used = re.search(r"Used (\d+) registers", report)
    return int(used.group(1)) if used else None, sass


def local_accesses(loops) -> list:
    """Local loads and stores (spilled registers) per key loop."""
    return [sum(1 for text in body if re.search(r"\b(LDL|STL)\b", text)) for body in loops]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=None)
    parser.add_argument("--try-caps", action="store_true")
    args = parser.parse_args()

    import torch
    import triton
    import triton.runtime.jit as jit

    from launched_sass import pretend_sm90
    from sass_loop import key_loops

    launch = pretend_sm90(SMS)
    from na3d.tools.common import bench_shapes
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    launches = []

    def compile_instead(self, grid):
        def run(*call_args, **kwargs):
            launches.append((self, grid, call_args, kwargs))
        return run

    jit.JITFunction.__getitem__ = compile_instead
    specs = bench_shapes("all")
    try:
        specs.append(__import__("na3d.tools.bench", fromlist=["FEATURE_BASE"]).FEATURE_BASE)
    except (ImportError, AttributeError):
        pass
    if args.shapes:
        specs = [s for s in specs if s["name"] in args.shapes]
    print(f"{'shape':<20}{'kernel':<26}{'warps':>6}{'regs':>6}{'shared':>8}  programs/SM (regs, shared)  "
          f"grid  waves  loops/local  cap for one more (used): loops/local")
    for spec in specs:
        shape, kernel = tuple(spec["shape"]), tuple(spec["kernel_size"])
        stride = tuple(spec.get("stride", (1, 1, 1)))
        generator = torch.Generator().manual_seed(0)
        q, k, v, grad_out = (torch.randn(shape, generator=generator).to(torch.bfloat16) for _ in range(4))
        scale = shape[-1] ** -0.5
        launches.clear()
        try:
            out, lse = launch.na3d_forward(q, k, v, kernel, scale, return_lse=True, stride=stride)
            launch.na3d_backward(grad_out, q, k, v, out, lse, kernel, scale, stride=stride)
        except Exception as error:  # noqa: BLE001 (a shape the CPU harness cannot bind: say so)
            print(f"{spec['name']:<20}{type(error).__name__}: {str(error)[:120]}")
        for fn, grid, call_args, kwargs in launches:
            if kwargs.get("REDO"):
                continue  # the second launch: a few programs reading flags on finite inputs
            compiled = fn.run(*call_args, grid=grid, warmup=True, **kwargs)
            warps = kwargs.get("num_warps", 4)
            registers, sass = ptxas_report(compiled.asm["ptx"], bin_dir)
            shared = compiled.metadata.shared
            fits = programs_per_sm(registers, shared, warps)
            per_sm = min(fits.values())
            n_programs = math.prod(grid if isinstance(grid, tuple) else grid(kwargs))
            waves = n_programs / (per_sm * SMS)
            uncapped_loops = key_loops(sass)[1]
            line = (f"{spec['name']:<20}{fn.fn.__name__:<26}{warps:>6}{registers:>6}{shared:>8}  {per_sm:>3} "
                    f"({fits['registers']}, {fits['shared']}){'':<17}{n_programs:>7}{waves:>7.2f}  "
                    f"{[len(body) for body in uncapped_loops]}/{local_accesses(uncapped_loops)}")
            more = per_sm + 1
            if fits["registers"] == per_sm and min(fits["shared"], fits["warps"], fits["programs"]) >= more:
                cap = cap_for(more, warps)
                note = f"  {cap}"
                if args.try_caps and cap >= 24:
                    capped = fn.run(*call_args, grid=grid, warmup=True, **dict(kwargs, maxnreg=cap))
                    capped_registers, capped_sass = ptxas_report(capped.asm["ptx"], bin_dir)
                    _, loops = key_loops(capped_sass)
                    local = local_accesses(loops)
                    note += f" ({capped_registers} used): {[len(body) for body in loops]}/{local}"
                line += note
            print(line, flush=True)


if __name__ == "__main__":
    main()
