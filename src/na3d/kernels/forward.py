"""Forward kernel: flash-style 3D neighborhood attention over box tiles."""

import triton
import triton.language as tl

# Every tl.dot says input_precision="ieee": float32 inputs then get true float32
# products (PyTorch's default for float32 matmul, not TF32); for 16-bit inputs the
# option changes nothing, and unlike "tf32" every backend (NVIDIA and AMD) accepts it.

from .common import window_start


@triton.jit(do_not_specialize=["T", "H", "W", "tiles_h", "tiles_w"])
def na3d_fwd_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qt, stride_qh, stride_qw, stride_qn,
    stride_kb, stride_kt, stride_kh, stride_kw, stride_kn,
    stride_vb, stride_vt, stride_vh, stride_vw, stride_vn,
    stride_ob, stride_ot, stride_oh, stride_ow, stride_on,
    T, H, W,
    KT, KH, KW,
    tiles_h, tiles_w,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    Q_T: tl.constexpr, Q_H: tl.constexpr, Q_W: tl.constexpr,
    KV_T: tl.constexpr, KV_H: tl.constexpr, KV_W: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    """Grid: (query tiles, heads, batch). One program: a Q_T x Q_H x Q_W box of queries
    of one (batch, head), against the union of their windows, scanned in
    KV_T x KV_H x KV_W boxes of keys with an online softmax (log2 domain, fp32).

    ``qk_scale`` is the softmax scale times log2(e). LSE, when stored, is the natural
    log-sum-exp per query, float32, contiguous ``(B, T, H, W, NH)``.
    """
    BLOCK_Q: tl.constexpr = Q_T * Q_H * Q_W
    BLOCK_KV: tl.constexpr = KV_T * KV_H * KV_W
    tl.static_assert(BLOCK_Q >= 16 and BLOCK_KV >= 16, "tl.dot needs tiles of at least 16")

    tile = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    t0 = (tile // (tiles_w * tiles_h)) * Q_T
    h0 = ((tile // tiles_w) % tiles_h) * Q_H
    w0 = (tile % tiles_w) * Q_W

    # Query coordinates, row-major inside the box. Rows past the grid's end repeat
    # the last position: their loads stay in bounds and their windows are non-empty,
    # and they are not stored.
    r = tl.arange(0, BLOCK_Q)
    qt = t0 + r // (Q_H * Q_W)
    qh = h0 + (r // Q_W) % Q_H
    qw = w0 + r % Q_W
    q_valid = (qt < T) & (qh < H) & (qw < W)
    qt = tl.minimum(qt, T - 1)
    qh = tl.minimum(qh, H - 1)
    qw = tl.minimum(qw, W - 1)
    # Each query's window is [s, s + K) per dimension.
    st = window_start(qt, T, KT)
    sh = window_start(qh, H, KH)
    sw = window_start(qw, W, KW)

    # Window starts never decrease with the index, so the windows of the box's
    # queries span one contiguous box of keys: [u0, u1) per dimension.
    ut0 = window_start(t0, T, KT)
    uh0 = window_start(h0, H, KH)
    uw0 = window_start(w0, W, KW)
    ut1 = window_start(tl.minimum(t0 + Q_T, T) - 1, T, KT) + KT
    uh1 = window_start(tl.minimum(h0 + Q_H, H) - 1, H, KH) + KH
    uw1 = window_start(tl.minimum(w0 + Q_W, W) - 1, W, KW) + KW
    steps_h = tl.cdiv(uh1 - uh0, KV_H)
    steps_w = tl.cdiv(uw1 - uw0, KV_W)
    n_steps = tl.cdiv(ut1 - ut0, KV_T) * steps_h * steps_w

    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_ptrs = (Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qn
              + (qt.to(tl.int64) * stride_qt + qh.to(tl.int64) * stride_qh
                 + qw.to(tl.int64) * stride_qw)[:, None] + d[None, :])
    q = tl.load(q_ptrs, mask=d_ok[None, :], other=0.0)
    k_base = K + batch.to(tl.int64) * stride_kb + head.to(tl.int64) * stride_kn
    v_base = V + batch.to(tl.int64) * stride_vb + head.to(tl.int64) * stride_vn

    # Key coordinates inside a key box, row-major.
    c = tl.arange(0, BLOCK_KV)
    ct = c // (KV_H * KV_W)
    ch = (c // KV_W) % KV_H
    cw = c % KV_W

    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    for step in range(n_steps):
        kt = ut0 + (step // (steps_h * steps_w)) * KV_T + ct
        kh = uh0 + ((step // steps_w) % steps_h) * KV_H + ch
        kw = uw0 + (step % steps_w) * KV_W + cw
        # The last step along a dimension may run past the union: those keys load a
        # repeat of the union's last position and are masked below (they lie outside
        # every window of the box).
        k_rows = (tl.minimum(kt, ut1 - 1).to(tl.int64) * stride_kt
                  + tl.minimum(kh, uh1 - 1).to(tl.int64) * stride_kh
                  + tl.minimum(kw, uw1 - 1).to(tl.int64) * stride_kw)
        k = tl.load(k_base + k_rows[:, None] + d[None, :], mask=d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
        visible = ((kt[None, :] >= st[:, None]) & (kt[None, :] < st[:, None] + KT)
                   & (kh[None, :] >= sh[:, None]) & (kh[None, :] < sh[:, None] + KH)
                   & (kw[None, :] >= sw[:, None]) & (kw[None, :] < sw[:, None] + KW))
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; subtracting 0 instead makes
        # its exponentials exactly 0 rather than NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_sub)
        p = tl.math.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = (tl.minimum(kt, ut1 - 1).to(tl.int64) * stride_vt
                  + tl.minimum(kh, uh1 - 1).to(tl.int64) * stride_vh
                  + tl.minimum(kw, uw1 - 1).to(tl.int64) * stride_vw)
        v = tl.load(v_base + v_rows[:, None] + d[None, :], mask=d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        m_i = m_new

    out = acc / l_i[:, None]
    o_ptrs = (O + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_on
              + (qt.to(tl.int64) * stride_ot + qh.to(tl.int64) * stride_oh
                 + qw.to(tl.int64) * stride_ow)[:, None] + d[None, :])
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=q_valid[:, None] & d_ok[None, :])
    if STORE_LSE:
        heads = tl.num_programs(1)
        lse_rows = (((batch.to(tl.int64) * T + qt) * H + qh) * W + qw) * heads + head
        # m_i is in log2 units of the scaled scores; convert to natural log.
        tl.store(LSE + lse_rows, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=q_valid)
