"""Check ``prefill``: the attention forward and forward+backward of NSA against dense causal attention at
each length of ``validate.sizes.<size>.prefill``, timed by ``experiments.prefill`` itself (its ``work``):
dense as PyTorch picks it (``dense``: cuDNN attention on an H200 with torch 2.11) and, on CUDA, forced to
FlashAttention-2 (``dense_flash``). Timings are reported, not judged: the check passes when every row
was measured (finite, positive) and every baseline the size names ran.
"""
from __future__ import annotations

import math

from .. import prefill as prefill_entry
from . import report
from .core import Check, Context, fmt_ms, seq_label
from .report import Image, Table, Text

TIMINGS = ("fwd", "fwd_bwd")


def run(ctx: Context) -> Check:
    c, s = Check("prefill"), ctx.size.prefill
    per = []
    for S in s.seqs:
        job = ctx.entry_job("prefill", seq=S, check=prefill_entry.check_config,
                            **{"prefill.batch": s.batch, "prefill.warmup": s.warmup, "prefill.repeats": s.repeats,
                               "prefill.per_branch": False, "prefill.backward": True,
                               "prefill.dense_flash": "dense_flash" in s.dense})
        res = prefill_entry.work(job)
        c.rows += res.rows
        by = {r["variant"]: r for r in res.rows}
        per.append((S, by))
        for d in s.dense:
            c.require(d in by, f"S={S}: baseline {d} was not measured: {res.tags.get(d, 'not run')}")
        times = [r[f"{t}_p50_ms"] for r in res.rows for t in TIMINGS]
        c.require(all(math.isfinite(t) and t > 0 for t in times), f"S={S}: a time is not finite and positive: {times}")
    dense = [d for d in s.dense if all(d in by for _, by in per)]
    names = {"dense": "dense (PyTorch's default)", "dense_flash": "dense FA-2"}
    rows = []
    for S, by in per:
        n = by["nsa"]
        rows.append([seq_label(S), *(fmt_ms(n[f"{t}_p50_ms"]) for t in TIMINGS),
                     *(f"{fmt_ms(by[d][f'{t}_p50_ms'])} ({n[f'{t}_speedup_vs_{d}_x']:.2f}x)" for d in dense for t in TIMINGS),
                     f"{n['fwd_tflop_per_s']:.3g}"])
    c.blocks.append(Text(f"Median of {s.repeats} calls after {s.warmup} warm-up (experiments.prefill's work, batch {s.batch}): "
                         "NSA's attention (the three branches and the gated sum, backends "
                         + ", ".join(f"{b}={n}" for b, n in ctx.job.plan.items()) + ") against dense causal SDPA "
                         "over the same queries and keys; in brackets NSA's speedup over that baseline."))
    c.blocks.append(Table(["S", "NSA fwd", "NSA fwd+bwd", *(f"{names[d]} {t}" for d in dense for t in ("fwd", "fwd+bwd")),
                           "NSA fwd TFLOP/s"], rows))
    series = {f"nsa {t}": [(S, by["nsa"][f"{t}_p50_ms"]) for S, by in per] for t in TIMINGS}
    series |= {f"{d} {t}": [(S, by[d][f"{t}_p50_ms"]) for S, by in per] for d in dense for t in TIMINGS}
    img = report.lines(series, ctx.path("prefill_vs_seq.png"), "prefill: attention time vs sequence length",
                       "sequence length (tokens)", "ms (median)")
    c.blocks.append(Image(img, "prefill: NSA and dense attention, forward and forward+backward, vs sequence length"))
    c.files.append(img)
    if per:
        S, by = per[-1]
        n = by["nsa"]
        c.figures = (f"S={seq_label(S)}: NSA fwd {fmt_ms(n['fwd_p50_ms'])}, fwd+bwd {fmt_ms(n['fwd_bwd_p50_ms'])}; "
                     + "; ".join(f"{d} {fmt_ms(by[d]['fwd_p50_ms'])} / {fmt_ms(by[d]['fwd_bwd_p50_ms'])} "
                                 f"({by['nsa'][f'fwd_speedup_vs_{d}_x']:.2f}x / {by['nsa'][f'fwd_bwd_speedup_vs_{d}_x']:.2f}x)"
                                 for d in dense))
        c.metrics = {f"S{S}_{v}_{t}_ms": by[v][f"{t}_p50_ms"] for S, by in per for v in ("nsa", *dense) for t in TIMINGS}
    return c
