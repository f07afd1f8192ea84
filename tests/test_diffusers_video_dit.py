"""na3d as the self-attention of diffusers' video transformers (``na3d.diffusers.video_dit``).

Tiny random models built from diffusers' own classes (Wan: 2 blocks; HunyuanVideo:
one dual-stream and one single-stream block; head dim 16, 2 heads), float32 on the CPU,
on a 5 x 4 x 6 token grid. The references are diffusers' own processors, either
unchanged (dense attention) or handed a dense boolean mask built from
``na3d.geometry.neighborhood_mask`` (the oracle's window): every difference from them
is the attention's.

Model-level tests use na3d's exact PyTorch reference (``exact_reference_backend``:
what a CPU user gets, and differentiable); the processor-level tests at the end run
na3d's Triton kernels in the interpreter (the test session's default on a CPU).
"""

import copy

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import DiffusionPipeline, HunyuanVideoTransformer3DModel, WanTransformer3DModel  # noqa: E402
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0  # noqa: E402
from diffusers.models.transformers.transformer_wan import WanAttnProcessor  # noqa: E402

from helpers import slow_except  # noqa: E402
from na3d import geometry, launch  # noqa: E402
from na3d.diffusers import (  # noqa: E402
    GridRotary,
    HunyuanVideoNA3DProcessor,
    NA3DProcessor,
    WanNA3DProcessor,
    use_na3d,
)

GRID = (5, 4, 6)  # the token grid of LATENT after the (1, 2, 2) patches
LATENT = (1, 4, 5, 8, 12)
TEXT = 7
WAN_CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                  text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32)
HUNYUAN_CONFIG = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
                      num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
                      text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(4, 6, 6))

# (kernel_size, stride, dilation, is_causal): windows smaller than the grid.
WINDOWS = [((3, 3, 3), 1, 1, False),
           ((3, 3, 5), (1, 2, 3), 1, False),
           ((3, 2, 3), 1, (1, 2, 1), False),
           ((2, 3, 3), (2, 1, 3), (2, 1, 1), (True, False, False))]
WINDOW_IDS = ["3x3x3", "stride", "dilation", "causal-t+stride+dilation"]


def wan_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return WanTransformer3DModel(**dict(WAN_CONFIG, **overrides)).eval()


def hunyuan_model(seed=0):
    torch.manual_seed(seed)
    return HunyuanVideoTransformer3DModel(**HUNYUAN_CONFIG).eval()


def wan_inputs(latent=LATENT, seed=1, text=TEXT):
    gen = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(latent, generator=gen), timestep=torch.tensor([500]),
                encoder_hidden_states=torch.randn(latent[0], text, 16, generator=gen), return_dict=False)


def hunyuan_inputs(valid=(5, 7), seed=1):
    """A batch of len(valid) samples; sample b has valid[b] valid text tokens of TEXT (the rest padding)."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(valid)
    mask = (torch.arange(TEXT)[None, :] < torch.tensor(valid)[:, None]).long()
    return dict(hidden_states=torch.randn((batch,) + LATENT[1:], generator=gen), timestep=torch.tensor([500] * batch),
                encoder_hidden_states=torch.randn(batch, TEXT, 16, generator=gen), encoder_attention_mask=mask,
                pooled_projections=torch.randn(batch, 8, generator=gen), guidance=torch.tensor([3000.0] * batch),
                return_dict=False)


def window_mask(grid, kernel_size, stride=1, dilation=1, is_causal=False, device=None):
    """The oracle's window over the flattened grid: [N, N] bool, True where query i sees key j."""
    def triple(x):
        return tuple(x) if isinstance(x, (tuple, list)) else (x,) * 3
    return geometry.neighborhood_mask(grid, triple(kernel_size), triple(dilation), triple(is_causal),
                                      device=device, stride=triple(stride))


class MaskedWan(WanAttnProcessor):
    """Diffusers' own Wan processor, its self-attention restricted to the oracle's window by a dense mask."""

    def __init__(self, *window):
        super().__init__()
        self.window = window

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        return super().__call__(attn, hidden_states, encoder_hidden_states,
                                window_mask(self.grid, *self.window, device=hidden_states.device), rotary_emb)


class MaskedHunyuan(HunyuanVideoAttnProcessor2_0):
    """Diffusers' own HunyuanVideo processor with a dense [L, L] mask: video queries see their window
    and every text token, text queries every token; then the model's key mask (padded text) on top."""

    def __init__(self, *window):
        super().__init__()
        self.window = window

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        n = hidden_states.shape[1]
        length = n + (0 if encoder_hidden_states is None else encoder_hidden_states.shape[1])
        full = torch.ones(length, length, dtype=torch.bool, device=hidden_states.device)
        full[:n, :n] = window_mask(self.grid, *self.window, device=hidden_states.device)
        if attention_mask is not None:
            full = full & attention_mask  # (B, 1, 1, L): the padded text keys
        return super().__call__(attn, hidden_states, encoder_hidden_states, full, image_rotary_emb)


def masked_reference(model, window, grid=GRID):
    """A copy of ``model`` whose switched modules run the masked diffusers processor over ``grid``."""
    reference = copy.deepcopy(model)
    if isinstance(model, WanTransformer3DModel):
        modules, processor = [b.attn1 for b in reference.blocks], MaskedWan(*window)
    else:
        modules = [b.attn for b in (*reference.transformer_blocks, *reference.single_transformer_blocks)]
        processor = MaskedHunyuan(*window)
    processor.grid = grid
    for module in modules:
        module.set_processor(processor)
    return reference


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def assert_close(out, ref, what=""):
    scale = max(1.0, ref.abs().max().item())
    err = (out - ref).abs().max().item()
    assert err <= 1e-5 * scale, f"{what}: max abs difference {err:.3e} (outputs up to {scale:.2f})"


def assert_window_matters(windowed, dense):
    """The comparison means something only if the window moves the output far beyond the tolerance."""
    assert (windowed - dense).abs().max().item() > 1e-2


MODELS = {"wan": (wan_model, lambda: wan_inputs()), "hunyuan": (hunyuan_model, lambda: hunyuan_inputs())}


# ---------------------------------------------------------------------------------------
# Whole models: against dense attention and the masked reference
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", MODELS)
def test_window_covering_the_grid_is_the_dense_model(family, exact_reference_backend):
    make, inputs = MODELS[family]
    model, x = make(), inputs()
    dense = run(model, x)
    assert use_na3d(model, kernel_size=GRID) == 2
    assert_close(run(model, x), dense, f"{family} with the window covering the grid")


# Every window on both models; the default run takes four of the eight (CI runs all).
WINDOW_CASES = slow_except([(family, window) for family in MODELS for window in WINDOWS], keep={1, 3, 5, 6},
                           ids=[f"{family}-{name}" for family in MODELS for name in WINDOW_IDS])


@pytest.mark.parametrize("family, window", WINDOW_CASES)
def test_smaller_window_equals_masked_reference(family, window, exact_reference_backend):
    make, inputs = MODELS[family]
    model, x = make(seed=2), inputs()
    dense = run(model, x)
    reference = run(masked_reference(model, window), x)
    kernel_size, stride, dilation, is_causal = window
    use_na3d(model, kernel_size=kernel_size, stride=stride, dilation=dilation, is_causal=is_causal)
    out = run(model, x)
    assert_close(out, reference, f"{family} {window}")
    assert_window_matters(out, dense)


def test_grid_comes_from_each_input(exact_reference_backend):
    """One switched model, two resolutions and frame counts: each call uses its own grid."""
    model = wan_model(seed=3)
    use_na3d(model, kernel_size=3)
    for latent, grid in [((1, 4, 5, 8, 12), (5, 4, 6)), ((2, 4, 3, 10, 6), (3, 5, 3))]:
        x = wan_inputs(latent)
        assert_close(run(model, x), run(masked_reference(model, ((3, 3, 3), 1, 1, False), grid), x), str(grid))


def test_hunyuan_padded_text_per_sample(exact_reference_backend):
    """A batch whose samples pad different numbers of text tokens; and one with none padded."""
    model = hunyuan_model(seed=4)
    window = ((3, 3, 3), 1, 1, False)
    reference = masked_reference(model, window)
    use_na3d(model, kernel_size=3)
    for valid in [(2, 7), (7,)]:
        x = hunyuan_inputs(valid)
        assert_close(run(model, x), run(reference, x), f"valid text tokens {valid}")


def test_switching_back_restores_the_default_bit_for_bit(exact_reference_backend):
    wan, hunyuan = wan_model(), hunyuan_model()
    saved = dict(hunyuan.attn_processors)
    before = run(wan, wan_inputs()), run(hunyuan, hunyuan_inputs())
    use_na3d(wan, kernel_size=3)
    use_na3d(hunyuan, kernel_size=3)
    wan.set_attn_processor(WanAttnProcessor())
    for block in (*hunyuan.transformer_blocks, *hunyuan.single_transformer_blocks):
        block.attn.set_processor(HunyuanVideoAttnProcessor2_0())
    assert torch.equal(run(wan, wan_inputs()), before[0])
    assert torch.equal(run(hunyuan, hunyuan_inputs()), before[1])
    use_na3d(hunyuan, kernel_size=3)
    hunyuan.set_attn_processor(dict(saved))  # the processors saved before the switch
    assert torch.equal(run(hunyuan, hunyuan_inputs()), before[1])


# ---------------------------------------------------------------------------------------
# Training: gradients through the switched model
# ---------------------------------------------------------------------------------------

def gradients(model, inputs, seed=5):
    """Gradients of a random projection of the output w.r.t. the input latent and every parameter."""
    model.zero_grad(set_to_none=True)
    inputs = dict(inputs, hidden_states=inputs["hidden_states"].clone().requires_grad_())
    out = model(**inputs)[0]
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    (out * cotangent).sum().backward()
    grads = {"input": inputs["hidden_states"].grad}
    grads.update({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    return grads


@pytest.mark.parametrize("family", MODELS)
def test_gradients_equal_masked_reference(family, exact_reference_backend):
    make, inputs = MODELS[family]
    window = ((3, 3, 5), (1, 2, 3), 1, False)
    model, x = make(seed=6), inputs()
    model.train()
    reference = masked_reference(model, window)
    use_na3d(model, kernel_size=window[0], stride=window[1])
    model.enable_gradient_checkpointing()  # blocks recomputed in the backward: the grid must travel with them
    ours, ref = gradients(model, x), gradients(reference, x)
    assert ours.keys() == ref.keys() and len(ours) > 20
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-4, atol=1e-5, msg=name)


# ---------------------------------------------------------------------------------------
# What use_na3d switches, and what it leaves alone
# ---------------------------------------------------------------------------------------

def test_wan_cross_attention_and_image_conditioning_untouched(exact_reference_backend):
    """Wan I2V-style: cross-attention to text and image (added K/V) keeps diffusers' processor."""
    model = wan_model(seed=7, image_dim=8, added_kv_proj_dim=32)
    x = wan_inputs(text=512)  # the I2V processor takes the last 512 context tokens as the text
    x["encoder_hidden_states_image"] = torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(7))
    dense = run(model, x)
    cross = [b.attn2.processor for b in model.blocks]
    assert use_na3d(model, kernel_size=GRID) == 2
    assert [b.attn2.processor for b in model.blocks] == cross
    assert all(isinstance(b.attn1.processor, WanNA3DProcessor) for b in model.blocks)
    assert_close(run(model, x), dense, "I2V with the window covering the grid")


def test_wan_fused_projections(exact_reference_backend):
    model = wan_model(seed=8)
    x = wan_inputs()
    use_na3d(model, kernel_size=3, stride=(1, 2, 2))
    unfused = run(model, x)
    model.fuse_qkv_projections()
    assert model.blocks[0].attn1.fused_projections
    assert_close(run(model, x), unfused, "fused QKV")


class TinyPipeline(DiffusionPipeline):
    """A pipeline with an optional second transformer, as Wan 2.2's (its ``components`` leaves it out)."""

    def __init__(self, transformer, transformer_2=None):
        super().__init__()
        self.register_modules(transformer=transformer, transformer_2=transformer_2)


def test_use_na3d_accepts_a_pipeline_with_two_transformers():
    pipe = TinyPipeline(wan_model(), wan_model(seed=1))
    assert use_na3d(pipe, kernel_size=(3, 3, 3)) == 4
    processors = [b.attn1.processor for t in (pipe.transformer, pipe.transformer_2) for b in t.blocks]
    assert all(isinstance(p, WanNA3DProcessor) and p.kernel_size == (3, 3, 3) for p in processors)


def test_use_na3d_with_a_processor_instance(exact_reference_backend):
    model = hunyuan_model()
    processor = HunyuanVideoNA3DProcessor(3, stride=(1, 2, 2))
    assert use_na3d(model, processor) == 2
    assert all(p is processor for name, p in model.attn_processors.items() if "token_refiner" not in name)
    assert not any(isinstance(p, HunyuanVideoNA3DProcessor)
                   for name, p in model.attn_processors.items() if "token_refiner" in name)
    with pytest.raises(ValueError, match="holds no model that WanNA3DProcessor serves"):
        use_na3d(model, WanNA3DProcessor(3))
    with pytest.raises(ValueError, match="not both"):
        use_na3d(model, processor, kernel_size=3)


def test_rotary_embedding_carries_the_grid():
    model = wan_model()
    use_na3d(model, kernel_size=3)
    rotary = model.rope(torch.zeros(1, 4, 7, 6, 10))
    assert isinstance(rotary, GridRotary) and rotary.grid == (7, 3, 5) and len(rotary) == 2
    assert copy.deepcopy(rotary).grid == (7, 3, 5)
    use_na3d(model, kernel_size=5)  # switching again hooks the rope module once only
    assert model.rope(torch.zeros(1, 4, 7, 6, 10)).grid == (7, 3, 5)


# ---------------------------------------------------------------------------------------
# Bad input: errors naming the argument, never a silent fallback to dense
# ---------------------------------------------------------------------------------------

def test_use_na3d_rejects_unknown_models():
    model = wan_model()
    with pytest.raises(TypeError, match="model must be"):
        use_na3d("transformer", kernel_size=3)
    with pytest.raises(ValueError, match="contains no WanTransformer3DModel or HunyuanVideoTransformer3DModel"):
        use_na3d(torch.nn.Linear(4, 4), kernel_size=3)
    with pytest.raises(ValueError, match="bare block"):
        use_na3d(model.blocks[0], kernel_size=3)
    with pytest.raises(ValueError, match="give its window"):
        use_na3d(model)  # no window: the decoder's switch, which finds no decoder
    with pytest.raises(ValueError, match="need kernel_size"):
        use_na3d(model, stride=2)
    with pytest.raises(TypeError, match="give a window as kernel_size"):
        use_na3d(model, (3, 3, 3))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(kernel_size=(3, 3)), TypeError, "kernel_size="),
    (dict(kernel_size=2.5), TypeError, "kernel_size="),
    (dict(kernel_size=0), ValueError, "kernel_size="),
    (dict(kernel_size=3, stride=4), ValueError, "stride="),
    (dict(kernel_size=3, stride=(1, 0, 1)), ValueError, "stride="),
    (dict(kernel_size=3, dilation=0), ValueError, "dilation="),
    (dict(kernel_size=3, is_causal="yes"), TypeError, "is_causal="),
])
def test_use_na3d_rejects_bad_windows(kwargs, error, match):
    model = wan_model()
    before = [b.attn1.processor for b in model.blocks]
    with pytest.raises(error, match=match):
        use_na3d(model, **kwargs)
    assert [b.attn1.processor for b in model.blocks] == before  # nothing switched


@pytest.mark.parametrize("family", MODELS)
def test_window_larger_than_the_grid_raises_at_call_time(family, exact_reference_backend):
    make, inputs = MODELS[family]
    model = make()
    use_na3d(model, kernel_size=(3, 5, 3))  # fits 5 x 4 x 6? no: H has 4 tokens
    with pytest.raises(ValueError, match=r"token grid \(T, H, W\) = \(5, 4, 6\).*along H kernel \* dilation = 5 > 4"):
        run(model, inputs())
    use_na3d(model, kernel_size=3, dilation=(2, 1, 1))
    with pytest.raises(ValueError, match="along T kernel \\* dilation = 6 > 5"):
        run(model, inputs())


def test_processors_refuse_what_they_cannot_compute():
    model = wan_model()
    model.blocks[0].attn1.set_processor(WanNA3DProcessor(3))  # set by hand: the model's rope is not hooked
    with pytest.raises(ValueError, match="needs the token grid"):
        run(model, wan_inputs())
    processor = WanNA3DProcessor(3)
    hidden = torch.randn(1, 120, 32)
    with pytest.raises(TypeError, match="self-attention WanAttention"):
        processor(model.blocks[0].attn2, hidden)
    rotary = GridRotary((torch.zeros(1), torch.zeros(1)), (5, 4, 5))
    with pytest.raises(ValueError, match="120 video tokens but its token grid"):
        processor(model.blocks[0].attn1, hidden, rotary_emb=rotary)
    with pytest.raises(ValueError, match="attention_mask must be None"):
        processor(model.blocks[0].attn1, hidden, attention_mask=torch.ones(120, 120, dtype=torch.bool))

    hunyuan = hunyuan_model()
    use_na3d(hunyuan, kernel_size=3)
    attn = hunyuan.transformer_blocks[0].attn
    rotary = GridRotary(hunyuan.rope(torch.zeros(LATENT)), GRID)
    text = torch.randn(1, TEXT, 32)
    with pytest.raises(TypeError, match="bool key mask"):
        attn.processor(attn, hidden, text, torch.zeros(1, 1, 1, 127), rotary)
    with pytest.raises(ValueError, match="key mask of shape"):
        attn.processor(attn, hidden, text, torch.ones(1, 1, 127, 127, dtype=torch.bool), rotary)
    with pytest.raises(RuntimeError, match="masks video tokens"):
        attn.processor(attn, hidden, text, torch.zeros(1, 1, 1, 127, dtype=torch.bool), rotary)


def test_ltx_decoder_switch_refuses_a_window():
    from helpers import TINY_CONFIG
    from diffusers.models.autoencoders.ltx2_diffusion_decoder import LTX2VideoDiffusionDecoderModel

    decoder = LTX2VideoDiffusionDecoderModel(**TINY_CONFIG)
    with pytest.raises(ValueError, match="windows are their own"):
        use_na3d(decoder, kernel_size=3)
    with pytest.raises(ValueError, match="need kernel_size"):
        use_na3d(decoder, dilation=2)
    assert use_na3d(decoder, NA3DProcessor()) == 6


# ---------------------------------------------------------------------------------------
# One attention module on na3d's Triton kernels (the interpreter, on a CPU)
# ---------------------------------------------------------------------------------------

def test_wan_module_runs_the_kernel():
    model = wan_model(seed=9)
    window = ((3, 3, 5), (1, 2, 1), 1, (True, False, False))
    attn = model.blocks[0].attn1
    hidden = torch.randn(1, 120, 32, generator=torch.Generator().manual_seed(9))
    rotary = GridRotary(model.rope(torch.zeros(LATENT)), GRID)
    reference = MaskedWan(*window)
    reference.grid = GRID
    with torch.no_grad():
        ref = reference(attn, hidden, rotary_emb=rotary)
        out = WanNA3DProcessor(*window)(attn, hidden, rotary_emb=rotary)
    assert_close(out, ref, "Wan attn1")
    if not launch.kernels_interpreted():
        pytest.skip("compared through the PyTorch reference: the Triton interpreter is not active")


@pytest.mark.parametrize("block", ["dual_stream", "single_stream"])
def test_hunyuan_module_runs_the_kernel(block):
    """Video and text queries of one joint attention, padded text included, against the masked reference."""
    model = hunyuan_model(seed=10)
    attn = (model.transformer_blocks if block == "dual_stream" else model.single_transformer_blocks)[0].attn
    gen = torch.Generator().manual_seed(10)
    hidden, text = torch.randn(2, 120, 32, generator=gen), torch.randn(2, TEXT, 32, generator=gen)
    key_mask = torch.ones(2, 1, 1, 120 + TEXT, dtype=torch.bool)
    key_mask[0, ..., 120 + 3:] = False  # the first sample pads 4 of its 7 text tokens
    rotary = GridRotary(model.rope(torch.zeros(LATENT)), GRID)
    window = ((3, 3, 3), (1, 1, 2), 1, False)
    reference = MaskedHunyuan(*window)
    reference.grid = GRID
    with torch.no_grad():
        ref_video, ref_text = reference(attn, hidden, text, key_mask, rotary)
        video, text_out = HunyuanVideoNA3DProcessor(*window)(attn, hidden, text, key_mask, rotary)
    assert_close(video, ref_video, f"{block} video queries")
    assert_close(text_out, ref_text, f"{block} text queries")
    if not launch.kernels_interpreted():
        pytest.skip("compared through the PyTorch reference: the Triton interpreter is not active")


# ---------------------------------------------------------------------------------------
# GPU: bf16, head dim 128 (the models' own), na3d's kernels forward and backward
# ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("family", MODELS)
@pytest.mark.parametrize("window", [((3, 5, 5), 1, 1, False), ((4, 8, 8), (2, 4, 4), 1, False)],
                         ids=["3x5x5", "4x8x8-stride-2x4x4"])
def test_bf16_on_the_gpu_matches_masked_reference(family, window):
    """Two blocks, 2 heads of 128, grid 8 x 12 x 16: na3d's bf16 outputs and gradients within twice the
    masked reference's own bf16 error (against float32) plus a rounding band."""
    device = torch.device("cuda")
    overrides = dict(attention_head_dim=128, in_channels=16, out_channels=16)
    if family == "wan":
        config = dict(WAN_CONFIG, **overrides)
        make = WanTransformer3DModel
    else:
        config = dict(HUNYUAN_CONFIG, rope_axes_dim=(16, 56, 56), **overrides)
        make = HunyuanVideoTransformer3DModel
    latent, grid = (1, 16, 8, 24, 32), (8, 12, 16)
    torch.manual_seed(11)
    model32 = make(**config).to(device)
    inputs = wan_inputs(latent) if family == "wan" else hunyuan_inputs((5,))
    if family == "hunyuan":
        inputs["hidden_states"] = torch.randn(latent, generator=torch.Generator().manual_seed(12))

    def results(model, dtype, switch):
        model = copy.deepcopy(model).to(dtype)
        if switch:
            use_na3d(model, kernel_size=window[0], stride=window[1])
        else:
            model = masked_reference(model, window, grid)
        x = {k: (v.detach().to(device, dtype) if torch.is_floating_point(v) else v.to(device))
             if torch.is_tensor(v) else v for k, v in inputs.items()}
        x["hidden_states"].requires_grad_()
        out = model(**x)[0]
        out.float().square().mean().backward()
        grads = {"out": out.detach(), "input": x["hidden_states"].grad}
        grads.update({n: p.grad for n, p in model.named_parameters() if "attn" in n and p.grad is not None})
        return {k: v.float() for k, v in grads.items()}

    reference = results(model32, torch.float32, switch=False)
    dense16 = results(model32, torch.bfloat16, switch=False)
    ours = results(model32, torch.bfloat16, switch=True)
    band = 2 * torch.finfo(torch.bfloat16).eps
    for name, ref in reference.items():
        scale = max(1.0, ref.abs().max().item())
        own = (dense16[name] - ref).abs().max().item()
        err = (ours[name] - ref).abs().max().item()
        assert err <= 2 * own + band * scale, f"{family} {name}: {err:.3e} > 2 x {own:.3e} + band"
