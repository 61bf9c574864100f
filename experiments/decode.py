"""Decode benchmark: one step at context length seq, per branch, vs dense SDPA decode.

    python -m experiments.decode hardware=cpu -m seq=256,512                 # a CPU sweep
    python -m experiments.decode hardware=rtx4090 -m seq=512,1024,2048,4096  # on an RTX 4090
    python -m experiments.decode -m seq=256,512 --cfg job                    # each job's config, no run

The cache is filled with seq-1 tokens (the layer's projected and compressed keys/values, written
chunk by chunk, exactly what a prefill leaves there); the timed step is the query at position
t = seq-1, which attends to seq keys (so the paper's count at S = seq applies). Rows (column ``variant``):

* ``layer``: the whole NSAAttention step (projections, cache write, compression, attention, output),
  with branch_force applied through ``measure.ForcedBranch``;
* ``nsa``: the attention core, all three branches gated (branch_force=none), or the forced branch;
* ``cmp``/``sel``/``win``: each branch alone (with branch_force=none and decode.per_branch);
* ``dense``: torch SDPA decode over seq keys with the same heads and dims;
* the public NSA kernels of ``decode.peers`` (``experiments.peers``: ``fla``, on the same query, gates and
  cache, where it can run the shape; else a tag ``peer_fla`` says why).

Key/value tokens read are counted from the indices and ranges the step used (per group, mean over
batch and groups), beside the paper's formula; bytes are summed over batch and groups.

Timing on a GPU (``decode.cuda_graph``): each row is captured ``decode.graph_reps`` times in a row in
ONE CUDA graph, and the time of a replay divided by that number is the step's time (p20/p50/p80_ms).
One replay costs the host a fixed launch: at B=1 on an H200 a graph holding one decode kernel replayed
in 9.3 or 14.5 us at random, so one step per graph measured the launch, not the GPU's work.
``single_replay_p50_ms`` keeps that figure (one step per graph, one replay). Column ``step_path``:
``graph_decoder`` (nsa.decode.GraphDecoder) or ``module`` (the module's forward, and measure.core per
branch, where the ``sel`` row also runs the compressed scoring that picks its blocks).
"""
from __future__ import annotations

import logging

import hydra
import torch
from omegaconf import DictConfig

from nsa import NSAAttention
from nsa.decode import GraphDecoder

from . import measure, peers
from .framework import Charts, Job, Result, check_memory, launch, run_job

BRANCHES = ("cmp", "sel", "win")
log = logging.getLogger("experiments.decode")


def estimate_bytes(job: Job) -> float:
    """Rough tensor memory: the cache (three branches' raw keys/values, +10 % compressed) and one
    fill chunk's activations (input, queries, six key/value projections, about twice over)."""
    c, d, S, e = job.nsa, job.cfg.decode, job.seq, job.dtype.itemsize
    cache = d.batch * S * c.n_kv_heads * (c.d_k + c.d_v) * 3 * e * 1.1
    C = min(d.prefill_chunk, S)
    chunk = d.batch * C * (2 * c.dim + c.n_heads * (c.d_k + c.d_v) + 6 * c.n_kv_heads * (c.d_k + c.d_v)) * e * 2
    return float(cache + chunk)


def work(job: Job) -> Result:
    d, c, S = job.cfg.decode, job.nsa, job.seq
    check_memory(job, estimate_bytes(job))
    B, dev, dt = d.batch, job.device, job.dtype
    bw, branch = float(job.profile.peak_hbm_gbps), job.branch
    elem = torch.empty((), dtype=dt).element_size()
    layer = NSAAttention(c, backend=job.plan, fallback=job.fallback).to(dev, dt).eval()
    step_layer = layer if branch == "none" else measure.ForcedBranch(layer, branch)
    rows, metrics, tags = [], {}, {}
    # On CUDA with the triton backend for every branch, the step runs through nsa.decode.GraphDecoder
    # (fused decode kernels, device-side position, CUDA graphs); elsewhere through the module's forward.
    graphs = bool(d.cuda_graph) and dev.type == "cuda"
    use_decoder = graphs and all(job.plan[b] == "triton" for b in BRANCHES)
    timed = ["layer", "nsa"] + (["cmp", "sel", "win"] if branch == "none" and d.per_branch else []) + ["dense"]

    def progress(i, name, q):
        log.info(f"[decode] seq={S} [{i}/{len(timed)}] {name}: p50 {q['p50_ms']:.4f} ms")

    def graph_capture(fn):
        return measure.graph_step(fn, dev)

    def time_step(capture, fn):
        """Quantiles of one call of fn: from graphs of decode.graph_reps calls on CUDA, eager on CPU."""
        if not graphs:
            return measure.quantiles(measure.time_ms(fn, dev, d.warmup, d.repeats))
        return measure.graph_ms(capture, fn, dev, d.warmup, d.repeats, d.graph_reps)

    with torch.no_grad():
        cache = layer.new_cache(B, S, dev, dt)
        measure.fill_cache(layer, cache, S - 1, d.prefill_chunk)  # positions 0 .. S-2
        xs = torch.randn(B, 1, c.dim, device=dev, dtype=dt)

        def layer_step():
            cache.length = S - 1
            step_layer(xs, cache)

        if use_decoder:
            # nsa.decode.GraphDecoder: device-side position, one CUDA graph per variant (the GPU path).
            dec = GraphDecoder(layer, cache)
            tags.update(measure.decode_launch_tags(dec))
            forced = BRANCHES if branch == "none" else (branch,)
            times = {"layer": time_step(lambda f: dec.graph(f).replay, dec.step_fn(xs, branches=forced, advance=False))}
        else:
            times = {"layer": time_step(graph_capture, layer_step)}
        progress(1, "layer", times["layer"])
        cache.length = S
        inp = measure.cache_inputs(layer, cache, xs)
        # What the step reads: selected blocks from the configured cmp backend, ranges from the spec.
        t = torch.tensor(S - 1, device=dev)
        idx = measure.selection_indices(inp, c, job.plan, job.fallback)
        parts = measure.branch_tokens(c, t, measure.selected_tokens(idx, c, S - 1))
        if use_decoder:
            # The decode kernels' own counters must agree with the count from the indices.
            q_d, g_d = inp.q[:, 0], inp.gates[:, 0]
            dec.attend(q_d, g_d, position=S - 1, count=True)
            counted = dec.token_counts().double().mean((0, 1)).tolist()
            for b, n in zip(BRANCHES, counted):
                metrics[f"kernel_counted_{b}_tokens_per_step_per_group"] = n
                if abs(n - float(parts[b].double().mean())) > 0:
                    raise RuntimeError(f"decode kernels counted {n} {b} tokens, indices give "
                                       f"{float(parts[b].double().mean())}")
        for i, v in enumerate(timed[1:-1], 2):
            if use_decoder:
                brs = (BRANCHES if branch == "none" else (branch,)) if v == "nsa" else (v,)
                times[v] = time_step(lambda f: dec.graph(f).replay,
                                     lambda brs=brs, v=v: dec.attend(q_d, g_d, branches=brs, combine=(v == "nsa")))
                progress(i, v, times[v])
                continue
            forced = branch if v == "nsa" else v

            def step(forced=forced):
                measure.core(forced, inp, c, job.plan, job.fallback, job.cfg.streams)

            times[v] = time_step(graph_capture, step)
            progress(i, v, times[v])
        qd, kd, vd = inp.q, inp.k_win, inp.v_win
        times["dense"] = time_step(graph_capture, lambda: measure.dense_attention(qd, kd, vd, causal=False))
        progress(len(timed), "dense", times["dense"])
        peer = peers.rows(d.peers, inp, c, dev, tags)
        for v, p in peer.items():
            timed.append(v)
            times[v] = measure.quantiles(measure.time_ms(measure.graph_step(p.fn, dev) if graphs else p.fn, dev,
                                                         d.warmup, d.repeats))
            progress(len(timed), v, times[v])

    for v in timed:
        if v == "dense":
            tok = torch.full((B, 1, c.n_kv_heads), S)
            formula = S
        elif v in peer:  # it pools the whole cache every step, then reads its compressed and selected keys
            tok = S + sum(parts[b] for b in peer[v].branches).cpu()
            formula = measure.formula_tokens("sel" if "win" not in peer[v].branches else "none", c, S)
        else:
            what = branch if v in ("layer", "nsa") else v
            tok = measure.variant_tokens(what, parts).cpu()
            formula = measure.formula_tokens(what, c, S)
            if use_decoder and v == "sel":
                # The decoder's sel kernel alone reuses the step's top-n: it reads the selected tokens only.
                tok, formula = parts["sel"].cpu(), min(c.n_sel * c.l_sel, S)
        kv_bytes = int(tok.sum()) * (c.d_k + c.d_v) * elem
        q = times[v]
        gbps = kv_bytes / (q["p50_ms"] * 1e-3) / 1e9
        row = {
            "seq_tokens": S, "batch_seqs": B, "variant": v, "branch_force": branch,
            "step_path": "graph_decoder" if use_decoder else "module",
            "backend_cmp": job.plan["cmp"], "backend_sel": job.plan["sel"], "backend_win": job.plan["win"],
            "dtype": str(dt).replace("torch.", ""),
            **q,
            "kv_tokens_read_per_step_per_group": float(tok.double().mean()),
            "kv_tokens_formula_per_step_per_group": formula,
            "kv_bytes_read_per_step": kv_bytes,
            "kv_gb_per_s": gbps,
            "kv_bw_roofline_pct": 100.0 * gbps / bw,
            "hbm_floor_ms": kv_bytes / (bw * 1e9) * 1e3,
            **({} if v == "dense" else {"speedup_vs_dense_x": times["dense"]["p50_ms"] / q["p50_ms"]}),
        }
        rows.append(row)
    by = {r["variant"]: r for r in rows}
    headline = {"nsa_p50_ms": by["nsa"]["p50_ms"], "dense_p50_ms": by["dense"]["p50_ms"],
                "nsa_speedup_vs_dense_x": by["nsa"]["speedup_vs_dense_x"], "layer_p50_ms": by["layer"]["p50_ms"],
                "nsa_kv_gb_per_s": by["nsa"]["kv_gb_per_s"]}
    return Result(rows, metrics, headline=headline, charts=Charts("seq_tokens", "variant", ("p50_ms", "speedup_vs_dense_x")),
                  tags=tags)


@hydra.main(config_path="../conf", config_name="decode", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_job(cfg, "decode", work)


if __name__ == "__main__":
    launch(main, "decode")
