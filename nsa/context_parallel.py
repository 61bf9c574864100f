"""Context parallelism: one sequence's NSA attention over the ranks of a ``torch.distributed`` group.

    import torch.distributed as dist
    from nsa import context_parallel as cp
    dist.init_process_group("nccl")                # torchrun; "gloo" on CPUs
    q_r = cp.shard(q, rank, world)                 # this rank's queries (and likewise every input)
    o_r = cp.nsa_attention(q_r, kc_r, vc_r, ks_r, vs_r, kw_r, vw_r, g_r, config, phi_k=.., phi_v=..)
    o = cp.unshard([o_0, .., o_{R-1}])             # = functional.nsa_attention on the whole sequence
    y_r = layer(cp.shard(x, rank, world), cp_group=dist.group.WORLD)   # the layer: the same, RoPE at the
                                                                       # rank's positions

Layout (:func:`shard`): the T tokens are cut into 2R equal chunks; rank r holds chunks r and 2R-1-r
(one early and one late chunk: with causal attention every rank then has about the same work). Every
input is sharded so along its token axis: q ``[B,2C,HQ,Dk]``, gates ``[B,2C,HQ,3]``, and the raw
keys/values of each branch ``[B,2C,H,D]``, the compression branch's *raw* keys/values included
(``k_cmp_raw``, ``v_cmp_raw``: rotated as the module rotates them, before phi).

Each rank all-gathers the raw keys and values (small under GQA: H heads, not HQ;
``torch.distributed.nn.functional.all_gather``, whose backward reduce-scatters their gradients), runs
the compression phi (Eq. 7) over the whole sequence itself, and attends with each of its two query chunks
through :func:`nsa.functional.nsa_attention` at its position (``q_start``), over the keys up to the
chunk's end. Outputs and every gradient equal the single-device computation (tests/test_context_parallel.py:
float64 through gloo). phi's parameters get, on each rank, the gradient of that rank's queries: sum them
over the ranks (as data parallelism all-reduces gradients) for the single-device gradient.
"""
from __future__ import annotations

from typing import Mapping

import torch

from . import functional
from .config import NSAConfig


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


def positions(T: int, rank: int, world: int, device=None) -> torch.Tensor:
    """The absolute positions ``[2C]`` of rank ``rank``'s tokens of a T-token sequence."""
    return shard(torch.arange(T, device=device)[None], rank, world)[0]


def unshard(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's part (rank order), the inverse of :func:`shard`."""
    C = parts[0].shape[dim] // 2
    order = [p.narrow(dim, 0, C) for p in parts] + [p.narrow(dim, C, C) for p in reversed(parts)]
    return torch.cat(order, dim)


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    """The whole sequence of ``x`` (this rank's part) from every rank, differentiable."""
    import torch.distributed.nn.functional as dist_fn

    return unshard(list(dist_fn.all_gather(x, group=group)))


def nsa_attention(q, k_cmp_raw, v_cmp_raw, k_sel, v_sel, k_win, v_win, gates, config: NSAConfig, *, phi_k=None,
                  phi_v=None, group=None, scale=None, backend: str | Mapping[str, str] = "reference",
                  fallback: str | None = None) -> torch.Tensor:
    """This rank's NSA output ``[B,2C,HQ,Dv]`` for its part of one sequence (module docstring: layout).

    ``phi_k``/``phi_v``: the compression phi of keys and values (``[B,Tc,H,l,D] -> [B,Tc,H,D]``; None:
    mean pooling), as :func:`nsa.functional.compress` takes; ``group``: the process group (default: the
    world); ``backend``/``fallback``/``scale``: as :func:`nsa.functional.nsa_attention`."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    for name, x in (("q", q), ("k_cmp_raw", k_cmp_raw), ("v_cmp_raw", v_cmp_raw), ("k_sel", k_sel), ("v_sel", v_sel),
                    ("k_win", k_win), ("v_win", v_win), ("gates", gates)):
        if x.dim() != 4 or x.shape[1] != q.shape[1]:
            raise ValueError(f"{name}: expected this rank's [B,2C,...] part with 2C={q.shape[1]} tokens (q's), "
                             f"got {tuple(x.shape)}")
    C = _chunks(q.shape[1] * world, world)
    full = {n: _gather(x, group) for n, x in (("kc", k_cmp_raw), ("vc", v_cmp_raw), ("ks", k_sel), ("vs", v_sel),
                                               ("kw", k_win), ("vw", v_win))}
    k_cmp = functional.compress(full["kc"], config, phi_k)
    v_cmp = functional.compress(full["vc"], config, phi_v)
    outs = []
    for half, pos in ((0, rank), (1, 2 * world - 1 - rank)):
        a, end = pos * C, (pos + 1) * C
        nc = config.n_cmp(end)
        sl = slice(half * C, (half + 1) * C)
        outs.append(functional.nsa_attention(
            q[:, sl], k_cmp[:, :nc], v_cmp[:, :nc], full["ks"][:, :end], full["vs"][:, :end], full["kw"][:, :end],
            full["vw"][:, :end], gates[:, sl], config, scale=scale, backend=backend, fallback=fallback, q_start=a))
    return torch.cat(outs, 1)


__all__ = ["nsa_attention", "positions", "shard", "unshard"]
