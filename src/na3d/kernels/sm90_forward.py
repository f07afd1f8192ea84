"""sm90 (Hopper) forward for perfectly block-sparse calls, in Gluon.

Where a stride makes the pattern perfectly block-sparse (``launch.block_sparse_axes``
true on all three axes: every query of a box shares one window, and the key boxes
tile it exactly), each program is dense attention of one box of 128 queries against
a fixed list of key boxes, with no mask. The portable kernel runs that loop as
Triton schedules it: each step's products, then its softmax, then the next step's
products (NOTES v27: about half the tensor cores' rate). Here two warpgroups, each
its own partition (``gl.warp_specialize``), own half of the box's queries and take
turns at the tensor cores (an mbarrier each: one's softmax runs while the other's
products do); inside each, the products are asynchronous: this step's softmax runs
while the previous step's ``P V`` is still on the tensor cores, and the next step's
``Q K^T`` is issued with this step's ``P V``. The second warpgroup, half a step
behind the first, issues the copies (tensor-memory accelerator) of the key and value
boxes into a ring of ``STAGES`` shared-memory slots; a slot is refilled once both
warpgroups released it ("empty" barrier, two arrivals). (A separate producer warp,
FlashAttention 3's layout, makes Triton 3.6 park the workers in a 120-register
dispatch loop, and ptxas then serializes every product: NOTES v37.)

Same arithmetic as the portable kernel (online softmax in the log2 domain, fp32
accumulators, 16-bit operands); outputs are checked against the float64 oracle.
Limits (any other call runs the portable kernel): NVIDIA compute capability 9.x,
bf16/fp16, head dim 64 or 128, positive scale, no causal axis, no dilation, every
axis block-sparse, 128-query boxes, inputs readable through tensor descriptors.
Non-finite inputs: the kernel sets the portable kernel's per-program flags, and the
portable kernel's second launch redoes those tiles the safe way.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)

from .. import constants

LN_2 = gl.constexpr(constants.LN_2)


@gluon.jit
def _window_start(first, length, kernel_size, stride):
    """First key of the window that the stride group of query ``first`` shares
    (``geometry.window_bounds``, non-causal, dilation 1): the group's leader's
    window, shifted inward at the borders."""
    leader = gl.minimum((first // stride) * stride + stride // 2, length - 1)
    return gl.minimum(gl.maximum(leader - kernel_size // 2, 0), length - kernel_size)


@gluon.jit
def _program_place(T, H, W, KT, KH, KW, ST, SH, SW, tiles_h, tiles_w, Q_BOX: gl.constexpr):
    """This program's box of queries (its first position) and its window's first key."""
    tile = gl.program_id(0)
    t0 = (tile // (tiles_h * tiles_w)) * Q_BOX[0]
    h0 = ((tile // tiles_w) % tiles_h) * Q_BOX[1]
    w0 = (tile % tiles_w) * Q_BOX[2]
    return (t0, h0, w0, _window_start(t0, T, KT, ST), _window_start(h0, H, KH, SH), _window_start(w0, W, KW, SW))


@gluon.jit
def _load_step(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, j, batch, channel, s_t, s_h, s_w, n_h, n_w,
               KV_BOX: gl.constexpr, STAGES: gl.constexpr):
    """Issue the copies of step ``j``'s key and value boxes (scan order: T outermost,
    W innermost) into slot ``j % STAGES``."""
    slot = j % STAGES
    kt = s_t + (j // (n_h * n_w)) * KV_BOX[0]
    kh = s_h + ((j // n_w) % n_h) * KV_BOX[1]
    kw = s_w + (j % n_w) * KV_BOX[2]
    mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [batch, kt, kh, kw, channel], k_ready.index(slot), k_smem.index(slot))
    mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [batch, kt, kh, kw, channel], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _scores(q, k_smem, k_ready, j, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
            s_layout: gl.constexpr, ROWS: gl.constexpr):
    """Issue step ``j``'s scores ``Q K^T`` (asynchronous) once its keys landed."""
    slot = j % STAGES
    mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
    k = k_smem.index(slot)._reinterpret(k_smem.dtype, [BLOCK_N, HEAD_DIM],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], k_smem.dtype))
    zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    return warpgroup_mma(q, k.permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _consumer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, empty, turn, O, LSE, FLAGS,
              o_strides, T, H, W, KT: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr, ST, SH, SW, tiles_h,
              tiles_w, heads, qk_scale, HALF: gl.constexpr, Q_BOX: gl.constexpr, KV_BOX: gl.constexpr,
              GROUP: gl.constexpr,
              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, RETURN_LSE: gl.constexpr, ASSUME_FINITE: gl.constexpr,
              OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, TURN_AFTER_SCORES: gl.constexpr):
    """One warpgroup: queries ``HALF * 64 ..`` of the box, the online softmax over
    every key box, and their output (and lse) rows.

    The two warpgroups take turns issuing their products (``turn``: each waits for
    its barrier, issues the next step's ``Q K^T`` and this step's ``P V``, then
    lets the other go), so that one's softmax runs while the other's products do
    (FlashAttention 3's "ping-pong"); the first goes first. The second, which is
    therefore half a step behind, issues the copies: a slot it has released, the
    first has too, so it refills it without waiting."""
    LOADER: gl.constexpr = 1
    ROWS: gl.constexpr = 64
    BLOCK_N: gl.constexpr = KV_BOX[0] * KV_BOX[1] * KV_BOX[2]
    BLOCK_M: gl.constexpr = Q_BOX[0] * Q_BOX[1] * Q_BOX[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    head = gl.program_id(1)
    batch = gl.program_id(2)
    t0, h0, w0, s_t, s_h, s_w = _program_place(T, H, W, KT, KH, KW, ST, SH, SW, tiles_h, tiles_w, Q_BOX)
    n_h = KH // KV_BOX[1]
    n_w = KW // KV_BOX[2]
    n_steps = (KT // KV_BOX[0]) * n_h * n_w
    channel = (head // GROUP) * HEAD_DIM
    if HALF == LOADER:
        mbarrier.expect(q_ready, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [batch, t0, h0, w0, head * HEAD_DIM], q_ready, q_smem)
        for i in gl.static_range(STAGES):
            if i < n_steps:
                _load_step(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, i, batch, channel, s_t, s_h, s_w,
                           n_h, n_w, KV_BOX, STAGES)
    mbarrier.wait(q_ready, 0)
    q = q_smem._reinterpret(q_smem.dtype, [BLOCK_M, HEAD_DIM],
                            gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], q_smem.dtype))
    q = q.slice(HALF * ROWS, ROWS, dim=0)

    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([ROWS], gl.float32, row_layout)
    acc = warpgroup_mma_init(gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout))
    s = _scores(q, k_smem, k_ready, 0, STAGES, BLOCK_N, HEAD_DIM, s_layout, ROWS)
    s = warpgroup_mma_wait(0, deps=[s])
    # The probabilities a P V product reads from registers stay alive until the wait
    # that retires it (``deps``): else the next step's softmax may write over them.
    p_in_flight = gl.zeros([ROWS, BLOCK_N], k_smem.dtype, p_layout)
    for j in range(n_steps):
        slot = j % STAGES
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        p = gl.convert_layout(p.to(k_smem.dtype), p_layout)
        acc, p_in_flight = warpgroup_mma_wait(0, deps=[acc, p_in_flight])
        mbarrier.arrive(empty.index((j + STAGES - 1) % STAGES), pred=j > 0)
        if HALF == LOADER:
            # Step j - 1's slot, once the other warpgroup released it too (it has:
            # it runs ahead), takes step j - 1 + STAGES.
            if (j > 0) & (j - 1 + STAGES < n_steps):
                mbarrier.wait(empty.index((j - 1) % STAGES), ((j - 1) // STAGES) & 1)
                _load_step(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, j - 1 + STAGES, batch, channel,
                           s_t, s_h, s_w, n_h, n_w, KV_BOX, STAGES)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        if PINGPONG:
            mbarrier.wait(turn.index(HALF), j & 1)
        # (On the last step this computes the last box's scores once more, unused: one
        # product in 2 * n_steps, which keeps the loop free of a branch around it.)
        s_next = _scores(q, k_smem, k_ready, gl.minimum(j + 1, n_steps - 1), STAGES, BLOCK_N, HEAD_DIM,
                         s_layout, ROWS)
        mbarrier.wait(v_ready.index(slot), (j // STAGES) & 1)
        v = v_smem.index(slot)._reinterpret(v_smem.dtype, [BLOCK_N, HEAD_DIM],
                                            gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], v_smem.dtype))
        acc = warpgroup_mma(p, v, acc, is_async=True)
        if PINGPONG and not TURN_AFTER_SCORES:
            mbarrier.arrive(turn.index(1 - HALF))
        p_in_flight = p
        if not OVERLAP:  # (for measurements: each step's P V finished before the next softmax)
            acc, p_in_flight = warpgroup_mma_wait(0, deps=[acc, p_in_flight])
            acc = warpgroup_mma_init(acc)
        s = warpgroup_mma_wait(1, deps=[s_next])
        if PINGPONG and TURN_AFTER_SCORES:
            # (for measurements: the other warpgroup issues once this one's scores are
            # done, so that the two softmaxes cannot fall into step)
            mbarrier.arrive(turn.index(1 - HALF))
    acc, p_in_flight = warpgroup_mma_wait(0, deps=[acc, p_in_flight])
    mbarrier.arrive(empty.index((n_steps + STAGES - 1) % STAGES))

    # Rows of the output: this half's queries, positions inside the box, stored
    # from the accumulator's own layout (no shared memory for a layout change).
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    x = acc / l_o[:, None]
    if not ASSUME_FINITE:
        # The portable kernel's flag (``kernels.programs.run_programs``): 1 where this
        # program's tile holds an inf or NaN; the flags start at 0 and either half
        # may set it. The portable kernel's second launch then redoes the tile.
        bad = gl.max(gl.max(((x != x) | (gl.abs(x) == float("inf"))).to(gl.int32), axis=1), axis=0)
        if bad != 0:
            tile = gl.program_id(0)
            gl.store(FLAGS + tile + gl.num_programs(0) * (head + heads * batch.to(gl.int64)), 1)
    r = HALF * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    t = t0 + r // (Q_BOX[1] * Q_BOX[2])
    h = h0 + (r // Q_BOX[2]) % Q_BOX[1]
    w = w0 + r % Q_BOX[2]
    valid = (t < T) & (h < H) & (w < W)
    rows = (batch.to(gl.int64) * o_strides[0] + t.to(gl.int64) * o_strides[1] + h.to(gl.int64) * o_strides[2]
            + w.to(gl.int64) * o_strides[3] + head.to(gl.int64) * o_strides[4])
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    gl.store(O + rows[:, None] + d[None, :], x.to(O.dtype.element_ty), mask=valid[:, None])
    if RETURN_LSE:
        lse_rows = (((batch * T + t).to(gl.int64) * H + h) * W + w) * heads + head
        gl.store(LSE + lse_rows, (gl.convert_layout(m_i, gl.SliceLayout(1, o_layout)) + gl.log2(l_o))
                 * LN_2, mask=valid)


@gluon.jit
def na3d_fwd_sm90_kernel(q_desc, k_desc, v_desc, O, LSE, FLAGS, o_strides, T, H, W,
                         KT: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr, ST, SH, SW,
                         tiles_h, tiles_w, heads, qk_scale,
                         Q_BOX: gl.constexpr, KV_BOX: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
                         STAGES: gl.constexpr, RETURN_LSE: gl.constexpr, ASSUME_FINITE: gl.constexpr,
                         OVERLAP: gl.constexpr = True, PINGPONG: gl.constexpr = True,
                         TURN_AFTER_SCORES: gl.constexpr = False):
    """Grid: (query boxes, heads, batch); launched with 4 warps (the first
    warpgroup), the second a worker partition. The window ``KT, KH, KW`` is a
    compile-time constant: the loading warpgroup finds each step's key box by
    dividing by the window's box counts, and constant divisors keep that off its
    path to the next products (7 % of the kernel's time at head dim 128, NOTES v38). Unless ``ASSUME_FINITE``: set ``FLAGS``
    (int8 per program, zeroed by the caller) where the output holds an inf or NaN. Q, K, V descriptors over
    ``(B, T, H, W, NH * HD)`` with blocks of one head's box; O any strides."""
    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a slot
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    mbarrier.arrive(turn.index(0))  # the first warpgroup's first turn
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, empty, turn, O,
                     LSE, FLAGS, o_strides, T, H, W, KT, KH, KW, ST, SH, SW, tiles_h, tiles_w, heads, qk_scale, 0, Q_BOX, KV_BOX,
                     GROUP, HEAD_DIM, STAGES, RETURN_LSE, ASSUME_FINITE, OVERLAP, PINGPONG,
                     TURN_AFTER_SCORES)),
        (_consumer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, empty, turn, O,
                     LSE, FLAGS, o_strides, T, H, W, KT, KH, KW, ST, SH, SW, tiles_h, tiles_w, heads, qk_scale, 1, Q_BOX, KV_BOX,
                     GROUP, HEAD_DIM, STAGES, RETURN_LSE, ASSUME_FINITE, OVERLAP, PINGPONG,
                     TURN_AFTER_SCORES)),
    ], [4], [240])
