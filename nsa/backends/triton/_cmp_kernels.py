"""Triton kernels shared by the ``cmp`` and ``win`` operators of the triton backend.

One family of flash-style kernels over a "key stream" whose key i ends at raw position
``e(i) = i * STRIDE + OFFSET`` and is visible to the query at absolute position t iff
``e(i) <= t`` and (with a window) ``e(i) > t - WINDOW``:

* compressed branch (spec step 1): STRIDE = d, OFFSET = l - 1, no window;
* sliding branch (spec step 6): STRIDE = 1, OFFSET = 0, WINDOW = w.

A program owns one key/value head h and a tile of BLOCK_M query positions, and its rows are the
(position, head-in-group) pairs of that tile: row r = (m, g) with m = r // GP, g = r % GP, query head
h*G + g. So the keys of group h are loaded once for all G heads (GQA), and sums over the group
(Eq. 10) are a reshape and a sum.

The compressed forward (``SCORES=True``) runs two passes over the visible compressed keys: the first
finds each row's log-sum-exp, the second forms the normalized p_cmp = exp(s - lse), accumulates
o = p @ v, sums p over the G heads of the group (Eq. 10) and maps it onto selection blocks with the
block-aligned Eq. 9 weights W[i, j] = |[i*d, i*d+l) ∩ [j*l_sel, (j+1)*l_sel)| / d. Key tiles step
NSTEP tokens with NSTEP*d a multiple of l_sel, so a tile feeds BJ = NSTEP*d/l_sel whole blocks plus a
spill into the next block(s) that is carried in registers to the next tile: each block score is
written exactly once and no [T, Tc] tensor exists. The window forward is the usual one-pass online
softmax. Backward: a dq kernel (per query tile) and a dk/dv kernel (per key tile, looping over the
query tiles that see it), both recomputing p from the saved log-sum-exp (base 2).
"""

# No ``from __future__ import annotations`` here: triton 2.3/3.0's JIT reads the kernel annotations
# as objects (string annotations make ``tl.constexpr`` parameters plain runtime arguments).
import triton
import triton.language as tl


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    Out,
    LSE,
    SC,
    sq_b,
    sq_t,
    sq_h,
    sk_b,
    sk_n,
    sk_h,
    sv_b,
    sv_n,
    sv_h,
    so_b,
    so_t,
    so_h,
    ssc_b,
    ssc_t,
    ssc_h,
    N,
    Tq,
    q_start,
    m_begin,
    m_end,
    nb,
    scale_log2,
    HQ: tl.constexpr,
    H: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BDK: tl.constexpr,
    BDV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NSTEP: tl.constexpr,
    STRIDE: tl.constexpr,
    OFFSET: tl.constexpr,
    WINDOW: tl.constexpr,
    SCORES: tl.constexpr,
    D_CMP: tl.constexpr,
    L_CMP: tl.constexpr,
    L_SEL: tl.constexpr,
    BJ: tl.constexpr,
    BJP: tl.constexpr,
    PREC: tl.constexpr,
    SCORE_DOT: tl.constexpr,
):
    R: tl.constexpr = BLOCK_M * GP
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    n_tiles = tl.cdiv(m_end - m_begin, BLOCK_M)
    m0 = m_begin + (n_tiles - 1 - pid_m) * BLOCK_M  # longest rows first
    r = tl.arange(0, R)
    m = m0 + r // GP
    g = r % GP
    row_ok = (m < m_end) & (g < G)
    t = q_start + m
    head = h * G + g
    dk = tl.arange(0, BDK)
    dv = tl.arange(0, BDV)
    q = tl.load(
        Q + b * sq_b + m[:, None].to(tl.int64) * sq_t + head[:, None] * sq_h + dk[None, :],
        mask=row_ok[:, None] & (dk[None, :] < DK),
        other=0.0,
    )
    tmin = q_start + m0
    tmax = q_start + tl.minimum(m0 + BLOCK_M, m_end) - 1
    # keys i with e(i) <= tmax
    hi = tl.maximum(tmax - OFFSET + STRIDE, 0) // STRIDE  # keys with e(i) <= tmax
    hi = tl.minimum(hi, N)
    if WINDOW > 0:
        lo = tl.maximum(tmin - WINDOW + 1, 0)  # STRIDE == 1, OFFSET == 0 for windows
        lo = (lo // NSTEP) * NSTEP
    else:
        lo = 0
    kb = K + b * sk_b + h * sk_h
    vb = V + b * sv_b + h * sv_h
    nn = tl.arange(0, BLOCK_N)

    m_i = tl.full([R], float("-inf"), tl.float32)
    l_i = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, BDV], tl.float32)
    if SCORES:
        # pass 1: the row log-sum-exp over the visible compressed keys
        for n0 in range(lo, hi, NSTEP):
            n = n0 + nn
            n_ok = (nn < NSTEP) & (n < N)
            k = tl.load(
                kb + n[:, None].to(tl.int64) * sk_n + dk[None, :],
                mask=n_ok[:, None] & (dk[None, :] < DK),
                other=0.0,
            )
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
            vis = row_ok[:, None] & n_ok[None, :] & ((n * STRIDE + OFFSET)[None, :] <= t[:, None])
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
            m_i = m_new
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("inf"))
        # pass 2: normalized probabilities -> output and Eq. 9/10 block scores
        ii = tl.arange(0, BLOCK_N)
        cc = tl.arange(0, BJP)
        mm = tl.arange(0, BLOCK_M)
        sc_row = SC + b * ssc_b + (m0 + mm - m_begin)[:, None].to(tl.int64) * ssc_t + h * ssc_h
        sc_row_ok = (m0 + mm) < m_end
        carry = tl.zeros([BLOCK_M, BJP], tl.float32)
        for n0 in range(lo, hi, NSTEP):
            n = n0 + nn
            n_ok = (nn < NSTEP) & (n < N)
            k = tl.load(
                kb + n[:, None].to(tl.int64) * sk_n + dk[None, :],
                mask=n_ok[:, None] & (dk[None, :] < DK),
                other=0.0,
            )
            v = tl.load(
                vb + n[:, None].to(tl.int64) * sv_n + dv[None, :],
                mask=n_ok[:, None] & (dv[None, :] < DV),
                other=0.0,
            )
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
            vis = row_ok[:, None] & n_ok[None, :] & ((n * STRIDE + OFFSET)[None, :] <= t[:, None])
            p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
            acc += tl.dot(p.to(v.dtype), v, input_precision=PREC)
            # Eq. 9 weights of tokens n0+ii onto blocks j0+cc (main) and j0+BJ+cc (spill)
            j0 = (n0 // NSTEP) * BJ
            i_lo = (n0 + ii) * D_CMP
            i_ok = ii < NSTEP
            if SCORE_DOT:
                # Tensor-core path (half inputs): p*2^14 split into two fp16 parts, W interleaved
                # [main c, spill c] in 2*BJP columns (small integers, exact in fp16), Eq. 10 group
                # sum on the [R, 2*BJP] product.
                c2 = tl.arange(0, 2 * BJP)
                jl = (j0 + c2 // 2 + (c2 % 2) * BJ) * L_SEL
                w2 = tl.minimum(i_lo[:, None] + L_CMP, jl[None, :] + L_SEL) - tl.maximum(
                    i_lo[:, None], jl[None, :]
                )
                w2 = tl.where(i_ok[:, None], tl.maximum(w2, 0) // D_CMP, 0).to(tl.float16)
                ps = p * 16384.0
                p_hi = ps.to(tl.float16)
                p_lo = (ps - p_hi.to(tl.float32)).to(tl.float16)
                cw = tl.dot(p_hi, w2) + tl.dot(p_lo, w2)
                cw = tl.sum(tl.reshape(cw, [BLOCK_M, GP, 2 * BJP]), 1) * (1.0 / 16384.0)
                main, spill = tl.split(tl.reshape(cw, [BLOCK_M, BJP, 2]))
                blk = main + carry
                carry = spill
            else:
                pg = tl.sum(tl.reshape(p, [BLOCK_M, GP, BLOCK_N]), 1)  # Eq. 10: sum over the group
                j_lo = (j0 + cc) * L_SEL
                w_main = tl.minimum(i_lo[:, None] + L_CMP, j_lo[None, :] + L_SEL) - tl.maximum(
                    i_lo[:, None], j_lo[None, :]
                )
                w_main = tl.where(i_ok[:, None], tl.maximum(w_main, 0) // D_CMP, 0).to(tl.float32)
                j_lo2 = j_lo + BJ * L_SEL
                w_sp = tl.minimum(i_lo[:, None] + L_CMP, j_lo2[None, :] + L_SEL) - tl.maximum(
                    i_lo[:, None], j_lo2[None, :]
                )
                w_sp = tl.where(i_ok[:, None], tl.maximum(w_sp, 0) // D_CMP, 0).to(tl.float32)
                blk = tl.sum(pg[:, :, None] * w_main[None, :, :], 1) + carry
                carry = tl.sum(pg[:, :, None] * w_sp[None, :, :], 1)
            j = j0 + cc
            tl.store(
                sc_row + j[None, :], blk, mask=sc_row_ok[:, None] & (cc < BJ)[None, :] & (j < nb)[None, :]
            )
        j_end = tl.cdiv(hi, NSTEP) * BJ
        j = j_end + cc
        tl.store(sc_row + j[None, :], carry, mask=sc_row_ok[:, None] & (j < nb)[None, :])
        o = acc
    else:
        for n0 in range(lo, hi, NSTEP):
            n = n0 + nn
            n_ok = (nn < NSTEP) & (n < N)
            k = tl.load(
                kb + n[:, None].to(tl.int64) * sk_n + dk[None, :],
                mask=n_ok[:, None] & (dk[None, :] < DK),
                other=0.0,
            )
            v = tl.load(
                vb + n[:, None].to(tl.int64) * sv_n + dv[None, :],
                mask=n_ok[:, None] & (dv[None, :] < DV),
                other=0.0,
            )
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
            e = n * STRIDE + OFFSET
            vis = row_ok[:, None] & n_ok[None, :] & (e[None, :] <= t[:, None])
            if WINDOW > 0:
                vis = vis & (e[None, :] > t[:, None] - WINDOW)
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("inf"))
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        Out + b * so_b + m[:, None].to(tl.int64) * so_t + head[:, None] * so_h + dv[None, :],
        o.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & (dv[None, :] < DV),
    )
    # LSE layout: [B, HQ, Tq] float32, base 2
    tl.store(LSE + (b * HQ + head).to(tl.int64) * Tq + m, lse, mask=row_ok)


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    sq_b,
    sq_t,
    sq_h,
    sk_b,
    sk_n,
    sk_h,
    sv_b,
    sv_n,
    sv_h,
    sdo_b,
    sdo_t,
    sdo_h,
    sdq_b,
    sdq_t,
    sdq_h,
    N,
    Tq,
    q_start,
    scale_log2,
    scale,
    HQ: tl.constexpr,
    H: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BDK: tl.constexpr,
    BDV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STRIDE: tl.constexpr,
    OFFSET: tl.constexpr,
    WINDOW: tl.constexpr,
    PREC: tl.constexpr,
):
    R: tl.constexpr = BLOCK_M * GP
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    m0 = (tl.cdiv(Tq, BLOCK_M) - 1 - pid_m) * BLOCK_M
    r = tl.arange(0, R)
    m = m0 + r // GP
    g = r % GP
    row_ok = (m < Tq) & (g < G)
    t = q_start + m
    head = h * G + g
    dk = tl.arange(0, BDK)
    dv = tl.arange(0, BDV)
    q = tl.load(
        Q + b * sq_b + m[:, None].to(tl.int64) * sq_t + head[:, None] * sq_h + dk[None, :],
        mask=row_ok[:, None] & (dk[None, :] < DK),
        other=0.0,
    )
    do = tl.load(
        DO + b * sdo_b + m[:, None].to(tl.int64) * sdo_t + head[:, None] * sdo_h + dv[None, :],
        mask=row_ok[:, None] & (dv[None, :] < DV),
        other=0.0,
    )
    row = (b * HQ + head).to(tl.int64) * Tq + m
    lse = tl.load(LSE + row, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    tmin = q_start + m0
    tmax = q_start + tl.minimum(m0 + BLOCK_M, Tq) - 1
    hi = tl.maximum(tmax - OFFSET + STRIDE, 0) // STRIDE  # keys with e(i) <= tmax
    hi = tl.minimum(hi, N)
    if WINDOW > 0:
        lo = tl.maximum(tmin - WINDOW + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    else:
        lo = 0
    kb = K + b * sk_b + h * sk_h
    vb = V + b * sv_b + h * sv_h
    nn = tl.arange(0, BLOCK_N)
    dq = tl.zeros([R, BDK], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + nn
        n_ok = n < N
        k = tl.load(
            kb + n[:, None].to(tl.int64) * sk_n + dk[None, :],
            mask=n_ok[:, None] & (dk[None, :] < DK),
            other=0.0,
        )
        v = tl.load(
            vb + n[:, None].to(tl.int64) * sv_n + dv[None, :],
            mask=n_ok[:, None] & (dv[None, :] < DV),
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
        e = n * STRIDE + OFFSET
        vis = row_ok[:, None] & n_ok[None, :] & (e[None, :] <= t[:, None])
        if WINDOW > 0:
            vis = vis & (e[None, :] > t[:, None] - WINDOW)
        p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    dq = dq * scale
    tl.store(
        DQ + b * sdq_b + m[:, None].to(tl.int64) * sdq_t + head[:, None] * sdq_h + dk[None, :],
        dq.to(DQ.dtype.element_ty),
        mask=row_ok[:, None] & (dk[None, :] < DK),
    )


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK_,
    DV_,
    sq_b,
    sq_t,
    sq_h,
    sk_b,
    sk_n,
    sk_h,
    sv_b,
    sv_n,
    sv_h,
    sdo_b,
    sdo_t,
    sdo_h,
    sdk_b,
    sdk_n,
    sdk_h,
    sdv_b,
    sdv_n,
    sdv_h,
    N,
    Tq,
    q_start,
    scale_log2,
    scale,
    HQ: tl.constexpr,
    H: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BDK: tl.constexpr,
    BDV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STRIDE: tl.constexpr,
    OFFSET: tl.constexpr,
    WINDOW: tl.constexpr,
    PREC: tl.constexpr,
):
    R: tl.constexpr = BLOCK_M * GP
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    n0 = pid_n * BLOCK_N
    nn = tl.arange(0, BLOCK_N)
    n = n0 + nn
    n_ok = n < N
    e = n * STRIDE + OFFSET
    dk = tl.arange(0, BDK)
    dv = tl.arange(0, BDV)
    k = tl.load(
        K + b * sk_b + h * sk_h + n[:, None].to(tl.int64) * sk_n + dk[None, :],
        mask=n_ok[:, None] & (dk[None, :] < DK),
        other=0.0,
    )
    v = tl.load(
        V + b * sv_b + h * sv_h + n[:, None].to(tl.int64) * sv_n + dv[None, :],
        mask=n_ok[:, None] & (dv[None, :] < DV),
        other=0.0,
    )
    # query rows m that see some key of this tile: t >= e(n0) (and t < e(last) + WINDOW)
    m_lo = tl.maximum(n0 * STRIDE + OFFSET - q_start, 0)
    m_lo = (m_lo // BLOCK_M) * BLOCK_M
    if WINDOW > 0:
        last = tl.minimum(n0 + BLOCK_N, N) - 1
        m_hi = tl.minimum(last * STRIDE + OFFSET + WINDOW - q_start, Tq)
    else:
        m_hi = Tq
    r = tl.arange(0, R)
    g = r % GP
    head = h * G + g
    dk_acc = tl.zeros([BLOCK_N, BDK], tl.float32)
    dv_acc = tl.zeros([BLOCK_N, BDV], tl.float32)
    for m0 in range(m_lo, m_hi, BLOCK_M):
        m = m0 + r // GP
        row_ok = (m < Tq) & (g < G)
        t = q_start + m
        q = tl.load(
            Q + b * sq_b + m[:, None].to(tl.int64) * sq_t + head[:, None] * sq_h + dk[None, :],
            mask=row_ok[:, None] & (dk[None, :] < DK),
            other=0.0,
        )
        do = tl.load(
            DO + b * sdo_b + m[:, None].to(tl.int64) * sdo_t + head[:, None] * sdo_h + dv[None, :],
            mask=row_ok[:, None] & (dv[None, :] < DV),
            other=0.0,
        )
        row = (b * HQ + head).to(tl.int64) * Tq + m
        lse = tl.load(LSE + row, mask=row_ok, other=float("inf"))
        delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
        vis = row_ok[:, None] & n_ok[None, :] & (e[None, :] <= t[:, None])
        if WINDOW > 0:
            vis = vis & (e[None, :] > t[:, None] - WINDOW)
        p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
        dv_acc += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dk_acc += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC)
    dk_acc = dk_acc * scale
    tl.store(
        DK_ + b * sdk_b + h * sdk_h + n[:, None].to(tl.int64) * sdk_n + dk[None, :],
        dk_acc.to(DK_.dtype.element_ty),
        mask=n_ok[:, None] & (dk[None, :] < DK),
    )
    tl.store(
        DV_ + b * sdv_b + h * sdv_h + n[:, None].to(tl.int64) * sdv_n + dv[None, :],
        dv_acc.to(DV_.dtype.element_ty),
        mask=n_ok[:, None] & (dv[None, :] < DV),
    )


@triton.jit
def _topn_kernel(
    SC,
    IDX,
    n_rows,
    c_len,
    nb,
    q_start,
    H: tl.constexpr,
    NBP: tl.constexpr,
    N_SEL: tl.constexpr,
    NSP: tl.constexpr,
    N_INIT: tl.constexpr,
    N_LOCAL: tl.constexpr,
    L_SEL: tl.constexpr,
    RB: tl.constexpr,
):
    """Eqs. 11-12 with forcing, rows of a contiguous [B, c, H, nb] float32 score buffer ->
    [B, c, H, n_sel] ascending indices, -1 padded. Each candidate gets the int64 key
    (float bits of its nonnegative score << 32) | (2^31 - 1 - j): distinct keys ordered by score with
    ties to the lower index (forced blocks: the bits of +inf; non-candidates: -1). N_SEL rounds of
    row max pick the winners; a prefix sum writes them in ascending order."""
    pid = tl.program_id(0)
    r = pid * RB + tl.arange(0, RB)
    r_ok = r < n_rows
    t = q_start + (r // H) % c_len
    last = t // L_SEL
    j = tl.arange(0, NBP)
    s = tl.load(
        SC + r[:, None].to(tl.int64) * nb + j[None, :], mask=r_ok[:, None] & (j < nb)[None, :], other=0.0
    )
    bits = s.to(tl.int32, bitcast=True).to(tl.int64)
    cand = (j[None, :] <= last[:, None]) & (j < nb)[None, :]
    forced = cand & ((j[None, :] < N_INIT) | (j[None, :] > last[:, None] - N_LOCAL))
    bits = tl.where(forced, 0x7F800000, bits)
    key = (bits << 32) | (2147483647 - j).to(tl.int64)[None, :]
    key = tl.where(cand, key, -1)
    sel = tl.zeros([RB, NBP], tl.int32)
    for _ in tl.static_range(N_SEL):
        mx = tl.max(key, 1)
        hit = (key == mx[:, None]) & (mx[:, None] >= 0)
        sel = tl.where(hit, 1, sel)
        key = tl.where(hit, -1, key)
    pos = tl.cumsum(sel, 1) - 1
    cnt = tl.sum(sel, 1)
    out = IDX + r[:, None].to(tl.int64) * N_SEL
    tl.store(
        out + pos, (j[None, :] + tl.zeros([RB, NBP], tl.int32)).to(tl.int64), mask=(sel > 0) & r_ok[:, None]
    )
    kk = tl.arange(0, NSP)
    tl.store(
        out + kk[None, :],
        tl.full([RB, NSP], -1, tl.int64),
        mask=(kk[None, :] >= cnt[:, None]) & (kk < N_SEL)[None, :] & r_ok[:, None],
    )
