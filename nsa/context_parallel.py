"""Context parallelism: one sequence's NSA attention over the ranks of a ``torch.distributed`` group.

    import torch.distributed as dist
    from nsa import context_parallel as cp
    dist.init_process_group("nccl")                # torchrun; "gloo" on CPUs
    q_r = cp.shard(q, rank, world)                 # this rank's queries (and likewise every input)
    o_r = cp.nsa_attention(q_r, kc_r, vc_r, ks_r, vs_r, kw_r, vw_r, g_r, config, phi_k=.., phi_v=..)
    o = cp.unshard([o_0, .., o_{R-1}])             # = functional.nsa_attention on the whole sequence
    y_r = layer(cp.shard(x, rank, world), cp_group=dist.group.WORLD)   # the layer: the same, RoPE at the
                                                                       # rank's positions
    o_r = cp.nsa_attention(.., cu_seqlens=docs)    # packed documents: x [1,N,..], the whole cu_seqlens

Layout (:func:`shard`): the T tokens are cut into 2R equal chunks; rank r holds chunks r and 2R-1-r
(one early and one late chunk: with causal attention every rank then has about the same work). Every
input is sharded so along its token axis: q ``[B,2C,HQ,Dk]``, gates ``[B,2C,HQ,3]``, and the raw
keys/values of each branch ``[B,2C,H,D]``, the compression branch's *raw* keys/values included
(``k_cmp_raw``, ``v_cmp_raw``: rotated as the module rotates them, before phi).

Each rank all-gathers the raw keys and values (small under GQA: H heads, not HQ;
(:func:`gather_sequence`, whose backward reduce-scatters their gradients: on gloo an all-reduce), runs
the compression phi (Eq. 7) over the whole sequence itself, and attends with each of its two query chunks
through :func:`nsa.functional.nsa_attention` at its position (``q_start``), over the keys up to the
chunk's end. Outputs and every gradient equal the single-device computation (tests/test_context_parallel.py:
float64 through gloo). phi's parameters get, on each rank, the gradient of that rank's queries: sum them
over the ranks (as data parallelism all-reduces gradients) for the single-device gradient.

Packed documents (``cu_seqlens``, docs/nsa-spec.md "Varlen"): B = 1 and the N packed tokens are cut into the
same 2R equal chunks, whatever the document boundaries (a document may span chunks and ranks); every rank
passes the whole sequence's ``cu_seqlens``. phi runs per document over the gathered sequence
(``functional.compress(.., cu_seqlens=..)``). A query chunk [a, e) then splits at document boundaries into

* at most one *head* piece [a, b): the rest of the document i that began before the chunk (s_i < a),
  b = min(its end, e). One call of :func:`nsa.functional.nsa_attention` without ``cu_seqlens``: that
  document's keys [s_i, b), its first n_cmp(b - s_i) compressed tokens, ``q_start = a - s_i`` (positions
  counted from the document's start);
* the *body* [b, e): the documents that start in the chunk, the last cut at e. One packed call
  (``cu_seqlens`` of those documents, rebased to b), keys [b, e) and their compressed tokens, a contiguous
  run of the packed compressed rows. A document cut at e gives its first e - s tokens exactly what it gives
  whole (causal attention: query t reads no key after t, compressed token i only raw tokens < i*d + l,
  selection block j counted from the document's start).

So a rank makes at most four calls (two per chunk), whatever the number of documents: the packed
calls take no query offset (``q_start`` is 0 with ``cu_seqlens``), and only the head piece needs one. The
plan (pieces, their documents) is computed on the host once per :class:`nsa.varlen.Varlen` and kept with it:
pass one Varlen to every layer. The module takes it as ``layer(x_r, cu_seqlens=docs, cp_group=group)``, with
RoPE at the rank's positions counted from each document's start (:func:`positions`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from . import functional
from .config import NSAConfig
from .varlen import Varlen, as_varlen


def _chunks(T: int, world: int) -> int:
    if T % (2 * world):
        raise ValueError(f"context parallel: the sequence's {T} tokens must split into 2 x {world} ranks = "
                         f"{2 * world} equal chunks")
    return T // (2 * world)


def shard(x: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s part of ``x`` (the whole sequence along ``dim``): chunks rank and 2*world-1-rank of
    2*world equal chunks, concatenated."""
    C = _chunks(x.shape[dim], world)
    return torch.cat([x.narrow(dim, rank * C, C), x.narrow(dim, (2 * world - 1 - rank) * C, C)], dim)


def positions(T: int, rank: int, world: int, device=None, *, cu_seqlens=None) -> torch.Tensor:
    """The positions ``[2C]`` of rank ``rank``'s tokens of a T-token sequence: absolute, or with ``cu_seqlens``
    (packed documents of T tokens in all) counted from each token's document start."""
    docs = as_varlen(cu_seqlens)
    if docs is None:
        return shard(torch.arange(T, device=device)[None], rank, world)[0]
    docs.check_total(T, f"the whole sequence (T={T})")
    return shard(docs.row_pos("cpu" if device is None else device)[None], rank, world)[0]


def unshard(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's part (rank order), the inverse of :func:`shard`."""
    C = parts[0].shape[dim] // 2
    order = [p.narrow(dim, 0, C) for p in parts] + [p.narrow(dim, C, C) for p in reversed(parts)]
    return torch.cat(order, dim)


class _AllGather(torch.autograd.Function):
    """``x`` of every rank of ``group``, stacked ``[world, ...]``; the backward hands each rank the sum over the
    ranks of its part's gradient: a reduce-scatter on NCCL, an all-reduce on gloo (which has no reduce-scatter).
    torch.distributed.nn's all_gather is not used: on gloo its backward scatters from global ranks, which fails
    in a subgroup without rank 0 (the cp groups of a dp x cp mesh)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "nccl":
            out = torch.empty_like(grad[0])
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The whole sequence of ``x`` (this rank's part) from every rank, differentiable."""
    return unshard(list(_AllGather.apply(x, group).unbind(0)))


@dataclass(frozen=True)
class _Piece:
    """One attention call of a query chunk (packed rows): queries [q0, q1), raw keys [k0, q1), compressed rows
    [c0, c1); ``docs`` the documents of the body call (rows [q0, q1), so k0 = q0), None for a head piece
    (one document from k0, queries at q_start = q0 - k0)."""

    q0: int
    q1: int
    k0: int
    c0: int
    c1: int
    docs: Varlen | None


def _plan(docs: Varlen, config: NSAConfig, C: int, rank: int, world: int) -> tuple[tuple[_Piece, ...], ...]:
    """The pieces of each of the rank's two query chunks (module docstring: head and body)."""
    n_cmp = docs.cmp_counts(config)
    cu_cmp = [0]
    for n in n_cmp:
        cu_cmp.append(cu_cmp[-1] + n)
    spans = [(i, s, s + n) for i, (s, n) in enumerate(zip(docs.starts, docs.lens)) if n]  # empty ones hold nothing
    plan = []
    for pos in (rank, 2 * world - 1 - rank):
        a, e = pos * C, (pos + 1) * C
        pieces, lo = [], a
        for i, s, end in spans:
            if s < a < end:  # document i began before the chunk: its rest here is the head piece
                lo = min(end, e)
                pieces.append(_Piece(a, lo, s, cu_cmp[i], cu_cmp[i] + config.n_cmp(lo - s), None))
        if lo < e:  # the documents that start in [lo, e), the last cut at e
            body = [(i, s, min(end, e)) for i, s, end in spans if lo <= s < e]
            cu = [0] + [b - lo for _, _, b in body]
            last, s_last, b_last = body[-1]
            pieces.append(_Piece(lo, e, lo, cu_cmp[body[0][0]], cu_cmp[last] + config.n_cmp(b_last - s_last),
                                 Varlen(torch.tensor(cu, dtype=torch.int32))))
        plan.append(tuple(pieces))
    return tuple(plan)


def nsa_attention(q, k_cmp_raw, v_cmp_raw, k_sel, v_sel, k_win, v_win, gates, config: NSAConfig, *, phi_k=None,
                  phi_v=None, group=None, scale=None, backend: str | Mapping[str, str] = "reference",
                  fallback: str | None = None, cu_seqlens=None) -> torch.Tensor:
    """This rank's NSA output ``[B,2C,HQ,Dv]`` for its part of one sequence (module docstring: layout).

    ``phi_k``/``phi_v``: the compression phi of keys and values (``[B,Tc,H,l,D] -> [B,Tc,H,D]``; None:
    mean pooling), as :func:`nsa.functional.compress` takes; ``group``: the process group (default: the
    world); ``backend``/``fallback``/``scale``: as :func:`nsa.functional.nsa_attention`. ``cu_seqlens``:
    packed documents of the *whole* sequence (B = 1; its last offset is 2C x world; a tensor or a
    :class:`nsa.varlen.Varlen`, which keeps this rank's plan of calls), the same on every rank."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    for name, x in (("q", q), ("k_cmp_raw", k_cmp_raw), ("v_cmp_raw", v_cmp_raw), ("k_sel", k_sel), ("v_sel", v_sel),
                    ("k_win", k_win), ("v_win", v_win), ("gates", gates)):
        if x.dim() != 4 or x.shape[1] != q.shape[1]:
            raise ValueError(f"{name}: expected this rank's [B,2C,...] part with 2C={q.shape[1]} tokens (q's), "
                             f"got {tuple(x.shape)}")
    N = q.shape[1] * world
    C = _chunks(N, world)
    docs = as_varlen(cu_seqlens)
    if docs is not None:
        if q.shape[0] != 1:
            raise ValueError(f"q: expected batch 1 with cu_seqlens (documents packed along the token axis), "
                             f"got shape {tuple(q.shape)}")
        docs.check_total(N, f"the whole sequence (this rank's 2C={q.shape[1]} tokens x {world} ranks)")
    full = {n: gather_sequence(x, group) for n, x in (("kc", k_cmp_raw), ("vc", v_cmp_raw), ("ks", k_sel), ("vs", v_sel),
                                               ("kw", k_win), ("vw", v_win))}
    k_cmp = functional.compress(full["kc"], config, phi_k, cu_seqlens=docs)
    v_cmp = functional.compress(full["vc"], config, phi_v, cu_seqlens=docs)
    kw = dict(scale=scale, backend=backend, fallback=fallback)
    outs = []
    if docs is None:
        for half, pos in ((0, rank), (1, 2 * world - 1 - rank)):
            a, end = pos * C, (pos + 1) * C
            nc = config.n_cmp(end)
            sl = slice(half * C, (half + 1) * C)
            outs.append(functional.nsa_attention(
                q[:, sl], k_cmp[:, :nc], v_cmp[:, :nc], full["ks"][:, :end], full["vs"][:, :end],
                full["kw"][:, :end], full["vw"][:, :end], gates[:, sl], config, q_start=a, **kw))
        return torch.cat(outs, 1)
    plan = docs.kept(("context_parallel", rank, world, config.l, config.d),
                     lambda: _plan(docs, config, C, rank, world))
    for half, (pos, pieces) in enumerate(zip((rank, 2 * world - 1 - rank), plan)):
        for p in pieces:
            # the piece's queries in this rank's part: chunk `half` holds packed rows [pos*C, (pos+1)*C)
            sl = slice(half * C + p.q0 - pos * C, half * C + p.q1 - pos * C)
            keys = [full[n][:, p.k0:p.q1] for n in ("ks", "vs", "kw", "vw")]
            outs.append(functional.nsa_attention(
                q[:, sl], k_cmp[:, p.c0:p.c1], v_cmp[:, p.c0:p.c1], *keys, gates[:, sl], config,
                q_start=p.q0 - p.k0, cu_seqlens=p.docs, **kw))
    if not outs:  # N = 0: no token, no call
        return q.new_zeros(1, 0, q.shape[2], v_sel.shape[3])
    return torch.cat(outs, 1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, scale=None) -> torch.Tensor:
    """Dense causal grouped-query attention of this rank's part of one sequence, by the same all-gather: q
    ``[B,2C,HQ,D]``, k/v ``[B,2C,H,D]`` (this rank's two chunks, :func:`shard`'s layout) -> ``[B,2C,HQ,Dv]``.
    Each query chunk [a, e) attends to the gathered keys [0, e), query a + i to keys up to a + i (the causal mask
    aligned to the last key); the gradients of k and v reach their ranks through the all-gather's backward."""
    import torch.distributed as dist

    from .compat import sdpa_gqa

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    C = _chunks(q.shape[1] * world, world)
    k_all, v_all = gather_sequence(k, group), gather_sequence(v, group)
    outs = []
    for half, pos in ((0, rank), (1, 2 * world - 1 - rank)):
        a, end = pos * C, (pos + 1) * C
        rows = torch.arange(a, end, device=q.device)[:, None] >= torch.arange(end, device=q.device)[None, :]
        o = sdpa_gqa(q[:, half * C:(half + 1) * C].transpose(1, 2), k_all[:, :end].transpose(1, 2),
                     v_all[:, :end].transpose(1, 2), attn_mask=rows, scale=scale)
        outs.append(o.transpose(1, 2))
    return torch.cat(outs, 1)


__all__ = ["causal_attention", "nsa_attention", "positions", "shard", "unshard"]
