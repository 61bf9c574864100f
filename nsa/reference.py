"""The reference backend: plain, vectorized PyTorch for every NSA operator.

Each function implements one step of ``docs/nsa-spec.md`` and cites the paper's equation
(Yuan et al., arXiv 2502.11089). Layouts are batch-first: q ``[B,Tq,HQ,Dk]``, keys/values
``[B,S,H,D]``. Queries sit at absolute positions ``q_start .. q_start+Tq-1`` (prefill: q_start=0,
S=Tq; decode: S = q_start+Tq keys in the cache). Query head h reads key/value head h // G.

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
_CHUNK_BYTES = 1 << 28


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunks(Tq: int, per_query_bytes: int):
    size = max(1, min(Tq, _CHUNK_BYTES // max(1, per_query_bytes)))
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
def compress(x: torch.Tensor, config: NSAConfig, phi=None) -> torch.Tensor:
    """Eq. 7: compressed token i = phi(x[i*d : i*d + l]) for i = 0 .. (T-l)//d.

    x ``[B,T,H,D]`` -> ``[B,Tc,H,D]`` with Tc = 0 if T < l else (T-l)//d + 1. ``phi`` maps blocks
    ``[B,Tc,H,l,D]`` to ``[B,Tc,H,D]``; None is mean pooling.
    """
    B, T, H, D = x.shape
    if T < config.l:
        return x.new_zeros(B, 0, H, D)
    blocks = x.unfold(1, config.l, config.d).permute(0, 1, 2, 4, 3)  # [B,Tc,H,l,D]
    if phi is None:
        return blocks.mean(dim=3)
    return phi(blocks)


# --------------------------------------------------------------------------------------------
# Compressed branch (Eqs. 5, 8) with its probabilities
# --------------------------------------------------------------------------------------------
def _cmp_probs(q, k_cmp, config, scale, q_start, c0, c1):
    """p_cmp for queries c0..c1-1 of q: ``[B,H,G,c,Tc]`` in the accumulation dtype (Eq. 8)."""
    B, _, HQ, Dk = q.shape
    H, Tc = k_cmp.shape[2], k_cmp.shape[1]
    acc = _acc_dtype(q.dtype)
    qc = q[:, c0:c1].reshape(B, c1 - c0, H, HQ // H, Dk).to(acc)
    s = torch.einsum("bthgd,bchd->bhgtc", qc, k_cmp.to(acc)) * scale
    t = q_start + torch.arange(c0, c1, device=q.device)
    end = torch.arange(Tc, device=q.device) * config.d + config.l - 1
    visible = end[None, :] <= t[:, None]  # [c, Tc]: compressed token i is visible iff i*d+l-1 <= t
    s = s.masked_fill(~visible, torch.finfo(acc).min)
    # A row with no visible token would be uniform here; multiplying by the mask makes it zero.
    return torch.softmax(s, dim=-1) * visible


def compressed_attention(q, k_cmp, v_cmp, config: NSAConfig, *, scale=None, q_start: int = 0):
    """Compressed branch (spec step 1; paper Eq. 5 with the compressed K/V of Eq. 7).

    Returns ``(o_cmp [B,Tq,HQ,Dv], p_cmp [B,Tq,HQ,Tc])``. Rows with no visible compressed token
    have o_cmp = 0 and p_cmp = 0.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    B, Tq, HQ, _ = q.shape
    Dv = v_cmp.shape[3]
    p = _cmp_probs(q, k_cmp, config, scale, q_start, 0, Tq)
    o = torch.einsum("bhgtc,bchd->bthgd", p, v_cmp.to(p.dtype)).reshape(B, Tq, HQ, Dv)
    return o.to(q.dtype), p.permute(0, 3, 1, 2, 4).reshape(B, Tq, HQ, k_cmp.shape[1]).to(q.dtype)


# --------------------------------------------------------------------------------------------
# Selection scores (Eqs. 9, 10) and top-n (Eqs. 11, 12)
# --------------------------------------------------------------------------------------------
def _overlap_matrix(Tc: int, n_blocks: int, config: NSAConfig, device, dtype) -> torch.Tensor:
    """W[i, j] = |[i*d, i*d+l) ∩ [j*l_sel, (j+1)*l_sel)| / d: the block-aligned Eq. 9 weights."""
    i = torch.arange(Tc, device=device)
    j = torch.arange(n_blocks, device=device)
    lo = torch.maximum(i[:, None] * config.d, j[None, :] * config.l_sel)
    hi = torch.minimum(i[:, None] * config.d + config.l, (j[None, :] + 1) * config.l_sel)
    return ((hi - lo).clamp(min=0) // config.d).to(dtype)


def _group_scores_from_probs(p, config: NSAConfig, n_blocks: int):
    """``[B,H,G,c,Tc]`` probabilities -> group scores ``[B,c,H,n_blocks]`` (Eq. 9 then Eq. 10)."""
    W = _overlap_matrix(p.shape[-1], n_blocks, config, p.device, p.dtype)
    return torch.einsum("bhgtc,cj->bthj", p, W)


def selection_scores(p_cmp, config: NSAConfig, n_blocks: int):
    """Eqs. 9-10: p_cmp ``[B,Tq,HQ,Tc]`` -> group-summed block scores ``[B,Tq,H,n_blocks]``.

    p_slc[j] = sum_i p_cmp[i] * |[i*d, i*d+l) ∩ [j*l_sel, (j+1)*l_sel)| / d (the spec's
    block-aligned form of Eq. 9), summed over the G query heads of each group (Eq. 10).
    """
    B, Tq, HQ, Tc = p_cmp.shape
    H = config.n_kv_heads
    p = p_cmp.reshape(B, Tq, H, HQ // H, Tc).permute(0, 2, 3, 1, 4).to(_acc_dtype(p_cmp.dtype))
    return _group_scores_from_probs(p, config, n_blocks)


def select_blocks(scores, config: NSAConfig, *, q_start: int = 0):
    """Eqs. 11-12 with the spec's forcing: scores ``[B,Tq,H,nb]`` -> indices ``[B,Tq,H,n_sel]``.

    Candidates are blocks j <= t // l_sel. With at most n_sel candidates all are taken; otherwise
    j < n_init and the n_local newest candidates are forced and the rest go to the highest scores,
    ties to the lower index. Indices ascending, padded with -1.
    """
    B, Tq, H, nb = scores.shape
    dev = scores.device
    t = q_start + torch.arange(Tq, device=dev)
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


def compressed_branch(q, k_cmp, v_cmp, config: NSAConfig, *, scale=None, q_start: int = 0, n_keys=None):
    """The whole compressed branch as the dispatch sees it: Eq. 5 output plus the top-n indices
    (Eqs. 8-12), computed over query chunks so that no ``[B,HQ,T,Tc]`` tensor is held at once.

    ``n_keys`` (S, default q_start + Tq) fixes the number of selection blocks ceil(S / l_sel).
    Returns ``(o_cmp [B,Tq,HQ,Dv], indices [B,Tq,H,n_sel] int64)``.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    B, Tq, HQ, _ = q.shape
    H, Tc, Dv = k_cmp.shape[2], k_cmp.shape[1], v_cmp.shape[3]
    S = q_start + Tq if n_keys is None else n_keys
    nb = config.n_blocks(S)

    def chunk(c0, c1, q, k_cmp, v_cmp):
        p = _cmp_probs(q, k_cmp, config, scale, q_start, c0, c1)
        o = torch.einsum("bhgtc,bchd->bthgd", p, v_cmp.to(p.dtype)).reshape(B, c1 - c0, HQ, Dv)
        with torch.no_grad():  # indices are not differentiable
            idx = select_blocks(_group_scores_from_probs(p.detach(), config, nb), config, q_start=q_start + c0)
        return o.to(q.dtype), idx

    per_query = 8 * B * HQ * max(Tc, 1) + 8 * B * H * nb
    return _run_chunked(chunk, Tq, per_query, q, k_cmp, v_cmp)


# --------------------------------------------------------------------------------------------
# Gathered attention: the selected (spec step 5) and sliding (step 6) branches
# --------------------------------------------------------------------------------------------
def _gather_attend(q, k, v, tok, valid, scale):
    """Attention of each query over its own key list.

    q ``[B,c,HQ,Dk]``; tok ``[B,c,H,N]`` key positions (any value where not valid); valid same
    shape. Every query must have at least one valid key. Returns ``[B,c,HQ,Dv]``.
    """
    B, c, HQ, Dk = q.shape
    H = k.shape[2]
    G = HQ // H
    acc = _acc_dtype(q.dtype)
    tok = tok.clamp(0, k.shape[1] - 1)
    b = torch.arange(B, device=q.device)[:, None, None, None]
    h = torch.arange(H, device=q.device)[None, None, :, None]
    kg = k[b, tok, h].to(acc)  # [B,c,H,N,Dk]
    vg = v[b, tok, h].to(acc)  # [B,c,H,N,Dv]
    qg = q.reshape(B, c, H, G, Dk).to(acc)
    s = torch.einsum("bthgd,bthnd->bthgn", qg, kg) * scale
    s = s.masked_fill(~valid[:, :, :, None, :], -math.inf)
    p = torch.softmax(s, dim=-1)
    o = torch.einsum("bthgn,bthnd->bthgd", p, vg)
    return o.reshape(B, c, HQ, v.shape[3]).to(q.dtype)


def selected_attention(q, k_sel, v_sel, indices, config: NSAConfig, *, scale=None, q_start: int = 0):
    """Selected branch (spec step 5, paper Eq. 5 over the blocks of Eq. 12): attention over the
    raw tokens u <= t in the selected blocks, read from the selection branch's own keys/values.

    indices ``[B,Tq,H,n_sel]`` (ascending, -1 padded; -1 entries are ignored).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    B, Tq, HQ, _ = q.shape
    H, S = k_sel.shape[2], k_sel.shape[1]
    ls = config.l_sel
    off = torch.arange(ls, device=q.device)

    def chunk(c0, c1, q, k_sel, v_sel):
        idx = indices[:, c0:c1]
        tok = (idx[..., None] * ls + off).flatten(-2)  # [B,c,H,n_sel*l_sel]
        t = (q_start + torch.arange(c0, c1, device=q.device))[None, :, None, None]
        valid = (idx[..., None] >= 0).expand(*idx.shape, ls).flatten(-2) & (tok <= t) & (tok < S)
        return _gather_attend(q[:, c0:c1], k_sel, v_sel, tok, valid, scale)

    per_query = 4 * B * H * indices.shape[-1] * ls * (k_sel.shape[3] + v_sel.shape[3] + 2 * HQ // H + 2)
    return _run_chunked(chunk, Tq, per_query, q, k_sel, v_sel)


def sliding_window_attention(q, k_win, v_win, config: NSAConfig, *, scale=None, q_start: int = 0):
    """Sliding branch (spec step 6): attention over u in [max(0, t-w+1), t] with the window
    branch's own keys/values."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    B, Tq, HQ, _ = q.shape
    H = k_win.shape[2]
    w = min(config.w, q_start + Tq)
    off = torch.arange(-w + 1, 1, device=q.device)

    def chunk(c0, c1, q, k_win, v_win):
        t = q_start + torch.arange(c0, c1, device=q.device)
        tok = (t[:, None] + off)[None, :, None, :].expand(B, c1 - c0, H, w)
        return _gather_attend(q[:, c0:c1], k_win, v_win, tok, tok >= 0, scale)

    per_query = 4 * B * H * w * (k_win.shape[3] + v_win.shape[3] + 2 * HQ // H + 2)
    return _run_chunked(chunk, Tq, per_query, q, k_win, v_win)
