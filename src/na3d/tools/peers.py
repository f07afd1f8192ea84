"""The other exact neighborhood-attention kernels the benchmark times beside na3d.

Optional and for measurement only: the peers are imported here, when the benchmark
asks, and nowhere else in the package. Each is called the way its users call it.

* ``natten_hopper``: NATTEN's Hopper FNA, ``natten.na3d(..., backend="hopper-fna")``
  (CUTLASS 3 kernels for compute capability 9.0 only), forward and backward. Its
  tile shapes and kernel schedule are arguments of the call (by default the first
  configuration NATTEN lists), so the benchmark times NATTEN's configurations on
  each shape (:func:`best_config`) and keeps the fastest, as a user tuning it would.
* ``comfy_cuda``, ``comfy_triton``: comfy-kitchen's ``na3d``, what ComfyUI runs for
  the LTX-2 decoder's neighborhood attention: a CUDA kernel (head dim <= 64) and a
  Triton kernel, forward only.

:func:`available_methods` says which of them run in this process (installed, and
on a GPU they support) and why the others do not.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

NATTEN = "natten_hopper"
COMFY = ("comfy_cuda", "comfy_triton")
METHODS = (NATTEN,) + COMFY

# For 3-D Hopper FNA NATTEN 0.21.7 lists 2 (head dim 64) or 4 (128) forward and 4
# backward configurations; a version listing more would still cost at most this many
# trials per shape and pass.
MAX_CONFIGS = 8

# natten.na3d's names for its KernelSchedule values.
_SCHEDULES = {"NonPersistent": "non", "WarpSpecializedCooperative": "coop", "WarpSpecializedPingpong": "pp"}


def _probe(device, dtype=torch.bfloat16, head_dim: int = 64) -> torch.Tensor:
    return torch.zeros(1, 1, 1, 8, 1, head_dim, dtype=dtype, device=device)


def natten_unavailable(device) -> Optional[str]:
    """Why NATTEN's Hopper FNA cannot run on ``device`` in this process, or None."""
    try:
        import natten
    except ImportError as exc:
        return f"natten is not installed ({exc})"
    except Exception as exc:  # installed but broken here (another torch, say)
        return f"natten does not import: {type(exc).__name__}: {exc}"[:300]
    device = torch.device(device)
    if device.type != "cuda":
        return "not a CUDA device"
    cc = torch.cuda.get_device_capability(device)
    if cc != (9, 0):
        return f"hopper-fna needs compute capability 9.0, this GPU has {cc[0]}.{cc[1]}"
    p = _probe(device)
    if not natten.get_configs_for_cutlass_hopper_fna(p, p, p):
        return (f"natten {natten.__version__} offers no hopper-fna configuration here "
                f"(built without libnatten: {not natten.HAS_LIBNATTEN})")
    return None


def comfy_kernel(method: str) -> Callable:
    """comfy-kitchen's ``na3d`` of ``method``: ``fn(q, k, v, [kt, kh, kw], is_causal, scale)``
    on ``(B, T, H, W, NH, HD)`` tensors (``is_causal`` None: non-causal).

    The backend's function itself, which ComfyUI's dispatcher (``comfy_kitchen.na3d``,
    a ``torch.library`` op that picks a backend) ends up calling: it makes q, k, v
    contiguous (no copy for the benchmark's contiguous inputs) and allocates the
    output, all of which the benchmark times; the dispatcher's own host work is not.
    """
    if method == "comfy_cuda":
        from comfy_kitchen.backends import cuda
        return cuda.na3d
    if method == "comfy_triton":
        from comfy_kitchen.backends.triton import na
        return na.na3d
    raise ValueError(f"method must be one of {COMFY}, got {method!r}")


def comfy_unavailable(method: str, device) -> Optional[str]:
    """Why comfy-kitchen's kernel ``method`` cannot run on ``device`` in this process, or None.

    A call on a tiny input is the test: the CUDA backend's compiled extension may
    fail to load (another Python, another CUDA) and the module still imports.
    """
    try:
        fn = comfy_kernel(method)
    except ImportError as exc:
        return f"comfy_kitchen is not installed ({exc})"
    except Exception as exc:  # installed but broken here
        return f"comfy_kitchen does not import: {type(exc).__name__}: {exc}"[:300]
    device = torch.device(device)
    if device.type != "cuda":
        return "not a CUDA device"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "comfy-kitchen's na3d needs compute capability 8.0 or later"
    p = _probe(device)
    try:
        fn(p, p, p, [1, 1, 1], None, 1.0)
        torch.cuda.synchronize(device)
    except Exception as exc:  # the extension did not load, or the kernel does not run here
        return f"a call on a tiny input failed: {type(exc).__name__}: {exc}"[:300]
    return None


def available_methods(device, natten: bool = True, comfy: bool = True) -> Tuple[List[str], List[str]]:
    """The peer methods that run on ``device`` in this process, and one note per peer left out.

    ``natten``/``comfy``: False when the caller leaves them out (``--no-natten``,
    ``--no-comfy``); they are then neither probed nor noted.
    """
    methods, notes = [], []
    if natten:
        reason = natten_unavailable(device)
        if reason is None:
            methods.append(NATTEN)
        else:
            notes.append(f"{NATTEN} skipped: {reason}")
    if comfy:
        for method in COMFY:
            reason = comfy_unavailable(method, device)
            if reason is None:
                methods.append(method)
            else:
                notes.append(f"{method} skipped: {reason}")
    return methods, notes


def versions(methods: Sequence[str]) -> Dict[str, str]:
    """Package versions of the peers among ``methods`` (for the results file)."""
    out = {}
    if NATTEN in methods:
        import natten
        out["natten"] = natten.__version__
    if any(m in COMFY for m in methods):
        from importlib import metadata
        try:
            out["comfy_kitchen"] = metadata.version("comfy-kitchen")
        except metadata.PackageNotFoundError:
            out["comfy_kitchen"] = "unknown"
    return out


def skip_reason(method: str, shape: Sequence[int], dtype: torch.dtype, backward: bool = False,
                stride: Sequence[int] = (1, 1, 1)) -> Optional[str]:
    """Why ``method`` is not timed on this shape, dtype, pass and stride, or None.

    NATTEN's Hopper FNA: float16/bfloat16, head dim 64 or 128 (the head dims of the
    build the benchmark carries to the GPU machine; NATTEN has 32 and 256 too).
    comfy-kitchen: forward only, float16/bfloat16, head dim a multiple of 16 up to
    64 (its CUDA kernel's limit; the Triton kernel is held to the same rows, the
    LTX ones, so that both are compared on the same shapes).
    """
    head_dim = shape[-1]
    if dtype not in (torch.float16, torch.bfloat16):
        return f"{dtype} (float16 and bfloat16 only)"
    if method == NATTEN:
        return None if head_dim in (64, 128) else f"head dim {head_dim} (64 and 128 only)"
    if method in COMFY:
        if backward:
            return "forward only"
        if any(x != 1 for x in stride):
            return "no stride"
        return None if head_dim <= 64 and head_dim % 16 == 0 else f"head dim {head_dim} (multiples of 16 up to 64)"
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def capped(configs: Sequence, cap: int = MAX_CONFIGS) -> list:
    """At most ``cap`` configurations: the first ones in NATTEN's order (its default first)."""
    return list(configs)[:cap]


def natten_forward_kwargs(config) -> dict:
    """NATTEN's forward configuration ``((q_tile, kv_tile), schedule)`` as ``natten.na3d``'s keywords."""
    (q_tile, kv_tile), schedule = config
    return {"q_tile_shape": tuple(q_tile), "kv_tile_shape": tuple(kv_tile),
            "kernel_schedule": _SCHEDULES[getattr(schedule, "name", schedule)]}


def natten_backward_kwargs(config) -> dict:
    """NATTEN's backward configuration ``(q_tile, kv_tile)`` as ``natten.na3d``'s keywords."""
    q_tile, kv_tile = config
    return {"backward_q_tile_shape": tuple(q_tile), "backward_kv_tile_shape": tuple(kv_tile)}


def natten_configs(q: torch.Tensor, backward: bool = False) -> List[dict]:
    """NATTEN's Hopper FNA configurations for q's shape and dtype, as keywords, capped."""
    import natten
    if backward:
        return [natten_backward_kwargs(c) for c in capped(natten.get_bwd_configs_for_cutlass_hopper_fna(q, q, q))]
    return [natten_forward_kwargs(c) for c in capped(natten.get_configs_for_cutlass_hopper_fna(q, q, q))]


def config_key(config: dict) -> str:
    """A configuration as a short name, e.g. ``q_tile_shape=4x4x8 kv_tile_shape=4x4x8 kernel_schedule=coop``."""
    return " ".join(f"{k}={'x'.join(map(str, v)) if isinstance(v, (tuple, list)) else v}"
                    for k, v in config.items())


def config_json(config: dict) -> dict:
    """A configuration for the results file (lists for tuples)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}


def config_from_json(config: dict) -> dict:
    """:func:`config_json`'s inverse: keywords ``natten.na3d`` takes (tuples for lists)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}


def best_config(candidates: Sequence[dict], time_ms: Callable[[dict], float]
                ) -> Tuple[Optional[dict], Dict[str, float], Dict[str, str]]:
    """The fastest of ``candidates`` by ``time_ms(config)``.

    Returns the best configuration (None when every one failed), each trial's time
    and each failure's message, both keyed by :func:`config_key`. A configuration
    that raises (one a build lacks, memory) is reported and passed over.
    """
    best, best_ms, times, errors = None, float("inf"), {}, {}
    for config in candidates:
        key = config_key(config)
        try:
            ms = time_ms(config)
        except Exception as exc:
            errors[key] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        times[key] = round(ms, 5)
        if ms < best_ms:
            best, best_ms = config, ms
    return best, times, errors


def natten_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size: Sequence[int], scale: float,
                  stride: Sequence[int] = (1, 1, 1), **config) -> torch.Tensor:
    """``natten.na3d`` with its Hopper FNA backend and ``config`` (keywords from :func:`natten_configs`),
    on ``(B, T, H, W, NH, HD)`` tensors: the call a user makes, token permutations included.
    ``stride``: NATTEN's generalized (strided) neighborhood attention."""
    import natten
    return natten.na3d(q, k, v, tuple(kernel_size), stride=tuple(stride), backend="hopper-fna", scale=scale,
                       **config)
