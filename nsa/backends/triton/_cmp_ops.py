"""Launchers and autograd wrappers around ``_cmp_kernels`` (compressed and sliding attention).

Tile sizes live in ``TUNE`` (one entry per device type); the interpreter on CPU gets small tiles so
that tests at tiny shapes still cross tile borders.
"""

from __future__ import annotations

import math

import torch
import triton

from ._cmp_kernels import _bwd_dkdv_kernel, _bwd_dq_kernel, _fwd_kernel, _topn_kernel

from . import _interp  # noqa: F401  (interpreter shim, applied on import)
from .rowdot import row_dot

LOG2E = 1.4426950408889634

# rows: query rows per program (BLOCK_M * next_pow2(G)); block_n: keys per tile.
# cuda: measured on one H200 (scripts/bench_cmp_win.py, 2026-11-21): forward 64 rows / 4 warps beat
# 128 / 8; backward 128 rows / 8 warps with the dk/dv split over up to 32 query shares (compressed
# backward at 64k: 47.7 ms; 49.5 with 16 shares; 56.4 at 64 rows / 4 warps; 71.1 unsplit).
TUNE = {
    "cuda": dict(
        rows=64, block_n=64, warps=4, stages=2, score_lo=True, lse_n=128,
        win_rows=128, win_block_n=64, win_warps=8, win_stages=2, win_maxnreg=128,
        bwd_rows=128, bwd_block_n=64, bwd_warps=8, bwd_stages=2, bwd_programs=4096, bwd_split_max=32,
        topn_elems=1024, topn_warps=1,
    ),
    "cpu": dict(
        rows=16, block_n=16, warps=4, stages=1, lse_n=32,
        win_rows=16, win_block_n=16, win_warps=4, win_stages=1,
        bwd_rows=16, bwd_block_n=16, bwd_warps=4, bwd_stages=1, bwd_programs=8, bwd_split_max=4,
        topn_elems=2048, topn_warps=4,
    ),
}
# lse_n: keys per tile of the compressed forward's first pass (log-sum-exp only, no values); 128 took
# the compressed forward at 64k from 23.4 to 22.6 ms (H200, bench_cmp_win.py --tune-fwd, 2026-11-21).
# win_*: the sliding window's forward tiles (its own: no score tiles to hold). 128 rows / 8 warps with
# registers capped at 128 per thread (two programs of 8 warps per SM instead of two of 4; 60 bytes of
# spill): the whole forward at 64k 0.25-0.35 ms faster than 64 rows / 4 warps in the same runs (H200,
# bench_layer_fwd.py --tune, 2026-11-21 19:10-19:12). Without the cap 128 rows / 8 warps was slower.
# maxnreg / win_maxnreg (optional): that register cap for the compressed / window forward.
# topn_elems / topn_warps: score elements and warps per top-n program (rows = topn_elems // width).
# 1024 / 1: the whole 64k top-n 0.47-0.61 ms on two H200s, 2048 / 4 2.15 ms (bench_cmp_win.py
# --tune-topn, 2026-11-21 18:57 and 19:04).
# score_lo: half inputs map p_cmp onto block scores (Eq. 9) with a tensor-core product of p as fp16
# (relative rounding <= 2^-12 per term); True adds a second product with the fp16 remainder
# (~2^-23). Measured on the H200 at 64k (2026-11-21): the compressed forward 23.2 ms without, 24.6 ms
# with it, but without it 0.1 % of the top-n rows differ from the fp32 reference (near-ties) instead
# of ~1e-6: exact selection is kept the default.
# bwd_programs: the dk/dv kernel splits each key tile's query range into up to bwd_split_max shares
# (float32 partials, summed after) until about this many programs run: at 64k the compressed branch
# has only Tc/64 x H = 256 key tiles, too few to fill the GPU's SMs on their own.
# Bytes the [B, chunk, H, nb] float32 block-score buffer of the compressed forward may take: 1 GiB
# holds T = 64k (H=4, l_sel=64) in one chunk, so one launch of the forward and one top-n per bucket.
SCORE_BUFFER_BYTES = 1 << 30
# Fill outputs with NaN before the kernels write them (tests set it: an unwritten element then fails).
POISON = False


def _out(shape, like, dtype=None):
    dtype = like.dtype if dtype is None else dtype
    if POISON:
        fill = float("nan") if dtype.is_floating_point else -7
        return torch.full(shape, fill, device=like.device, dtype=dtype)
    return torch.empty(shape, device=like.device, dtype=dtype)


def _p2(x: int) -> int:
    return triton.next_power_of_2(max(1, int(x)))


def _prec(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"


def _geom(HQ, H, Dk, Dv, device, kind="fwd"):
    """kind: "fwd" (compressed forward), "win" (window forward) or "bwd" (both backwards)."""
    tune = TUNE["cuda" if device.type == "cuda" else "cpu"]
    G = HQ // H
    GP = _p2(G)
    rows = tune[{"fwd": "rows", "win": "win_rows", "bwd": "bwd_rows"}[kind]]
    if max(Dk, Dv) > 128:
        rows = min(rows, 64)  # shared memory: 128 rows of Dk=192 (padded to 256) exceed the H200's 227 KB
    block_m = max(1, rows // GP)
    geo = dict(HQ=HQ, H=H, G=G, GP=GP, DK=Dk, DV=Dv, BDK=max(16, _p2(Dk)), BDV=max(16, _p2(Dv)), BLOCK_M=block_m)
    return geo, tune  # geo: the shape constexprs every kernel of _cmp_kernels takes


def fwd_launch(tune, scores, rows):
    """Launch options of the forward kernel: compressed (``scores``) or window; ``rows`` per program
    as ``_geom`` set them. The window's warps and register cap go with win_rows: where large head dims
    cap the rows below it, the window launches with 4 warps and no cap."""
    if scores:
        launch = dict(num_warps=tune["warps"], num_stages=tune["stages"])
        cap = tune.get("maxnreg")
    elif rows < tune["win_rows"]:
        return dict(num_warps=4, num_stages=tune["win_stages"])
    else:
        launch = dict(num_warps=tune["win_warps"], num_stages=tune["win_stages"])
        cap = tune.get("win_maxnreg")
    if cap:  # registers per thread (ptxas .maxnreg): more programs per SM
        launch["maxnreg"] = cap
    return launch


def _attn_forward(q, k, v, *, scale, q_start, stride, offset, window, config=None, n_blocks=0, on_scored=None):
    """o [B,Tq,HQ,Dv], lse [B,HQ,Tq] (base 2), and with ``config`` the block scores consumed
    chunk by chunk into top-n indices [B,Tq,H,n_sel]. ``on_scored()`` (optional) is called once the
    last chunk's attention and scoring kernel is queued, before its top-n."""
    B, Tq, HQ, Dk = q.shape
    N, H, Dv = k.shape[1], k.shape[2], v.shape[3]
    scores = config is not None
    geo, tune = _geom(HQ, H, Dk, Dv, q.device, "fwd" if scores else "win")
    o = _out((B, Tq, HQ, Dv), q)
    lse = _out((B, HQ, Tq), q, torch.float32)
    launch = fwd_launch(tune, scores, geo["BLOCK_M"] * geo["GP"])
    if scores:
        u = config.l_sel // config.d  # compressed tokens per selection block
        bj = max(1, tune["block_n"] // u)
        bj = max(bj, -(-(config.l - config.d) // config.l_sel))  # the spill fits in one carry
        nstep = u * bj
        nb = n_blocks
        per_row = B * H * max(nb, 1) * 4
        chunk = max(geo["BLOCK_M"], SCORE_BUFFER_BYTES // per_row // geo["BLOCK_M"] * geo["BLOCK_M"])
        idx = _out((B, Tq, H, config.n_sel), q, torch.int64)
        score_dot = q.dtype in (torch.float16, torch.bfloat16)
        kw = dict(
            D_CMP=config.d,
            L_CMP=config.l,
            L_SEL=config.l_sel,
            BJ=bj,
            BJP=max(16, _p2(bj)) if score_dot else _p2(bj),  # tl.dot needs N >= 16 (triton 3.0)
            SCORE_DOT=score_dot,
            SCORE_LO=tune.get("score_lo", True),
            SPILL_W=-(-max(config.l - config.d, 0) // config.l_sel),  # blocks past a tile's end its keys reach
        )
    else:
        nstep = tune["win_block_n"]
        chunk = max(Tq, 1)
        kw = dict(D_CMP=1, L_CMP=1, L_SEL=1, BJ=1, BJP=1, SCORE_DOT=False, SCORE_LO=False, SPILL_W=0)
    for c0 in range(0, Tq, chunk):
        c1 = min(Tq, c0 + chunk)
        if scores:
            # every candidate block (j <= t // l_sel) of every row is written by the kernel: no memset
            sc = _out((B, c1 - c0, H, nb), q, torch.float32)
        else:
            sc = lse  # unused
        grid = (triton.cdiv(c1 - c0, geo["BLOCK_M"]), B * H)
        _fwd_kernel[grid](
            q,
            k,
            v,
            o,
            lse,
            sc,
            *q.stride()[:3],
            *k.stride()[:3],
            *v.stride()[:3],
            *o.stride()[:3],
            sc.stride(0),
            sc.stride(1),
            sc.stride(2) if sc.dim() > 2 else 0,
            N,
            Tq,
            q_start,
            c0,
            c1,
            n_blocks,
            scale * LOG2E,
            **geo,
            BLOCK_N=_p2(nstep),
            NSTEP=nstep,
            STRIDE=stride,
            OFFSET=offset,
            WINDOW=window,
            SCORES=scores,
            PREC=_prec(q.dtype),
            LSE_N=tune["lse_n"],
            **launch,
            **kw,
        )
        if scores:
            if on_scored is not None and c1 == Tq:
                on_scored()
            out = idx if (c0 == 0 and c1 == Tq) else _out((B, c1 - c0, H, config.n_sel), q, torch.int64)
            topn_launch(sc, out, q_start + c0, nb, config)
            if out is not idx:
                idx[:, c0:c1] = out
    return o, lse, (idx if scores else None)


# Columns per segment of the top-n's two-level row view (at most 32: one bit per column of a segment).
TOPN_SEG = 32


def topn_rows(width, n_sel, tune):
    """Rows per top-n program: about ``topn_elems`` score elements (rows with few candidates share a
    program), and the [rows, NSP, NSP] rank comparison at most 4096 elements."""
    return max(1, min(tune["topn_elems"] // width, 4096 // _p2(n_sel) ** 2))


def topn_launch(sc, out, t0, nb, config):
    """Top-n (``_topn_kernel``) of a ``[B, c, H, nb]`` float32 score buffer whose position p sits at
    t0 + p, into ``out [B, c, H, n_sel]``. Positions are cut into ranges whose candidate count
    (t // l_sel + 1) fits the same power of two, and each range reads only that many columns: at 64k,
    about 2/3 of the score columns are never read (non-candidates of early rows)."""
    B, c, H = sc.shape[:3]
    tune = TUNE["cuda" if sc.device.type == "cuda" else "cpu"]
    if c and (t0 + c - 1) // config.l_sel + 1 > nb:
        raise ValueError(f"topn_launch: nb={nb} score columns, but position {t0 + c - 1} has "
                         f"{(t0 + c - 1) // config.l_sel + 1} candidate blocks (need nb >= t // l_sel + 1)")
    p0 = 0
    while p0 < c:
        width = _p2(min(nb, (t0 + p0) // config.l_sel + 1))
        # last position whose candidate count still fits ``width`` (or the end)
        p1 = c if width >= _p2(nb) else min(c, width * config.l_sel - t0)
        rb = topn_rows(width, config.n_sel, tune)
        rows = (p1 - p0) * H
        _topn_kernel[(triton.cdiv(rows, rb), B)](
            sc[:, p0:],
            out[:, p0:],
            rows,
            sc.stride(0),
            out.stride(0),
            nb,
            t0 + p0,
            H=H,
            NBP=width,
            N_SEL=config.n_sel,
            NSP=_p2(config.n_sel),
            N_INIT=config.n_init,
            N_LOCAL=config.n_local,
            L_SEL=config.l_sel,
            RB=rb,
            SEG=min(TOPN_SEG, width),
            num_warps=tune["topn_warps"],
        )
        p0 = p1


def topn_blocks(scores, config, q_start):
    """Eqs. 11-12 with forcing on nonnegative float32 scores ``[B,c,H,nb]`` -> ``[B,c,H,n_sel]``.

    Exactly ``reference.select_blocks``: each candidate gets the int64 key
    (float bits of its score << 32) | (2^31 - 1 - j), so keys are distinct, order by score and
    break ties to the lower index; forced blocks take the bits of +inf, non-candidates -1.
    """
    c, nb = scores.shape[1], scores.shape[3]
    dev = scores.device
    t = q_start + torch.arange(c, device=dev)
    last = (t // config.l_sel)[:, None]
    j = torch.arange(nb, device=dev)[None, :]
    cand = j <= last
    forced = cand & ((j < config.n_init) | (j > last - config.n_local))
    low = (2**31 - 1) - j  # [1, nb]
    bits = scores.contiguous().view(torch.int32).to(torch.int64)
    inf_bits = 0x7F800000
    bits = torch.where(forced[None, :, None, :], torch.full_like(bits, inf_bits), bits)
    key = (bits << 32) | low[None, :, None, :]
    key = torch.where(cand[None, :, None, :], key, torch.full_like(key, -1))
    if nb < config.n_sel:
        key = torch.nn.functional.pad(key, (0, config.n_sel - nb), value=-1)
    vals, sel = torch.topk(key, config.n_sel, dim=-1, sorted=False)
    big = torch.iinfo(torch.int64).max
    sel = torch.where(vals >= 0, sel, torch.full_like(sel, big))
    sel = torch.sort(sel, dim=-1).values
    return torch.where(sel == big, torch.full_like(sel, -1), sel)


def _attn_backward(q, k, v, o, lse, do, *, scale, q_start, stride, offset, window):
    B, Tq, HQ, Dk = q.shape
    N, H, Dv = k.shape[1], k.shape[2], v.shape[3]
    geo, tune = _geom(HQ, H, Dk, Dv, q.device, "bwd")
    do = do.contiguous()
    delta = row_dot(do, o).permute(0, 2, 1).contiguous()  # [B,HQ,Tq]: rowsum(dO * O)
    dq, dk, dv = _out(q.shape, q), _out(k.shape, k), _out(v.shape, v)
    common = dict(
        **geo,
        BLOCK_N=tune["bwd_block_n"],
        STRIDE=stride,
        OFFSET=offset,
        WINDOW=window,
        PREC=_prec(q.dtype),
        num_warps=tune["bwd_warps"],
        num_stages=tune["bwd_stages"],
    )
    if Tq > 0:
        _bwd_dq_kernel[(triton.cdiv(Tq, geo["BLOCK_M"]), B * H)](
            q,
            k,
            v,
            do,
            lse,
            delta,
            dq,
            *q.stride()[:3],
            *k.stride()[:3],
            *v.stride()[:3],
            *do.stride()[:3],
            *dq.stride()[:3],
            N,
            Tq,
            q_start,
            scale * LOG2E,
            scale,
            **common,
        )
    if N > 0:
        n_kt = triton.cdiv(N, tune["bwd_block_n"])
        n_split = max(1, min(tune["bwd_split_max"], -(-tune["bwd_programs"] // (n_kt * B * H)),
                             triton.cdiv(Tq, geo["BLOCK_M"])))
        if n_split > 1:
            dkw = _out((n_split, *k.shape), k, torch.float32)
            dvw = _out((n_split, *v.shape), v, torch.float32)
        else:
            dkw, dvw = dk[None], dv[None]
        _bwd_dkdv_kernel[(n_kt, B * H, n_split)](
            q,
            k,
            v,
            do,
            lse,
            delta,
            dkw,
            dvw,
            *q.stride()[:3],
            *k.stride()[:3],
            *v.stride()[:3],
            *do.stride()[:3],
            *dkw.stride()[1:4],
            *dvw.stride()[1:4],
            dkw.stride(0),
            dvw.stride(0),
            N,
            Tq,
            q_start,
            scale * LOG2E,
            scale,
            **common,
        )
        if n_split > 1:
            dk, dv = dkw.sum(0).to(k.dtype), dvw.sum(0).to(v.dtype)
    return dq, dk, dv


class CompressedAttention(torch.autograd.Function):
    """(o_cmp, indices) of the compressed branch; differentiable in q, k_cmp, v_cmp through o_cmp."""

    @staticmethod
    def forward(ctx, q, k, v, config, scale, q_start, n_blocks, on_scored=None):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        geom = dict(scale=scale, q_start=q_start, stride=config.d, offset=config.l - 1, window=0)
        o, lse, idx = _attn_forward(q, k, v, config=config, n_blocks=n_blocks, on_scored=on_scored, **geom)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.geom = geom
        ctx.mark_non_differentiable(idx)
        return o, idx

    @staticmethod
    def backward(ctx, do, _didx):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _attn_backward(q, k, v, o, lse, do, **ctx.geom)
        return dq, dk, dv, None, None, None, None, None


class WindowAttention(torch.autograd.Function):
    """Sliding-window attention (u in [t-w+1, t]) over raw keys/values."""

    @staticmethod
    def forward(ctx, q, k, v, w, scale, q_start):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        geom = dict(scale=scale, q_start=q_start, stride=1, offset=0, window=w)
        o, lse, _ = _attn_forward(q, k, v, **geom)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.geom = geom
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _attn_backward(q, k, v, o, lse, do, **ctx.geom)
        return dq, dk, dv, None, None, None


def default_scale(q, scale):
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
