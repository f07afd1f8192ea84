"""End-to-end benchmark: the LTX-2.5 diffusion video decoder of diffusers, attention swapped.

    python -m na3d.tools.bench_decoder                        # full size, latent 1x128x16x16x24, bf16, tiling on
    python -m na3d.tools.bench_decoder --methods na3d noattn --repeats 5 --json decoder.json

The full-size ``LTX2VideoDiffusionDecoderModel`` (diffusers' default config, random
weights: nothing is downloaded) decodes the latent of a 121-frame 512x768 video with
diffusers' tiled decoding (``enable_tiling()`` with its default tile sizes), once per
attention processor:

* ``na3d``: :class:`na3d.diffusers.NA3DProcessor`;
* ``noattn``: q/k/v projected, v handed to the output projection: what the rest of the
  decoder costs;
* ``sdpa_exact``: the exact grouped-SDPA reference :func:`na3d.na3d_sdpa_exact`;
* ``flex``: diffusers' own FlexAttention processor; its error (typically running out
  of memory building or applying the BlockMask) is reported instead of a time.

Per method: median decode time of ``repeats`` runs after ``warmup`` runs, peak
``torch.cuda.max_memory_allocated`` (reset between methods; weights included), and
the largest difference of the decoded video to the ``sdpa_exact`` one.
``attn_share = (ms["na3d"] - ms["noattn"]) / ms["na3d"]``. Without a GPU the command
says so and exits 0; :func:`decoder_row` itself also runs on the CPU (small configs,
for tests).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import sys
import time
from typing import Callable, Optional, Sequence, Union

import torch

from ..reference import na3d_sdpa_exact
from . import common

METHODS = ("na3d", "noattn", "sdpa_exact", "flex")
LATENT_SHAPE = (1, 128, 16, 16, 24)  # LTX-2 latent of 121 frames at 512x768: (121 - 1) / 8 + 1, 512 / 32, 768 / 32


def method_processors() -> dict:
    """The processor each method installs (built lazily: diffusers is an optional dependency)."""
    from diffusers.models.autoencoders.ltx2_diffusion_decoder import LTX2VideoVaeNeighborhoodAttnProcessor

    from ..diffusers import NA3DProcessor

    class SkipAttentionProcessor(NA3DProcessor):
        """Projects q/k/v and hands v to the output projection: the decoder without attention."""

        def attention(self, query, key, value, kernel_size):
            return value

    class SDPAExactProcessor(NA3DProcessor):
        """The exact grouped-SDPA reference on the pre-scaled query (scale 1.0)."""

        def attention(self, query, key, value, kernel_size):
            return na3d_sdpa_exact(query, key, value, kernel_size, scale=1.0)

    return {"na3d": NA3DProcessor(), "noattn": SkipAttentionProcessor(), "sdpa_exact": SDPAExactProcessor(),
            "flex": LTX2VideoVaeNeighborhoodAttnProcessor()}


def _install(model, method: str, processor) -> None:
    from ..diffusers import use_na3d

    if method == "flex":
        # Diffusers' own switch; its build_block_mask builds the stage masks again for this processor.
        model.set_attn_processor(processor)
    else:
        use_na3d(model, processor)


def build_decoder(device, dtype=torch.bfloat16, config: Optional[dict] = None, seed: int = 0):
    """A randomly initialized ``LTX2VideoDiffusionDecoderModel`` (``config`` overrides its defaults)."""
    from diffusers.models.autoencoders.ltx2_diffusion_decoder import LTX2VideoDiffusionDecoderModel

    torch.manual_seed(seed)
    with torch.device(device):  # initialize in place: the full model is ~0.4 G parameters
        model = LTX2VideoDiffusionDecoderModel(**(config or {}))
    return model.to(dtype=dtype).eval()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _describe(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:500]


def decoder_row(
    device: Union[str, torch.device],
    latent_shape: Sequence[int] = LATENT_SHAPE,
    dtype: torch.dtype = torch.bfloat16,
    methods: Sequence[str] = METHODS,
    warmup: int = 1,
    repeats: int = 3,
    tiling: Union[bool, dict] = True,
    config: Optional[dict] = None,
    seed: int = 0,
    log: Callable[[str], None] = common.log,
) -> dict:
    """Decode time, peak memory and output difference of each attention method, as one row.

    ``device``: where to run (CUDA for real numbers; CPU works, for tests). ``tiling``:
    ``True`` for ``enable_tiling()`` with diffusers' default tiles, ``False`` for one
    pass, or a dict of ``enable_tiling`` keyword arguments. ``config``: overrides of
    ``LTX2VideoDiffusionDecoderModel``'s defaults (default: the full-size decoder).

    Returns ``{"name": "ltx-decoder", "pass": "e2e", "shape": latent_shape, "ms": {...},
    "peak_gib": {...}, "errors": {...}, "attn_share": ..., ...}``; ``ms`` and ``peak_gib``
    hold only the methods that ran (``peak_gib`` only on CUDA), ``errors`` the others.
    """
    device = torch.device(device)
    latent_shape = tuple(latent_shape)
    if len(latent_shape) != 5 or not all(isinstance(x, int) and x > 0 for x in latent_shape):
        raise ValueError(f"latent_shape={latent_shape} must be 5 positive ints (B, C, F, H, W)")
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"methods={list(methods)}: allowed (at least one of) {list(METHODS)}")
    for name, value, least in (("warmup", warmup, 0), ("repeats", repeats, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name}={value!r} must be an int >= {least}")
    if not isinstance(tiling, (bool, dict)):
        raise TypeError(f"tiling={tiling!r} must be a bool or a dict of enable_tiling arguments")

    model = build_decoder(device, dtype, config, seed)
    if tiling is not False:
        model.enable_tiling(**(tiling if isinstance(tiling, dict) else {}))
    weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    latent = torch.randn(latent_shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)
    processors = method_processors()

    def decode():
        # Every method denoises the same noise.
        generator = torch.Generator(device=device).manual_seed(seed + 1)
        return model.decode(latent, generator=generator, return_dict=False)[0]

    row = {"name": "ltx-decoder", "pass": "e2e", "shape": list(latent_shape), "dtype": str(dtype).split(".")[-1],
           "tiling": tiling, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "warmup": warmup, "repeats": repeats, "weights_gib": round(weights_bytes / 2**30, 3),
           "ms": {}, "peak_gib": {}, "errors": {}, "max_abs_diff_vs_sdpa_exact": {}}
    outputs = {}
    for method in methods:
        _install(model, method, processors[method])
        _release(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        log(f"[ltx-decoder] {method}: {warmup} warm-up + {repeats} timed decodes of latent {list(latent_shape)}")
        try:
            with torch.inference_mode():
                for _ in range(warmup):
                    decode()
                times = []
                for _ in range(repeats):
                    _synchronize(device)
                    start = time.perf_counter()
                    video = decode()
                    _synchronize(device)
                    times.append((time.perf_counter() - start) * 1e3)
            row["ms"][method] = round(statistics.median(times), 2)
            if device.type == "cuda":
                row["peak_gib"][method] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
            row["output_shape"] = list(video.shape)
            if method != "noattn":  # compared to sdpa_exact below; kept off the device, out of later peaks
                outputs[method] = video.float().cpu()
            del video
            log(f"[ltx-decoder] {method}: {row['ms'][method]:.1f} ms"
                + (f", peak {row['peak_gib'][method]:.2f} GiB" if method in row["peak_gib"] else ""))
        except Exception as error:  # noqa: BLE001 -- reported in the row (flex is expected to run out of memory)
            row["errors"][method] = _describe(error)
            log(f"[ltx-decoder] {method} failed: {row['errors'][method]}")
        _release(device)

    if "sdpa_exact" in outputs:
        for method, video in outputs.items():
            if method != "sdpa_exact":
                row["max_abs_diff_vs_sdpa_exact"][method] = (video - outputs["sdpa_exact"]).abs().max().item()
    ms = row["ms"]
    if "na3d" in ms and "noattn" in ms:
        row["attn_share"] = round((ms["na3d"] - ms["noattn"]) / ms["na3d"], 4)
        row["attn_ms"] = {m: round(t - ms["noattn"], 2) for m, t in ms.items() if m != "noattn"}
    model = outputs = None  # frees them (decode() refers to model)
    _release(device)
    return row


def print_row(row: dict) -> None:
    print(f"\nLTX-2.5 decoder, latent {row['shape']} -> video {row.get('output_shape')}, {row['dtype']}, "
          f"tiling {row['tiling']}, {row['device']}")
    print(f"{'method':>11} {'ms':>10} {'peak GiB':>9} {'diff vs sdpa':>13}")
    for method in METHODS:
        if method in row["ms"]:
            peak = row["peak_gib"].get(method)
            diff = row["max_abs_diff_vs_sdpa_exact"].get(method)
            print(f"{method:>11} {row['ms'][method]:>10.1f} {'' if peak is None else f'{peak:.2f}':>9} "
                  f"{'' if diff is None else f'{diff:.3g}':>13}")
        elif method in row["errors"]:
            print(f"{method:>11} failed: {row['errors'][method]}")
    if "attn_share" in row:
        print(f"attention share of the na3d decode: {100 * row['attn_share']:.1f}%")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m na3d.tools.bench_decoder", description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-tiling", action="store_true", help="decode in one pass (diffusers' default is off; "
                        "the benchmark's is on, as the production decode needs it)")
    parser.add_argument("--json", metavar="PATH", help="also write the row to PATH")
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (the median of fewer is not a measurement)")

    if not torch.cuda.is_available():
        print("No GPU found: the decoder benchmark needs a CUDA device; nothing was measured.")
        return 0
    if importlib.util.find_spec("diffusers") is None:
        print("The decoder benchmark needs diffusers>=0.42: pip install 'na3d[diffusers]'", file=sys.stderr)
        return 1
    row = decoder_row(torch.device("cuda"), methods=args.methods, warmup=args.warmup, repeats=args.repeats,
                      tiling=not args.no_tiling)
    print_row(row)
    print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)
        print(f"wrote {args.json}")
    return 1 if "na3d" in row["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
