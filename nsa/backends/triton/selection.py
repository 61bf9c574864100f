"""Selected attention (spec step 5; paper Eq. 5 over the blocks of Eq. 12) in Triton, forward and backward.

Same contract as ``nsa.reference.selected_attention``: q ``[B,Tq,HQ,Dk]``, k ``[B,S,H,Dk]``,
v ``[B,S,H,Dv]``, indices ``[B,Tq,H,n_sel]`` (-1 entries ignored); query row i sits at absolute
position t = q_start + i and attends to the raw tokens u <= t (u < S) of its selected blocks
(block j = tokens [j*l_sel, (j+1)*l_sel)). Query head h reads key/value head h // G. Differentiable
in q, k, v. Packed documents (``varlen``, a ``nsa.varlen.Varlen``; B = 1): row i of document k sits at
position i - cu_seqlens[k] and its block j covers that document's tokens [j*l_sel, (j+1)*l_sel). Launch
parameters, and which kernel family runs: ``tuning.params("selection")``.

Two kernel families, both group-centric (paper Fig. 3: the G heads of a group share the blocks and
each key/value tile is loaded once for all of them):

* **query-outer** (``fwd_q_kernel``, ``bwd_dq_kernel``): one program per (query row, group); the
  G heads form the M rows of the tile; loop over the selected blocks with an online softmax. Best
  for large G (>= 8), where the G rows fill a matrix tile.
* **block-outer** (``fwd_kv_kernel``, ``bwd_kv_kernel``): an inverted index (torch sort) lists,
  for each (sequence, group, key block), the queries that selected it; one program per chunk of
  that list loads the key/value block once and packs (queries x G heads) into the M rows, so a
  tile is full for any G. Forward writes per-slot partial outputs and log-sum-exps, merged by
  ``combine_kernel``; backward accumulates dK/dV of the block in registers (one fp32 atomic add
  per chunk, not per query), and dQ per slot (or, after a query-outer forward whose dq partials
  would not fit, by the query-outer kernel). Long inputs run in row chunks whose partials fit
  ``part_bytes_max`` (one plan per chunk).

Softmax statistics are kept in base 2 (``lse2 = log2 sum exp2(scale*log2(e)*q.k)``). All offsets
are computed in int64. Accumulation is fp32; fp32 inputs use IEEE fp32 products (no tf32).
"""

# No ``from __future__ import annotations`` here: triton 2.3/3.0's JIT reads the kernel annotations
# as objects (string annotations make ``tl.constexpr`` parameters plain runtime arguments).
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from ...compat import assume_constant_result, custom_op
from . import tuning
from .gate import gate_rows
from .rowdot import row_dot
from .utils import LOG2E, default_scale, descriptor, dot_precision, empty, interpreted, p2, tma_ok


@triton.jit
def _seq_bounds(CU_Q, CU_K, seq):
    """(first query row, first key row, key count) of packed sequence ``seq`` (int64)."""
    q0 = tl.load(CU_Q + seq).to(tl.int64)
    k0 = tl.load(CU_K + seq).to(tl.int64)
    return q0, k0, tl.load(CU_K + seq + 1).to(tl.int64) - k0


# ------------------------------------------------------------------------------------------------
# Query-outer kernels: one program per (query row, kv head); rows of the tile = the G heads.
# ------------------------------------------------------------------------------------------------
@triton.jit
def sel_tile(XD, row, h, BLOCK_S: tl.constexpr, BD: tl.constexpr):
    """Key rows row.. row+BLOCK_S of head h through the TMA descriptor of a [Nk, H, D] tensor (block
    [BLOCK_S, 1, BD]). Unlike the masked pointer loads, rows outside the selected block (past t, past the
    block, the previous or next sequence) hold data, not zeros, so the forward loads through it only
    blocks that lie wholly at or before the row's token; rows outside the tensor (a negative ``row``) are
    zeros."""
    return tl.reshape(XD.load([row.to(tl.int32), h.to(tl.int32), 0]), [BLOCK_S, BD])


@triton.jit
def _online(q, kt, vv, ok, m_i, l_i, acc, scale_log2, PREC: tl.constexpr):
    """One key tile of the online softmax (Eq. 12 over the selected tokens): scores of q [G, Dk] against
    kt [Dk, S] (log2 domain), keys where ``ok`` is False masked to p = 0; returns the updated running max,
    sum and unnormalised output."""
    qk = tl.dot(q, kt, input_precision=PREC) * scale_log2
    qk = tl.where(ok[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(qk - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def fwd_q_kernel(
    Q, K, V, KD, VD, FIN, IDX, O, LSE, ROW_SEQ, CU_Q, CU_K, OC, OW, GT,
    sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, si_n, si_h, so_n, so_h, sl_n, sg_n,
    q_start, scale_log2,
    G: tl.constexpr, N_SEL: tl.constexpr, L_SEL: tl.constexpr, N_SUB: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    PREC: tl.constexpr, GATED: tl.constexpr, TMA: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The query-outer forward: grid (query rows, key/value heads); each program attends, for the G
    query heads of its group, to the row's n_sel selected blocks (online softmax), writing o and lse
    (base 2), or with GATED the gated sum of the three branches.

    Arguments:
        Tensors and strides as :func:`_forward` passes them (``s<x>_<dim>``: tensor x's stride along dim);
        constexprs: the config's sizes, tiles from :func:`tile_meta`, ``TMA``: load keys through KD/VD.
    """
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    seq = tl.load(ROW_SEQ + r).to(tl.int64)
    q0, k0, S = _seq_bounds(CU_Q, CU_K, seq)
    t = q_start + (r - q0)

    g = tl.arange(0, BLOCK_G)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    ar = tl.arange(0, BLOCK_S)
    mg = g < G
    heads = h * G + g
    q = tl.load(Q + r * sq_n + heads[:, None] * sq_h + dk[None, :], mask=mg[:, None] & (dk[None, :] < DK), other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    # TMA: the descriptor has no mask. With every value finite (FIN, one flag for the call) the loop loads
    # whole blocks, and p = 0 zeroes the keys past t. Otherwise a value the row may not see must not reach
    # p @ v (0 x NaN is NaN): the block holding t, when selected and not whole, goes first with its values
    # past t zeroed, and the loop skips it and any later block (rows outside the tensor: zeros). Both
    # before the loop and only then: a peel after the loop spilled registers, one on every call cost
    # 20 % (BENCHMARKS.md).
    jt = t // L_SEL
    skip = t * 0 + (1 << 62)  # TMA: the loop loads no block from this one on (here: none skipped)
    if TMA:
        if tl.load(FIN) == 0:
            skip = jt + (jt * L_SEL + L_SEL <= t + 1).to(tl.int64)  # from t's block, or the next if t ends it
            peel = 0
            for s in range(N_SEL):
                peel = peel | (tl.load(IDX + r * si_n + h * si_h + s) == jt).to(tl.int32)
            peel = peel & (skip == jt).to(tl.int32)
            row = tl.where(peel > 0, k0 + jt * L_SEL, -BLOCK_S)
            for sb in range(N_SUB):
                off = sb * BLOCK_S + ar
                pos = jt * L_SEL + off
                ok = (peel > 0) & (off < L_SEL) & (pos <= t) & (pos < S)
                kt = tl.trans(sel_tile(KD, row + sb * BLOCK_S, h, BLOCK_S, BLOCK_DK))
                vv = tl.where(ok[:, None], sel_tile(VD, row + sb * BLOCK_S, h, BLOCK_S, BLOCK_DV), 0.0)
                m_i, l_i, acc = _online(q, kt, vv, ok, m_i, l_i, acc, scale_log2, PREC)
    # One flat loop, so that the next block's loads overlap. The update is _online's, written out so that the
    # value tile is loaded after the scores: 96 registers a thread against 108 through _online (ptxas, sm_90a).
    # It ends at the last valid slot: a row before token n_sel * l_sel has fewer blocks than slots (-1 after).
    slots = tl.arange(0, BLOCK_N)
    ids = tl.load(IDX + r * si_n + h * si_h + slots, mask=slots < N_SEL, other=-1)
    n_live = tl.max(tl.where(ids >= 0, slots + 1, 0), 0)
    for i in range(n_live * N_SUB):
        s = i // N_SUB
        sb = i % N_SUB
        j = tl.load(IDX + r * si_n + h * si_h + s).to(tl.int64)
        off = sb * BLOCK_S + ar
        pos = j * L_SEL + off
        ok = (j >= 0) & (off < L_SEL) & (pos <= t) & (pos < S)
        if TMA:
            ok = ok & (j < skip)
            row = tl.where((j >= 0) & (j < skip), k0 + j * L_SEL + sb * BLOCK_S, -BLOCK_S)
            kt = tl.trans(sel_tile(KD, row, h, BLOCK_S, BLOCK_DK))
        else:
            kt = tl.load(K + (k0 + pos)[None, :] * sk_n + h * sk_h + dk[:, None],
                         mask=ok[None, :] & (dk[:, None] < DK), other=0.0)
        qk = tl.dot(q, kt, input_precision=PREC) * scale_log2
        qk = tl.where(ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if TMA:
            vv = sel_tile(VD, row, h, BLOCK_S, BLOCK_DV)
        else:
            vv = tl.load(V + (k0 + pos)[:, None] * sv_n + h * sv_h + dv[None, :],
                         mask=ok[:, None] & (dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision=PREC)
        m_i = m_new
    o = acc / l_i[:, None]
    off = r * so_n + heads[:, None] * so_h + dv[None, :]
    omask = mg[:, None] & (dv[None, :] < DV)
    if GATED:  # Eq. 5 in the epilogue: O is the layer's output (O_CMP/O_WIN share its strides)
        o = gate_rows(o, OC, OW, GT, off, r * sg_n + heads * 3, mg, omask)
    tl.store(O + off, o.to(O.dtype.element_ty), mask=omask)
    tl.store(LSE + r * sl_n + heads, m_i + tl.log2(l_i), mask=mg)


@triton.jit
def bwd_dq_kernel(
    Q, K, V, DO, IDX, LSE, DELTA, DQ, ROW_SEQ, CU_Q, CU_K,
    sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sd_n, sd_h, si_n, si_h, sl_n, sdq_n, sdq_h,
    q_start, scale_log2, scale,
    G: tl.constexpr, N_SEL: tl.constexpr, L_SEL: tl.constexpr, N_SUB: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    PREC: tl.constexpr,
):
    """The query-outer backward's dq: grid (query rows, key/value heads), dq of the row's G heads over its
    selected blocks (the block-outer kernel writes dk and dv).

    Arguments:
        Tensors and strides as :func:`_backward` passes them; constexprs as :func:`fwd_q_kernel`.
    """
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    seq = tl.load(ROW_SEQ + r).to(tl.int64)
    q0, k0, S = _seq_bounds(CU_Q, CU_K, seq)
    t = q_start + (r - q0)

    g = tl.arange(0, BLOCK_G)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    ar = tl.arange(0, BLOCK_S)
    mg = g < G
    heads = h * G + g
    q = tl.load(Q + r * sq_n + heads[:, None] * sq_h + dk[None, :], mask=mg[:, None] & (dk[None, :] < DK), other=0.0)
    do = tl.load(DO + r * sd_n + heads[:, None] * sd_h + dv[None, :], mask=mg[:, None] & (dv[None, :] < DV), other=0.0)
    lse = tl.load(LSE + r * sl_n + heads, mask=mg, other=0.0)
    delta = tl.load(DELTA + r * sl_n + heads, mask=mg, other=0.0)

    dq = tl.zeros([BLOCK_G, BLOCK_DK], tl.float32)
    for i in range(N_SEL * N_SUB):  # one flat loop, so that the next block's loads overlap
        s = i // N_SUB
        sb = i % N_SUB
        j = tl.load(IDX + r * si_n + h * si_h + s).to(tl.int64)
        off = sb * BLOCK_S + ar
        pos = j * L_SEL + off
        ok = (j >= 0) & (off < L_SEL) & (pos <= t) & (pos < S)
        kk = tl.load(K + (k0 + pos)[:, None] * sk_n + h * sk_h + dk[None, :],
                     mask=ok[:, None] & (dk[None, :] < DK), other=0.0)
        vt = tl.load(V + (k0 + pos)[None, :] * sv_n + h * sv_h + dv[:, None],
                     mask=ok[None, :] & (dv[:, None] < DV), other=0.0)
        qk = tl.dot(q, tl.trans(kk), input_precision=PREC) * scale_log2
        p = tl.where(ok[None, :], tl.exp2(qk - lse[:, None]), 0.0)
        dp = tl.dot(do, vt, input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kk.dtype), kk, input_precision=PREC)
    tl.store(DQ + r * sdq_n + heads[:, None] * sdq_h + dk[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=mg[:, None] & (dk[None, :] < DK))


# ------------------------------------------------------------------------------------------------
# Block-outer kernels: one program per chunk of the queries that selected one (seq, head, block).
# Rows of the tile = BLOCK_Q queries x GP heads (GP = G rounded up to a power of two).
# ------------------------------------------------------------------------------------------------
@triton.jit
def _fwd_kv_tile(e0, e_end, q0, h, pos, kok, kt, vv, Q, OPART, LPART, ENT_ROW, ENT_SLOT,
                 sq_n, sq_h, sop_n, sop_h, sop_s, slp_n, slp_h, part_row0, q_start, scale_log2,
                 G: tl.constexpr, GP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_Q: tl.constexpr,
                 BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, PREC: tl.constexpr):
    """Rows = BLOCK_Q entries x GP heads: partial attention of each row over this key block, stored
    at partial row r - part_row0 (the partials hold the rows of one chunk)."""
    rows = tl.arange(0, BLOCK_Q * GP)
    g = rows % GP
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    e = e0 + rows // GP
    rok = (e < e_end) & (g < G)
    r = tl.load(ENT_ROW + e, mask=rok, other=0).to(tl.int64)
    slot = tl.load(ENT_SLOT + e, mask=rok, other=0).to(tl.int64)
    t = q_start + (r - q0)
    hq = h * G + g
    q = tl.load(Q + r[:, None] * sq_n + hq[:, None] * sq_h + dk[None, :], mask=rok[:, None] & (dk[None, :] < DK), other=0.0)
    qk = tl.dot(q, kt, input_precision=PREC) * scale_log2
    ok = kok[None, :] & (pos[None, :] <= t[:, None]) & rok[:, None]
    qk = tl.where(ok, qk, float("-inf"))
    m = tl.max(qk, 1)
    m = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp2(qk - m[:, None])
    l = tl.sum(p, 1)
    o = tl.dot(p.to(vv.dtype), vv, input_precision=PREC)
    o = o / tl.where(l == 0.0, 1.0, l)[:, None]
    rp = r - part_row0
    tl.store(OPART + rp[:, None] * sop_n + hq[:, None] * sop_h + slot[:, None] * sop_s + dv[None, :],
             o.to(OPART.dtype.element_ty), mask=rok[:, None] & (dv[None, :] < DV))
    tl.store(LPART + rp * slp_n + hq * slp_h + slot, m + tl.log2(l), mask=rok)


@triton.jit
def fwd_kv_kernel(
    Q, K, V, OPART, LPART, ENT_ROW, ENT_SLOT, ITEM_KEY, ITEM_START, ITEM_END, CU_Q, CU_K,
    sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sop_n, sop_h, sop_s, slp_n, slp_h, part_row0,
    q_start, scale_log2, H, NB,
    G: tl.constexpr, GP: tl.constexpr, L_SEL: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    PREC: tl.constexpr, INTERP: tl.constexpr,
):
    """The block-outer forward: one program per plan item (a key/value block and the query rows that
    selected it), writing per-slot partials (OPART, LPART) that :func:`combine_kernel` merges.

    Arguments:
        Tensors, the plan's tables and strides as :func:`_forward` passes them; ``part_row0``: the first row
        of this chunk of partials; H, NB: key/value heads and selection blocks; constexprs: tile sizes.
    """
    it = tl.program_id(0).to(tl.int64)
    key = tl.load(ITEM_KEY + it).to(tl.int64)
    e_beg = tl.load(ITEM_START + it).to(tl.int64)
    e_end = tl.load(ITEM_END + it).to(tl.int64)
    if e_beg >= e_end:  # an item past the plan's real count (``_plan_items``)
        return
    j = key % NB
    h = (key // NB) % H
    seq = key // (NB * H)
    q0, k0, S = _seq_bounds(CU_Q, CU_K, seq)

    kl = tl.arange(0, BLOCK_L)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    pos = j * L_SEL + kl
    # Tokens up to the item's last query (its entries are in ascending row order): the block is loaded
    # once for all of them, so a token past every one of their positions is never loaded (0 x NaN is NaN).
    t_last = q_start + (tl.load(ENT_ROW + e_end - 1).to(tl.int64) - q0)
    kok = (kl < L_SEL) & (pos < S) & (pos <= t_last)
    kt = tl.load(K + (k0 + pos)[None, :] * sk_n + h * sk_h + dk[:, None], mask=kok[None, :] & (dk[:, None] < DK), other=0.0)
    vv = tl.load(V + (k0 + pos)[:, None] * sv_n + h * sv_h + dv[None, :], mask=kok[:, None] & (dv[None, :] < DV), other=0.0)
    if INTERP:  # the interpreter cannot range() over loaded scalars; compiled code wants a for loop
        e0 = e_beg
        while e0 < e_end:
            _fwd_kv_tile(e0, e_end, q0, h, pos, kok, kt, vv, Q, OPART, LPART, ENT_ROW, ENT_SLOT,
                         sq_n, sq_h, sop_n, sop_h, sop_s, slp_n, slp_h, part_row0, q_start, scale_log2,
                         G, GP, DK, DV, BLOCK_Q, BLOCK_DK, BLOCK_DV, PREC)
            e0 += BLOCK_Q
    else:
        for e0 in range(e_beg, e_end, BLOCK_Q):
            _fwd_kv_tile(e0, e_end, q0, h, pos, kok, kt, vv, Q, OPART, LPART, ENT_ROW, ENT_SLOT,
                         sq_n, sq_h, sop_n, sop_h, sop_s, slp_n, slp_h, part_row0, q_start, scale_log2,
                         G, GP, DK, DV, BLOCK_Q, BLOCK_DK, BLOCK_DV, PREC)


@triton.jit
def combine_kernel(
    OPART, LPART, O, LSE, OC, OW, GT, n_rows, HQ,
    sop_n, sop_h, sop_s, slp_n, slp_h, so_n, so_h, sl_n, sg_n,
    N_SEL: tl.constexpr, DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
    GATED: tl.constexpr,
):
    """Merge the per-slot partial outputs of each (query row, head): o = sum_s 2^(lse_s - lse) o_s
    (GATED: then Eq. 5 with the other two branches, as in ``fwd_q_kernel``)."""
    pid = tl.program_id(0).to(tl.int64)
    rr = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rok = rr < n_rows
    r = rr // HQ
    hq = rr % HQ
    sl = tl.arange(0, BLOCK_N)
    dv = tl.arange(0, BLOCK_DV)
    lp = tl.load(LPART + r[:, None] * slp_n + hq[:, None] * slp_h + sl[None, :],
                 mask=rok[:, None] & (sl[None, :] < N_SEL), other=float("-inf"))
    m = tl.max(lp, 1)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lp - m[:, None])
    wsum = tl.sum(w, 1)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    for s in range(N_SEL):
        ls = tl.load(LPART + r * slp_n + hq * slp_h + s, mask=rok, other=float("-inf"))
        ws = tl.exp2(ls - m)
        live = rok & (ls > float("-inf"))
        os_ = tl.load(OPART + r[:, None] * sop_n + hq[:, None] * sop_h + s * sop_s + dv[None, :],
                      mask=live[:, None] & (dv[None, :] < DV), other=0.0)
        acc += ws[:, None] * os_
    o = acc / wsum[:, None]
    off = r[:, None] * so_n + hq[:, None] * so_h + dv[None, :]
    omask = rok[:, None] & (dv[None, :] < DV)
    if GATED:
        o = gate_rows(o, OC, OW, GT, off, r * sg_n + hq * 3, rok, omask)
    tl.store(O + off, o.to(O.dtype.element_ty), mask=omask)
    tl.store(LSE + r * sl_n + hq, m + tl.log2(wsum), mask=rok)


@triton.jit
def _bwd_kv_tile(e0, e_end, q0, h, pos, kok, kk, vv, acc_dk, acc_dv, Q, DO, LSE, DELTA, DQPART, ENT_ROW, ENT_SLOT,
                 sq_n, sq_h, sd_n, sd_h, sl_n, sdq_n, sdq_h, sdq_s, dq_row0, q_start, scale_log2, scale,
                 G: tl.constexpr, GP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_Q: tl.constexpr,
                 BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, WRITE_DQ: tl.constexpr, PREC: tl.constexpr):
    rows = tl.arange(0, BLOCK_Q * GP)
    g = rows % GP
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    e = e0 + rows // GP
    rok = (e < e_end) & (g < G)
    r = tl.load(ENT_ROW + e, mask=rok, other=0).to(tl.int64)
    t = q_start + (r - q0)
    hq = h * G + g
    q = tl.load(Q + r[:, None] * sq_n + hq[:, None] * sq_h + dk[None, :], mask=rok[:, None] & (dk[None, :] < DK), other=0.0)
    do = tl.load(DO + r[:, None] * sd_n + hq[:, None] * sd_h + dv[None, :], mask=rok[:, None] & (dv[None, :] < DV), other=0.0)
    lse = tl.load(LSE + r * sl_n + hq, mask=rok, other=0.0)
    delta = tl.load(DELTA + r * sl_n + hq, mask=rok, other=0.0)
    qk = tl.dot(q, tl.trans(kk), input_precision=PREC) * scale_log2
    ok = kok[None, :] & (pos[None, :] <= t[:, None]) & rok[:, None]
    p = tl.where(ok, tl.exp2(qk - lse[:, None]), 0.0)
    acc_dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
    dp = tl.dot(do, tl.trans(vv), input_precision=PREC)
    ds = (p * (dp - delta[:, None])).to(q.dtype)
    acc_dk += tl.dot(tl.trans(ds), q, input_precision=PREC)
    if WRITE_DQ:
        slot = tl.load(ENT_SLOT + e, mask=rok, other=0).to(tl.int64)
        dq = tl.dot(ds, kk, input_precision=PREC) * scale
        tl.store(DQPART + (r - dq_row0)[:, None] * sdq_n + hq[:, None] * sdq_h + slot[:, None] * sdq_s + dk[None, :],
                 dq.to(DQPART.dtype.element_ty), mask=rok[:, None] & (dk[None, :] < DK))
    return acc_dk, acc_dv


@triton.jit
def bwd_kv_kernel(
    Q, K, V, DO, LSE, DELTA, DK32, DV32, DQPART, ENT_ROW, ENT_SLOT, ITEM_KEY, ITEM_START, ITEM_END, CU_Q, CU_K,
    sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sd_n, sd_h, sl_n, sdk_n, sdk_h, sdv_n, sdv_h, sdq_n, sdq_h, sdq_s, dq_row0,
    q_start, scale_log2, scale, H, NB,
    G: tl.constexpr, GP: tl.constexpr, L_SEL: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    WRITE_DQ: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr,
):
    """The block-outer backward: one program per plan item, accumulating dk and dv of its block (float32,
    atomics) and, with WRITE_DQ, per-slot dq partials that :func:`dq_combine_kernel` sums.

    Arguments:
        Tensors, the plan's tables and strides as :func:`_backward` passes them; as :func:`fwd_kv_kernel`.
    """
    it = tl.program_id(0).to(tl.int64)
    key = tl.load(ITEM_KEY + it).to(tl.int64)
    e_beg = tl.load(ITEM_START + it).to(tl.int64)
    e_end = tl.load(ITEM_END + it).to(tl.int64)
    if e_beg >= e_end:  # an item past the plan's real count (``_plan_items``)
        return
    j = key % NB
    h = (key // NB) % H
    seq = key // (NB * H)
    q0, k0, S = _seq_bounds(CU_Q, CU_K, seq)

    kl = tl.arange(0, BLOCK_L)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    pos = j * L_SEL + kl
    kok = (kl < L_SEL) & (pos < S)
    kk = tl.load(K + (k0 + pos)[:, None] * sk_n + h * sk_h + dk[None, :], mask=kok[:, None] & (dk[None, :] < DK), other=0.0)
    vv = tl.load(V + (k0 + pos)[:, None] * sv_n + h * sv_h + dv[None, :], mask=kok[:, None] & (dv[None, :] < DV), other=0.0)
    acc_dk = tl.zeros([BLOCK_L, BLOCK_DK], tl.float32)
    acc_dv = tl.zeros([BLOCK_L, BLOCK_DV], tl.float32)
    if INTERP:  # the interpreter cannot range() over loaded scalars; compiled code wants a for loop
        e0 = e_beg
        while e0 < e_end:
            acc_dk, acc_dv = _bwd_kv_tile(
                e0, e_end, q0, h, pos, kok, kk, vv, acc_dk, acc_dv, Q, DO, LSE, DELTA, DQPART, ENT_ROW, ENT_SLOT,
                sq_n, sq_h, sd_n, sd_h, sl_n, sdq_n, sdq_h, sdq_s, dq_row0, q_start, scale_log2, scale,
                G, GP, DK, DV, BLOCK_Q, BLOCK_DK, BLOCK_DV, WRITE_DQ, PREC)
            e0 += BLOCK_Q
    else:
        for e0 in range(e_beg, e_end, BLOCK_Q):
            acc_dk, acc_dv = _bwd_kv_tile(
                e0, e_end, q0, h, pos, kok, kk, vv, acc_dk, acc_dv, Q, DO, LSE, DELTA, DQPART, ENT_ROW, ENT_SLOT,
                sq_n, sq_h, sd_n, sd_h, sl_n, sdq_n, sdq_h, sdq_s, dq_row0, q_start, scale_log2, scale,
                G, GP, DK, DV, BLOCK_Q, BLOCK_DK, BLOCK_DV, WRITE_DQ, PREC)
    tl.atomic_add(DK32 + (k0 + pos)[:, None] * sdk_n + h * sdk_h + dk[None, :], acc_dk * scale,
                  mask=kok[:, None] & (dk[None, :] < DK), sem="relaxed")
    tl.atomic_add(DV32 + (k0 + pos)[:, None] * sdv_n + h * sdv_h + dv[None, :], acc_dv,
                  mask=kok[:, None] & (dv[None, :] < DV), sem="relaxed")


@triton.jit
def dq_combine_kernel(
    DQPART, IDX, DQ, n_rows, HQ, NB,
    sdq_n, sdq_h, sdq_s, si_n, si_h, so_n, so_h,
    G: tl.constexpr, N_SEL: tl.constexpr, DK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DK: tl.constexpr,
):
    """dq = sum of the per-slot partials over the slots that hold a selected block."""
    pid = tl.program_id(0).to(tl.int64)
    rr = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rok = rr < n_rows
    r = rr // HQ
    hq = rr % HQ
    h = hq // G
    dk = tl.arange(0, BLOCK_DK)
    acc = tl.zeros([BLOCK_R, BLOCK_DK], tl.float32)
    for s in range(N_SEL):
        j = tl.load(IDX + r * si_n + h * si_h + s, mask=rok, other=-1)
        live = rok & (j >= 0) & (j < NB)
        acc += tl.load(DQPART + r[:, None] * sdq_n + hq[:, None] * sdq_h + s * sdq_s + dk[None, :],
                       mask=live[:, None] & (dk[None, :] < DK), other=0.0).to(tl.float32)
    tl.store(DQ + r[:, None] * so_n + hq[:, None] * so_h + dk[None, :], acc.to(DQ.dtype.element_ty),
             mask=rok[:, None] & (dk[None, :] < DK))


# ------------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------------
class _Layout:
    """Packed-token view of the batched and the varlen layouts (one sequence per batch row, or documents).

    q ``[Nq,HQ,Dk]``, k/v ``[Nk,H,D]``, indices ``[Nq,H,n_sel]``; sequence i owns query rows
    cu_q[i]..cu_q[i+1] and key rows cu_k[i]..cu_k[i+1]; query row r of sequence i sits at
    position q_start + r - cu_q[i] and its block j covers key rows cu_k[i] + [j*l_sel, (j+1)*l_sel).
    """

    def __init__(self, cu_q, cu_k, row_seq, q_start, n_blocks):
        self.cu_q, self.cu_k, self.row_seq = cu_q, cu_k, row_seq
        self.q_start, self.n_blocks = int(q_start), int(n_blocks)


def _block_outer_plan(idx, lay, H, G, chunk_rows, row0: int = 0):
    """Invert the selection: for each (seq, head, block), the (query row, slot) pairs that chose it.
    ``idx`` holds the query rows row0.. (the entries name rows of the whole tensor).

    Returns entry arrays sorted by segment key = (seq*H + h)*NB + j (query rows ascending inside a
    segment: the sort is stable) and work items, each at most ``chunk_rows // G`` entries of one
    segment. No host sync: the item arrays have ``_plan_items`` entries (a bound known from the shapes);
    those past the real count are empty (start = end = 0) and their programs return at once.
    """
    n_sel = idx.shape[2]
    dev = idx.device
    NB = max(lay.n_blocks, 1)
    n_seg = (int(lay.cu_q.numel()) - 1) * H * NB
    kdt = torch.int32 if n_seg < 2**31 - 1 else torch.int64
    h = torch.arange(H, device=dev, dtype=kdt)[None, :, None]
    j = idx.to(kdt)
    valid = (j >= 0) & (j < NB)
    key = (lay.row_seq[row0:row0 + idx.shape[0]].to(kdt)[:, None, None] * H + h) * NB + j
    key = torch.where(valid, key, torch.full_like(key, n_seg)).flatten()  # invalid entries sort last
    skey, order = torch.sort(key, stable=True)
    # segment ends by binary search in the sorted keys (a histogram's atomics on 16M keys cost 0.6 ms at
    # 16k tokens, G=1); the invalid entries (key n_seg) lie past the last segment
    seg_end = torch.searchsorted(skey, torch.arange(1, n_seg + 1, device=dev, dtype=kdt))
    counts = torch.diff(seg_end, prepend=seg_end.new_zeros(1))
    seg_start = seg_end - counts
    ent_row = (order // (H * n_sel) + row0).to(torch.int32)
    ent_slot = (order % n_sel).to(torch.int32)
    per = max(1, chunk_rows // G)
    n_items = _plan_items(idx.numel(), n_seg, per)
    n_chunks = (counts + per - 1) // per
    chunk_end = torch.cumsum(n_chunks, 0)
    i = torch.arange(n_items, device=dev)
    item_seg = torch.searchsorted(chunk_end, i.to(chunk_end.dtype), right=True)  # the segment whose chunks hold i
    live = item_seg < n_seg
    seg = item_seg.clamp(max=max(n_seg - 1, 0)).long()
    item_start = seg_start[seg].long() + (i - (chunk_end - n_chunks)[seg]) * per
    item_end = torch.minimum(item_start + per, seg_end[seg].long())
    zero = torch.zeros_like(item_start)
    return dict(ent_row=ent_row, ent_slot=ent_slot, item_key=torch.where(live, seg, zero),
                item_start=torch.where(live, item_start, zero), item_end=torch.where(live, item_end, zero),
                n_items=n_items)


def _plan_items(n_entries, n_seg, per):
    """Work items of a block-outer plan, at most: a segment of c entries takes ceil(c / per) items, and the
    segments hold at most ``n_entries``, so the sum is at most n_entries // per + n_seg."""
    return n_entries // per + n_seg if n_entries else 0


def _choose_mode(tune, G, l_sel, n_rows):
    """The kernel family: ``tune["mode"]``, where "auto" takes block-outer for G < 16 (where small
    groups leave query-outer tiles mostly empty; BENCHMARKS.md, "Tuning choices") and query-outer for
    G >= 16 or for few query rows (decode: the block-outer plan costs a sort and a grid sized for the worst
    case). Long inputs run block-outer in row chunks (``_part_rows``)."""
    mode = tune["mode"]
    if mode == "auto":
        mode = "block" if G < 16 and n_rows >= 512 else "query"
    if mode == "block" and l_sel > 128:
        mode = "query"  # a whole selection block is one tile in the block-outer kernels
    return mode


def _part_budget(tune, device):
    """``part_bytes_max``, where None: 8 GiB, at most an eighth of the GPU's memory (a 24 GB card
    keeps 3 GB of partials, 80 GB and larger cards 8 GiB)."""
    if tune["part_bytes_max"] is not None:
        return tune["part_bytes_max"]
    if device.type != "cuda":
        return 8 << 30
    return min(8 << 30, _gpu_memory(device) // 8)


@assume_constant_result  # torch.compile: asked when tracing, a constant of the graph
def _gpu_memory(device) -> int:
    return torch.cuda.get_device_properties(device).total_memory


def _part_rows(n_rows, row_bytes, tune):
    """Query rows per chunk of the block-outer kernels: their per-slot partials (``row_bytes`` a row)
    fit ``part_bytes_max``."""
    return max(1, min(n_rows, tune["part_bytes_max"] // row_bytes))


def tile_meta(Dk, Dv, l_sel, block_s):
    """The query-outer kernels' key tiles.

    Arguments:
        Dk, Dv: head dims; l_sel: the selection block length; block_s: the tuned key tile.

    Returns:
        ``{BLOCK_S, N_SUB, BLOCK_DK, BLOCK_DV}``: the tile (at most l_sel, >= 16), tiles per block, and the
        head dims' power-of-2 tiles (>= 16).
    """
    BLOCK_S = min(block_s, p2(l_sel, 16))
    return dict(BLOCK_S=BLOCK_S, N_SUB=triton.cdiv(l_sel, BLOCK_S), BLOCK_DK=p2(Dk, 16), BLOCK_DV=p2(Dv, 16))


def kv_descriptors(tune, k, v, l_sel):
    """TMA descriptors of k, v [Nk, H, D] for the query-outer forward's key tiles (its dq kernel keeps
    pointer loads, which timed faster there: BENCHMARKS.md), or (None, None) where
    ``tune["tma"]`` is off or the tensors do not qualify (``utils.tma_ok``; packed documents qualify:
    the kernel loads through them only whole blocks at or before the row's token), or where a key tile
    would reach past its block (``l_sel`` not a multiple of the tile: l_sel < 16)."""
    block_s = tile_meta(k.shape[2], v.shape[2], l_sel, tune["block_s"])["BLOCK_S"]
    if l_sel % block_s or not tma_ok(tune["tma"], None, 1, 1, k, v):
        return None, None
    return (descriptor(k, [block_s, 1, p2(k.shape[2], 16)]), descriptor(v, [block_s, 1, p2(v.shape[2], 16)]))


def block_q(G, Dmax, rows):
    """(GP, BLOCK_Q): rows of a block-outer tile = BLOCK_Q queries x GP heads."""
    GP = triton.next_power_of_2(G)
    rows = rows if Dmax <= 128 else min(rows, 32)
    return GP, max(1, rows // GP)


def bwd_launch(tune, G, itemsize, write_dq):
    """Rows, warps and stages of the block-outer backward: the table's, or where None the values measured
    fastest on an H100 at 8k-64k (BENCHMARKS.md, "Tuning choices"): 64 rows of 4 warps for G >= 16 without
    dq partials (the dk/dv pass beside the query-outer dq), else 128 rows of 8 warps; 3 stages for 16-bit
    inputs, 2 for 32-bit (whose tiles take twice the shared memory)."""
    big = G >= 16 and not write_dq
    return dict(rows=tune["bwd_rows"] or (64 if big else 128), warps=tune["bwd_warps"] or (4 if big else 8),
                stages=tune["bwd_stages"] or (2 if itemsize > 2 else 3))


def _part_dtype(dtype):
    """Partial outputs / dq partials: 16-bit inputs keep 16-bit partials (halves their traffic)."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32


def _forward(q, k, v, idx, lay, scale, l_sel, mode, tune, gated=None):
    """o, lse, plan. ``gated`` = (o_cmp [Nq,HQ,Dv], o_win (o's layout), gates [Nq,HQ,3]), all
    contiguous: o is then Eq. 5's gated sum, computed in the epilogue (lse stays the branch's own)."""
    Nq, HQ, Dk = q.shape
    H, Dv = k.shape[1], v.shape[2]
    G = HQ // H
    n_sel = idx.shape[2]
    o = empty((Nq, HQ, Dv), q)
    lse = empty((Nq, HQ), q, torch.float32)
    oc, ow, gt = gated if gated is not None else (o, o, lse)  # unread when not GATED
    prec = dot_precision(q.dtype)
    scale_log2 = scale * LOG2E
    plan = None
    if Nq == 0:
        return o, lse, plan
    if mode == "query":
        kd, vd = kv_descriptors(tune, k, v, l_sel)
        # through descriptors: whether every value is finite (a device flag: no sync, graph-safe)
        fin = torch.isfinite(v).all().to(torch.int32) if kd is not None else lse
        fwd_q_kernel[(Nq, H)](
            Q=q,
            K=k,
            V=v,
            KD=kd,
            VD=vd,
            FIN=fin,
            IDX=idx,
            O=o,
            LSE=lse,
            ROW_SEQ=lay.row_seq,
            CU_Q=lay.cu_q,
            CU_K=lay.cu_k,
            OC=oc,
            OW=ow,
            GT=gt,
            sq_n=q.stride(0),
            sq_h=q.stride(1),
            sk_n=k.stride(0),
            sk_h=k.stride(1),
            sv_n=v.stride(0),
            sv_h=v.stride(1),
            si_n=idx.stride(0),
            si_h=idx.stride(1),
            so_n=o.stride(0),
            so_h=o.stride(1),
            sl_n=lse.stride(0),
            sg_n=gt.stride(0),
            q_start=lay.q_start,
            scale_log2=scale_log2,
            G=G,
            N_SEL=n_sel,
            L_SEL=l_sel,
            DK=Dk,
            DV=Dv,
            BLOCK_G=p2(G, 16),
            PREC=prec,
            GATED=gated is not None,
            TMA=kd is not None,
            BLOCK_N=p2(n_sel, 2),
            num_warps=tune["warps"],
            num_stages=tune["stages"],
            **tile_meta(Dk, Dv, l_sel, tune["block_s"]),
        )
        return o, lse, plan
    GP, BQ = block_q(G, max(Dk, Dv), tune["rows"] or (128 if G == 1 else 64))
    # Per-slot partials of at most part_bytes_max: query rows in chunks, each with its own plan (the
    # plan of a single chunk is kept for the backward).
    rows = _part_rows(Nq, HQ * n_sel * Dv * q.element_size(), tune)
    for r0 in range(0, Nq, rows):
        r1 = min(Nq, r0 + rows)
        plan = _block_outer_plan(idx[r0:r1], lay, H, G, tune["chunk_rows"], row0=r0)
        opart = empty((r1 - r0, HQ, n_sel, Dv), q, _part_dtype(q.dtype))
        lpart = torch.full((r1 - r0, HQ, n_sel), float("-inf"), device=q.device, dtype=torch.float32)
        if plan["n_items"]:
            fwd_kv_kernel[(plan["n_items"],)](
                Q=q,
                K=k,
                V=v,
                OPART=opart,
                LPART=lpart,
                ENT_ROW=plan["ent_row"],
                ENT_SLOT=plan["ent_slot"],
                ITEM_KEY=plan["item_key"],
                ITEM_START=plan["item_start"],
                ITEM_END=plan["item_end"],
                CU_Q=lay.cu_q,
                CU_K=lay.cu_k,
                sq_n=q.stride(0),
                sq_h=q.stride(1),
                sk_n=k.stride(0),
                sk_h=k.stride(1),
                sv_n=v.stride(0),
                sv_h=v.stride(1),
                sop_n=opart.stride(0),
                sop_h=opart.stride(1),
                sop_s=opart.stride(2),
                slp_n=lpart.stride(0),
                slp_h=lpart.stride(1),
                part_row0=r0,
                q_start=lay.q_start,
                scale_log2=scale_log2,
                H=H,
                NB=max(lay.n_blocks, 1),
                G=G,
                GP=GP,
                L_SEL=l_sel,
                DK=Dk,
                DV=Dv,
                BLOCK_Q=BQ,
                BLOCK_L=p2(l_sel, 16),
                BLOCK_DK=p2(Dk, 16),
                BLOCK_DV=p2(Dv, 16),
                PREC=prec,
                INTERP=interpreted(q),
                num_warps=tune["kv_warps"],
                num_stages=tune["kv_stages"] or (2 if G == 1 else 3),
            )
        BLOCK_R = 16
        n_rows = (r1 - r0) * HQ
        o_c, lse_c, oc_c, ow_c, gt_c = (x[r0:r1] for x in (o, lse, oc, ow, gt))
        combine_kernel[(triton.cdiv(n_rows, BLOCK_R),)](
            OPART=opart,
            LPART=lpart,
            O=o_c,
            LSE=lse_c,
            OC=oc_c,
            OW=ow_c,
            GT=gt_c,
            n_rows=n_rows,
            HQ=HQ,
            sop_n=opart.stride(0),
            sop_h=opart.stride(1),
            sop_s=opart.stride(2),
            slp_n=lpart.stride(0),
            slp_h=lpart.stride(1),
            so_n=o.stride(0),
            so_h=o.stride(1),
            sl_n=lse.stride(0),
            sg_n=gt.stride(0),
            N_SEL=n_sel,
            DV=Dv,
            BLOCK_R=BLOCK_R,
            BLOCK_N=p2(n_sel, 2),
            BLOCK_DV=p2(Dv, 16),
            GATED=gated is not None,
            num_warps=4,
        )
    if rows < Nq:
        plan = None
    return o, lse, plan


def _backward(do, q, k, v, o, lse, idx, lay, scale, l_sel, mode, plan, tune):
    Nq, HQ, Dk = q.shape
    Nk, H, Dv = v.shape
    G = HQ // H
    n_sel = idx.shape[2]
    do = do.contiguous()
    prec = dot_precision(q.dtype)
    scale_log2 = scale * LOG2E
    delta = row_dot(do, o)  # [Nq,HQ]: rowsum(dO * O)
    dk32 = torch.zeros(Nk, H, Dk, device=q.device, dtype=torch.float32)
    dv32 = torch.zeros(Nk, H, Dv, device=q.device, dtype=torch.float32)
    if Nq == 0:
        return torch.zeros_like(q), dk32.to(k.dtype), dv32.to(v.dtype)
    # dq per slot from the block-outer kernel (no query-outer dq pass): always after a block-outer
    # forward, after a query-outer one when the partials fit; they need Nq*HQ*n_sel*Dk 16-bit values
    # (BENCHMARKS.md, "Tuning choices"), in row chunks of at most part_bytes_max. Head dims over 128 always
    # take this path, in row chunks whose partials fit: compiled by triton 3.6 for the H200, the
    # block-outer kernel without its dq store (BLOCK_DK = 256) returned wrong dK (rel-L2 0.09-0.27
    # against the reference; BENCHMARKS.md, "Validation"), with the store it matches.
    part_row = HQ * n_sel * Dk * q.element_size()
    write_dq = tune["dq_part"]
    if write_dq is False and p2(Dk, 16) > 128 and not interpreted(q):
        raise ValueError(f"tuning selection.dq_part=False: not for head dims over 128 (Dk={Dk}) on a GPU "
                         "(the kernel without its dq store returned wrong dK there); use None or True")
    if write_dq is None:
        write_dq = mode == "block" or Nq * part_row <= tune["part_bytes_max"] or p2(Dk, 16) > 128
    rows = Nq if not write_dq else _part_rows(Nq, part_row, tune)
    bwd = bwd_launch(tune, G, q.element_size(), write_dq)
    GP, BQ = block_q(G, max(Dk, Dv), bwd["rows"])
    dq = empty(q.shape, q)
    for r0 in range(0, Nq, rows):
        r1 = min(Nq, r0 + rows)
        if (r0, r1) != (0, Nq) or plan is None:
            plan = _block_outer_plan(idx[r0:r1], lay, H, G, tune["chunk_rows"], row0=r0)
        # dq per (row, head, slot) of rows r0..r1, summed by dq_combine_kernel over the live slots only
        dqpart = empty((r1 - r0, HQ, n_sel, Dk), q, _part_dtype(q.dtype)) if write_dq else dk32
        if plan["n_items"]:
            bwd_kv_kernel[(plan["n_items"],)](
                Q=q,
                K=k,
                V=v,
                DO=do,
                LSE=lse,
                DELTA=delta,
                DK32=dk32,
                DV32=dv32,
                DQPART=dqpart,
                ENT_ROW=plan["ent_row"],
                ENT_SLOT=plan["ent_slot"],
                ITEM_KEY=plan["item_key"],
                ITEM_START=plan["item_start"],
                ITEM_END=plan["item_end"],
                CU_Q=lay.cu_q,
                CU_K=lay.cu_k,
                sq_n=q.stride(0),
                sq_h=q.stride(1),
                sk_n=k.stride(0),
                sk_h=k.stride(1),
                sv_n=v.stride(0),
                sv_h=v.stride(1),
                sd_n=do.stride(0),
                sd_h=do.stride(1),
                sl_n=lse.stride(0),
                sdk_n=dk32.stride(0),
                sdk_h=dk32.stride(1),
                sdv_n=dv32.stride(0),
                sdv_h=dv32.stride(1),
                sdq_n=dqpart.stride(0),
                sdq_h=dqpart.stride(1),
                sdq_s=dqpart.stride(2) if write_dq else 0,
                dq_row0=r0,
                q_start=lay.q_start,
                scale_log2=scale_log2,
                scale=scale,
                H=H,
                NB=max(lay.n_blocks, 1),
                G=G,
                GP=GP,
                L_SEL=l_sel,
                DK=Dk,
                DV=Dv,
                BLOCK_Q=BQ,
                BLOCK_L=p2(l_sel, 16),
                BLOCK_DK=p2(Dk, 16),
                BLOCK_DV=p2(Dv, 16),
                WRITE_DQ=write_dq,
                PREC=prec,
                INTERP=interpreted(q),
                num_warps=bwd["warps"],
                num_stages=bwd["stages"],
            )
        if write_dq:
            BLOCK_R = 16
            n_rows = (r1 - r0) * HQ
            idx_c, dq_c = idx[r0:r1], dq[r0:r1]
            dq_combine_kernel[(triton.cdiv(n_rows, BLOCK_R),)](
                DQPART=dqpart,
                IDX=idx_c,
                DQ=dq_c,
                n_rows=n_rows,
                HQ=HQ,
                NB=max(lay.n_blocks, 1),
                sdq_n=dqpart.stride(0),
                sdq_h=dqpart.stride(1),
                sdq_s=dqpart.stride(2),
                si_n=idx_c.stride(0),
                si_h=idx_c.stride(1),
                so_n=dq_c.stride(0),
                so_h=dq_c.stride(1),
                G=G,
                N_SEL=n_sel,
                DK=Dk,
                BLOCK_R=BLOCK_R,
                BLOCK_DK=p2(Dk, 16),
                num_warps=4,
            )
    if not write_dq:
        bwd_dq_kernel[(Nq, H)](
            Q=q,
            K=k,
            V=v,
            DO=do,
            IDX=idx,
            LSE=lse,
            DELTA=delta,
            DQ=dq,
            ROW_SEQ=lay.row_seq,
            CU_Q=lay.cu_q,
            CU_K=lay.cu_k,
            sq_n=q.stride(0),
            sq_h=q.stride(1),
            sk_n=k.stride(0),
            sk_h=k.stride(1),
            sv_n=v.stride(0),
            sv_h=v.stride(1),
            sd_n=do.stride(0),
            sd_h=do.stride(1),
            si_n=idx.stride(0),
            si_h=idx.stride(1),
            sl_n=lse.stride(0),
            sdq_n=dq.stride(0),
            sdq_h=dq.stride(1),
            q_start=lay.q_start,
            scale_log2=scale_log2,
            scale=scale,
            G=G,
            N_SEL=n_sel,
            L_SEL=l_sel,
            DK=Dk,
            DV=Dv,
            BLOCK_G=p2(G, 16),
            PREC=prec,
            num_warps=tune["dq_warps"] or tune["warps"],
            num_stages=tune["dq_stages"] or tune["stages"],
            **tile_meta(Dk, Dv, l_sel, tune["block_s"]),
        )
    return dq, dk32.to(k.dtype), dv32.to(v.dtype)


_PLAN = ("ent_row", "ent_slot", "item_key", "item_start", "item_end")  # the plan's tensors, as op outputs


def _plan_kept(Nq, row_bytes, mode, tune) -> bool:
    """Whether :func:`_forward` returns its block-outer plan (for the backward): one chunk of rows only."""
    return mode == "block" and Nq > 0 and _part_rows(Nq, row_bytes, tune) >= Nq


def _selection_fwd_fake(q, k, v, idx, cu_q, cu_k, row_seq, q_start, n_blocks, scale, l_sel, mode, tune, o_cmp, o_win,
                        gates):
    Nq, HQ, _ = q.shape
    tune = tuning.from_ints("selection", tune)
    kept = _plan_kept(Nq, HQ * idx.shape[2] * v.shape[2] * q.element_size(), mode, tune)
    n_ent = Nq * idx.shape[1] * idx.shape[2] if kept else 0
    n_seg = (cu_q.shape[0] - 1) * k.shape[1] * max(n_blocks, 1)
    n_items = _plan_items(n_ent, n_seg, max(1, tune["chunk_rows"] // (HQ // k.shape[1]))) if kept else 0
    return (q.new_empty(Nq, HQ, v.shape[2]), q.new_empty(Nq, HQ, dtype=torch.float32),
            idx.new_empty(n_ent), idx.new_empty(n_ent), *(q.new_empty(n_items, dtype=torch.int64) for _ in range(3)))


@custom_op("nsa::selection_fwd", _selection_fwd_fake)
def _selection_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, cu_q: torch.Tensor,
                      cu_k: torch.Tensor, row_seq: torch.Tensor, q_start: int, n_blocks: int, scale: float, l_sel: int,
                      mode: str, tune: Sequence[int], o_cmp: Optional[torch.Tensor], o_win: Optional[torch.Tensor],
                      gates: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                              torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_forward` on the packed layout (``_Layout``'s fields), gated where o_cmp/o_win/gates are given:
    (o, lse, then the plan's ``_PLAN`` tensors, empty where none is kept); ``tune`` from ``tuning.to_ints``."""
    gated = None if o_cmp is None else (o_cmp, o_win, gates)
    o, lse, plan = _forward(q, k, v, idx, _Layout(cu_q, cu_k, row_seq, q_start, n_blocks), scale, l_sel, mode,
                            tuning.from_ints("selection", tune), gated=gated)
    if plan is None:
        plan = dict(ent_row=idx.new_empty(0), ent_slot=idx.new_empty(0), item_key=q.new_empty(0, dtype=torch.int64),
                    item_start=q.new_empty(0, dtype=torch.int64), item_end=q.new_empty(0, dtype=torch.int64))
    return (o, lse, *(plan[n] for n in _PLAN))


def _selection_bwd_fake(do, q, k, v, o, lse, idx, cu_q, cu_k, row_seq, q_start, n_blocks, scale, l_sel, mode, tune,
                        ent_row, ent_slot, item_key, item_start, item_end):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@custom_op("nsa::selection_bwd", _selection_bwd_fake)
def _selection_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                      lse: torch.Tensor, idx: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, row_seq: torch.Tensor,
                      q_start: int, n_blocks: int, scale: float, l_sel: int, mode: str, tune: Sequence[int],
                      ent_row: torch.Tensor, ent_slot: torch.Tensor, item_key: torch.Tensor, item_start: torch.Tensor,
                      item_end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_backward` of ``nsa::selection_fwd`` (same layout and parameters), reusing its plan where kept."""
    tune = tuning.from_ints("selection", tune)
    plan = None
    if _plan_kept(q.shape[0], q.shape[1] * idx.shape[2] * v.shape[2] * q.element_size(), mode, tune):
        plan = dict(zip(_PLAN, (ent_row, ent_slot, item_key, item_start, item_end)), n_items=item_key.shape[0])
    return _backward(do, q, k, v, o, lse, idx, _Layout(cu_q, cu_k, row_seq, q_start, n_blocks), scale, l_sel, mode,
                     plan, tune)


class _SelectedAttention(torch.autograd.Function):
    """The selected branch by the custom ops ``nsa::selection_fwd`` and ``nsa::selection_bwd`` (see the package
    docstring); ``args``: (q_start, n_blocks, scale, l_sel, mode, encoded tune). Returns o and the plan's
    tensors (not differentiable), which the backward reuses."""

    @staticmethod
    def forward(ctx, q, k, v, idx, cu_q, cu_k, row_seq, *args):
        o, lse, *plan = _selection_fwd_op(q, k, v, idx, cu_q, cu_k, row_seq, *args, None, None, None)
        ctx.save_for_backward(q, k, v, o, lse, idx, cu_q, cu_k, row_seq, *plan)
        ctx.args = args
        ctx.mark_non_differentiable(*plan)
        return (o, *plan)

    @staticmethod
    def backward(ctx, do, *_):
        q, k, v, o, lse, idx, cu_q, cu_k, row_seq, *plan = ctx.saved_tensors
        dq, dk, dv = _selection_bwd_op(do, q, k, v, o, lse, idx, cu_q, cu_k, row_seq, *ctx.args, *plan)
        return dq, dk, dv, *(None,) * (4 + len(ctx.args))


def _prepare(q, k, v, indices, config, scale):
    """(scale, kernel family, launch parameters, int32 indices) of one call (packed layout)."""
    HQ, H = q.shape[1], k.shape[1]
    if HQ % H:
        raise ValueError(f"selected_attention: {HQ} query heads not divisible by {H} key/value heads")
    tune = tuning.params("selection", q.device)
    tune["part_bytes_max"] = _part_budget(tune, q.device)
    mode = _choose_mode(tune, HQ // H, config.l_sel, q.shape[0])
    return default_scale(q, scale), mode, tune, indices.to(torch.int32).contiguous()


def _run(q, k, v, indices, lay, config, scale):
    scale, mode, tune, idx = _prepare(q, k, v, indices, config, scale)
    return _SelectedAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), idx, lay.cu_q, lay.cu_k, lay.row_seq,
                                    lay.q_start, lay.n_blocks, float(scale), config.l_sel, mode,
                                    tuning.to_ints("selection", tune))[0]


def _layout(q, k_sel, config, q_start, varlen):
    """The ``_Layout`` of [B, Tq] queries over [B, S] keys, or of packed documents (B = 1)."""
    if varlen is not None:
        cu = varlen.cu(q.device)
        return _Layout(cu, cu, varlen.row_doc(q.device), 0, varlen.n_blocks(config))
    B, Tq = q.shape[:2]
    S = k_sel.shape[1]
    ar = torch.arange(B + 1, device=q.device, dtype=torch.int32)
    return _Layout(ar * Tq, ar * S, torch.arange(B, device=q.device, dtype=torch.int32).repeat_interleave(Tq),
                   q_start, config.n_blocks(S))


def selected_attention(q, k_sel, v_sel, indices, config, *, scale=None, q_start: int = 0, varlen=None):
    """Selected branch; same contract as ``nsa.reference.selected_attention``."""
    B, Tq, HQ, Dk = q.shape
    S, H = k_sel.shape[1], k_sel.shape[2]
    o = _run(q.reshape(B * Tq, HQ, Dk), k_sel.reshape(B * S, H, Dk), v_sel.reshape(B * S, H, v_sel.shape[-1]),
             indices.reshape(B * Tq, H, indices.shape[-1]), _layout(q, k_sel, config, q_start, varlen), config, scale)
    return o.reshape(B, Tq, HQ, v_sel.shape[-1])


def selected_gated(q, k_sel, v_sel, indices, config, o_cmp, o_win, gates, *, scale=None, q_start: int = 0,
                   varlen=None):
    """The layer's output without autograd (prefill/inference): Eq. 5's gated sum
    ``g_cmp o_cmp + g_sel o_sel + g_win o_win`` with o_sel the selected branch of
    :func:`selected_attention` (same arguments), the sum done in float32 in the selection kernel's
    epilogue, so o_sel is never written. The reference equivalent is
    ``combine(o_cmp, selected_attention(...), o_win, gates)``. Raises if a gradient would be needed."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_sel, v_sel, o_cmp, o_win, gates)):
        raise RuntimeError("selected_gated: forward only (no autograd); use selected_attention and combine "
                           "when gradients are needed")
    B, Tq, HQ, Dk = q.shape
    S, H = k_sel.shape[1], k_sel.shape[2]
    Dv = v_sel.shape[-1]
    if o_cmp.shape != o_win.shape or tuple(o_cmp.shape) != (B, Tq, HQ, Dv):
        raise ValueError(f"selected_gated: o_cmp {tuple(o_cmp.shape)} and o_win {tuple(o_win.shape)} must both be "
                         f"[B,Tq,HQ,Dv] = {[B, Tq, HQ, Dv]}")
    if tuple(gates.shape) != (B, Tq, HQ, 3):
        raise ValueError(f"selected_gated: gates {tuple(gates.shape)} must be [B,Tq,HQ,3] = {[B, Tq, HQ, 3]}")
    qf, kf, vf = q.reshape(B * Tq, HQ, Dk), k_sel.reshape(B * S, H, Dk), v_sel.reshape(B * S, H, Dv)
    scale, mode, tune, idx = _prepare(qf, kf, vf, indices.reshape(B * Tq, H, indices.shape[-1]), config, scale)
    gated = tuple(x.reshape(B * Tq, HQ, x.shape[-1]).contiguous() for x in (o_cmp, o_win, gates))
    lay = _layout(q, k_sel, config, q_start, varlen)
    o = _selection_fwd_op(qf.contiguous(), kf.contiguous(), vf.contiguous(), idx, lay.cu_q, lay.cu_k, lay.row_seq,
                          lay.q_start, lay.n_blocks, float(scale), config.l_sel, mode, tuning.to_ints("selection", tune),
                          *gated)[0]
    return o.reshape(B, Tq, HQ, Dv)
