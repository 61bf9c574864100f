"""Triton top-n with forcing (spec step 4; paper Eqs. 11-12): float32 block scores ``[B, c, H, nb]``
-> the selected block indices ``[B, c, H, n_sel]``, ascending, -1 padded; the order of
``nsa.reference.select_blocks`` (by score, ties to the lower index). Launch parameters:
``tuning.params("topn")``.
"""

# No ``from __future__ import annotations`` here: triton 2.3/3.0's JIT reads the kernel annotations
# as objects (string annotations make ``tl.constexpr`` parameters plain runtime arguments).
import triton
import triton.language as tl

from . import tuning
from .utils import p2

# Columns per segment of the top-n's two-level row view (at most 32: one bit per column of a segment).
TOPN_SEG = 32


@triton.jit
def _free(j, last, nb, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr):
    """Columns j (broadcast against rows' last = t // l_sel) that are candidates (j <= last, j < nb)
    and not forced (j >= N_INIT, j <= last - N_LOCAL); no ~, which triton 3.0's interpreter lacks."""
    return (j < nb) & (j >= N_INIT) & (j <= last - N_LOCAL)


@triton.jit
def topn_kernel(
    SC, IDX, POS, n_rows, ssc_b, sidx_b, nb, t0,
    H: tl.constexpr, NBP: tl.constexpr, N_SEL: tl.constexpr, NSP: tl.constexpr, N_INIT: tl.constexpr,
    N_LOCAL: tl.constexpr, L_SEL: tl.constexpr, RB: tl.constexpr, SEG: tl.constexpr, VARLEN: tl.constexpr,
):
    """Eqs. 11-12 with forcing. Batch b = program_id(1); its rows r = (position, head) of a
    [rows, nb] float32 score slice (``ssc_b`` elements apart per batch) -> [rows, N_SEL] ascending
    indices, -1 padded (``sidx_b`` apart); row r sits at position t0 + r // H (VARLEN, packed
    documents: at POS[r // H], its position in its document; else POS is None). Only columns < NBP are
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
    if VARLEN:
        t = tl.load(POS + r // H, mask=r_ok, other=0)
    else:
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


def topn_rows(width, n_sel, tune):
    """Rows per top-n program: about ``tune["elems"]`` score elements (rows with few candidates share
    a program), and the [rows, NSP, NSP] rank comparison at most 4096 elements."""
    return max(1, min(tune["elems"] // width, 4096 // p2(n_sel) ** 2))


def _ranges(c, t0, nb, l_sel):
    """(p0, p1, width): positions t0+p0 .. t0+p1-1 whose candidate count (t // l_sel + 1) fits the power
    of two ``width`` (at most p2(nb))."""
    p0 = 0
    while p0 < c:
        width = p2(min(nb, (t0 + p0) // l_sel + 1))
        # last position whose candidate count still fits ``width`` (or the end)
        p1 = c if width >= p2(nb) else min(c, width * l_sel - t0)
        yield p0, p1, width
        p0 = p1


def topn_launch(sc, out, t0, nb, config, pos=None):
    """Top-n (``topn_kernel``) of a ``[B, c, H, nb]`` float32 score buffer whose position p sits at
    t0 + p, into ``out [B, c, H, n_sel]``. Positions are cut into ranges whose candidate count
    (t // l_sel + 1) fits the same power of two, and each range reads only that many columns: at 64k,
    about 2/3 of the score columns are never read (non-candidates of early rows). ``pos`` (packed
    documents, B = 1): int32 ``[c]``, each row's position in its document (t0 unused); nb must cover
    the longest document, and one launch reads p2(nb) columns of every row."""
    B, c, H = sc.shape[:3]
    tune = tuning.params("topn", sc.device)
    if pos is None and c and (t0 + c - 1) // config.l_sel + 1 > nb:
        raise ValueError(f"topn_launch: nb={nb} score columns, but position {t0 + c - 1} has "
                         f"{(t0 + c - 1) // config.l_sel + 1} candidate blocks (need nb >= t // l_sel + 1)")
    if B == 0 or c == 0:
        return
    for p0, p1, width in _ranges(c, t0, nb, config.l_sel) if pos is None else [(0, c, p2(nb))]:
        rb = topn_rows(width, config.n_sel, tune)
        rows = (p1 - p0) * H
        topn_kernel[(triton.cdiv(rows, rb), B)](
            SC=sc[:, p0:], IDX=out[:, p0:], POS=pos, n_rows=rows, ssc_b=sc.stride(0), sidx_b=out.stride(0), nb=nb, t0=t0 + p0,
            H=H, NBP=width, N_SEL=config.n_sel, NSP=p2(config.n_sel), N_INIT=config.n_init, N_LOCAL=config.n_local,
            L_SEL=config.l_sel, RB=rb, SEG=min(TOPN_SEG, width), VARLEN=pos is not None, num_warps=tune["warps"],
        )
