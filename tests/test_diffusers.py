"""na3d as the attention processor of diffusers' LTX-2.5 diffusion video decoder.

CPU tests (run in CI): a small randomly initialized decoder, with non-zero AdaLN
modulation tables so attention changes the output (checked: skipping attention moves
it by ~1.8, the tolerance is ~2e-5), decodes the same video with ``use_na3d`` as with
diffusers' own FlexAttention processor, untiled and tiled, and builds no BlockMask.

The decoder-level tests give na3d its exact PyTorch reference backend (the fixture
``exact_reference_backend`` of conftest.py: what a CPU user gets when the Triton interpreter is not
active), because the interpreter, active in the test session (conftest.py), would take
minutes at these grids. The Triton kernel itself, in the interpreter, runs in
``test_block_runs_the_kernel_on_the_projected_views`` (on the very views
``project_qkv`` returns), in the processor-level tests and, through a whole tiny
decoder, in ``tools/test_bench_decoder.py``. On the CPU FlexAttention runs eagerly and has
no backward, so every decode is under ``torch.no_grad()``.

GPU tests (``-m gpu``, skipped without CUDA): one full-size block of each decoder stage,
bf16, na3d against the flex processor (outputs and gradients) with a tolerance derived
from flex's own bf16 error against a float32 run; and the full-size decoder on a small
latent.
"""

import copy
import inspect

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers.models.autoencoders import ltx2_diffusion_decoder as ltx2  # noqa: E402
from diffusers.models.autoencoders.ltx2_diffusion_decoder import (  # noqa: E402
    LTX2VideoDiffusionDecoderModel,
    LTX2VideoVaeDiffusionNABlock,
    LTX2VideoVaeNABlock,
    LTX2VideoVaeNeighborhoodAttention,
    LTX2VideoVaeNeighborhoodAttnProcessor,
)

import na3d  # noqa: E402
from na3d.diffusers import ltx_decoder  # noqa: E402
from na3d import geometry, launch  # noqa: E402
from na3d.diffusers import NA3DProcessor, use_na3d  # noqa: E402
from helpers import TINY_CONFIG  # noqa: E402

TINY_LATENT = (1, 8, 2, 2, 3)
NUM_TINY_ATTENTIONS = 6  # one block per deterministic stage, two diffusion blocks
# Tiles in pixels: 6 frames x 16 x 16 every 4 x 12 x 12, i.e. 2 x 2 x 3 overlapping tiles
# on the stage-4 grid (cells of 2 frames x 4 x 4 pixels).
TINY_TILES = dict(tile_sample_min_num_frames=6, tile_sample_min_height=16, tile_sample_min_width=16,
                  tile_sample_stride_num_frames=4, tile_sample_stride_height=12, tile_sample_stride_width=12)


def randomize_modulation(model: torch.nn.Module, seed: int = 0) -> None:
    """Non-zero AdaLN tables: diffusers initializes them to zero, which would hide modulation bugs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LTX2VideoVaeDiffusionNABlock):
                # Drawn on the CPU (reproducible anywhere, also inside a torch.device("cuda") block).
                table = torch.randn(module.scale_shift_table.shape, generator=gen, device="cpu")
                module.scale_shift_table.copy_(0.5 * table)


def tiny_model(seed: int = 0) -> LTX2VideoDiffusionDecoderModel:
    torch.manual_seed(seed)
    model = LTX2VideoDiffusionDecoderModel(**TINY_CONFIG).eval()
    randomize_modulation(model, seed)
    return model


def tiny_latent(seed: int = 0) -> torch.Tensor:
    return torch.randn(TINY_LATENT, generator=torch.Generator().manual_seed(seed))


def decode(model, latent, seed=1):
    return model.decode(latent, generator=torch.Generator().manual_seed(seed), return_dict=False)[0]


def decode_with_flex(model, latent):
    model.set_attn_processor(LTX2VideoVaeNeighborhoodAttnProcessor())
    with torch.no_grad():  # FlexAttention has no backward on the CPU
        return decode(model, latent)


def decode_with_na3d(model, latent):
    assert use_na3d(model) == NUM_TINY_ATTENTIONS
    with torch.no_grad():
        return decode(model, latent)


class SkipAttention(NA3DProcessor):
    def attention(self, query, key, value, kernel_size):
        return value


def assert_same_video(out, ref, skipped):
    """float32 end to end: the two exact attentions differ by rounding only (seen: ~7e-7 on outputs ~2)."""
    assert out.shape == ref.shape
    scale = ref.abs().max().item()
    err = (out - ref).abs().max().item()
    attention_effect = (skipped - ref).abs().max().item()
    assert err <= 1e-5 * max(1.0, scale), f"na3d vs flex: max abs difference {err:.3e} (outputs up to {scale:.2f})"
    # The comparison means something only if attention moves the output far more than the tolerance.
    assert attention_effect > 1e3 * 1e-5 * max(1.0, scale), f"attention barely matters ({attention_effect:.3e})"


@pytest.fixture(autouse=True)
def _quiet_flex_warning():
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


# ---------------------------------------------------------------------------------------
# The decoder, end to end
# ---------------------------------------------------------------------------------------

def test_decoder3d_matches_flex_processor(exact_reference_backend):
    model = tiny_model()
    decoder, latent = model.decoder, tiny_latent()
    model.set_attn_processor(LTX2VideoVaeNeighborhoodAttnProcessor())
    with torch.no_grad():
        ref = decoder(latent, generator=torch.Generator().manual_seed(1))
    assert use_na3d(decoder) == NUM_TINY_ATTENTIONS  # the bare LTX2VideoDiffusionDecoder3d
    with torch.no_grad():
        out = decoder(latent, generator=torch.Generator().manual_seed(1))
    use_na3d(decoder, SkipAttention())
    with torch.no_grad():
        skipped = decoder(latent, generator=torch.Generator().manual_seed(1))
    assert out.shape == (1, 3, 9, 32, 48)
    assert_same_video(out, ref, skipped)


def test_tiled_model_decode_matches_flex_processor(exact_reference_backend):
    model = tiny_model(seed=2)
    model.enable_tiling(**TINY_TILES)
    latent = tiny_latent(seed=2)
    ref = decode_with_flex(model, latent)
    out = decode_with_na3d(model, latent)
    use_na3d(model, SkipAttention())
    with torch.no_grad():
        skipped = decode(model, latent)
    assert_same_video(out, ref, skipped)


def test_no_block_mask_is_built(monkeypatch, exact_reference_backend):
    model = tiny_model()
    model.enable_tiling(**TINY_TILES)
    use_na3d(model)

    def refuse(*args, **kwargs):
        raise AssertionError("a FlexAttention BlockMask was built")

    monkeypatch.setattr(torch.nn.attention.flex_attention, "create_block_mask", refuse)
    monkeypatch.setattr(ltx2, "_neighborhood_block_mask", refuse)
    with torch.no_grad():
        decode(model, tiny_latent())  # tiled: stages 1-3 once, stage 4 and 5 per tile
        model.disable_tiling()
        model.decoder(tiny_latent())
    for module in model.modules():
        if isinstance(module, LTX2VideoVaeNeighborhoodAttention):
            assert module.build_block_mask(torch.empty(1, 13, 8, 12, 32)) is None
            assert "build_block_mask" not in vars(module), "diffusers 0.42 needs no instance guard"


def test_switching_back_to_flex_builds_the_mask_again():
    model = tiny_model()
    use_na3d(model)
    model.set_attn_processor(LTX2VideoVaeNeighborhoodAttnProcessor())
    attn = model.decoder.diff_blocks[0].attn
    assert attn.build_block_mask(torch.empty(1, 9, 16, 24, 32)) is not None


# ---------------------------------------------------------------------------------------
# The processor on one module
# ---------------------------------------------------------------------------------------

def test_block_runs_the_kernel_on_the_projected_views(monkeypatch):
    """No grad: on a CPU test session na3d runs its Triton kernel in the interpreter here."""
    torch.manual_seed(3)
    block = LTX2VideoVaeDiffusionNABlock(dim=32, kernel_size=(3, 3, 5), context_channels=16, head_dim=16).eval()
    randomize_modulation(block, seed=3)
    hidden = torch.randn(2, 5, 6, 7, 32)
    context = torch.randn(2, 5, 6, 7, 16)
    modulation = tuple(0.5 * torch.randn(2, 1, 1, 1, 32) for _ in range(7))

    with torch.no_grad():
        ref = block(hidden, context, modulation, block.attn.build_block_mask(hidden))

        projected, received = [], []
        project_qkv = block.attn.project_qkv
        monkeypatch.setattr(block.attn, "project_qkv", lambda x: projected.append(project_qkv(x)) or projected[-1])
        attend = ltx_decoder.na3d_flash_attn
        monkeypatch.setattr(ltx_decoder, "na3d_flash_attn",
                            lambda q, k, v, ks: received.append((q, k, v, ks)) or attend(q, k, v, ks))
        block.attn.set_processor(NA3DProcessor())
        assert block.attn.build_block_mask(hidden) is None
        out = block(hidden, context, modulation)

    q, k, v, kernel = received[0]
    assert all(a is b for a, b in zip((q, k, v), projected[0])), "q/k/v were copied on the way to na3d"
    assert q.shape == (2, 5, 6, 7, 2, 16) and kernel == (3, 3, 5)
    err = (out - ref).abs().max().item()
    assert err <= 1e-5 * max(1.0, ref.abs().max().item()), f"max abs difference {err:.3e}"
    if not launch.kernels_interpreted():
        pytest.skip("compared through the PyTorch reference: the Triton interpreter is not active")


def test_processor_output_equals_dense_masked_attention():
    """Independent of diffusers' flex path: the processor against a dense float64 masked attention."""
    torch.manual_seed(4)
    attn = LTX2VideoVaeNeighborhoodAttention(48, (3, 5, 3), head_dim=16)
    attn.set_processor(NA3DProcessor())
    hidden = torch.randn(1, 4, 6, 5, 48)
    with torch.no_grad():
        out = attn(hidden)
        q, k, v = attn.project_qkv(hidden)
        dense = na3d.na3d_brute_force(q, k, v, (3, 5, 3), scale=1.0)  # q is pre-scaled by project_qkv
        ref = attn.to_out[0](dense.reshape(1, 4, 6, 5, 48))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


class DenseAttention(NA3DProcessor):
    """The same module with a dense float64 masked attention: an independent reference."""

    def attention(self, query, key, value, kernel_size):
        return na3d.na3d_brute_force(query, key, value, kernel_size, scale=1.0)


def test_processor_gradients_equal_dense_masked_attention():
    torch.manual_seed(5)
    attn = LTX2VideoVaeNeighborhoodAttention(32, (3, 3, 3), head_dim=16)
    hidden = torch.randn(1, 3, 4, 5, 32)
    cotangent = torch.randn(1, 3, 4, 5, 32)
    grads = []
    for processor in (NA3DProcessor(), DenseAttention()):
        attn.set_processor(processor)
        attn.zero_grad()
        leaf = hidden.clone().requires_grad_()
        (attn(leaf) * cotangent).sum().backward()
        grads.append([leaf.grad] + [getattr(attn, n).weight.grad.clone() for n in ("to_q", "to_k", "to_v")])
    for ours, ref in zip(*grads):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_diffusers_flex_window_is_natten_window():
    """Diffusers' mask_mod (the flex processor's window) equals na3d's (NATTEN's) definition."""
    for shape, kernel in [((5, 6, 7), (3, 3, 5)), ((3, 4, 9), (3, 1, 9)), ((7, 5, 11), (5, 5, 7))]:
        n = shape[0] * shape[1] * shape[2]
        block_mask = ltx2._neighborhood_block_mask(*shape, kernel, torch.device("cpu"))
        idx = torch.arange(n)
        theirs = block_mask.mask_mod(0, 0, idx[:, None], idx[None, :])
        ours = geometry.neighborhood_mask(shape, kernel)
        assert torch.equal(theirs, ours), (shape, kernel)


# ---------------------------------------------------------------------------------------
# use_na3d: what it accepts, what it refuses
# ---------------------------------------------------------------------------------------

def test_use_na3d_counts_and_installs_one_processor():
    model = tiny_model()
    processor = NA3DProcessor()
    assert use_na3d(model, processor) == NUM_TINY_ATTENTIONS
    processors = list(model.attn_processors.values())
    assert len(processors) == NUM_TINY_ATTENTIONS and all(p is processor for p in processors)


def test_use_na3d_accepts_a_pipeline():
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx2.pipeline_ltx2_diffusion_decode import LTX2VideoDiffusionDecodePipeline

    pipe = LTX2VideoDiffusionDecodePipeline(diffusion_decoder=tiny_model(), scheduler=FlowMatchEulerDiscreteScheduler())
    assert use_na3d(pipe) == NUM_TINY_ATTENTIONS
    assert all(isinstance(p, NA3DProcessor) for p in pipe.diffusion_decoder.attn_processors.values())


def test_use_na3d_rejects_wrong_inputs():
    with pytest.raises(TypeError, match="model must be"):
        use_na3d("decoder")
    with pytest.raises(ValueError, match="no LTX2VideoVaeNeighborhoodAttention"):
        use_na3d(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="processor must be"):
        use_na3d(tiny_model(), processor=LTX2VideoVaeNeighborhoodAttnProcessor())


def test_processor_rejects_wrong_inputs():
    attn = LTX2VideoVaeNeighborhoodAttention(32, (3, 3, 3), head_dim=16)
    hidden = torch.randn(1, 3, 3, 3, 32)
    processor = NA3DProcessor()
    with pytest.raises(TypeError, match="attn must be"):
        processor(torch.nn.Linear(32, 32), hidden)
    with pytest.raises(ValueError, match="hidden_states must be"):
        processor(attn, hidden.flatten(1, 3))
    with pytest.raises(ValueError, match="block_mask must be None"):
        processor(attn, hidden, block_mask=ltx2._neighborhood_block_mask(3, 3, 3, (3, 3, 3), torch.device("cpu")))


def test_instance_guard_when_the_mask_builder_does_not_skip():
    """A diffusers whose build_block_mask ignores the processor: use_na3d guards those instances only."""

    class AlwaysBuilds(LTX2VideoVaeNeighborhoodAttention):
        def build_block_mask(self, hidden_states):
            return ltx2._neighborhood_block_mask(*hidden_states.shape[1:4], self.kernel_size, hidden_states.device)

    eager = AlwaysBuilds(32, (3, 3, 3), head_dim=16)
    bystander = AlwaysBuilds(32, (3, 3, 3), head_dim=16)
    assert use_na3d(eager) == 1
    hidden = torch.randn(1, 3, 4, 5, 32)
    assert eager.build_block_mask(hidden) is None
    assert bystander.build_block_mask(hidden) is not None  # the class itself is untouched
    eager.set_processor(LTX2VideoVaeNeighborhoodAttnProcessor())
    assert eager.build_block_mask(hidden) is not None  # back to flex: diffusers' builder again


# ---------------------------------------------------------------------------------------
# GPU: full-size blocks of every stage, and the full decoder
# ---------------------------------------------------------------------------------------

def full_size_stages():
    """(channels, kernel) per stage, from LTX2VideoDiffusionDecoderModel's own defaults."""
    parameters = inspect.signature(LTX2VideoDiffusionDecoderModel.__init__).parameters
    defaults = {name: p.default for name, p in parameters.items()}
    kernels = list(defaults["decoder_stage_kernels"]) + [defaults["decoder_stage5_kernel"]]
    return list(zip(defaults["decoder_stage_channels"], kernels)), defaults["decoder_head_dim"]


# Small but real grids (T, H, W): borders and interior along every axis.
GPU_STAGE_GRIDS = [(5, 16, 20), (5, 20, 24), (7, 16, 20), (7, 20, 24), (13, 20, 24)]


@pytest.mark.parametrize("stage", range(5), ids=lambda s: f"stage{s + 1}")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_full_size_block_matches_flex_bf16(stage):
    """Forward and backward: na3d's bf16 error within twice flex's, both against flex in float32."""
    stages, head_dim = full_size_stages()
    channels, kernel = stages[stage]
    grid = GPU_STAGE_GRIDS[stage]
    torch.manual_seed(stage)
    device = torch.device("cuda")
    with torch.device(device):
        hidden = torch.randn(1, *grid, channels)
        if stage < 4:
            block = LTX2VideoVaeNABlock(channels, kernel, head_dim=head_dim)
            inputs = [hidden]
        else:
            block = LTX2VideoVaeDiffusionNABlock(channels, kernel, context_channels=channels, head_dim=head_dim)
            randomize_modulation(block, seed=stage)
            inputs = [hidden, torch.randn(1, *grid, channels), tuple(0.5 * torch.randn(1, 1, 1, 1, channels)
                                                                       for _ in range(7))]
    block.eval()
    cotangent = torch.randn(1, *grid, channels, device=device)

    def run(processor_cls, dtype):
        """Attention output, block output and gradients (input, q/k/v weights), all in float32."""
        blk = copy.deepcopy(block).to(dtype)
        if processor_cls is NA3DProcessor:
            use_na3d(blk)
        else:
            blk.attn.set_processor(processor_cls())
        args = [tuple(x.to(dtype) for x in a) if isinstance(a, tuple) else a.to(dtype) for a in inputs]
        hidden = args[0].detach().requires_grad_()
        mask = blk.attn.build_block_mask(hidden)
        with torch.no_grad():
            attn_out = blk.attn(blk.norm1(hidden), mask)
        out = blk(hidden, *args[1:], block_mask=mask)
        (out.float() * cotangent).sum().backward()
        results = {"attention": attn_out, "block": out.detach(), "d_input": hidden.grad}
        for name in ("to_q", "to_k", "to_v"):
            results[f"d_{name}.weight"] = getattr(blk.attn, name).weight.grad
        return {key: value.float() for key, value in results.items()}

    reference = run(LTX2VideoVaeNeighborhoodAttnProcessor, torch.float32)
    flex = run(LTX2VideoVaeNeighborhoodAttnProcessor, torch.bfloat16)
    ours = run(NA3DProcessor, torch.bfloat16)
    eps = torch.finfo(torch.bfloat16).eps
    for what, ref in reference.items():
        assert torch.isfinite(ours[what]).all(), f"stage {stage + 1} {what}: non-finite na3d result"
        flex_err = (flex[what] - ref).abs().max().item()
        err = (ours[what] - ref).abs().max().item()
        band = 2 * eps * max(1.0, ref.abs().max().item())
        assert err <= 2 * flex_err + band, (
            f"stage {stage + 1} {what}: na3d bf16 error {err:.3e} > 2 x flex bf16 error {flex_err:.3e} + {band:.1e}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_full_size_decoder_bf16_matches_exact_reference(monkeypatch):
    """The full-size decoder, untiled, on a latent of 17 frames at 224x224 (stage 5: 17 x 56 x 56).

    Flex cannot run here (its eager path materializes 53k x 53k scores per head), so the
    reference is the same decoder with the exact grouped-SDPA processor, in float32
    and bf16; na3d's bf16 error must stay within twice the reference's own.
    """
    from na3d.tools.bench_decoder import build_decoder, method_processors

    device = torch.device("cuda")
    model32 = build_decoder(device, torch.float32)
    model16 = build_decoder(device, torch.bfloat16)
    randomize_modulation(model32)
    randomize_modulation(model16)
    gen = torch.Generator().manual_seed(0)
    latent = torch.randn(1, 128, 3, 7, 7, generator=gen).to(device)
    noise = None

    def run(model, processor, dtype):
        nonlocal noise
        decoder = model.decoder
        if processor == "na3d":
            use_na3d(model)
        else:
            use_na3d(model, method_processors()[processor])
        with torch.inference_mode():
            context = decoder.forward_stage_4(decoder.forward_stages_1_to_3(latent.to(dtype)))
            if noise is None:
                noise = torch.randn(1, 3, context.shape[1], context.shape[2] * decoder.patch_size,
                                    context.shape[3] * decoder.patch_size, generator=gen).to(device)
            return decoder.denoise(context, noise.to(dtype), 1).float()

    ref = run(model32, "sdpa_exact", torch.float32)
    exact16 = run(model16, "sdpa_exact", torch.bfloat16)

    def refuse(*args, **kwargs):
        raise AssertionError("a FlexAttention BlockMask was built")

    monkeypatch.setattr(torch.nn.attention.flex_attention, "create_block_mask", refuse)
    ours = run(model16, "na3d", torch.bfloat16)
    assert ours.shape == (1, 3, 17, 224, 224)
    assert torch.isfinite(ours).all()
    exact_err = (exact16 - ref).abs().max().item()
    err = (ours - ref).abs().max().item()
    band = 2 * torch.finfo(torch.bfloat16).eps * max(1.0, ref.abs().max().item())
    assert err <= 2 * exact_err + band, f"na3d bf16 error {err:.3e} > 2 x exact bf16 error {exact_err:.3e} + {band:.1e}"
