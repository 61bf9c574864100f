"""Check ``thresholds``: the window branch on each window backend of ``validate.sizes.<size>.thresholds``
over its lengths (the run's model shape and dtype, one sequence), forward and forward+backward; where the
fastest backend changes (the crossovers), and the policy that follows, written as a hardware profile.

The policy (``validate.thresholds``): at each measured length the fastest backend for the criterion
(``fwd_bwd`` or ``fwd``), except that the profile's preferred window backend stays unless another is at
least ``margin`` faster (a difference within noise does not flip it). A change at a measured length
starts there (between two measured lengths the shorter one's choice holds). Written as
``<run>/conf/hardware/<profile>_validated.yaml``: the profile with ``policy.by_seq.win``, which the
framework applies to every job with ``backend=auto`` (``experiments/framework/config.py``,
``backend_by_seq``) and records on the run::

    python -m experiments.prefill -cd <run>/conf hardware=<profile>_validated backend=auto seq=65536

The check fails where a listed backend cannot run here, a time is not finite, or a backend's output at the
shortest length differs from the reference's by more than ``validate.tol`` allows.
"""
from __future__ import annotations

import math
import time

import torch
from omegaconf import OmegaConf

from nsa import dispatch, functional, reference
from nsa.numerics import rel_l2

from ..measure.timing import quantiles, time_ms
from ..framework import should_stop
from . import report
from .core import Check, Context, fmt_ms, seq_label
from .report import Code, Image, Table, Text

CRITERIA = ("fwd", "fwd_bwd")


def choose(times: dict[str, dict[int, float]], seqs: list[int], preferred: str, margin: float) -> dict[int, str]:
    """The backend per length: the fastest, unless the preferred one is within ``margin`` of it."""
    out = {}
    for S in seqs:
        best = min(times, key=lambda b: times[b][S])
        if preferred in times and best != preferred and times[best][S] > (1.0 - margin) * times[preferred][S]:
            best = preferred
        out[S] = best
    return out


def by_seq(choice: dict[int, str]) -> list[dict]:
    """``[{min_seq, backend}]`` from a choice per length: the first from 0, then one per change."""
    entries = []
    for S in sorted(choice):
        if not entries or entries[-1]["backend"] != choice[S]:
            entries.append({"min_seq": 0 if not entries else S, "backend": choice[S]})
    return entries


def _inputs(c, S, device, dtype, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    return [(torch.randn(1, S, h, d, generator=g, device=device) * std).to(dtype)
            for h, d, std in ((c.n_heads, c.d_k, 2.0), (c.n_kv_heads, c.d_k, 2.0), (c.n_kv_heads, c.d_v, 1.0))]


def measure_window(backend: str, c, S: int, device, dtype, warmup: int, repeats: int) -> dict[str, float]:
    """Median ms of the window on ``backend``: forward (no gradient) and forward+backward."""
    q, k, v = (t.requires_grad_() for t in _inputs(c, S, device, dtype, seed=S))
    dout = torch.randn(1, S, c.n_heads, c.d_v, device=device, dtype=dtype)

    def fwd():
        return functional.sliding_window_attention(q, k, v, c, backend=backend)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        fwd().backward(dout)

    with torch.no_grad():
        t_fwd = quantiles(time_ms(fwd, device, warmup, repeats, should_stop))["p50_ms"]
    t_bwd = quantiles(time_ms(fwd_bwd, device, warmup, repeats, should_stop))["p50_ms"]
    return {"fwd": t_fwd, "fwd_bwd": t_bwd}


def profile_file(ctx: Context, entries: list[dict], criterion: str, margin: float) -> tuple[str, "object"]:
    """The hardware profile with ``policy.by_seq.win``: (its name, its path)."""
    prof = OmegaConf.to_container(ctx.job.profile, resolve=True)
    base = str(prof["name"]).removesuffix("_validated")
    name = f"{base}_validated"
    prof["name"] = name
    prof.setdefault("policy", {})["by_seq"] = {"win": entries}
    path = ctx.path("conf") / "hardware" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    head = (f"# Written by python -m experiments.validate (check thresholds) on {ctx.job.dev.describe()}, "
            f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}: hardware={base} with the window backend by sequence length\n"
            f"# (policy.by_seq.win: criterion {criterion}, a backend replaces the preferred one where at least "
            f"{margin:.0%} faster).\n"
            f"# Use it: python -m experiments.prefill -cd {ctx.out / 'conf'} hardware={name} backend=auto seq=...\n"
            f"# or copy it to conf/hardware/ and pass hardware={name}.\n")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(head + OmegaConf.to_yaml(OmegaConf.create(prof)))
    tmp.replace(path)
    return name, path


def run(ctx: Context) -> Check:
    c, s, v = Check("thresholds"), ctx.size.thresholds, ctx.cfg.validate.thresholds
    job, dev, dt = ctx.job, ctx.device, ctx.job.dtype
    cfg = job.nsa
    if v.criterion not in CRITERIA:
        c.fail(f"validate.thresholds.criterion={v.criterion!r}: one of {', '.join(CRITERIA)}")
        return c
    backends = []
    for b in s.backends:
        reason = dispatch.get(b).unavailable("win", dev, dt)
        if c.require(reason is None, f"window backend {b} cannot run here: {reason}"):
            backends.append(b)
    if not backends:
        return c
    # The outputs agree with the reference at the shortest length (a backend that is wrong is not recommended).
    S0, tol = min(s.seqs), ctx.cfg.validate.tol[ctx.cfg.dtype]
    q, k, vv = _inputs(cfg, S0, dev, dt, seed=0)
    ref_dt = torch.float64 if dev.type == "cpu" else torch.float32
    with torch.no_grad():
        o_ref = reference.sliding_window_attention(q.to(ref_dt), k.to(ref_dt), vv.to(ref_dt), cfg)
        for b in backends:
            err = rel_l2(functional.sliding_window_attention(q, k, vv, cfg, backend=b), o_ref)
            c.require(err <= tol.out, f"{b}: window output at S={S0} vs the reference rel-L2 {err:.3g} > {tol.out:g}")
    times = {b: {} for b in backends}
    for S in s.seqs:
        for b in backends:
            t = measure_window(b, cfg, S, dev, dt, s.warmup, s.repeats)
            c.require(all(math.isfinite(x) and x > 0 for x in t.values()), f"{b} S={S}: times {t}")
            for crit in CRITERIA:
                times[b].setdefault(crit, {})[S] = t[crit]
            c.rows.append({"seq_tokens": S, "backend": b, **{f"{k}_p50_ms": x for k, x in t.items()}})
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    preferred = (job.profile.get("policy") or {}).get("preferred", {}).get("win", "reference")
    choices = {crit: choose({b: times[b][crit] for b in backends}, list(s.seqs), preferred, float(v.margin)) for crit in CRITERIA}
    entries = by_seq(choices[v.criterion])
    name, path = profile_file(ctx, entries, v.criterion, float(v.margin))
    c.files.append(path)
    cross = {crit: [(e["min_seq"], e["backend"]) for e in by_seq(choices[crit])[1:]] for crit in CRITERIA}
    c.metrics = {f"S{S}_{b}_{crit}_ms": times[b][crit][S] for b in backends for crit in CRITERIA for S in s.seqs}
    policy = ", ".join(f"from {seq_label(e['min_seq'])}: {e['backend']}" for e in entries)
    c.figures = (f"window backend by length ({v.criterion}, margin {float(v.margin):.0%}, preferred {preferred}): {policy}; "
                 f"crossovers fwd {_cross(cross['fwd'])}, fwd+bwd {_cross(cross['fwd_bwd'])}")
    c.blocks.append(Text(f"The window branch alone (HQ={cfg.n_heads}, H={cfg.n_kv_heads}, Dk={cfg.d_k}, Dv={cfg.d_v}, "
                         f"w={cfg.w}, {str(dt).replace('torch.', '')}, one sequence), median of {s.repeats} calls. "
                         f"The fastest per length ('best'); the policy keeps the profile's preferred backend ({preferred}) "
                         f"unless another is at least {float(v.margin):.0%} faster by {v.criterion}. Outputs agree with "
                         f"the reference at S={S0} within {tol.out:g}."))
    rows = []
    for S in s.seqs:
        rows.append([seq_label(S), *(f"{fmt_ms(times[b]['fwd'][S])} / {fmt_ms(times[b]['fwd_bwd'][S])}" for b in backends),
                     min(backends, key=lambda b: times[b]["fwd"][S]), min(backends, key=lambda b: times[b]["fwd_bwd"][S]),
                     choices[v.criterion][S]])
    c.blocks.append(Table(["S", *(f"{b} fwd / fwd+bwd" for b in backends), "best fwd", "best fwd+bwd", "policy"], rows))
    c.blocks.append(Text(f"Crossovers (the length from which another backend is chosen): forward {_cross(cross['fwd'])}; "
                         f"forward+backward {_cross(cross['fwd_bwd'])}. The recommended policy ({v.criterion}) as a "
                         f"hardware profile, {path.relative_to(ctx.out)}, applied to jobs with backend=auto and recorded "
                         f"on their runs (tag policy_overrides):"))
    yaml = "".join(f"      - {{min_seq: {e['min_seq']}, backend: {e['backend']}}}\n" for e in entries)
    c.blocks.append(Code(f"python -m experiments.prefill -cd {ctx.out / 'conf'} hardware={name} backend=auto "
                         f"seq={max(s.seqs)}\npolicy:\n  by_seq:\n    win:\n{yaml}"))
    series = {f"{b} {crit.replace('_', '+')}": sorted(times[b][crit].items()) for b in backends for crit in CRITERIA}
    img = report.lines(series, ctx.path("thresholds.png"), "window backends vs sequence length", "sequence length (tokens)",
                       "ms (median)")
    c.blocks.append(Image(img, "the window branch on each backend, forward and forward+backward, vs sequence length"))
    c.files.append(img)
    return c


def _cross(pairs) -> str:
    return ", ".join(f"{b} from {seq_label(S)}" for S, b in pairs) or "none"
