"""The Gluon sm90 forward's key loops in SASS, compiled here (no GPU needed):
instructions per step of each warpgroup and their opcode histogram, shared memory
and ptxas's report (registers, serialization warnings).

    python benchmarks/sm90_gluon_sass.py [--head-dim 128] [--kv-box 2 8 8] [--stages 3]
                                         [--switch NAME=VALUE ...] [--dump]

``--switch`` passes the kernel's measurement switches (``OVERLAP=0``, ``PINGPONG=0``).
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
sys.path[:0] = [os.path.join(HERE, "..", "src"), os.path.join(HERE, "..", "tests", "kernels"),
                 os.path.join(HERE, "..", "tests"), HERE]

import triton  # noqa: E402

from sass_loop import key_loops  # noqa: E402
from test_sm90_forward import build_gluon_for_sm90  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--q-box", type=int, nargs=3, default=[2, 8, 8])
    parser.add_argument("--kv-box", type=int, nargs=3, default=[2, 8, 8])
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--switch", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--no-check", action="store_true", help="compile without the non-finite check (assume_finite)")
    parser.add_argument("--dump", action="store_true", help="print each loop's instructions")
    args = parser.parse_args()
    switches = {name: int(value) for name, value in (s.split("=") for s in args.switch)}
    kernel = build_gluon_for_sm90(args.head_dim, tuple(args.q_box), tuple(args.kv_box), args.stages,
                                  return_lse=False, assume_finite=args.no_check, **switches)
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as folder:
        ptx = os.path.join(folder, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        report = subprocess.run([os.path.join(bin_dir, "ptxas"), "-v", "--gpu-name=sm_90a", ptx, "-o",
                                 os.path.join(folder, "k.cubin")], capture_output=True, text=True)
        sass = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", os.path.join(folder, "k.cubin")],
                              capture_output=True, text=True, check=True).stdout
    print(f"head dim {args.head_dim} q box {args.q_box} kv box {args.kv_box} stages {args.stages} {switches}: "
          f"shared {kernel.metadata.shared} B")
    print("\n".join(line for line in report.stderr.splitlines() if "Used" in line or "warn" in line.lower()))
    _, loops = key_loops(sass)
    for body in loops:
        opcodes = collections.Counter()
        for text in body:
            m = re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", text)
            if m:
                opcodes[m.group(1).split(".")[0]] += 1
        print(f"key loop: {len(body)} instructions per step")
        print("  " + ", ".join(f"{op} {n}" for op, n in opcodes.most_common()))
        if args.dump:
            print("\n".join("    " + re.sub(r"\s+", " ", t) for t in body))


if __name__ == "__main__":
    main()
