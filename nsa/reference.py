"""The reference backend: plain, vectorized PyTorch for every NSA operator.

Each function implements one step of ``docs/nsa-spec.md`` and cites the paper's equation
(Yuan et al., arXiv 2502.11089). Layouts are batch-first: q ``[B,Tq,HQ,Dk]``, keys/values
``[B,S,H,D]``. Queries sit at absolute positions ``q_start .. q_start+Tq-1`` (prefill: q_start=0,
S=Tq; decode: S = q_start+Tq keys in the cache). Query head h reads key/value head h // G.
Packed documents (``varlen``, a :class:`nsa.varlen.Varlen`; B = 1, q_start = 0): each query row sits at
its position in its document and sees that document's keys only (docs/nsa-spec.md, "Varlen").

No Python loop runs over tokens: work is vectorized over all queries, and only split into query
chunks (a loop over chunks) to bound the memory of the intermediates at long T. Every op works in
any float dtype on any device and is differentiable; half-precision inputs are computed in float32
and cast back. Empty inputs (B = 0 or Tq = 0) give empty outputs of the right shape, as
``torch.nn.functional.scaled_dot_product_attention`` does.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .config import NSAConfig

# Bytes of float32 intermediates one query chunk may hold (scores, gathered keys).
CHUNK_BYTES = 1 << 28


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunks(Tq: int, per_query_bytes: int):
    size = max(1, min(Tq, CHUNK_BYTES // max(1, per_query_bytes)))
    return [(c0, min(Tq, c0 + size)) for c0 in range(0, Tq, size)]


def _run_chunked(fn, Tq: int, per_query_bytes: int, *tensors):
    """Apply ``fn(c0, c1, *tensors)`` over query chunks and concatenate along dim 1.

    With more than one chunk and gradients on, each chunk is recomputed in backward
    (activation checkpointing), so backward memory is that of one chunk.
    """
    spans = _chunks(Tq, per_query_bytes)
    if len(spans) <= 1:  # one chunk, or no query at all (Tq = 0: empty outputs)
        return fn(0, Tq, *tensors)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors if isinstance(t, torch.Tensor))
    outs = []
    for c0, c1 in spans:
        if grad:
            outs.append(checkpoint(fn, c0, c1, *tensors, use_reentrant=False))
        else:
            outs.append(fn(c0, c1, *tensors))
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts, dim=1) for parts in zip(*outs))
    return torch.cat(outs, dim=1)


# --------------------------------------------------------------------------------------------
# Compression (Eq. 7)
# --------------------------------------------------------------------------------------------
def compress(x: torch.Tensor, config: NSAConfig, phi=None, varlen=None) -> torch.Tensor:
    """Eq. 7: compressed token i = phi(x[i*d : i*d + l]) for i = 0 .. (T-l)//d.

    x ``[B,T,H,D]`` -> ``[B,Tc,H,D]`` with Tc = 0 if T < l else (T-l)//d + 1. ``phi`` maps blocks
    ``[B,Tc,H,l,D]`` to ``[B,Tc,H,D]``; None is mean pooling. ``varlen``: the same over each document,
    packed in document order (Tc = sum of n_cmp(L_i)).
    """
    B, T, H, D = x.shape
    if varlen is not None:
        doc, index = varlen.cmp_tokens(config, x.device)
        if doc.numel() == 0:
            return x.new_zeros(B, 0, H, D)
        first = varlen.cu(x.device).to(torch.int64)[doc] + index * config.d  # each token's first raw row
        rows = first[:, None] + torch.arange(config.l, device=x.device)  # [Tc, l]
        blocks = x[:, rows].permute(0, 1, 3, 2, 4)  # [B,Tc,H,l,D]
    elif T < config.l:
        return x.new_zeros(B, 0, H, D)
    else:
        blocks = x.unfold(1, config.l, config.d).permute(0, 1, 2, 4, 3)  # [B,Tc,H,l,D]
    if phi is None:
        return blocks.mean(dim=3)
    return phi(blocks)


# --------------------------------------------------------------------------------------------
# Non-finite keys and values (docs/nsa-spec.md, "Non-finite inputs")
# --------------------------------------------------------------------------------------------
def _all_finite(k: torch.Tensor, v: torch.Tensor) -> bool:
    """No NaN or Inf in k and v (one check and one host sync: the fast path's condition). Under
    torch.compile False without looking (a graph cannot branch on data): the masked path, which gives
    the same result on finite inputs."""
    if torch.compiler.is_compiling():
        return False
    return bool(torch.isfinite(k).all() & torch.isfinite(v).all())


def _bad_tokens(k: torch.Tensor, v: torch.Tensor):
    """(bad_k, bad_v): ``[B,N,H]`` masks of the tokens with a non-finite key / value element, or (None, None)
    when every element is finite."""
    if _all_finite(k, v):
        return None, None
    return ~torch.isfinite(k).all(-1), ~torch.isfinite(v).all(-1)


# --------------------------------------------------------------------------------------------
# Where each query row sits, and which compressed tokens it may see
# --------------------------------------------------------------------------------------------
def _positions(Tq: int, q_start: int, varlen, device) -> torch.Tensor:
    """Each query row's position [Tq] (int64): q_start + r, or its position in its document."""
    if varlen is None:
        return q_start + torch.arange(Tq, device=device)
    return varlen.row_pos(device).to(torch.int64)


def _cmp_index(Tc: int, config: NSAConfig, varlen, device):
    """(index of each compressed token in its sequence [Tc], its document [Tc] or None)."""
    if varlen is None:
        return torch.arange(Tc, device=device), None
    doc, index = varlen.cmp_tokens(config, device)
    return index, doc


# --------------------------------------------------------------------------------------------
# Compressed branch (Eqs. 5, 8) with its probabilities
# --------------------------------------------------------------------------------------------
def _cmp_probs(q, k_cmp, config, scale, t, c0, c1, varlen=None, bad_k=None):
    """p_cmp for queries c0..c1-1 of q at positions t[c0:c1]: ``[B,H,G,c,Tc]`` in the accumulation dtype
    (Eq. 8), and the visibility ``[c,Tc]``; with packed documents, over all packed compressed tokens (zero
    outside the row's document). ``bad_k`` (``_bad_tokens``): keys with a non-finite element."""
    B, _, HQ, Dk = q.shape
    H, Tc = k_cmp.shape[2], k_cmp.shape[1]
    acc = _acc_dtype(q.dtype)
    qc = q[:, c0:c1].reshape(B, c1 - c0, H, HQ // H, Dk).to(acc)
    k = k_cmp.to(acc)
    index, doc = _cmp_index(Tc, config, varlen, q.device)
    end = index * config.d + config.l - 1
    visible = end[None, :] <= t[c0:c1, None]  # [c, Tc]: compressed token i is visible iff i*d+l-1 <= t
    if doc is not None:
        visible = visible & (doc[None, :] == varlen.row_doc(q.device)[c0:c1, None])
    if bad_k is None:
        s = torch.einsum("bthgd,bchd->bhgtc", qc, k) * scale
    else:
        # A non-finite key enters only the rows that see it: the others score against keys with those
        # tokens zeroed; the natural product q.k (non-finite) is taken where a row sees one, on queries
        # zeroed outside such rows (so no other row's gradient multiplies the non-finite key).
        hit = visible[None, None] & bad_k.transpose(1, 2)[:, :, None, :]  # [B,H,c,Tc]
        sees = hit.any(-1).transpose(1, 2)[:, :, :, None, None]  # [B,c,H,1,1]
        s_clean = torch.einsum("bthgd,bchd->bhgtc", qc, k.masked_fill(bad_k[..., None], 0))
        s_seen = torch.einsum("bthgd,bchd->bhgtc", qc.masked_fill(~sees, 0), k)
        s = torch.where(hit[:, :, None], s_seen, s_clean) * scale
    s = s.masked_fill(~visible, torch.finfo(acc).min)
    # A row with no visible token would be uniform here; multiplying by the mask makes it zero.
    return torch.softmax(s, dim=-1) * visible, visible


def _cmp_output(p, v_cmp, visible, bad_v=None):
    """Eq. 5 over the compressed tokens: ``p [B,H,G,c,Tc]`` times ``v_cmp [B,Tc,H,Dv]`` -> ``[B,c,H,G,Dv]``.

    A masked token's probability is 0, but 0 x NaN is NaN: with non-finite values (``bad_v``), rows that see
    none take the product with those tokens zeroed, and only the rows that see one the natural product
    (on probabilities zeroed outside those rows, which keeps the other rows' gradients finite)."""
    v = v_cmp.to(p.dtype)
    if bad_v is None:
        return torch.einsum("bhgtc,bchd->bthgd", p, v)
    sees = (visible[None, None] & bad_v.transpose(1, 2)[:, :, None, :]).any(-1)  # [B,H,c]
    clean = torch.einsum("bhgtc,bchd->bthgd", p, v.masked_fill(bad_v[..., None], 0))
    seen = torch.einsum("bhgtc,bchd->bthgd", p.masked_fill(~sees[:, :, None, :, None], 0), v)
    return torch.where(sees.transpose(1, 2)[:, :, :, None, None], seen, clean)


def compressed_attention(q, k_cmp, v_cmp, config: NSAConfig, *, scale=None, q_start: int = 0, varlen=None):
    """Compressed branch (spec step 1; paper Eq. 5 with the compressed K/V of Eq. 7).

    Returns ``(o_cmp [B,Tq,HQ,Dv], p_cmp [B,Tq,HQ,Tc])``. Rows with no visible compressed token
    have o_cmp = 0 and p_cmp = 0. Packed documents: Tc counts every document's compressed tokens, and a
    row's probabilities are zero outside its own document's.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    B, Tq, HQ, _ = q.shape
    Dv = v_cmp.shape[3]
    bad_k, bad_v = _bad_tokens(k_cmp, v_cmp)
    p, visible = _cmp_probs(q, k_cmp, config, scale, _positions(Tq, q_start, varlen, q.device), 0, Tq, varlen,
                            bad_k)
    o = _cmp_output(p, v_cmp, visible, bad_v).reshape(B, Tq, HQ, Dv)
    return o.to(q.dtype), p.permute(0, 3, 1, 2, 4).reshape(B, Tq, HQ, k_cmp.shape[1]).to(q.dtype)


# --------------------------------------------------------------------------------------------
# Selection scores (Eqs. 9, 10) and top-n (Eqs. 11, 12)
# --------------------------------------------------------------------------------------------
def _overlap_matrix(i: torch.Tensor, n_blocks: int, config: NSAConfig, dtype) -> torch.Tensor:
    """W[i, j] = |[i*d, i*d+l) ∩ [j*l_sel, (j+1)*l_sel)| / d: the block-aligned Eq. 9 weights of the
    compressed tokens of (in-sequence) index i."""
    # In units of d (l and l_sel are multiples of d): no integer division, which inductor's index
    # simplification cannot compile here (torch 2.13: "vr must not be None").
    j = torch.arange(n_blocks, device=i.device)
    u_l, u_sel = config.l // config.d, config.l_sel // config.d
    lo = torch.maximum(i[:, None], j[None, :] * u_sel)
    hi = torch.minimum(i[:, None] + u_l, (j[None, :] + 1) * u_sel)
    return (hi - lo).clamp(min=0).to(dtype)


def _group_scores_from_probs(p, config: NSAConfig, n_blocks: int, varlen=None):
    """``[B,H,G,c,Tc]`` probabilities -> group scores ``[B,c,H,n_blocks]`` (Eq. 9 then Eq. 10)."""
    W = _overlap_matrix(_cmp_index(p.shape[-1], config, varlen, p.device)[0], n_blocks, config, p.dtype)
    return torch.einsum("bhgtc,cj->bthj", p, W)


def selection_scores(p_cmp, config: NSAConfig, n_blocks: int, varlen=None):
    """Eqs. 9-10: p_cmp ``[B,Tq,HQ,Tc]`` -> group-summed block scores ``[B,Tq,H,n_blocks]``.

    p_slc[j] = sum_i p_cmp[i] * |[i*d, i*d+l) ∩ [j*l_sel, (j+1)*l_sel)| / d (the spec's
    block-aligned form of Eq. 9), summed over the G query heads of each group (Eq. 10). Packed
    documents: i and j count from the document's start (p_cmp is zero outside it).
    """
    B, Tq, HQ, Tc = p_cmp.shape
    H = config.n_kv_heads
    p = p_cmp.reshape(B, Tq, H, HQ // H, Tc).permute(0, 2, 3, 1, 4).to(_acc_dtype(p_cmp.dtype))
    return _group_scores_from_probs(p, config, n_blocks, varlen)


def _select(scores, config: NSAConfig, t):
    """select_blocks for query rows at positions t [Tq]."""
    B, Tq, H, nb = scores.shape
    dev = scores.device
    last = (t // config.l_sel)[:, None]  # newest candidate block per query
    j = torch.arange(nb, device=dev)[None, :]
    cand = j <= last
    forced = cand & ((j < config.n_init) | (j > last - config.n_local))
    s = scores.to(_acc_dtype(scores.dtype))
    s = torch.where(forced[None, :, None, :], torch.full_like(s, math.inf), s)
    s = torch.where(cand[None, :, None, :], s, torch.full_like(s, -math.inf))
    if nb < config.n_sel:
        s = F.pad(s, (0, config.n_sel - nb), value=-math.inf)
    # A stable descending sort keeps the lower index first among equal scores (the tie-break).
    vals, idx = torch.sort(s, dim=-1, descending=True, stable=True)
    vals, idx = vals[..., : config.n_sel], idx[..., : config.n_sel]
    big = torch.iinfo(torch.int64).max
    idx = torch.where(vals > -math.inf, idx, torch.full_like(idx, big))
    idx = torch.sort(idx, dim=-1).values
    return torch.where(idx == big, torch.full_like(idx, -1), idx)


def select_blocks(scores, config: NSAConfig, *, q_start: int = 0, varlen=None):
    """Eqs. 11-12 with the spec's forcing: scores ``[B,Tq,H,nb]`` -> indices ``[B,Tq,H,n_sel]``.

    Candidates are blocks j <= t // l_sel. With at most n_sel candidates all are taken; otherwise
    j < n_init and the n_local newest candidates are forced and the rest go to the highest scores,
    ties to the lower index. Indices ascending, padded with -1. Packed documents: t and j count from
    the document's start.
    """
    return _select(scores, config, _positions(scores.shape[1], q_start, varlen, scores.device))


def compressed_branch(q, k_cmp, v_cmp, config: NSAConfig, *, scale=None, q_start: int = 0, n_keys=None,
                      varlen=None):
    """The whole compressed branch as the dispatch sees it: Eq. 5 output plus the top-n indices
    (Eqs. 8-12), computed over query chunks so that no ``[B,HQ,T,Tc]`` tensor is held at once.

    ``n_keys`` (S, default q_start + Tq) fixes the number of selection blocks ceil(S / l_sel); with
    packed documents (``varlen``), the longest document's.
    Returns ``(o_cmp [B,Tq,HQ,Dv], indices [B,Tq,H,n_sel] int64)``.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    B, Tq, HQ, _ = q.shape
    H, Tc, Dv = k_cmp.shape[2], k_cmp.shape[1], v_cmp.shape[3]
    S = q_start + Tq if n_keys is None else n_keys
    nb = config.n_blocks(S) if varlen is None else varlen.n_blocks(config)
    t = _positions(Tq, q_start, varlen, q.device)
    bad_k, bad_v = _bad_tokens(k_cmp, v_cmp)

    def chunk(c0, c1, q, k_cmp, v_cmp):
        p, visible = _cmp_probs(q, k_cmp, config, scale, t, c0, c1, varlen, bad_k)
        o = _cmp_output(p, v_cmp, visible, bad_v).reshape(B, c1 - c0, HQ, Dv)
        with torch.no_grad():  # indices are not differentiable
            idx = _select(_group_scores_from_probs(p.detach(), config, nb, varlen), config, t[c0:c1])
        return o.to(q.dtype), idx

    per_query = 8 * B * HQ * max(Tc, 1) + 8 * B * H * nb
    return _run_chunked(chunk, Tq, per_query, q, k_cmp, v_cmp)


# --------------------------------------------------------------------------------------------
# Gathered attention: the selected (spec step 5) and sliding (step 6) branches
# --------------------------------------------------------------------------------------------
def _gather_tokens(x, tok):
    """x[b, tok[b,t,h,n], h] for every (b,t,h,n): x ``[B,S,H,D]``, tok ``[B,c,H,N]`` in [0, S) -> ``[B,c,H,N,D]``.

    ``index_select`` over x's (b, s, h) rows: the values of advanced indexing ``x[b, tok, h]``, and in
    backward the same sums in the same order, but ``index_add_`` instead of ``index_put_`` with
    accumulation, which on the CPU took most of a training step's time (BENCHMARKS.md)."""
    B, S, H, D = x.shape
    b = torch.arange(B, device=x.device)[:, None, None, None]
    h = torch.arange(H, device=x.device)[None, None, :, None]
    rows = (b * S + tok) * H + h
    return x.reshape(B * S * H, D).index_select(0, rows.flatten()).view(*tok.shape, D)


def _gather_blocks(x, idx, l_blk: int):
    """The tokens of whole blocks: x ``[B,S,H,D]``, idx ``[B,c,H,n]`` block numbers in [0, ceil(S / l_blk))
    -> ``[B,c,H,n*l_blk,D]``, block j's tokens j*l_blk .. (j+1)*l_blk-1 (zeros past S) in order.

    ``_gather_tokens`` of those positions, but one ``index_select`` row per block instead of per token
    (far cheaper on the CPU); the same values, and in backward the same sums in the same order."""
    B, S, H, D = x.shape
    nb = -(-S // l_blk)
    xb = F.pad(x, (0, 0, 0, 0, 0, nb * l_blk - S)).unflatten(1, (nb, l_blk)).transpose(2, 3)  # [B,nb,H,l_blk,D]
    b = torch.arange(B, device=x.device)[:, None, None, None]
    h = torch.arange(H, device=x.device)[None, None, :, None]
    rows = (b * nb + idx) * H + h
    out = xb.reshape(B * nb * H, l_blk * D).index_select(0, rows.flatten())
    return out.view(*idx.shape[:3], idx.shape[3] * l_blk, D)


def _gather_attend(q, k, v, gather, valid, scale, finite=True):
    """Attention of each query over its own key list.

    q ``[B,c,HQ,Dk]``; ``gather(x)`` maps keys or values ``[B,S,H,D]`` to each query's list ``[B,c,H,N,D]``
    (any entry where not valid); valid ``[B,c,H,N]``. Every query must have at least one valid key.
    Returns ``[B,c,HQ,Dv]``. ``finite``: k and v hold no NaN or Inf (else the gathered entries that are
    not valid are zeroed before any product).
    """
    B, c, HQ, Dk = q.shape
    H = k.shape[2]
    G = HQ // H
    acc = _acc_dtype(q.dtype)
    kg = gather(k).to(acc)  # [B,c,H,N,Dk]
    vg = gather(v).to(acc)  # [B,c,H,N,Dv]
    if not finite:
        # A masked entry's probability is 0, but 0 x NaN is NaN: masked keys/values are selected away
        # before the products, so a non-finite one reaches only the rows that attend to it.
        kg = kg.masked_fill(~valid[..., None], 0)
        vg = vg.masked_fill(~valid[..., None], 0)
    qg = q.reshape(B, c, H, G, Dk).to(acc)
    s = torch.einsum("bthgd,bthnd->bthgn", qg, kg) * scale
    s = s.masked_fill(~valid[:, :, :, None, :], -math.inf)
    p = torch.softmax(s, dim=-1)
    o = torch.einsum("bthgn,bthnd->bthgd", p, vg)
    return o.reshape(B, c, HQ, v.shape[3]).to(q.dtype)


def _masked_attend(q, k, v, allowed, scale, bad=None, gathered=None):
    """The attention of ``_gather_attend``, written over every key under a mask: q ``[B,c,HQ,Dk]``, k, v
    ``[B,S,H,D]``, allowed ``[B,c,H,S]`` (each query's key set, duplicate-free; at least one key each). Where
    the scores of every key take no more room than the gathered lists (short sequences: the CPU's training
    presets) this reads less, and its backward is two products instead of ``index_add_``'s scatter.

    ``bad`` ``[B,S,H]``: the keys with a non-finite key or value element (None: none). They are zeroed for
    the products (a masked key's 0 probability times a NaN value would be NaN in every row), and the rows
    whose set holds one take ``gathered()``'s output, the gathered form's (its NaN/Inf as it has them), so
    a row that cannot see a bad key gets exactly what it gets without one."""
    B, c, HQ, Dk = q.shape
    H = k.shape[2]
    acc = _acc_dtype(q.dtype)
    if bad is not None:
        k, v = k.masked_fill(bad[..., None], 0), v.masked_fill(bad[..., None], 0)
    qg = q.reshape(B, c, H, HQ // H, Dk).to(acc)
    s = torch.einsum("bthgd,bshd->bthgs", qg, k.to(acc)) * scale
    s = s.masked_fill(~allowed[:, :, :, None, :], -math.inf)
    o = torch.einsum("bthgs,bshd->bthgd", torch.softmax(s, dim=-1), v.to(acc))
    o = o.reshape(B, c, HQ, v.shape[3]).to(q.dtype)
    if bad is not None:
        sees = (allowed & bad.transpose(1, 2)[:, None]).any(-1)  # [B,c,H]
        if bool(sees.any()):
            o = torch.where(sees.repeat_interleave(HQ // H, dim=2)[..., None], gathered(), o)
    return o


def _masked_cheaper(HQ: int, H: int, S: int, n_list: int, Dk: int, Dv: int) -> bool:
    """Whether every key's scores ([HQ, S] a query) take no more room than the gathered keys and values
    ([H, n_list, Dk + Dv] a query), outside torch.compile (whose graphs keep the gathered form)."""
    return HQ * S <= H * n_list * (Dk + Dv) and not torch.compiler.is_compiling()


def _doc_rows(varlen, c0, c1, device):
    """(first key row, key count) of the documents of query rows c0..c1-1, as [1, c, 1, 1] int64."""
    doc = varlen.row_doc(device)[c0:c1].to(torch.int64)
    cu = varlen.cu(device).to(torch.int64)
    start, end = cu[doc], cu[doc + 1]
    return start[None, :, None, None], (end - start)[None, :, None, None]


def selected_attention(q, k_sel, v_sel, indices, config: NSAConfig, *, scale=None, q_start: int = 0, varlen=None):
    """Selected branch (spec step 5, paper Eq. 5 over the blocks of Eq. 12): attention over the
    raw tokens u <= t in the selected blocks, read from the selection branch's own keys/values.

    indices ``[B,Tq,H,n_sel]`` (ascending, -1 padded; -1 entries are ignored). Packed documents: block j
    of a row covers its document's tokens [j*l_sel, (j+1)*l_sel).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    B, Tq, HQ, _ = q.shape
    H, S = k_sel.shape[2], k_sel.shape[1]
    ls = config.l_sel
    # Tokens gathered per block: l_sel, bounded by the S keys (with l_sel >= S only block 0 holds tokens, and
    # those are its first S), so an l_sel beyond the sequence costs what the sequence has, not l_sel.
    lb = max(1, min(ls, S))  # 1 where S = 0 (no keys: nothing is gathered)
    off = torch.arange(lb, device=q.device)
    pos = _positions(Tq, q_start, varlen, q.device)
    finite = _all_finite(k_sel, v_sel)

    def chunk(c0, c1, q, k_sel, v_sel):
        idx = indices[:, c0:c1]
        tok = (idx[..., None] * ls + off).flatten(-2)  # [B,c,H,n_sel*lb], positions in the row's sequence
        t = pos[c0:c1][None, :, None, None]
        start, n = (0, S) if varlen is None else _doc_rows(varlen, c0, c1, q.device)
        valid = (idx[..., None] >= 0).expand(*idx.shape, lb).flatten(-2) & (tok <= t) & (tok < n)
        if varlen is None:  # blocks start at multiples of l_sel: gathered whole
            def gather(x):
                return _gather_blocks(x, idx.clamp(min=0), lb)
        else:
            def gather(x):
                return _gather_tokens(x, (tok + start).clamp(0, S - 1))
        return _gather_attend(q[:, c0:c1], k_sel, v_sel, gather, valid, scale, finite)

    nb = -(-S // ls)
    if varlen is None and S > 0 and _masked_cheaper(HQ, H, S, indices.shape[-1] * lb, k_sel.shape[3], v_sel.shape[3]):
        chosen = torch.zeros(*indices.shape[:3], nb + 1, dtype=torch.bool, device=q.device)
        chosen.scatter_(-1, torch.where(indices >= 0, indices, nb), True)  # -1 entries land in column nb
        if bool((chosen[..., :nb].sum(-1) == (indices >= 0).sum(-1)).all()):  # no block listed twice
            key = torch.arange(S, device=q.device)
            bad = None if finite else torch.logical_or(*_bad_tokens(k_sel, v_sel))

            def masked(c0, c1, q, k_sel, v_sel):
                allowed = chosen[:, c0:c1, :, key // ls] & (key <= pos[c0:c1, None, None])[None]
                return _masked_attend(q[:, c0:c1], k_sel, v_sel, allowed, scale, bad,
                                      lambda: chunk(c0, c1, q, k_sel, v_sel))

            return _run_chunked(masked, Tq, 4 * B * (3 * HQ * S + H * (S + nb)), q, k_sel, v_sel)

    per_query = 4 * B * H * indices.shape[-1] * lb * (k_sel.shape[3] + v_sel.shape[3] + 2 * HQ // H + 2)
    return _run_chunked(chunk, Tq, per_query, q, k_sel, v_sel)


def sliding_window_attention(q, k_win, v_win, config: NSAConfig, *, scale=None, q_start: int = 0, varlen=None):
    """Sliding branch (spec step 6): attention over u in [max(0, t-w+1), t] with the window
    branch's own keys/values (packed documents: u and t in the row's document)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    B, Tq, HQ, _ = q.shape
    H = k_win.shape[2]
    w = min(config.w, q_start + Tq if varlen is None else varlen.max_len)
    off = torch.arange(-w + 1, 1, device=q.device)
    pos = _positions(Tq, q_start, varlen, q.device)
    finite = _all_finite(k_win, v_win)

    def chunk(c0, c1, q, k_win, v_win):
        tok = (pos[c0:c1, None] + off)[None, :, None, :].expand(B, c1 - c0, H, w)
        start = 0 if varlen is None else _doc_rows(varlen, c0, c1, q.device)[0]

        def gather(x):
            return _gather_tokens(x, (tok + start).clamp(0, x.shape[1] - 1))
        return _gather_attend(q[:, c0:c1], k_win, v_win, gather, tok >= 0, scale, finite)

    S = k_win.shape[1]
    if varlen is None and S > 0 and _masked_cheaper(HQ, H, S, w, k_win.shape[3], v_win.shape[3]):
        key = torch.arange(S, device=q.device)
        bad = None if finite else torch.logical_or(*_bad_tokens(k_win, v_win))

        def masked(c0, c1, q, k_win, v_win):
            d = pos[c0:c1, None] - key  # [c, S]: how far back each key lies
            allowed = ((d >= 0) & (d < w))[None, :, None, :].expand(B, c1 - c0, H, S)
            return _masked_attend(q[:, c0:c1], k_win, v_win, allowed, scale, bad,
                                  lambda: chunk(c0, c1, q, k_win, v_win))

        return _run_chunked(masked, Tq, 4 * B * (3 * HQ * S + H * S), q, k_win, v_win)

    per_query = 4 * B * H * w * (k_win.shape[3] + v_win.shape[3] + 2 * HQ // H + 2)
    return _run_chunked(chunk, Tq, per_query, q, k_win, v_win)
