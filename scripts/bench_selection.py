"""Check and time the Triton selected-attention kernels on one GPU (bf16).

1. Correctness: bf16 kernels vs ``nsa.reference.selected_attention`` on fp32-upcast inputs
   (rel. L2 error of o, dq, dk, dv) at modest T, for both kernel families and several shapes
   (G = 16/4/1, Dk != Dv, head dim 256).
2. Timing: forward and forward+backward, median of ``triton.testing.do_bench``, at
   T = 8k..64k, B=1, H=4 key/value heads, G = 16/4/1 (HQ = 64/16/4), D = 128, l_sel=64, n_sel=16,
   random valid selections (1 initial + 2 local blocks forced, the rest random).

Writes $OUT/selection.json (or ./selection.json) and prints a table last. Imports only torch,
triton and nsa. Usage: ``python scripts/bench_selection.py [--quick] [--T 8192,65536] [--plan 16:query,1:block]
[--variants "65536;16:query:{\"num_stages\": 3};16:query:{\"dk\": 192, \"dv\": 128}"]`` (opts go to the
kernels; "dk"/"dv" set the head dims, 128 otherwise).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch
import triton
import triton.testing

from nsa import NSAConfig, reference
from nsa.backends.triton import selection

H = 4


def config(HQ, Dk, Dv, l_sel=64, n_sel=16):
    return NSAConfig(dim=HQ * Dk, n_heads=HQ, n_kv_heads=H, d_k=Dk, d_v=Dv, l=32, d=16, l_sel=l_sel,
                     n_sel=n_sel, n_init=1, n_local=2)


def random_indices(cfg, B, T, gen):
    """Random valid selections: forced blocks + random others (reference top-n on random scores)."""
    nb = cfg.n_blocks(T)
    out = []
    for c0 in range(0, T, 8192):  # bound the memory of the scores
        c1 = min(T, c0 + 8192)
        s = torch.rand(B, c1 - c0, H, nb, device="cuda", generator=gen)
        out.append(reference.select_blocks(s, cfg, q_start=c0).to(torch.int32))
    return torch.cat(out, 1)


def inputs(cfg, B, T, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, cfg.n_heads, cfg.d_k, device="cuda", generator=gen).to(dtype)
    k = torch.randn(B, T, H, cfg.d_k, device="cuda", generator=gen).to(dtype)
    v = torch.randn(B, T, H, cfg.d_v, device="cuda", generator=gen).to(dtype)
    do = torch.randn(B, T, cfg.n_heads, cfg.d_v, device="cuda", generator=gen).to(dtype)
    return q, k, v, do, random_indices(cfg, B, T, gen)


def rel(a, b):
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - b).norm() / b.norm()).item()


def check(HQ, Dk, Dv, T, mode, B=1):
    cfg = config(HQ, Dk, Dv)
    q, k, v, do, idx = inputs(cfg, B, T, torch.bfloat16, seed=HQ + T)
    xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
    selection.POISON = True
    o = selection.selected_attention(*xs, idx, cfg, mode=mode)
    o.backward(do)
    selection.POISON = False
    xr = [x.float().requires_grad_(True) for x in (q, k, v)]
    o_r = reference.selected_attention(*xr, idx.long(), cfg)
    o_r.backward(do.float())
    errs = {"o": rel(o, o_r)}
    for n, a, b in zip(("dq", "dk", "dv"), xs, xr):
        errs[n] = rel(a.grad, b.grad)
    ok = all(math.isfinite(e) and e < 2e-2 for e in errs.values())
    return dict(HQ=HQ, G=HQ // H, Dk=Dk, Dv=Dv, T=T, mode=mode, ok=ok, **{k: round(v, 6) for k, v in errs.items()})


def bench(HQ, T, mode, D=128, B=1, reps=(50, 300), opts=None):
    opts = dict(opts or {})
    Dk, Dv = opts.pop("dk", D), opts.pop("dv", D)  # e.g. the paper's Dk=192 / Dv=128
    cfg = config(HQ, Dk, Dv)
    q, k, v, do, idx = inputs(cfg, B, T, torch.bfloat16)
    fwd = lambda: selection.selected_attention(q, k, v, idx, cfg, mode=mode, opts=opts)
    with torch.no_grad():
        t_f = triton.testing.do_bench(fwd, warmup=reps[0], rep=reps[1], return_mode="median")
    qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))

    def fb():
        selection.selected_attention(qg, kg, vg, idx, cfg, mode=mode, opts=opts).backward(do)

    t_fb = triton.testing.do_bench(fb, warmup=reps[0], rep=reps[1], grad_to_none=[qg, kg, vg], return_mode="median")
    n_pairs = (idx >= 0).sum().item() * cfg.l_sel * (HQ // H)  # (query head, key) pairs, full blocks
    flop_f = 2 * n_pairs * (Dk + Dv)
    return dict(T=T, HQ=HQ, G=HQ // H, Dk=Dk, Dv=Dv, mode=mode, opts=opts or {}, fwd_ms=round(t_f, 3), fwdbwd_ms=round(t_fb, 3),
                fwd_tflops=round(flop_f / t_f / 1e9, 1), fwdbwd_tflops=round(3.5 * flop_f / t_fb / 1e9, 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--T", default="8192,16384,32768,65536")
    ap.add_argument("--plan", default="16:query,4:query,4:block,1:block", help="G:mode pairs to time")
    ap.add_argument("--variants", default="", help="T; then G:mode:json-opts items separated by ';'")
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", ".")
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), checks=[], timings=[])

    def save():
        with open(os.path.join(out_dir, "selection.json"), "w") as f:
            json.dump(res, f, indent=1)

    if not args.no_check:
        shapes = [(64, 128, 128, 4096), (16, 128, 128, 4096), (4, 128, 128, 4096), (32, 192, 128, 2048),
                  (8, 256, 256, 2048), (12, 64, 64, 1024)]
        for HQ, Dk, Dv, T in shapes[: 3 if args.quick else None]:
            for mode in ("query", "block"):
                try:
                    r = check(HQ, Dk, Dv, T, mode)
                except Exception as e:  # noqa: BLE001  (the table says which shape failed)
                    r = dict(HQ=HQ, Dk=Dk, Dv=Dv, T=T, mode=mode, ok=False, error=repr(e)[:300])
                res["checks"].append(r)
                print("check", r, flush=True)
                save()
    runs = [(int(T), int(g), m, None) for T in args.T.split(",") for g, m in (x.split(":") for x in args.plan.split(","))]
    if args.variants:
        T, *items = args.variants.split(";")
        for it in items:
            g, m, o = it.split(":", 2)
            runs.append((int(T), int(g), m, json.loads(o)))
    for T, G, mode, opts in runs:
        if mode == "block" and G >= 16 and T > 16384:
            continue  # per-slot partial outputs would need > 30 GB
        try:
            r = bench(G * H, T, mode, opts=opts)
        except Exception as e:  # noqa: BLE001  (the table shows the error)
            r = dict(T=T, G=G, mode=mode, opts=opts or {}, error=repr(e)[:300])
        res["timings"].append(r)
        print("time", r, flush=True)
        save()
        torch.cuda.empty_cache()
    save()
    print("\n=== selected attention, bf16, B=1, H=4, D=128, l_sel=64, n_sel=16 (ms, median) ===")
    for c in res["checks"]:
        print(f"chk HQ={c['HQ']:3d} Dk={c['Dk']} Dv={c['Dv']} T={c['T']} {c['mode']:5s} ok={c['ok']} "
              + " ".join(f"{k}={c.get(k)}" for k in ("o", "dq", "dk", "dv")) + (f" ERR {c['error']}" if "error" in c else ""))
    print(f"{'T':>6} {'G':>3} {'mode':>5} {'fwd':>8} {'fwd+bwd':>8} {'fwdTF':>6} {'fbTF':>6} opts")
    for r in res["timings"]:
        if "error" in r:
            print(f"{r['T']:>6} {r['G']:>3} {r['mode']:>5} ERROR {r['error'][:150]}")
        else:
            print(f"{r['T']:>6} {r['G']:>3} {r['mode']:>5} {r['fwd_ms']:>8.3f} {r['fwdbwd_ms']:>8.3f} "
                  f"{r['fwd_tflops']:>6.1f} {r['fwdbwd_tflops']:>6.1f} Dk={r['Dk']} Dv={r['Dv']} "
                  f"{json.dumps(r['opts']) if r['opts'] else ''}")


if __name__ == "__main__":
    main()
