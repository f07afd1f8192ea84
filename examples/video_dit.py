"""A video diffusion transformer of diffusers (Wan 2.1) with na3d as its self-attention.

    python examples/video_dit.py                              # CPU: a tiny random Wan transformer, float32
    python examples/video_dit.py --device cuda                # GPU: the same, bfloat16, na3d's kernels
    python examples/video_dit.py --device cuda --full-size    # the 1.3B model's shapes, 81 frames at 480x832

Needs ``diffusers>=0.42`` (``pip install -e ".[diffusers]"``). Weights are random: nothing
is downloaded. ``use_na3d(transformer, kernel_size=...)`` turns the self-attention of every
block into 3-D neighborhood attention over the token grid (frames x height x width after
patching); the cross-attention to the text stays dense. Three checks:

1. a window that covers the whole grid is dense attention: the output equals the dense
   model's (float32 on the CPU: within 1e-5);
2. a smaller window (and a strided one) changes it, as it should;
3. a training step: gradients reach every parameter through na3d's backward.
"""

import argparse
import time

import torch
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from na3d.diffusers import use_na3d

# A tiny Wan transformer: 2 blocks, 2 heads of 16; a latent of 5 frames at 8 x 12 gives a
# token grid of 5 x 4 x 6 after the 1 x 2 x 2 patches.
TINY = dict(config=dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32),
            latent=(1, 4, 5, 8, 12), text=(1, 7, 16), window=(3, 3, 3), strided=((2, 4, 4), (1, 2, 2)))
# Wan 2.1 T2V 1.3B (diffusers' config); 81 frames at 480 x 832: latent 21 x 60 x 104, grid 21 x 30 x 52.
FULL = dict(config=dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                        out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30),
            latent=(1, 16, 21, 60, 104), text=(1, 512, 4096), window=(9, 15, 15), strided=((8, 16, 16), (2, 8, 8)))


def forward(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--full-size", action="store_true", help="the Wan 2.1 1.3B config at 81 frames of 480x832 "
                        "(needs a GPU)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.full_size and device.type != "cuda":
        parser.error("--full-size needs --device cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = FULL if args.full_size else TINY
    torch.manual_seed(0)
    with torch.device(device):
        model = WanTransformer3DModel(**spec["config"]).eval()
    for name, param in model.named_parameters():  # as from_pretrained(torch_dtype=...) loads them
        if not any(part in name.split(".") for part in model._keep_in_fp32_modules):
            param.data = param.data.to(dtype)
    gen = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(spec["latent"], generator=gen).to(device, dtype),
                  timestep=torch.tensor([500], device=device),
                  encoder_hidden_states=torch.randn(spec["text"], generator=gen).to(device, dtype), return_dict=False)
    patch = spec["config"]["patch_size"]
    grid = tuple(n // p for n, p in zip(spec["latent"][2:], patch))
    print(f"Wan transformer, {sum(p.numel() for p in model.parameters()):,} random parameters, "
          f"{dtype}, latent {spec['latent']} -> token grid {grid}")

    dense = forward(model, inputs)  # diffusers' default processors: dense SDPA
    scale = dense.float().abs().max().item()

    switched = use_na3d(model, kernel_size=grid)  # a window covering the grid: dense attention, through na3d
    full = forward(model, inputs)
    err = (full.float() - dense.float()).abs().max().item()
    print(f"{switched} self-attention modules on na3d; window {grid} (the whole grid) vs dense: max abs "
          f"difference {err:.1e} (outputs up to {scale:.2f})")
    if dtype == torch.float32 and err > 1e-5 * max(1.0, scale):
        raise SystemExit(f"the window covering the grid differs from dense attention by {err:.2e}")

    # A window; then a strided one: groups of queries share one window (block-sparse when
    # the groups and windows line up with the kernels' tiles, as 8x16x16 at stride 2x8x8 does
    # on the full-size grid).
    for window, stride in ((spec["window"], 1), spec["strided"]):
        use_na3d(model, kernel_size=window, stride=stride)
        start = time.perf_counter()
        out = forward(model, inputs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        moved = (out.float() - dense.float()).abs().max().item()
        print(f"window {window}, stride {stride}: forward in {seconds:.2f} s; differs from dense by "
              f"{moved:.2f} (a window, not the whole grid)")

    model.train()
    if args.full_size:
        model.enable_gradient_checkpointing()  # the 1.3B model's activations at 32760 tokens need it
    inputs["hidden_states"].requires_grad_()
    out = model(**inputs)[0]
    out.float().pow(2).mean().backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    norm = torch.sqrt(sum(p.grad.float().pow(2).sum() for p in model.parameters() if p.grad is not None)).item()
    print(f"training step through na3d's backward: gradient norm {norm:.3e}, {len(missing)} parameters without "
          "a gradient")
    if missing:
        raise SystemExit(f"no gradient reached {missing[:5]}")
    model.set_attn_processor(WanAttnProcessor())  # back to diffusers' default
    print(f"switched back: the dense output again, bit for bit: {torch.equal(forward(model.eval(), inputs), dense)}")


if __name__ == "__main__":
    main()
