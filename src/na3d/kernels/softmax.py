"""The forward's online softmax, in the log2 domain (fp32)."""

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(s, visible, m_i, l_i, qk_scale, SCALE_SIGN: tl.constexpr, MASK_SCORES: tl.constexpr):
    """One key box's step of the online softmax over raw scores ``s`` [queries, keys]
    (``qk_scale``: the softmax scale times log2(e), ``SCALE_SIGN`` its sign): the
    running row maximum ``m_i`` and sum ``l_i`` brought up to date. With
    ``MASK_SCORES`` the scores ``visible`` leaves out weigh 0 (otherwise ``visible``
    is not read). Returns ``(p, alpha, m_new, l_new)``: the step's weights, the
    factor that rescales what came before, and the new maximum and sum.

    The row maximum of the scaled scores is taken on the raw ones (the scale's sign
    picks max or min), so that scaling and subtracting it fuse into one FMA per
    score."""
    if SCALE_SIGN > 0:
        if MASK_SCORES:
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    elif SCALE_SIGN < 0:
        if MASK_SCORES:
            s = tl.where(visible, s, float("inf"))
        m_new = tl.maximum(m_i, tl.min(s, 1) * qk_scale)
    else:
        # 0 * score keeps a non-finite score non-finite, as scaling it would.
        if MASK_SCORES:
            s = tl.where(visible, s * 0.0, float("-inf"))
        else:
            s = s * 0.0
        m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no key yet keeps m = -inf; subtracting 0 instead makes
    # its exponentials exactly 0 rather than NaN.
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_sub)
    if SCALE_SIGN == 0:
        p = tl.math.exp2(s - m_sub[:, None])
    else:
        p = tl.math.exp2(s * qk_scale - m_sub[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)
