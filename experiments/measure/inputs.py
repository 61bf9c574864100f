"""The attention inputs the benchmarks feed the layer's branches: one layer call's queries, keys and
gates (:class:`CoreInputs`), from a whole sequence (prefill) or a filled cache (decode, ragged decode)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nsa import NSAAttention, NSAConfig


@dataclass
class CoreInputs:
    """Attention inputs of one layer call: queries at q_start.., the cached/whole keys."""

    q: torch.Tensor
    k_cmp: torch.Tensor
    v_cmp: torch.Tensor
    k_sel: torch.Tensor
    v_sel: torch.Tensor
    k_win: torch.Tensor
    v_win: torch.Tensor
    gates: torch.Tensor
    q_start: int = 0

    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in ("q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win", "gates")}


def project(layer: NSAAttention, x: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """The layer's queries, per-branch raw keys/values and gates for tokens x at positions start.."""
    pos = torch.arange(start, start + x.shape[1], device=x.device)
    return layer.project(x, pos)


def fill_per_seq(tokens: int, batch: int) -> int:
    """Tokens per sequence of one fill pass of at most ``tokens`` tokens over ``batch`` sequences (at least 1)."""
    return max(1, tokens // batch)


@torch.no_grad()
def fill_cache(layer: NSAAttention, cache, n: int, tokens: int) -> None:
    """Positions 0 .. n-1 of ``cache`` filled with the layer's keys/values of random tokens, in passes of
    ``fill_per_seq(tokens, batch)`` positions of every sequence, so one pass holds the activations of about
    ``tokens`` tokens whatever the batch (what a prefill leaves there: one layer's cache does not depend on
    its attention outputs)."""
    p = next(layer.parameters())
    per = fill_per_seq(tokens, cache.batch_size)
    for start in range(0, n, per):
        xc = torch.randn(cache.batch_size, min(per, n - start), layer.config.dim, device=p.device, dtype=p.dtype)
        layer.append_to_cache(cache, xc, project(layer, xc, start)[1])
        cache.length = start + xc.shape[1]


def prefill_inputs(layer: NSAAttention, x: torch.Tensor) -> CoreInputs:
    """Core inputs of a whole-sequence (prefill) call: q, compressed and raw keys from the layer."""
    q, kv, gates = project(layer, x)
    k_cmp, v_cmp = layer.compress(kv["k_cmp_raw"], kv["v_cmp_raw"])
    return CoreInputs(q, k_cmp, v_cmp, kv["k_sel"], kv["v_sel"], kv["k_win"], kv["v_win"], gates, 0)


def cache_inputs(layer: NSAAttention, cache, x_step: torch.Tensor) -> CoreInputs:
    """Core inputs of the decode step whose token (at position cache.length-1) is already cached."""
    t = cache.length - 1
    q, _, gates = project(layer, x_step, t)
    c, S = layer.config, cache.length
    Tc = c.n_cmp(S)
    return CoreInputs(q, cache.k_cmp[:, :Tc], cache.v_cmp[:, :Tc], cache.k_sel[:, :S], cache.v_sel[:, :S],
                      cache.k_win[:, :S], cache.v_win[:, :S], gates, t)


def ragged_inputs(layer: NSAAttention, cache, x_step: torch.Tensor) -> list[CoreInputs]:
    """Per row b, the core inputs of row b's decode step (``x_step[b]``, its token at position
    ``cache.lengths[b] - 1`` already cached): ``cache_inputs`` on ``cache.row(b)``, views of row b's buffers
    up to its own length (nothing copied)."""
    return [cache_inputs(layer, cache.row(b), x_step[b:b + 1]) for b in range(cache.batch_size)]


def layer_bytes(config: NSAConfig, itemsize: int) -> float:
    """Bytes of an NSAAttention layer's parameters in a dtype of ``itemsize`` bytes (counted on the meta
    device: nothing is allocated), for the memory estimates."""
    with torch.device("meta"):
        return float(sum(p.numel() for p in NSAAttention(config).parameters()) * itemsize)
