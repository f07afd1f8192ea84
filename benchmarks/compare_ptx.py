"""Do two revisions compile the kernels to the same sm90 instructions?

    python benchmarks/compare_ptx.py OLD_REV [NEW_REV]   # NEW_REV default: the working tree
    python benchmarks/compare_ptx.py OLD_REV --tma       # boxes through tensor descriptors, and the fused dK/dV
    python benchmarks/compare_ptx.py OLD_REV --features  # causal, GQA, dilation, masks, lse, the safe launch
    python benchmarks/compare_ptx.py OLD_REV --sass      # (with any of the above) the SASS ptxas makes of it

Compiles the forward, dQ and dK/dV kernels for sm90 (no GPU needed) with every
configuration of the sm90 table, non-causal, stride 1, deterministic backward, at
both revisions, and compares the PTX instructions (parameter numbering, comments,
debug sections and debug-only labels ignored). Identical instructions mean a
benchmark measured at one revision holds for the other. Uses ``git worktree`` for
the old revision.

``--features``: only the sm90 table's first configuration, plain and then each
kernel with each feature turned on in turn (with and without tensor descriptors): causal
axes, strided windows, grouped heads, dilation, the mask modes, a negative and a
zero scale, lse and dlse, the fused dK/dV, the second (safe) launch, the full-box
split and the dependent second launch. Flags a revision's kernels do not have are
skipped.

``--sass``: compare the machine code (sm90 SASS from Triton's ptxas, disassembled
by its nvdisasm; addresses and encodings ignored) instead of the PTX. PTX that
differs only in the order of independent instructions can still assemble to the
same SASS, which is what runs. Where the SASS differs, the line says whether the
key loops (``sass_loop.key_loops``: the scan's body) are still the same.
"""

import json
import os
import re
import subprocess
import sys
import tempfile

DUMP = r'''
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
root = sys.argv[1]
tma_run = len(sys.argv) > 2 and sys.argv[2] == "tma"
features_run = len(sys.argv) > 2 and sys.argv[2] == "features"
sys.path[:0] = [root + "/src", root + "/tests/kernels", root + "/tests"]  # (tests/kernels: this layout)
import test_compile_targets as t
from triton.backends.compiler import GPUTarget
from na3d.kernels.forward import na3d_fwd_kernel
from na3d.kernels.backward import na3d_bwd_dq_kernel, na3d_bwd_dkdv_kernel
# Flags a revision's kernels do not have are left out (older code had none).
flags = {f: False for f in ("CAUSAL_T", "CAUSAL_H", "CAUSAL_W", "STRIDED") if f in na3d_fwd_kernel.arg_names}
plain_mask = {f: 0 for f in ("MASK_T", "MASK_H", "MASK_W") if f in na3d_fwd_kernel.arg_names}
# Flags renamed since: their names before (CHECK was ASSUME_FINITE's inverse).
RENAMED = {"ASSUME_FINITE": "CHECK", "RETURN_LSE": "STORE_LSE"}


def has(kernel, flag):
    return flag in kernel.arg_names or RENAMED.get(flag) in kernel.arg_names


def as_built(kernel, constexprs):
    """``constexprs`` under the names of ``kernel``'s revision. Before ASSUME_FINITE, the
    launcher passed CHECK (its inverse) to the first launch and CHECK off to the second
    (whose code never reads it, nor ASSUME_FINITE)."""
    constexprs = dict(constexprs)
    if "ASSUME_FINITE" in constexprs and "ASSUME_FINITE" not in kernel.arg_names:
        constexprs["CHECK"] = not constexprs.pop("ASSUME_FINITE") and not constexprs.get("REDO", False)
    if "RETURN_LSE" in constexprs and "RETURN_LSE" not in kernel.arg_names:
        constexprs["STORE_LSE"] = constexprs.pop("RETURN_LSE")
    return constexprs


# The first launch with its check for inf/NaN (revisions that have the flags).
flags.update({f: v for f, v in (("ASSUME_FINITE", False), ("REDO", False)) if has(na3d_fwd_kernel, f)})
# Multi-head attention (revisions with grouped-query attention in the kernels).
flags.update({"GROUP": 1} if "GROUP" in na3d_fwd_kernel.arg_names else {})
# No dilation (revisions with dilation in the kernels).
flags.update({f: 1 for f in ("DIL_T", "DIL_H", "DIL_W") if f in na3d_fwd_kernel.arg_names})
tgt = GPUTarget("cuda", 90, 32)
sass_run = os.environ.get("COMPARE_SASS") == "1"


def code(kernel):
    """The kernel's PTX, or (COMPARE_SASS=1) its SASS as ptxas made it. (sass_loop.py
    disassembles the same way; it is not imported here because it puts its own
    tree's src first on sys.path, and this process compiles another revision's.)"""
    if not sass_run:
        return kernel.asm["ptx"]
    import subprocess, tempfile, triton
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


res = {}
FEATURES = {  # name: flags, and the kernels they apply to
    "causal_t": (dict(CAUSAL_T=True), "fwd dq dkdv"),
    "causal_thw": (dict(CAUSAL_T=True, CAUSAL_H=True, CAUSAL_W=True), "fwd dq dkdv"),
    "strided": (dict(STRIDED=True), "fwd dq dkdv"),
    "gqa4": (dict(GROUP=4), "fwd dq dkdv"),
    "dil122": (dict(DIL_H=2, DIL_W=2), "fwd dq dkdv"),
    "dil222": (dict(DIL_T=2, DIL_H=2, DIL_W=2), "fwd dq dkdv"),
    "dil222_causal_gqa": (dict(DIL_T=2, DIL_H=2, DIL_W=2, CAUSAL_T=True, GROUP=2), "fwd dq dkdv"),
    "mask_bits": (dict(MASK_T=1, MASK_H=1, MASK_W=1), "fwd dq"),
    "mask_fixed_t": (dict(MASK_T=2, MASK_H=1, MASK_W=1), "fwd dq"),
    "mask_fixed_all": (dict(MASK_T=2, MASK_H=2, MASK_W=2), "fwd dq"),
    "mask_none": (dict(MASK_T=3, MASK_H=3, MASK_W=3), "fwd dq dkdv"),
    "mask_none_w_fixed_t": (dict(MASK_T=2, MASK_H=1, MASK_W=3), "fwd dq"),
    "scale_negative": (dict(SCALE_SIGN=-1), "fwd"),
    "scale_zero": (dict(SCALE_SIGN=0), "fwd"),
    "lse": (dict(RETURN_LSE=True), "fwd"),
    "dlse": (dict(HAS_DLSE=True), "dq"),
    "fused": (dict(ACCUMULATE_DQ=True), "dkdv"),
    "unchecked": (dict(ASSUME_FINITE=True), "fwd dq dkdv"),
    "safe_launch": (dict(REDO=True), "fwd dq dkdv"),
    "safe_launch_dil_gqa": (dict(REDO=True, DIL_H=2, GROUP=2, CAUSAL_W=True), "fwd dq dkdv"),
    "split_full": (dict(SPLIT_FULL=True), "fwd dq dkdv"),
    "split_full_gqa_dil": (dict(SPLIT_FULL=True, GROUP=2, DIL_H=2, CAUSAL_T=True), "fwd dq dkdv"),
    "split_full_fused": (dict(SPLIT_FULL=True, ACCUMULATE_DQ=True), "dkdv"),
    "split_full_safe": (dict(SPLIT_FULL=True, REDO=True), "fwd dq dkdv"),
    "dependent_launch": (dict(PDL=True), "fwd dq dkdv"),
}
configs = list(t.configs_for("sm90"))
if features_run:
    configs = configs[:1]
for entry in configs:
    bucket, (qt, kt, w, st, hd) = entry[0], entry[1]
    base = dict(HEAD_DIM=hd, BLOCK_D=hd, **flags)
    tiles = dict(Q_T=qt[0], Q_H=qt[1], Q_W=qt[2], KV_T=kt[0], KV_H=kt[1], KV_W=kt[2])
    dual = dict(K_T=qt[0], K_H=qt[1], K_W=qt[2], Q_T=kt[0], Q_H=kt[1], Q_W=kt[2])
    extra = {f: v for f, v in (("SCALE_SIGN", 1), ("USE_TMA", tma_run)) if f in na3d_fwd_kernel.arg_names}
    tma = {"USE_TMA": tma_run} if "USE_TMA" in na3d_bwd_dq_kernel.arg_names else {}
    dq_plain_mask = {f: 0 for f in ("MASK_T", "MASK_H", "MASK_W") if f in na3d_bwd_dq_kernel.arg_names}
    if "ACCUMULATE_DQ" in na3d_bwd_dkdv_kernel.arg_names:
        dual["ACCUMULATE_DQ"] = False
    dual.update(tma)
    if "BULK_DQ" in na3d_bwd_dkdv_kernel.arg_names:
        dual["BULK_DQ"] = False
    if "MASK_T" in na3d_bwd_dkdv_kernel.arg_names:  # (block-sparse dK/dV, from 87fae80 on)
        dual.update(MASK_T=0, MASK_H=0, MASK_W=0)
    if "STATS_TMA" in na3d_bwd_dkdv_kernel.arg_names:  # a flag of revisions c07cec7..b2e21eb
        dual["STATS_TMA"] = False
    # kernel name: (kernel, compile-time arguments, pipeline stages)
    kernels = dict(fwd=(na3d_fwd_kernel, dict(base, RETURN_LSE=False, **tiles, **extra, **plain_mask), st),
                   dq=(na3d_bwd_dq_kernel, dict(base, HAS_DLSE=False, **tiles, **tma, **dq_plain_mask), max(1, st - 1)),
                   dkdv=(na3d_bwd_dkdv_kernel, dict(base, **dual), max(1, st - 1)))
    for kname, (kernel, constexprs, stages) in kernels.items():
        res[f"{bucket}/{kname}"] = code(t.compile_for(kernel, tgt, as_built(kernel, constexprs), w, stages))
    if tma_run and "BULK_DQ" in dual:  # the one-pass backward, dQ by bulk reductions
        fused = as_built(na3d_bwd_dkdv_kernel, dict(base, **dict(dual, ACCUMULATE_DQ=True, BULK_DQ=True)))
        res[bucket + "/fused"] = code(t.compile_for(na3d_bwd_dkdv_kernel, tgt, fused, w, max(1, st - 1)))
    if not features_run:
        continue
    for descriptors in (False, True):
        for name, (flags_on, which) in FEATURES.items():
            for kname in which.split():
                kernel, constexprs, stages = kernels[kname]
                if not all(has(kernel, f) for f in flags_on):
                    continue
                constexprs = dict(constexprs, **flags_on)
                for f in ("USE_TMA", "BULK_DQ"):
                    if f in constexprs:
                        constexprs[f] = descriptors and (f == "USE_TMA" or constexprs.get("ACCUMULATE_DQ", False))
                key = f"{name}{'/tma' if descriptors else ''}/{kname}"
                res[key] = code(t.compile_for(kernel, tgt, as_built(kernel, constexprs), w, stages))
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


def sass_instructions(sass: str):
    """SASS instructions and labels, without addresses, encodings and comments."""
    lines = (re.sub(r"/\*.*?\*/", "", line).strip() for line in sass.splitlines())
    return [line for line in lines if (line and not line.startswith(".")) or line.endswith(":")]


def dump(root: str, mode: str, sass: bool = False) -> dict:
    env = dict(os.environ, COMPARE_SASS="1" if sass else "0")
    out = subprocess.run([sys.executable, "-c", DUMP, root] + ([mode] if mode else []), capture_output=True,
                         text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"compiling at {root} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    mode = "tma" if "--tma" in sys.argv else "features" if "--features" in sys.argv else ""
    sass = "--sass" in sys.argv
    revs = [a for a in sys.argv[1:] if a not in ("--tma", "--features", "--sass")]
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
        old, new = dump(roots[0], mode, sass), dump(roots[1], mode, sass)
    finally:
        for tree in trees:
            subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=repo)
    same = True
    for key in old:
        parse = sass_instructions if sass else instructions
        a, b = parse(old[key]), parse(new.get(key, ""))
        ok = a == b
        same &= ok
        verdict = "same" if ok else "DIFFERENT"
        if sass and not ok:
            from sass_loop import key_loops  # (this folder)
            loops_a = [[re.sub(r"/\*.*?\*/", "", t) for t in body] for body in key_loops(old[key])[1]]
            loops_b = [[re.sub(r"/\*.*?\*/", "", t) for t in body] for body in key_loops(new.get(key, ""))[1]]
            verdict += f" (key loops: {'same' if loops_a == loops_b else 'different'}, {len(b)} instructions now)"
        print(f"{key:30} {len(a):6} instructions  {verdict}")
    print("identical" if same else "different")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
