"""What the sm90 table picks for a shape, and what ptxas makes of it (no GPU needed).

    python benchmarks/kernel_resources.py                       # the benchmark shapes
    python benchmarks/kernel_resources.py --shape 1 30 48 80 24 128 --kernel 18 24 24 --name dit-hunyuan

For each shape and pass (forward; dQ and dK/dV of the deterministic backward):
the tiles, warps, stages and register cap the table picks, the products issued per
useful one (geometry), and, from compiling that kernel for sm90 here (bf16, the
first launch with its non-finite check): registers per thread, spilled bytes,
shared memory, programs per SM (by registers and shared memory), whether ptxas
serialized the Hopper products (wgmma) for want of registers, and the
instructions and spill instructions of the kernel's key loop. Registers and
occupancy are compile-time facts; whether they matter is for the GPU to say.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "src"), os.path.join(HERE, "..", "tests", "kernels"), HERE]

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from occupancy_scan import programs_per_sm  # noqa: E402
from sass_loop import key_loops  # noqa: E402
from test_compile_targets import compile_for  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def resources(kernel, maxnreg, warps) -> dict:
    """ptxas' verdict on a compiled kernel, and its key loop in SASS."""
    with tempfile.TemporaryDirectory() as folder:
        ptx, cubin = os.path.join(folder, "k.ptx"), os.path.join(folder, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        cmd = [os.path.join(BIN, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", cubin]
        if maxnreg:
            cmd += ["--maxrregcount", str(maxnreg)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        report = done.stdout + done.stderr
        sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", cubin], capture_output=True, text=True).stdout
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spilled = re.search(r"(\d+) bytes spill stores", report)
    _, loops = key_loops(sass)
    loop = loops[0] if loops else []  # the first key loop: the first launch's
    shared = kernel.metadata.shared
    per_sm = min(programs_per_sm(registers, shared, warps).values())
    return {"registers": registers, "spilled_bytes": int(spilled.group(1)) if spilled else 0, "shared": shared,
            "programs_per_sm": per_sm, "wgmma_serialized": "serialized" in report,
            "loop_instructions": len(loop), "loop_spill_instructions": sum(("LDL" in t or "STL" in t) for t in loop)}


def rows_for(name, shape, kernel_size, causal=(False,) * 3, dilation=(1, 1, 1), pointers=False, group=1):
    from na3d import configs, geometry, launch
    from na3d.kernels.backward import na3d_bwd_dkdv_kernel, na3d_bwd_dq_kernel
    from na3d.kernels.forward import na3d_fwd_kernel

    B, T, H, W, NH, HD = shape
    grid, target = launch.group_grid((T, H, W), dilation), GPUTarget("cuda", 90, 32)
    fwd = configs.forward_config("sm90", grid, kernel_size, HD, torch.bfloat16)
    bwd = configs.backward_config("sm90", grid, kernel_size, HD, torch.bfloat16)
    base = dict(HEAD_DIM=HD, BLOCK_D=max(16, triton.next_power_of_2(HD)), CAUSAL_T=causal[0], CAUSAL_H=causal[1],
                CAUSAL_W=causal[2], STRIDED=False, ASSUME_FINITE=False, REDO=False, GROUP=group,
                USE_TMA=fwd.tma and HD in (16, 32, 64, 128) and not pointers,
                **launch.dilation_constexprs(dilation))
    stride = (1, 1, 1)
    passes = [
        ("fwd", na3d_fwd_kernel, fwd.q_tile, fwd.kv_tile, fwd.num_warps, fwd.num_stages, fwd.maxnreg,
         dict(RETURN_LSE=True, SCALE_SIGN=1, **launch.mask_modes(fwd.q_tile, fwd.kv_tile, kernel_size, causal, stride,
                                                                 fwd.fixed_mask, grid))),
        ("dq", na3d_bwd_dq_kernel, bwd.dq_q_tile, bwd.dq_kv_tile, bwd.num_warps, bwd.num_stages, bwd.dq_maxnreg,
         dict(HAS_DLSE=False, **launch.mask_modes(bwd.dq_q_tile, bwd.dq_kv_tile, kernel_size, causal, stride,
                                                  bwd.fixed_mask, grid))),
        ("dkdv", na3d_bwd_dkdv_kernel, bwd.dkdv_k_tile, bwd.dkdv_q_tile, bwd.dkdv_warps, bwd.dkdv_stages,
         bwd.dkdv_maxnreg, dict(ACCUMULATE_DQ=False, BULK_DQ=False, MASK_T=0, MASK_H=0, MASK_W=0)),
    ]
    for pas, fn, box, scanned, warps, stages, maxnreg, extra in passes:
        if pas == "dkdv":
            tiles = dict(K_T=box[0], K_H=box[1], K_W=box[2], Q_T=scanned[0], Q_H=scanned[1], Q_W=scanned[2])
            # dK/dV: key boxes on a fixed grid, each scanning the queries that see it.
            issued = geometry.issued_flops_ratio(grid, kernel_size, box, scanned, own="keys")
        else:
            tiles = dict(Q_T=box[0], Q_H=box[1], Q_W=box[2], KV_T=scanned[0], KV_H=scanned[1], KV_W=scanned[2])
            issued = geometry.issued_flops_ratio(grid, kernel_size, box, scanned)
        kernel = compile_for(fn, target, dict(base, **tiles, **extra), warps, stages, maxnreg)
        yield {"name": name, "pass": pas, "bucket": fwd.bucket, "box": list(box), "scanned": list(scanned),
               "warps": warps, "stages": stages, "maxnreg": maxnreg, "issued_per_useful": round(issued, 2),
               **resources(kernel, maxnreg, warps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=6, metavar=("B", "T", "H", "W", "NH", "HD"))
    parser.add_argument("--kernel", type=int, nargs=3)
    parser.add_argument("--name", default="shape")
    parser.add_argument("--causal", type=int, nargs=3, default=(0, 0, 0), metavar=("T", "H", "W"),
                        help="causal axes (1: causal), e.g. --causal 1 0 0")
    parser.add_argument("--dilation", type=int, nargs=3, default=(1, 1, 1), metavar=("T", "H", "W"),
                        help="NATTEN's dilation (boxes through descriptors that fold the groups: every dilated axis a multiple of its dilation)")
    parser.add_argument("--pointers", action="store_true", help="load through pointers where the table says TMA")
    parser.add_argument("--group", type=int, default=1, help="query heads per key/value head (GQA; 1: multi-head)")
    args = parser.parse_args()
    if args.shape:
        specs = [{"name": args.name, "shape": args.shape, "kernel_size": args.kernel}]
    else:
        from na3d.tools.common import bench_shapes

        specs = bench_shapes()
    head = (f"{'shape':<18}{'pass':>5} {'box':>10} {'scanned':>10} {'warps':>5} {'cap':>4} {'issued':>6} {'regs':>5}"
            f" {'spill B':>7} {'smem':>7} {'per SM':>6} {'wgmma':>10} {'loop':>5} {'spill':>5}")
    print(head)
    for spec in specs:
        for r in rows_for(spec["name"], tuple(spec["shape"]), tuple(spec["kernel_size"]),
                          tuple(bool(c) for c in args.causal), tuple(args.dilation), args.pointers, args.group):
            print(f"{r['name']:<18}{r['pass']:>5} {'x'.join(map(str, r['box'])):>10} "
                  f"{'x'.join(map(str, r['scanned'])):>10} {r['warps']:>5} {str(r['maxnreg'] or '-'):>4} "
                  f"{r['issued_per_useful']:>6} {r['registers']:>5} {r['spilled_bytes']:>7} {r['shared']:>7} "
                  f"{r['programs_per_sm']:>6} {'serialized' if r['wgmma_serialized'] else 'overlap':>10} "
                  f"{r['loop_instructions']:>5} {r['loop_spill_instructions']:>5}", flush=True)


if __name__ == "__main__":
    main()
