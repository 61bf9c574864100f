"""Triton compressed branch (spec steps 1-4; paper Eqs. 5, 8-12), same contract as
``nsa.reference.compressed_branch``.

The forward kernel fuses compressed attention with the Eq. 9/10 block scores, so no [H, T, Tc]
probability tensor is ever formed. It runs two passes over the visible compressed keys (a key
stream with STRIDE = d, OFFSET = l - 1, see ``tiles``): the first finds each row's log-sum-exp, the
second forms the normalized p_cmp = exp(s - lse), accumulates o = p @ v, sums p over the G heads of
the group (Eq. 10) and maps it onto selection blocks with the block-aligned Eq. 9 weights
W[i, j] = |[i*d, i*d+l) ∩ [j*l_sel, (j+1)*l_sel)| / d. Key tiles step NSTEP tokens with NSTEP*d a
multiple of l_sel, so a tile feeds BJ = NSTEP*d/l_sel whole blocks plus a spill into the next
block(s) that is carried in registers to the next tile: each block score is written exactly once.

The scores go to a float32 ``[B, chunk, H, nb]`` buffer for a chunk of queries, which
``topn.topn_launch`` turns into the top-n indices (forcing, ties to the lower index) before the
next chunk. Backward (dq, dk_cmp, dv_cmp): ``attention_bwd`` with the visibility i*d + l - 1 <= t.
Launch parameters: ``tuning.params("compressed")``.
"""

# No ``from __future__ import annotations`` here: triton 2.3/3.0's JIT reads the kernel annotations
# as objects (string annotations make ``tl.constexpr`` parameters plain runtime arguments).
from typing import Sequence

import torch
import triton
import triton.language as tl

from ...compat import custom_op
from . import attention_bwd, tuning
from .tiles import (forward_rows, geometry, group_rows, key_range, load_head_rows, load_rows, query_grid,
                    store_head_rows, visible)
from .topn import topn_launch
from .utils import LOG2E, Blocks, default_scale, descriptor, dot_precision, empty, launch_options, p2, tma_ok


@triton.jit
def _key_tile(base, XD, b, h, n0, n, nn, d, s_n, N, D: tl.constexpr, BD: tl.constexpr, NSTEP: tl.constexpr,
              MASKED: tl.constexpr, TMA: tl.constexpr):
    """Keys n = n0 + nn of head h (``load_rows``), or with TMA through the descriptor XD of the [B, N, H, D]
    tensor (block [1, NSTEP, 1, BD]). MASKED: zero from key N on, as the masked load; N is the tile's bound
    ``hi`` there, so that no key that none of its rows may see is loaded (0 x NaN is NaN in p @ v)."""
    if TMA:
        x = tl.reshape(XD.load([b.to(tl.int32), n0, h, 0]), [NSTEP, BD])
        if MASKED:
            x = tl.where(((nn < NSTEP) & (n < N))[:, None], x, 0.0)
        return x
    return load_rows(base, n, nn, d, s_n, N, D, BD, NSTEP, MASKED)


@triton.jit
def _lse_tile(q, kb, KD, b, h, n0, nn, dk, sk_n, N, t, row_ok, m_i, l_i, scale_log2, DK: tl.constexpr,
              BDK: tl.constexpr, NSTEP: tl.constexpr, STRIDE: tl.constexpr, OFFSET: tl.constexpr, PREC: tl.constexpr,
              MASKED: tl.constexpr, TMA: tl.constexpr):
    """Pass 1 on keys n0..n0+NSTEP: online max and sum of exp2 (base-2 log-sum-exp of Eq. 8)."""
    n = n0 + nn
    k = _key_tile(kb, KD, b, h, n0, n, nn, dk, sk_n, N, DK, BDK, NSTEP, MASKED, TMA)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
    if MASKED:
        vis = visible(n * STRIDE + OFFSET, (nn < NSTEP) & (n < N), t, row_ok, 0)
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
    return m_new, l_i


@triton.jit
def _lse_pass(q, kb, KD, b, h, dk, sk_n, N, t, row_ok, n_vis, hi, scale_log2, DK: tl.constexpr, BDK: tl.constexpr,
              R: tl.constexpr, LSE_N: tl.constexpr, STRIDE: tl.constexpr, OFFSET: tl.constexpr, PREC: tl.constexpr,
              TMA: tl.constexpr):
    """Pass 1: each row's base-2 log-sum-exp over its visible compressed keys (Eq. 8's normalizer), in
    tiles of LSE_N keys (a power of two: no padding columns); the first n_vis keys, visible to every
    row, unmasked. +inf for padding rows, so their p is exactly 0 in pass 2."""
    m_i = tl.full([R], float("-inf"), tl.float32)
    l_i = tl.zeros([R], tl.float32)
    n_full1 = (n_vis // LSE_N) * LSE_N
    nn1 = tl.arange(0, LSE_N)
    for n0 in range(0, n_full1, LSE_N):
        m_i, l_i = _lse_tile(q, kb, KD, b, h, n0, nn1, dk, sk_n, N, t, row_ok, m_i, l_i, scale_log2,
                             DK, BDK, LSE_N, STRIDE, OFFSET, PREC, False, TMA)
    for n0 in range(n_full1, hi, LSE_N):  # bounded by hi: keys from hi on are seen by no row
        m_i, l_i = _lse_tile(q, kb, KD, b, h, n0, nn1, dk, sk_n, hi, t, row_ok, m_i, l_i, scale_log2,
                             DK, BDK, LSE_N, STRIDE, OFFSET, PREC, True, TMA)
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("inf"))
    return tl.where(row_ok, lse, float("inf"))


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
def _score_tile(q, kb, vb, KD, VD, b, h, n0, nn, dk, dv, sk_n, sv_n, N, t, row_ok, lse, acc, carry, w_a, w_b, sc_row,
                sc_row_ok, cc, nb, scale_log2, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
                BLOCK_M: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr, NSTEP: tl.constexpr,
                STRIDE: tl.constexpr, OFFSET: tl.constexpr, BJ: tl.constexpr, BJP: tl.constexpr, PREC: tl.constexpr,
                SCORE_DOT: tl.constexpr, SCORE_LO: tl.constexpr, MASKED: tl.constexpr, D_CMP: tl.constexpr,
                L_CMP: tl.constexpr, L_SEL: tl.constexpr, SPILL_W: tl.constexpr, TMA: tl.constexpr,
                SCORE_ONLY: tl.constexpr):
    """Pass 2 on keys n0..n0+NSTEP: p_cmp = exp2(s - lse) (Eq. 8), o += p v (not with SCORE_ONLY), and
    the Eq. 9/10 block scores of blocks j0..j0+BJ written (plus the spill into later blocks carried to the
    next tile). (w_a, w_b): the tile's Eq. 9 weights from ``_eq9_weights``."""
    n = n0 + nn
    k = _key_tile(kb, KD, b, h, n0, n, nn, dk, sk_n, N, DK, BDK, NSTEP, MASKED, TMA)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
    p = tl.exp2(s - lse[:, None])
    if MASKED:
        vis = visible(n * STRIDE + OFFSET, (nn < NSTEP) & (n < N), t, row_ok, 0)
        p = tl.where(vis, p, 0.0)
    if not SCORE_ONLY:
        v = _key_tile(vb, VD, b, h, n0, n, nn, dv, sv_n, N, DV, BDV, NSTEP, MASKED, TMA)
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
def _score_pass(q, kb, vb, KD, VD, b, h, nn, cc, dk, dv, sk_n, sv_n, N, t, row_ok, lse, sc_row, sc_row_ok, n_full,
                hi, nb, scale_log2, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
                BLOCK_M: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr, NSTEP: tl.constexpr,
                STRIDE: tl.constexpr, OFFSET: tl.constexpr, BJ: tl.constexpr, BJP: tl.constexpr, PREC: tl.constexpr,
                SCORE_DOT: tl.constexpr, SCORE_LO: tl.constexpr, D_CMP: tl.constexpr, L_CMP: tl.constexpr,
                L_SEL: tl.constexpr, SPILL_W: tl.constexpr, TMA: tl.constexpr, SCORE_ONLY: tl.constexpr):
    """Pass 2: normalized probabilities p -> the output o = p @ v (returned, zeros with SCORE_ONLY; p is
    normalized, so no final division) and the Eq. 9/10 block scores of every candidate block (the last tile's carry
    written at the end); cc: the block columns 0..BJP. Tiles [0, n_full) are visible to every valid
    row and skip the mask."""
    acc = tl.zeros([BLOCK_M * GP, BDV], tl.float32)
    carry = tl.zeros([BLOCK_M, BJP], tl.float32)
    w_a, w_b = _eq9_weights(nn, cc, NSTEP, D_CMP, L_CMP, L_SEL, BJ, BJP, SCORE_DOT)
    for n0 in range(0, n_full, NSTEP):
        acc, carry = _score_tile(q, kb, vb, KD, VD, b, h, n0, nn, dk, dv, sk_n, sv_n, N, t, row_ok, lse, acc, carry,
                                 w_a, w_b, sc_row, sc_row_ok, cc, nb, scale_log2, DK, DV, BDK, BDV, BLOCK_M, GP,
                                 BLOCK_N, NSTEP, STRIDE, OFFSET, BJ, BJP, PREC, SCORE_DOT, SCORE_LO, False,
                                 D_CMP, L_CMP, L_SEL, SPILL_W, TMA, SCORE_ONLY)
    for n0 in range(n_full, hi, NSTEP):  # bounded by hi: no key that none of the rows sees enters p @ v
        acc, carry = _score_tile(q, kb, vb, KD, VD, b, h, n0, nn, dk, dv, sk_n, sv_n, hi, t, row_ok, lse, acc, carry,
                                 w_a, w_b, sc_row, sc_row_ok, cc, nb, scale_log2, DK, DV, BDK, BDV, BLOCK_M, GP,
                                 BLOCK_N, NSTEP, STRIDE, OFFSET, BJ, BJP, PREC, SCORE_DOT, SCORE_LO, True,
                                 D_CMP, L_CMP, L_SEL, SPILL_W, TMA, SCORE_ONLY)
    j = tl.cdiv(hi, NSTEP) * BJ + cc
    tl.store(sc_row + j[None, :], carry, mask=sc_row_ok[:, None] & (j < nb)[None, :])
    return acc


@triton.jit
def fwd_kernel(
    Q, K, V, Out, LSE, SC, QD, KD1, KD, VD, TILES, CU_Q, CU_K, sq_b, sq_t, sq_h, sk_b, sk_n, sk_h, sv_b, sv_n, sv_h,
    so_b, so_t, so_h, ssc_b, ssc_t, ssc_h, N, Tq, q_start, m_begin, m_end, nb, scale_log2,
    HQ: tl.constexpr, H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BDK: tl.constexpr, BDV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NSTEP: tl.constexpr,
    STRIDE: tl.constexpr, OFFSET: tl.constexpr, D_CMP: tl.constexpr, L_CMP: tl.constexpr, L_SEL: tl.constexpr,
    BJ: tl.constexpr, BJP: tl.constexpr, PREC: tl.constexpr, SCORE_DOT: tl.constexpr, SCORE_LO: tl.constexpr,
    LSE_N: tl.constexpr, SPILL_W: tl.constexpr, VARLEN: tl.constexpr, TMA: tl.constexpr, SCORE_ONLY: tl.constexpr,
):
    """o_cmp [B,Tq,HQ,Dv], lse [B,HQ,Tq] (base 2) and the block scores of queries [m_begin, m_end)
    (rows of SC: position - m_begin). VARLEN: packed documents (B = 1; TILES, CU_Q = cu_seqlens, CU_K =
    the compressed tokens' offsets, see ``tiles.doc_rows``); else TILES, CU_Q, CU_K are None. TMA: q and the
    key tiles through the descriptors QD, KD1 (pass 1's LSE_N keys), KD, VD (pass 2's BLOCK_N keys).
    SCORE_ONLY: the block scores alone, from the rows' lse read from LSE (no pass 1, no p @ v; Out unused)."""
    b, h, m0, m, t, head, row_ok, m_begin, m_end, N, Q, Out, LSE, K, V = forward_rows(
        Q, Out, LSE, K, V, TILES, CU_Q, CU_K, sq_t, so_t, sk_n, sv_n, N, q_start, m_begin, m_end, H, G, GP, BLOCK_M,
        VARLEN)
    dk = tl.arange(0, BDK)
    dv = tl.arange(0, BDV)
    if TMA:
        q = group_rows(QD, b, m0, h, BLOCK_M, G, BDK)
    else:
        q = load_head_rows(Q, b, sq_b, sq_t, sq_h, m, head, dk, row_ok, DK)
    tmin, tmax, hi = key_range(q_start, m0, m_end, N, STRIDE, OFFSET, BLOCK_M)
    kb = K + b * sk_b + h * sk_h
    vb = V + b * sv_b + h * sv_h
    nn = tl.arange(0, BLOCK_N)
    # Keys [0, n_vis) are visible to every valid row of this program (e(i) <= tmin, i < N): they skip
    # the causal mask. Padding rows (m >= m_end or g >= G) then carry garbage through pass 1, so their
    # lse is +inf and their p exactly 0 in pass 2.
    n_vis = tl.minimum(tl.maximum(tmin - OFFSET + STRIDE, 0) // STRIDE, N)
    n_full = (n_vis // NSTEP) * NSTEP
    if NSTEP != BLOCK_N:
        n_full = 0  # tiles with padding columns always take the masked path
    if SCORE_ONLY:  # +inf for padding rows, as pass 1 gives them
        lse = tl.load(LSE + (b * HQ + head).to(tl.int64) * Tq + m, mask=row_ok, other=float("inf"))
    else:
        lse = _lse_pass(q, kb, KD1, b, h, dk, sk_n, N, t, row_ok, n_vis, hi, scale_log2, DK, BDK, BLOCK_M * GP,
                        LSE_N, STRIDE, OFFSET, PREC, TMA)
    cc = tl.arange(0, BJP)
    mm = tl.arange(0, BLOCK_M)
    sc_row = SC + b * ssc_b + (m0 + mm - m_begin)[:, None].to(tl.int64) * ssc_t + h * ssc_h
    o = _score_pass(q, kb, vb, KD, VD, b, h, nn, cc, dk, dv, sk_n, sv_n, N, t, row_ok, lse, sc_row, (m0 + mm) < m_end,
                    n_full, hi, nb, scale_log2, DK, DV, BDK, BDV, BLOCK_M, GP, BLOCK_N, NSTEP, STRIDE, OFFSET, BJ, BJP,
                    PREC, SCORE_DOT, SCORE_LO, D_CMP, L_CMP, L_SEL, SPILL_W, TMA, SCORE_ONLY)
    if not SCORE_ONLY:
        store_head_rows(Out, o, b, so_b, so_t, so_h, m, head, dv, row_ok, DV)
        # LSE layout: [B, HQ, Tq] float32, base 2
        tl.store(LSE + (b * HQ + head).to(tl.int64) * Tq + m, lse, mask=row_ok)


def compressed_forward(q, k, v, config, *, scale, q_start, n_blocks, on_scored, tune, varlen=None, lse_in=None):
    """o [B,Tq,HQ,Dv], lse [B,HQ,Tq] (base 2) and the top-n indices [B,Tq,H,n_sel], the block scores
    consumed chunk by chunk. ``on_scored()`` (optional) is called once the last chunk's attention and
    scoring kernel is queued, before its top-n. ``varlen``: packed documents (B = 1; a chunk's tiles
    are its documents' parts, each its own sequence). ``lse_in`` (the rows' base-2 lse, [B,HQ,Tq]
    float32, +inf where a row sees no key): the scores alone from it, o returned as None."""
    B, Tq, HQ, Dk = q.shape
    N, H, Dv = k.shape[1], k.shape[2], v.shape[3]
    geo = geometry(HQ, H, Dk, Dv, tune["rows"])
    score_only = lse_in is not None
    o = None if score_only else empty((B, Tq, HQ, Dv), q)
    lse = lse_in if score_only else empty((B, HQ, Tq), q, torch.float32)
    u = config.l_sel // config.d  # compressed tokens per selection block
    bj = max(1, tune["block_n"] // u)
    bj = max(bj, -(-(config.l - config.d) // config.l_sel))  # the spill fits in one carry
    nstep = u * bj
    nb = n_blocks
    per_row = max(B, 1) * H * max(nb, 1) * 4
    chunk = max(geo["BLOCK_M"], tune["score_buffer_bytes"] // per_row // geo["BLOCK_M"] * geo["BLOCK_M"])
    idx = empty((B, Tq, H, config.n_sel), q, torch.int64)
    score_dot = q.dtype in (torch.float16, torch.bfloat16)
    kw = dict(
        D_CMP=config.d,
        L_CMP=config.l,
        L_SEL=config.l_sel,
        BJ=bj,
        BJP=p2(bj, 16) if score_dot else p2(bj),  # tl.dot needs N >= 16 (triton 3.0)
        SCORE_DOT=score_dot,
        SCORE_LO=tune["score_lo"],
        SPILL_W=-(-max(config.l - config.d, 0) // config.l_sel),  # blocks past a tile's end its keys reach
    )
    if B == 0 or Tq == 0:  # empty outputs, nothing to launch
        if on_scored is not None:
            on_scored()
        return o, lse, idx
    # TMA: tiles without padding columns only (a descriptor block has no per-column mask)
    tma = tma_ok(tune["tma"], varlen, geo["G"], geo["GP"], q, k, v) and p2(nstep) == nstep
    bdk, bdv = geo["BDK"], geo["BDV"]
    descs = ((descriptor(q, [1, geo["BLOCK_M"], geo["GP"], bdk]), descriptor(k, [1, tune["lse_n"], 1, bdk]),
              descriptor(k, [1, nstep, 1, bdk]), descriptor(v, [1, nstep, 1, bdv])) if tma else (None,) * 4)
    out_t = q if score_only else o  # the kernel's Out (not written with SCORE_ONLY)
    for c0 in range(0, Tq, chunk):
        c1 = min(Tq, c0 + chunk)
        # every candidate block (j <= t // l_sel) of every row is written by the kernel: no memset
        sc = empty((B, c1 - c0, H, nb), q, torch.float32)
        grid, docs = query_grid(varlen, geo["BLOCK_M"], B, H, q.device, c0, c1, config.d, config.l - 1)
        fwd_kernel[grid](
            Q=q, K=k, V=v, Out=out_t, LSE=lse, SC=sc, QD=descs[0], KD1=descs[1], KD=descs[2], VD=descs[3], TILES=docs[0],
            CU_Q=docs[1], CU_K=docs[2], sq_b=q.stride(0), sq_t=q.stride(1), sq_h=q.stride(2), sk_b=k.stride(0), sk_n=k.stride(1),
            sk_h=k.stride(2), sv_b=v.stride(0), sv_n=v.stride(1), sv_h=v.stride(2), so_b=out_t.stride(0), so_t=out_t.stride(1),
            so_h=out_t.stride(2), ssc_b=sc.stride(0), ssc_t=sc.stride(1), ssc_h=sc.stride(2), N=N, Tq=Tq,
            q_start=q_start, m_begin=c0,
            m_end=c1, nb=n_blocks, scale_log2=scale * LOG2E, **geo, BLOCK_N=p2(nstep), NSTEP=nstep, STRIDE=config.d,
            OFFSET=config.l - 1, PREC=dot_precision(q.dtype), LSE_N=tune["lse_n"], VARLEN=varlen is not None, TMA=tma,
            SCORE_ONLY=score_only,
            **launch_options(tuning.by_path(tune, tma, q.element_size())), **kw,
        )
        if on_scored is not None and c1 == Tq:
            on_scored()
        out = idx if (c0 == 0 and c1 == Tq) else empty((B, c1 - c0, H, config.n_sel), q, torch.int64)
        topn_launch(sc, out, q_start + c0, nb, config, pos=None if varlen is None else varlen.row_pos(q.device)[c0:c1])
        if out is not idx:
            idx[:, c0:c1] = out
    return o, lse, idx


def _compressed_fwd_fake(q, k, v, blocks, scale, q_start, n_blocks, tune):
    B, Tq, HQ, _ = q.shape
    return (q.new_empty(B, Tq, HQ, v.shape[3]), q.new_empty(B, HQ, Tq, dtype=torch.float32),
            q.new_empty(B, Tq, k.shape[2], Blocks(*blocks).n_sel, dtype=torch.int64))


@custom_op("nsa::compressed_fwd", _compressed_fwd_fake)
def _compressed_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: Sequence[int], scale: float,
                       q_start: int, n_blocks: int, tune: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`compressed_forward` of one sequence per batch row: (o, lse, indices); ``blocks``: ``Blocks.of(config)``,
    ``tune`` from ``tuning.to_ints``."""
    return compressed_forward(q, k, v, Blocks(*blocks), scale=scale, q_start=q_start, n_blocks=n_blocks, on_scored=None,
                    tune=tuning.from_ints("compressed", tune))


def _compressed_scores_fake(q, k, v, lse, blocks, scale, n_blocks, tune):
    return q.new_empty(q.shape[0], q.shape[1], k.shape[2], Blocks(*blocks).n_sel, dtype=torch.int64)


@custom_op("nsa::compressed_scores", _compressed_scores_fake)
def compressed_scores_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor, blocks: Sequence[int],
                         scale: float, n_blocks: int, tune: Sequence[int]) -> torch.Tensor:
    """The top-n indices of rows from the sequence's start, their Eq. 9/10 scores from the given base-2 lse
    ``[B,HQ,Tq]`` (:func:`compressed_forward`'s score-only pass; ``nsa.backends.cudnn`` gives it cuDNN's)."""
    return compressed_forward(q, k, v, Blocks(*blocks), scale=scale, q_start=0, n_blocks=n_blocks, on_scored=None,
                    tune=tuning.from_ints("compressed", tune), lse_in=lse)[2]


class CompressedAttention(torch.autograd.Function):
    """(o_cmp, indices) of the compressed branch; differentiable in q, k_cmp, v_cmp through o_cmp. By the custom
    ops ``nsa::compressed_fwd`` and ``nsa::attention_bwd`` (see the package docstring); ``on_scored`` and
    packed documents (``varlen``), which no op schema carries, call the functions beneath (eager only)."""

    @staticmethod
    def forward(ctx, q, k, v, config, scale, q_start, n_blocks, on_scored=None, varlen=None):
        """Arguments:
            ctx: autograd's context.
            q, k, v: queries ``[B,Tq,HQ,Dk]``, compressed keys ``[B,Tc,H,Dk]`` and values ``[B,Tc,H,Dv]``.
            config: the layer's NSAConfig; scale: the softmax scale; q_start: the first query's position.
            n_blocks: the number of selection blocks; on_scored, varlen: as ``Backend.compressed``.

        Returns:
            ``(o_cmp [B,Tq,HQ,Dv], indices [B,Tq,H,n_sel])`` (indices not differentiable).
        """
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        tune = tuning.params("compressed", q.device)
        if on_scored is None and varlen is None:
            o, lse, idx = _compressed_fwd_op(q, k, v, list(Blocks.of(config)), float(scale), int(q_start), int(n_blocks),
                                             tuning.to_ints("compressed", tune))
        else:
            o, lse, idx = compressed_forward(q, k, v, config, scale=scale, q_start=q_start, n_blocks=n_blocks,
                                   on_scored=on_scored, tune=tune, varlen=varlen)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.geom = dict(scale=scale, q_start=q_start, stride=config.d, offset=config.l - 1, window=0,
                        tune=tuning.params("attention_bwd", q.device), varlen=varlen)
        ctx.mark_non_differentiable(idx)
        return o, idx

    @staticmethod
    def backward(ctx, do, _didx):
        """Arguments:
            ctx: autograd's context; do: the gradient of o_cmp; _didx: that of the indices (none).

        Returns:
            ``(dq, dk, dv)`` and None for every other input of :meth:`forward`.
        """
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = attention_bwd.backward(q, k, v, o, lse, do, **ctx.geom)
        return dq, dk, dv, None, None, None, None, None, None


def compressed_branch(q, k_cmp, v_cmp, config, *, scale=None, q_start: int = 0, n_keys=None, on_scored=None,
                      varlen=None):
    """Returns ``(o_cmp [B,Tq,HQ,Dv], indices [B,Tq,H,n_sel] int64)``; see the module docstring.
    ``on_scored()`` (optional, no arguments, no autograd work) is called once the attention and scoring
    kernel is queued, before the top-n: ``nsa.functional`` records a CUDA event there. ``varlen``: packed
    documents (a ``nsa.varlen.Varlen``; k_cmp/v_cmp packed per document)."""
    scale = default_scale(q, scale)
    S = q_start + q.shape[1] if n_keys is None else n_keys
    nb = config.n_blocks(S) if varlen is None else varlen.n_blocks(config)
    return CompressedAttention.apply(q, k_cmp, v_cmp, config, scale, int(q_start), nb, on_scored, varlen)
