"""na3d in diffusers: one switch, :func:`use_na3d`, for the models whose attention it takes.

    from na3d.diffusers import use_na3d
    use_na3d(decoder)                                # the LTX-2.5 diffusion decoder: its own windows
    use_na3d(transformer, kernel_size=(9, 15, 15))   # Wan 2.1, HunyuanVideo: the window you choose

Needs ``diffusers>=0.42`` (the ``diffusers`` extra: ``pip install -e ".[diffusers]"`` in a
clone, or ``pip install "<wheel>[diffusers]"``); the core ``na3d`` package never
imports diffusers, only this package does.

* :mod:`na3d.diffusers.ltx_decoder`: :class:`NA3DProcessor`, the LTX-2.5 decoder's
  neighborhood attention (its windows are the model's).
* :mod:`na3d.diffusers.video_dit`: :class:`WanNA3DProcessor` and
  :class:`HunyuanVideoNA3DProcessor`, the self-attention of the video transformers
  (``WanTransformer3DModel``, ``HunyuanVideoTransformer3DModel``) turned into 3-D
  neighborhood attention over their token grid.

Details and measurements: ``docs/diffusers.md``.
"""

from typing import Union

from torch import nn

try:
    from diffusers import DiffusionPipeline
    from diffusers.models.autoencoders import ltx2_diffusion_decoder  # noqa: F401
except ImportError as error:  # diffusers missing, or older than the LTX-2.5 decoder
    raise ImportError(
        "na3d.diffusers needs diffusers>=0.42 (the LTX-2.5 diffusion decoder, "
        "diffusers.models.autoencoders.ltx2_diffusion_decoder): pip install 'diffusers>=0.42'"
    ) from error

from . import ltx_decoder, video_dit
from .ltx_decoder import NA3DProcessor
from .video_dit import DiTNA3DProcessor, GridRotary, HunyuanVideoNA3DProcessor, WanNA3DProcessor

__all__ = ["DiTNA3DProcessor", "GridRotary", "HunyuanVideoNA3DProcessor", "NA3DProcessor", "WanNA3DProcessor",
           "use_na3d"]

_MODELS = "WanTransformer3DModel or HunyuanVideoTransformer3DModel"


def _modules_of(model) -> list:
    """The ``nn.Module`` s to search: the model itself, or a pipeline's module components."""
    if isinstance(model, nn.Module):
        return [model]
    if isinstance(model, DiffusionPipeline):
        # Every registered module: ``components`` leaves out optional ones (a second transformer).
        found = (getattr(model, name, None) for name in model.config.keys() if not name.startswith("_"))
        return [c for c in found if isinstance(c, nn.Module)]
    components = getattr(model, "components", None)
    if isinstance(components, dict):  # a pipeline-like object
        return [c for c in components.values() if isinstance(c, nn.Module)]
    raise TypeError(
        f"model must be a torch.nn.Module (an LTX2VideoDiffusionDecoderModel, a {_MODELS}, ...) or a diffusers "
        f"pipeline, got {type(model).__name__}")


def use_na3d(model: Union[nn.Module, DiffusionPipeline], processor=None, *, kernel_size=None, stride=1,
             dilation=1, is_causal=False) -> int:
    """Switch a diffusers model's attention to na3d; returns how many attention modules were switched.

    Two kinds of models, told apart by whether a window is given:

    * ``use_na3d(decoder)``: every ``LTX2VideoVaeNeighborhoodAttention`` of the LTX-2.5
      diffusion decoder runs :class:`NA3DProcessor` over the module's own kernel size.
      No FlexAttention ``BlockMask`` is built afterwards.
    * ``use_na3d(transformer, kernel_size=..., stride=1, dilation=1, is_causal=False)``:
      the self-attention of every block of each ``WanTransformer3DModel`` (``attn1``;
      the cross-attention ``attn2`` is untouched) and ``HunyuanVideoTransformer3DModel``
      (the joint attention of its dual- and single-stream blocks; video queries see
      their window plus every valid text token, text queries every valid token)
      becomes 3-D neighborhood attention over the post-patch token grid (frames x
      height x width, as the model flattens them). The grid is read from the model's
      input at each call, so any resolution and frame count the model takes works;
      the window must fit it (checked at each call). Projections, QK norms and
      rotary embeddings stay the model's own.

    Args:
        model: an ``nn.Module`` that is or contains such models (an
            ``LTX2VideoDiffusionDecoderModel`` or its ``.decoder``; a
            ``WanTransformer3DModel``, a ``HunyuanVideoTransformer3DModel``), or a
            diffusers pipeline (its module components are searched: both
            transformers of a two-expert Wan pipeline are switched). Any device
            and dtype na3d supports (bfloat16, float16, float32; a float64 model
            raises ``TypeError`` at its first attention call).
        processor: the instance to install instead of a new one: an
            :class:`NA3DProcessor` (decoder), or a :class:`WanNA3DProcessor` /
            :class:`HunyuanVideoNA3DProcessor` (its window inside; only models of
            its family are switched). Then ``kernel_size`` and the other window
            arguments are not given.
        kernel_size: for the video transformers: ``K`` per axis of the token grid,
            an int or ``(KT, KH, KW)``; a window covering the grid is dense attention.
        stride: ``1 <= stride <= kernel_size`` per axis: each group of ``stride``
            consecutive queries shares one window (NATTEN's strided, "generalized"
            neighborhood attention; block-sparse when the groups match the kernels' tiles).
        dilation: ``>= 1`` per axis, ``kernel_size * dilation`` within the grid.
        is_causal: per axis, e.g. ``(True, False, False)`` for causal frames.

    Returns:
        The number of attention modules switched (30 for Wan 2.1 1.3B, 60 for
        HunyuanVideo, 24 for the LTX-2.5 decoder).

    Raises:
        TypeError: ``model`` is neither a module nor a pipeline, ``processor`` is
            not one of the processors above, or a window argument has the wrong type.
        ValueError: nothing to switch (a module without such models: a bare block
            of a video transformer too, whose token grid only its model knows);
            a window the video transformers need but not given, or given for the
            decoder (whose windows are its own); a kernel, stride or dilation na3d
            refuses. At call time: a window larger than that input's token grid
            (the message names the grid). Never a silent fallback to dense attention.

    To switch back, install diffusers' processors: ``model.set_attn_processor(
    WanAttnProcessor())`` for Wan, ``HunyuanVideoAttnProcessor2_0()`` on each block's
    ``attn`` for HunyuanVideo, ``LTX2VideoVaeNeighborhoodAttnProcessor()`` for the
    decoder (or ``model.set_attn_processor(saved)`` with ``saved = model.attn_processors``
    taken before the switch).

    Example::

        transformer = WanTransformer3DModel.from_pretrained(path, subfolder="transformer", torch_dtype=torch.bfloat16)
        use_na3d(transformer, kernel_size=(9, 15, 15))      # 30 modules
        use_na3d(pipe, kernel_size=(18, 24, 24), stride=(2, 8, 8))   # a HunyuanVideo pipeline
    """
    roots = _modules_of(model)
    video = kernel_size is not None or isinstance(processor, DiTNA3DProcessor)
    if not video:
        if (stride, dilation, is_causal) != (1, 1, False):
            raise ValueError("stride, dilation and is_causal describe a video transformer's window and need "
                             "kernel_size=...; the LTX-2.5 decoder's windows are its modules' own")
        if processor is None:
            processor = NA3DProcessor()
        elif not isinstance(processor, NA3DProcessor):
            raise TypeError(f"processor must be an NA3DProcessor (LTX-2.5 decoder), a WanNA3DProcessor or a "
                            f"HunyuanVideoNA3DProcessor instance, got {type(processor).__name__}"
                            + (": give a window as kernel_size=..." if isinstance(processor, (int, tuple, list))
                               else ""))
        modules = ltx_decoder.attention_modules(roots)
        if not modules:
            hint = (f" It holds a {type(video_dit.find_models(roots)[0]).__name__}: give its window, "
                    "use_na3d(model, kernel_size=...)." if video_dit.find_models(roots) else
                    " Pass the LTX-2.5 diffusion decoder (LTX2VideoDiffusionDecoderModel), its .decoder, or the "
                    f"LTX2VideoDiffusionDecodePipeline; or a {_MODELS} with kernel_size=....")
            raise ValueError(f"model ({type(model).__name__}) contains no LTX2VideoVaeNeighborhoodAttention module: "
                             f"nothing to switch.{hint}")
        return ltx_decoder.switch(modules, processor)

    if processor is not None:
        if kernel_size is not None or (stride, dilation, is_causal) != (1, 1, False):
            raise ValueError(f"give the window either as kernel_size=... (and stride, dilation, is_causal) or "
                             f"inside processor ({processor!r}), not both")
        if type(processor) is DiTNA3DProcessor:
            raise TypeError("processor must be a WanNA3DProcessor or a HunyuanVideoNA3DProcessor, not their base")
    else:
        DiTNA3DProcessor(kernel_size, stride, dilation, is_causal)  # the window's checks, before anything changes
    models = video_dit.find_models(roots)
    switched = video_dit.switch(models, processor, kernel_size, stride, dilation, is_causal)
    if switched == 0:
        if models:
            raise ValueError(f"model ({type(model).__name__}) holds no model that {type(processor).__name__} "
                             f"serves (it holds {sorted({type(m).__name__ for m in models})})")
        hint = (" It holds LTX-2.5 decoder attention modules: their windows are their own, call use_na3d(model) "
                "without kernel_size." if ltx_decoder.attention_modules(roots) else
                " A bare block or attention module is not enough: pass the model that holds it, whose input gives "
                "the token grid.")
        raise ValueError(f"model ({type(model).__name__}) contains no {_MODELS}: nothing to switch.{hint}")
    return switched
