"""Triton sliding-window branch (spec step 6), same contract as
``nsa.reference.sliding_window_attention``: attention over u in [max(0, t-w+1), t].

One-pass online-softmax forward over the at most w + BLOCK_M - 1 keys a query tile sees (a key
stream with STRIDE = 1, OFFSET = 0, WINDOW = w, see ``tiles``), GQA rows (a program holds all G
heads of a group); backward: ``attention_bwd`` (dq per query tile, dk/dv per key tile). Launch
parameters: ``tuning.params("window")``.
"""

# No ``from __future__ import annotations`` here: triton 2.3/3.0's JIT reads the kernel annotations
# as objects (string annotations make ``tl.constexpr`` parameters plain runtime arguments).
from typing import Sequence

import torch
import triton
import triton.language as tl

from ...compat import custom_op
from . import attention_bwd, tuning
from .tiles import (forward_rows, geometry, key_range, load_head_rows, load_rows, load_span, query_grid,
                    store_head_rows, visible)
from .utils import LOG2E, default_scale, dot_precision, empty, launch_options, p2


@triton.jit
def _online_tile(q, kb, vb, n0, nn, dk, dv, sk_n, sv_n, n_lo, n_hi, t, row_ok, m_i, l_i, acc, scale_log2,
                 DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, NSTEP: tl.constexpr,
                 WINDOW: tl.constexpr, PREC: tl.constexpr, MASKED: tl.constexpr):
    """One-pass online softmax (Eq. 5 with Eq. 8's normalizer) on keys n0..n0+NSTEP; unmasked tiles
    are visible to every row of the program. Masked tiles load only keys [n_lo, n_hi), those that some
    row of the program may see."""
    n = n0 + nn
    if MASKED:
        k = load_span(kb, n, nn, dk, sk_n, n_lo, n_hi, DK, BDK, NSTEP)
        v = load_span(vb, n, nn, dv, sv_n, n_lo, n_hi, DV, BDV, NSTEP)
    else:
        k = load_rows(kb, n, nn, dk, sk_n, n_hi, DK, BDK, NSTEP, False)
        v = load_rows(vb, n, nn, dv, sv_n, n_hi, DV, BDV, NSTEP, False)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
    if MASKED:
        vis = visible(n, (nn < NSTEP) & (n < n_hi), t, row_ok, WINDOW)  # key n ends at raw position n
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def fwd_kernel(
    Q, K, V, Out, LSE, SC, TILES, CU_Q, CU_K,
    sq_b, sq_t, sq_h, sk_b, sk_n, sk_h, sv_b, sv_n, sv_h, so_b, so_t, so_h, ssc_b, ssc_t, ssc_h,
    N, Tq, q_start, m_begin, m_end, nb, scale_log2,
    HQ: tl.constexpr, H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BDK: tl.constexpr, BDV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NSTEP: tl.constexpr,
    WINDOW: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr,
):
    """o_win [B,Tq,HQ,Dv] and lse [B,HQ,Tq] (base 2) of queries [m_begin, m_end). VARLEN: packed
    documents (B = 1; TILES, CU_Q = CU_K = cu_seqlens, see ``tiles.doc_rows``); else those are None.

    SC, ssc_b, ssc_t, ssc_h, nb are unused (the compressed forward's score buffer): they are kept
    because the parameter list changes the machine code. Without them LLVM orders the prologue's
    loads differently and ptxas allocates registers differently (sm_90: other SASS at Dk 128 and
    192, one register less at 192), so dropping them is a change to measure on the GPU first."""
    # VARLEN: the window stops at the document's first token (keys before it are not in its stream)
    b, h, m0, m, t, head, row_ok, m_begin, m_end, N, Q, Out, LSE, K, V = forward_rows(
        Q, Out, LSE, K, V, TILES, CU_Q, CU_K, sq_t, so_t, sk_n, sv_n, N, q_start, m_begin, m_end, H, G, GP, BLOCK_M,
        VARLEN)
    dk = tl.arange(0, BDK)
    dv = tl.arange(0, BDV)
    q = load_head_rows(Q, b, sq_b, sq_t, sq_h, m, head, dk, row_ok, DK)
    tmin, tmax, hi = key_range(q_start, m0, m_end, N, 1, 0, BLOCK_M)
    first = tl.maximum(tmin - WINDOW + 1, 0)  # the first key any row of the tile sees
    lo = (first // NSTEP) * NSTEP
    kb = K + b * sk_b + h * sk_h
    vb = V + b * sv_b + h * sv_h
    nn = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M * GP], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GP], tl.float32)
    acc = tl.zeros([BLOCK_M * GP, BDV], tl.float32)
    # Tiles [mid_lo, mid_hi) lie inside every row's window (i in [tmax - W + 1, tmin]) and skip the
    # mask; padding rows see them too (q = 0 there: finite, and never stored).
    mid_lo = hi
    mid_hi = hi
    if NSTEP == BLOCK_N:
        mid_lo = tl.minimum(tl.maximum((tl.maximum(tmax - WINDOW + 1, 0) + NSTEP - 1) // NSTEP * NSTEP, lo), hi)
        mid_hi = tl.maximum((tmin + 1) // NSTEP * NSTEP, mid_lo)
    for n0 in range(lo, mid_lo, NSTEP):
        m_i, l_i, acc = _online_tile(q, kb, vb, n0, nn, dk, dv, sk_n, sv_n, first, hi, t, row_ok, m_i, l_i, acc,
                                     scale_log2, DK, DV, BDK, BDV, NSTEP, WINDOW, PREC, True)
    for n0 in range(mid_lo, mid_hi, NSTEP):
        m_i, l_i, acc = _online_tile(q, kb, vb, n0, nn, dk, dv, sk_n, sv_n, first, hi, t, row_ok, m_i, l_i, acc,
                                     scale_log2, DK, DV, BDK, BDV, NSTEP, WINDOW, PREC, False)
    for n0 in range(mid_hi, hi, NSTEP):
        m_i, l_i, acc = _online_tile(q, kb, vb, n0, nn, dk, dv, sk_n, sv_n, first, hi, t, row_ok, m_i, l_i, acc,
                                     scale_log2, DK, DV, BDK, BDV, NSTEP, WINDOW, PREC, True)
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("inf"))
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    store_head_rows(Out, o, b, so_b, so_t, so_h, m, head, dv, row_ok, DV)
    # LSE layout: [B, HQ, Tq] float32, base 2
    tl.store(LSE + (b * HQ + head).to(tl.int64) * Tq + m, lse, mask=row_ok)


def _forward(q, k, v, w, *, scale, q_start, tune, varlen=None):
    """o [B,Tq,HQ,Dv] and lse [B,HQ,Tq] (base 2); ``varlen``: packed documents (B = 1)."""
    B, Tq, HQ, Dk = q.shape
    N, H, Dv = k.shape[1], k.shape[2], v.shape[3]
    geo = geometry(HQ, H, Dk, Dv, tune["rows"])
    o = empty((B, Tq, HQ, Dv), q)
    lse = empty((B, HQ, Tq), q, torch.float32)
    # The tuned warps and register cap go with the tuned rows: where large head dims cap the rows
    # below them, the window launches with 4 warps and no cap.
    launch = launch_options(tune) if geo["BLOCK_M"] * geo["GP"] >= tune["rows"] else dict(
        num_warps=4, num_stages=tune["stages"])
    nstep = tune["block_n"]
    if B and Tq:
        grid, docs = query_grid(varlen, geo["BLOCK_M"], B, H, q.device, 0, Tq)
        fwd_kernel[grid](
            Q=q, K=k, V=v, Out=o, LSE=lse, SC=lse, TILES=docs[0], CU_Q=docs[1], CU_K=docs[2], sq_b=q.stride(0), sq_t=q.stride(1),
            sq_h=q.stride(2), sk_b=k.stride(0), sk_n=k.stride(1), sk_h=k.stride(2), sv_b=v.stride(0), sv_n=v.stride(1),
            sv_h=v.stride(2), so_b=o.stride(0), so_t=o.stride(1), so_h=o.stride(2), ssc_b=lse.stride(0), ssc_t=lse.stride(1),
            ssc_h=lse.stride(2), N=N, Tq=Tq, q_start=q_start, m_begin=0, m_end=Tq, nb=0, scale_log2=scale * LOG2E, **geo,
            BLOCK_N=p2(nstep), NSTEP=nstep, WINDOW=w, PREC=dot_precision(q.dtype), VARLEN=varlen is not None, **launch,
        )
    return o, lse


def _window_fwd_fake(q, k, v, w, scale, q_start, tune):
    B, Tq, HQ, _ = q.shape
    return q.new_empty(B, Tq, HQ, v.shape[3]), q.new_empty(B, HQ, Tq, dtype=torch.float32)


@custom_op("nsa::window_fwd", _window_fwd_fake)
def _window_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: int, scale: float, q_start: int,
                   tune: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_forward` of one sequence per batch row: (o, lse); ``tune`` from ``tuning.to_ints``."""
    return _forward(q, k, v, w, scale=scale, q_start=q_start, tune=tuning.from_ints("window", tune))


class WindowAttention(torch.autograd.Function):
    """Sliding-window attention (u in [t-w+1, t]) over raw keys/values. By the custom ops ``nsa::window_fwd`` and
    ``nsa::attention_bwd`` (see the package docstring); packed documents (``varlen``), whose tables no op
    schema carries, call the functions beneath (eager only)."""

    @staticmethod
    def forward(ctx, q, k, v, w, scale, q_start, varlen=None):
        """Arguments:
            ctx: autograd's context; q, k, v: ``[B,Tq,HQ,Dk]``, ``[B,S,H,Dk]``, ``[B,S,H,Dv]``.
            w: the window; scale: the softmax scale; q_start: the first query's position; varlen: packed
            documents or None.

        Returns:
            ``o_win [B,Tq,HQ,Dv]``.
        """
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        tune = tuning.params("window", q.device)
        if varlen is None:
            o, lse = _window_fwd_op(q, k, v, int(w), float(scale), int(q_start), tuning.to_ints("window", tune))
        else:
            o, lse = _forward(q, k, v, w, scale=scale, q_start=q_start, tune=tune, varlen=varlen)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.geom = dict(scale=scale, q_start=q_start, stride=1, offset=0, window=w,
                        tune=tuning.params("attention_bwd", q.device), varlen=varlen)
        return o

    @staticmethod
    def backward(ctx, do):
        """Arguments:
            ctx: autograd's context; do: the gradient of o_win.

        Returns:
            ``(dq, dk, dv)`` and None for every other input of :meth:`forward`.
        """
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = attention_bwd.backward(q, k, v, o, lse, do, **ctx.geom)
        return dq, dk, dv, None, None, None, None


def sliding_window_attention(q, k_win, v_win, config, *, scale=None, q_start: int = 0, varlen=None):
    """``varlen``: packed documents (a ``nsa.varlen.Varlen``, B = 1)."""
    return WindowAttention.apply(q, k_win, v_win, int(config.w), default_scale(q, scale), int(q_start), varlen)
