"""Device-side helpers shared by the Triton kernels."""

import triton
import triton.language as tl


@triton.jit
def window_start(index, length, kernel_size):
    """Device copy of ``na3d.geometry.window_start``: ``clamp(i - K // 2, 0, L - K)``.

    Kept in step with the Python definition by ``tests/test_geometry.py``.
    """
    return tl.minimum(tl.maximum(index - kernel_size // 2, 0), length - kernel_size)
