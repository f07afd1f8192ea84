"""na3d as the attention processor of the LTX-2.5 diffusion video decoder in diffusers.

    from na3d.diffusers import use_na3d
    use_na3d(decoder_model)   # or a pipeline, or any module containing the decoder

:func:`na3d.diffusers.use_na3d` finds the decoder's attention modules with
:func:`attention_modules` and switches them with :func:`switch`.

What diffusers does, and what this module relies on
(``diffusers/models/autoencoders/ltx2_diffusion_decoder.py``, 0.42.1):

* ``LTX2VideoVaeNeighborhoodAttention.forward(hidden_states, block_mask=None)``
  checks the grid is at least the kernel, then calls
  ``processor(attn, hidden_states, block_mask)`` with ``hidden_states`` channels-last
  ``(B, T, H, W, C)``.
* ``attn.project_qkv(hidden_states)`` returns q, k, v as ``(B, T, H, W, heads,
  head_dim)``: RMS-normed (q, k), **q already multiplied by** ``head_dim ** -0.5``,
  then rotated by the 3D RoPE (q, k). Both diffusers processors therefore attend with
  ``scale=1.0``; so does :class:`NA3DProcessor`.
* The processors return ``attn.to_out[0](out)`` (no dropout, no residual: the
  residual add and the AdaLN modulation live in the blocks).
* The flex processor's window (``_neighborhood_block_mask``) is NATTEN's: per axis
  ``start = clamp(i - K // 2, 0, L - K)``, exactly na3d's definition.
* The ``BlockMask`` is built once per decoder stage, in
  ``LTX2VideoDiffusionDecoder3d.forward_stages_1_to_3`` / ``forward_stage_4`` /
  ``forward_diffusion_step``, by ``blocks[0].attn.build_block_mask(hidden_states)``,
  which returns ``None`` unless that module's processor is an instance of
  ``LTX2VideoVaeNeighborhoodAttnProcessor`` (the flex one). :class:`NA3DProcessor`
  deliberately does not subclass it, so with every attention module switched no mask
  is built: at production grids the mask alone would exceed device memory.
  :func:`switch` checks that this still holds for the installed diffusers and, if a
  module's ``build_block_mask`` would build a mask anyway, guards that module instance
  (never the diffusers class or module globally).
"""

import logging
import types
from typing import List, Tuple

import torch
from diffusers.models.autoencoders.ltx2_diffusion_decoder import LTX2VideoVaeNeighborhoodAttention
from torch import nn

from ..api import na3d_flash_attn

__all__ = ["NA3DProcessor", "attention_modules", "switch"]

logger = logging.getLogger(__name__)


class NA3DProcessor:
    """Processor for ``LTX2VideoVaeNeighborhoodAttention`` that runs :func:`na3d.na3d_flash_attn`.

    Computes what diffusers' ``LTX2VideoVaeNeighborhoodAttnProcessor`` (flex) and
    ``LTX2VideoVaeNeighborhoodNattenProcessor`` compute: ``attn.project_qkv`` (norms,
    query scaling, RoPE), neighborhood attention over ``attn.kernel_size`` with
    ``scale=1.0`` (the query is pre-scaled), then ``attn.to_out[0]``. q, k and v go to
    na3d as they come out of ``project_qkv``, as heads-last ``(B, T, H, W, heads,
    head_dim)`` views, without copies.

    Device policy and gradients are na3d's (see :func:`na3d.na3d`): CUDA runs the
    Triton kernels; the CPU runs the exact PyTorch reference or, with
    ``TRITON_INTERPRET=1``, the kernels in the Triton interpreter. Unlike diffusers' flex
    processor on the CPU, it is differentiable there. Dtypes: bfloat16, float16, float32
    (a float64 decoder raises ``TypeError``); head_dim a multiple of 8 from 8 to 256.
    Non-finite inputs: see the README's "non-finite inputs" row.

    Called by diffusers as ``processor(attn, hidden_states, block_mask)``: ``attn`` an
    ``LTX2VideoVaeNeighborhoodAttention``, ``hidden_states`` channels-last
    ``(B, T, H, W, C)``, ``block_mask`` None (a FlexAttention mask raises
    ``ValueError``: na3d computes the window itself). Returns ``(B, T, H, W, C)``.

    Example::

        decoder.set_attn_processor(NA3DProcessor())   # what use_na3d(decoder) installs

    The processor holds no state, so one instance can serve every module.
    ``model.set_attention_backend(...)`` does not apply to it (it has no
    ``_attention_backend`` attribute, so diffusers skips it).

    Subclasses may override :meth:`attention` to swap the attention operator while
    keeping the projections (the decoder benchmark does).
    """

    def __call__(
        self,
        attn: LTX2VideoVaeNeighborhoodAttention,
        hidden_states: torch.Tensor,
        block_mask=None,
    ) -> torch.Tensor:
        if not isinstance(attn, LTX2VideoVaeNeighborhoodAttention):
            raise TypeError(f"attn must be an LTX2VideoVaeNeighborhoodAttention, got {type(attn).__name__}")
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 5:
            shape = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states)
            raise ValueError(f"hidden_states must be a channels-last (B, T, H, W, C) tensor, got {shape}")
        if block_mask is not None:
            # Ignoring it would be silently wrong for any mask other than the window na3d
            # computes itself. Diffusers only builds one when the first block of a stage
            # runs the flex processor while this block runs na3d.
            raise ValueError(
                "block_mask must be None: NA3DProcessor computes the neighborhood window in its kernel and "
                "cannot apply a FlexAttention BlockMask. A mask is passed when the first attention module of a "
                "decoder stage still uses the flex processor; switch every module with na3d.diffusers.use_na3d.")
        batch, frames, height, width, _ = hidden_states.shape
        query, key, value = attn.project_qkv(hidden_states)
        out = self.attention(query, key, value, attn.kernel_size)
        out = out.reshape(batch, frames, height, width, attn.heads * attn.head_dim)
        return attn.to_out[0](out)

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  kernel_size: Tuple[int, int, int]) -> torch.Tensor:
        """Neighborhood attention on pre-scaled ``(B, T, H, W, heads, head_dim)`` q, k, v."""
        return na3d_flash_attn(query, key, value, kernel_size)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _mask_builder_skips(module: LTX2VideoVaeNeighborhoodAttention) -> bool:
    """Whether ``module.build_block_mask`` returns ``None`` for its current processor.

    The probe is a meta tensor of the smallest valid grid: diffusers 0.42 returns
    before looking at it; a version that would build a mask builds a tiny one (or
    fails on the meta device), and either way we learn it would not skip.
    """
    probe = torch.empty((1, *module.kernel_size, 0), device="meta")
    try:
        return module.build_block_mask(probe) is None
    except Exception:  # building on the meta device failed: it did try to build
        return False


def _guard_mask_builder(module: LTX2VideoVaeNeighborhoodAttention) -> None:
    """Make this instance's ``build_block_mask`` return ``None`` while it runs an NA3DProcessor.

    An instance attribute shadowing the class method, on this module only. Any other
    processor set later gets diffusers' own method, so switching back to flex keeps
    working.
    """
    class_builder = type(module).build_block_mask

    def build_block_mask(self, hidden_states):
        if isinstance(self.processor, NA3DProcessor):
            return None
        return class_builder(self, hidden_states)

    module.build_block_mask = types.MethodType(build_block_mask, module)


def attention_modules(roots: List[nn.Module]) -> List[LTX2VideoVaeNeighborhoodAttention]:
    """Every ``LTX2VideoVaeNeighborhoodAttention`` inside ``roots``, in module order."""
    return [m for root in roots for m in root.modules() if isinstance(m, LTX2VideoVaeNeighborhoodAttention)]


def switch(modules: List[LTX2VideoVaeNeighborhoodAttention], processor: NA3DProcessor) -> int:
    """Install ``processor`` on ``modules``; returns how many.

    After the switch the decoder builds no FlexAttention ``BlockMask``: diffusers' own
    ``build_block_mask`` skips processors that are not its flex processor. This is
    checked per module, and a module whose builder would still build one gets an
    instance-level guard (see the module docstring).
    """
    guarded = 0
    for module in modules:
        module.set_processor(processor)
        if not _mask_builder_skips(module):
            _guard_mask_builder(module)
            guarded += 1
    if guarded:
        logger.info("na3d.diffusers: this diffusers version's build_block_mask does not skip non-flex processors; "
                    "guarded %d attention module instances so no BlockMask is built", guarded)
    return len(modules)
