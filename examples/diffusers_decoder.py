"""The LTX-2.5 diffusion video decoder of diffusers with na3d as its attention.

    python examples/diffusers_decoder.py                  # CPU: a tiny random decoder, float32
    python examples/diffusers_decoder.py --device cuda    # GPU: the same, bfloat16 kernels
    python examples/diffusers_decoder.py --device cuda --full-size   # the real decoder's shapes

Needs ``diffusers>=0.42`` (``pip install -e ".[diffusers]"``). Weights are random:
nothing is downloaded. ``use_na3d`` switches every neighborhood attention module of
the decoder to na3d; the decoded video is compared with the one diffusers' own
FlexAttention processor decodes (tiny decoder only: at full size its BlockMask does
not fit in memory).
"""

import argparse
import time
import warnings

import torch
from diffusers.models.autoencoders.ltx2_diffusion_decoder import (
    LTX2VideoDiffusionDecoderModel,
    LTX2VideoVaeNeighborhoodAttnProcessor,
)

from na3d.diffusers import use_na3d

# A small decoder with every stage of the real one: head dim 16 (2-4 heads), kernels
# shifted inward along every axis; a latent of 1 x 8 x 2 x 2 x 3 decodes to 9 frames of 32 x 48.
TINY_CONFIG = dict(latent_channels=8, patch_size=2, spatial_compression_ratio=16, decoder_head_dim=16,
                   decoder_t_emb_dim=32, decoder_stage_channels=(64, 32, 32, 32, 32),
                   decoder_stage_depths=(1, 1, 1, 1, 2), decoder_upsample_channel_reductions=(2, 1, 1, 1),
                   decoder_stage_kernels=((3, 1, 3), (3, 3, 5), (3, 3, 3), (3, 3, 3)), decoder_stage5_kernel=(5, 5, 7))
TINY_LATENT = (1, 8, 2, 2, 3)
FULL_LATENT = (1, 128, 16, 16, 24)  # a 121-frame 512 x 768 video


def decode(model, latent, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator(device=latent.device).manual_seed(seed)
    with torch.no_grad():
        return model.decode(latent, generator=generator, return_dict=False)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--full-size", action="store_true", help="diffusers' default decoder config and a "
                        "121-frame 512x768 latent, tiled (needs a GPU)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.full_size and device.type != "cuda":
        parser.error("--full-size needs --device cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)

    config = {} if args.full_size else TINY_CONFIG
    model = LTX2VideoDiffusionDecoderModel(**config).eval().to(device)
    if dtype != torch.float32:
        model.to(dtype=dtype)
    latent = torch.randn(FULL_LATENT if args.full_size else TINY_LATENT, device=device, dtype=dtype)
    if args.full_size:
        model.enable_tiling()

    switched = use_na3d(model)  # every neighborhood attention -> na3d; no BlockMask is built
    start = time.perf_counter()
    video = decode(model, latent)
    seconds = time.perf_counter() - start
    print(f"na3d: {switched} attention modules switched; latent {tuple(latent.shape)} -> video "
          f"{tuple(video.shape)} in {seconds:.2f} s")

    if not args.full_size:
        model.set_attn_processor(LTX2VideoVaeNeighborhoodAttnProcessor())  # diffusers' own, for comparison
        with warnings.catch_warnings():  # FlexAttention runs eagerly here, and says so
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            reference = decode(model, latent)
        diff = (video.float() - reference.float()).abs().max().item()
        print(f"FlexAttention processor: same video within {diff:.1e} (max abs difference)")


if __name__ == "__main__":
    main()
