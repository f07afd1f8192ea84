"""na3d: exact, fast 3D neighborhood attention for PyTorch, in Triton.

    import na3d
    out = na3d.na3d(q, k, v, kernel_size=(3, 7, 7))        # NATTEN-compatible
    out = na3d.na3d_flash_attn(q_scaled, k, v, (3, 7, 7))  # pre-scaled queries

Tensors are ``(B, T, H, W, NH, HD)``; see ``na3d.api`` for the device policy.
"""

from .api import na1d, na2d, na3d, na3d_flash_attn
from .merge import merge_attentions
from .reference import na3d_brute_force, na3d_sdpa_exact, na3d_windowed

__all__ = ["na1d", "na2d", "na3d", "na3d_flash_attn", "merge_attentions", "na3d_brute_force",
           "na3d_sdpa_exact", "na3d_windowed"]
__version__ = "0.1.0"
