"""Triton backward of the compressed and sliding-window attention (flash-style), shared by both: they
are the same key stream (``tiles``) with different STRIDE / OFFSET / WINDOW.

A dq kernel (per query tile, looping over the keys it sees) and a dk/dv kernel (per key tile,
looping over the query tiles that see it, split into query shares when there are too few key tiles
to fill the GPU), both recomputing p from the forward's log-sum-exp (base 2) and using
delta = rowsum(dO * O) (``rowdot``). Launch parameters: ``tuning.params("attention_bwd")``, fixed by
the forward. Packed documents (VARLEN): query tiles and key tiles come from ``nsa.varlen`` tile tables,
each within one document (``tiles.doc_span``).
"""

# No ``from __future__ import annotations`` here: triton 2.3/3.0's JIT reads the kernel annotations
# as objects (string annotations make ``tl.constexpr`` parameters plain runtime arguments).
from typing import Sequence

import torch
import triton
import triton.language as tl

from ...compat import custom_op
from . import tuning
from .rowdot import row_dot
from .tiles import (at_doc, doc_rows, doc_span, geometry, group_rows, key_range, load_head_rows, load_row_stats,
                    load_rows, query_grid, query_rows, store_head_rows, visible)
from .utils import LOG2E, descriptor, dot_precision, empty, tma_ok


@triton.jit
def _query_rows(Q, DO, QD, DOD, b, h, m0, m, head, dk, dv, row_ok, sq_b, sq_t, sq_h, sdo_b, sdo_t, sdo_h,
                G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
                BLOCK_M: tl.constexpr, TMA: tl.constexpr):
    """(q, dO) of the tile's rows (positions m from m0, heads of group h): through the descriptors QD, DOD
    (TMA) or per-element pointers; 0 where not row_ok either way."""
    if TMA:
        return group_rows(QD, b, m0, h, BLOCK_M, G, BDK), group_rows(DOD, b, m0, h, BLOCK_M, G, BDV)
    return (load_head_rows(Q, b, sq_b, sq_t, sq_h, m, head, dk, row_ok, DK),
            load_head_rows(DO, b, sdo_b, sdo_t, sdo_h, m, head, dv, row_ok, DV))


@triton.jit
def bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, QD, KD, VD, DOD, TILES, CU_Q, CU_K, sq_b, sq_t, sq_h, sk_b, sk_n, sk_h, sv_b, sv_n, sv_h,
    sdo_b, sdo_t, sdo_h, sdq_b, sdq_t, sdq_h, N, Tq, q_start, scale_log2, scale,
    HQ: tl.constexpr, H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BDK: tl.constexpr, BDV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STRIDE: tl.constexpr,
    OFFSET: tl.constexpr, WINDOW: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr, TMA: tl.constexpr,
):
    """dq of one query tile (VARLEN: of a tile-table entry, rows of one document; Tq stays the row
    stride of LSE/DELTA [B,HQ,Tq]). TMA: q, dO, k, v through the descriptors QD, KD, VD, DOD."""
    if VARLEN:
        h, m0, m, t, head, row_ok, q0, k0, N, m_begin, m_end = doc_rows(TILES, CU_Q, CU_K, 0, Tq, G, GP, BLOCK_M)
        b = 0
        Q, DO, LSE, K, V = at_doc(Q, DO, LSE, K, V, q0, k0, sq_t, sdo_t, sk_n, sv_n)
        DELTA += q0
        DQ += q0 * sdq_t
    else:
        b, h, m0, m, t, head, row_ok = query_rows(q_start, 0, Tq, H, G, GP, BLOCK_M)
        m_end = Tq
    dk = tl.arange(0, BDK)
    dv = tl.arange(0, BDV)
    q, do = _query_rows(Q, DO, QD, DOD, b, h, m0, m, head, dk, dv, row_ok, sq_b, sq_t, sq_h, sdo_b, sdo_t, sdo_h,
                        G, DK, DV, BDK, BDV, BLOCK_M, TMA)
    lse, delta = load_row_stats(LSE, DELTA, b, head, m, row_ok, HQ, Tq)
    tmin, tmax, hi = key_range(q_start, m0, m_end, N, STRIDE, OFFSET, BLOCK_M)
    if WINDOW > 0:
        lo = tl.maximum(tmin - WINDOW + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    else:
        lo = 0
    kb = K + b * sk_b + h * sk_h
    vb = V + b * sv_b + h * sv_h
    nn = tl.arange(0, BLOCK_N)
    dq = tl.zeros([BLOCK_M * GP, BDK], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + nn
        n_ok = n < N
        if TMA:
            k = tl.reshape(KD.load([b.to(tl.int32), n0, h, 0]), [BLOCK_N, BDK])
            v = tl.reshape(VD.load([b.to(tl.int32), n0, h, 0]), [BLOCK_N, BDV])
        else:
            k = load_rows(kb, n, nn, dk, sk_n, N, DK, BDK, BLOCK_N, True)
            v = load_rows(vb, n, nn, dv, sv_n, N, DV, BDV, BLOCK_N, True)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
        vis = visible(n * STRIDE + OFFSET, n_ok, t, row_ok, WINDOW)
        p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    dq = dq * scale
    store_head_rows(DQ, dq, b, sdq_b, sdq_t, sdq_h, m, head, dk, row_ok, DK)


@triton.jit
def _dkdv_queries(n0, N, Tq, q_start, pid_s, n_split, STRIDE: tl.constexpr, OFFSET: tl.constexpr,
                  WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[m_lo, m_hi): the query rows of share pid_s (of n_split, whole query tiles) that see some key of
    the tile starting at n0: t >= e(n0) (and t < e(last) + WINDOW)."""
    m_lo = tl.maximum(n0 * STRIDE + OFFSET - q_start, 0)
    m_lo = (m_lo // BLOCK_M) * BLOCK_M
    if WINDOW > 0:
        last = tl.minimum(n0 + BLOCK_N, N) - 1
        m_hi = tl.minimum(last * STRIDE + OFFSET + WINDOW - q_start, Tq)
    else:
        m_hi = Tq
    per = tl.cdiv(tl.cdiv(tl.maximum(m_hi - m_lo, 0), BLOCK_M), n_split) * BLOCK_M
    m_lo = m_lo + pid_s * per
    return m_lo, tl.minimum(m_hi, m_lo + per)


@triton.jit
def _dkdv_tile(Q, DO, QD, DOD, LSE, DELTA, k, v, e, n_ok, m0, m, g, head, b, h, m_end, Tq, q_start, sq_b, sq_t, sq_h,
               sdo_b, sdo_t, sdo_h, dk, dv, dk_acc, dv_acc, scale_log2, HQ: tl.constexpr, G: tl.constexpr, DK: tl.constexpr,
               DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BLOCK_M: tl.constexpr, WINDOW: tl.constexpr,
               PREC: tl.constexpr, TMA: tl.constexpr):
    """dk/dv contributions of the query rows m (position, head; those below m_end) to the key tile (k, v);
    Tq: the row stride of LSE/DELTA."""
    row_ok = (m < m_end) & (g < G)
    t = q_start + m
    q, do = _query_rows(Q, DO, QD, DOD, b, h, m0, m, head, dk, dv, row_ok, sq_b, sq_t, sq_h, sdo_b, sdo_t, sdo_h,
                        G, DK, DV, BDK, BDV, BLOCK_M, TMA)
    lse, delta = load_row_stats(LSE, DELTA, b, head, m, row_ok, HQ, Tq)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
    vis = visible(e, n_ok, t, row_ok, WINDOW)
    p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
    dv_acc += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    ds = p * (dp - delta[:, None])
    dk_acc += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC)
    return dk_acc, dv_acc


@triton.jit
def _store_key_rows(X, x, b, h, s_b, s_n, s_h, n, d, n_ok, D: tl.constexpr):
    """Store rows n of head h of a [B, N, H, D] tensor."""
    tl.store(X + b * s_b + h * s_h + n[:, None].to(tl.int64) * s_n + d[None, :], x.to(X.dtype.element_ty),
             mask=n_ok[:, None] & (d[None, :] < D))


@triton.jit
def bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK_, DV_, QD, DOD, TILES, CU_Q, CU_K, sq_b, sq_t, sq_h, sk_b, sk_n, sk_h, sv_b, sv_n, sv_h,
    sdo_b, sdo_t, sdo_h, sdk_b, sdk_n, sdk_h, sdv_b, sdv_n, sdv_h, sdk_s, sdv_s, N, Tq, q_start, scale_log2, scale,
    HQ: tl.constexpr, H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BDK: tl.constexpr, BDV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STRIDE: tl.constexpr,
    OFFSET: tl.constexpr, WINDOW: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr, TMA: tl.constexpr,
):
    """dk/dv of one key tile (program_id 0; VARLEN: a key-tile table entry, keys of one document) of head
    h; program_id 2 picks the query share, whose float32 partial dk/dv slice (sdk_s / sdv_s apart) the
    launcher sums."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)  # query share
    n_split = tl.num_programs(2)
    if VARLEN:
        q0, k0, m_end, N, n0 = doc_span(TILES, CU_Q, CU_K, pid_n)
        b = 0
        h = pid_bh
        Q, DO, LSE, K, V = at_doc(Q, DO, LSE, K, V, q0, k0, sq_t, sdo_t, sk_n, sv_n)
        DELTA += q0
        DK_ += k0 * sdk_n
        DV_ += k0 * sdv_n
    else:
        b = (pid_bh // H).to(tl.int64)
        h = pid_bh % H
        n0 = pid_n * BLOCK_N
        m_end = Tq
    nn = tl.arange(0, BLOCK_N)
    n = n0 + nn
    n_ok = n < N
    e = n * STRIDE + OFFSET
    dk = tl.arange(0, BDK)
    dv = tl.arange(0, BDV)
    k = load_rows(K + b * sk_b + h * sk_h, n, nn, dk, sk_n, N, DK, BDK, BLOCK_N, True)
    v = load_rows(V + b * sv_b + h * sv_h, n, nn, dv, sv_n, N, DV, BDV, BLOCK_N, True)
    m_lo, m_hi = _dkdv_queries(n0, N, m_end, q_start, pid_s, n_split, STRIDE, OFFSET, WINDOW, BLOCK_M, BLOCK_N)
    r = tl.arange(0, BLOCK_M * GP)
    g = r % GP
    head = h * G + g
    dk_acc = tl.zeros([BLOCK_N, BDK], tl.float32)
    dv_acc = tl.zeros([BLOCK_N, BDV], tl.float32)
    for m0 in range(m_lo, m_hi, BLOCK_M):
        dk_acc, dv_acc = _dkdv_tile(Q, DO, QD, DOD, LSE, DELTA, k, v, e, n_ok, m0, m0 + r // GP, g, head, b, h, m_end,
                                    Tq, q_start, sq_b, sq_t, sq_h, sdo_b, sdo_t, sdo_h, dk, dv, dk_acc, dv_acc,
                                    scale_log2, HQ, G, DK, DV, BDK, BDV, BLOCK_M, WINDOW, PREC, TMA)
    dk_acc = dk_acc * scale
    DK_ += pid_s.to(tl.int64) * sdk_s
    DV_ += pid_s.to(tl.int64) * sdv_s
    _store_key_rows(DK_, dk_acc, b, h, sdk_b, sdk_n, sdk_h, n, dk, n_ok, DK)
    _store_key_rows(DV_, dv_acc, b, h, sdv_b, sdv_n, sdv_h, n, dv, n_ok, DV)


def attention_backward(q, k, v, o, lse, do, *, scale, q_start, stride, offset, window, tune, varlen=None):
    """(dq, dk, dv) of attention over the key stream (stride, offset, window) given the forward's o and
    base-2 lse [B,HQ,Tq]; ``tune``: ``tuning.params("attention_bwd")``; ``varlen``: packed documents (B = 1,
    the key stream packed per document)."""
    B, Tq, HQ, Dk = q.shape
    N, H, Dv = k.shape[1], k.shape[2], v.shape[3]
    geo = geometry(HQ, H, Dk, Dv, tune["rows"])
    do = do.contiguous()
    delta = row_dot(do, o).permute(0, 2, 1).contiguous()  # [B,HQ,Tq]: rowsum(dO * O)
    dq, dk, dv = empty(q.shape, q), empty(k.shape, k), empty(v.shape, v)
    tma = tma_ok(tune["tma"], varlen, HQ // H, geo["GP"], q, k, v, do)
    bm, bn, bdk, bdv = geo["BLOCK_M"], tune["block_n"], geo["BDK"], geo["BDV"]
    qd, dod = (descriptor(q, [1, bm, geo["GP"], bdk]), descriptor(do, [1, bm, geo["GP"], bdv])) if tma else (None, None)
    kd, vd = (descriptor(k, [1, bn, 1, bdk]), descriptor(v, [1, bn, 1, bdv])) if tma else (None, None)
    common = dict(**geo, BLOCK_N=bn, STRIDE=stride, OFFSET=offset, WINDOW=window, PREC=dot_precision(q.dtype),
                  VARLEN=varlen is not None, TMA=tma, num_warps=tune["warps"],
                  num_stages=tuning.by_path(tune, tma, q.element_size())["stages"])
    if B > 0 and Tq > 0:
        grid, docs = query_grid(varlen, geo["BLOCK_M"], B, H, q.device, 0, Tq, stride, offset)
        bwd_dq_kernel[grid](
            Q=q, K=k, V=v, DO=do, LSE=lse, DELTA=delta, DQ=dq, QD=qd, KD=kd, VD=vd, DOD=dod, TILES=docs[0], CU_Q=docs[1],
            CU_K=docs[2], sq_b=q.stride(0), sq_t=q.stride(1), sq_h=q.stride(2), sk_b=k.stride(0), sk_n=k.stride(1),
            sk_h=k.stride(2), sv_b=v.stride(0), sv_n=v.stride(1), sv_h=v.stride(2), sdo_b=do.stride(0), sdo_t=do.stride(1),
            sdo_h=do.stride(2), sdq_b=dq.stride(0), sdq_t=dq.stride(1), sdq_h=dq.stride(2), N=N, Tq=Tq, q_start=q_start,
            scale_log2=scale * LOG2E, scale=scale, **common,
        )
    if B > 0 and N > 0:
        if varlen is None:
            n_kt, docs, q_rows = triton.cdiv(N, tune["block_n"]), (None, None, None), Tq
        else:  # key tiles of each document's keys; a tile's queries are its document's
            tiles = varlen.key_tiles(tune["block_n"], q.device, stride, offset, window)
            n_kt, q_rows = tiles.shape[0], varlen.max_len
            docs = (tiles, varlen.cu(q.device), varlen.cu_keys(q.device, stride, offset))
        n_split = max(1, min(tune["split_max"], -(-tune["programs"] // (n_kt * B * H)),
                             triton.cdiv(q_rows, geo["BLOCK_M"])))
        if n_split > 1:
            dkw = empty((n_split, *k.shape), k, torch.float32)
            dvw = empty((n_split, *v.shape), v, torch.float32)
        else:
            dkw, dvw = dk[None], dv[None]
        bwd_dkdv_kernel[(n_kt, B * H, n_split)](
            Q=q, K=k, V=v, DO=do, LSE=lse, DELTA=delta, DK_=dkw, DV_=dvw, QD=qd, DOD=dod, TILES=docs[0], CU_Q=docs[1],
            CU_K=docs[2], sq_b=q.stride(0), sq_t=q.stride(1), sq_h=q.stride(2), sk_b=k.stride(0), sk_n=k.stride(1),
            sk_h=k.stride(2), sv_b=v.stride(0), sv_n=v.stride(1), sv_h=v.stride(2), sdo_b=do.stride(0), sdo_t=do.stride(1),
            sdo_h=do.stride(2), sdk_b=dkw.stride(1), sdk_n=dkw.stride(2), sdk_h=dkw.stride(3), sdv_b=dvw.stride(1),
            sdv_n=dvw.stride(2), sdv_h=dvw.stride(3), sdk_s=dkw.stride(0), sdv_s=dvw.stride(0), N=N, Tq=Tq, q_start=q_start,
            scale_log2=scale * LOG2E, scale=scale, **common,
        )
        if n_split > 1:
            dk, dv = dkw.sum(0).to(k.dtype), dvw.sum(0).to(v.dtype)
    return dq, dk, dv


def _attention_bwd_fake(q, k, v, o, lse, do, scale, q_start, stride, offset, window, tune):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@custom_op("nsa::attention_bwd", _attention_bwd_fake)
def _attention_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                      do: torch.Tensor, scale: float, q_start: int, stride: int, offset: int, window: int,
                      tune: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`attention_backward` of one sequence per batch row, ``tune`` from ``tuning.to_ints``."""
    return attention_backward(q, k, v, o, lse, do, scale=scale, q_start=q_start, stride=stride, offset=offset,
                              window=window, tune=tuning.from_ints("attention_bwd", tune))


def backward(q, k, v, o, lse, do, *, scale, q_start, stride, offset, window, tune, varlen=None):
    """:func:`attention_backward` by the custom op ``nsa::attention_bwd`` (see the package docstring); packed
    documents (``varlen``), whose tables no op schema carries, call it directly (eager only)."""
    if varlen is not None:
        return attention_backward(q, k, v, o, lse, do, scale=scale, q_start=q_start, stride=stride, offset=offset,
                                  window=window, tune=tune, varlen=varlen)
    return _attention_bwd_op(q, k, v, o, lse, do, float(scale), int(q_start), int(stride), int(offset), int(window),
                             tuning.to_ints("attention_bwd", tune))
