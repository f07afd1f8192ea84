"""Every kernel, with every configuration the tables can hand out, compiles for the
GPUs we claim (no GPU needed: Triton compiles ahead of time for a named target).

Run as a test (which starts this file in a fresh interpreter, since the test
session may have turned on the Triton interpreter), or directly:
``python tests/kernels/test_compile_targets.py sm90`` (``--first``: the first table
configuration only; ``--core``: of it, the descriptor path's forward, dQ and dK/dV). The
default test run compiles sm90's core; the exhaustive sweep over every target and
configuration, every variant, is marked ``slow`` (CI runs it).

This is what keeps the CPU-only CI honest about the compiled path: the interpreter
accepts code the compiler rejects (global constexprs, dot precisions an AMD
backend does not know, ...). sm90 builds must use Hopper's wgmma (mma.sync where a
table gives a box fewer than 64 rows or fewer than 4 warps: wgmma works on 64 rows
per warpgroup of 4 warps), AMD builds MFMA. Each configuration is compiled at head
dim 64 and at the largest head dim its bucket serves, and must fit the target's
shared memory (a table entry that does not would fail at launch on that GPU).
"""

import json
import os
import subprocess
import sys
from importlib import resources

import pytest

from na3d import configs

try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover
    triton = None

TARGETS = {
    "sm90": (("cuda", 90, 32), "wgmma", "ptx"),
    "sm80": (("cuda", 80, 32), "mma.sync", "ptx"),
    "gfx942": (("hip", "gfx942", 64), "mfma", "amdgcn"),
    "gfx950": (("hip", "gfx950", 64), "mfma", "amdgcn"),
}
# Shared memory (LDS on AMD) one program may use: the opt-in maximum per block.
SHARED_LIMIT = {"sm90": 227 * 1024, "sm80": 163 * 1024, "gfx942": 64 * 1024, "gfx950": 160 * 1024}
POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "DO": "*bf16", "DQ": "*bf16",
            "DK": "*bf16", "DV": "*bf16", "LSE": "*fp32", "DLSE": "*fp32", "DQ_ACC": "*fp32", "STATS": "*fp32",
            "FLAGS": "*i8"}


def compile_for(kernel, target, constexprs, num_warps, num_stages, maxnreg=None):
    """Compile as a launch would: pointers and strides divisible by 16 (what Triton's
    launcher specializes on for real tensors), descriptors typed by their block, the
    table's register cap if it sets one."""
    # Compile-time arguments left out take their defaults, as at a launch.
    constexprs = dict({p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}, **constexprs)
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "STATS_DESC":  # the backward's statistics: (B NH, T, H, W, 4)
            box = [constexprs[f"Q_{a}"] for a in "THW"]
            signature[name] = f"tensordesc<fp32[1,{box[0]},{box[1]},{box[2]},4]>" if constexprs["USE_TMA"] else "*fp32"
        elif name.endswith("_DESC"):
            box = [constexprs.get(f"{'Q' if name in ('Q_DESC', 'DO_DESC', 'DQ_DESC') else 'KV'}_{a}") for a in "THW"]
            kind = "fp32" if name == "DQ_DESC" else "bf16"
            on = constexprs.get("BULK_DQ" if name == "DQ_DESC" else "USE_TMA")
            signature[name] = (f"tensordesc<{kind}[1,{box[0]},{box[1]},{box[2]},{constexprs['BLOCK_D']}]>"
                               if on else "*bf16")
        elif name in POINTERS:
            signature[name] = POINTERS[name]
        elif name.endswith("_strides"):  # a tensor's (b, t, h, w, head) strides
            signature[name] = ("i32",) * 5
        elif name in ("qk_scale", "scale"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if isinstance(signature[name], str) and signature[name].startswith("*")}
    attrs.update({(i, j): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
                  if name.endswith("_strides") for j in range(5)})
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=target, options=options)


def table_entries(arch):
    folder = resources.files("na3d") / "configs"
    path = folder / f"{arch}.json"
    if not path.is_file():
        path = folder / "default.json"
    return json.loads(path.read_text())["forward"]


def configs_for(arch):
    """Each distinct table configuration, at the usual head dim (64) and at the
    largest its bucket serves (128, or 256 for the wide-head bucket): shared memory
    grows with the head dim, and every size must fit the target."""
    seen = set()
    for bucket in table_entries(arch):
        wide = bucket.get("when", {}).get("head_dim_min", 0) > 128
        # A bucket's alternatives are compiled too, with their own backward entry or
        # the bucket's.
        # A strided call's boxes (configs.stride_aligned_option), on NATTEN's showcase.
        for name, entry in configs.bucket_options(bucket, (30, 48, 80), (18, 24, 24), (2, 8, 8)):
            for head_dim in (256,) if wide else (64, 128):
                if head_dim > entry.get("when", {}).get("head_dim_max", head_dim):
                    continue
                key = (tuple(entry["q_tile"]), tuple(entry["kv_tile"]), entry["num_warps"], entry["num_stages"],
                       head_dim)
                split = entry.get("split_full") is not None  # (the forward's scan split in two loops)
                if (key, split) not in seen:
                    seen.add((key, split))
                    yield name, key, entry.get("backward", bucket.get("backward")), entry.get("maxnreg"), split


# Causal flags cycle over the table's buckets: every flag is compiled on and off.
CAUSAL_CYCLE = [(False, False, False), (True, False, False), (False, True, True), (True, True, False)]
# Window-mask modes per axis (launch.mask_modes: 0 per step, 1 window bits, 2 once per program,
# 3 none: the axis is block-sparse).
MASK_CYCLE = [(1, 1, 2), (2, 2, 0), (0, 2, 2), (2, 2, 2), (2, 1, 1), (3, 3, 3), (3, 2, 1), (0, 3, 3)]
PLAIN_MASKS = dict(MASK_T=0, MASK_H=0, MASK_W=0)
# Dilations, cycled over the configurations on the pointer path (dilated calls do
# not use descriptors).
DILATION_CYCLE = [(1, 2, 2), (1, 1, 1), (2, 2, 2), (3, 1, 2)]


def product_instruction(arch, rows, warps):
    """The tensor-core instruction a kernel must use for a box of ``rows`` rows on ``warps`` warps."""
    instruction = TARGETS[arch][1]
    if instruction == "wgmma" and (rows < 64 or warps % 4):
        return "mma.sync"
    return instruction


def compile_all(arch, first_only=False, core=False):
    """``core`` (with ``first_only``): the descriptor path (sm90's) forward, dQ and dK/dV
    only, without their second launches, the one-pass backward and the variants the first
    configuration adds (the split scan, one-launch redo)."""
    from na3d.kernels.backward import na3d_bwd_delta_kernel, na3d_bwd_dkdv_kernel, na3d_bwd_dq_kernel
    from na3d.kernels.forward import na3d_fwd_kernel

    target, _, asm = TARGETS[arch]
    target = GPUTarget(*target)

    def fits(kernel, what):
        used = kernel.metadata.shared
        assert used <= SHARED_LIMIT[arch], f"{arch} {bucket} head_dim {head_dim}: {what} needs {used} B of shared memory"
        return kernel

    for i, (bucket, (q_tile, kv_tile, warps, stages, head_dim), bwd, cap, split) in enumerate(configs_for(arch)):
        if first_only and i > 0:
            break
        # Register caps are an NVIDIA compiler option; other backends reject the keyword.
        assert target.backend == "cuda" or cap is None and not any(
            k.endswith("maxnreg") for k in (bwd or {})), f"{arch} {bucket}: register caps on a non-NVIDIA table"
        dq_cap = dkdv_cap = None
        causal = CAUSAL_CYCLE[i % len(CAUSAL_CYCLE)]
        # Every third configuration with two query heads per key/value head (GQA); every
        # launch with its check for inf/NaN (ASSUME_FINITE off), as by default.
        # On Hopper the second launch may be a programmatic dependent of the first
        # (device.dependent_launch, where the table's dependent_launch is on): sm90 builds
        # compile that code, so that turning it on cannot fail to compile.
        base = dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, CAUSAL_T=causal[0], CAUSAL_H=causal[1], CAUSAL_W=causal[2],
                    STRIDED=i % 2 == 1, GROUP=2 if i % 3 == 2 else 1, ASSUME_FINITE=False, PDL=arch == "sm90")
        dilated = dict(zip(("DIL_T", "DIL_H", "DIL_W"), DILATION_CYCLE[i % len(DILATION_CYCLE)]))
        tiles = dict(Q_T=q_tile[0], Q_H=q_tile[1], Q_W=q_tile[2], KV_T=kv_tile[0], KV_H=kv_tile[1], KV_W=kv_tile[2])
        for use_tma in ((True,) if core else (False, True)) if arch == "sm90" else (False,):
            # The plain per-step mask and a cycling choice of modes, alternately (every
            # table has several configurations, so each target compiles both).
            modes = (0, 0, 0) if (i + use_tma) % 2 == 0 else MASK_CYCLE[i % len(MASK_CYCLE)]
            flags = dict(zip(("MASK_T", "MASK_H", "MASK_W"), modes),
                         **(dict(DIL_T=1, DIL_H=1, DIL_W=1) if use_tma else dilated))
            fwd = fits(compile_for(na3d_fwd_kernel, target, dict(base, RETURN_LSE=True, SCALE_SIGN=1 - 2 * (i % 2),
                                                                 USE_TMA=use_tma, REDO=False, SPLIT_FULL=split,
                                                                 **tiles, **flags),
                                   warps, stages, cap), "forward")
            expected = product_instruction(arch, q_tile[0] * q_tile[1] * q_tile[2], warps)
            assert expected in fwd.asm[asm], f"{arch} {bucket}: forward has no {expected}"
            if i == 0 and not split and not core:  # the split scan (a table's split_full) on every target, once
                fits(compile_for(na3d_fwd_kernel, target, dict(base, RETURN_LSE=True, SCALE_SIGN=1, USE_TMA=use_tma,
                                                               REDO=False, SPLIT_FULL=True, **tiles, **flags),
                                 warps, stages, cap), "split forward")
            if use_tma:
                assert "cp.async.bulk.tensor" in fwd.asm[asm], f"{bucket}: forward with TMA has no bulk tensor copy"
            if use_tma == (arch == "sm90") and not core:  # the safe kernel (kernels/programs.py), once per configuration
                redo = fits(compile_for(na3d_fwd_kernel, target, dict(base, RETURN_LSE=True, SCALE_SIGN=1,
                                                                      USE_TMA=use_tma, REDO=True, SPLIT_FULL=split,
                                                                      **tiles, **flags),
                                        warps, 1), "forward's second launch")
                dependent_launch(arch, asm, fwd, redo)
                if i == 0 and not core:  # one launch, each program redoing its own tile (a config's redo_in_program)
                    one_launch(arch, asm, fits(compile_for(na3d_fwd_kernel, target, dict(
                        base, RETURN_LSE=True, SCALE_SIGN=1, USE_TMA=use_tma, REDO=False, REDO_IN_PROGRAM=True,
                        SPLIT_FULL=split, **tiles, **flags), warps, stages, cap), "forward redoing in program"))
        dq_warps, dq_stages = warps, max(1, stages - 1)
        dkdv_warps, dkdv_stages = dq_warps, dq_stages
        dkdv_k, dkdv_q = q_tile, kv_tile
        dq_split = split if bwd is None else bwd.get("split_full") is not None
        if bwd is not None:
            q_tile, kv_tile = bwd["dq"]
            dkdv_k, dkdv_q = bwd["dkdv"]
            dq_warps, dq_stages = bwd["num_warps"], bwd["num_stages"]
            dkdv_warps = bwd.get("dkdv_num_warps", dq_warps)
            dkdv_stages = bwd.get("dkdv_num_stages", dq_stages)
            dq_cap, dkdv_cap = bwd.get("dq_maxnreg"), bwd.get("dkdv_maxnreg")
        tiles = dict(Q_T=q_tile[0], Q_H=q_tile[1], Q_W=q_tile[2], KV_T=kv_tile[0], KV_H=kv_tile[1], KV_W=kv_tile[2])
        dual = dict(K_T=dkdv_k[0], K_H=dkdv_k[1], K_W=dkdv_k[2], Q_T=dkdv_q[0], Q_H=dkdv_q[1], Q_W=dkdv_q[2])
        for use_tma in ((True,) if core else (False, True)) if arch == "sm90" else (False,):
            # As the forward: the plain mask and the cycle of modes, alternately.
            modes = (0, 0, 0) if (i + use_tma) % 2 == 1 else MASK_CYCLE[i % len(MASK_CYCLE)]
            modes = dict(zip(("MASK_T", "MASK_H", "MASK_W"), modes))
            dil = dict(DIL_T=1, DIL_H=1, DIL_W=1) if use_tma else dilated
            # dK/dV: mask-free (every pair full) on every other configuration.
            dkdv_masks = dict.fromkeys(("MASK_T", "MASK_H", "MASK_W"), 3 if (i + use_tma) % 2 else 0)
            dq = fits(compile_for(na3d_bwd_dq_kernel, target, dict(base, HAS_DLSE=True, USE_TMA=use_tma, REDO=False,
                                                                   SPLIT_FULL=dq_split, **tiles, **modes, **dil),
                                  dq_warps, dq_stages, dq_cap), "dQ")
            expected = product_instruction(arch, q_tile[0] * q_tile[1] * q_tile[2], dq_warps)
            assert expected in dq.asm[asm], f"{arch} {bucket}: dQ has no {expected}"
            if i == 0 and not dq_split and not core:
                fits(compile_for(na3d_bwd_dq_kernel, target, dict(base, HAS_DLSE=True, USE_TMA=use_tma, REDO=False,
                                                                  SPLIT_FULL=True, **tiles, **modes, **dil),
                                 dq_warps, dq_stages, dq_cap), "split dQ")
            dkdv_split = bwd is not None and bwd.get("dkdv_split_full") is not None
            dkdv = fits(compile_for(na3d_bwd_dkdv_kernel, target,
                                    dict(base, ACCUMULATE_DQ=False, USE_TMA=use_tma, BULK_DQ=False, REDO=False,
                                         SPLIT_FULL=dkdv_split, **dual, **dil, **dkdv_masks),
                                    dkdv_warps, dkdv_stages, dkdv_cap), "dK/dV")
            expected = product_instruction(arch, dkdv_k[0] * dkdv_k[1] * dkdv_k[2], dkdv_warps)
            assert expected in dkdv.asm[asm], f"{arch} {bucket}: dK/dV has no {expected}"
            if i == 0 and not dkdv_split and not core:
                fits(compile_for(na3d_bwd_dkdv_kernel, target,
                                 dict(base, ACCUMULATE_DQ=False, USE_TMA=use_tma, BULK_DQ=False, REDO=False,
                                      SPLIT_FULL=True, **dual, **dil, **PLAIN_MASKS),
                                 dkdv_warps, dkdv_stages, dkdv_cap), "split dK/dV")
            # A backward's other dQ and dK/dV pairs, which configs.fit_backward takes per call (slow run).
            for alt_q, alt_k in (bwd or {}).get("dq_alternatives", ()) if not core else ():
                alt = fits(compile_for(na3d_bwd_dq_kernel, target,
                                       dict(base, HAS_DLSE=True, USE_TMA=use_tma, REDO=False, SPLIT_FULL=dq_split,
                                            Q_T=alt_q[0], Q_H=alt_q[1], Q_W=alt_q[2], KV_T=alt_k[0], KV_H=alt_k[1],
                                            KV_W=alt_k[2], **modes, **dil),
                                       dq_warps, dq_stages, dq_cap), f"dQ {alt_q}/{alt_k}")
                alt_instruction = product_instruction(arch, alt_q[0] * alt_q[1] * alt_q[2], dq_warps)
                assert alt_instruction in alt.asm[asm], f"{arch} {bucket}: dQ {alt_q}/{alt_k} has no {alt_instruction}"
            for alt_k, alt_q in (bwd or {}).get("dkdv_alternatives", ()) if not core else ():
                alt = fits(compile_for(na3d_bwd_dkdv_kernel, target,
                                       dict(base, ACCUMULATE_DQ=False, USE_TMA=use_tma, BULK_DQ=False, REDO=False,
                                            SPLIT_FULL=dkdv_split, K_T=alt_k[0], K_H=alt_k[1], K_W=alt_k[2],
                                            Q_T=alt_q[0], Q_H=alt_q[1], Q_W=alt_q[2], **dil, **dkdv_masks),
                                       dkdv_warps, dkdv_stages, dkdv_cap), f"dK/dV {alt_k}/{alt_q}")
                alt_instruction = product_instruction(arch, alt_k[0] * alt_k[1] * alt_k[2], dkdv_warps)
                assert alt_instruction in alt.asm[asm], f"{arch} {bucket}: dK/dV {alt_k}/{alt_q} has no {alt_instruction}"
            # The one-pass backward runs only where a table selects it (``fused``): it must
            # fit there; elsewhere it must compile (an explicit config may select it, and a
            # launch that does not fit fails with Triton's out-of-resources error).
            if core:  # (the fused backward and the second launches: every configuration's, slow run)
                if use_tma:
                    assert all("cp.async.bulk.tensor" in x.asm[asm] for x in (dq, dkdv)), bucket
                continue
            fused = compile_for(na3d_bwd_dkdv_kernel, target,
                                dict(base, ACCUMULATE_DQ=True, USE_TMA=use_tma, BULK_DQ=use_tma, REDO=False,
                                     **dual, **dil, **PLAIN_MASKS),
                                dkdv_warps, dkdv_stages, dkdv_cap)
            if bwd is not None and bwd.get("fused"):
                fits(fused, "fused dK/dV")
            assert expected in fused.asm[asm], f"{arch} {bucket}: fused backward has no {expected}"
            if use_tma == (arch == "sm90"):
                redo = fits(compile_for(na3d_bwd_dq_kernel, target, dict(base, HAS_DLSE=True, USE_TMA=use_tma,
                                                                         REDO=True, SPLIT_FULL=dq_split, **tiles,
                                                                         **modes, **dil),
                                        dq_warps, 1), "dQ's second launch")
                dependent_launch(arch, asm, dq, redo)
                redo = fits(compile_for(na3d_bwd_dkdv_kernel, target,
                                        dict(base, ACCUMULATE_DQ=True, USE_TMA=use_tma, BULK_DQ=use_tma, REDO=True,
                                             SPLIT_FULL=dkdv_split, **dual, **dil, **PLAIN_MASKS), dkdv_warps, 1),
                            "dK/dV's second launch")
                dependent_launch(arch, asm, dkdv, redo)
                if i == 0 and not core:
                    one_launch(arch, asm, fits(compile_for(na3d_bwd_dq_kernel, target, dict(
                        base, HAS_DLSE=True, USE_TMA=use_tma, REDO=False, REDO_IN_PROGRAM=True, SPLIT_FULL=dq_split,
                        **tiles, **modes, **dil), dq_warps, dq_stages, dq_cap), "dQ redoing in program"))
                    for accumulate in (False, True):
                        one_launch(arch, asm, fits(compile_for(na3d_bwd_dkdv_kernel, target, dict(
                            base, ACCUMULATE_DQ=accumulate, USE_TMA=use_tma, BULK_DQ=use_tma and accumulate,
                            REDO=False, REDO_IN_PROGRAM=True, SPLIT_FULL=False, **dual, **dil, **PLAIN_MASKS),
                            dkdv_warps, dkdv_stages, dkdv_cap), "dK/dV redoing in program"))
            if use_tma:
                assert all("cp.async.bulk.tensor" in x.asm[asm] for x in (dq, dkdv, fused)), bucket
                assert "cp.reduce.async.bulk.tensor" in fused.asm[asm], f"{bucket}: fused dQ is not a bulk reduction"
        delta = dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, HAS_DLSE=True,
                     Q_T=q_tile[0], Q_H=q_tile[1], Q_W=q_tile[2])
        compile_for(na3d_bwd_delta_kernel, target, delta, 4, 1)
    which = ("the first table configuration's core" if core else "the first table configuration" if first_only
             else "every table configuration")
    print(f"{arch}: all kernels compiled with {which}, within {SHARED_LIMIT[arch]} B of shared memory")


def dependent_launch(arch, asm, first, second):
    """On sm90 a kernel's first launch lets its second start early and the second
    waits for the first's results (kernels/programs.py); elsewhere neither is there."""
    signals = ("griddepcontrol.launch_dependents" in first.asm[asm], "griddepcontrol.wait" in second.asm[asm])
    assert signals == ((True, True) if arch == "sm90" else (False, False)), f"{arch}: griddepcontrol {signals}"


def one_launch(arch, asm, kernel):
    """A kernel that redoes flagged tiles in its own programs has no second launch to
    signal (``REDO_IN_PROGRAM``: the launcher sets PDL off; the kernel ignores it)."""
    assert "griddepcontrol" not in kernel.asm[asm], f"{arch}: griddepcontrol in a one-launch kernel"


def compile_in_fresh_interpreter(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.skipif(triton is None, reason="Triton is not installed")
@pytest.mark.parametrize("arch", ["sm90"])
def test_first_configuration_compiles_for_target(arch):
    # The default run's compile check: sm90, the measured target (its first table
    # configuration's forward, dQ and dK/dV: 4 compiles with the delta kernel, about 9 s
    # from a cold cache on 2 cores, where every variant took 110 s). Every variant of every
    # configuration, on every target, compiles in the slow run (below).
    compile_in_fresh_interpreter(arch, "--first", "--core")


@pytest.mark.slow
@pytest.mark.skipif(triton is None, reason="Triton is not installed")
@pytest.mark.parametrize("arch", list(TARGETS))
def test_kernels_compile_for_target(arch):
    compile_in_fresh_interpreter(arch)


if __name__ == "__main__":
    compile_all(sys.argv[1], first_only="--first" in sys.argv[2:] or "--core" in sys.argv[2:],
                core="--core" in sys.argv[2:])
