"""Check ``decode``: one decode step per (batch, context) of ``validate.sizes.<size>.decode``, timed by
``experiments.decode`` itself (its ``work``: the same rows, the same timing method), and:

* each branch's measured time and its share of the measured attention step: cmp (compressed attention
  and the top-n), sel, win, and the remainder (the step minus the three: the gated sum, gaps between
  kernels; negative where the fused step is faster than its parts run alone), summing to 100 %;
* key/value tokens read per step and group: counted by the decode kernels themselves (GraphDecoder's
  counters; ``experiments.decode`` fails the step where they differ from the count from the indices),
  from the indices, and the paper's formula; bytes read per step;
* the step's attention output and top-n against the reference's on the same cache (the float32
  reference on a GPU, float64 on the CPU): rel-L2 and mismatching top-n slots within ``validate.tol``
  for the dtype.

Timing on a GPU: the step (or branch) is captured ``graph_reps`` times in one CUDA graph and a replay's
time divided by that (``experiments.measure.timing.graph_ms``); one step per graph measures the host's launch
at B=1 (9.3 or 14.5 us at random on an H200, whatever the kernel) and is kept as its own column.
"""
from __future__ import annotations

import math

import torch

from nsa import NSAAttention, functional
from nsa.decode import GraphDecoder
from nsa.numerics import rel_l2

from .. import decode as decode_entry
from ..measure.inputs import cache_inputs, fill_cache
from . import report
from .core import Check, Context, fmt_ms, fmt_tokens, seq_label
from .report import Image, Table, Text

PARTS = ("cmp", "sel", "win")


def uses_decoder(job) -> bool:
    """As experiments.decode: GraphDecoder on CUDA with CUDA graphs and triton for every branch."""
    return decode_entry.uses_decoder(job)


def shares(rows: list[dict]) -> dict:
    """Branch times (ms) and their shares (%) of the attention step (the ``nsa`` row), from one
    experiments.decode job's rows. On the module path the ``sel`` row also times the scoring that picks
    its blocks: sel alone is then that row minus the ``cmp`` row (``sel_derived``)."""
    by = {r["variant"]: r for r in rows}
    step = by["nsa"]["p50_ms"]
    derived = by["nsa"]["step_path"] == "module"
    t = {"cmp": by["cmp"]["p50_ms"], "sel": by["sel"]["p50_ms"] - (by["cmp"]["p50_ms"] if derived else 0.0),
         "win": by["win"]["p50_ms"]}
    t["remainder"] = step - sum(t.values())
    return {"step_ms": step, "ms": t, "pct": {k: 100.0 * v / step for k, v in t.items()}, "sel_derived": derived}


def tokens(rows: list[dict], metrics: dict) -> dict:
    """Tokens per step and group, by branch: from the kernels' counters (None off the GraphDecoder path)
    and from the indices; the whole step's read and the paper's formula."""
    by = {r["variant"]: r for r in rows}
    key = "kv_tokens_read_per_step_per_group"
    idx = {b: by[b][key] for b in PARTS}
    if by["nsa"]["step_path"] == "module":
        idx["sel"] -= by["cmp"][key]  # the module path's sel row counts the compressed tokens it scores with
    kern = {b: metrics.get(f"kernel_counted_{b}_tokens_per_step_per_group") for b in PARTS}
    return {"kernel": kern, "indices": idx, "read": by["nsa"][key], "formula": by["nsa"]["kv_tokens_formula_per_step_per_group"],
            "bytes": by["nsa"]["kv_bytes_read_per_step"], "floor_ms": by["nsa"]["hbm_floor_ms"]}


@torch.no_grad()
def step_vs_reference(ctx: Context, S: int, B: int) -> dict:
    """The attention output and top-n of the step at t = S-1 (the path experiments.decode times) against
    the reference on the same cache, queries and gates."""
    job = ctx.entry_job("decode", seq=S, check=decode_entry.check_config, **{"decode.batch": B})
    c, dev, dt = job.nsa, job.device, job.dtype
    torch.manual_seed(int(job.cfg.seed))
    layer = NSAAttention(c, backend=job.plan, fallback=job.fallback).to(dev, dt).eval()
    cache = layer.new_cache(B, S, dev, dt)
    fill_cache(layer, cache, S, int(job.cfg.decode.fill_tokens))
    inp = cache_inputs(layer, cache, torch.randn(B, 1, c.dim, device=dev, dtype=dt))
    ref_dt = torch.float64 if dev.type == "cpu" else torch.float32
    o_ref, idx_ref = functional.nsa_attention(*(t.to(ref_dt) for t in inp.tensors().values()), c, backend="reference",
                                              q_start=S - 1, return_indices=True)
    if uses_decoder(job):
        dec = GraphDecoder(layer, cache)
        o = dec.attend(inp.q[:, 0], inp.gates[:, 0], position=S - 1).clone()[:, None]
        idx, path = dec.indices(), "GraphDecoder (triton decode kernels)"
    else:
        o, idx = functional.nsa_attention(*inp.tensors().values(), c, backend=job.plan, fallback=job.fallback,
                                          q_start=S - 1, return_indices=True, streams=bool(job.cfg.streams))
        path = "nsa_attention (" + ", ".join(f"{b}={n}" for b, n in job.plan.items()) + ")"
    return {"rel_l2": rel_l2(o, o_ref), "index_mismatch": float((idx.cpu() != idx_ref.cpu()).double().mean()),
            "path": path, "ref_dtype": str(ref_dt).replace("torch.", "")}


def run(ctx: Context) -> Check:
    c, s = Check("decode"), ctx.size.decode
    tol = ctx.cfg.validate.tol[ctx.cfg.dtype]
    per = []
    for B in s.batches:
        for S in s.seqs:
            job = ctx.entry_job("decode", seq=S, check=decode_entry.check_config, **{
                "decode.batch": B, "decode.warmup": s.warmup, "decode.repeats": s.repeats,
                "decode.graph_reps": s.graph_reps, "decode.per_branch": True})
            res = decode_entry.work(job)  # raises where the kernels' token counters differ from the indices
            c.rows += res.rows
            per.append({"B": B, "S": S, "rows": res.rows, "sh": shares(res.rows), "tok": tokens(res.rows, res.metrics),
                        "by": {r["variant"]: r for r in res.rows}, "decoder": uses_decoder(job)})
    for p in per:
        where = f"B={p['B']} S={p['S']}"
        times = [r["p50_ms"] for r in p["rows"]]
        c.require(all(math.isfinite(t) and t > 0 for t in times), f"{where}: a time is not finite and positive: {times}")
        tk = p["tok"]
        c.require(tk["read"] <= tk["formula"], f"{where}: {tk['read']} tokens read per group > the formula's {tk['formula']}")
        for b in PARTS:
            k = tk["kernel"][b]
            if k is not None:
                c.require(k == tk["indices"][b],
                          f"{where}: the kernels counted {k} {b} tokens, the indices give {tk['indices'][b]}")
    S0, B0 = min(s.seqs), max(s.batches)
    chk = step_vs_reference(ctx, S0, B0)
    c.require(chk["rel_l2"] <= tol.out,
              f"B={B0} S={S0}: attention output vs the reference rel-L2 {chk['rel_l2']:.3g} > {tol.out:g}")
    c.require(chk["index_mismatch"] <= tol.index,
              f"B={B0} S={S0}: {chk['index_mismatch']:.3%} of the top-n slots differ from the reference's (tol {tol.index:g})")
    c.metrics = {"output_rel_l2": chk["rel_l2"], "index_mismatch_frac": chk["index_mismatch"]}
    for p in per:
        tag = f"B{p['B']}_S{p['S']}"
        c.metrics |= {f"{tag}_step_ms": p["sh"]["step_ms"], **{f"{tag}_{k}_pct": v for k, v in p["sh"]["pct"].items()}}
    path = "GraphDecoder, CUDA graphs" if per and per[0]["decoder"] else "the module's forward and measure.branches.core, eager"
    big = max(per, key=lambda p: (p["B"], p["S"]))
    pc = big["sh"]["pct"]
    c.figures = (f"B={big['B']} S={seq_label(big['S'])}: attention step {fmt_ms(big['sh']['step_ms'])} = cmp {pc['cmp']:.0f} % + "
                 f"sel {pc['sel']:.0f} % + win {pc['win']:.0f} % + remainder {pc['remainder']:.0f} %; "
                 f"{fmt_tokens(big['tok']['read'])} tokens read per group (formula {big['tok']['formula']}); "
                 f"output vs reference rel-L2 {chk['rel_l2']:.2g}")
    _blocks(c, ctx, per, chk, tol, path)
    return c


def _blocks(c: Check, ctx: Context, per: list, chk: dict, tol, path: str) -> None:
    s = ctx.size.decode
    method = (f"Timed by experiments.decode's work ({path}): median of {s.repeats} samples. Each step or branch is "
              f"captured {s.graph_reps} times in ONE CUDA graph and a replay's time divided by {s.graph_reps}: one step "
              "per graph measures the host's launch at B=1 (on an H200 a graph of one decode kernel replays in 9.3 or "
              "14.5 us at random), kept as the column 'attention, 1 step per graph'." if ctx.device.type == "cuda" else
              f"Timed by experiments.decode's work ({path}): median of {s.repeats} calls, eager (no CUDA graphs on a CPU).")
    c.blocks.append(Text(method + " Shares are of the attention step (the 'nsa' row: the three branches and the gated "
                         "sum); the remainder is the step minus the branches run alone. The layer step adds the "
                         "projections, RoPE, the cache write, phi and the output projection."))
    if per and per[0]["sh"]["sel_derived"]:
        c.notes.append("sel alone = the sel row minus the cmp row: on the module path the sel row also runs the "
                       "compressed scoring that picks its blocks")
    rows = []
    for p in per:
        ms, pc, by = p["sh"]["ms"], p["sh"]["pct"], p["by"]
        single = by["nsa"].get("single_replay_p50_ms")
        rows.append([str(p["B"]), seq_label(p["S"]), fmt_ms(by["layer"]["p50_ms"]), fmt_ms(p["sh"]["step_ms"]),
                     *(f"{fmt_ms(ms[k])} ({pc[k]:.1f} %)" for k in (*PARTS, "remainder")), f"{sum(pc.values()):.1f} %",
                     fmt_ms(single) if single is not None else "n/a (no graphs)", fmt_ms(by["dense"]["p50_ms"])])
    c.blocks.append(Table(["B", "S", "layer step", "attention step", "cmp", "sel", "win", "remainder", "sum",
                           "attention, 1 step per graph", "dense SDPA"], rows))
    rows = []
    for p in per:
        tk = p["tok"]
        rows.append([str(p["B"]), seq_label(p["S"]), *(_counts(tk, b) for b in PARTS), fmt_tokens(tk["read"]), str(tk["formula"]),
                     f"{tk['bytes'] / 2**20:.2f} MiB", fmt_ms(tk["floor_ms"])])
    c.blocks.append(Table(["B", "S", "cmp tokens (kernels / indices)", "sel", "win", "read per group", "paper formula",
                           "K/V bytes per step", "HBM floor"], rows))
    c.blocks.append(Text("Tokens per step and group, mean over sequences and groups: counted by the decode kernels "
                         "(n/a off the GraphDecoder path) and from the indices the step used; the formula is the "
                         "paper's (Table 4) ((S-l)//d+1) + n_sel*l_sel + w. The selection and window read their own "
                         "key/value projections, so 'read' adds both."))
    c.blocks.append(Text(f"Correctness: {chk['path']} at the smallest context against the {chk['ref_dtype']} reference on the "
                         f"same cache: output rel-L2 {chk['rel_l2']:.3g} (tolerance {tol.out:g}), top-n slots differing "
                         f"{chk['index_mismatch']:.3%} (tolerance {tol.index:g})."))
    labels = [f"B={p['B']} S={seq_label(p['S'])}" for p in per]
    img = report.stacked_shares(labels, {k: [p["sh"]["pct"][k] for p in per] for k in (*PARTS, "remainder")},
                                ctx.path("decode_shares.png"), "decode: shares of the attention step")
    c.blocks.append(Image(img, "decode: each branch's share of the measured attention step"))
    c.files.append(img)


def _counts(tk: dict, b: str) -> str:
    kernel = "n/a" if tk["kernel"][b] is None else fmt_tokens(tk["kernel"][b])
    return f"{kernel} / {fmt_tokens(tk['indices'][b])}"
