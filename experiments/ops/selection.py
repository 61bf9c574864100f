"""op=selection: selected attention (Eq. 12) alone, ``nsa.backends.triton.selection.selected_attention``.

Inputs: q ``[B,T,HQ,Dk]``, k/v ``[B,T,H,D]`` (standard normal) and random valid block indices: the
reference top-n (``reference.select_blocks``: the n_init first and n_local newest blocks forced) of
uniform random scores; with ``kernels.indices=<file>`` a trained layer's selections instead
(``measure.replay``; tags ``indices``, ``indices_note``; metric ``sel_share_m64``). Row ``triton``:
forward and forward+backward; FLOPs over the tokens u <= t of the selected blocks, 2 (Dk + Dv) per
query head and token. The kernel family (query-outer or block-outer) is ``tuning.selection.mode``
(auto: block-outer for G < 16, in row chunks at long T).

Row ``gather_floor`` (forward only): the query-outer forward's key/value loads alone
(``nsa.backends.triton.selection_floor``), with the bytes they move: that design's memory bound on this card, whichever
family row ``triton`` ran. Row ``flash_nsa`` (with ``kernels.peers``, where importable, on CUDA): the
strongest public NSA kernel set's ``select_attn`` on the same indices, checked but not held.
"""
from __future__ import annotations

import torch

from nsa import reference
from nsa.backends.triton import selection_floor, tuning
from nsa.backends.triton.selection import selected_attention
from nsa.backends.triton.utils import poisoned_outputs

from .. import peers
from ..lm.selections import tile_sharing
from ..measure import replay
from ..measure.tokens import selected_tokens
from .bench import Bench, backward_of, leaves

CHUNK = 8192  # queries per chunk of random scores (bounds their memory)


def random_indices(b: Bench, T: int) -> torch.Tensor:
    """``[B,T,H,n_sel]`` int32: the reference top-n of uniform random block scores."""
    c, nb, out = b.c, b.c.n_blocks(T), []
    for c0 in range(0, T, CHUNK):
        s = b.rand(b.B, min(T, c0 + CHUNK) - c0, c.n_kv_heads, nb, dtype=torch.float32)
        out.append(reference.select_blocks(s, c, q_start=c0).to(torch.int32))
    return torch.cat(out, 1)


def block_indices(b: Bench, T: int) -> torch.Tensor:
    """``[B,T,H,k]`` int32: ``random_indices``, or with ``kernels.indices=<file>`` a trained layer's selections at
    ``seq`` (``measure.replay``), their first T queries (the check's shorter sequence reads the same blocks)."""
    b.tags["indices"] = str(b.k.indices)
    if b.k.indices == replay.RANDOM:
        return random_indices(b, T)
    idx, b.tags["indices_note"] = replay.load(str(b.k.indices), b.T, b.c, "kernels.indices")
    return idx[:T].to(b.dev)[None].expand(b.B, -1, -1, -1).contiguous()


def inputs(b: Bench, T: int):
    c = b.c
    q = b.randn(b.B, T, c.n_heads, c.d_k)
    k = b.randn(b.B, T, c.n_kv_heads, c.d_k)
    v = b.randn(b.B, T, c.n_kv_heads, c.d_v)
    do = b.randn(b.B, T, c.n_heads, c.d_v)
    return q, k, v, do, block_indices(b, T)


def flash_nsa(b: Bench, T: int, record: bool = True):
    """flash_nsa's select_attn on B sequences of T tokens, or None (where ``record``, the row skipped with
    its reason)."""
    why = peers.flash_nsa_unavailable(b.c, b.dev)
    if why:
        if record:
            b.skip("flash_nsa", why)
        return None
    return peers.flash_nsa_selection(b.c, b.B, T, b.dev)


def check(b: Bench) -> None:
    q, k, v, do, idx = inputs(b, b.check_seq)
    xs = leaves(q, k, v)
    with poisoned_outputs():
        o = selected_attention(*xs, idx, b.c)
        o.backward(do)
    xr = b.upcast(q, k, v, grad=True)
    o_r = reference.selected_attention(*xr, idx.long(), b.c)
    o_r.backward(do.to(b.ref_dtype))
    b.compare("o", o, o_r)
    b.compare_grads("", ("dq", "dk", "dv"), xs, xr)
    if not selection_floor.unavailable(k, v, b.c.l_sel):
        got, ref = selection_floor.gather_sums(k, v, idx, b.c.l_sel), selection_floor.gather_sums_reference(
            k, v, idx, b.c.l_sel)
        for n, g, r in zip(("floor_k_sums", "floor_v_sums"), got, ref):
            b.compare(n, g, r)
    peer = flash_nsa(b, b.check_seq, record=False) if b.k.peers else None
    if peer is not None:
        xp = leaves(q, k, v)
        o_p = peer(*xp, idx)
        o_p.backward(do)
        b.compare("flash_nsa_o", o_p, o_r, hold=False)
        b.compare_grads("flash_nsa_", ("dq", "dk", "dv"), xp, xr, hold=False)


def timed(b: Bench) -> None:
    q, k, v, do, idx = inputs(b, b.T)
    c = b.c
    tokens = float(selected_tokens(idx, c, 0).sum())  # per query and group
    b.metrics["sel_share_m64"] = tile_sharing(idx, min(64, b.T))  # what neighbouring queries share (lm.selections)
    flop = 2.0 * (c.d_k + c.d_v) * c.G * tokens
    xs = leaves(q, k, v)
    fn = lambda: selected_attention(q, k, v, idx, c)
    b.row("triton", fn, backward_of(lambda: selected_attention(*xs, idx, c), xs, do),
          flop=flop, G=c.G, mode=tuning.params("selection", b.dev)["mode"])
    why = selection_floor.unavailable(k, v, c.l_sel)
    if why:
        b.skip("gather_floor", why)
    else:
        b.row("gather_floor", lambda: selection_floor.gather_sums(k, v, idx, c.l_sel),
              nbytes=selection_floor.floor_bytes(idx, c.l_sel, c.d_k, c.d_v, k.element_size()), G=c.G)
    peer = flash_nsa(b, b.T) if b.k.peers else None
    if peer is not None:
        xp = leaves(q, k, v)
        b.row("flash_nsa", lambda: peer(q, k, v, idx), backward_of(lambda: peer(*xp, idx), xp, do), flop=flop, G=c.G)


def once(b: Bench) -> None:
    q, k, v, _, idx = inputs(b, b.T)
    with torch.no_grad():
        selected_attention(q, k, v, idx, b.c)
