"""A kernel's main loop in sm90 SASS, compiled here (no GPU needed): instructions
per step and their opcode histogram. On the H200 the loops are co-limited by
instruction issue and shared-memory bandwidth (benchmarks/NOTES.md, v10), so this
count is a first check when changing a loop, never the verdict: a change that
removes instructions but adds shared-memory traffic can still lose. Time it on the
GPU.

    python benchmarks/sass_loop.py [--kernel forward|dq|dkdv] [--q-tile 4 4 4] [--kv-tile 2 2 16]
                                   [--warps 4] [--stages 2] [--maxnreg N] [--no-tma] [--head-dim 64]
                                   [--split-full] [--group 8] [--dump]

Defaults: the sm90 table's large-window (11x11x11) config, bf16, head dim 64 (``--head-dim``).
``--q-tile``/``--kv-tile`` are the program's own box and the scanned box: for dK/dV
the key box and the query box.
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "src"), os.path.join(HERE, "..", "tests", "kernels")]

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from test_compile_targets import compile_for  # noqa: E402

ADDRESS = re.compile(r"/\*([0-9a-f]{4,})\*/")


def key_loops(sass: str):
    """``(instructions, loops)`` of a kernel's SASS (``nvdisasm -c``): its instructions
    as ``(address, text)``, and the bodies of its key loops, in code order: backward
    branches around tensor-core products (HGMMA: Hopper's warpgroup products, 64+
    query rows; HMMA: mma.sync, smaller query boxes) with no exit inside."""
    # Instruction lines with their addresses; labels with the address that follows them.
    instructions, labels, pending = [], {}, None
    for line in sass.splitlines():
        label = re.match(r"\s*\.L_x_(\d+):", line)
        if label:
            pending = label.group(1)
            continue
        m = ADDRESS.search(line)
        if m:
            address = int(m.group(1), 16)
            instructions.append((address, line.split("*/", 1)[1].split(";")[0].strip()))
            if pending is not None:
                labels[pending], pending = address, None
    loops = []
    for address, text in instructions:
        m = re.search(r"BRA\s+`\(\.L_x_(\d+)\)", text)
        if m and labels.get(m.group(1), address) < address:
            body = [t for a, t in instructions if labels[m.group(1)] <= a <= address]
            if any("HGMMA" in t or "HMMA" in t for t in body) and not any(t.startswith("EXIT") for t in body):
                loops.append(body)
    return instructions, loops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", choices=["forward", "dq", "dkdv"], default="forward")
    parser.add_argument("--q-tile", type=int, nargs=3, default=[4, 4, 4])
    parser.add_argument("--kv-tile", type=int, nargs=3, default=[2, 2, 16])
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--maxnreg", type=int, default=None, help="register cap, as a table's maxnreg")
    parser.add_argument("--no-tma", action="store_true")
    parser.add_argument("--fixed", default="", metavar="AXES",
                        help="forward, dq: axes (of t, h, w) whose mask is computed once per program, e.g. 'w'")
    parser.add_argument("--bits", default="", metavar="AXES",
                        help="forward, dq: moving axes masked from window bits (needs a --fixed axis), e.g. 'th'")
    parser.add_argument("--none", default="", metavar="AXES",
                        help="axes proven block-sparse (MASK_NONE), e.g. 'thw' (dkdv: all three or none)")
    parser.add_argument("--dilation", type=int, nargs=3, default=[1, 1, 1], metavar=("T", "H", "W"),
                        help="NATTEN's dilation")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--group", type=int, default=1, help="query heads per key/value head (GQA, MQA)")
    parser.add_argument("--split-full", action="store_true",
                        help="full boxes in a loop of their own, without the mask (SPLIT_FULL; dkdv: full query boxes)")
    parser.add_argument("--dump", action="store_true", help="print the loop's instructions")
    args = parser.parse_args()

    from na3d.kernels.backward import na3d_bwd_dkdv_kernel, na3d_bwd_dq_kernel
    from na3d.kernels.forward import na3d_fwd_kernel

    (qt, qh, qw), (kt, kh, kw) = args.q_tile, args.kv_tile
    tma = not args.no_tma
    # (the first launch, with its check)
    constexprs = dict(HEAD_DIM=args.head_dim, BLOCK_D=args.head_dim, CAUSAL_T=False, CAUSAL_H=False, CAUSAL_W=False,
                      STRIDED=False, USE_TMA=tma, ASSUME_FINITE=False, REDO=False, GROUP=args.group,
                      **dict(zip(("DIL_T", "DIL_H", "DIL_W"), args.dilation)))
    if args.kernel == "dkdv":
        fn = na3d_bwd_dkdv_kernel
        constexprs.update(ACCUMULATE_DQ=False, BULK_DQ=False,
                          K_T=qt, K_H=qh, K_W=qw, Q_T=kt, Q_H=kh, Q_W=kw)
    else:
        fn = na3d_fwd_kernel if args.kernel == "forward" else na3d_bwd_dq_kernel
        constexprs.update(Q_T=qt, Q_H=qh, Q_W=qw, KV_T=kt, KV_H=kh, KV_W=kw)
        constexprs.update(dict(RETURN_LSE=False, SCALE_SIGN=1) if args.kernel == "forward" else dict(HAS_DLSE=False))
    # launch.mask_modes: 0 per step, 1 window bits, 2 fixed, 3 none
    constexprs.update({f"MASK_{axis.upper()}": 3 if axis in args.none else 2 if axis in args.fixed
                       else 1 if axis in args.bits else 0 for axis in "thw"})
    if args.split_full:
        constexprs["SPLIT_FULL"] = True
    kernel = compile_for(fn, GPUTarget("cuda", 90, 32), constexprs, args.warps, args.stages, args.maxnreg)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout

    instructions, loops = key_loops(sass)
    if not loops:
        sys.exit("no key loop found")
    scores = (qt * qh * qw) * (kt * kh * kw) // (32 * args.warps)
    # Registers: one past the highest one named (ptxas allocates in steps of 8 above that).
    registers = 1 + max((int(r) for _, t in instructions for r in re.findall(r"\bR(\d+)\b", t)), default=-1)
    print(f"{args.kernel}: q_tile {args.q_tile} kv_tile {args.kv_tile} warps {args.warps} stages {args.stages} "
          f"maxnreg {args.maxnreg} tma {tma}: shared {kernel.metadata.shared} B, {registers} registers named")
    # Every key loop, in code order (a kernel variant may have more than one).
    for body in loops:
        opcodes = collections.Counter()
        for text in body:
            m = re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", text)
            if m:
                opcodes[m.group(1)] += 1
        print(f"key loop: {len(body)} instructions per step and thread, {len(body) / scores:.1f} per score")
        print(", ".join(f"{op} {n}" for op, n in opcodes.most_common()))
    body = max(loops, key=len)
    if args.dump:
        print("\n".join(re.sub(r"\s+", " ", t) for t in body))


if __name__ == "__main__":
    main()
