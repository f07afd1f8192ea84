"""Device-side helpers shared by the Triton kernels."""

import triton
import triton.language as tl


@triton.jit
def window_start(index, length, kernel_size):
    """Device copy of ``na3d.geometry.window_start``: ``clamp(i - K // 2, 0, L - K)``.

    Kept in step with the Python definition by ``tests/test_geometry.py``.
    """
    return tl.minimum(tl.maximum(index - kernel_size // 2, 0), length - kernel_size)


@triton.jit
def queries_seeing(first_key, last_key, length, kernel_size):
    """Device copy of ``na3d.geometry.queries_seeing``: the ``[first, stop)`` queries
    whose windows contain a key of ``first_key..last_key``."""
    lowest_start = first_key - kernel_size + 1
    first = tl.where(lowest_start <= 0, 0, lowest_start + kernel_size // 2)
    stop = tl.where(last_key >= length - kernel_size, length, last_key + kernel_size // 2 + 1)
    return first, stop
