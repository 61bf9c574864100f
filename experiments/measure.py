"""What the benchmarks time and count: the NSA attention core (all branches, or one forced alone),
a forced-branch layer wrapper, the dense SDPA baseline, timers, and key/value token counts.

Forcing a branch (``branch_force``) sets the gates one-hot, so the output is that branch's output;
instead of computing the other branches and multiplying them by zero, their compute is skipped.
The selected branch still runs the compressed scoring that picks its blocks (spec steps 1-4).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nsa import NSAAttention, NSAConfig, dispatch, functional
from nsa.dispatch import BRANCHES
from nsa.module import forward_rows
from nsa._compat import sdpa_gqa



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


def core(branch: str, x: CoreInputs, config: NSAConfig, plan: Mapping[str, str], fallback: str | None,
         streams: bool = True):
    """NSA attention output ``[B,Tq,HQ,Dv]``. branch "none": all three branches with the gates
    (``nsa.functional.nsa_attention``, ``streams`` passed on); "cmp"/"sel"/"win": that branch alone
    (one-hot gates)."""
    if branch == "none":
        return functional.nsa_attention(x.q, x.k_cmp, x.v_cmp, x.k_sel, x.v_sel, x.k_win, x.v_win, x.gates,
                                        config, backend=dict(plan), q_start=x.q_start, fallback=fallback,
                                        streams=streams)
    dev, dt = x.q.device, x.q.dtype
    scale = x.q.shape[-1] ** -0.5
    S = x.k_sel.shape[1]
    if branch in ("cmp", "sel"):
        o_cmp, idx = dispatch.choose("cmp", plan["cmp"], dev, dt, fallback).compressed(
            x.q, x.k_cmp, x.v_cmp, config, scale=scale, q_start=x.q_start, n_keys=S)
        if branch == "cmp":
            return o_cmp
        return dispatch.choose("sel", plan["sel"], dev, dt, fallback).selected(
            x.q, x.k_sel, x.v_sel, idx, config, scale=scale, q_start=x.q_start)
    if branch == "win":
        return dispatch.choose("win", plan["win"], dev, dt, fallback).window(
            x.q, x.k_win, x.v_win, config, scale=scale, q_start=x.q_start)
    raise ValueError(f"branch_force={branch!r}: one of none, cmp, sel, win")


def selection_indices(x: CoreInputs, config: NSAConfig, plan: Mapping[str, str], fallback: str | None):
    """The block indices ``[B,Tq,H,n_sel]`` the configured cmp backend selects for these queries."""
    scale = x.q.shape[-1] ** -0.5
    be = dispatch.choose("cmp", plan["cmp"], x.q.device, x.q.dtype, fallback)
    return be.compressed(x.q, x.k_cmp, x.v_cmp, config, scale=scale, q_start=x.q_start, n_keys=x.k_sel.shape[1])[1]


def project(layer: NSAAttention, x: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """The layer's queries, per-branch raw keys/values and gates for tokens x at positions start.."""
    pos = torch.arange(start, start + x.shape[1], device=x.device)
    return layer._project(x, pos)


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
        layer._append(cache, xc, project(layer, xc, start)[1])
        cache.length = start + xc.shape[1]


def prefill_inputs(layer: NSAAttention, x: torch.Tensor) -> CoreInputs:
    """Core inputs of a whole-sequence (prefill) call: q, compressed and raw keys from the layer."""
    q, kv, gates = project(layer, x)
    k_cmp, v_cmp = layer._compress(kv["k_cmp_raw"], kv["v_cmp_raw"])
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


def ragged_core(branch: str, rows: list[CoreInputs], config: NSAConfig, plan: Mapping[str, str],
                fallback: str | None, streams: bool = True) -> torch.Tensor:
    """``core`` of a ragged step, row by row (each query at its own position over its own keys) ->
    ``[B,1,HQ,Dv]``: what a batch of different context lengths costs on a path without ragged kernels."""
    return torch.cat([core(branch, x, config, plan, fallback, streams) for x in rows], 0)


def ragged_parts(rows: list[CoreInputs], config: NSAConfig, plan: Mapping[str, str],
                 fallback: str | None) -> dict[str, torch.Tensor]:
    """``branch_tokens`` of a ragged step, ``[B,1,H]`` per branch: each row's selected blocks from the
    configured cmp backend at its own position (``selection_indices`` on the row's inputs)."""
    per = []
    for x in rows:
        idx = selection_indices(x, config, plan, fallback)
        t = torch.tensor(x.q_start, device=idx.device)
        per.append(branch_tokens(config, t, selected_tokens(idx, config, x.q_start)))
    return {b: torch.cat([p[b] for p in per], 0) for b in BRANCHES}


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
            k_cmp, v_cmp = L._compress(kv["k_cmp_raw"], kv["v_cmp_raw"])
            keys = {n: kv[n] for n in ("k_sel", "v_sel", "k_win", "v_win")}
        else:
            k_cmp, v_cmp, keys = L._append(cache, x, kv)
        inp = CoreInputs(q, k_cmp, v_cmp, keys["k_sel"], keys["v_sel"], keys["k_win"], keys["v_win"], gates, start)
        plan = dispatch.resolve(L.backend)
        o = core(self.branch, inp, c, plan, L.fallback)
        if cache is not None:
            cache.length = start + T
        return L.o_proj(o.reshape(B, T, c.n_heads * c.d_v))


def dense_attention(q, k, v, causal: bool, kernel: str = "auto"):
    """Dense baseline: torch SDPA over ``[B,T,H*,D]`` layouts with grouped heads. A single decode
    query is not causal-masked (is_causal aligns top-left: one query would see one key).
    ``kernel``: "auto" lets PyTorch pick (cuDNN attention on an H200 with torch 2.11), "flash" forces
    its FlashAttention-2 kernel (``SDPBackend.FLASH_ATTENTION``; an error where it cannot run)."""
    if kernel not in ("auto", "flash"):
        raise ValueError(f"kernel={kernel!r}: one of auto, flash")
    pick = contextlib.nullcontext()
    if kernel == "flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        pick = sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    with pick:
        return sdpa_gqa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)


def key_mask(lengths: torch.Tensor, S: int, device) -> torch.Tensor:
    """``[B,1,1,S]`` bool: key j of row b is read (j < lengths[b])."""
    return (torch.arange(S, device=device)[None, :] < torch.as_tensor(lengths, device=device)[:, None])[:, None, None]


def dense_attention_ragged(q, k, v, mask):
    """Dense baseline of a ragged decode step: one query per row ``q [B,1,HQ,Dk]`` over that row's own keys,
    ``k``/``v`` ``[B,S,H,D*]`` under the key mask ``mask [B,1,1,S]`` (``key_mask``). The G query heads of a
    group are laid out as G queries of its key head (``[B,H,G,Dk]``), so SDPA reads the grouped cache as it
    is: ``sdpa_gqa`` with a mask would repeat the keys/values to every query head (SDPA's GQA runs only in
    its flash and math kernels, and flash takes no mask). The masked SDPA may run another kernel than the
    unmasked one of ``dense_attention`` (e.g. memory-efficient attention or the math path instead of flash
    or cuDNN), so its time includes that choice."""
    B, T, HQ, Dk = q.shape
    H = k.shape[2]
    if T != 1:
        raise ValueError(f"q: one decode query per row expected, got {tuple(q.shape)}")
    o = F.scaled_dot_product_attention(q.reshape(B, H, HQ // H, Dk), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask)
    return o.reshape(B, 1, HQ, v.shape[-1])


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------
def graph_step(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """CUDA-graph hook for decode steps: capture ``fn`` once (static inputs) and replay it."""
    if device.type != "cuda":
        raise ValueError("decode.cuda_graph=true needs a CUDA device")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def repeated(fn: Callable[[], object], n: int) -> Callable[[], object]:
    """``fn`` called ``n`` times in a row (returns the last result): the body of a graph of n steps."""
    def run():
        out = None
        for _ in range(n):
            out = fn()
        return out
    return run


def graph_ms(capture: Callable, fn: Callable[[], object], device: torch.device, warmup: int, repeats: int,
             reps: int) -> dict[str, float]:
    """Quantiles of the time of one call of ``fn`` on the GPU: ``capture`` (``graph_step``, or a
    ``GraphDecoder``'s ``graph(...).replay``) takes ``reps`` calls of fn into ONE CUDA graph, each
    replay is timed with CUDA events and divided by reps. A replay costs the host a fixed launch
    (at B=1 on an H200 a graph of one decode kernel replayed in 9.3 or 14.5 us, at random): one call
    per graph measures that launch, reps calls per graph spread it over the calls and leave the GPU's
    own time. ``single_replay_p50_ms``: the median of graphs of one call (host launch included)."""
    many = quantiles([t / reps for t in time_ms(capture(repeated(fn, reps)), device, warmup, repeats)])
    one = quantiles(time_ms(capture(fn), device, warmup, repeats))
    return {**many, "single_replay_p50_ms": one["p50_ms"]}


def decode_launch_tags(decoder) -> dict[str, str]:
    """A ``nsa.decode.GraphDecoder``'s launch modes as run tags: ``decode_pdl`` (programmatic dependent
    launch between the step's kernels), ``decode_mode`` (launches per step: ``tuning.decode.mode``) and
    ``decode_prologue`` (the layer step's RoPE, cache writes, phi and gates: ``tuning.decode.prologue``)."""
    p = decoder.kernel_params()
    return {f"decode_{k}": str(p[k]) for k in ("pdl", "mode", "prologue")}


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Milliseconds per call of fn, one sample per call: CUDA events on GPU, perf_counter on CPU."""
    for _ in range(warmup):
        fn()
    out = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for a, b in ev:
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize(device)
        return [a.elapsed_time(b) for a, b in ev]
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def profile_table(fn: Callable[[], object], device: torch.device, rows: int = 30) -> str:
    """One call of ``fn`` (after one untimed call) under ``torch.profiler``: a table of the ops and
    kernels by their own time on the device (CPU time on a CPU), so a user sees where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize(device)
    events = prof.key_averages()
    # torch >= 2.4 names the device columns "device"; 2.3 named them "cuda"
    key = "self_cpu_time_total"
    if cuda:
        key = "self_device_time_total" if all(hasattr(e, "self_device_time_total") for e in events) \
            else "self_cuda_time_total"
    return events.table(sort_by=key, row_limit=rows)


def quantiles(ms: list[float]) -> dict[str, float]:
    t = torch.tensor(ms, dtype=torch.float64)
    return {f"p{p}_ms": float(torch.quantile(t, p / 100)) for p in (20, 50, 80)}


# ------------------------------------------------------------------------------------------------
# Counting what is read: tokens of keys/values whose scores enter a softmax
# ------------------------------------------------------------------------------------------------
def selected_tokens(idx: torch.Tensor, config: NSAConfig, q_start: int) -> torch.Tensor:
    """Distinct raw tokens u <= t in the selected blocks, per query and group: ``[B,Tq,H]``.
    idx ``[B,Tq,H,n_sel]`` (-1 padded); query i sits at position q_start + i."""
    t = q_start + torch.arange(idx.shape[1], device=idx.device)[None, :, None, None]
    per_block = (t + 1 - idx * config.l_sel).clamp(0, config.l_sel)
    return torch.where(idx >= 0, per_block, torch.zeros_like(per_block)).sum(-1)


def branch_tokens(config: NSAConfig, t: torch.Tensor, sel: torch.Tensor) -> dict[str, torch.Tensor]:
    """Key/value tokens each branch reads for queries at positions t (broadcast against sel [B,Tq,H])."""
    n_cmp = torch.where(t + 1 >= config.l, (t + 1 - config.l) // config.d + 1, torch.zeros_like(t))
    win = torch.clamp(t + 1, max=config.w)
    return {"cmp": n_cmp.expand_as(sel), "sel": sel, "win": win.expand_as(sel)}


def variant_tokens(variant: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """Tokens a timed variant reads: all branches, one forced branch (sel also reads the compressed
    tokens it scores with), per query and group."""
    if variant in ("none", "nsa", "layer"):
        return parts["cmp"] + parts["sel"] + parts["win"]
    if variant == "sel":
        return parts["cmp"] + parts["sel"]
    return parts[variant]


def formula_tokens(variant: str, config: NSAConfig, S: int) -> int:
    """Paper Table 4's count at context S for the same variant (NSAConfig.decode_tokens_formula)."""
    cmp, sel, win = config.n_cmp(S), min(config.n_sel * config.l_sel, S), min(config.w, S)
    return {"cmp": cmp, "sel": cmp + sel, "win": win}.get(variant, config.decode_tokens_formula(S))
