"""Do two revisions compile the kernels to the same sm90 instructions?

    python benchmarks/compare_ptx.py OLD_REV [NEW_REV]   # NEW_REV default: the working tree
    python benchmarks/compare_ptx.py OLD_REV --tma       # boxes through tensor descriptors, and the fused dK/dV

Compiles the forward, dQ and dK/dV kernels for sm90 (no GPU needed) with every
configuration of the sm90 table, non-causal, stride 1, deterministic backward, at
both revisions, and compares the PTX instructions (parameter numbering, comments,
debug sections and debug-only labels ignored). Identical instructions mean a
benchmark measured at one revision holds for the other. Uses ``git worktree`` for
the old revision.
"""

import json
import re
import subprocess
import sys
import tempfile

DUMP = r'''
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
root = sys.argv[1]
tma_run = len(sys.argv) > 2 and sys.argv[2] == "tma"
sys.path[:0] = [root + "/src", root + "/tests/kernels", root + "/tests"]  # (tests/kernels: this layout)
import test_compile_targets as t
from triton.backends.compiler import GPUTarget
from na3d.kernels.forward import na3d_fwd_kernel
from na3d.kernels.backward import na3d_bwd_dq_kernel, na3d_bwd_dkdv_kernel
# Flags a revision's kernels do not have are left out (older code had none).
flags = {f: False for f in ("CAUSAL_T", "CAUSAL_H", "CAUSAL_W", "STRIDED") if f in na3d_fwd_kernel.arg_names}
plain_mask = {f: 0 for f in ("MASK_T", "MASK_H", "MASK_W") if f in na3d_fwd_kernel.arg_names}
# The first launch with its check for inf/NaN (revisions that have the flags).
flags.update({f: v for f, v in (("CHECK", True), ("REDO", False)) if f in na3d_fwd_kernel.arg_names})
# Multi-head attention (revisions with grouped-query attention in the kernels).
flags.update({"GROUP": 1} if "GROUP" in na3d_fwd_kernel.arg_names else {})
# No dilation (revisions with dilation in the kernels).
flags.update({f: 1 for f in ("DIL_T", "DIL_H", "DIL_W") if f in na3d_fwd_kernel.arg_names})
tgt = GPUTarget("cuda", 90, 32)
res = {}
for entry in t.configs_for("sm90"):
    bucket, (qt, kt, w, st, hd) = entry[0], entry[1]
    base = dict(HEAD_DIM=hd, BLOCK_D=hd, **flags)
    tiles = dict(Q_T=qt[0], Q_H=qt[1], Q_W=qt[2], KV_T=kt[0], KV_H=kt[1], KV_W=kt[2])
    dual = dict(K_T=qt[0], K_H=qt[1], K_W=qt[2], Q_T=kt[0], Q_H=kt[1], Q_W=kt[2])
    extra = {f: v for f, v in (("SCALE_SIGN", 1), ("USE_TMA", tma_run)) if f in na3d_fwd_kernel.arg_names}
    res[bucket + "/fwd"] = t.compile_for(na3d_fwd_kernel, tgt, dict(base, STORE_LSE=False, **tiles, **extra,
                                                                    **plain_mask), w, st).asm["ptx"]
    tma = {"USE_TMA": tma_run} if "USE_TMA" in na3d_bwd_dq_kernel.arg_names else {}
    dq_plain_mask = {f: 0 for f in ("MASK_T", "MASK_H", "MASK_W") if f in na3d_bwd_dq_kernel.arg_names}
    res[bucket + "/dq"] = t.compile_for(na3d_bwd_dq_kernel, tgt, dict(base, HAS_DLSE=False, **tiles, **tma,
                                                                      **dq_plain_mask), w, max(1, st - 1)).asm["ptx"]
    if "ACCUMULATE_DQ" in na3d_bwd_dkdv_kernel.arg_names:
        dual["ACCUMULATE_DQ"] = False
    dual.update(tma)
    if "BULK_DQ" in na3d_bwd_dkdv_kernel.arg_names:
        dual["BULK_DQ"] = False
    if "STATS_TMA" in na3d_bwd_dkdv_kernel.arg_names:  # a flag of revisions c07cec7..b2e21eb
        dual["STATS_TMA"] = False
    res[bucket + "/dkdv"] = t.compile_for(na3d_bwd_dkdv_kernel, tgt, dict(base, **dual), w, max(1, st - 1)).asm["ptx"]
    if tma_run and "BULK_DQ" in dual:  # the one-pass backward, dQ by bulk reductions
        res[bucket + "/fused"] = t.compile_for(na3d_bwd_dkdv_kernel, tgt, dict(base, **dict(dual, ACCUMULATE_DQ=True,
                                               BULK_DQ=True)), w, max(1, st - 1)).asm["ptx"]
print(json.dumps(res))
'''


def instructions(ptx: str):
    """The PTX instructions, with parameters and virtual registers renamed in order of
    first use (an added kernel argument shifts every register number by one)."""
    body = re.split(r"\.section\s+\.debug", ptx)[0]
    # $L__tmp labels only anchor the debug line table (an inlined helper adds some).
    keep = [line for line in body.splitlines()
            if ".param" not in line and not line.strip().startswith("//") and ".loc" not in line
            and ".file" not in line and not re.fullmatch(r"\s*\$L__tmp\d+:", line)]
    names = {}

    def rename(match):
        kind = re.match(r"%[a-z]+", match.group(0)).group(0)
        return names.setdefault(match.group(0), f"{kind}#{sum(k.startswith(kind + '#') for k in names.values())}")

    return [re.sub(r"%[a-z]+\d+", rename, re.sub(r"_param_\d+", "_param_N", line)) for line in keep]


def dump(root: str, tma: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", DUMP, root] + (["tma"] if tma else []), capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    tma = "--tma" in sys.argv
    revs = [a for a in sys.argv[1:] if a != "--tma"]
    if not revs:
        print(__doc__)
        return 2
    repo = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True).stdout.strip()
    roots, trees = [], []
    for rev in revs[:2]:
        tree = tempfile.mkdtemp(prefix="na3d-rev-")
        subprocess.run(["git", "worktree", "add", "-q", "--detach", tree, rev], cwd=repo, check=True)
        roots.append(tree)
        trees.append(tree)
    if len(roots) == 1:
        roots.append(repo)
    try:
        old, new = dump(roots[0], tma), dump(roots[1], tma)
    finally:
        for tree in trees:
            subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=repo)
    same = True
    for key in old:
        a, b = instructions(old[key]), instructions(new.get(key, ""))
        ok = a == b
        same &= ok
        print(f"{key:24} {len(a):6} instructions  {'same' if ok else 'DIFFERENT'}")
    print("identical" if same else "different")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
