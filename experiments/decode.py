"""Decode benchmark: one step at context length seq, per branch, vs dense SDPA decode.

    python -m experiments.decode hardware=cpu -m seq=256,512                 # a CPU sweep
    python -m experiments.decode hardware=rtx4090 -m seq=512,1024,2048,4096  # on an RTX 4090
    python -m experiments.decode -m seq=256,512 --cfg job                    # each job's config, no run
    python -m experiments.decode hardware=cpu decode.ragged=true decode.batch=4 -m seq=256,512  # ragged batch

The cache is filled with seq-1 tokens (the layer's projected and compressed keys/values, written in
passes of ``decode.fill_tokens`` tokens over the batch, exactly what a prefill leaves there); the timed
step is the query at position t = seq-1, which attends to seq keys (so the paper's count at S = seq
applies). Rows (column ``variant``):

* ``layer``: the whole NSAAttention step (projections, cache write, compression, attention, output),
  with branch_force applied through ``measure.branches.ForcedBranch``;
* ``nsa``: the attention core, all three branches gated (branch_force=none), or the forced branch;
* ``cmp``/``sel``/``win``: each branch alone (with branch_force=none and decode.per_branch);
* ``dense``: torch SDPA decode over seq keys with the same heads and dims;
* the public NSA kernels of ``decode.peers`` (``experiments.peers``: ``fla``, on the same query, gates and
  cache, where it can run the shape; else a tag ``peer_fla`` says why).

Key/value tokens read are counted from the indices and ranges the step used (per group, mean over
batch and groups), beside the paper's formula; bytes are summed over batch and groups. A single run (not a
sweep's job, whose parent charts them against seq) logs them with the HBM floor (bytes / the profile's
peak_hbm_gbps) as metrics ``kv_tokens_read_per_step_per_group/<variant>``, ``kv_bytes_read_per_step/<variant>``
and ``hbm_floor_ms/<variant>``; every run has the headlines ``0_nsa_hbm_floor_ms``, ....

Timing on a GPU (``decode.cuda_graph``): each row is captured ``decode.graph_reps`` times in a row in
ONE CUDA graph, and the time of a replay divided by that number is the step's time (p20/p50/p80_ms).
One replay costs the host a fixed launch: at B=1 on an H200 a graph holding one decode kernel replayed
in 9.3 or 14.5 us at random, so one step per graph measured the launch, not the GPU's work.
``single_replay_p50_ms`` keeps that figure (one step per graph, one replay). Column ``step_path``:
``graph_decoder`` (nsa.decode.GraphDecoder) or ``module`` (the module's forward, and measure.branches.core per
branch, where the ``sel`` row also runs the compressed scoring that picks its blocks).

Ragged batches (``decode.ragged=true``): sequence b has its own context length L_b, uniform integers in
[seq/2, seq] drawn from ``seed`` (``ragged_lengths``; tag ``ragged_lengths``, metrics
``ragged_min/mean/max_tokens``). The cache is filled as above, then each row's length is set to L_b - 1,
so the timed step is row b's query at position L_b - 1 over L_b keys: on the GraphDecoder path its kernels
at each row's position, on the module path the module's forward on the ragged cache (a loop over rows,
like ``measure.branches.ragged_core`` for the ``nsa`` and per-branch rows). ``dense`` is SDPA over each row's own
keys under a key mask (``measure.dense.dense_attention_ragged``: it may run another SDPA kernel than the
unmasked uniform one). Token counts are per row at its own length (the decoder's indices through
``nsa.decode.tokens_read`` and its kernel counters, row by row; on the module path each row's own
top-n), averaged over rows like the groups; the formula column is the mean of each row's formula. Rows
gain ``ragged`` and ``ragged_mean_tokens``; ``seq_tokens`` stays seq. Peers are not timed (tag
``ragged_skipped``: they take one length for the batch).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable

import hydra
import torch
from omegaconf import DictConfig

from nsa import NSAAttention
from nsa.compat import SDPA_ENABLE_GQA
from nsa.backends.triton.decode_attention import device_params, workspace_bytes
from nsa.decode import GraphDecoder, tokens_read
from nsa.dispatch import BRANCHES

from . import peers
from .framework import Charts, Job, Result, check_memory, launch, run_job, should_stop
from .measure.branches import ForcedBranch, core, ragged_core, selection_indices
from .measure.dense import dense_attention, dense_attention_ragged, key_mask, math_path
from .measure.inputs import cache_inputs, fill_cache, fill_per_seq, ragged_inputs
from .measure.timing import decode_launch_tags, graph_ms, graph_step, quantiles, time_ms
from .measure.tokens import branch_tokens, formula_tokens, ragged_parts, selected_tokens, variant_tokens

log = logging.getLogger("experiments.decode")

# Row columns logged per variant as metrics ``<column>/<variant>`` on a single run: what the step reads
READ_METRICS = ("kv_tokens_read_per_step_per_group", "kv_bytes_read_per_step", "hbm_floor_ms")


def check_config(job: Job) -> None:
    """decode's own rules beyond ``config.RULES`` (``run_job`` and ``launch`` take it as ``check``: a ValueError is
    a config error, one line, exit 2, before any run)."""
    if job.cfg.decode.ragged and job.seq < 2:
        raise ValueError(f"decode.ragged=true: seq={job.seq} must be >= 2 (each sequence's length is drawn in "
                         "[seq/2, seq], and seq/2 must be >= 1)")


def ragged_lengths(seq: int, batch: int, seed: int) -> torch.Tensor:
    """decode.ragged's context lengths: int64 ``[batch]`` (CPU), uniform integers in [ceil(seq/2), seq] from
    a generator of their own seeded with ``seed`` (the global one, which fills the cache, is left as is)."""
    g = torch.Generator().manual_seed(int(seed))
    return torch.randint((seq + 1) // 2, seq + 1, (batch,), generator=g, dtype=torch.int64)


def uses_decoder(job: Job) -> bool:
    """The step runs through nsa.decode.GraphDecoder: CUDA graphs on CUDA and triton for every branch."""
    return bool(job.cfg.decode.cuda_graph) and job.device.type == "cuda" and all(job.plan[b] == "triton" for b in BRANCHES)


def memory_parts(job: Job) -> dict[str, float]:
    """Bytes of the tensors a decode job holds, by part (``estimate_bytes`` sums them; the fill pass's are
    freed before the step's are made, so the sum bounds the peak from above):

    * ``cache``: three branches' raw keys/values and the compressed ones (twice on the GraphDecoder path:
      it copies them into a buffer one row longer);
    * ``fill``: one pass of ``measure.inputs.fill_cache`` (``decode.fill_tokens`` tokens over the batch): input,
      queries, gates and the six key/value projections, RoPE's float32 temporaries of the queries (four of
      their size), phi's input blocks of the compressed tokens the pass completes;
    * ``weights``: the layer's parameters (and GraphDecoder's copy of the projections);
    * ``step``: on the GraphDecoder path the decode kernels' workspaces as the kernels size them
      (``decode_attention.workspace_bytes`` of ``device_params``: the same launch parameters, tuning overrides
      and split rules as ``DecodeKernels``; its prologue's few buffers aside); on the module path a float32
      copy of the compressed cache (the reference's upcast);
    * ``dense``: the dense baseline's keys/values repeated to every query head, where SDPA has no
      ``enable_gqa`` (``nsa.compat.sdpa_gqa``; with it SDPA reads the grouped cache in place) or runs its math
      kernel (``measure.dense.math_path``: a CPU where d_k != d_v; the keys once more, transposed, and the
      scores); with
      ``decode.ragged`` instead (``measure.dense.dense_attention_ragged``, nothing repeated) the key mask (B*S
      bools), its additive float form, and the scores and probabilities of the step where SDPA keeps them
      (its math path, float32 or float64: 2*B*HQ*S); the ragged step allocates nothing else beyond the uniform one
      (row views of the same cache, per-row inputs and outputs of one token);
    * ``peers``: fla's pooled keys/values of the whole cache (``decode.peers``, where fla runs)."""
    c, d, S, e = job.nsa, job.cfg.decode, job.seq, job.dtype.itemsize
    c = c.bounded(S)  # n_sel beyond the cache's blocks: the decoder sizes its buffers by the blocks (NSAConfig.bounded)
    B, H, HQ, kv = d.batch, c.n_kv_heads, c.n_heads, c.d_k + c.d_v
    acc = 8 if job.dtype == torch.float64 else 4
    Tc = c.n_cmp(S)
    per = min(fill_per_seq(d.fill_tokens, B), max(S - 1, 1))
    N = B * per  # tokens of one fill pass
    fill = (N * (c.dim + HQ * c.d_k + 3 * HQ + c.gate_hidden + 3 * H * kv) * e
            + 4 * N * HQ * c.d_k * acc
            + 2 * B * min(per // c.d + 1, max(Tc, 1)) * H * c.l * kv * e)
    with torch.device("meta"):
        weights = sum(p.numel() for p in NSAAttention(c).parameters()) * e
    cache = 3 * B * S * H * kv * e + B * Tc * H * kv * e
    if uses_decoder(job):
        # the kernels' own sizing (nsa.backends.triton.decode_attention): launch parameters, then workspaces
        step = workspace_bytes(c, B, device_params(c, B, S, job.device), job.dtype)
        cache += B * (Tc + 1) * H * kv * e
        weights += (HQ * c.d_k + 3 * H * kv) * c.dim * e
    else:
        step = B * Tc * H * kv * 4
    ragged = bool(d.get("ragged", False))
    fla = not ragged and "fla" in d.peers and peers.fla_unavailable(c, job.device) is None
    if ragged:
        dense = B * S * (1 + acc) + 2 * B * HQ * S * acc
    elif math_path(job.device, c.d_k, c.d_v):  # keys/values repeated to every head, the keys once more transposed
        dense = B * S * HQ * (2 * c.d_k + c.d_v) * e + 3 * B * HQ * S * acc
    else:
        dense = 0 if SDPA_ENABLE_GQA else B * S * HQ * kv * e
    return {"cache": float(cache), "fill": float(fill), "weights": float(weights), "step": float(step),
            "dense": float(dense),
            "peers": float(2 * B * -(-S // c.l_sel) * H * kv * e if fla else 0)}


def estimate_bytes(job: Job) -> float:
    return sum(memory_parts(job).values())


def check_fits(job: Job) -> dict[str, float]:
    """:func:`memory_parts`, or ResourceLimit (one line, with the parts) where their sum exceeds the limit
    (``run_job`` calls this before the run is created; ``work`` again before allocating)."""
    mem = memory_parts(job)
    check_memory(job, sum(mem.values()), f"decode.batch={job.cfg.decode.batch}: "
                 + ", ".join(f"{k} {v / 2**30:.3g}" for k, v in mem.items() if v) + " GiB")
    return mem


def work(job: Job) -> Result:
    """decode's job (module docstring): the cache filled to seq-1, then each variant's step timed.

    Arguments:
        job: the prepared job (``config.prepare``).

    Returns:
        One CSV row per variant (times, keys/values read, HBM floor, speedup), the run's metrics (per variant
        what it reads, the kernels' own token counts, the memory estimate and peak), the headline, the charts
        a sweep draws, and tags (the launch parameters, ragged lengths, peers skipped).
    """
    d, c, S = job.cfg.decode, job.nsa, job.seq
    mem = check_fits(job)
    B, dev, dt = d.batch, job.device, job.dtype
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    layer = NSAAttention(c, backend=job.plan, fallback=job.fallback).to(dev, dt).eval()
    metrics, tags, texts = {}, {}, {}
    # decode.ragged: each sequence's own context length L (None: every row at seq)
    L = ragged_lengths(S, B, job.cfg.seed) if d.get("ragged", False) else None
    if L is not None:
        _note_ragged(job, L, metrics, tags, texts)
    timed = ["layer", "nsa"] + (["cmp", "sel", "win"] if job.branch == "none" and d.per_branch else []) + ["dense"]
    with torch.no_grad():
        times, parts, peer = _measure(job, layer, L, timed, metrics, tags)
    timed += list(peer)
    rows = [_row(job, v, times, parts, peer, L) for v in timed]
    # A single run: what each variant's step reads and its HBM floor (a sweep's parent charts them against seq,
    # and its children keep to a few metrics each)
    if job.cfg.tracking.get("parent_run_id") is None:
        metrics.update({f"{k}/{r['variant']}": float(r[k]) for r in rows for k in READ_METRICS})
    metrics["memory_estimate_gib"] = sum(mem.values()) / 2**30
    if dev.type == "cuda":
        metrics["memory_peak_allocated_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    by = {r["variant"]: r for r in rows}
    headline = {"nsa_p50_ms": by["nsa"]["p50_ms"], "dense_p50_ms": by["dense"]["p50_ms"],
                "nsa_speedup_vs_dense_x": by["nsa"]["speedup_vs_dense_x"], "layer_p50_ms": by["layer"]["p50_ms"],
                "nsa_kv_gb_per_s": by["nsa"]["kv_gb_per_s"],
                "nsa_kv_tokens_read_per_step_per_group": by["nsa"]["kv_tokens_read_per_step_per_group"],
                "nsa_hbm_floor_ms": by["nsa"]["hbm_floor_ms"]}
    # The sweep's parent charts each of these per variant against seq (metrics <y>/<variant>): the latency
    # and speedup, and what a step reads (tokens, bytes), its HBM floor and share of the roofline.
    charts = Charts("seq_tokens", "variant", ("p50_ms", "speedup_vs_dense_x", "kv_tokens_read_per_step_per_group",
                                              "kv_bytes_read_per_step", "hbm_floor_ms", "kv_bw_roofline_pct"))
    return Result(rows, metrics, headline=headline, charts=charts, tags=tags, texts=texts)


def _note_ragged(job: Job, L: torch.Tensor, metrics: dict, tags: dict, texts: dict) -> None:
    """decode.ragged's lengths ``L`` on the run (tag ``ragged_lengths``, an artifact too where the tag cannot
    hold them; metrics ``ragged_min/mean/max_tokens``) and in the log; peers are skipped (tag)."""
    d, S = job.cfg.decode, job.seq
    lens = json.dumps(L.tolist())
    tags["ragged_lengths"] = lens
    if len(lens) > 5000:  # a tag holds 5000 characters: the whole list as an artifact too
        texts["ragged_lengths.json"] = lens
    metrics.update(ragged_min_tokens=float(L.min()), ragged_mean_tokens=float(L.double().mean()),
                   ragged_max_tokens=float(L.max()))
    log.info(f"[decode] seq={S} ragged: context lengths {L.tolist()} (min {int(L.min())}, "
             f"mean {float(L.double().mean()):.1f}, max {int(L.max())})")
    if d.peers:
        tags["ragged_skipped"] = "peers"
        log.info(f"[decode] seq={S} ragged: peers {list(d.peers)} skipped (they take one length for the batch)")


def _progress(S: int, i: int, n: int, name: str, q: dict) -> None:
    """The log line of variant ``name``, the i-th of n timed."""
    log.info(f"[decode] seq={S} [{i}/{n}] {name}: p50 {q['p50_ms']:.4f} ms")


def _graphs(job: Job) -> bool:
    """Timed steps are captured in CUDA graphs (decode.cuda_graph, on CUDA)."""
    return bool(job.cfg.decode.cuda_graph) and job.device.type == "cuda"


def _capture(job: Job) -> Callable:
    """The module path's graph capture: ``measure.timing.graph_step`` on the job's device."""
    return lambda fn: graph_step(fn, job.device)


def _time_step(job: Job, capture: Callable, fn: Callable) -> dict[str, float]:
    """Quantiles of one call of fn: from graphs of decode.graph_reps calls (``capture``) on CUDA, eager on CPU."""
    d, dev = job.cfg.decode, job.device
    if not _graphs(job):
        return quantiles(time_ms(fn, dev, d.warmup, d.repeats, should_stop))
    return graph_ms(capture, fn, dev, d.warmup, d.repeats, d.graph_reps, should_stop)


def _place(cache, S: int, L: torch.Tensor | None, k: int) -> None:
    """Every row of ``cache`` at its step's position (k=0: seq-1, or L_b-1), or just past it (k=1)."""
    if L is None:
        cache.length = S - 1 + k
    else:
        cache.lengths = L - 1 + k


def _measure(job: Job, layer: NSAAttention, L: torch.Tensor | None, timed: list[str], metrics: dict, tags: dict):
    """Fill a cache to seq-1 and time each variant of ``timed`` (then the peers) at the step's position.

    On CUDA with the triton backend for every branch, the step runs through nsa.decode.GraphDecoder (fused
    decode kernels, device-side position, CUDA graphs; its kernel counters are checked against the indices,
    metrics ``kernel_counted_*``); elsewhere through the module's forward.

    Returns:
        (variant -> quantiles, branch -> the tokens each group's step reads ``[B,1,H]``, peer name -> its row
        (``peers.rows``)).
    """
    d, c, S, dev, dt, branch = job.cfg.decode, job.nsa, job.seq, job.device, job.dtype, job.branch
    B, n = d.batch, len(timed)
    use_decoder, capture = uses_decoder(job), _capture(job)
    cache = layer.new_cache(B, S, dev, dt)
    fill_cache(layer, cache, S - 1, d.fill_tokens)  # positions 0 .. S-2
    xs = torch.randn(B, 1, c.dim, device=dev, dtype=dt)
    _place(cache, S, L, 0)  # before the decoder reads the positions
    dec = None
    if use_decoder:
        # nsa.decode.GraphDecoder: device-side position, one CUDA graph per variant (the GPU path).
        dec = GraphDecoder(layer, cache)
        tags.update(decode_launch_tags(dec))
        forced = BRANCHES if branch == "none" else (branch,)
        times = {"layer": _time_step(job, lambda f: dec.graph(f).replay, dec.step_fn(xs, branches=forced, advance=False))}
    else:
        step_layer = layer if branch == "none" else ForcedBranch(layer, branch)

        def layer_step():
            _place(cache, S, L, 0)
            step_layer(xs, cache)

        times = {"layer": _time_step(job, capture, layer_step)}
    _progress(S, 1, n, "layer", times["layer"])
    _place(cache, S, L, 1)
    inp = rows_in = parts = None
    if L is None:
        inp = cache_inputs(layer, cache, xs)
        q_all, g_all = inp.q, inp.gates
        # What the step reads: selected blocks from the configured cmp backend, ranges from the spec.
        t = torch.tensor(S - 1, device=dev)
        idx = selection_indices(inp, c, job.plan, job.fallback)
        parts = branch_tokens(c, t, selected_tokens(idx, c, S - 1))
    else:  # each row's query at its own position, over views of its own keys
        rows_in = ragged_inputs(layer, cache, xs)
        q_all, g_all = torch.cat([x.q for x in rows_in]), torch.cat([x.gates for x in rows_in])
        if not use_decoder:  # each row's own top-n (the configured cmp backend)
            parts = ragged_parts(rows_in, c, job.plan, job.fallback)
    if use_decoder:
        q_d, g_d = q_all[:, 0], g_all[:, 0]
        parts = _checked_counts(dec, c, S, L, q_d, g_d, parts, metrics)
    for i, v in enumerate(timed[1:-1], 2):
        if use_decoder:
            brs = (BRANCHES if branch == "none" else (branch,)) if v == "nsa" else (v,)
            times[v] = _time_step(job, lambda f: dec.graph(f).replay,
                                  lambda brs=brs, v=v: dec.attend(q_d, g_d, branches=brs, combine=(v == "nsa")))
        else:
            forced = branch if v == "nsa" else v

            def step(forced=forced):
                if L is None:
                    core(forced, inp, c, job.plan, job.fallback, job.cfg.streams)
                else:
                    ragged_core(forced, rows_in, c, job.plan, job.fallback, job.cfg.streams)

            times[v] = _time_step(job, capture, step)
        _progress(S, i, n, v, times[v])
    if L is None:
        qd, kd, vd = inp.q, inp.k_win, inp.v_win
        times["dense"] = _time_step(job, capture, lambda: dense_attention(qd, kd, vd, causal=False))
    else:  # SDPA over each row's own L_b keys: a key mask over the cache
        mask, kd, vd = key_mask(L, S, dev), cache.k_win[:, :S], cache.v_win[:, :S]
        times["dense"] = _time_step(job, capture, lambda: dense_attention_ragged(q_all, kd, vd, mask))
    _progress(S, n, n, "dense", times["dense"])
    peer = peers.rows(d.peers, inp, c, dev, tags) if L is None else {}
    for i, (v, p) in enumerate(peer.items(), n + 1):
        times[v] = quantiles(time_ms(graph_step(p.fn, dev) if _graphs(job) else p.fn, dev, d.warmup, d.repeats,
                                         should_stop))
        _progress(S, i, i, v, times[v])
    return times, parts, peer


def _checked_counts(dec: GraphDecoder, c, S: int, L: torch.Tensor | None, q_d, g_d, parts, metrics: dict):
    """One counted step of the decoder's kernels: their own counters must agree with the count from the
    indices (RuntimeError otherwise); metrics ``kernel_counted_<branch>_tokens_per_step_per_group``.

    Returns:
        branch -> tokens read ``[B,1,H]``: ``parts`` (uniform), or per row at its own length from the
        decoder's own indices (ragged).
    """
    dec.attend(q_d, g_d, position=S - 1 if L is None else L - 1, count=True)
    if L is None:
        counted = dec.token_counts().double().mean((0, 1)).tolist()
        for b, n in zip(BRANCHES, counted):
            metrics[f"kernel_counted_{b}_tokens_per_step_per_group"] = n
            if abs(n - float(parts[b].double().mean())) > 0:
                raise RuntimeError(f"decode kernels counted {n} {b} tokens, indices give "
                                   f"{float(parts[b].double().mean())}")
        return parts
    # per row, at its own length: the decoder's own indices, and its counters row by row
    read = tokens_read(c, L, dec.indices())
    parts = {b: read[b][:, None] for b in BRANCHES}  # [B,1,H], as the uniform count
    counted = dec.token_counts().double().cpu()  # [B,H,3]
    for j, b in enumerate(BRANCHES):
        metrics[f"kernel_counted_{b}_tokens_per_step_per_group"] = float(counted[..., j].mean())
        per_row, want = counted[..., j].mean(1), parts[b].double().mean((1, 2))
        if not torch.equal(per_row, want):
            r = int((per_row != want).nonzero()[0])
            raise RuntimeError(f"decode kernels counted {float(per_row[r])} {b} tokens in row {r} "
                               f"(length {int(L[r])}), indices give {float(want[r])}")
    return parts


def _row(job: Job, v: str, times: dict, parts: dict, peer: dict, L: torch.Tensor | None) -> dict:
    """Variant ``v``'s CSV row: its times, the keys/values its step reads (tokens per group, beside the
    paper's formula; bytes over batch and groups), their rate against the profile's peak HBM bandwidth, its
    HBM floor and its speedup over dense."""
    c, S, B, branch = job.nsa, job.seq, job.cfg.decode.batch, job.branch
    bw, elem = float(job.profile.peak_hbm_gbps), job.dtype.itemsize
    use_decoder = uses_decoder(job)

    def per_seq(f):
        """A count at context length n: at seq, or its mean over the rows' own lengths (ragged)."""
        return f(S) if L is None else sum(f(n) for n in L.tolist()) / B

    if v == "dense":
        tok = torch.full((B, 1, c.n_kv_heads), S) if L is None else L[:, None, None].expand(B, 1, c.n_kv_heads)
        formula = per_seq(lambda n: n)
    elif v in peer:  # it pools the whole cache every step, then reads its compressed and selected keys
        tok = S + sum(parts[b] for b in peer[v].branches).cpu()
        formula = formula_tokens("sel" if "win" not in peer[v].branches else "none", c, S)
    else:
        what = branch if v in ("layer", "nsa") else v
        tok = variant_tokens(what, parts).cpu()
        formula = per_seq(lambda n, what=what: formula_tokens(what, c, n))
        if use_decoder and v == "sel":
            # The decoder's sel kernel alone reuses the step's top-n: it reads the selected tokens only.
            tok, formula = parts["sel"].cpu(), per_seq(lambda n: min(c.n_sel * c.l_sel, n))
    kv_bytes = int(tok.sum()) * (c.d_k + c.d_v) * elem
    q = times[v]
    gbps = kv_bytes / (q["p50_ms"] * 1e-3) / 1e9
    return {
        "seq_tokens": S, "batch_seqs": B,
        **({} if L is None else {"ragged": True, "ragged_mean_tokens": float(L.double().mean())}),
        "variant": v, "branch_force": branch,
        "step_path": "graph_decoder" if use_decoder else "module",
        "backend_cmp": job.plan["cmp"], "backend_sel": job.plan["sel"], "backend_win": job.plan["win"],
        "dtype": str(job.dtype).replace("torch.", ""),
        **q,
        "kv_tokens_read_per_step_per_group": float(tok.double().mean()),
        "kv_tokens_formula_per_step_per_group": formula,
        "kv_bytes_read_per_step": kv_bytes,
        "kv_gb_per_s": gbps,
        "kv_bw_roofline_pct": 100.0 * gbps / bw,
        "hbm_floor_ms": kv_bytes / (bw * 1e9) * 1e3,
        **({} if v == "dense" else {"speedup_vs_dense_x": times["dense"]["p50_ms"] / q["p50_ms"]}),
    }


@hydra.main(config_path="../conf", config_name="decode", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_job(cfg, "decode", work, fits=check_fits, check=check_config)


if __name__ == "__main__":
    launch(main, "decode", check=check_config)
