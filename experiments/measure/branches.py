"""The NSA attention core as the benchmarks time it: all branches gated, or one branch forced alone
(:func:`core`, :func:`ragged_core`), and a layer wrapper that runs one forced branch (:class:`ForcedBranch`).

Forcing a branch (``branch_force``) sets the gates one-hot, so the output is that branch's output;
instead of computing the other branches and multiplying them by zero, their compute is skipped.
The selected branch still runs the compressed scoring that picks its blocks (spec steps 1-4).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from nsa import NSAAttention, NSAConfig, dispatch, functional
from nsa.module import forward_rows

from .inputs import CoreInputs, project


def core(branch: str, x: CoreInputs, config: NSAConfig, plan: Mapping[str, str], fallback: str | None,
         streams: bool = True, *, block_indices=None, check_indices: bool = True):
    """NSA attention output ``[B,Tq,HQ,Dv]``. branch "none": all three branches with the gates
    (``nsa.functional.nsa_attention``, ``streams`` passed on); "cmp"/"sel"/"win": that branch alone
    (one-hot gates). n_sel is bounded by the blocks of the S keys (``NSAConfig.bounded``, as the library
    does): a larger n_sel selects every block, so work and index tensors are sized by the blocks that exist.
    ``block_indices`` ``[B,Tq,H,k]`` (e.g. a trained model's, ``measure.replay``): the blocks the selected
    branch reads instead of the top-n's (the compressed branch still runs; its top-n does not); ``check_indices``:
    their range checked on every call (one host sync: False in a timing loop, once they are checked)."""
    config = config.bounded(x.k_sel.shape[1])
    if branch == "none":
        return functional.nsa_attention(x.q, x.k_cmp, x.v_cmp, x.k_sel, x.v_sel, x.k_win, x.v_win, x.gates,
                                        config, backend=dict(plan), q_start=x.q_start, fallback=fallback,
                                        streams=streams, block_indices=block_indices,
                                        check_indices=check_indices)
    dev, dt = x.q.device, x.q.dtype
    scale = x.q.shape[-1] ** -0.5
    S = x.k_sel.shape[1]
    if branch == "sel" and block_indices is not None:
        idx = block_indices
    elif branch in ("cmp", "sel"):
        o_cmp, idx = dispatch.choose("cmp", plan["cmp"], dev, dt, fallback).compressed(
            x.q, x.k_cmp, x.v_cmp, config, scale=scale, q_start=x.q_start, n_keys=S)
        if branch == "cmp":
            return o_cmp
    if branch == "sel":
        return dispatch.choose("sel", plan["sel"], dev, dt, fallback).selected(
            x.q, x.k_sel, x.v_sel, idx, config, scale=scale, q_start=x.q_start)
    if branch == "win":
        return dispatch.choose("win", plan["win"], dev, dt, fallback).window(
            x.q, x.k_win, x.v_win, config, scale=scale, q_start=x.q_start)
    raise ValueError(f"branch_force={branch!r}: one of none, cmp, sel, win")


def selection_indices(x: CoreInputs, config: NSAConfig, plan: Mapping[str, str], fallback: str | None):
    """The block indices ``[B,Tq,H,k]`` the configured cmp backend selects for these queries (k: n_sel bounded
    by the blocks of the keys, ``NSAConfig.bounded``)."""
    config = config.bounded(x.k_sel.shape[1])
    scale = x.q.shape[-1] ** -0.5
    be = dispatch.choose("cmp", plan["cmp"], x.q.device, x.q.dtype, fallback)
    return be.compressed(x.q, x.k_cmp, x.v_cmp, config, scale=scale, q_start=x.q_start, n_keys=x.k_sel.shape[1])[1]


def ragged_core(branch: str, rows: list[CoreInputs], config: NSAConfig, plan: Mapping[str, str],
                fallback: str | None, streams: bool = True) -> torch.Tensor:
    """``core`` of a ragged step, row by row (each query at its own position over its own keys) ->
    ``[B,1,HQ,Dv]``: what a batch of different context lengths costs on a path without ragged kernels."""
    return torch.cat([core(branch, x, config, plan, fallback, streams) for x in rows], 0)


class ForcedBranch(nn.Module):
    """Wraps an NSAAttention so that only ``branch`` runs (gates one-hot, other branches skipped).
    Same forward as the layer: ``(x [B,T,dim], cache=None) -> [B,T,dim]``; on a ragged cache each row's
    tokens go at its own position (``nsa.module.forward_rows``, as ``NSAAttention.forward`` does)."""

    def __init__(self, layer: NSAAttention, branch: str):
        super().__init__()
        self.layer, self.branch = layer, branch

    def forward(self, x, cache=None):
        L, c = self.layer, self.layer.config
        B, T, _ = x.shape
        if cache is not None and cache.ragged:  # each row at its own position, as the module's forward does
            return forward_rows(self, x, cache)
        start = 0 if cache is None else cache.length
        q, kv, gates = project(L, x, start)
        if cache is None:
            k_cmp, v_cmp = L.compress(kv["k_cmp_raw"], kv["v_cmp_raw"])
            keys = {n: kv[n] for n in ("k_sel", "v_sel", "k_win", "v_win")}
        else:
            k_cmp, v_cmp, keys = L.append_to_cache(cache, x, kv)
        inp = CoreInputs(q, k_cmp, v_cmp, keys["k_sel"], keys["v_sel"], keys["k_win"], keys["v_win"], gates, start)
        plan = dispatch.resolve(L.backend)
        o = core(self.branch, inp, c, plan, L.fallback)
        if cache is not None:
            cache.length = start + T
        return L.o_proj(o.reshape(B, T, c.n_heads * c.d_v))
