"""Triton kernels of the NSA decode step (one query per sequence) and their launcher.

Four launches per step, all reading the query position from device memory (``pos_ptr``) and using
fixed grids and preallocated workspaces, so that one CUDA graph serves every step:

1. ``_dec_cmp_partial``  grid (B*H, NSC): split-KV compressed attention. Each program takes a
   slice of the visible compressed tokens (the slice length follows the position), computes the
   scores of the G heads of its group (log2 domain), keeps them in a scratch row for step 2, and
   writes its flash-decoding partial (running max m, sum l, unnormalized acc).
2. ``_dec_cmp_topk``     grid (B*H,): combines the partials into o_cmp, turns the scratch scores
   into p_cmp (exactly softmax over the visible tokens), sums over the group (Eq. 10), weights by
   the block-aligned overlap (Eq. 9), forces initial/local blocks and takes the top-n by n_sel
   iterative argmaxes in registers (ties to the lower index, Eqs. 11-12). Indices are written
   ascending, -1 padded.
3. ``_dec_sv_partial``   grid (B*H, NS_SEL + NS_WIN): split-KV attention over the selected blocks
   (splits 0..NS_SEL-1) and over the window tokens (the rest), flash-decoding partials.
4. ``_dec_combine``      grid (B*H,): combines the sel partials and the win partials separately,
   applies the gates and adds g_cmp * o_cmp.

On sm_90+ (``tuning.decode.pdl``) the four launch with programmatic dependent launch: each kernel's
programs are launched while the previous kernel runs and wait for it (``griddepcontrol.wait``) before
reading anything, so no launch latency lies between them; outputs are bit-identical to serial launches
(tests/test_decode_gpu.py).

With ``tuning.decode.fuse`` (off by default: slower on the H100, BENCHMARKS.md) the whole step takes
two launches: the program of a group that finishes its pass last (an atomic count per group, released
and acquired at GPU scope) runs step 2 after step 1, and step 4 after step 3, itself.

Optional counters (COUNT): every program adds the number of tokens whose keys/values it loaded to
``cnt[b*H + h, branch]`` (branch 0 cmp, 1 sel, 2 win): counted from the load masks themselves.

:class:`DecodeKernels` owns the workspaces for one (batch, cache size) and runs
``attend(q, gates, ...)`` over the caches it is given (``nsa.decode.GraphDecoder`` gets it from the
dispatch). Branch subsets (``branches``) run only the kernels of those branches, so each can be
timed alone. Launch parameters: ``tuning.params("decode")``.
"""

# No ``from __future__ import annotations`` here: triton 2.3/3.0's JIT reads the kernel annotations
# as objects (string annotations make ``tl.constexpr`` parameters plain runtime arguments).
import torch
import triton
import triton.language as tl

from ...dispatch import BRANCHES
from . import tuning
from .utils import DOT_MIN, LOG2E, capability, default_scale, dot_precision, p2, poisoning

try:  # grid dependency control (programmatic dependent launch, sm_90+): triton >= 3.4
    from triton.language.extra.cuda.gdc import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # the kernels reach these only with PDL=True, which pdl_supported() refuses here
    HAS_GDC = False
    gdc_wait = gdc_launch_dependents = None

NEG = tl.constexpr(-1.0e30)


@triton.jit
def _pdl_enter(PDL: tl.constexpr):
    """With programmatic dependent launch: wait until the previous kernel in the stream has finished
    and its writes are visible, then let the next one start launching (its programs then wait here
    in turn, so no launch latency lies between the step's kernels). Without: nothing."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


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
def _dec_cmp_partial(q_ptr, kc_ptr, vc_ptr, pos_ptr, sc_ptr, pm_ptr, pl_ptr, pacc_ptr, cnt_ptr,
                     psum_ptr, ocmp_ptr, idx_ptr, sem_ptr,
                     stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                     qk_scale, TCS,
                     H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                     L: tl.constexpr, D: tl.constexpr, NSC: tl.constexpr,
                     BG: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BLOCK_C: tl.constexpr,
                     PREC: tl.constexpr, COUNT: tl.constexpr, SMALL_DOT: tl.constexpr, PDL: tl.constexpr,
                     LS: tl.constexpr, NSC_PAD: tl.constexpr, N_SEL: tl.constexpr, N_INIT: tl.constexpr,
                     N_LOCAL: tl.constexpr, BLOCK_T: tl.constexpr, NB_PAD: tl.constexpr, BSEL: tl.constexpr,
                     FUSE: tl.constexpr):
    # FUSE: the last of a group's NSC programs to finish runs the top-n step (_cmp_topk) itself, so the
    # step needs no launch of _dec_cmp_topk; the arguments after PDL serve only it.
    _pdl_enter(PDL)
    # SMALL_DOT: BLOCK_C is below the tl.dot minimum of the running triton (16 on triton 3.0, even
    # under the interpreter); the two products are then broadcast-multiply-sums in fp32.
    bh = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    b = bh // H
    h = bh % H
    t = tl.load(pos_ptr).to(tl.int32)
    n_vis = tl.where(t + 1 >= L, (t + 1 - L) // D + 1, 0)  # compressed tokens i with i*d + l - 1 <= t
    chunk = tl.cdiv(tl.cdiv(n_vis, NSC), BLOCK_C) * BLOCK_C
    c0 = sp * chunk
    c1 = tl.minimum(c0 + chunk, n_vis)
    offs_g = tl.arange(0, BG)
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    offs_c = tl.arange(0, BLOCK_C)
    gmask = offs_g < G
    q = _group_rows(q_ptr, b, h, stride_qb, stride_qh, offs_g, offs_dk, gmask, G, DK)
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
    row = bh * NSC + sp
    tl.store(pm_ptr + row * BG + offs_g, m_i)
    tl.store(pl_ptr + row * BG + offs_g, l_i)
    tl.store(pacc_ptr + row * (BG * BDV) + offs_g[:, None] * BDV + offs_dv[None, :], acc)
    if COUNT:
        tl.atomic_add(cnt_ptr + bh * 3 + 0, tl.maximum(c1 - c0, 0))
    if FUSE:
        if _last_to_arrive(sem_ptr + bh, NSC):
            _cmp_topk(bh, pos_ptr, sc_ptr, pm_ptr, pl_ptr, pacc_ptr, psum_ptr, ocmp_ptr, idx_ptr, TCS, H, G, DV, L, D,
                      LS, NSC, NSC_PAD, N_SEL, N_INIT, N_LOCAL, BG, BDV, BLOCK_T, NB_PAD, BSEL, True)


@triton.jit
def _dec_cmp_topk(pos_ptr, sc_ptr, pm_ptr, pl_ptr, pacc_ptr, psum_ptr, ocmp_ptr, idx_ptr, TCS,
                  H: tl.constexpr, G: tl.constexpr, DV: tl.constexpr,
                  L: tl.constexpr, D: tl.constexpr, LS: tl.constexpr, NSC: tl.constexpr, NSC_PAD: tl.constexpr,
                  N_SEL: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr,
                  BG: tl.constexpr, BDV: tl.constexpr, BLOCK_T: tl.constexpr, NB_PAD: tl.constexpr,
                  BSEL: tl.constexpr, DO_TOPK: tl.constexpr, PDL: tl.constexpr):
    _pdl_enter(PDL)
    _cmp_topk(tl.program_id(0).to(tl.int64), pos_ptr, sc_ptr, pm_ptr, pl_ptr, pacc_ptr, psum_ptr, ocmp_ptr, idx_ptr,
              TCS, H, G, DV, L, D, LS, NSC, NSC_PAD, N_SEL, N_INIT, N_LOCAL, BG, BDV, BLOCK_T, NB_PAD, BSEL, DO_TOPK)


@triton.jit
def _cmp_topk(bh, pos_ptr, sc_ptr, pm_ptr, pl_ptr, pacc_ptr, psum_ptr, ocmp_ptr, idx_ptr, TCS,
              H: tl.constexpr, G: tl.constexpr, DV: tl.constexpr,
              L: tl.constexpr, D: tl.constexpr, LS: tl.constexpr, NSC: tl.constexpr, NSC_PAD: tl.constexpr,
              N_SEL: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr,
              BG: tl.constexpr, BDV: tl.constexpr, BLOCK_T: tl.constexpr, NB_PAD: tl.constexpr,
              BSEL: tl.constexpr, DO_TOPK: tl.constexpr):
    """Group bh's compressed output from the NSC split partials, and (DO_TOPK) its top-n blocks."""
    t = tl.load(pos_ptr).to(tl.int32)
    n_vis = tl.where(t + 1 >= L, (t + 1 - L) // D + 1, 0)
    offs_g = tl.arange(0, BG)
    offs_dv = tl.arange(0, BDV)
    gmask = offs_g < G
    # ---- combine the split partials: o_cmp, and each head's softmax max M and normalizer Lsum
    # (one tile load for m / l; the acc loop is unrolled so its loads are all in flight at once)
    offs_s = tl.arange(0, NSC_PAD)
    smask = offs_s[:, None] < NSC
    prow = (bh * NSC + offs_s)[:, None] * BG + offs_g[None, :]
    ms = tl.load(pm_ptr + prow, mask=smask, other=NEG)
    M = tl.max(ms, 0)
    Lsum = tl.sum(tl.load(pl_ptr + prow, mask=smask, other=0.0) * tl.exp2(ms - M[None, :]), 0)
    acc = tl.zeros([BG, BDV], tl.float32)
    for sp in tl.static_range(NSC):
        row = bh * NSC + sp
        w = tl.exp2(tl.load(pm_ptr + row * BG + offs_g) - M)
        acc += tl.load(pacc_ptr + row * (BG * BDV) + offs_g[:, None] * BDV + offs_dv[None, :]) * w[:, None]
    Lsafe = tl.where(Lsum > 0, Lsum, 1.0)
    o = tl.where(Lsum[:, None] > 0, acc / Lsafe[:, None], 0.0)  # no visible token: o_cmp = 0
    b = bh // H
    h = bh % H
    tl.store(ocmp_ptr + (b * (H * G) + h * G + offs_g)[:, None] * DV + offs_dv[None, :], o,
             mask=gmask[:, None] & (offs_dv[None, :] < DV))
    if DO_TOPK:
        # ---- Eq. 10 first (Eq. 9's weights do not depend on the head): P[i] = sum_g p_cmp[g, i]
        offs_t = tl.arange(0, BLOCK_T)
        s_base = sc_ptr + bh * G * TCS
        psum_base = psum_ptr + bh * TCS
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
        chosen = j < 0
        for _ in tl.static_range(N_SEL):
            mx = tl.max(key, 0)
            hit = (key == mx) & (key >= 0)
            chosen = chosen | hit
            key = tl.where(hit, -1, key)
        ci = chosen.to(tl.int32)
        rank = tl.cumsum(ci, 0) - 1  # ascending order of the chosen blocks
        tl.store(idx_ptr + bh * N_SEL + rank, j, mask=chosen)
        cnt = tl.sum(ci, 0)
        ks = tl.arange(0, BSEL)
        tl.store(idx_ptr + bh * N_SEL + ks, tl.full([BSEL], -1, tl.int32), mask=(ks >= cnt) & (ks < N_SEL))


@triton.jit
def _dec_sv_partial(q_ptr, ks_ptr, vs_ptr, kw_ptr, vw_ptr, idx_ptr, pos_ptr, pm_ptr, pl_ptr, pacc_ptr, cnt_ptr,
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
    gated output (_combine), so the step needs no launch of _dec_combine; ocmp .. stride_oh serve it."""
    _pdl_enter(PDL)
    bh = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1) + SPLIT_OFF
    b = bh // H
    h = bh % H
    t = tl.load(pos_ptr).to(tl.int32)
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
    row = bh * NS_TOT + sp
    tl.store(pm_ptr + row * BG + offs_g, m_i)
    tl.store(pl_ptr + row * BG + offs_g, l_i)
    tl.store(pacc_ptr + row * (BG * BDV) + offs_g[:, None] * BDV + offs_dv[None, :], acc)
    if COUNT:
        tl.atomic_add(cnt_ptr + bh * 3 + tl.where(is_sel, 1, 2), n_read)
    if FUSE:
        if _last_to_arrive(sem_ptr + bh, NS_TOT):
            _combine(bh, pm_ptr, pl_ptr, pacc_ptr, ocmp_ptr, g_ptr, out_ptr, stride_gb, stride_gh, stride_ob, stride_oh,
                     H, G, DV, NS_SEL, NS_TOT, True, True, True, BG, BDV)


@triton.jit
def _add_merged(o, g_base, gmask, pm_ptr, pl_ptr, pacc_ptr, bh, offs_g, offs_dv, C: tl.constexpr, SP0: tl.constexpr,
                SP1: tl.constexpr, NS_TOT: tl.constexpr, BG: tl.constexpr, BDV: tl.constexpr):
    """o + g_c * (flash-decoding merge of the partials of splits SP0..SP1-1): branch c's gated output."""
    M = tl.full([BG], NEG, tl.float32)
    for sp in tl.static_range(SP0, SP1):
        M = tl.maximum(M, tl.load(pm_ptr + (bh * NS_TOT + sp) * BG + offs_g))
    Ls = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BDV], tl.float32)
    for sp in tl.static_range(SP0, SP1):
        row = bh * NS_TOT + sp
        w = tl.exp2(tl.load(pm_ptr + row * BG + offs_g) - M)
        Ls += tl.load(pl_ptr + row * BG + offs_g) * w
        acc += tl.load(pacc_ptr + row * (BG * BDV) + offs_g[:, None] * BDV + offs_dv[None, :]) * w[:, None]
    g = tl.load(g_base + C, mask=gmask, other=0.0).to(tl.float32)
    return o + g[:, None] * (acc / tl.where(Ls > 0, Ls, 1.0)[:, None])


@triton.jit
def _dec_combine(pm_ptr, pl_ptr, pacc_ptr, ocmp_ptr, g_ptr, out_ptr, stride_gb, stride_gh, stride_ob, stride_oh,
                 H: tl.constexpr, G: tl.constexpr, DV: tl.constexpr,
                 NS_SEL: tl.constexpr, NS_TOT: tl.constexpr,
                 HAS_CMP: tl.constexpr, HAS_SEL: tl.constexpr, HAS_WIN: tl.constexpr,
                 BG: tl.constexpr, BDV: tl.constexpr, PDL: tl.constexpr):
    """o = g_cmp * o_cmp + g_sel * combine(sel partials) + g_win * combine(win partials)."""
    _pdl_enter(PDL)
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
        o = _add_merged(o, g_base, gmask, pm_ptr, pl_ptr, pacc_ptr, bh, offs_g, offs_dv, 1, 0, NS_SEL, NS_TOT, BG, BDV)
    if HAS_WIN:
        o = _add_merged(o, g_base, gmask, pm_ptr, pl_ptr, pacc_ptr, bh, offs_g, offs_dv, 2, NS_SEL, NS_TOT, NS_TOT, BG,
                        BDV)
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :],
             o.to(out_ptr.dtype.element_ty), mask=omask)


def pdl_supported(device=None) -> bool:
    """Programmatic dependent launch on ``device`` (default: the current CUDA device): triton's grid
    dependency control and a GPU of sm_90 or later."""
    return HAS_GDC and torch.cuda.is_available() and capability(device)[0] >= 9


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
    return dict(pdl=pdl, fuse=tune["fuse"], BG=p2(c.G, 16), BDK=p2(c.d_k, 16), BDV=p2(c.d_v, 16), TCS=TCS,
                block_c=block_c, nsc=nsc,
                NB_PAD=p2(c.n_blocks(max_len), 16), BSEL=p2(c.n_sel, 2), BLS=p2(c.l_sel, 16), bw=bw, nwc=nwc,
                sel_per=sel_per, sel_vec=tune["sel_vec"] or p2(sel_per), win_per=win_per, ns_sel=ns_sel,
                ns_win=ns_win, ns_tot=ns_sel + ns_win, warps=tune["warps"], topk_warps=tune["topk_warps"],
                block_t=tune["block_t"])


class DecodeKernels:
    """Workspaces + launch parameters of the decode step for ``B`` sequences and caches of
    ``max_len`` raw tokens (``TCS`` rows of compressed cache). ``n_sm`` (default: the device's
    multiprocessor count, 4 on CPU) sizes the split-KV grids so that B=1 still fills the GPU."""

    def __init__(self, config, B: int, max_len: int, device, *, dtype, n_sm: int | None = None):
        c = self.config = config
        device = torch.device(device)
        self.B, self.max_len, self.device, self.dtype = B, max_len, device, dtype
        gpu = device.type == "cuda"
        if n_sm is None:
            n_sm = torch.cuda.get_device_properties(device).multi_processor_count if gpu else 4
        self.p = launch_params(c, B, max_len, gpu=gpu, n_sm=n_sm, tune=tuning.params("decode", device),
                               device=device if gpu else None)
        self.prec = dot_precision(dtype)
        H, G, p = c.n_kv_heads, c.G, self.p
        f32 = {"device": device, "dtype": torch.float32}
        BH = B * H
        self.scores = torch.empty(BH, G, p["TCS"], **f32)
        self.psum = torch.empty(BH, p["TCS"], **f32)
        self.cm = torch.empty(BH, p["nsc"], p["BG"], **f32)
        self.cl = torch.empty(BH, p["nsc"], p["BG"], **f32)
        self.cacc = torch.empty(BH, p["nsc"], p["BG"], p["BDV"], **f32)
        self.o_cmp = torch.zeros(B, c.n_heads, c.d_v, **f32)
        self.sm = torch.empty(BH, p["ns_tot"], p["BG"], **f32)
        self.sl = torch.empty(BH, p["ns_tot"], p["BG"], **f32)
        self.sacc = torch.empty(BH, p["ns_tot"], p["BG"], p["BDV"], **f32)
        self.indices = torch.full((B, H, c.n_sel), -1, device=device, dtype=torch.int32)
        self.counts = torch.zeros(BH, 3, device=device, dtype=torch.int32)
        self.sem = torch.zeros(2, BH, device=device, dtype=torch.int32)  # fused steps: programs done per group
        self.out = torch.empty(B, c.n_heads, c.d_v, device=device, dtype=dtype)

    # ------------------------------------------------------------------------------------------
    def attend(self, q, gates, pos, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, *, scale=None,
               branches=("cmp", "sel", "win"), combine=True, combine_branches=None, count=False, topk=True):
        """One decode step's attention for the query at position ``pos`` (a device int tensor [1]).

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
        if poisoning():
            self.out.fill_(float("nan"))
        if count:
            self.counts.zero_()
        # The whole step with fuse: two launches (the top-n and the combine run in the last program of
        # the compressed pass and of the sel/win pass); timing a part alone takes the four-kernel path.
        fuse = p["fuse"] and set(branches) == set(BRANCHES) and combine and topk and \
            (combine_branches is None or set(combine_branches) == set(BRANCHES))
        topk_args = dict(LS=c.l_sel, NSC_PAD=p2(p["nsc"], 2), N_SEL=c.n_sel, N_INIT=c.n_init, N_LOCAL=c.n_local,
                         BLOCK_T=p["block_t"], NB_PAD=p["NB_PAD"], BSEL=p["BSEL"])
        if "cmp" in branches:
            _dec_cmp_partial[(BH, p["nsc"])](
                q, k_cmp, v_cmp, pos, self.scores, self.cm, self.cl, self.cacc, self.counts,
                self.psum, self.o_cmp, self.indices, self.sem[0],
                q.stride(0), q.stride(1), k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2),
                v_cmp.stride(0), v_cmp.stride(1), v_cmp.stride(2), qk, p["TCS"],
                H=H, G=G, DK=c.d_k, DV=c.d_v, L=c.l, D=c.d, NSC=p["nsc"],
                BG=p["BG"], BDK=p["BDK"], BDV=p["BDV"], BLOCK_C=p["block_c"], PREC=self.prec, COUNT=count,
                SMALL_DOT=p["block_c"] < DOT_MIN, num_warps=nw, FUSE=fuse, **topk_args, **pdl)
            if not fuse:
                _dec_cmp_topk[(BH,)](
                    pos, self.scores, self.cm, self.cl, self.cacc, self.psum, self.o_cmp, self.indices, p["TCS"],
                    H=H, G=G, DV=c.d_v, L=c.l, D=c.d, NSC=p["nsc"], BG=p["BG"], BDV=p["BDV"], DO_TOPK=topk,
                    num_warps=p["topk_warps"], **topk_args, **pdl)
        has_sel, has_win = "sel" in branches, "win" in branches
        if has_sel or has_win:
            off = 0 if has_sel else p["ns_sel"]
            n = (p["ns_sel"] if has_sel else 0) + (p["ns_win"] if has_win else 0)
            _dec_sv_partial[(BH, n)](
                q, k_sel, v_sel, k_win, v_win, self.indices, pos, self.sm, self.sl, self.sacc, self.counts,
                self.o_cmp, gates, self.out, self.sem[1],
                gates.stride(0), gates.stride(1), self.out.stride(0), self.out.stride(1),
                q.stride(0), q.stride(1),
                k_sel.stride(0), k_sel.stride(1), k_sel.stride(2), v_sel.stride(0), v_sel.stride(1), v_sel.stride(2),
                k_win.stride(0), k_win.stride(1), k_win.stride(2), v_win.stride(0), v_win.stride(1), v_win.stride(2),
                qk, H=H, G=G, DK=c.d_k, DV=c.d_v, LS=c.l_sel, W=c.w, N_SEL=c.n_sel,
                NS_SEL=p["ns_sel"], SEL_PER=p["sel_per"], SEL_VEC=p["sel_vec"], NS_TOT=p["ns_tot"],
                WIN_PER=p["win_per"], NWC=p["nwc"], SPLIT_OFF=off, BG=p["BG"], BDK=p["BDK"], BDV=p["BDV"],
                BLS=p["BLS"], BW=p["bw"], PREC=self.prec, COUNT=count, num_warps=nw, FUSE=fuse, **pdl)
        cb = branches if combine_branches is None else combine_branches
        if combine and not fuse:
            _dec_combine[(BH,)](
                self.sm, self.sl, self.sacc, self.o_cmp, gates, self.out,
                gates.stride(0), gates.stride(1), self.out.stride(0), self.out.stride(1),
                H=H, G=G, DV=c.d_v, NS_SEL=p["ns_sel"], NS_TOT=p["ns_tot"],
                HAS_CMP="cmp" in cb, HAS_SEL="sel" in cb, HAS_WIN="win" in cb,
                BG=p["BG"], BDV=p["BDV"], num_warps=nw, **pdl)
        return self.out
