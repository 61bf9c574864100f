"""@triton.jit tile helpers shared by several operations' kernels (compressed, window, their backward,
the gated sum, the row dot).

The compressed and window kernels work on a "key stream" whose key i ends at raw position
``e(i) = i * STRIDE + OFFSET`` and is visible to the query at absolute position t iff ``e(i) <= t``
and (with a window) ``e(i) > t - WINDOW``:

* compressed branch (spec step 1): STRIDE = d, OFFSET = l - 1, no window;
* sliding branch (spec step 6): STRIDE = 1, OFFSET = 0, WINDOW = w.

A program owns one key/value head h and a tile of BLOCK_M query positions, and its rows are the
(position, head-in-group) pairs of that tile: row r = (m, g) with m = r // GP, g = r % GP, query head
h*G + g. So the keys of group h are loaded once for all G heads (GQA), and sums over the group
(Eq. 10) are a reshape and a sum.

Packed documents (``nsa.varlen``; the kernels' constexpr VARLEN): B = 1, and program_id(0) is an entry
of a tile table (``Varlen.query_tiles`` / ``key_tiles``: document, first position) instead of a tile
number. ``doc_span`` reads where that document's queries and keys start in the packed tensors; the
kernel moves its base pointers there and then works as on one sequence of that document's length,
positions counted from its start: no tile straddles two documents.
"""

# No ``from __future__ import annotations`` here: triton 2.3/3.0's JIT reads the kernel annotations
# as objects (string annotations make ``tl.constexpr`` parameters plain runtime arguments).
import triton
import triton.language as tl

from .utils import p2


@triton.jit
def query_rows(q_start, m_begin, m_end, H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """This program's rows over query positions [m_begin, m_end) (grid: query tiles, B*H), the last
    tile first (longest rows first): (b, h, m0, m, t, head, row_ok) with b in int64, m0 the tile's
    first position, m / t / head each row's position, absolute position and query head."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    n_tiles = tl.cdiv(m_end - m_begin, BLOCK_M)
    m0 = m_begin + (n_tiles - 1 - pid_m) * BLOCK_M
    r = tl.arange(0, BLOCK_M * GP)
    m = m0 + r // GP
    g = r % GP
    row_ok = (m < m_end) & (g < G)
    t = q_start + m
    head = h * G + g
    return b, h, m0, m, t, head, row_ok


@triton.jit
def doc_span(TILES, CU_Q, CU_K, pid):
    """Entry ``pid`` of a varlen tile table: (first query row q0 and key row k0 of its document in the
    packed tensors (int64), the document's query and key counts, the tile's first position or key)."""
    doc = tl.load(TILES + 2 * pid)
    first = tl.load(TILES + 2 * pid + 1)
    q0 = tl.load(CU_Q + doc)
    k0 = tl.load(CU_K + doc)
    return q0.to(tl.int64), k0.to(tl.int64), tl.load(CU_Q + doc + 1) - q0, tl.load(CU_K + doc + 1) - k0, first


@triton.jit
def doc_rows(TILES, CU_Q, CU_K, m_begin, m_end, G: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr):
    """The varlen twin of ``query_rows`` (grid: tile-table entries, H): this program's rows of packed rows
    [m_begin, m_end), as (h, m0, m, t, head, row_ok, q0, k0, n_keys, m_begin, m_end) with m0 / m / t and
    the returned bounds in the document's positions (m_begin may be negative: rows before the document)."""
    q0, k0, n_q, n_keys, m0 = doc_span(TILES, CU_Q, CU_K, tl.program_id(0))
    h = tl.program_id(1)
    m_begin = m_begin - q0.to(tl.int32)
    m_end = tl.minimum(m_end - q0.to(tl.int32), n_q)
    r = tl.arange(0, BLOCK_M * GP)
    m = m0 + r // GP
    g = r % GP
    row_ok = (m < m_end) & (g < G)
    return h, m0, m, m, h * G + g, row_ok, q0, k0, n_keys, m_begin, m_end


@triton.jit
def at_doc(Q, O, LSE, K, V, q0, k0, sq_t, so_t, sk_n, sv_n):
    """The pointers of a document: the query-side tensors (q, the output or dO: [B,T,HQ,D]; lse: [B,HQ,T])
    q0 rows on, the key-side ones (k, v: [B,N,H,D]) k0 rows on."""
    return Q + q0 * sq_t, O + q0 * so_t, LSE + q0, K + k0 * sk_n, V + k0 * sv_n


@triton.jit
def forward_rows(Q, Out, LSE, K, V, TILES, CU_Q, CU_K, sq_t, so_t, sk_n, sv_n, N, q_start, m_begin, m_end,
                 H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr, VARLEN: tl.constexpr):
    """A forward program's rows over query rows [m_begin, m_end): ``query_rows``, or with VARLEN ``doc_rows``
    with its document's key count and pointers (``at_doc``). Returns (b, h, m0, m, t, head, row_ok,
    m_begin, m_end, N, Q, Out, LSE, K, V)."""
    if VARLEN:
        h, m0, m, t, head, row_ok, q0, k0, N, m_begin, m_end = doc_rows(TILES, CU_Q, CU_K, m_begin, m_end, G, GP,
                                                                       BLOCK_M)
        b = 0
        Q, Out, LSE, K, V = at_doc(Q, Out, LSE, K, V, q0, k0, sq_t, so_t, sk_n, sv_n)
    else:
        b, h, m0, m, t, head, row_ok = query_rows(q_start, m_begin, m_end, H, G, GP, BLOCK_M)
    return b, h, m0, m, t, head, row_ok, m_begin, m_end, N, Q, Out, LSE, K, V


@triton.jit
def group_rows(XD, b, m0, h, BLOCK_M: tl.constexpr, G: tl.constexpr, BD: tl.constexpr):
    """Rows (m0 + i, h*G + g), i < BLOCK_M, g < G, of a [B, T, HQ, D] tensor through its TMA descriptor
    (block [1, BLOCK_M, G, BD]; zero past T and D), in the row order of ``query_rows``."""
    return tl.reshape(XD.load([b.to(tl.int32), m0, h * G, 0]), [BLOCK_M * G, BD])


@triton.jit
def key_range(q_start, m0, m_end, N, STRIDE: tl.constexpr, OFFSET: tl.constexpr, BLOCK_M: tl.constexpr):
    """(tmin, tmax, hi) of a query tile starting at m0: its first and last absolute positions and
    the number of keys with e(i) <= tmax (at most N)."""
    tmin = q_start + m0
    tmax = q_start + tl.minimum(m0 + BLOCK_M, m_end) - 1
    hi = tl.maximum(tmax - OFFSET + STRIDE, 0) // STRIDE  # keys with e(i) <= tmax
    hi = tl.minimum(hi, N)
    return tmin, tmax, hi


@triton.jit
def load_rows(base, n, nn, d, s_n, N, D: tl.constexpr, BD: tl.constexpr, NSTEP: tl.constexpr, MASKED: tl.constexpr):
    """Rows n of a [*, D] key/value stream (columns padded to BD)."""
    ptr = base + n[:, None].to(tl.int64) * s_n + d[None, :]
    if MASKED:
        return tl.load(ptr, mask=((nn < NSTEP) & (n < N))[:, None] & (d[None, :] < D), other=0.0)
    elif BD == D:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=d[None, :] < D, other=0.0)


@triton.jit
def load_span(base, n, nn, d, s_n, n_lo, n_hi, D: tl.constexpr, BD: tl.constexpr, NSTEP: tl.constexpr):
    """Rows n of a [*, D] key/value stream (columns padded to BD), zero outside [n_lo, n_hi): a masked tile
    loads no key that none of its rows may see (0 x NaN is NaN in p @ v; docs/nsa-spec.md, "Non-finite
    inputs")."""
    ptr = base + n[:, None].to(tl.int64) * s_n + d[None, :]
    return tl.load(ptr, mask=((nn < NSTEP) & (n >= n_lo) & (n < n_hi))[:, None] & (d[None, :] < D), other=0.0)


@triton.jit
def load_head_rows(X, b, s_b, s_t, s_h, m, head, d, row_ok, D: tl.constexpr):
    """Rows (position m, query head) of a [B, T, HQ, D] tensor (columns padded to len(d)); 0 where not row_ok."""
    return tl.load(
        X + b * s_b + m[:, None].to(tl.int64) * s_t + head[:, None] * s_h + d[None, :],
        mask=row_ok[:, None] & (d[None, :] < D),
        other=0.0,
    )


@triton.jit
def store_head_rows(X, x, b, s_b, s_t, s_h, m, head, d, row_ok, D: tl.constexpr):
    """Store rows (position m, query head) of a [B, T, HQ, D] tensor (the inverse of load_head_rows)."""
    tl.store(
        X + b * s_b + m[:, None].to(tl.int64) * s_t + head[:, None] * s_h + d[None, :],
        x.to(X.dtype.element_ty),
        mask=row_ok[:, None] & (d[None, :] < D),
    )


@triton.jit
def load_row_stats(LSE, DELTA, b, head, m, row_ok, HQ: tl.constexpr, Tq):
    """lse (+inf where not row_ok, so p = 0 there) and delta of rows (m, head), both [B, HQ, Tq]."""
    row = (b * HQ + head).to(tl.int64) * Tq + m
    lse = tl.load(LSE + row, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    return lse, delta


@triton.jit
def visible(e, col_ok, t, row_ok, WINDOW: tl.constexpr):
    """[rows, keys] visibility: the key ending at raw position e is seen by the row at position t iff
    e <= t (and e > t - WINDOW with a window); row_ok / col_ok mask padding rows and columns."""
    vis = row_ok[:, None] & col_ok[None, :] & (e[None, :] <= t[:, None])
    if WINDOW > 0:
        vis = vis & (e[None, :] > t[:, None] - WINDOW)
    return vis


@triton.jit
def row_tile(n_rows, D: tl.constexpr, BD: tl.constexpr, BLOCK_R: tl.constexpr):
    """This program's BLOCK_R rows of a contiguous [n_rows, D] tensor (columns padded to BD):
    (rows r, row mask, element mask, element offsets); offsets in int64."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BD)
    ok = r < n_rows
    return r, ok, ok[:, None] & (d[None, :] < D), r[:, None] * D + d[None, :]


def geometry(HQ, H, Dk, Dv, rows):
    """The shape constexprs every key-stream kernel takes, for ``rows`` query rows per program (as
    tuned): BLOCK_M positions x GP = next_pow2(G) heads."""
    G = HQ // H
    GP = p2(G)
    if max(Dk, Dv) > 128:
        rows = min(rows, 64)  # shared memory: 128 rows of Dk=192 (padded to 256) exceed the H200's 227 KB
    return dict(HQ=HQ, H=H, G=G, GP=GP, DK=Dk, DV=Dv, BDK=p2(Dk, 16), BDV=p2(Dv, 16), BLOCK_M=max(1, rows // GP))


def query_grid(varlen, block, B, H, device, lo, hi, stride=1, offset=0):
    """(grid, (TILES, CU_Q, CU_K)) of a kernel over query tiles of ``block`` positions covering rows
    [lo, hi): (tiles, B*H) and no tables for one sequence per batch row; with packed documents
    (``varlen``, B = 1) the entries of ``Varlen.query_tiles`` times H, cu_seqlens and the offsets of the
    documents' keys in the key stream (stride, offset)."""
    if varlen is None:
        return (triton.cdiv(hi - lo, block), B * H), (None, None, None)
    tiles = varlen.query_tiles(block, device, lo, hi)
    return (tiles.shape[0], H), (tiles, varlen.cu(device), varlen.cu_keys(device, stride, offset))
