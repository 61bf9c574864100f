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
def _load_rows(base, n, nn, d, s_n, N, D: tl.constexpr, BD: tl.constexpr, NSTEP: tl.constexpr, MASKED: tl.constexpr):
    """Rows n of a [*, D] key/value stream (columns padded to BD)."""
    ptr = base + n[:, None].to(tl.int64) * s_n + d[None, :]
    if MASKED:
        return tl.load(ptr, mask=((nn < NSTEP) & (n < N))[:, None] & (d[None, :] < D), other=0.0)
    elif BD == D:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=d[None, :] < D, other=0.0)


@triton.jit
def _load_head_rows(X, b, s_b, s_t, s_h, m, head, d, row_ok, D: tl.constexpr):
    """Rows (position m, query head) of a [B, T, HQ, D] tensor (columns padded to len(d)); 0 where not row_ok."""
    return tl.load(
        X + b * s_b + m[:, None].to(tl.int64) * s_t + head[:, None] * s_h + d[None, :],
        mask=row_ok[:, None] & (d[None, :] < D),
        other=0.0,
    )


@triton.jit
def _load_row_stats(LSE, DELTA, b, head, m, row_ok, HQ: tl.constexpr, Tq):
    """lse (+inf where not row_ok, so p = 0 there) and delta of rows (m, head), both [B, HQ, Tq]."""
    row = (b * HQ + head).to(tl.int64) * Tq + m
    lse = tl.load(LSE + row, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    return lse, delta


@triton.jit
def _visible(e, col_ok, t, row_ok, WINDOW: tl.constexpr):
    """[rows, keys] visibility: the key ending at raw position e is seen by the row at position t iff
    e <= t (and e > t - WINDOW with a window); row_ok / col_ok mask padding rows and columns."""
    vis = row_ok[:, None] & col_ok[None, :] & (e[None, :] <= t[:, None])
    if WINDOW > 0:
        vis = vis & (e[None, :] > t[:, None] - WINDOW)
    return vis


@triton.jit
def _lse_tile(q, kb, n0, nn, dk, sk_n, N, t, row_ok, m_i, l_i, scale_log2, DK: tl.constexpr, BDK: tl.constexpr,
              NSTEP: tl.constexpr, STRIDE: tl.constexpr, OFFSET: tl.constexpr, PREC: tl.constexpr,
              MASKED: tl.constexpr):
    """Pass 1 on keys n0..n0+NSTEP: online max and sum of exp2 (base-2 log-sum-exp of Eq. 8)."""
    n = n0 + nn
    k = _load_rows(kb, n, nn, dk, sk_n, N, DK, BDK, NSTEP, MASKED)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
    if MASKED:
        vis = _visible(n * STRIDE + OFFSET, (nn < NSTEP) & (n < N), t, row_ok, 0)
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
    return m_new, l_i


@triton.jit
def _online_tile(q, kb, vb, n0, nn, dk, dv, sk_n, sv_n, N, t, row_ok, m_i, l_i, acc, scale_log2,
                 DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, NSTEP: tl.constexpr,
                 STRIDE: tl.constexpr, OFFSET: tl.constexpr, WINDOW: tl.constexpr, PREC: tl.constexpr,
                 MASKED: tl.constexpr):
    """One-pass online softmax (Eq. 5 with Eq. 8's normalizer) on keys n0..n0+NSTEP; unmasked tiles
    are visible to every row of the program."""
    n = n0 + nn
    k = _load_rows(kb, n, nn, dk, sk_n, N, DK, BDK, NSTEP, MASKED)
    v = _load_rows(vb, n, nn, dv, sv_n, N, DV, BDV, NSTEP, MASKED)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
    if MASKED:
        vis = _visible(n * STRIDE + OFFSET, (nn < NSTEP) & (n < N), t, row_ok, WINDOW)
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _eq9_w(i_lo, j_lo, D_CMP: tl.constexpr, L_CMP: tl.constexpr, L_SEL: tl.constexpr):
    """Eq. 9 weight |[i_lo, i_lo+l) ∩ [j_lo, j_lo+l_sel)| / d of the compressed token starting at raw
    position i_lo onto the selection block starting at j_lo (broadcast shapes; integer)."""
    return tl.maximum(tl.minimum(i_lo + L_CMP, j_lo + L_SEL) - tl.maximum(i_lo, j_lo), 0) // D_CMP


@triton.jit
def _eq9_weights(nn, cc, NSTEP: tl.constexpr, D_CMP: tl.constexpr, L_CMP: tl.constexpr, L_SEL: tl.constexpr,
                 BJ: tl.constexpr, BJP: tl.constexpr, SCORE_DOT: tl.constexpr):
    """Eq. 9 weights W[i, j] = |[i*d, i*d+l) ∩ [j*l_sel, (j+1)*l_sel)| / d of a tile's tokens ii onto its
    blocks: the same for every tile (tile n0 starts at token n0*d = block j0*l_sel, NSTEP*d = BJ*l_sel),
    so they are built once per program. SCORE_DOT: [BLOCK_N, BJP] fp16 onto the tile's own blocks
    (small integers: exact; the spill past its end is summed in float32 by ``_spill``); else
    (main [BLOCK_N, BJP], spill onto blocks BJ + c) fp32."""
    i_lo = (nn * D_CMP)[:, None]
    i_ok = (nn < NSTEP)[:, None]
    j_lo = (cc * L_SEL)[None, :]
    w_a = _eq9_w(i_lo, j_lo, D_CMP, L_CMP, L_SEL)
    if SCORE_DOT:
        w_a = tl.where(i_ok & (cc < BJ)[None, :], w_a, 0).to(tl.float16)
        w_b = w_a
    else:
        w_a = tl.where(i_ok, w_a, 0).to(tl.float32)
        w_b = tl.where(i_ok, _eq9_w(i_lo, j_lo + BJ * L_SEL, D_CMP, L_CMP, L_SEL), 0).to(tl.float32)
    return w_a, w_b


@triton.jit
def _spill(p, nn, cc, carry, BLOCK_M: tl.constexpr, GP: tl.constexpr, NSTEP: tl.constexpr, D_CMP: tl.constexpr,
           L_CMP: tl.constexpr, L_SEL: tl.constexpr, BJ: tl.constexpr, SPILL_W: tl.constexpr):
    """The tile's Eq. 9/10 mass on blocks BJ .. BJ+SPILL_W-1 (past its end: the tokens of its last keys
    reach into them), summed over the group in float32: column c of the returned carry."""
    for c in tl.static_range(SPILL_W):
        w = tl.where(nn < NSTEP, _eq9_w(nn * D_CMP, (BJ + c) * L_SEL, D_CMP, L_CMP, L_SEL), 0).to(tl.float32)
        sp = tl.sum(tl.reshape(tl.sum(p * w[None, :], 1), [BLOCK_M, GP]), 1)  # [BLOCK_M]
        carry = tl.where(cc[None, :] == c, sp[:, None], carry)
    return carry


@triton.jit
def _score_tile(q, kb, vb, n0, nn, dk, dv, sk_n, sv_n, N, t, row_ok, lse, acc, carry, w_a, w_b, sc_row, sc_row_ok,
                cc, nb, scale_log2, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
                BLOCK_M: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr, NSTEP: tl.constexpr,
                STRIDE: tl.constexpr, OFFSET: tl.constexpr, BJ: tl.constexpr, BJP: tl.constexpr, PREC: tl.constexpr,
                SCORE_DOT: tl.constexpr, SCORE_LO: tl.constexpr, MASKED: tl.constexpr, D_CMP: tl.constexpr,
                L_CMP: tl.constexpr, L_SEL: tl.constexpr, SPILL_W: tl.constexpr):
    """Pass 2 on keys n0..n0+NSTEP: p_cmp = exp2(s - lse) (Eq. 8), o += p v, and the Eq. 9/10 block
    scores of blocks j0..j0+BJ written (plus the spill into later blocks carried to the next tile).
    (w_a, w_b): the tile's Eq. 9 weights from ``_eq9_weights``."""
    n = n0 + nn
    k = _load_rows(kb, n, nn, dk, sk_n, N, DK, BDK, NSTEP, MASKED)
    v = _load_rows(vb, n, nn, dv, sv_n, N, DV, BDV, NSTEP, MASKED)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
    p = tl.exp2(s - lse[:, None])
    if MASKED:
        vis = _visible(n * STRIDE + OFFSET, (nn < NSTEP) & (n < N), t, row_ok, 0)
        p = tl.where(vis, p, 0.0)
    acc += tl.dot(p.to(v.dtype), v, input_precision=PREC)
    j0 = (n0 // NSTEP) * BJ
    if SCORE_DOT:
        # Tensor-core path (half inputs): p*2^14 as fp16 (plus, with SCORE_LO, its fp16 remainder) times
        # the fp16 weights onto the tile's blocks, Eq. 10 group sum on the [R, BJP] product; the mass
        # past the tile's end (its last keys' tokens) in float32, carried to the next tile.
        ps = p * 16384.0
        p_hi = ps.to(tl.float16)
        cw = tl.dot(p_hi, w_a)
        if SCORE_LO:
            p_lo = (ps - p_hi.to(tl.float32)).to(tl.float16)
            cw += tl.dot(p_lo, w_a)
        blk = tl.sum(tl.reshape(cw, [BLOCK_M, GP, BJP]), 1) * (1.0 / 16384.0) + carry
        carry = _spill(p, nn, cc, tl.zeros([BLOCK_M, BJP], tl.float32), BLOCK_M, GP, NSTEP, D_CMP, L_CMP, L_SEL,
                       BJ, SPILL_W)
    else:
        pg = tl.sum(tl.reshape(p, [BLOCK_M, GP, BLOCK_N]), 1)  # Eq. 10: sum over the group
        blk = tl.sum(pg[:, :, None] * w_a[None, :, :], 1) + carry
        carry = tl.sum(pg[:, :, None] * w_b[None, :, :], 1)
    j = j0 + cc
    tl.store(sc_row + j[None, :], blk, mask=sc_row_ok[:, None] & (cc < BJ)[None, :] & (j < nb)[None, :])
    return acc, carry


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
    SCORE_LO: tl.constexpr,
    LSE_N: tl.constexpr,
    SPILL_W: tl.constexpr,
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
    q = _load_head_rows(Q, b, sq_b, sq_t, sq_h, m, head, dk, row_ok, DK)
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
        # Tiles [0, n_full) are visible to every valid row of this program (e(i) <= tmin, i < N): they
        # skip the causal mask. Padding rows (m >= m_end or g >= G) then carry garbage through pass 1,
        # so their lse is set to +inf below and their p is exactly 0 in pass 2.
        n_vis = tl.minimum(tl.maximum(tmin - OFFSET + STRIDE, 0) // STRIDE, N)
        n_full = (n_vis // NSTEP) * NSTEP
        if NSTEP != BLOCK_N:
            n_full = 0  # tiles with padding columns always take the masked path
        # pass 1: the row log-sum-exp over the visible compressed keys (Eq. 8's normalizer), in tiles
        # of LSE_N keys (a power of two: no padding columns)
        n_full1 = (n_vis // LSE_N) * LSE_N
        nn1 = tl.arange(0, LSE_N)
        for n0 in range(0, n_full1, LSE_N):
            m_i, l_i = _lse_tile(q, kb, n0, nn1, dk, sk_n, N, t, row_ok, m_i, l_i, scale_log2,
                                 DK, BDK, LSE_N, STRIDE, OFFSET, PREC, False)
        for n0 in range(n_full1, hi, LSE_N):
            m_i, l_i = _lse_tile(q, kb, n0, nn1, dk, sk_n, N, t, row_ok, m_i, l_i, scale_log2,
                                 DK, BDK, LSE_N, STRIDE, OFFSET, PREC, True)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("inf"))
        lse = tl.where(row_ok, lse, float("inf"))
        # pass 2: normalized probabilities -> output and Eq. 9/10 block scores
        cc = tl.arange(0, BJP)
        mm = tl.arange(0, BLOCK_M)
        sc_row = SC + b * ssc_b + (m0 + mm - m_begin)[:, None].to(tl.int64) * ssc_t + h * ssc_h
        sc_row_ok = (m0 + mm) < m_end
        carry = tl.zeros([BLOCK_M, BJP], tl.float32)
        w_a, w_b = _eq9_weights(nn, cc, NSTEP, D_CMP, L_CMP, L_SEL, BJ, BJP, SCORE_DOT)
        for n0 in range(0, n_full, NSTEP):
            acc, carry = _score_tile(q, kb, vb, n0, nn, dk, dv, sk_n, sv_n, N, t, row_ok, lse, acc, carry, w_a, w_b,
                                     sc_row, sc_row_ok, cc, nb, scale_log2, DK, DV, BDK, BDV, BLOCK_M, GP,
                                     BLOCK_N, NSTEP, STRIDE, OFFSET, BJ, BJP, PREC, SCORE_DOT, SCORE_LO, False,
                                     D_CMP, L_CMP, L_SEL, SPILL_W)
        for n0 in range(n_full, hi, NSTEP):
            acc, carry = _score_tile(q, kb, vb, n0, nn, dk, dv, sk_n, sv_n, N, t, row_ok, lse, acc, carry, w_a, w_b,
                                     sc_row, sc_row_ok, cc, nb, scale_log2, DK, DV, BDK, BDV, BLOCK_M, GP,
                                     BLOCK_N, NSTEP, STRIDE, OFFSET, BJ, BJP, PREC, SCORE_DOT, SCORE_LO, True,
                                     D_CMP, L_CMP, L_SEL, SPILL_W)
        j_end = tl.cdiv(hi, NSTEP) * BJ
        j = j_end + cc
        tl.store(sc_row + j[None, :], carry, mask=sc_row_ok[:, None] & (j < nb)[None, :])
        o = acc
    else:
        # Tiles [mid_lo, mid_hi) lie inside every row's window (e(i) = i in [tmax - W + 1, tmin]) and
        # skip the mask; padding rows see them too (q = 0 there: finite, and never stored).
        mid_lo = hi
        mid_hi = hi
        if WINDOW > 0 and NSTEP == BLOCK_N:
            mid_lo = tl.minimum(tl.maximum((tl.maximum(tmax - WINDOW + 1, 0) + NSTEP - 1) // NSTEP * NSTEP, lo), hi)
            mid_hi = tl.maximum((tmin + 1) // NSTEP * NSTEP, mid_lo)
        for n0 in range(lo, mid_lo, NSTEP):
            m_i, l_i, acc = _online_tile(q, kb, vb, n0, nn, dk, dv, sk_n, sv_n, N, t, row_ok, m_i, l_i, acc,
                                         scale_log2, DK, DV, BDK, BDV, NSTEP, STRIDE, OFFSET, WINDOW, PREC, True)
        for n0 in range(mid_lo, mid_hi, NSTEP):
            m_i, l_i, acc = _online_tile(q, kb, vb, n0, nn, dk, dv, sk_n, sv_n, N, t, row_ok, m_i, l_i, acc,
                                         scale_log2, DK, DV, BDK, BDV, NSTEP, STRIDE, OFFSET, WINDOW, PREC, False)
        for n0 in range(mid_hi, hi, NSTEP):
            m_i, l_i, acc = _online_tile(q, kb, vb, n0, nn, dk, dv, sk_n, sv_n, N, t, row_ok, m_i, l_i, acc,
                                         scale_log2, DK, DV, BDK, BDV, NSTEP, STRIDE, OFFSET, WINDOW, PREC, True)
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
    q = _load_head_rows(Q, b, sq_b, sq_t, sq_h, m, head, dk, row_ok, DK)
    do = _load_head_rows(DO, b, sdo_b, sdo_t, sdo_h, m, head, dv, row_ok, DV)
    lse, delta = _load_row_stats(LSE, DELTA, b, head, m, row_ok, HQ, Tq)
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
        k = _load_rows(kb, n, nn, dk, sk_n, N, DK, BDK, BLOCK_N, True)
        v = _load_rows(vb, n, nn, dv, sv_n, N, DV, BDV, BLOCK_N, True)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
        vis = _visible(n * STRIDE + OFFSET, n_ok, t, row_ok, WINDOW)
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
    sdk_s,
    sdv_s,
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
    pid_s = tl.program_id(2)  # query split: this program sums the query tiles of one share
    n_split = tl.num_programs(2)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    n0 = pid_n * BLOCK_N
    nn = tl.arange(0, BLOCK_N)
    n = n0 + nn
    n_ok = n < N
    e = n * STRIDE + OFFSET
    dk = tl.arange(0, BDK)
    dv = tl.arange(0, BDV)
    k = _load_rows(K + b * sk_b + h * sk_h, n, nn, dk, sk_n, N, DK, BDK, BLOCK_N, True)
    v = _load_rows(V + b * sv_b + h * sv_h, n, nn, dv, sv_n, N, DV, BDV, BLOCK_N, True)
    # query rows m that see some key of this tile: t >= e(n0) (and t < e(last) + WINDOW)
    m_lo = tl.maximum(n0 * STRIDE + OFFSET - q_start, 0)
    m_lo = (m_lo // BLOCK_M) * BLOCK_M
    if WINDOW > 0:
        last = tl.minimum(n0 + BLOCK_N, N) - 1
        m_hi = tl.minimum(last * STRIDE + OFFSET + WINDOW - q_start, Tq)
    else:
        m_hi = Tq
    # split [m_lo, m_hi) into n_split shares of whole query tiles; share pid_s writes its own
    # float32 partial dk/dv slice (sdk_s / sdv_s apart), summed by the launcher
    per = tl.cdiv(tl.cdiv(tl.maximum(m_hi - m_lo, 0), BLOCK_M), n_split) * BLOCK_M
    m_lo = m_lo + pid_s * per
    m_hi = tl.minimum(m_hi, m_lo + per)
    r = tl.arange(0, R)
    g = r % GP
    head = h * G + g
    dk_acc = tl.zeros([BLOCK_N, BDK], tl.float32)
    dv_acc = tl.zeros([BLOCK_N, BDV], tl.float32)
    for m0 in range(m_lo, m_hi, BLOCK_M):
        m = m0 + r // GP
        row_ok = (m < Tq) & (g < G)
        t = q_start + m
        q = _load_head_rows(Q, b, sq_b, sq_t, sq_h, m, head, dk, row_ok, DK)
        do = _load_head_rows(DO, b, sdo_b, sdo_t, sdo_h, m, head, dv, row_ok, DV)
        lse, delta = _load_row_stats(LSE, DELTA, b, head, m, row_ok, HQ, Tq)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
        vis = _visible(e, n_ok, t, row_ok, WINDOW)
        p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
        dv_acc += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dk_acc += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC)
    dk_acc = dk_acc * scale
    DK_ += pid_s.to(tl.int64) * sdk_s
    DV_ += pid_s.to(tl.int64) * sdv_s
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
def _free(j, last, nb, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr):
    """Columns j (broadcast against rows' last = t // l_sel) that are candidates (j <= last, j < nb)
    and not forced (j >= N_INIT, j <= last - N_LOCAL); no ~, which triton 3.0's interpreter lacks."""
    return (j < nb) & (j >= N_INIT) & (j <= last - N_LOCAL)


@triton.jit
def _topn_kernel(
    SC,
    IDX,
    n_rows,
    ssc_b,
    sidx_b,
    nb,
    t0,
    H: tl.constexpr,
    NBP: tl.constexpr,
    N_SEL: tl.constexpr,
    NSP: tl.constexpr,
    N_INIT: tl.constexpr,
    N_LOCAL: tl.constexpr,
    L_SEL: tl.constexpr,
    RB: tl.constexpr,
    SEG: tl.constexpr,
):
    """Eqs. 11-12 with forcing. Batch b = program_id(1); its rows r = (position, head) of a
    [rows, nb] float32 score slice (``ssc_b`` elements apart per batch) -> [rows, N_SEL] ascending
    indices, -1 padded (``sidx_b`` apart); row r sits at position t0 + r // H. Only columns < NBP are
    read: the launcher picks NBP >= the candidate count (t // L_SEL + 1) of every row. Order of
    ``reference.select_blocks``: by score, ties to the lower index.

    The forced blocks outrank every other candidate, so they are placed directly. The others are
    picked in rounds over a two-level view of the row: the maxima of its NBP / SEG segments of SEG
    columns are taken once; each round takes the largest segment maximum (the lowest segment among
    equal ones), reloads that segment (SEG scores, cached), masks what earlier rounds took there (a
    bit per column), picks the lowest column holding the maximum, and updates that segment's maximum.
    So a round costs O(NBP / SEG + SEG), not O(NBP). All are written in ascending order by rank."""
    NSEG: tl.constexpr = NBP // SEG
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    r = pid * RB + tl.arange(0, RB)
    r_ok = r < n_rows
    t = t0 + r // H
    last = t // L_SEL
    row = SC + b * ssc_b + r.to(tl.int64) * nb  # [RB] row pointers
    j = tl.arange(0, NBP)
    s = tl.load(row[:, None] + j[None, :], mask=r_ok[:, None] & (j < nb)[None, :], other=0.0)
    kk = tl.arange(0, NSP)
    big = 1 << 30  # above every block index (nb < 2^30)
    win = big + kk[None, :] + tl.zeros([RB, NSP], tl.int32)  # distinct "no winner" values
    # The forced blocks win first, so they are written directly: slots [0, ni) take the initial
    # blocks, [ni, f) the local ones not already initial. Rows with f < N_INIT + N_LOCAL have only
    # forced candidates, so N_SEL - N_INIT - N_LOCAL rounds over the other candidates fill every row
    # (NSAConfig guarantees n_sel >= n_init + n_local).
    tl.static_assert(N_SEL >= N_INIT + N_LOCAL)
    ni = tl.minimum(last + 1, N_INIT)
    lo_loc = tl.maximum(last - N_LOCAL + 1, ni)
    f = ni + (last + 1 - lo_loc)
    kr = kk[None, :] + tl.zeros([RB, NSP], tl.int32)
    win = tl.where(kr < ni[:, None], kr, win)
    win = tl.where((kr >= ni[:, None]) & (kr < f[:, None]), lo_loc[:, None] + kr - ni[:, None], win)
    s = tl.where(_free(j[None, :], last[:, None], nb, N_INIT, N_LOCAL), s, -1.0)  # scores >= 0: -1 = not free
    smax = tl.max(tl.reshape(s, [RB, NSEG, SEG]), 2)  # [RB, NSEG]
    sg_i = tl.arange(0, NSEG)
    sl = tl.arange(0, SEG)
    taken = tl.zeros([RB, NSEG], tl.int32)  # bit c of segment g: column g*SEG + c already picked
    for i in tl.static_range(N_SEL - N_INIT - N_LOCAL):
        mx = tl.max(smax, 1)
        sg = tl.min(tl.where(smax == mx[:, None], sg_i[None, :], NSEG), 1)  # ties: the lower segment
        sg = tl.minimum(sg, NSEG - 1)
        jj = sg[:, None] * SEG + sl[None, :]  # [RB, SEG] columns of that segment
        seg = tl.load(row[:, None] + jj, mask=r_ok[:, None] & (jj < nb), other=-1.0)
        bits = tl.sum(tl.where(sg_i[None, :] == sg[:, None], taken, 0), 1)
        ok = _free(jj, last[:, None], nb, N_INIT, N_LOCAL) & (((bits[:, None] >> sl[None, :]) & 1) == 0)
        seg = tl.where(ok, seg, -1.0)  # not free, or taken by an earlier round
        jl = tl.min(tl.where(seg == mx[:, None], sl[None, :], SEG), 1)  # ties: the lower column
        jl = tl.minimum(jl, SEG - 1)
        seg = tl.where(sl[None, :] == jl[:, None], -1.0, seg)
        hit = sg_i[None, :] == sg[:, None]
        smax = tl.where(hit, tl.max(seg, 1)[:, None], smax)
        taken = tl.where(hit, taken | (1 << jl)[:, None], taken)
        jw = tl.where(mx >= 0, sg * SEG + jl, big + f + i)
        win = tl.where(kr == (f + i)[:, None], jw[:, None], win)
    # ascending order: each value's rank among the row's NSP distinct values; "no winner" ranks last
    rank = tl.sum((win[:, None, :] < win[:, :, None]).to(tl.int32), 2)
    out = IDX + b * sidx_b + r[:, None].to(tl.int64) * N_SEL
    tl.store(out + rank, tl.where(win >= big, -1, win).to(tl.int64), mask=(rank < N_SEL) & r_ok[:, None])
