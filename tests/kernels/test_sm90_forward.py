"""The Gluon sm90 forward for perfectly block-sparse calls (``kernels/sm90_forward.py``).

On the CPU: which calls the launcher hands it (``launch.sm90_block_sparse_slots``,
the GPU's answers faked) and that the table's strided entries carry its settings.
On an sm90 GPU: its outputs and lse against the float64 oracle (bf16 and fp16, head
dims 64 and 128, B > 1, grouped heads, grids that cut the last boxes short, an output
view with padded rows, poisoned outputs), checked to run the Gluon kernel; non-finite
inputs: outputs and lse non-finite exactly where the gathered float64 oracle is (the
portable kernel's second launch redoes the flagged tiles), and bit for bit the
zeroed-input run where the input cannot reach.
"""

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch

import na3d
from na3d import configs, geometry, launch
from na3d.reference import na3d_windowed
from helpers import assert_matches_oracle, make_qkv, poisoned_like

F = (False, False, False)


def fake_sm90(monkeypatch):
    monkeypatch.setattr(launch, "kernels_interpreted", lambda: False)
    monkeypatch.setattr(launch, "device_arch", lambda device: "sm90")
    monkeypatch.setattr(launch, "tma_layout_ok", lambda *tensors, **kw: True)


def decide(shape, kernel, stride, dtype=torch.bfloat16, scale=0.1, is_causal=F, dilation=(1, 1, 1), cfg=None):
    B, T, H, W, NH, HD = shape
    q = torch.empty(shape, dtype=dtype)
    cfg = cfg or with_gluon(configs.forward_config("sm90", (T, H, W), kernel, HD, dtype, stride, is_causal))
    modes = launch.mask_modes(cfg.q_tile, cfg.kv_tile, kernel, is_causal, stride, cfg.fixed_mask, (T, H, W),
                              launch.block_sparse_axes(cfg.q_tile, cfg.kv_tile, kernel, is_causal, stride, (T, H, W),
                                                       dilation))
    return cfg, launch.sm90_block_sparse_slots(q, q, q, cfg, modes, scale, is_causal, dilation)


def test_strided_entries_pass_the_gluon_settings_through():
    entry = {"q_positions": 128, "kv_positions": 128, "num_warps": 8, "num_stages": 3,
             "sm90_gluon": {"stages": 4}}
    option = configs.stride_aligned_option(entry, (30, 48, 80), (18, 24, 24), (2, 8, 8), F)
    assert configs._sm90_gluon(option.get("sm90_gluon")) == 4
    assert configs._sm90_gluon(None) is None


def test_strided_entries_may_give_dkdv_smaller_query_boxes():
    # dkdv_q_positions: dK/dV scans boxes of that many queries (its accumulators and
    # score tiles spill at 128 by 128, head dim 128: NOTES v38); the forward's and
    # dQ's boxes stay; every pair still full on dit-hunyuan-s2x8x8.
    entry = {"q_positions": 128, "kv_positions": 128, "num_warps": 8, "num_stages": 3}
    shape, kernel, stride = (30, 48, 80), (18, 24, 24), (2, 8, 8)
    same = configs.stride_aligned_option(entry, shape, kernel, stride, F)
    half = configs.stride_aligned_option(dict(entry, dkdv_q_positions=64), shape, kernel, stride, F)
    assert (half["q_tile"], half["kv_tile"], half["backward"]["dq"]) == (same["q_tile"], same["kv_tile"],
                                                                       same["backward"]["dq"])
    k_box, q_box = half["backward"]["dkdv"]
    assert math.prod(q_box) == 64 and math.prod(same["backward"]["dkdv"][1]) == 128 and "dkdv_q_positions" not in half
    assert all(launch.block_sparse_axes(k_box, q_box, kernel, F, stride, shape, (1, 1, 1), own="keys"))


def test_sm90_table_takes_the_gluon_kernel_for_the_strided_dit_rows():
    # (measured on an H100: NOTES v37)
    for shape, kernel, stride, head_dim, want in (((30, 48, 80), (18, 24, 24), (2, 8, 8), 128, 3),
                                                 ((32, 64, 64), (16, 16, 16), (4, 4, 8), 64, 4)):
        cfg = configs.forward_config("sm90", shape, kernel, head_dim, torch.bfloat16, stride, F)
        assert cfg.bucket.endswith("/strided") and cfg.sm90_gluon == want
    assert configs.forward_config("sm90", (30, 48, 80), (18, 24, 24), 128, torch.bfloat16).sm90_gluon is None


def test_gluon_product_cost_takes_clipped_aligned_boxes_on_sm90():
    # Wan 2.1's grid at window 8x16x16, stride 2x8x8: the aligned boxes issue 1.20
    # products per useful one (the borders clip them), the stride-1 tiles 1.12; the
    # aligned boxes' products cost 0.85 on sm90 (the Gluon kernel), so they win there.
    cfg = configs.forward_config("sm90", (21, 30, 52), (8, 16, 16), 128, torch.bfloat16, (2, 8, 8), F)
    assert cfg.bucket.endswith("/strided") and cfg.sm90_gluon == 3 and math.prod(cfg.q_tile) == 128
    assert geometry.full_products_share((21, 30, 52), (8, 16, 16), cfg.q_tile, cfg.kv_tile, F, (2, 8, 8)) == 1.0
    # The backward has no Gluon kernel: it keeps the choice by products alone (the
    # stride-1 tiles; with the aligned ones Wan's training step took 1574 against
    # 1367 ms: NOTES v38).
    assert configs.backward_config("sm90", (21, 30, 52), (8, 16, 16), 128, torch.bfloat16, (2, 8, 8),
                                   F).bucket == "dit_large_window"
    # Where the Gluon kernel cannot run (head dim 96), the fewer products win.
    assert configs.forward_config("sm90", (21, 30, 52), (8, 16, 16), 96, torch.bfloat16, (2, 8, 8),
                                  F).bucket == "dit_large_window"
    # Without the weight, the fewer products win.
    assert geometry.issued_flops_ratio((21, 30, 52), (8, 16, 16), cfg.q_tile, cfg.kv_tile, F, (2, 8, 8)) > \
        geometry.issued_flops_ratio((21, 30, 52), (8, 16, 16), (2, 8, 4), (2, 8, 2), F, (2, 8, 8))


def with_gluon(cfg):
    return dataclasses.replace(cfg, sm90_gluon=4)


def test_block_sparse_calls_take_the_gluon_kernel(monkeypatch):
    fake_sm90(monkeypatch)
    cfg, slots = decide((1, 30, 48, 80, 24, 128), (18, 24, 24), (2, 8, 8))
    assert slots == cfg.sm90_gluon == 4
    assert all(launch.block_sparse_axes(cfg.q_tile, cfg.kv_tile, (18, 24, 24), F, (2, 8, 8), (30, 48, 80), (1, 1, 1)))


@pytest.mark.parametrize("change", ["causal", "dilation", "negative scale", "fp32", "head dim 32", "stride 1",
                                    "not sm90", "masked"])
def test_other_calls_keep_the_portable_kernel(monkeypatch, change):
    fake_sm90(monkeypatch)
    shape, kernel, stride = [1, 30, 48, 80, 24, 128], (18, 24, 24), (2, 8, 8)
    kw = {}
    if change == "causal":
        kw["is_causal"] = (True, False, False)
    elif change == "dilation":
        kw["dilation"] = (1, 2, 1)
    elif change == "negative scale":
        kw["scale"] = -0.1
    elif change == "fp32":
        kw["dtype"] = torch.float32
        kw["cfg"] = dataclasses.replace(configs.forward_config("sm90", (30, 48, 80), kernel, 128, torch.float32,
                                                               stride, F), sm90_gluon=4)
    elif change == "head dim 32":
        shape[-1] = 32
    elif change == "stride 1":
        stride = (1, 1, 1)
    elif change == "not sm90":
        monkeypatch.setattr(launch, "device_arch", lambda device: "gfx942")
    elif change == "masked":  # a stride of 3 along T: boxes of 2 frames straddle its groups
        stride = (3, 8, 8)
    cfg, slots = decide(tuple(shape), kernel, stride, **kw)
    assert slots is None


# --------------------------------------------------------------------------------
# GPU (sm90): exactness of the Gluon kernel
# --------------------------------------------------------------------------------

def on_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and torch.version.hip is None


CASES = [  # shape, key/value heads, kernel, stride, (query box, key box), Gluon slots
    ((2, 6, 20, 24, 3, 128), 3, (4, 8, 16), (2, 8, 8), ((2, 8, 8), (1, 8, 8)), 4),
    ((2, 6, 20, 24, 3, 128), 3, (4, 8, 16), (2, 8, 8), ((2, 8, 8), (2, 8, 8)), 3),
    ((1, 5, 16, 40, 4, 64), 2, (4, 8, 16), (2, 8, 8), ((2, 8, 8), (2, 4, 16)), 3),
    ((1, 8, 12, 36, 2, 64), 1, (4, 4, 8), (4, 4, 8), ((4, 4, 8), (2, 4, 8)), 4),
    # every axis' last box cut short by the grid, key boxes (1,8,16): as Wan's 21x30x52
    ((1, 5, 14, 20, 2, 128), 2, (4, 8, 16), (2, 8, 8), ((2, 8, 8), (1, 8, 16)), 3),
]
IDS = ["hd128-kv64", "hd128-kv128", "hd64-gqa-short", "hd64-mqa", "hd128-clipped"]


def run_gluon(case, dtype, seed, out=None, assume_finite=False, q=None, k=None, v=None):
    shape, kv_heads, kernel, stride, (q_box, kv_box), gluon = case
    if q is None:
        q, k, v = make_qkv(shape, dtype, device="cuda", seed=seed)
        k, v = k[..., :kv_heads, :].contiguous(), v[..., :kv_heads, :].contiguous()
    cfg = configs.ForwardConfig(q_box, kv_box, 8, 2, sm90_gluon=gluon)
    calls = []
    launched = launch.sm90_block_sparse_forward

    def spy(*args, **kwargs):
        calls.append(args[6])
        return launched(*args, **kwargs)

    launch.sm90_block_sparse_forward = spy
    try:
        out = poisoned_like(q) if out is None else out
        out, lse = launch.na3d_forward(q, k, v, kernel, 0.3, return_lse=True, out=out, config=cfg, stride=stride,
                                       assume_finite=assume_finite)
    finally:
        launch.sm90_block_sparse_forward = launched
    assert calls, "the Gluon kernel did not run"
    return (q, k, v), out, lse


@pytest.mark.gpu
@pytest.mark.skipif(not on_sm90(), reason="needs a GPU of compute capability 9.x (Hopper)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_gluon_forward_matches_oracle(case, dtype):
    (q, k, v), out, lse = run_gluon(CASES[case], dtype, seed=300 + case)
    shape, _, kernel, stride = CASES[case][:4]
    assert_matches_oracle(out.cpu(), q.cpu(), k.cpu(), v.cpu(), kernel, 0.3, stride=stride)
    _, want_lse = na3d.na3d_brute_force(q.cpu().double(), k.cpu().double(), v.cpu().double(), kernel, 0.3,
                                        stride=stride, return_lse=True)
    assert (lse.cpu().double() - want_lse).abs().max().item() < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not on_sm90(), reason="needs a GPU of compute capability 9.x (Hopper)")
def test_gluon_forward_into_a_strided_view():
    # An output whose rows are padded (head dim contiguous, as the API requires).
    case = CASES[0]
    q, k, v = make_qkv(case[0], torch.bfloat16, device="cuda", seed=320)
    wide = torch.full(case[0][:5] + (2 * case[0][5],), float("nan"), dtype=torch.bfloat16, device="cuda")
    view = wide[..., :case[0][5]]
    run_gluon(case, torch.bfloat16, 0, out=view, q=q, k=k, v=v)
    assert_matches_oracle(view.cpu(), q.cpu(), k.cpu(), v.cpu(), case[2], 0.3, stride=case[3])
    assert torch.isnan(wide[..., case[0][5]:]).all(), "wrote outside the view"


@pytest.mark.gpu
@pytest.mark.skipif(not on_sm90(), reason="needs a GPU of compute capability 9.x (Hopper)")
@pytest.mark.parametrize("what", ["nan key", "inf value", "-inf query"])
def test_gluon_forward_keeps_nonfinite_inputs_in_their_windows(what):
    # The Gluon kernel flags the tiles an inf or NaN reaches; the portable kernel's
    # second launch redoes them the safe way. Non-finite exactly where the gathered
    # float64 oracle is; bit for bit the zeroed-input run where the input cannot reach
    # (as tests/kernels/test_nonfinite.py asks of the portable kernels).
    case = CASES[0]
    q, k, v = make_qkv(case[0], torch.bfloat16, device="cuda", seed=330)
    which, value = {"nan key": (1, float("nan")), "inf value": (2, float("inf")),
                    "-inf query": (0, float("-inf"))}[what]
    index = (1, 3, 9, 17, 1, 5)
    inputs = [q, k, v]
    zeroed = [t.clone() for t in inputs]
    inputs[which][index] = value
    zeroed[which][index] = 0.0
    _, out, lse = run_gluon(case, torch.bfloat16, 0, q=inputs[0], k=inputs[1], v=inputs[2])
    # (an inf value leaves every lse finite; the outputs it reaches are not)
    _, out_z, lse_z = run_gluon(case, torch.bfloat16, 0, q=zeroed[0], k=zeroed[1], v=zeroed[2])
    for got, got_z, (want, want_z) in (
            (out, out_z, (na3d_windowed(*(t.cpu().double() for t in inputs), case[2], 0.3, stride=case[3]),
                          na3d_windowed(*(t.cpu().double() for t in zeroed), case[2], 0.3, stride=case[3]))),
            (lse, lse_z, (na3d_windowed(*(t.cpu().double() for t in inputs), case[2], 0.3, stride=case[3],
                                        return_lse=True)[1],
                          na3d_windowed(*(t.cpu().double() for t in zeroed), case[2], 0.3, stride=case[3],
                                        return_lse=True)[1]))):
        got, got_z = got.cpu(), got_z.cpu()
        assert torch.equal(torch.isfinite(got), torch.isfinite(want))
        unreached = want == want_z
        assert torch.equal(got[unreached], got_z[unreached])
    assert not torch.isfinite(out).all()


# --------------------------------------------------------------------------------
# CPU: the table's Gluon configurations compile for sm90, fit its shared memory,
# and ptxas keeps their products asynchronous (NOTES v37: a producer partition
# made it serialize them, with a warning and no error)
# --------------------------------------------------------------------------------

SM90_SHARED = 232448  # bytes of shared memory one block may opt into on H100/H200


def table_gluon_configs():
    """(head dim, query box, key box, slots) of every sm90_gluon the sm90 table sets."""
    found = []
    for entry in configs.load_table("sm90")["forward"]:
        gluon = entry.get("strided", {}).get("sm90_gluon")
        if gluon is None:
            continue
        when = entry.get("when", {})
        head_dim = 128 if when.get("head_dim_min", 0) > 64 else 64  # (the buckets before take the others)
        keys = entry["strided"]["kv_positions"]  # (the entry's key boxes; any box of that many keys)
        kv_box = {128: (2, 8, 8), 64: (1, 8, 8)}[keys]
        found.append((head_dim, (2, 8, 8), kv_box, gluon["stages"]))
    return found


def build_gluon_for_sm90(head_dim, q_box, kv_box, stages, return_lse=True, assume_finite=False, **switches):
    """The Gluon forward compiled for sm90 (no GPU: a driver that answers sm90), with
    ``switches`` (its measurement switches); also ``benchmarks/sm90_gluon_sass.py``'s."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.driver import driver

    from na3d.kernels.sm90_forward import na3d_fwd_sm90_kernel

    class Sm90Driver:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    driver.set_active(Sm90Driver())
    B, T, H, W, NH = 1, 8, 32, 32, 2
    x = torch.empty(B, T, H, W, NH, head_dim, dtype=torch.bfloat16)

    def descriptor(box):
        block = [1, *box, head_dim]
        return TensorDescriptor(x, [B, T, H, W, NH * head_dim], list(x.stride()[:4]) + [1], block,
                                gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))

    lse = torch.empty(B, T, H, W, NH)
    flags = torch.empty(64, dtype=torch.int8)
    return na3d_fwd_sm90_kernel.warmup(
        descriptor(q_box), descriptor(kv_box), descriptor(kv_box), x, lse, flags, tuple(x.stride()[:5]), T, H, W,
        4, 16, 16, 2, 8, 8, 4, 4, NH, 0.1, q_box, kv_box, 1, head_dim, stages, return_lse, assume_finite, grid=(1,),
        num_warps=4, **switches)


def compile_gluon_for_sm90(head_dim, q_box, kv_box, stages):
    """Compile the Gluon forward for sm90 (:func:`build_gluon_for_sm90`); return
    (shared memory bytes, ptxas's report)."""
    from triton.backends.nvidia.compiler import get_ptxas

    kernel = build_gluon_for_sm90(head_dim, q_box, kv_box, stages)
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        ptx = os.path.join(folder, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        report = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", ptx, "-o",
                                 os.path.join(folder, "kernel.cubin")], capture_output=True, text=True)
    assert report.returncode == 0, report.stderr[-2000:]
    return kernel.metadata.shared, report.stderr


@pytest.mark.parametrize("build", table_gluon_configs() or [pytest.param(None, marks=pytest.mark.skip)],
                         ids=lambda b: "none" if b is None else f"hd{b[0]}-kv{'x'.join(map(str, b[2]))}-s{b[3]}")
def test_table_gluon_configurations_compile_for_sm90(build):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      env.get("PYTHONPATH")]))  # (tests/, for helpers)
    done = subprocess.run([sys.executable, __file__, *map(str, [build[0], *build[1], *build[2], build[3]])],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


if __name__ == "__main__":  # one build in a fresh interpreter (the test session may interpret kernels)
    values = [int(a) for a in sys.argv[1:]]
    shared, report = compile_gluon_for_sm90(values[0], tuple(values[1:4]), tuple(values[4:7]), values[7])
    assert shared <= SM90_SHARED, f"{shared} bytes of shared memory, {SM90_SHARED} available"
    assert "C751" not in report, f"ptxas serializes the products: {report}"
    print(shared, report.strip().splitlines()[-2:])
