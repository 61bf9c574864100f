"""One GPU visit: the decode step's launch modes checked and timed side by side (B=1 by default).

    python scripts/decode_variants.py [--models tiny,bench4090,h200bench] [--seqs 512,4096,8192]
                                      [--variants "four:mode=four;three:mode=three"] [--batch 1] [--out DIR]

For each model (conf/model/<name>.yaml) and context S, random caches and one query at position S-1;
the attention step of ``nsa.backends.triton.decode_attention.DecodeKernels`` in each ``--variants`` entry
(``tuning.decode`` overrides, e.g. ``three:mode=three,nsc=4``), and dense SDPA over S keys
(``experiments.measure.dense.dense_attention``). Each variant is first checked against the first one's output
(rel-L2) and top-n; then timed as graphs of ``--reps`` steps (CUDA
events, median of ``--repeats`` replays, divided by reps), as ``experiments.decode`` times them.
Prints a table per model and writes ``decode_variants.json`` under ``--out``. Needs CUDA.
"""
from __future__ import annotations

import argparse
import json
import pathlib

import torch
import yaml

from experiments.measure.dense import dense_attention
from experiments.measure.timing import graph_step, quantiles, repeated, time_ms
from nsa import NSAConfig
from nsa.backends.triton import tuning
from nsa.backends.triton.decode_attention import DecodeKernels
from nsa.numerics import rel_l2

ROOT = pathlib.Path(__file__).resolve().parents[1]


def model(name: str) -> NSAConfig:
    nsa = yaml.safe_load((ROOT / "conf" / "model" / f"{name}.yaml").read_text())["nsa"]
    return NSAConfig(**nsa)


def kernel_times(fn, dev, n=20) -> dict[str, float]:
    """Mean GPU microseconds per call of each kernel ``fn`` launches (torch.profiler, eager calls)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            fn()
        torch.cuda.synchronize(dev)
    out = {}
    for e in p.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0 and e.count:
            out[e.key[:40]] = t / n
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,bench4090,h200bench")
    ap.add_argument("--seqs", default="512,1024,2048,4096,8192,16384,32768,65536")
    ap.add_argument("--variants", default="four:mode=four;three:mode=three;one-4:mode=one,splits=4",
                    help="name:key=value,...;... -- tuning.decode overrides per timed variant (the first is the "
                         "baseline the others are checked against)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default=".")
    ap.add_argument("--profile", action="store_true", help="also print each mode's kernels' GPU time (eager calls, "
                                                                "torch.profiler): busy time vs the graph step")
    a = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(dev).manual_seed(0)
    rows = []
    print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}", flush=True)
    for mname in a.models.split(","):
        c = model(mname)
        B, H = a.batch, c.n_kv_heads
        for S in map(int, a.seqs.split(",")):
            Tc = c.n_cmp(S)
            r = lambda *s: torch.randn(*s, device=dev, dtype=dt, generator=gen)
            q, g = r(B, c.n_heads, c.d_k), torch.rand(B, c.n_heads, 3, device=dev, generator=gen).to(dt)
            kc, vc = r(B, Tc + 1, H, c.d_k), r(B, Tc + 1, H, c.d_v)
            ks, vs, kw, vw = r(B, S, H, c.d_k), r(B, S, H, c.d_v), r(B, S, H, c.d_k), r(B, S, H, c.d_v)
            pos = torch.tensor([S - 1], device=dev)
            modes = {}
            for v in a.variants.split(";"):
                name, _, kv = v.partition(":")
                tune = {k: yaml.safe_load(x) for k, x in (e.split("=") for e in kv.split(",") if e)}
                modes[name] = tune
            ref_o = ref_i = None
            res = {}
            for name, tune in modes.items():
                with tuning.overrides({"decode": tune}):
                    k = DecodeKernels(c, B, S, dev, dtype=dt)
                fn = lambda k=k, args=(q, g, pos, kc, vc, ks, vs, kw, vw): k.attend(*args)
                o = fn().clone()
                if ref_o is None:
                    ref_o, ref_i = o, k.indices.clone()
                err = rel_l2(o, ref_o)
                mism = float((k.indices != ref_i).float().mean())
                ms = quantiles([t / a.reps for t in time_ms(
                    graph_step(repeated(fn, a.reps), dev), dev, 5, a.repeats)])["p50_ms"]
                res[name] = ms
                if a.profile:
                    prof = kernel_times(fn, dev)
                    busy = sum(prof.values())
                    print(f"   {mname} S={S} {name}: step {ms * 1e3:.2f} us, kernels busy {busy:.2f} us: "
                          + ", ".join(f"{k} {v:.2f}" for k, v in prof.items()), flush=True)
                rows.append(dict(model=mname, S=S, B=B, mode=name, us=ms * 1e3, rel_l2_vs_first=err,
                                 index_mismatch=mism))
            dense = lambda args=(q[:, None], ks, vs): dense_attention(*args, causal=False)
            ms = quantiles([t / a.reps for t in time_ms(
                graph_step(repeated(dense, a.reps), dev), dev, 5, a.repeats)])["p50_ms"]
            rows.append(dict(model=mname, S=S, B=B, mode="dense", us=ms * 1e3))
            first = next(iter(res))
            best = min((v, n) for n, v in res.items())
            line = "  ".join(f"{n} {v * 1e3:6.2f}" for n, v in res.items())
            print(f"{mname:9s} S={S:6d} B={B}: {line}  dense {ms * 1e3:6.2f} us | best {best[1]} "
                  f"{best[0] / ms:.2f}x dense ({first} {res[first] / ms:.2f}x)", flush=True)
            bad = [x for x in rows[-len(modes) - 1:] if x.get("rel_l2_vs_first", 0) > 1e-2
                   or x.get("index_mismatch", 0) > 0.02]
            for x in bad:
                print(f"   CHECK FAILED: {x}", flush=True)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_variants.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
