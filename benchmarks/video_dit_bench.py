"""Video DiTs and ComfyUI on na3d: the rows wan-1.3b-step, hunyuan-blocks and comfy-ltx.

On the GPU machine (H100 or H200; Python 3.12, torch 2.11, no network, no diffusers),
from the repository root, carrying ``.whl`` (the diffusers wheel), ``.ck`` (comfy-kitchen,
unpacked) and ``.peers`` (NATTEN's Hopper build), as benchmarks/NOTES.md and
../shared/peers/README.md describe them:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/.ck:$PWD/.peers:$PWD/src PYTHONUNBUFFERED=1 && python3 benchmarks/video_dit_bench.py

(carry [".whl", ".ck", ".peers"]; about 3-4 minutes on an H100, most of it the dense
baselines and the first compilation of na3d's kernels; ``--only wan``, ``--only hunyuan``
or ``--only comfy`` runs one part; each run merges its rows into the results file;
``--rounds N`` times the methods N times, taking turns, and keeps the medians).

What it measures, in one process, median GPU time by CUDA events (``na3d.tools.common.Timer``,
L2 flushed before each run), random bf16 weights at full width:

* ``wan-1.3b-step``: diffusers' ``WanTransformer3DModel`` with the Wan 2.1 T2V 1.3B
  config (30 blocks, 12 heads of 128), parameters in bf16 but for the modules diffusers
  keeps in float32 (``_keep_in_fp32_modules``), on the latent of 81 frames at 480x832
  (1x16x21x60x104: 21x30x52 = 32760 tokens) and 512 text tokens. Pass ``fwd`` (no grad)
  and ``fwd+bwd`` (a training step: forward, an MSE loss, backward to every parameter,
  with diffusers' gradient checkpointing per block, for every method: without it the
  dense model's activations do not fit 78 GiB). Methods: ``dense`` (diffusers'
  default processors, SDPA), ``na3d`` (window 9x15x15), ``na3d_strided`` (window 8x16x16,
  2048 keys, stride 2x8x8: block-sparse on this grid with the boxes na3d picks;
  ``--wan-strided``), ``natten`` and ``natten_strided`` (NATTEN's Hopper FNA through the
  same switch, its default configuration), where NATTEN imports; with ``--attention-free``,
  ``attention_free``: the same switch with an operator that attends to nothing (the
  model's time outside self-attention, so the ceiling of any attention's speedup).
* ``hunyuan-blocks``: ``HunyuanVideoTransformer3DModel`` at full width (24 heads of 128)
  with two blocks, one dual-stream and one single-stream (and its text refiner), on the
  30x48x80 token grid (latent 1x16x30x96x160) with 256 text tokens, the last 64 of them
  padding (the model's key mask). Same passes and methods at window 18x24x24, stride 1
  and (2, 8, 8). Dense is diffusers' default: SDPA with the model's boolean key mask.
* ``comfy-ltx/<shape>``: ``comfy_kitchen.na3d`` (ComfyUI's call) on each LTX shape, bf16,
  before and after ``na3d.comfy_kitchen.register()``: eager time (``ms``) and GPU time by
  CUDA-graph replay (``gpu_ms``), the backend the registry picked each time, and the
  largest difference between the two outputs.

Rows go into ``benchmarks/results/<card>.json`` (``h100.json``, ``h200.json``), merged with
the rows already there (same name and pass replaced), each row stamped with its own
device, commit, date and versions (the file's top-level fields describe its other rows).
A compact table at the end.

``--tiny``: the same code on tiny models and shapes, on the CPU (float32, na3d's exact
reference; NATTEN's CPU path where it imports), written to a temporary folder: the
script's logic, end to end, without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Callable, List, Optional

import torch

from na3d.tools import peers
from na3d.tools.bench import device_slug, git_commit, write_merged_results
from na3d.tools.common import Timer, bench_shapes, log

# diffusers' config of Wan-AI/Wan2.1-T2V-1.3B-Diffusers (transformer/config.json).
WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
                rope_max_seq_len=1024)
# HunyuanVideo's config (the class defaults, hunyuanvideo-community/HunyuanVideo) with two blocks.
HUNYUAN_TWO_BLOCKS = dict(num_layers=1, num_single_layers=1)

FULL = dict(
    # The strided window of Wan: 8x16x16 (2048 keys, as 9x15x15's 2025) with stride 2x8x8 is
    # block-sparse on the 21x30x52 grid with the boxes na3d picks for it
    # (geometry.full_products_share 1.0, 1.2 products issued per useful one; 9x15x15 at
    # stride 1: 2.85, none of them full).
    wan=dict(config=WAN_1_3B, latent=(1, 16, 21, 60, 104), text=512, kernel=(9, 15, 15),
             strided=((8, 16, 16), (2, 8, 8))),
    hunyuan=dict(config=HUNYUAN_TWO_BLOCKS, latent=(1, 16, 30, 96, 160), text=256, valid_text=192,
                 kernel=(18, 24, 24), strided=((18, 24, 24), (2, 8, 8))),
)
TINY = dict(
    wan=dict(config=dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                         out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32),
             latent=(1, 4, 5, 8, 12), text=7, kernel=(3, 3, 5), strided=((2, 4, 4), (1, 2, 2))),
    hunyuan=dict(config=dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                             num_layers=1, num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0,
                             text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(4, 6, 6)),
                 latent=(1, 4, 5, 8, 12), text=7, valid_text=5, kernel=(3, 3, 5), strided=((3, 3, 5), (1, 2, 3))),
)
TINY_COMFY_SHAPES = [dict(name="tiny-a", shape=[1, 4, 6, 8, 2, 64], kernel_size=[3, 5, 5]),
                     dict(name="tiny-b", shape=[1, 3, 5, 40, 2, 64], kernel_size=[3, 5, 27])]
TARGETS = {"wan-1.3b-step": {"fwd": 2.0, "fwd+bwd": 1.8}}
COMFY_TARGET = 5.0


# ---------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------

class CpuTimer:
    """``Timer``'s call on the CPU (``--tiny``): median wall time of ``runs`` runs after one warm-up."""

    def __call__(self, fn: Callable, min_runs: int = 3, target_ms: float = 0.0, max_runs: int = 3) -> float:
        fn()
        times = []
        for _ in range(max(1, min_runs)):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def significant(x: float) -> float:
    """Three significant digits (differences of 1e-7 stay visible)."""
    return float(f"{x:.3g}")


def peak_gib(device) -> Optional[float]:
    return round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 2) if device.type == "cuda" else None


def reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ---------------------------------------------------------------------------------------
# The models and the methods: one switch, several attention operators
# ---------------------------------------------------------------------------------------

def processors_with(operator: type) -> dict:
    """WanNA3DProcessor and HunyuanVideoNA3DProcessor with ``operator``'s ``attention`` in place of
    na3d's: the same switch, the same projections, another operator."""
    from na3d.diffusers import HunyuanVideoNA3DProcessor, WanNA3DProcessor

    return {"wan": type(f"{operator.__name__}Wan", (operator, WanNA3DProcessor), {}),
            "hunyuan": type(f"{operator.__name__}Hunyuan", (operator, HunyuanVideoNA3DProcessor), {})}


def natten_processors(backend: Optional[str]) -> dict:
    """The processors with NATTEN's ``na3d`` as their operator (contiguous inputs: NATTEN misreads
    strided ones)."""
    class Natten:
        def attention(self, query, key, value, return_lse=False):
            import natten
            query, key, value = (x.contiguous() for x in (query, key, value))
            return natten.na3d(query, key, value, self.kernel_size, stride=self.stride, dilation=self.dilation,
                               is_causal=self.is_causal, return_lse=return_lse, backend=backend)

    return processors_with(Natten)


def attention_free_processors() -> dict:
    """The processors with an operator that attends to nothing: the output is the values (plus the queries
    and keys times zero, so that every projection stays in the graph, forward and backward). What the model
    spends outside self-attention, measured: the ceiling of any attention's speedup over dense."""
    class NoAttention:
        def attention(self, query, key, value, return_lse=False):
            out = value + (query + key) * 0
            if not return_lse:
                return out
            return out, torch.zeros(query.shape[:-1], device=query.device, dtype=torch.float32)

    return processors_with(NoAttention)


def build_model(family: str, spec: dict, device, dtype):
    """A randomly initialized model on ``device``: parameters in ``dtype``, except those diffusers keeps in
    float32 when loading a checkpoint in ``dtype`` (``_keep_in_fp32_modules``); buffers as created."""
    from diffusers import HunyuanVideoTransformer3DModel, WanTransformer3DModel

    cls = WanTransformer3DModel if family == "wan" else HunyuanVideoTransformer3DModel
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(**spec["config"])
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    for name, param in model.named_parameters():
        if not any(part in name.split(".") for part in keep):
            param.data = param.data.to(dtype)
    return model


def model_inputs(family: str, spec: dict, device, dtype) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(1)

    def rand(*shape):
        return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)

    latent = spec["latent"]
    inputs = dict(hidden_states=rand(*latent), timestep=torch.tensor([500], device=device), return_dict=False)
    if family == "wan":
        text_dim = spec["config"].get("text_dim", 4096)
        return dict(inputs, encoder_hidden_states=rand(1, spec["text"], text_dim))
    config = spec["config"]
    mask = (torch.arange(spec["text"]) < spec["valid_text"]).long()[None].to(device)
    return dict(inputs, encoder_hidden_states=rand(1, spec["text"], config.get("text_embed_dim", 4096)),
                encoder_attention_mask=mask, pooled_projections=rand(1, config.get("pooled_projection_dim", 768)),
                guidance=torch.tensor([6000.0], device=device, dtype=dtype))


def methods_for(family: str, spec: dict, natten_backend: Optional[str], with_natten: bool,
                attention_free: bool = False) -> dict:
    """name -> (kernel_size, stride, processor class or None for na3d's); ``dense`` is None."""
    kernel, stride = spec["strided"]
    methods = {"dense": None, "na3d": (spec["kernel"], 1, None), "na3d_strided": (kernel, stride, None)}
    if with_natten:
        natten = natten_processors(natten_backend)[family]
        methods.update(natten=(spec["kernel"], 1, natten), natten_strided=(kernel, stride, natten))
    if attention_free:
        methods.update(attention_free=(spec["kernel"], 1, attention_free_processors()[family]))
    return methods


def switch_to(model, family: str, method) -> None:
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor
    from na3d.diffusers import use_na3d

    if method is None:  # diffusers' default
        if family == "wan":
            model.set_attn_processor(WanAttnProcessor())
        else:
            for block in (*model.transformer_blocks, *model.single_transformer_blocks):
                block.attn.set_processor(HunyuanVideoAttnProcessor2_0())
        return
    kernel_size, stride, processor = method
    if processor is None:
        use_na3d(model, kernel_size=kernel_size, stride=stride)
    else:
        use_na3d(model, processor(kernel_size, stride))


def dit_rows(family: str, name: str, spec: dict, timer, device, dtype, runs: int, step_runs: int, methods: dict,
             stamp: dict, rounds: int = 1) -> List[dict]:
    """The fwd and fwd+bwd rows of one model: every method timed on the same model and
    inputs. Over ``rounds`` rounds the methods take turns (the order rotating each
    round) and each row keeps the median of its rounds (all of them in ``ms_rounds``):
    an H100 at its power cap moves its clock between measurements (NOTES v38)."""
    model = build_model(family, spec, device, dtype)
    inputs = model_inputs(family, spec, device, dtype)
    config = dict(model.config)
    latent = spec["latent"]
    patch = (config["patch_size"] if family == "wan" else
             (config["patch_size_t"], config["patch_size"], config["patch_size"]))
    grid = [n // p for n, p in zip(latent[2:], patch)]
    common = dict(model=type(model).__name__, latent=list(latent), grid=grid, tokens=grid[0] * grid[1] * grid[2],
                  heads=config["num_attention_heads"], head_dim=config["attention_head_dim"],
                  dtype=str(dtype).replace("torch.", ""), kernel_size=list(spec["kernel"]), text_tokens=spec["text"],
                  params_m=round(sum(p.numel() for p in model.parameters()) / 1e6, 1), **stamp)
    if family == "hunyuan":
        common.update(valid_text_tokens=spec["valid_text"],
                      blocks={"dual_stream": config["num_layers"], "single_stream": config["num_single_layers"]})
    windows = {m: dict(kernel_size=list(v[0]), stride=list(v[1]) if isinstance(v[1], (tuple, list)) else [v[1]] * 3)
               for m, v in methods.items() if v is not None}
    fwd = dict(common, name=name, **{"pass": "fwd"}, ms={}, errors={}, windows=windows, runs=runs)
    step = dict(common, name=name, **{"pass": "fwd+bwd"}, ms={}, errors={}, windows=windows, runs=step_runs,
                gradient_checkpointing=True, peak_gib={})
    target = torch.randn(inputs["hidden_states"].shape, generator=torch.Generator().manual_seed(2)).to(device)
    outputs, last = {}, {}

    def forward():
        with torch.no_grad():
            last["out"] = model(**inputs)[0]

    def training_step():
        model.zero_grad(set_to_none=True)
        out = model(**inputs)[0]
        torch.nn.functional.mse_loss(out.float(), target).backward()

    times = {"fwd": {}, "step": {}}
    order = list(methods)
    for round_ in range(rounds):
        turn = round_ % len(order)
        for method in order[turn:] + order[:turn]:
            how = methods[method]
            if method in fwd["errors"] and method in step["errors"]:
                continue
            log(f"  {name} {method}" + (f" (round {round_ + 1})" if rounds > 1 else ""))
            try:
                switch_to(model, family, how)
            except Exception as exc:  # e.g. a window the API refuses
                fwd["errors"][method] = step["errors"][method] = f"{type(exc).__name__}: {exc}"[:300]
                continue
            model.disable_gradient_checkpointing()
            model.eval()
            reset_peak(device)
            if method not in fwd["errors"]:
                try:
                    times["fwd"].setdefault(method, []).append(
                        timer(forward, min_runs=runs, target_ms=0.0, max_runs=runs))
                    out = last.pop("out")
                    if method not in outputs:
                        outputs[method] = out.float().cpu()
                except Exception as exc:
                    fwd["errors"][method] = f"{type(exc).__name__}: {exc}"[:300]
            model.enable_gradient_checkpointing()
            model.train()
            reset_peak(device)
            if method not in step["errors"]:
                try:
                    times["step"].setdefault(method, []).append(
                        timer(training_step, min_runs=step_runs, target_ms=0.0, max_runs=step_runs))
                    step["peak_gib"][method] = peak_gib(device)
                except Exception as exc:
                    step["errors"][method] = f"{type(exc).__name__}: {exc}"[:300]
            model.zero_grad(set_to_none=True)
            reset_peak(device)
    for row, key in ((fwd, "fwd"), (step, "step")):
        done = {m: v for m, v in times[key].items() if m not in row["errors"]}
        row["ms"] = {m: round(statistics.median(v), 3) for m, v in done.items()}
        if rounds > 1:
            row["ms_rounds"] = {m: [round(t, 3) for t in v] for m, v in done.items()}
    for row in (fwd, step):
        dense = row["ms"].get("dense")
        row["speedup_vs_dense"] = {m: round(dense / ms, 2) for m, ms in row["ms"].items() if dense and m != "dense"}
        if not row["errors"]:
            del row["errors"]
    # NATTEN against na3d on the same window (the same projections around both): bf16 rounding apart.
    fwd["max_abs_diff"] = {f"{other}_vs_{base}": significant((outputs[other] - outputs[base]).abs().max().item())
                           for base, other in (("na3d", "natten"), ("na3d_strided", "natten_strided"), ("dense", "na3d"))
                           if base in outputs and other in outputs}
    if "natten" in methods and family == "hunyuan":
        step["note"] = ("NATTEN's hopper-fna backward ignores the gradient of its log-sum-exps, which the merge "
                        "with the text tokens uses: its fwd+bwd time is a timing, its gradients are not exact")
    model = inputs = outputs = None  # (freed; the timed closures above read them)
    reset_peak(device)
    return [fwd, step]


# ---------------------------------------------------------------------------------------
# comfy-kitchen: comfy_kitchen.na3d before and after na3d.comfy_kitchen.register()
# ---------------------------------------------------------------------------------------

def comfy_rows(shapes: List[dict], timer, gpu_timer, device, dtype, stamp: dict) -> List[dict]:
    import comfy_kitchen
    from comfy_kitchen.registry import registry

    import na3d.comfy_kitchen as backend

    backend.unregister()
    rows = []
    for spec in shapes:
        shape, kernel = spec["shape"], list(spec["kernel_size"])
        log(f"  comfy-ltx/{spec['name']} {shape} kernel {kernel}")
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
        call_kwargs = dict(q=q, k=k, v=v, kernel_size=kernel, is_causal=[False] * 3, scale=None)
        row = dict(name=f"comfy-ltx/{spec['name']}", group="comfy-ltx", **{"pass": "fwd"}, shape=shape,
                   kernel_size=kernel, dtype=str(dtype).replace("torch.", ""), call="comfy_kitchen.na3d(q, k, v, "
                   "kernel_size, None, None)", ms={}, gpu_ms={}, backend={}, errors={}, **stamp)
        outs = {}

        def run():
            return comfy_kitchen.na3d(q, k, v, kernel, None, None)

        for when in ("before", "after"):
            if when == "after":
                backend.register()
            try:
                row["backend"][when] = registry.get_capable_backend("na3d", call_kwargs)
                row["ms"][when] = round(timer(run, min_runs=5, target_ms=200.0, max_runs=50), 4)
                outs[when] = run().float()
            except Exception as exc:
                row["errors"][when] = f"{type(exc).__name__}: {exc}"[:300]
            if gpu_timer is not None and when in row["ms"]:
                try:  # GPU time alone: the call captured in a CUDA graph, replayed
                    row["gpu_ms"][when] = round(gpu_timer(run, min_runs=5, target_ms=200.0, max_runs=50), 4)
                except Exception as exc:
                    row["errors"][f"{when}_gpu"] = f"{type(exc).__name__}: {exc}"[:300]
        backend.unregister()
        for key in ("ms", "gpu_ms"):
            times = row[key]
            if "before" in times and "after" in times:
                row[f"speedup{'' if key == 'ms' else '_gpu'}"] = round(times["before"] / times["after"], 2)
        if len(outs) == 2:
            row["max_abs_diff"] = significant((outs["before"] - outs["after"]).abs().max().item())
        for key in ("gpu_ms", "errors"):
            if not row[key]:
                del row[key]
        rows.append(row)
        q = k = v = outs = None  # (freed before the next shape; the timed closures above read them)
    return rows


# ---------------------------------------------------------------------------------------
# The table, the results file
# ---------------------------------------------------------------------------------------

def print_tables(rows: List[dict]) -> None:
    dits = [r for r in rows if "speedup_vs_dense" in r]
    if dits:
        methods = ["dense", "na3d", "na3d_strided", "natten", "natten_strided"]
        if any("attention_free" in r["ms"] for r in dits):
            methods.append("attention_free")
        log(f"\n{'row':<16}{'pass':<9}" + "".join(f"{m:>16}" for m in methods) + "   x dense (na3d, strided)")
        for r in dits:
            cells = "".join(f"{r['ms'][m]:>13.1f} ms" if m in r["ms"] else f"{'-':>16}" for m in methods)
            up = r["speedup_vs_dense"]
            target = TARGETS.get(r["name"], {}).get(r["pass"])
            verdict = "" if target is None else (" meets" if up.get("na3d", 0) >= target else " MISSES") + f" {target}x"
            log(f"{r['name']:<16}{r['pass']:<9}{cells}   {up.get('na3d', '-')}x, {up.get('na3d_strided', '-')}x"
                f"{verdict}")
        for r in dits:
            if r["pass"] == "fwd":
                log(f"  {r['name']} windows: " + ", ".join(
                    f"{m} {'x'.join(map(str, w['kernel_size']))} stride {'x'.join(map(str, w['stride']))}"
                    for m, w in r["windows"].items()))
    comfy = [r for r in rows if r.get("group") == "comfy-ltx"]
    if comfy:
        log(f"\n{'comfy-ltx':<28}{'backend':>16}{'before ms':>11}{'after ms':>10}{'x':>7}"
            f"{'before gpu':>12}{'after gpu':>11}{'x gpu':>7}")
        for r in comfy:
            ms, gpu, be = r["ms"], r.get("gpu_ms", {}), r["backend"]
            nan = float("nan")
            x_gpu = r.get("speedup_gpu", nan)
            verdict = "" if x_gpu != x_gpu else ("  meets" if x_gpu >= COMFY_TARGET else "  MISSES") + f" {COMFY_TARGET}x"
            log(f"{r['name']:<28}{be.get('before', '?') + '->' + be.get('after', '?'):>16}"
                f"{ms.get('before', nan):>11.3f}{ms.get('after', nan):>10.3f}{r.get('speedup', nan):>7.1f}"
                f"{gpu.get('before', nan):>12.3f}{gpu.get('after', nan):>11.3f}{x_gpu:>7.1f}{verdict}")
    for r in rows:
        for method, error in r.get("errors", {}).items():
            log(f"  {r['name']} {r['pass']} {method}: {error}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=("wan", "hunyuan", "comfy"), default=None,
                        help="parts to run (default: all three)")
    parser.add_argument("--runs", type=int, default=3, help="timed forwards per method (median; after a warm-up "
                        "and a first timing run)")
    parser.add_argument("--step-runs", type=int, default=2, help="timed training steps per method (median)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time the methods in this many rounds, taking turns, and keep the medians (an H100 at "
                             "its power cap moves its clock between measurements)")
    parser.add_argument("--wan-strided", type=int, nargs=6, default=None, metavar=("KT", "KH", "KW", "ST", "SH", "SW"),
                        help="Wan's strided window: kernel and stride (default 8 16 16 2 8 8)")
    parser.add_argument("--no-natten", action="store_true", help="skip NATTEN")
    parser.add_argument("--attention-free", action="store_true",
                        help="also time the model with an operator that attends to nothing (method attention_free: "
                             "the time spent outside self-attention, the ceiling of any attention's speedup)")
    parser.add_argument("--tiny", action="store_true", help="tiny models and shapes on the CPU: the logic only")
    parser.add_argument("--out-dir", default=None,
                        help="where <card>.json goes (default benchmarks/results; --tiny: a temporary folder)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--commit", default=None, help="git sha of the measured tree (default: git rev-parse)")
    args = parser.parse_args(argv)
    parts = args.only or ["wan", "hunyuan", "comfy"]

    if args.tiny:
        device, dtype, specs = torch.device("cpu"), torch.float32, TINY
        timer, gpu_timer, comfy_shapes = CpuTimer(), None, TINY_COMFY_SHAPES
        natten_backend = None
        out_dir = args.out_dir or tempfile.mkdtemp(prefix="video_dit_bench-")
    else:
        if not torch.cuda.is_available():
            parser.error("needs a GPU (or --tiny for the CPU logic test)")
        device, dtype, specs = torch.device("cuda"), torch.bfloat16, FULL
        timer, gpu_timer, comfy_shapes = Timer(device), Timer(device, graphs=True), bench_shapes("ltx")
        natten_backend = "hopper-fna"
        out_dir = args.out_dir or os.path.join("benchmarks", "results")
    name = "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device)
    path = os.path.join(out_dir, f"{device_slug(name) if device.type == 'cuda' else 'cpu-tiny'}.json")
    with_natten = not args.no_natten
    if with_natten and not args.tiny:
        reason = peers.natten_unavailable(device)
        if reason is not None:
            log(f"natten skipped: {reason}")
            with_natten = False
    if with_natten and args.tiny:
        try:
            import natten  # noqa: F401
        except ImportError:
            with_natten = False

    import triton

    commit = args.commit or git_commit()
    stamp = dict(device=name, commit=commit, date=datetime.date.today().isoformat(), torch=torch.__version__,
                 triton=triton.__version__, python=platform.python_version())
    fields = dict(stamp, ceilings={})
    log(f"device: {name}; torch {torch.__version__}; parts {parts}; natten {with_natten}")
    rows: List[dict] = []

    def save(complete: bool) -> None:
        if not args.no_write:
            write_merged_results(path, rows, fields, complete)

    for family, row_name in (("wan", "wan-1.3b-step"), ("hunyuan", "hunyuan-blocks")):
        if family not in parts:
            continue
        log(f"[{row_name}]")
        spec = dict(specs[family])
        if family == "wan" and args.wan_strided is not None:
            spec["strided"] = (tuple(args.wan_strided[:3]), tuple(args.wan_strided[3:]))
        methods = methods_for(family, spec, natten_backend, with_natten, args.attention_free)
        rows += dit_rows(family, row_name, spec, timer, device, dtype, args.runs, args.step_runs, methods, stamp,
                         args.rounds)
        save(complete=False)
    if "comfy" in parts:
        log("[comfy-ltx]")
        try:
            rows += comfy_rows(comfy_shapes, timer, gpu_timer, device, dtype, stamp)
        except ImportError as exc:
            log(f"comfy-ltx skipped: {exc}")
        save(complete=False)
    save(complete=True)
    print_tables(rows)
    if not args.no_write:
        log(f"\nrows merged into {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
