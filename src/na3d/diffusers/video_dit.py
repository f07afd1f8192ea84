"""na3d as the self-attention of diffusers' video transformers: Wan 2.1 and HunyuanVideo.

    from na3d.diffusers import use_na3d
    use_na3d(transformer, kernel_size=(9, 15, 15))   # a WanTransformer3DModel, a HunyuanVideo one, a pipeline

:func:`na3d.diffusers.use_na3d` finds the models with :func:`find_models` and
switches them with :func:`switch`. Each block's self-attention becomes 3-D
neighborhood attention over the post-patch token grid (frames x height x width);
everything else (projections, QK norms, rotary embeddings, output projections,
cross-attention) stays the model's own.

What diffusers does (0.42.1), and what this module relies on:

* Both models embed the latent ``(B, C, F, H, W)`` with a ``Conv3d`` whose kernel
  and stride are the patch size and flatten its output ``(B, C', F', H', W')`` with
  ``flatten(2).transpose(1, 2)``: token ``n`` is grid position ``(t, h, w)`` in
  row-major order, ``F' = F // p_t``, ``H' = H // p_h``, ``W' = W // p_w``. Both
  compute their rotary embedding by ``self.rope(hidden_states)`` on that latent,
  before the blocks, and hand it to every block. :func:`switch` hooks the model's
  ``rope`` module so that the embedding it returns is a :class:`GridRotary`: the same
  ``(cos, sin)`` tuple, carrying the grid of the input it was made for. That is how
  each attention call learns its grid (any resolution and frame count the model
  takes), also when gradient checkpointing recomputes a block later.
* ``WanTransformerBlock.attn1`` (a ``WanAttention``, ``is_cross_attention`` False) is
  the self-attention: ``WanAttnProcessor`` projects (``to_q/k/v`` or the fused
  ``to_qkv``), applies ``norm_q``/``norm_k`` across heads, splits heads, rotates q and k
  (its interleaved-pair rotation, written out below as in diffusers), attends with
  SDPA's default scale ``head_dim ** -0.5``, no mask, then ``to_out[0]``, ``to_out[1]``.
  ``attn2`` (cross-attention to the text, and to the image for I2V) is not touched.
* ``HunyuanVideoTransformerBlock.attn`` (dual-stream: video through ``to_q/k/v``, text
  through ``add_q/k/v_proj``) and ``HunyuanVideoSingleTransformerBlock.attn``
  (single-stream: ``to_q/k/v`` over the video tokens followed by the text tokens) run
  ``HunyuanVideoAttnProcessor2_0``: heads split, ``norm_q``/``norm_k`` (and
  ``norm_added_q/k``) per head, ``apply_rotary_emb(..., sequence_dim=1)`` on the video
  tokens only, one joint SDPA over ``[video, text]`` with the model's key mask
  ``(B, 1, 1, N + S)``: video tokens and the first ``encoder_attention_mask.sum()``
  text tokens valid, padded text masked. Outputs split back; ``to_out`` on the video
  part and ``to_add_out`` on the text part where the module has them.
  :class:`HunyuanVideoNA3DProcessor` keeps all of that and changes what each video
  query sees: its neighborhood plus every valid text token. Text queries still see
  every valid token.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttention, WanTransformer3DModel
from torch import nn

from .. import api
from ..merge import merge_attentions

__all__ = ["DiTNA3DProcessor", "GridRotary", "HunyuanVideoNA3DProcessor", "WanNA3DProcessor", "find_models",
           "switch"]

Triple = Tuple[int, int, int]
MODEL_CLASSES = (WanTransformer3DModel, HunyuanVideoTransformer3DModel)


class GridRotary(tuple):
    """A model's rotary embedding ``(cos, sin)`` that knows the token grid ``(T, H, W)`` it was made for.

    What a switched model's ``rope`` module returns: the tuple the blocks and
    diffusers' processors use as before, with one attribute more, ``grid``.
    """

    def __new__(cls, freqs: Sequence[torch.Tensor], grid: Triple):
        rotary = super().__new__(cls, freqs)
        rotary.grid = tuple(grid)
        return rotary

    def __getnewargs__(self):
        return tuple(self), self.grid


def _ints(value, name: str) -> Triple:
    """An int or a 3-sequence of ints (Python or NumPy) as a tuple of Python ints."""
    def is_int(x):
        return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))

    if is_int(value):
        return (int(value),) * 3
    if isinstance(value, (tuple, list)) and len(value) == 3 and all(is_int(x) for x in value):
        return tuple(int(x) for x in value)
    raise TypeError(f"{name}={value!r} must be an int or a tuple of 3 ints, (T, H, W)")


def _bools(value, name: str) -> Tuple[bool, bool, bool]:
    if isinstance(value, (bool, np.bool_)):
        return (bool(value),) * 3
    if isinstance(value, (tuple, list)) and len(value) == 3 and all(isinstance(x, (bool, np.bool_)) for x in value):
        return tuple(bool(x) for x in value)
    raise TypeError(f"{name}={value!r} must be a bool or a tuple of 3 bools, (T, H, W)")


class DiTNA3DProcessor:
    """What the video-transformer processors share: the window, the grid, the attention call.

    ``kernel_size``, ``stride``, ``dilation`` and ``is_causal`` are :func:`na3d.na3d`'s
    (per axis of the token grid, in ``(T, H, W)`` order) and are checked here, when the
    processor is made, by na3d's own rules; whether the kernel fits the grid is
    checked at each call, against the grid of that call's input.

    Subclasses may override :meth:`attention` to swap the neighborhood-attention
    operator while keeping everything else (the benchmark runs NATTEN that way).
    """

    def __init__(self, kernel_size, stride=1, dilation=1, is_causal=False):
        kernel_size, dilation = _ints(kernel_size, "kernel_size"), _ints(dilation, "dilation")
        stride, is_causal = _ints(stride, "stride"), _bools(is_causal, "is_causal")
        # na3d's own checks of every argument, on an empty batch whose grid just fits
        # the window: nothing runs.
        probe = torch.empty(0, *(max(1, k) * max(1, d) for k, d in zip(kernel_size, dilation)), 1, 8)
        api.na3d(probe, probe, probe, kernel_size, stride, dilation, is_causal)
        self.kernel_size, self.stride, self.dilation, self.is_causal = kernel_size, stride, dilation, is_causal

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  return_lse: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """Neighborhood attention on ``(B, T, H, W, heads, head_dim)`` q, k, v with scale ``head_dim ** -0.5``
        (SDPA's default, what diffusers' processors use); with ``return_lse``, also the log-sum-exps."""
        return api.na3d(query, key, value, self.kernel_size, self.stride, self.dilation, self.is_causal,
                        return_lse=return_lse)

    def token_grid(self, rotary, tokens: int) -> Triple:
        """The grid of this call's video tokens, from the rotary embedding the model made for its input.

        Raises ``ValueError`` if the embedding carries no grid (the module was not
        switched through :func:`na3d.diffusers.use_na3d` on its model), if the grid
        does not hold ``tokens`` tokens, or if the window does not fit it.
        """
        grid = getattr(rotary, "grid", None)
        if grid is None:
            raise ValueError(
                f"{type(self).__name__} needs the token grid of the input, which the model's rotary embedding "
                "carries once the model was switched with na3d.diffusers.use_na3d(model, kernel_size=...): "
                "switch the whole WanTransformer3DModel / HunyuanVideoTransformer3DModel (or its pipeline), "
                "not single attention modules or blocks")
        if math.prod(grid) != tokens:
            raise ValueError(f"the input has {tokens} video tokens but its token grid (T, H, W) = {grid} holds "
                             f"{math.prod(grid)}: the model flattens tokens in a way this processor does not know")
        for axis, k, d, n in zip("THW", self.kernel_size, self.dilation, grid):
            if k * d > n:
                raise ValueError(
                    f"kernel_size={self.kernel_size} with dilation={self.dilation} does not fit this input's token "
                    f"grid (T, H, W) = {grid} (frames, height and width after patching): along {axis} "
                    f"kernel * dilation = {k * d} > {n}. Use a smaller window or a larger input.")
        return grid

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(kernel_size={self.kernel_size}, stride={self.stride}, "
                f"dilation={self.dilation}, is_causal={self.is_causal})")


def _wan_rotary(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotation of interleaved pairs, as ``WanAttnProcessor`` writes it."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class WanNA3DProcessor(DiTNA3DProcessor):
    """The self-attention (``attn1``) of a ``WanTransformer3DModel`` block, on na3d.

    Computes what ``WanAttnProcessor`` computes, with each video token attending to its
    3-D neighborhood instead of every token: the module's projections (fused or not),
    ``norm_q``/``norm_k``, Wan's rotary embedding, :meth:`attention` on heads-last
    ``(B, T, H, W, heads, head_dim)`` views (no copies), ``to_out``.

    Called by diffusers as ``processor(attn, hidden_states, None, None, rotary_emb)``
    with ``hidden_states`` ``(B, N, C)`` and ``rotary_emb`` the :class:`GridRotary` of
    the model's input. Returns ``(B, N, C)``.

    Example::

        use_na3d(transformer, kernel_size=(9, 15, 15))   # installs one of these on every block's attn1
        transformer.blocks[0].attn1.set_processor(WanNA3DProcessor((9, 15, 15)))   # the same, one module
    """

    def __call__(self, attn: WanAttention, hidden_states: torch.Tensor,
                 encoder_hidden_states: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                 rotary_emb: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        if not isinstance(attn, WanAttention) or attn.is_cross_attention:
            raise TypeError(f"attn must be the self-attention WanAttention of a Wan block (attn1), got "
                            f"{type(attn).__name__}{' (cross-attention)' if isinstance(attn, WanAttention) else ''}")
        if encoder_hidden_states is not None:
            raise ValueError("encoder_hidden_states must be None: WanNA3DProcessor is the blocks' self-attention; "
                             "their cross-attention (attn2) keeps diffusers' WanAttnProcessor")
        if attention_mask is not None:
            raise ValueError("attention_mask must be None: the neighborhood window is the mask, and Wan's "
                             "self-attention has none")
        grid = self.token_grid(rotary_emb, hidden_states.shape[1])
        if attn.fused_projections:
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, value))
        query, key = _wan_rotary(query, *rotary_emb), _wan_rotary(key, *rotary_emb)
        out = self.attention(*(x.unflatten(1, grid) for x in (query, key, value)))
        out = out.flatten(1, 3).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def _key_mask(attention_mask: Optional[torch.Tensor], batch: int, tokens: int, text: int) -> Optional[torch.Tensor]:
    """The model's key mask as ``(B, N + S)`` bool, or None; the video keys must all be valid."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool:
        raise TypeError(f"attention_mask must be a bool key mask (True: attend), as HunyuanVideoTransformer3DModel "
                        f"builds it; got {getattr(attention_mask, 'dtype', type(attention_mask).__name__)}")
    if attention_mask.numel() != batch * (tokens + text) or attention_mask.shape[-1] != tokens + text:
        raise ValueError(f"attention_mask must be a key mask of shape (B, 1, 1, N + S) = ({batch}, 1, 1, "
                         f"{tokens + text}) (one flag per key, the same for every query); got "
                         f"{tuple(attention_mask.shape)}")
    mask = attention_mask.reshape(batch, tokens + text)
    # Checked on the device, without waiting for it: the model never masks a video token.
    torch._assert_async(mask[:, :tokens].all(), "attention_mask masks video tokens: na3d's window needs them all")
    return mask


def _attend_text(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: Optional[torch.Tensor],
                 score_budget: int = 1 << 26) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every video query over the valid text tokens: ``(out, lse)`` in na3d's layouts, float32 softmax.

    ``query`` ``(B, T, H, W, NH, HD)``, ``keys``/``values`` ``(B, S, NH, HD)``,
    ``valid`` ``(B, S)`` bool or None. The arithmetic of :func:`na3d.na3d`'s
    ``additional_keys`` (which takes no mask) with the padded keys masked out;
    queries in chunks so that the float32 scores stay under ``score_budget``
    elements. A query with no valid text token gets lse ``-inf`` and output 0
    (weight 0 in the merge).
    """
    B, T, H, W, NH, HD = query.shape
    S = keys.shape[1]
    q = query.reshape(B, T * H * W, NH, HD)
    kf, vf = keys.float(), values.float()
    masked = None if valid is None else ~valid[:, None, None, :]
    chunk = max(1, score_budget // max(1, B * NH * S))
    outs, lses = [], []
    for n0 in range(0, q.shape[1], chunk):
        scores = torch.einsum("bnhd,bshd->bhns", q[:, n0:n0 + chunk].float(), kf) * HD ** -0.5
        if masked is not None:
            scores = scores.masked_fill(masked, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        outs.append(torch.einsum("bhns,bshd->bnhd", torch.exp(scores - finite[..., None]), vf))
        lses.append(lse.transpose(1, 2))
    out = torch.cat(outs, 1).reshape(B, T, H, W, NH, HD).to(query.dtype)
    return out, torch.cat(lses, 1).reshape(B, T, H, W, NH)


class HunyuanVideoNA3DProcessor(DiTNA3DProcessor):
    """The joint attention of a ``HunyuanVideoTransformer3DModel`` block (dual- or single-stream), on na3d.

    Computes what ``HunyuanVideoAttnProcessor2_0`` computes, but for what a video query
    sees: the module's projections, QK norms and rotary embedding (video tokens
    only), then

    * each video query: its 3-D neighborhood among the video tokens (:meth:`attention`,
      with log-sum-exps) plus every valid text token (float32, masked as diffusers
      masks them), merged through the log-sum-exps (:func:`na3d.merge_attentions`,
      the arithmetic of na3d's ``additional_keys``, which has no key mask);
    * each text query: every valid token, video and text (SDPA with the model's key
      mask, as diffusers);

    then ``to_out`` (video) and ``to_add_out`` (text) where the module has them.

    Called by diffusers as ``processor(attn, hidden_states, encoder_hidden_states,
    attention_mask, image_rotary_emb)``: ``hidden_states`` ``(B, N, C)`` the video
    tokens, ``encoder_hidden_states`` ``(B, S, C)`` the text tokens,
    ``attention_mask`` the model's bool key mask ``(B, 1, 1, N + S)`` (or None: all
    valid), ``image_rotary_emb`` the :class:`GridRotary` of the model's input.
    Returns ``(video, text)`` as diffusers' processor does.
    """

    def __call__(self, attn: Attention, hidden_states: torch.Tensor,
                 encoder_hidden_states: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                 image_rotary_emb: Optional[Tuple[torch.Tensor, torch.Tensor]] = None):
        if not isinstance(attn, Attention):
            raise TypeError(f"attn must be the Attention module of a HunyuanVideo block, got {type(attn).__name__}")
        batch, tokens = hidden_states.shape[:2]
        grid = self.token_grid(image_rotary_emb, tokens)
        text = 0 if encoder_hidden_states is None else encoder_hidden_states.shape[1]
        key_mask = _key_mask(attention_mask, batch, tokens, text)
        single_stream = attn.add_q_proj is None
        joint = torch.cat([hidden_states, encoder_hidden_states], dim=1) if single_stream and text else hidden_states

        query, key, value = (proj(joint).unflatten(2, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        query, text_query = query[:, :tokens], query[:, tokens:]
        key, text_key = key[:, :tokens], key[:, tokens:]
        value, text_value = value[:, :tokens], value[:, tokens:]
        query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        if not single_stream and text:
            text_query, text_key, text_value = (
                proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
                for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            if attn.norm_added_q is not None:
                text_query = attn.norm_added_q(text_query)
            if attn.norm_added_k is not None:
                text_key = attn.norm_added_k(text_key)

        video = tuple(x.unflatten(1, grid) for x in (query, key, value))
        if not text:
            out = self.attention(*video)
            return out.flatten(1, 3).flatten(2, 3).to(query.dtype), None
        out, lse = self.attention(*video, return_lse=True)
        valid = None if key_mask is None else key_mask[:, tokens:]
        text_out, text_lse = _attend_text(video[0], text_key, text_value, valid)
        out, _ = merge_attentions([out, text_out], [lse, text_lse])
        hidden_out = out.flatten(1, 3).flatten(2, 3).to(query.dtype)

        keys, values = (torch.cat(pair, dim=1).transpose(1, 2) for pair in ((key, text_key), (value, text_value)))
        sdpa_mask = None if key_mask is None else key_mask[:, None, None, :]
        text_out = F.scaled_dot_product_attention(text_query.transpose(1, 2), keys, values, attn_mask=sdpa_mask)
        text_out = text_out.transpose(1, 2).flatten(2, 3).to(query.dtype)

        if getattr(attn, "to_out", None) is not None:
            hidden_out = attn.to_out[1](attn.to_out[0](hidden_out))
        if getattr(attn, "to_add_out", None) is not None:
            text_out = attn.to_add_out(text_out)
        return hidden_out, text_out


# What each model family switches: its processor class, its self-attention modules,
# its patch size (frames, height, width), read from the model's config.

def _wan_modules(model: WanTransformer3DModel) -> List[nn.Module]:
    return [block.attn1 for block in model.blocks]


def _hunyuan_modules(model: HunyuanVideoTransformer3DModel) -> List[nn.Module]:
    return [block.attn for block in (*model.transformer_blocks, *model.single_transformer_blocks)]


def _patch_size(model: nn.Module) -> Triple:
    if isinstance(model, WanTransformer3DModel):
        return tuple(model.config.patch_size)
    return model.config.patch_size_t, model.config.patch_size, model.config.patch_size


FAMILIES: Dict[type, Tuple[type, Callable[[nn.Module], List[nn.Module]]]] = {
    WanTransformer3DModel: (WanNA3DProcessor, _wan_modules),
    HunyuanVideoTransformer3DModel: (HunyuanVideoNA3DProcessor, _hunyuan_modules),
}


def _family(model: nn.Module) -> Tuple[type, Callable[[nn.Module], List[nn.Module]]]:
    return next(family for cls, family in FAMILIES.items() if isinstance(model, cls))


def find_models(roots: List[nn.Module]) -> List[nn.Module]:
    """Every ``WanTransformer3DModel`` and ``HunyuanVideoTransformer3DModel`` inside ``roots``."""
    return [m for root in roots for m in root.modules() if isinstance(m, MODEL_CLASSES)]


def _hook_grid(model: nn.Module) -> None:
    """Make ``model.rope`` return a :class:`GridRotary` carrying the post-patch grid of its input.

    One forward hook on that module instance (once: a marker attribute remembers
    it). The hook reads the grid off the latent the rope module is given, exactly as
    the model computes its post-patch sizes.
    """
    rope = model.rope
    patch = _patch_size(model)
    if getattr(rope, "_na3d_patch_size", None) == patch:
        return

    def attach_grid(module, args, kwargs, output):
        latent = args[0] if args else kwargs["hidden_states"]
        return GridRotary(output, tuple(n // p for n, p in zip(latent.shape[2:], patch)))

    rope.register_forward_hook(attach_grid, with_kwargs=True)
    rope._na3d_patch_size = patch


def switch(models: List[nn.Module], processor: Optional[DiTNA3DProcessor], kernel_size, stride, dilation,
           is_causal) -> int:
    """Switch the self-attention of every block of ``models`` to na3d; returns how many modules.

    With ``processor`` (a :class:`WanNA3DProcessor` or :class:`HunyuanVideoNA3DProcessor`,
    its window inside) only the models of its family are switched, with that instance;
    otherwise each model gets a new processor of its family with the window given.
    """
    switched = 0
    made = {}
    for model in models:
        cls, modules = _family(model)
        if processor is not None and not isinstance(processor, cls):
            continue
        if processor is not None:
            chosen = processor
        else:
            if cls not in made:
                made[cls] = cls(kernel_size, stride, dilation, is_causal)
            chosen = made[cls]
        _hook_grid(model)
        for module in modules(model):
            module.set_processor(chosen)
            switched += 1
    return switched
