"""Triton kernels of the NSA decode step (one query per sequence) and their launcher.

Every launch reads the query positions from device memory (``pos_ptr``: one for the batch, or one per
sequence for ragged batches) and uses fixed grids and preallocated workspaces, so that one CUDA graph
serves every step. ``tuning.decode.mode`` picks the launches of a step:

``four`` (B*H fills the SMs, or more than 512 selection blocks):

1. ``dec_cmp_partial``  grid (B*H, NSC): split-KV compressed attention. Each program takes a
   slice of the visible compressed tokens (the slice length follows the position), computes the
   scores of the G heads of its group (log2 domain), keeps them in a scratch row for step 2, and
   writes its flash-decoding partial (running max m, sum l, unnormalized acc).
2. ``dec_cmp_topk``     grid (B*H,): combines the partials into o_cmp, turns the scratch scores
   into p_cmp (exactly softmax over the visible tokens), sums over the group (Eq. 10), weights by
   the block-aligned overlap (Eq. 9), forces initial/local blocks and takes the top-n (Eqs. 11-12,
   ties to the lower index; ``tuning.decode.topn``: a bitonic top-k, ``tl.topk``, where triton has
   it, else n_sel dependent argmaxes: the same blocks). Indices are written ascending, -1 padded.
3. ``dec_sv_partial``   grid (B*H, NS_SEL + NS_WIN): split-KV attention over the selected blocks
   (splits 0..NS_SEL-1) and over the window tokens (the rest), flash-decoding partials.
4. ``dec_combine``      grid (B*H,): combines the sel partials and the win partials separately,
   applies the gates and adds g_cmp * o_cmp.

``three`` (the default on a GPU while B*H*n_sel programs fit the SMs: the step is bound by latency, not
bytes):

1. ``dec_cw_partial``   grid (B*H, NSC + NS_WIN): the compressed pass's splits and, beside them,
   the window's (the window needs no top-n).
2. ``dec_sel_topn``     grid (B*H, NS_SEL): every program merges the compressed statistics, picks the
   group's top-n itself (the same blocks in each: no program waits for another) and attends to its
   selected blocks.
3. ``dec_combine3``     grid (B*H, combine_split): merges the three branches' partials and applies the gates
   (``tuning.decode.combine_split``: at B=1 a group's value dims are shared among programs).

``two`` (slower on the H100, BENCHMARKS.md): four's kernels in two launches, the program of a group
that finishes its pass last (an atomic count per group, released and acquired at GPU scope) running
step 2 after step 1, and step 4 after step 3, itself.

On sm_90+ (``tuning.decode.pdl``) the kernels launch with programmatic dependent launch: each kernel's
programs are launched while the previous kernel runs and wait for it (``griddepcontrol.wait``) before
reading anything, so no launch latency lies between them; outputs are bit-identical to serial launches
(tests/test_decode_gpu.py).

Optional counters (COUNT): every program adds the number of tokens whose keys/values it loaded to
``cnt[b*H + h, branch]`` (branch 0 cmp, 1 sel, 2 win): counted from the load masks themselves.

:class:`DecodeKernels` owns the workspaces for one (batch, cache size) and runs
``attend(q, gates, ...)`` over the caches it is given (``nsa.decode.GraphDecoder`` gets it from the
dispatch). Branch subsets (``branches``) run only mode four's kernels of those branches, so each can be
timed alone. Launch parameters: ``tuning.params("decode")``.
"""

# No ``from __future__ import annotations`` here: triton 2.3/3.0's JIT reads the kernel annotations
# as objects (string annotations make ``tl.constexpr`` parameters plain runtime arguments).
import math

import torch
import triton
import triton.language as tl

from ...dispatch import BRANCHES
from . import tuning
from .decode_prologue import StepPrologue
from .pdl import HAS_GDC, pdl_enter, pdl_supported
from .utils import DOT_MIN, LOG2E, default_scale, dot_precision, p2, poisoning

NEG = tl.constexpr(-1.0e30)
HAS_TOPK = hasattr(tl, "topk")  # a bitonic top-k in triton.language (3.3+)


@triton.jit
def _last_to_arrive(count_ptr, N: tl.constexpr):
    """True in the last of the N programs sharing ``count_ptr`` to get here (which zeroes it again for
    the next launch). Every thread's stores before the call are issued (barrier), then released with
    the count (acq_rel, GPU scope); the last program so acquires the stores of all N."""
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    last = done == N - 1
    if last:
        tl.store(count_ptr, 0)
    return last


# Few nested @triton.jit calls, none inside loops: the interpreter (CPU tests) re-patches
# triton.language on every one.
@triton.jit
def _group_rows(x_ptr, b, h, stride_b, stride_h, offs_g, offs_d, gmask, G: tl.constexpr, D: tl.constexpr):
    """The G rows (query heads h*G ..) of sequence b of a [B, HQ, D] tensor, padded to [BG, BD]."""
    return tl.load(x_ptr + b * stride_b + (h * G + offs_g)[:, None] * stride_h + offs_d[None, :],
                   mask=gmask[:, None] & (offs_d[None, :] < D), other=0.0)


@triton.jit
def dec_cmp_partial(q_ptr, kc_ptr, vc_ptr, pos_ptr, stride_pos, sc_ptr, pm_ptr, pl_ptr, pacc_ptr, cnt_ptr,
                     psum_ptr, ocmp_ptr, idx_ptr, sem_ptr,
                     stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                     qk_scale, TCS,
                     H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                     L: tl.constexpr, D: tl.constexpr, NSC: tl.constexpr,
                     BG: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BLOCK_C: tl.constexpr,
                     PREC: tl.constexpr, COUNT: tl.constexpr, SMALL_DOT: tl.constexpr, PDL: tl.constexpr,
                     LS: tl.constexpr, NSC_PAD: tl.constexpr, N_SEL: tl.constexpr, N_INIT: tl.constexpr,
                     N_LOCAL: tl.constexpr, NB_PAD: tl.constexpr, BSEL: tl.constexpr, BLOCK_T: tl.constexpr,
                     TOPK: tl.constexpr, FUSE: tl.constexpr):
    """Mode four's step 1 (the module docstring): grid (B*H, NSC); each program attends to its slice of
    the visible compressed tokens for the G heads of its group, keeps the scores for step 2 and writes its
    flash-decoding partial (m, l, acc).

    Arguments:
        The caches, workspaces and strides as :meth:`DecodeKernels.attend` passes them; the constexprs are
        ``launch_params``'. FUSE (mode two): the last of a group's NSC programs to finish runs the top-n
        step (_cmp_topk) itself, so the step needs no launch of dec_cmp_topk; the arguments after PDL
        serve only it.
    """
    pdl_enter(PDL)
    # SMALL_DOT: BLOCK_C is below the tl.dot minimum of the running triton (16 on triton 3.0, even
    # under the interpreter); the two products are then broadcast-multiply-sums in fp32.
    bh = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    b = bh // H
    h = bh % H
    t = tl.load(pos_ptr + b * stride_pos).to(tl.int32)
    n_vis = tl.where(t + 1 >= L, (t + 1 - L) // D + 1, 0)  # compressed tokens i with i*d + l - 1 <= t
    offs_g = tl.arange(0, BG)
    gmask = offs_g < G
    q = _group_rows(q_ptr, b, h, stride_qb, stride_qh, offs_g, tl.arange(0, BDK), gmask, G, DK)
    _cmp_split(q, kc_ptr, vc_ptr, sc_ptr, pm_ptr, pl_ptr, pacc_ptr, cnt_ptr, bh, sp, b, h, n_vis,
               stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale, TCS, G, DK, DV, NSC,
               BG, BDK, BDV, BLOCK_C, PREC, COUNT, SMALL_DOT)
    if FUSE:
        if _last_to_arrive(sem_ptr + bh, NSC):
            _cmp_topk(bh, pos_ptr, stride_pos, sc_ptr, pm_ptr, pl_ptr, pacc_ptr, psum_ptr, ocmp_ptr, idx_ptr, TCS, H, G,
                      DV, L, D, LS, NSC, NSC_PAD, N_SEL, N_INIT, N_LOCAL, BG, BDV, NB_PAD, BSEL, BLOCK_T, TOPK, True)


@triton.jit
def _cmp_split(q, kc_ptr, vc_ptr, sc_ptr, pm_ptr, pl_ptr, pacc_ptr, cnt_ptr, bh, sp, b, h, n_vis,
               stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale, TCS,
               G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, NSC: tl.constexpr, BG: tl.constexpr,
               BDK: tl.constexpr, BDV: tl.constexpr, BLOCK_C: tl.constexpr, PREC: tl.constexpr, COUNT: tl.constexpr,
               SMALL_DOT: tl.constexpr):
    """Split sp of NSC of group bh's compressed pass: its slice of the visible compressed tokens, their
    scores kept in the group's scratch row (log2 domain, for the top-n), and its flash-decoding
    partial (m, l, acc) at partial row bh*NSC + sp."""
    chunk = tl.cdiv(tl.cdiv(n_vis, NSC), BLOCK_C) * BLOCK_C
    c0 = sp * chunk
    c1 = tl.minimum(c0 + chunk, n_vis)
    offs_g = tl.arange(0, BG)
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    offs_c = tl.arange(0, BLOCK_C)
    gmask = offs_g < G
    k_base = kc_ptr + b * stride_kb + h * stride_kh
    v_base = vc_ptr + b * stride_vb + h * stride_vh
    s_base = sc_ptr + bh * G * TCS
    m_i = tl.full([BG], NEG, tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BDV], tl.float32)
    for c in range(c0, c1, BLOCK_C):
        tok = c + offs_c
        tmask = tok < c1
        kT = tl.load(k_base + tok[None, :] * stride_kt + offs_dk[:, None],
                     mask=tmask[None, :] & (offs_dk[:, None] < DK), other=0.0)
        if SMALL_DOT:
            s = tl.sum(q.to(tl.float32)[:, :, None] * kT.to(tl.float32)[None, :, :], 1) * qk_scale
        else:
            s = tl.dot(q, kT, input_precision=PREC) * qk_scale
        s = tl.where(tmask[None, :], s, float("-inf"))
        tl.store(s_base + offs_g[:, None] * TCS + tok[None, :], s, mask=gmask[:, None] & tmask[None, :])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        v = tl.load(v_base + tok[:, None] * stride_vt + offs_dv[None, :],
                    mask=tmask[:, None] & (offs_dv[None, :] < DV), other=0.0)
        if SMALL_DOT:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    _store_partial(pm_ptr, pl_ptr, pacc_ptr, bh * NSC + sp, m_i, l_i, acc, BG, BDV)
    if COUNT:
        tl.atomic_add(cnt_ptr + bh * 3 + 0, tl.maximum(c1 - c0, 0))


@triton.jit
def dec_cmp_topk(pos_ptr, stride_pos, sc_ptr, pm_ptr, pl_ptr, pacc_ptr, psum_ptr, ocmp_ptr, idx_ptr, TCS,
                  H: tl.constexpr, G: tl.constexpr, DV: tl.constexpr,
                  L: tl.constexpr, D: tl.constexpr, LS: tl.constexpr, NSC: tl.constexpr, NSC_PAD: tl.constexpr,
                  N_SEL: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr,
                  BG: tl.constexpr, BDV: tl.constexpr, NB_PAD: tl.constexpr, BSEL: tl.constexpr,
                  BLOCK_T: tl.constexpr, TOPK: tl.constexpr, DO_TOPK: tl.constexpr, PDL: tl.constexpr):
    """Mode four's step 2 (the module docstring): grid (B*H,); merges the compressed partials into
    o_cmp, turns the kept scores into the group's block scores (Eqs. 9-10) and writes the top-n (Eqs. 11-12).

    Arguments:
        The workspaces as :meth:`DecodeKernels.attend` passes them; the constexprs are ``launch_params``'.
    """
    pdl_enter(PDL)
    _cmp_topk(tl.program_id(0).to(tl.int64), pos_ptr, stride_pos, sc_ptr, pm_ptr, pl_ptr, pacc_ptr, psum_ptr, ocmp_ptr,
              idx_ptr, TCS, H, G, DV, L, D, LS, NSC, NSC_PAD, N_SEL, N_INIT, N_LOCAL, BG, BDV, NB_PAD, BSEL, BLOCK_T, TOPK,
              DO_TOPK)


@triton.jit
def _cmp_topk(bh, pos_ptr, stride_pos, sc_ptr, pm_ptr, pl_ptr, pacc_ptr, psum_ptr, ocmp_ptr, idx_ptr, TCS,
              H: tl.constexpr, G: tl.constexpr, DV: tl.constexpr,
              L: tl.constexpr, D: tl.constexpr, LS: tl.constexpr, NSC: tl.constexpr, NSC_PAD: tl.constexpr,
              N_SEL: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr,
              BG: tl.constexpr, BDV: tl.constexpr, NB_PAD: tl.constexpr, BSEL: tl.constexpr,
              BLOCK_T: tl.constexpr, TOPK: tl.constexpr, DO_TOPK: tl.constexpr):
    """Group bh's compressed output from the NSC split partials, and (DO_TOPK) its top-n blocks."""
    b = bh // H
    h = bh % H
    t = tl.load(pos_ptr + b * stride_pos).to(tl.int32)
    n_vis = tl.where(t + 1 >= L, (t + 1 - L) // D + 1, 0)
    offs_g = tl.arange(0, BG)
    offs_dv = tl.arange(0, BDV)
    gmask = offs_g < G
    # ---- combine the split partials: o_cmp, and each head's softmax max M and normalizer Lsum
    # (one tile load for m / l; the acc loop is unrolled so its loads are all in flight at once)
    M, Lsum = _merged_stats(pm_ptr, pl_ptr, bh, offs_g, NSC, NSC_PAD, BG)
    acc = tl.zeros([BG, BDV], tl.float32)
    for sp in tl.static_range(NSC):
        row = bh * NSC + sp
        w = tl.exp2(tl.load(pm_ptr + row * BG + offs_g) - M)
        acc += tl.load(pacc_ptr + row * (BG * BDV) + offs_g[:, None] * BDV + offs_dv[None, :]) * w[:, None]
    Lsafe = tl.where(Lsum > 0, Lsum, 1.0)
    o = tl.where(Lsum[:, None] > 0, acc / Lsafe[:, None], 0.0)  # no visible token: o_cmp = 0
    tl.store(ocmp_ptr + (b * (H * G) + h * G + offs_g)[:, None] * DV + offs_dv[None, :], o,
             mask=gmask[:, None] & (offs_dv[None, :] < DV))
    if DO_TOPK:
        _topn(t, n_vis, sc_ptr + bh * G * TCS, psum_ptr + bh * TCS, idx_ptr + bh * N_SEL, M, Lsafe, offs_g, gmask,
              TCS, L, D, LS, N_SEL, N_INIT, N_LOCAL, NB_PAD, BSEL, BLOCK_T, TOPK)


@triton.jit
def _merged_stats(pm_ptr, pl_ptr, bh, offs_g, NSC: tl.constexpr, NSC_PAD: tl.constexpr, BG: tl.constexpr):
    """Each head's softmax max M and normalizer Lsum over the compressed tokens, from group bh's NSC
    split partials (one tile load for m and one for l)."""
    offs_s = tl.arange(0, NSC_PAD)
    smask = offs_s[:, None] < NSC
    prow = (bh * NSC + offs_s)[:, None] * BG + offs_g[None, :]
    ms = tl.load(pm_ptr + prow, mask=smask, other=NEG)
    M = tl.max(ms, 0)
    return M, tl.sum(tl.load(pl_ptr + prow, mask=smask, other=0.0) * tl.exp2(ms - M[None, :]), 0)


@triton.jit
def _topn(t, n_vis, s_base, psum_base, idx_base, M, Lsafe, offs_g, gmask, TCS, L: tl.constexpr, D: tl.constexpr,
          LS: tl.constexpr, N_SEL: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr, NB_PAD: tl.constexpr,
          BSEL: tl.constexpr, BLOCK_T: tl.constexpr, TOPK: tl.constexpr):
    """The top-n blocks (_pick) written ascending to ``idx_base[0:N_SEL]``, -1 padded."""
    j, chosen, rank = _pick(t, n_vis, s_base, psum_base, M, Lsafe, offs_g, gmask, TCS, L, D, LS, N_SEL, N_INIT,
                            N_LOCAL, NB_PAD, BLOCK_T, TOPK)
    _store_indices(idx_base, j, chosen, rank, N_SEL, BSEL)


@triton.jit
def _store_indices(idx_base, j, chosen, rank, N_SEL: tl.constexpr, BSEL: tl.constexpr):
    tl.store(idx_base + rank, j, mask=chosen)
    cnt = tl.sum(chosen.to(tl.int32), 0)
    ks = tl.arange(0, BSEL)
    tl.store(idx_base + ks, tl.full([BSEL], -1, tl.int32), mask=(ks >= cnt) & (ks < N_SEL))


@triton.jit
def _pick(t, n_vis, s_base, psum_base, M, Lsafe, offs_g, gmask, TCS, L: tl.constexpr, D: tl.constexpr,
          LS: tl.constexpr, N_SEL: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr, NB_PAD: tl.constexpr,
          BLOCK_T: tl.constexpr, TOPK: tl.constexpr):
    """The top-n blocks of the query at t from its group's compressed scores ``s_base`` ([G, TCS], log2
    domain) and each head's softmax max M / normalizer Lsafe (Eqs. 9-12): (j, chosen, rank) over the
    NB_PAD blocks j, rank = the chosen block's place in ascending order. ``psum_base``: a [TCS]
    scratch row. TOPK: 0, n_sel dependent argmaxes; else a bitonic top-TOPK (``tl.topk``, a power of
    two >= n_sel)."""
    # ---- Eq. 10 first (Eq. 9's weights do not depend on the head): P[i] = sum_g p_cmp[g, i]
    offs_t = tl.arange(0, BLOCK_T)
    for i0 in range(0, n_vis, BLOCK_T):
        ii = i0 + offs_t
        s = tl.load(s_base + offs_g[:, None] * TCS + ii[None, :],
                    mask=gmask[:, None] & (ii[None, :] < n_vis), other=float("-inf"))
        p = tl.exp2(s - M[:, None]) / Lsafe[:, None]
        tl.store(psum_base + ii, tl.sum(p, 0), mask=ii < n_vis)
    tl.debug_barrier()
    # ---- Eq. 9 (block-aligned): score[j] = sum_i P[i] * |[i*d, i*d+l) ∩ [j*ls, (j+1)*ls)| / d
    R: tl.constexpr = LS // D
    NL: tl.constexpr = L // D
    j = tl.arange(0, NB_PAD)
    score = tl.zeros([NB_PAD], tl.float32)
    for k in tl.static_range(R + NL - 1):
        i = R * j + (k - (NL - 1))
        ok = (i >= 0) & (i < n_vis)
        pv = tl.load(psum_base + i, mask=ok, other=0.0)
        lo = tl.maximum(i * D, j * LS)
        hi = tl.minimum(i * D + L, (j + 1) * LS)
        wgt = (tl.maximum(hi - lo, 0) // D).to(tl.float32)
        score += tl.where(ok, wgt * pv, 0.0)
    # ---- Eqs. 11-12 with forcing: n_sel iterative argmaxes, ties to the lower index
    last = t // LS
    cand = j <= last
    forced = cand & ((j < N_INIT) | (j > last - N_LOCAL))
    val = tl.where(forced, float("inf"), score)  # >= 0 (or +inf): its bits order like the values
    # one int64 max per pick: (value bits, NB_PAD-1-j) -> the largest value, ties to the lower j
    key = (val.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (NB_PAD - 1 - j).to(tl.int64)
    key = tl.where(cand, key, -1)
    if TOPK > 0:
        # the largest keys by a bitonic top-k, then block j is chosen iff its key is at least the n_sel-th
        # largest (keys are distinct: they hold j)
        top = tl.topk(key, TOPK)
        kth = tl.min(tl.where(tl.arange(0, TOPK) < N_SEL, top, 2**62), 0)
        chosen = (key >= kth) & (key >= 0)
    else:
        chosen = j < 0
        for _ in tl.static_range(N_SEL):
            mx = tl.max(key, 0)
            hit = (key == mx) & (key >= 0)
            chosen = chosen | hit
            key = tl.where(hit, -1, key)
    return j, chosen, tl.cumsum(chosen.to(tl.int32), 0) - 1


@triton.jit
def dec_sv_partial(q_ptr, ks_ptr, vs_ptr, kw_ptr, vw_ptr, idx_ptr, pos_ptr, stride_pos, pm_ptr, pl_ptr, pacc_ptr, cnt_ptr,
                    ocmp_ptr, g_ptr, out_ptr, sem_ptr, stride_gb, stride_gh, stride_ob, stride_oh,
                    stride_qb, stride_qh,
                    stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
                    stride_kwb, stride_kwt, stride_kwh, stride_vwb, stride_vwt, stride_vwh,
                    qk_scale,
                    H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                    LS: tl.constexpr, W: tl.constexpr, N_SEL: tl.constexpr,
                    NS_SEL: tl.constexpr, SEL_PER: tl.constexpr, SEL_VEC: tl.constexpr, NS_TOT: tl.constexpr,
                    WIN_PER: tl.constexpr, NWC: tl.constexpr, SPLIT_OFF: tl.constexpr,
                    BG: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BLS: tl.constexpr, BW: tl.constexpr,
                    PREC: tl.constexpr, COUNT: tl.constexpr, PDL: tl.constexpr, FUSE: tl.constexpr):
    """Splits 0..NS_SEL-1: SEL_PER selected blocks each (SEL_VEC per tile); the rest: WIN_PER
    window tiles of BW tokens each. Tiles of either kind are NT = max(SEL_VEC*BLS, BW) wide.
    FUSE (every split launched): the last of a group's NS_TOT programs to finish writes the group's
    gated output (_combine), so the step needs no launch of dec_combine; ocmp .. stride_oh serve it."""
    pdl_enter(PDL)
    bh = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1) + SPLIT_OFF
    b = bh // H
    h = bh % H
    t = tl.load(pos_ptr + b * stride_pos).to(tl.int32)
    offs_g = tl.arange(0, BG)
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    gmask = offs_g < G
    q = _group_rows(q_ptr, b, h, stride_qb, stride_qh, offs_g, offs_dk, gmask, G, DK)
    is_sel = sp < NS_SEL
    if is_sel:
        k_base = ks_ptr + b * stride_ksb + h * stride_ksh
        v_base = vs_ptr + b * stride_vsb + h * stride_vsh
        skt = stride_kst
        svt = stride_vst
        n_tiles = SEL_PER // SEL_VEC
    else:
        k_base = kw_ptr + b * stride_kwb + h * stride_kwh
        v_base = vw_ptr + b * stride_vwb + h * stride_vwh
        skt = stride_kwt
        svt = stride_vwt
        n_tiles = WIN_PER
    ws = tl.maximum(t - W + 1, 0)
    NT: tl.constexpr = SEL_VEC * BLS if SEL_VEC * BLS > BW else BW  # noqa: FURB136 (jit code)
    offs = tl.arange(0, NT)
    m_i = tl.full([BG], NEG, tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BDV], tl.float32)
    n_read = t * 0
    for it in range(n_tiles):
        if is_sel:
            slot = sp * SEL_PER + it * SEL_VEC + offs // BLS
            jb = tl.load(idx_ptr + bh * N_SEL + slot, mask=(slot < N_SEL) & (offs < SEL_VEC * BLS), other=-1)
            r = offs % BLS
            tok = jb * LS + r
            tmask = (jb >= 0) & (r < LS) & (tok <= t)
        else:
            c = (sp - NS_SEL) * WIN_PER + it
            tok = ws + c * BW + offs
            tmask = (tok <= t) & (c < NWC) & (offs < BW)
        kT = tl.load(k_base + tok[None, :] * skt + offs_dk[:, None],
                     mask=tmask[None, :] & (offs_dk[:, None] < DK), other=0.0)
        s = tl.dot(q, kT, input_precision=PREC) * qk_scale
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        v = tl.load(v_base + tok[:, None] * svt + offs_dv[None, :],
                    mask=tmask[:, None] & (offs_dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        if COUNT:
            n_read += tl.sum(tmask.to(tl.int32), 0)
    _store_partial(pm_ptr, pl_ptr, pacc_ptr, bh * NS_TOT + sp, m_i, l_i, acc, BG, BDV)
    if COUNT:
        tl.atomic_add(cnt_ptr + bh * 3 + tl.where(is_sel, 1, 2), n_read)
    if FUSE:
        if _last_to_arrive(sem_ptr + bh, NS_TOT):
            _combine(bh, pm_ptr, pl_ptr, pacc_ptr, ocmp_ptr, g_ptr, out_ptr, stride_gb, stride_gh, stride_ob, stride_oh,
                     H, G, DV, NS_SEL, NS_TOT, True, True, True, BG, BDV)


@triton.jit
def _win_split(q, kw_base, vw_base, t, wi, skt, svt, qk_scale, DK: tl.constexpr, DV: tl.constexpr, W: tl.constexpr,
               WIN_PER: tl.constexpr, NWC: tl.constexpr, BG: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
               BW: tl.constexpr, PREC: tl.constexpr):
    """Window split wi: its WIN_PER tiles of BW tokens of [t-w+1, t] -> (m, l, acc, tokens read)."""
    offs = tl.arange(0, BW)
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    ws = tl.maximum(t - W + 1, 0)
    m_i = tl.full([BG], NEG, tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BDV], tl.float32)
    n_read = t * 0
    for it in range(WIN_PER):
        c = wi * WIN_PER + it
        tok = ws + c * BW + offs
        tmask = (tok <= t) & (c < NWC)
        kT = tl.load(kw_base + tok[None, :] * skt + offs_dk[:, None],
                     mask=tmask[None, :] & (offs_dk[:, None] < DK), other=0.0)
        s = tl.dot(q, kT, input_precision=PREC) * qk_scale
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        v = tl.load(vw_base + tok[:, None] * svt + offs_dv[None, :],
                    mask=tmask[:, None] & (offs_dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        n_read += tl.sum(tmask.to(tl.int32), 0)
    return m_i, l_i, acc, n_read


@triton.jit
def _store_partial(pm_ptr, pl_ptr, pacc_ptr, row, m_i, l_i, acc, BG: tl.constexpr, BDV: tl.constexpr):
    offs_g = tl.arange(0, BG)
    tl.store(pm_ptr + row * BG + offs_g, m_i)
    tl.store(pl_ptr + row * BG + offs_g, l_i)
    tl.store(pacc_ptr + row * (BG * BDV) + offs_g[:, None] * BDV + tl.arange(0, BDV)[None, :], acc)


@triton.jit
def dec_cw_partial(q_ptr, kc_ptr, vc_ptr, kw_ptr, vw_ptr, pos_ptr, stride_pos, sc_ptr, cm_ptr, cl_ptr, cacc_ptr,
                    pm_ptr, pl_ptr, pacc_ptr, cnt_ptr,
                    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                    stride_kwb, stride_kwt, stride_kwh, stride_vwb, stride_vwt, stride_vwh, qk_scale, TCS,
                    H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, L: tl.constexpr,
                    D: tl.constexpr, W: tl.constexpr, NSC: tl.constexpr, NS_SEL: tl.constexpr, NS_TOT: tl.constexpr,
                    WIN_PER: tl.constexpr, NWC: tl.constexpr, BG: tl.constexpr, BDK: tl.constexpr,
                    BDV: tl.constexpr, BLOCK_C: tl.constexpr, BW: tl.constexpr, PREC: tl.constexpr,
                    COUNT: tl.constexpr, SMALL_DOT: tl.constexpr, PDL: tl.constexpr):
    """Launch 1 of 3 (mode "three"): splits 0..NSC-1 of the compressed pass (_cmp_split) and, beside
    them, the window splits (their partials at rows NS_SEL.. of the selected/window partials): the
    window needs no top-n, so it runs while the compressed scores are computed."""
    pdl_enter(PDL)
    bh = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    b = bh // H
    h = bh % H
    t = tl.load(pos_ptr + b * stride_pos).to(tl.int32)
    offs_g = tl.arange(0, BG)
    gmask = offs_g < G
    q = _group_rows(q_ptr, b, h, stride_qb, stride_qh, offs_g, tl.arange(0, BDK), gmask, G, DK)
    if sp < NSC:
        n_vis = tl.where(t + 1 >= L, (t + 1 - L) // D + 1, 0)
        _cmp_split(q, kc_ptr, vc_ptr, sc_ptr, cm_ptr, cl_ptr, cacc_ptr, cnt_ptr, bh, sp, b, h, n_vis,
                   stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale, TCS, G, DK, DV, NSC,
                   BG, BDK, BDV, BLOCK_C, PREC, COUNT, SMALL_DOT)
    else:
        wi = sp - NSC
        m_i, l_i, acc, n_read = _win_split(q, kw_ptr + b * stride_kwb + h * stride_kwh,
                                           vw_ptr + b * stride_vwb + h * stride_vwh, t, wi, stride_kwt, stride_vwt,
                                           qk_scale, DK, DV, W, WIN_PER, NWC, BG, BDK, BDV, BW, PREC)
        _store_partial(pm_ptr, pl_ptr, pacc_ptr, bh * NS_TOT + NS_SEL + wi, m_i, l_i, acc, BG, BDV)
        if COUNT:
            tl.atomic_add(cnt_ptr + bh * 3 + 2, n_read)


@triton.jit
def dec_sel_topn(q_ptr, ks_ptr, vs_ptr, pos_ptr, stride_pos, sc_ptr, psum_ptr, cm_ptr, cl_ptr, idx_ptr, pm_ptr, pl_ptr,
                  pacc_ptr, cnt_ptr, stride_qb, stride_qh, stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst,
                  stride_vsh, qk_scale, TCS,
                  H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, L: tl.constexpr,
                  D: tl.constexpr, LS: tl.constexpr, N_SEL: tl.constexpr, N_INIT: tl.constexpr,
                  N_LOCAL: tl.constexpr, NSC: tl.constexpr, NSC_PAD: tl.constexpr, SEL_PER: tl.constexpr,
                  NS_SEL: tl.constexpr, NS_TOT: tl.constexpr, BLOCK_T: tl.constexpr, TOPK: tl.constexpr,
                  BG: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BLS: tl.constexpr,
                  NB_PAD: tl.constexpr, BSEL: tl.constexpr, PREC: tl.constexpr, COUNT: tl.constexpr,
                  PDL: tl.constexpr):
    """Launch 2 of 3 (mode "three"): each program of a group merges the compressed pass's softmax
    statistics, picks the group's top-n blocks itself (the same blocks in every program: no program
    waits for another; program 0 writes them to ``idx``) and attends to its SEL_PER of them (Eq. 6),
    writing a partial at row sp."""
    pdl_enter(PDL)
    bh = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    b = bh // H
    h = bh % H
    t = tl.load(pos_ptr + b * stride_pos).to(tl.int32)
    n_vis = tl.where(t + 1 >= L, (t + 1 - L) // D + 1, 0)
    offs_g = tl.arange(0, BG)
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    gmask = offs_g < G
    q = _group_rows(q_ptr, b, h, stride_qb, stride_qh, offs_g, offs_dk, gmask, G, DK)
    M, Lsum = _merged_stats(cm_ptr, cl_ptr, bh, offs_g, NSC, NSC_PAD, BG)
    j, chosen, rank = _pick(t, n_vis, sc_ptr + bh * G * TCS, psum_ptr + (bh * NS_SEL + sp) * TCS, M,
                            tl.where(Lsum > 0, Lsum, 1.0), offs_g, gmask, TCS, L, D, LS, N_SEL, N_INIT, N_LOCAL,
                            NB_PAD, BLOCK_T, TOPK)
    if sp == 0:
        _store_indices(idx_ptr + bh * N_SEL, j, chosen, rank, N_SEL, BSEL)
    ks_base = ks_ptr + b * stride_ksb + h * stride_ksh
    vs_base = vs_ptr + b * stride_vsb + h * stride_vsh
    offs = tl.arange(0, BLS)
    m_i = tl.full([BG], NEG, tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BDV], tl.float32)
    n_read = t * 0
    for ksl in range(SEL_PER):
        hit = chosen & (rank == sp * SEL_PER + ksl)  # the slot's block, straight from the registers
        jb = tl.where(tl.sum(hit.to(tl.int32), 0) > 0, tl.sum(tl.where(hit, j, 0), 0), -1)
        tok = jb * LS + offs
        tmask = (jb >= 0) & (offs < LS) & (tok <= t)
        kT = tl.load(ks_base + tok[None, :] * stride_kst + offs_dk[:, None],
                     mask=tmask[None, :] & (offs_dk[:, None] < DK), other=0.0)
        s = tl.dot(q, kT, input_precision=PREC) * qk_scale
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        v = tl.load(vs_base + tok[:, None] * stride_vst + offs_dv[None, :],
                    mask=tmask[:, None] & (offs_dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        n_read += tl.sum(tmask.to(tl.int32), 0)
    _store_partial(pm_ptr, pl_ptr, pacc_ptr, bh * NS_TOT + sp, m_i, l_i, acc, BG, BDV)
    if COUNT:
        tl.atomic_add(cnt_ptr + bh * 3 + 1, n_read)


@triton.jit
def dec_combine3(cm_ptr, cl_ptr, cacc_ptr, pm_ptr, pl_ptr, pacc_ptr, g_ptr, out_ptr, stride_gb, stride_gh,
                  stride_ob, stride_oh, H: tl.constexpr, G: tl.constexpr, DV: tl.constexpr, NSC: tl.constexpr,
                  NS_SEL: tl.constexpr, NS_TOT: tl.constexpr, BG: tl.constexpr, BDV: tl.constexpr, BDVC: tl.constexpr,
                  PDL: tl.constexpr):
    """Launch 3 of 3 (mode "three"): o = sum over branches of g_c * (merge of branch c's partials), for
    value dims BDVC*program_id(1).. (at B=1 a group's merge is spread over several programs)."""
    pdl_enter(PDL)
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    h = bh % H
    offs_g = tl.arange(0, BG)
    offs_dv = tl.program_id(1) * BDVC + tl.arange(0, BDVC)
    heads = h * G + offs_g
    gmask = offs_g < G
    g_base = g_ptr + b * stride_gb + heads * stride_gh
    o = tl.zeros([BG, BDVC], tl.float32)
    o = _add_merged(o, g_base, gmask, cm_ptr, cl_ptr, cacc_ptr, bh, offs_g, offs_dv, 0, 0, NSC, NSC, BG, BDV, BDVC)
    o = _add_merged(o, g_base, gmask, pm_ptr, pl_ptr, pacc_ptr, bh, offs_g, offs_dv, 1, 0, NS_SEL, NS_TOT, BG, BDV,
                    BDVC)
    o = _add_merged(o, g_base, gmask, pm_ptr, pl_ptr, pacc_ptr, bh, offs_g, offs_dv, 2, NS_SEL, NS_TOT, NS_TOT, BG,
                    BDV, BDVC)
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :], o.to(out_ptr.dtype.element_ty),
             mask=gmask[:, None] & (offs_dv[None, :] < DV))


@triton.jit
def _add_merged(o, g_base, gmask, pm_ptr, pl_ptr, pacc_ptr, bh, offs_g, offs_dv, C: tl.constexpr, SP0: tl.constexpr,
                SP1: tl.constexpr, NS_TOT: tl.constexpr, BG: tl.constexpr, BDV: tl.constexpr, BDVC: tl.constexpr):
    """o + g_c * (flash-decoding merge of the partials of splits SP0..SP1-1): branch c's gated output, at the
    BDVC value dims ``offs_dv`` of the partials' BDV."""
    M = tl.full([BG], NEG, tl.float32)
    for sp in tl.static_range(SP0, SP1):
        M = tl.maximum(M, tl.load(pm_ptr + (bh * NS_TOT + sp) * BG + offs_g))
    Ls = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BDVC], tl.float32)
    for sp in tl.static_range(SP0, SP1):
        row = bh * NS_TOT + sp
        w = tl.exp2(tl.load(pm_ptr + row * BG + offs_g) - M)
        Ls += tl.load(pl_ptr + row * BG + offs_g) * w
        acc += tl.load(pacc_ptr + row * (BG * BDV) + offs_g[:, None] * BDV + offs_dv[None, :]) * w[:, None]
    g = tl.load(g_base + C, mask=gmask, other=0.0).to(tl.float32)
    return o + g[:, None] * (acc / tl.where(Ls > 0, Ls, 1.0)[:, None])


@triton.jit
def dec_combine(pm_ptr, pl_ptr, pacc_ptr, ocmp_ptr, g_ptr, out_ptr, stride_gb, stride_gh, stride_ob, stride_oh,
                 H: tl.constexpr, G: tl.constexpr, DV: tl.constexpr,
                 NS_SEL: tl.constexpr, NS_TOT: tl.constexpr,
                 HAS_CMP: tl.constexpr, HAS_SEL: tl.constexpr, HAS_WIN: tl.constexpr,
                 BG: tl.constexpr, BDV: tl.constexpr, PDL: tl.constexpr):
    """o = g_cmp * o_cmp + g_sel * combine(sel partials) + g_win * combine(win partials)."""
    pdl_enter(PDL)
    _combine(tl.program_id(0).to(tl.int64), pm_ptr, pl_ptr, pacc_ptr, ocmp_ptr, g_ptr, out_ptr, stride_gb, stride_gh,
             stride_ob, stride_oh, H, G, DV, NS_SEL, NS_TOT, HAS_CMP, HAS_SEL, HAS_WIN, BG, BDV)


@triton.jit
def _combine(bh, pm_ptr, pl_ptr, pacc_ptr, ocmp_ptr, g_ptr, out_ptr, stride_gb, stride_gh, stride_ob, stride_oh,
             H: tl.constexpr, G: tl.constexpr, DV: tl.constexpr, NS_SEL: tl.constexpr, NS_TOT: tl.constexpr,
             HAS_CMP: tl.constexpr, HAS_SEL: tl.constexpr, HAS_WIN: tl.constexpr, BG: tl.constexpr, BDV: tl.constexpr):
    """Group bh's gated output from o_cmp and the sel / win split partials."""
    b = bh // H
    h = bh % H
    offs_g = tl.arange(0, BG)
    offs_dv = tl.arange(0, BDV)
    heads = h * G + offs_g
    gmask = offs_g < G
    omask = gmask[:, None] & (offs_dv[None, :] < DV)
    g_base = g_ptr + b * stride_gb + heads * stride_gh
    o = tl.zeros([BG, BDV], tl.float32)
    if HAS_CMP:
        gc = tl.load(g_base + 0, mask=gmask, other=0.0).to(tl.float32)
        oc = tl.load(ocmp_ptr + (b * (H * G) + heads)[:, None] * DV + offs_dv[None, :], mask=omask, other=0.0)
        o += gc[:, None] * oc
    if HAS_SEL:
        o = _add_merged(o, g_base, gmask, pm_ptr, pl_ptr, pacc_ptr, bh, offs_g, offs_dv, 1, 0, NS_SEL, NS_TOT, BG, BDV,
                        BDV)
    if HAS_WIN:
        o = _add_merged(o, g_base, gmask, pm_ptr, pl_ptr, pacc_ptr, bh, offs_g, offs_dv, 2, NS_SEL, NS_TOT, NS_TOT, BG,
                        BDV, BDV)
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :],
             o.to(out_ptr.dtype.element_ty), mask=omask)


def launch_params(config, B: int, max_len: int, *, gpu: bool, n_sm: int, tune: dict, device=None) -> dict:
    """The decode kernels' tile and split sizes for ``B`` sequences and caches of ``max_len`` raw
    tokens on ``n_sm`` multiprocessors; ``tune``: ``tuning.params("decode")``, whose None entries
    are derived here. Without a GPU (the interpreter runs programs one by one): few, large programs."""
    c = config
    H = c.n_kv_heads
    TCS = max(c.n_cmp(max_len), 1)
    block_c = tune["block_c"]
    nsc = tune["nsc"]
    if nsc is None:
        # split the compressed pass so that B*H*nsc programs fill the SMs ~4x, but keep >= 4 tiles
        # per split (the combine is unrolled over the splits)
        nsc = max(1, min(-(-4 * n_sm // (B * H)), -(-TCS // (4 * block_c)), 32))
        nsc = nsc if gpu else min(2, nsc)
    w_eff = min(c.w, max_len)
    bw = tune["bw"] or p2(w_eff, 16)
    nwc = -(-w_eff // bw)
    big = B * H >= n_sm
    sel_per = tune["sel_per"] or ((4 if big else 1) if gpu else max(1, c.n_sel // 2))
    win_per = tune["win_per"] or ((4 if big else 1) if gpu else nwc)
    ns_sel, ns_win = -(-c.n_sel // sel_per), -(-nwc // win_per)
    pdl = tune["pdl"]
    if pdl is None:
        pdl = gpu and pdl_supported(device)
    elif pdl and not (gpu and pdl_supported(device)):
        raise ValueError("tuning.decode.pdl=True: programmatic dependent launch needs a CUDA GPU of sm_90 or later "
                         f"and triton >= 3.4 (here: {'triton without gdc' if not HAS_GDC else 'no such GPU'})")
    topn = tune["topn"]
    if topn == "auto":
        # bitonic: fewer dependent reductions than n_sel argmaxes, so a shorter chain at small batches;
        # but for many groups over long caches its longer program costs more throughput than it saves
        # (BENCHMARKS.md, "Decode at B=1": B=32 at 64k)
        long_many = p2(c.n_blocks(max_len), 16) >= 1024 and B * H >= 32
        topn = "bitonic" if HAS_TOPK and not long_many else "argmax"
    elif topn == "bitonic" and not HAS_TOPK:
        raise ValueError(f"tuning.decode.topn=bitonic: needs tl.topk (triton >= 3.3), not in triton {triton.__version__}")
    mode = tune["mode"]
    if mode == "auto":
        # three launches where its selected-branch programs, each picking the group's top-n again, fit on
        # SMs that would idle otherwise (B*H*n_sel <= n_sm: launch- and latency-bound steps), up to 512
        # selection blocks (32k tokens at l_sel=64); four elsewhere (H100, BENCHMARKS.md "Decode at B=1")
        mode = "three" if gpu and B * H * c.n_sel <= n_sm and c.n_blocks(max_len) <= 512 else "four"
    if mode == "three" and tune["nsc"] is None and gpu:
        nsc = max(1, min(-(-TCS // block_c), 8))  # one tile of the compressed pass a split, at most 8
    BDV = p2(c.d_v, 16)
    split = tune["combine_split"]
    if split is None:  # mode three's combine: about 2 programs an SM in all, chunks of >= 16 value dims
        split = min(BDV // 16, max(1, n_sm // (2 * B * H))) if gpu else 1
        split = 1 << (split.bit_length() - 1)
    elif split & (split - 1) or split > BDV:
        raise ValueError(f"tuning.decode.combine_split={split}: a power of two of at most {BDV} (the value dims "
                         "padded: next_pow2(d_v), at least 16)")
    return dict(pdl=pdl, mode=mode, prologue=tune["prologue"], combine_split=split, BG=p2(c.G, 16), BDK=p2(c.d_k, 16),
                BDV=BDV, TCS=TCS,
                block_c=block_c, nsc=nsc, NB_PAD=p2(c.n_blocks(max_len), 16), BSEL=p2(c.n_sel, 2),
                BLS=p2(c.l_sel, 16), bw=bw, nwc=nwc, sel_per=sel_per, sel_vec=tune["sel_vec"] or p2(sel_per),
                win_per=win_per, ns_sel=ns_sel, ns_win=ns_win, ns_tot=ns_sel + ns_win, warps=tune["warps"],
                topk_warps=tune["topk_warps"], sel_warps=tune["sel_warps"] or tune["warps"], block_t=tune["block_t"],
                topn=topn, topk=0 if topn == "argmax" else min(p2(c.n_sel), p2(c.n_blocks(max_len), 16)))


def device_params(config, B: int, max_len: int, device, *, n_sm: int | None = None) -> dict:
    """:func:`launch_params` for tensors on ``device``: what :class:`DecodeKernels` launches with there.

    Arguments:
        config, B, max_len: as :func:`launch_params`.
        device: the kernels' device; a CUDA one takes the GPU rules and ``tuning.params("decode", device)``
            (the active overrides applied), any other the interpreter's.
        n_sm: multiprocessors the split-KV grids are sized for; None: the device's (4 off CUDA).

    Returns:
        :func:`launch_params`' dict.
    """
    device = torch.device(device)
    gpu = device.type == "cuda"
    if n_sm is None:
        n_sm = torch.cuda.get_device_properties(device).multi_processor_count if gpu else 4
    return launch_params(config, B, max_len, gpu=gpu, n_sm=n_sm, tune=tuning.params("decode", device),
                         device=device if gpu else None)


def workspaces(config, B: int, p: dict, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype, int | None]]:
    """The tensors :class:`DecodeKernels` allocates for ``B`` sequences: the one place that sizes them.

    Arguments:
        config: the layer's NSAConfig (bounded by the cache, as the kernels get it).
        B: sequences of the batch.
        p: :func:`launch_params`' dict for this batch and cache.
        dtype: the output's dtype (the workspaces themselves are float32 and int32).

    Returns:
        name -> (shape, dtype, fill): ``fill`` None for an uninitialised tensor, else its initial value.
        The float32 scores and Eq. 10 sums per group (and per selected-branch program of mode three), the
        split partials (m, l, acc) of the compressed pass and of the selected + window pass, o_cmp, the
        top-n indices, the token counters, the fused steps' per-group counts and the output.
    """
    c, H = config, config.n_kv_heads
    BH, f32, i32 = B * H, torch.float32, torch.int32
    ws = {
        "scores": ((BH, c.G, p["TCS"]), f32, None),
        "cm": ((BH, p["nsc"], p["BG"]), f32, None),
        "cl": ((BH, p["nsc"], p["BG"]), f32, None),
        "cacc": ((BH, p["nsc"], p["BG"], p["BDV"]), f32, None),
        "psum": ((BH, p["TCS"]), f32, None),
        "o_cmp": ((B, c.n_heads, c.d_v), f32, 0),
        "sm": ((BH, p["ns_tot"], p["BG"]), f32, None),
        "sl": ((BH, p["ns_tot"], p["BG"]), f32, None),
        "sacc": ((BH, p["ns_tot"], p["BG"], p["BDV"]), f32, None),
        "indices": ((B, H, c.n_sel), i32, -1),
        "counts": ((BH, 3), i32, 0),
        "sem": ((2, BH), i32, 0),  # fused steps: programs done per group
        "out": ((B, c.n_heads, c.d_v), dtype, None),
    }
    if p["mode"] == "three":  # each selected-branch program's Eq. 10 sums
        ws["sel_psum"] = ((BH * p["ns_sel"], p["TCS"]), f32, None)
    return ws


def workspace_bytes(config, B: int, p: dict, dtype: torch.dtype) -> int:
    """Bytes of :func:`workspaces` (what :class:`DecodeKernels` holds, its prologue's aside); no GPU needed.

    Arguments:
        config, B, p, dtype: as :func:`workspaces`.

    Returns:
        The sum of every workspace's elements times its element size.
    """
    return sum(math.prod(shape) * dt.itemsize for shape, dt, _ in workspaces(config, B, p, dtype).values())


class DecodeKernels:
    """Workspaces + launch parameters of the decode step for ``B`` sequences and caches of
    ``max_len`` raw tokens (``TCS`` rows of compressed cache). ``n_sm`` (default: the device's
    multiprocessor count, 4 on CPU) sizes the split-KV grids so that B=1 still fills the GPU."""

    def __init__(self, config, B: int, max_len: int, device, *, dtype, n_sm: int | None = None):
        c = self.config = config
        device = torch.device(device)
        self.B, self.max_len, self.device, self.dtype = B, max_len, device, dtype
        p = self.p = device_params(c, B, max_len, device, n_sm=n_sm)
        self.prec = dot_precision(dtype)
        for name, (shape, dt, fill) in workspaces(c, B, p, dtype).items():
            setattr(self, name, torch.empty(shape, device=device, dtype=dt) if fill is None
                    else torch.full(shape, fill, device=device, dtype=dt))
        # the layer step's RoPE, cache writes, phi and gates (GraphDecoder; None: its torch ops)
        self.prologue = None
        if p["prologue"] == "triton":
            self.prologue = StepPrologue(c, B, device, dtype, pdl=p["pdl"], warps=p["warps"], prec=self.prec)

    # ------------------------------------------------------------------------------------------
    def attend(self, q, gates, pos, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, *, scale=None,
               branches=("cmp", "sel", "win"), combine=True, combine_branches=None, count=False, topk=True):
        """One decode step's attention for the queries at positions ``pos``: a device int tensor, [1]
        (every sequence at the same position) or [B] (each sequence at its own: ragged batches).

        q ``[B,HQ,Dk]`` (rows contiguous), gates ``[B,HQ,3]``, caches ``[B,*,H,D]`` (any strides
        with unit stride on D). Returns ``out [B,HQ,Dv]`` = sum over ``branches`` of g_b * o_b
        (a workspace tensor, overwritten by the next call; NaN-filled first inside
        ``poisoned_outputs()``). ``combine=False`` skips the combine kernel (timing);
        ``combine_branches`` (default ``branches``) says which branches it adds (``branches=(),
        combine_branches=BRANCHES`` times the combine alone). The selected branch reads
        ``self.indices`` (written by the cmp branch).
        """
        c, p = self.config, self.p
        H, G = c.n_kv_heads, c.G
        BH = self.B * H
        qk = default_scale(q, scale) * LOG2E
        nw = p["warps"]
        # PDL is a constexpr of every kernel; launch_pdl (the launch attribute) exists only compiled
        pdl = dict(PDL=True, launch_pdl=True) if p["pdl"] else dict(PDL=False)
        assert q.stride(-1) == 1 and k_cmp.stride(-1) == 1 and k_sel.stride(-1) == 1 and k_win.stride(-1) == 1
        if pos.dim() != 1 or pos.shape[0] not in (1, self.B):
            raise ValueError(f"pos: expected a [1] or [{self.B}] tensor of positions, got {tuple(pos.shape)}")
        spos = 0 if pos.shape[0] == 1 else pos.stride(0)
        if poisoning():
            self.out.fill_(float("nan"))
        if count:
            self.counts.zero_()
        # The whole step with fuse: two launches (the top-n and the combine run in the last program of
        # the compressed pass and of the sel/win pass); timing a part alone takes the four-kernel path.
        whole = set(branches) == set(BRANCHES) and combine and topk and \
            (combine_branches is None or set(combine_branches) == set(BRANCHES))
        if whole and p["mode"] == "three":
            self._three(q, gates, pos, spos, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, qk, count, pdl)
            return self.out
        fuse = whole and p["mode"] == "two"
        topk_args = dict(LS=c.l_sel, NSC_PAD=p2(p["nsc"], 2), N_SEL=c.n_sel, N_INIT=c.n_init, N_LOCAL=c.n_local,
                         NB_PAD=p["NB_PAD"], BSEL=p["BSEL"], BLOCK_T=p["block_t"], TOPK=p["topk"])
        if "cmp" in branches:
            dec_cmp_partial[(BH, p["nsc"])](
                q_ptr=q, kc_ptr=k_cmp, vc_ptr=v_cmp, pos_ptr=pos, stride_pos=spos, sc_ptr=self.scores, pm_ptr=self.cm,
                pl_ptr=self.cl, pacc_ptr=self.cacc, cnt_ptr=self.counts, psum_ptr=self.psum, ocmp_ptr=self.o_cmp,
                idx_ptr=self.indices, sem_ptr=self.sem[0], stride_qb=q.stride(0), stride_qh=q.stride(1),
                stride_kb=k_cmp.stride(0), stride_kt=k_cmp.stride(1), stride_kh=k_cmp.stride(2), stride_vb=v_cmp.stride(0),
                stride_vt=v_cmp.stride(1), stride_vh=v_cmp.stride(2), qk_scale=qk, TCS=p["TCS"], H=H, G=G, DK=c.d_k, DV=c.d_v,
                L=c.l, D=c.d, NSC=p["nsc"], BG=p["BG"], BDK=p["BDK"], BDV=p["BDV"], BLOCK_C=p["block_c"], PREC=self.prec,
                COUNT=count, SMALL_DOT=p["block_c"] < DOT_MIN, num_warps=nw, FUSE=fuse, **topk_args, **pdl,
            )
            if not fuse:
                dec_cmp_topk[(BH,)](
                    pos_ptr=pos, stride_pos=spos, sc_ptr=self.scores, pm_ptr=self.cm, pl_ptr=self.cl, pacc_ptr=self.cacc,
                    psum_ptr=self.psum, ocmp_ptr=self.o_cmp, idx_ptr=self.indices, TCS=p["TCS"], H=H, G=G, DV=c.d_v, L=c.l, D=c.d,
                    NSC=p["nsc"], BG=p["BG"], BDV=p["BDV"], DO_TOPK=topk, num_warps=p["topk_warps"], **topk_args, **pdl,
                )
        has_sel, has_win = "sel" in branches, "win" in branches
        if has_sel or has_win:
            off = 0 if has_sel else p["ns_sel"]
            n = (p["ns_sel"] if has_sel else 0) + (p["ns_win"] if has_win else 0)
            dec_sv_partial[(BH, n)](
                q_ptr=q, ks_ptr=k_sel, vs_ptr=v_sel, kw_ptr=k_win, vw_ptr=v_win, idx_ptr=self.indices, pos_ptr=pos,
                stride_pos=spos, pm_ptr=self.sm, pl_ptr=self.sl, pacc_ptr=self.sacc, cnt_ptr=self.counts, ocmp_ptr=self.o_cmp,
                g_ptr=gates, out_ptr=self.out, sem_ptr=self.sem[1], stride_gb=gates.stride(0), stride_gh=gates.stride(1),
                stride_ob=self.out.stride(0), stride_oh=self.out.stride(1), stride_qb=q.stride(0), stride_qh=q.stride(1),
                stride_ksb=k_sel.stride(0), stride_kst=k_sel.stride(1), stride_ksh=k_sel.stride(2), stride_vsb=v_sel.stride(0),
                stride_vst=v_sel.stride(1), stride_vsh=v_sel.stride(2), stride_kwb=k_win.stride(0), stride_kwt=k_win.stride(1),
                stride_kwh=k_win.stride(2), stride_vwb=v_win.stride(0), stride_vwt=v_win.stride(1), stride_vwh=v_win.stride(2),
                qk_scale=qk, H=H, G=G, DK=c.d_k, DV=c.d_v, LS=c.l_sel, W=c.w, N_SEL=c.n_sel, NS_SEL=p["ns_sel"],
                SEL_PER=p["sel_per"], SEL_VEC=p["sel_vec"], NS_TOT=p["ns_tot"], WIN_PER=p["win_per"], NWC=p["nwc"], SPLIT_OFF=off,
                BG=p["BG"], BDK=p["BDK"], BDV=p["BDV"], BLS=p["BLS"], BW=p["bw"], PREC=self.prec, COUNT=count, num_warps=nw,
                FUSE=fuse, **pdl,
            )
        cb = branches if combine_branches is None else combine_branches
        if combine and not fuse:
            dec_combine[(BH,)](
                pm_ptr=self.sm, pl_ptr=self.sl, pacc_ptr=self.sacc, ocmp_ptr=self.o_cmp, g_ptr=gates, out_ptr=self.out,
                stride_gb=gates.stride(0), stride_gh=gates.stride(1), stride_ob=self.out.stride(0), stride_oh=self.out.stride(1),
                H=H, G=G, DV=c.d_v, NS_SEL=p["ns_sel"], NS_TOT=p["ns_tot"], HAS_CMP="cmp" in cb, HAS_SEL="sel" in cb,
                HAS_WIN="win" in cb, BG=p["BG"], BDV=p["BDV"], num_warps=nw, **pdl,
            )
        return self.out

    def _three(self, q, gates, pos, spos, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, qk, count, pdl):
        c, p = self.config, self.p
        H, G, BH = c.n_kv_heads, c.G, self.B * c.n_kv_heads
        common = dict(H=H, G=G, DK=c.d_k, DV=c.d_v, L=c.l, D=c.d, BG=p["BG"], BDK=p["BDK"], BDV=p["BDV"],
                      PREC=self.prec, COUNT=count)
        dec_cw_partial[(BH, p["nsc"] + p["ns_win"])](
            q_ptr=q, kc_ptr=k_cmp, vc_ptr=v_cmp, kw_ptr=k_win, vw_ptr=v_win, pos_ptr=pos, stride_pos=spos, sc_ptr=self.scores,
            cm_ptr=self.cm, cl_ptr=self.cl, cacc_ptr=self.cacc, pm_ptr=self.sm, pl_ptr=self.sl, pacc_ptr=self.sacc,
            cnt_ptr=self.counts, stride_qb=q.stride(0), stride_qh=q.stride(1), stride_kb=k_cmp.stride(0),
            stride_kt=k_cmp.stride(1), stride_kh=k_cmp.stride(2), stride_vb=v_cmp.stride(0), stride_vt=v_cmp.stride(1),
            stride_vh=v_cmp.stride(2), stride_kwb=k_win.stride(0), stride_kwt=k_win.stride(1), stride_kwh=k_win.stride(2),
            stride_vwb=v_win.stride(0), stride_vwt=v_win.stride(1), stride_vwh=v_win.stride(2), qk_scale=qk, TCS=p["TCS"], W=c.w,
            NSC=p["nsc"], NS_SEL=p["ns_sel"], NS_TOT=p["ns_tot"], WIN_PER=p["win_per"], NWC=p["nwc"], BLOCK_C=p["block_c"],
            BW=p["bw"], SMALL_DOT=p["block_c"] < DOT_MIN, num_warps=p["warps"], **common, **pdl,
        )
        dec_sel_topn[(BH, p["ns_sel"])](
            q_ptr=q, ks_ptr=k_sel, vs_ptr=v_sel, pos_ptr=pos, stride_pos=spos, sc_ptr=self.scores, psum_ptr=self.sel_psum,
            cm_ptr=self.cm, cl_ptr=self.cl, idx_ptr=self.indices, pm_ptr=self.sm, pl_ptr=self.sl, pacc_ptr=self.sacc,
            cnt_ptr=self.counts, stride_qb=q.stride(0), stride_qh=q.stride(1), stride_ksb=k_sel.stride(0),
            stride_kst=k_sel.stride(1), stride_ksh=k_sel.stride(2), stride_vsb=v_sel.stride(0), stride_vst=v_sel.stride(1),
            stride_vsh=v_sel.stride(2), qk_scale=qk, TCS=p["TCS"], LS=c.l_sel, N_SEL=c.n_sel, N_INIT=c.n_init, N_LOCAL=c.n_local,
            NSC=p["nsc"], NSC_PAD=p2(p["nsc"], 2), SEL_PER=p["sel_per"], NS_SEL=p["ns_sel"], NS_TOT=p["ns_tot"],
            BLOCK_T=p["block_t"], TOPK=p["topk"], BLS=p["BLS"], NB_PAD=p["NB_PAD"], BSEL=p["BSEL"], num_warps=p["sel_warps"],
            **common, **pdl,
        )
        dec_combine3[(BH, p["combine_split"])](
            cm_ptr=self.cm, cl_ptr=self.cl, cacc_ptr=self.cacc, pm_ptr=self.sm, pl_ptr=self.sl, pacc_ptr=self.sacc, g_ptr=gates,
            out_ptr=self.out, stride_gb=gates.stride(0), stride_gh=gates.stride(1), stride_ob=self.out.stride(0),
            stride_oh=self.out.stride(1), H=H, G=G, DV=c.d_v, NSC=p["nsc"], NS_SEL=p["ns_sel"], NS_TOT=p["ns_tot"], BG=p["BG"],
            BDV=p["BDV"], BDVC=p["BDV"] // p["combine_split"], num_warps=p["warps"], **pdl,
        )
