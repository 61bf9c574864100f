"""One GPU visit: GraphDecoder's whole layer step (projections .. o_proj) with each prologue, checked and timed.

    python scripts/decode_step.py [--models tiny,bench4090,h200bench] [--seqs 512,4096] [--compile tiny,h200bench]
                                  [--batch 1] [--out DIR]

For each model (conf/model/<name>.yaml) and context S: a bf16 layer, a cache of S-1 random tokens and one
step at position S-1 (``advance=False``: a block completes there when S is a multiple of d, as in
``experiments.decode``) and at S-2 (no block completes). Variants: ``tuning.decode.prologue`` torch (the
reference path: torch ops) and triton (nsa/backends/triton/decode_prologue.py), and with ``--compile`` the torch
prologue under ``torch.compile`` (inductor). Each variant's output, gates and compressed caches are checked
against the torch prologue's (rel-L2); then timed as CUDA graphs of ``--reps`` steps (median of
``--repeats`` replays, divided by reps), beside the attention kernels alone, the two GEMMs alone (the
input projections and o_proj: the layer's weights read once) and dense SDPA over S keys. ``--profile``
lists each variant's kernels (eager step, torch.profiler). Prints a table, writes ``decode_step.json``.
"""
from __future__ import annotations

import argparse
import json
import pathlib

import torch

from decode_variants import kernel_times, model

from experiments.measure.dense import dense_attention
from experiments.measure.timing import graph_ms, graph_step
from nsa import NSAAttention
from nsa.backends.triton import tuning
from nsa.decode import GraphDecoder
from nsa.numerics import rel_l2

CACHES = ("k_cmp_raw", "v_cmp_raw", "k_sel", "v_sel", "k_win", "v_win")


def graph_us(capture, fn, dev, reps, repeats) -> float:
    return graph_ms(capture, fn, dev, 5, repeats, reps)["p50_ms"] * 1e3


def variant(layer, c, B, S, x, v, a, dev, dt):
    """One prologue variant on a fresh random cache at S-1 tokens: its outputs, and its timings."""
    cache = layer.new_cache(B, S, dev, dt)
    g2 = torch.Generator(dev).manual_seed(2)
    for name in CACHES + ("k_cmp", "v_cmp"):
        getattr(cache, name).normal_(generator=g2)
    cache.length = S - 1
    with tuning.overrides({"decode": {"prologue": "triton" if v == "triton" else "torch"}}):
        dec = GraphDecoder(layer, cache)
    if v == "compile":
        dec._project = torch.compile(dec._project, dynamic=False)
    with torch.no_grad():
        y = dec._body(x, advance=False).clone()
    i = c.n_cmp(S) - 1  # the compressed row written at S-1 (when a block completes there)
    got = dict(y=y, gates=dec.last["gates"].clone(), q=dec.last["q"].clone(), k_cmp=dec._k_cmp_ext[:, i].clone(),
               v_cmp=dec._v_cmp_ext[:, i].clone(), k_win=cache.k_win[:, S - 1].clone())
    at = {}
    for label, pos in (("emit", S - 1), ("plain", S - 2)):
        dec._pos.fill_(pos)
        at[label] = graph_us(lambda f: dec.graph(f).replay, dec.step_fn(x, advance=False), dev, a.reps, a.repeats)
    dec._pos.fill_(S - 1)
    q, g = dec.last["q"].clone(), dec.last["gates"].clone()
    att = graph_us(lambda f: dec.graph(f).replay, lambda: dec.attend(q, g), dev, a.reps, a.repeats)
    prof = kernel_times(lambda: dec._body(x, advance=False), dev) if a.profile else {}
    if prof:
        print(f"   {c.dim}d S={S} {v}: {len(prof)} kernels, busy {sum(prof.values()):.1f} us: "
              + ", ".join(f"{k} {t:.2f}" for k, t in list(prof.items())[:12]), flush=True)
    return got, dict(us=at, attend_us=att, kernels=len(prof), busy_us=sum(prof.values()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,bench4090,h200bench")
    ap.add_argument("--seqs", default="512,4096")
    ap.add_argument("--compile", default="", help="models whose torch prologue is also timed under torch.compile "
                                                  "(at the last of --seqs)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}", flush=True)
    rows = []
    seqs = [int(s) for s in a.seqs.split(",")]
    for mname in a.models.split(","):
        c = model(mname)
        B = a.batch
        torch.manual_seed(0)
        layer = NSAAttention(c, backend="triton").to(dev, dt).eval()
        weights = sum(p.numel() * p.element_size() for p in layer.parameters())
        for S in seqs:
            variants = ["torch", "triton"] + (["compile"] if mname in a.compile.split(",") and S == seqs[-1] else [])
            gen = torch.Generator(dev).manual_seed(1)
            x = torch.randn(B, 1, c.dim, device=dev, dtype=dt, generator=gen)
            res, ref = {}, None
            for v in variants:
                try:
                    got, res[v] = variant(layer, c, B, S, x, v, a, dev, dt)
                    ref = got if ref is None else ref
                    res[v]["err"] = {k: rel_l2(got[k], ref[k]) for k in got}
                except Exception as e:  # noqa: BLE001 -- a variant that fails is reported, the others still run
                    res[v] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
                    print(f"   {mname} S={S} {v}: FAILED {res[v]['error']}", flush=True)
            # the two GEMMs alone: every weight of the layer but phi's and the gate's second layer, read once
            wq = torch.cat([layer.q_proj.weight] + [layer.kv_proj[n].weight for n in
                           ("k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win")], 0)
            x2, o = x.reshape(B, c.dim), torch.randn(B, c.n_heads * c.d_v, device=dev, dtype=dt)
            gemms = lambda x2=x2, wq=wq, o=o, m=layer: (x2 @ wq.t(), m.o_proj(o))  # noqa: E731
            gemm = graph_us(lambda f: graph_step(f, dev), gemms, dev, a.reps, a.repeats)
            kd = torch.randn(B, S, c.n_kv_heads, c.d_k, device=dev, dtype=dt)
            qd = torch.randn(B, 1, c.n_heads, c.d_k, device=dev, dtype=dt)
            sdpa = lambda qd=qd, kd=kd: dense_attention(qd, kd, kd, causal=False)  # noqa: E731
            dense = graph_us(lambda f: graph_step(f, dev), sdpa, dev, a.reps, a.repeats)
            ok = {v: r for v, r in res.items() if "us" in r}
            line = "  ".join(f"{v} {r['us']['emit']:7.2f}/{r['us']['plain']:7.2f}" for v, r in ok.items())
            att = ok.get("triton", ok.get("torch", {})).get("attend_us", float("nan"))
            print(f"{mname:9s} S={S:6d} B={B}: step (block completes / not) {line} us | attention {att:.2f} | "
                  f"GEMMs {gemm:.2f} | dense {dense:.2f} | weights {weights / 1e6:.1f} MB", flush=True)
            for v, r in ok.items():
                worst = max(r["err"].values())
                if worst > 2e-2:
                    print(f"   CHECK FAILED: {mname} S={S} {v} vs torch: {r['err']}", flush=True)
            rows.append(dict(model=mname, S=S, B=B, variants=res, gemm_us=gemm, dense_us=dense, weights_bytes=weights))
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_step.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
