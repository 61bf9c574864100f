"""An independent float64 oracle for NSA, written from ``docs/nsa-spec.md`` alone.

It shares no code with the ``nsa`` package (nothing here imports it) and takes plain tensors and
plain ints. It is deliberately slow and literal: Python loops over batch, query position t and
heads, one spec step per function, so that a reader can check each line against the spec.

Layouts as in the spec: q ``[B,T,HQ,Dk]``; raw keys/values ``[B,S,H,D]``; compressed keys/values
``[B,Tc,H,D]``; gates ``[B,T,HQ,3]`` in the order (cmp, sel, win). Query row r sits at absolute
position t = q_start + r. Query head h reads key/value head h // G.
"""
from __future__ import annotations

import math

import torch

F64 = torch.float64


def n_compressed(T: int, l: int, d: int) -> int:  # noqa: E741
    """Spec layouts: Tc = 0 if T < l else (T - l) // d + 1."""
    return 0 if T < l else (T - l) // d + 1


def mean_compress(x, l: int, d: int):  # noqa: E741
    """Compressed token i = mean of x[:, i*d : i*d + l] (mean pooling phi)."""
    B, T, H, D = x.shape
    out = torch.zeros(B, n_compressed(T, l, d), H, D, dtype=F64)
    for i in range(out.shape[1]):
        out[:, i] = x[:, i * d: i * d + l].to(F64).mean(dim=1)
    return out


def _softmax_attend(qv, keys, vals, scale):
    """softmax(scale * keys @ qv) @ vals for one query vector; keys [N,Dk], vals [N,Dv], N >= 1."""
    s = scale * (keys @ qv)
    e = torch.exp(s - s.max())
    p = e / e.sum()
    return p @ vals, p


def compressed_attention(q, k_cmp, v_cmp, l: int, d: int, scale: float, q_start: int = 0):  # noqa: E741
    """Spec step 1. Returns (o_cmp [B,T,HQ,Dv], p_cmp [B,T,HQ,Tc]); p_cmp is zero where not visible."""
    B, T, HQ, _ = q.shape
    Tc, H, Dv = k_cmp.shape[1], k_cmp.shape[2], v_cmp.shape[3]
    G = HQ // H
    q, k_cmp, v_cmp = q.to(F64), k_cmp.to(F64), v_cmp.to(F64)
    o = torch.zeros(B, T, HQ, Dv, dtype=F64)
    p = torch.zeros(B, T, HQ, Tc, dtype=F64)
    for b in range(B):
        for r in range(T):
            t = q_start + r
            vis = [i for i in range(Tc) if i * d + l - 1 <= t]
            if not vis:
                continue  # o_cmp = 0, p_cmp empty
            for h in range(HQ):
                g = h // G
                o[b, r, h], pr = _softmax_attend(q[b, r, h], k_cmp[b, vis, g], v_cmp[b, vis, g], scale)
                p[b, r, h, vis] = pr
    return o, p


def overlap_weight(i: int, j: int, l: int, d: int, l_sel: int) -> int:  # noqa: E741
    """|[i*d, i*d+l) ∩ [j*l_sel, (j+1)*l_sel)| / d (spec step 2, overlap form)."""
    lo = max(i * d, j * l_sel)
    hi = min(i * d + l, (j + 1) * l_sel)
    n = max(0, hi - lo)
    assert n % d == 0
    return n // d


def overlap_table(Tc: int, n_blocks: int, l: int, d: int, l_sel: int):  # noqa: E741
    """[(i, j, weight)] for every compressed token i and block j that overlap."""
    return [(i, j, overlap_weight(i, j, l, d, l_sel)) for i in range(Tc) for j in range(n_blocks)
            if overlap_weight(i, j, l, d, l_sel)]


def block_scores_overlap(p_row, n_blocks: int, l: int, d: int, l_sel: int, table=None):  # noqa: E741
    """p_slc for one query and head from its p_cmp row [Tc], overlap form of Eq. 9."""
    p = p_row.tolist()
    table = overlap_table(len(p), n_blocks, l, d, l_sel) if table is None else table
    out = [0.0] * n_blocks
    for i, j, wgt in table:
        out[j] += p[i] * wgt
    return out


def block_scores_double_sum(p_row, n_blocks: int, l: int, d: int, l_sel: int):  # noqa: E741
    """p_slc[j] = sum_{m<l_sel/d} sum_{n<l/d} p_cmp[(l_sel/d)*j + m - n], out-of-range terms zero."""
    p = p_row.tolist()
    out = []
    for j in range(n_blocks):
        s = 0.0
        for m in range(l_sel // d):
            for n in range(l // d):
                i = (l_sel // d) * j + m - n
                if 0 <= i < len(p):
                    s += p[i]
        out.append(s)
    return out


def selection_scores(p_cmp, n_heads_kv: int, n_blocks: int, l: int, d: int, l_sel: int):  # noqa: E741
    """Spec steps 2-3: p_cmp [B,T,HQ,Tc] -> group scores [B,T,H,n_blocks] (Eq. 9, then Eq. 10)."""
    B, T, HQ, _ = p_cmp.shape
    G = HQ // n_heads_kv
    table = overlap_table(p_cmp.shape[3], n_blocks, l, d, l_sel)
    out = torch.zeros(B, T, n_heads_kv, n_blocks, dtype=F64)
    for b in range(B):
        for r in range(T):
            for g in range(n_heads_kv):
                acc = [0.0] * n_blocks
                for h in range(g * G, (g + 1) * G):
                    ps = block_scores_overlap(p_cmp[b, r, h], n_blocks, l, d, l_sel, table)
                    acc = [a + x for a, x in zip(acc, ps, strict=True)]
                out[b, r, g] = torch.tensor(acc, dtype=F64)
    return out


def top_n(scores_row, t: int, l_sel: int, n_sel: int, n_init: int, n_local: int):
    """Spec step 4 for one query and group: a sorted list of selected block indices."""
    last = t // l_sel
    cands = list(range(last + 1))
    if len(cands) <= n_sel:
        return cands
    forced = [j for j in cands if j < n_init or j > last - n_local]
    rest = [j for j in cands if j not in forced]
    s = scores_row.tolist()
    rest.sort(key=lambda j: (-s[j], j))  # highest score first, ties to lower index
    return sorted(forced + rest[: n_sel - len(forced)])


def select_blocks(scores, l_sel: int, n_sel: int, n_init: int, n_local: int, q_start: int = 0):
    """Scores [B,T,H,nb] -> indices [B,T,H,n_sel], ascending, -1 padded."""
    B, T, H, _ = scores.shape
    idx = torch.full((B, T, H, n_sel), -1, dtype=torch.int64)
    for b in range(B):
        for r in range(T):
            for g in range(H):
                sel = top_n(scores[b, r, g], q_start + r, l_sel, n_sel, n_init, n_local)
                idx[b, r, g, : len(sel)] = torch.tensor(sel, dtype=torch.int64)
    return idx


def selected_attention(q, k_sel, v_sel, indices, l_sel: int, scale: float, q_start: int = 0):
    """Spec step 5: attention over raw tokens u <= t inside the selected blocks (-1 ignored)."""
    B, T, HQ, _ = q.shape
    H, Dv = k_sel.shape[2], v_sel.shape[3]
    G = HQ // H
    q, k_sel, v_sel = q.to(F64), k_sel.to(F64), v_sel.to(F64)
    o = torch.zeros(B, T, HQ, Dv, dtype=F64)
    for b in range(B):
        for r in range(T):
            t = q_start + r
            for h in range(HQ):
                g = h // G
                toks = [u for j in indices[b, r, g].tolist() if j >= 0
                        for u in range(j * l_sel, (j + 1) * l_sel) if u <= t]
                o[b, r, h] = _softmax_attend(q[b, r, h], k_sel[b, toks, g], v_sel[b, toks, g], scale)[0]
    return o


def sliding_window_attention(q, k_win, v_win, w: int, scale: float, q_start: int = 0):
    """Spec step 6: attention over u in [max(0, t-w+1), t]."""
    B, T, HQ, _ = q.shape
    H, Dv = k_win.shape[2], v_win.shape[3]
    G = HQ // H
    q, k_win, v_win = q.to(F64), k_win.to(F64), v_win.to(F64)
    o = torch.zeros(B, T, HQ, Dv, dtype=F64)
    for b in range(B):
        for r in range(T):
            t = q_start + r
            lo = max(0, t - w + 1)
            for h in range(HQ):
                g = h // G
                keys, vals = k_win[b, lo: t + 1, g], v_win[b, lo: t + 1, g]
                o[b, r, h] = _softmax_attend(q[b, r, h], keys, vals, scale)[0]
    return o


def nsa(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *, l, d, l_sel, n_sel, w,  # noqa: E741
        n_init, n_local, scale=None, q_start: int = 0, return_parts: bool = False):
    """The whole layer (spec steps 1-7). Returns (o [B,T,HQ,Dv], indices [B,T,H,n_sel]), and with
    ``return_parts`` a third item: a dict of every intermediate (o_cmp, p_cmp, scores, o_sel, o_win)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    S = k_sel.shape[1]
    n_blocks = -(-S // l_sel)
    o_cmp, p_cmp = compressed_attention(q, k_cmp, v_cmp, l, d, scale, q_start)
    scores = selection_scores(p_cmp, k_sel.shape[2], n_blocks, l, d, l_sel)
    idx = select_blocks(scores, l_sel, n_sel, n_init, n_local, q_start)
    o_sel = selected_attention(q, k_sel, v_sel, idx, l_sel, scale, q_start)
    o_win = sliding_window_attention(q, k_win, v_win, w, scale, q_start)
    g = gates.to(F64)
    o = g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win
    if return_parts:
        return o, idx, dict(o_cmp=o_cmp, p_cmp=p_cmp, scores=scores, o_sel=o_sel, o_win=o_win)
    return o, idx
