"""Check and time the compressed (cmp) and sliding-window (win) branches on one GPU.

    python scripts/bench_cmp_win.py [--out DIR] [--T 8192,16384,32768,65536] [--quick | --tune-bwd | --tune-fwd]

1. Correctness in bf16 against ``nsa.reference`` on fp32-upcast inputs (T <= 8k): o_cmp, the top-n
   indices (share equal; bf16 rounding can reorder near-ties), dq/dk/dv; the fp32 Triton path (ieee
   dots) must give indices identical to the reference. Window: Triton, FlexAttention (sdpa backend)
   and FlashAttention-2 (fa2 backend) outputs and gradients. Outputs are NaN-poisoned by the kernels'
   wrappers before they write.
2. Times (``triton.testing.do_bench``, median, ms) at B=1, HQ=64, H=4, D=128, l=32, d=16, l_sel=64,
   n_sel=16, w=512, bf16:
   cmp: Triton fused compressed attention + Eq. 9/10 scores + top-n (fwd; fwd+bwd), and for comparison
   FlexAttention with the visibility mask_mod computing o_cmp only (no scores, no top-n).
   win: Triton, FlexAttention (compiled, BlockMask cached outside the timing), torch FlashAttention-2
   with window_size (the fa2 backend).
Results go to DIR/cmp_win.json (DIR: --out, else $OUT, else outputs/); a short table is printed last.
Imports only nsa, torch and triton.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402

from nsa import reference  # noqa: E402
from nsa.backends import fa2 as fa2_backend  # noqa: E402
from nsa.backends import sdpa as sdpa_backend  # noqa: E402
from nsa.backends.triton import _cmp_ops  # noqa: E402
from nsa.backends.triton.compressed import compressed_branch  # noqa: E402
from nsa.backends.triton.window import sliding_window_attention  # noqa: E402
from nsa.config import NSAConfig  # noqa: E402

DEV = "cuda"


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def cfg_for(HQ=64, H=4, D=128, Dv=None):
    return NSAConfig(
        dim=HQ * D, n_heads=HQ, n_kv_heads=H, d_k=D, d_v=Dv or D, l=32, d=16, l_sel=64, n_sel=16, w=512
    )


def inputs(cfg, B, T, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    Tc = cfg.n_cmp(T)

    def r(*s, std=1.0):
        return (torch.randn(*s, device=DEV, generator=g) * std).to(dtype)

    return dict(
        q=r(B, T, cfg.n_heads, cfg.d_k, std=2.0),
        kc=r(B, Tc, cfg.n_kv_heads, cfg.d_k, std=2.0),
        vc=r(B, Tc, cfg.n_kv_heads, cfg.d_v),
        kw=r(B, T, cfg.n_kv_heads, cfg.d_k),
        vw=r(B, T, cfg.n_kv_heads, cfg.d_v),
    )


def grads(fn, xs, do):
    xs = [x.detach().requires_grad_() for x in xs]
    out = fn(*xs)
    o = out[0] if isinstance(out, tuple) else out
    gs = torch.autograd.grad(o, xs, do)
    return out, gs


def check(res):
    scale = 1 / math.sqrt(128)
    # --- compressed branch, bf16 vs fp32 reference on upcast inputs
    for T, HQ, H, Dv in ((8192, 64, 4, 128), (2048, 16, 2, 64), (777, 8, 8, 128)):
        cfg = cfg_for(HQ, H, 128, Dv)
        x = inputs(cfg, 1, T, torch.bfloat16, seed=T)
        do = torch.randn(1, T, HQ, Dv, device=DEV, dtype=torch.bfloat16)
        (o, idx), g = grads(
            lambda q, k, v: compressed_branch(q, k, v, cfg, scale=scale), [x["q"], x["kc"], x["vc"]], do
        )
        (ro, ridx), rg = grads(
            lambda q, k, v: reference.compressed_branch(q, k, v, cfg, scale=scale),
            [x["q"].float(), x["kc"].float(), x["vc"].float()],
            do.float(),
        )
        entry = dict(
            T=T,
            HQ=HQ,
            H=H,
            Dv=Dv,
            o_rel=rel(o, ro),
            idx_equal_share=(idx == ridx).float().mean().item(),
            dq_rel=rel(g[0], rg[0]),
            dk_rel=rel(g[1], rg[1]),
            dv_rel=rel(g[2], rg[2]),
            nan=bool(torch.isnan(o).any() or any(torch.isnan(t).any() for t in g)),
        )
        # fp32 kernel (ieee dots): indices must equal the reference's exactly
        o32, idx32 = compressed_branch(x["q"].float(), x["kc"].float(), x["vc"].float(), cfg, scale=scale)
        entry["fp32_o_rel"] = rel(o32, ro)
        entry["fp32_idx_equal_share"] = (idx32 == ridx).float().mean().item()
        res["check_cmp"].append(entry)
        print("check cmp", entry, flush=True)
    # decode-like: few queries at the end of a long prefix
    cfg = cfg_for()
    x = inputs(cfg, 2, 4100, torch.float32, seed=1)
    q = x["q"][:, -3:]
    o, idx = compressed_branch(q, x["kc"], x["vc"], cfg, scale=scale, q_start=4097)
    ro, ridx = reference.compressed_branch(q, x["kc"], x["vc"], cfg, scale=scale, q_start=4097)
    res["check_cmp"].append(
        dict(decode=True, o_rel=rel(o, ro), idx_equal_share=(idx == ridx).float().mean().item())
    )
    print("check cmp decode", res["check_cmp"][-1], flush=True)
    # --- window
    for T, HQ, H, Dv in ((8192, 64, 4, 128), (3000, 16, 2, 64)):
        cfg = cfg_for(HQ, H, 128, Dv)
        x = inputs(cfg, 1, T, torch.bfloat16, seed=T + 1)
        do = torch.randn(1, T, HQ, Dv, device=DEV, dtype=torch.bfloat16)
        ro, rg = grads(
            lambda q, k, v: reference.sliding_window_attention(q, k, v, cfg, scale=scale),
            [x["q"].float(), x["kw"].float(), x["vw"].float()],
            do.float(),
        )
        for name, fn in (
            ("triton", lambda q, k, v: sliding_window_attention(q, k, v, cfg, scale=scale)),
            ("flex", lambda q, k, v: sdpa_backend.BACKEND.window(q, k, v, cfg, scale=scale, q_start=0)),
            ("fa2", lambda q, k, v: fa2_backend.BACKEND.window(q, k, v, cfg, scale=scale, q_start=0)),
        ):
            try:
                o, g = grads(fn, [x["q"], x["kw"], x["vw"]], do)
                entry = dict(
                    impl=name,
                    T=T,
                    HQ=HQ,
                    H=H,
                    Dv=Dv,
                    o_rel=rel(o, ro),
                    dq_rel=rel(g[0], rg[0]),
                    dk_rel=rel(g[1], rg[1]),
                    dv_rel=rel(g[2], rg[2]),
                )
            except Exception as e:  # noqa: BLE001
                entry = dict(impl=name, T=T, error=f"{type(e).__name__}: {e}"[:400])
            res["check_win"].append(entry)
            print("check win", entry, flush=True)


def bench(fn, rep=200):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def flex_cmp(cfg, T, Tc):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, qi, ki):
        return ki * cfg.d + cfg.l - 1 <= qi

    bm = create_block_mask(mask_mod, None, None, T, Tc, device=DEV)
    flex = sdpa_backend._flex_attention()

    def run(q, k, v):
        return flex(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm, enable_gqa=True
        ).transpose(1, 2)

    return run


def timings(res, Ts):
    cfg = cfg_for()
    for T in Ts:
        x = inputs(cfg, 1, T, torch.bfloat16, seed=7)
        do = torch.randn(1, T, 64, 128, device=DEV, dtype=torch.bfloat16)
        row = dict(T=T)

        def fb(fn, xs, do=do):
            xs = [t.detach().requires_grad_() for t in xs]

            def step():
                out = fn(*xs)
                o = out[0] if isinstance(out, tuple) else out
                o.backward(do)

            return step

        cases = {
            "cmp_triton": (lambda q, k, v: compressed_branch(q, k, v, cfg), "c"),
            "cmp_flex_o_only": (flex_cmp(cfg, T, cfg.n_cmp(T)), "c"),
            "win_triton": (lambda q, k, v: sliding_window_attention(q, k, v, cfg), "w"),
            "win_flex": (
                lambda q, k, v: sdpa_backend.BACKEND.window(
                    q, k, v, cfg, scale=1 / math.sqrt(128), q_start=0
                ),
                "w",
            ),
            "win_fa2": (
                lambda q, k, v: fa2_backend.BACKEND.window(q, k, v, cfg, scale=1 / math.sqrt(128), q_start=0),
                "w",
            ),
        }
        for name, (fn, kind) in cases.items():
            xs = [x["q"], x["kc"], x["vc"]] if kind == "c" else [x["q"], x["kw"], x["vw"]]
            try:
                with torch.no_grad():
                    row[name + "_fwd"] = bench(lambda: fn(*xs))
                row[name + "_fwdbwd"] = bench(fb(fn, xs))
            except Exception as e:  # noqa: BLE001
                row[name + "_error"] = f"{type(e).__name__}: {e}"[:300]
                traceback.print_exc()
            print(T, name, {k: v for k, v in row.items() if k.startswith(name)}, flush=True)
        torch.cuda.synchronize()
        res["times"].append(row)
        del x, do
        torch.cuda.empty_cache()


def parts(res, T=65536):
    """The top-n kernel alone on one [1, 16384, 4, nb] chunk of the score buffer (T/16384 chunks run)."""
    cfg = cfg_for()
    nb = cfg.n_blocks(T)
    c = min(T, 16384)
    sc = torch.rand(1, c, 4, nb, device=DEV)
    out = torch.empty(1, c, 4, cfg.n_sel, device=DEV, dtype=torch.int64)

    def run():
        _cmp_ops.topn_launch(sc, out, T - c, nb, cfg)

    run()
    ref = reference.select_blocks(sc, cfg, q_start=T - c)
    res["parts"] = dict(
        T=T,
        chunk=c,
        topn_kernel_ms_per_chunk=bench(run),
        chunks=T // c,
        topn_equal_reference=bool((out == ref).all()),
    )
    print("parts", res["parts"], flush=True)


# top-n launch variants: (score elements per program, warps); the first is the default
TOPN_VARIANTS = ((1024, 1), (2048, 1), (4096, 1), (512, 1), (2048, 2), (4096, 2), (2048, 4))


def tune_topn(res, T=65536):
    """The whole top-n of a T-row forward (all bucket launches over one [1, T, 4, nb] score buffer, as
    ``_attn_forward`` runs it when T fits one chunk), per launch variant, checked against
    ``reference.select_blocks``."""
    cfg = cfg_for()
    nb = cfg.n_blocks(T)
    sc = torch.rand(1, T, 4, nb, device=DEV)
    out = torch.empty(1, T, 4, cfg.n_sel, device=DEV, dtype=torch.int64)
    ref = reference.select_blocks(sc, cfg, q_start=0)
    base = dict(_cmp_ops.TUNE["cuda"])
    for elems, warps in TOPN_VARIANTS:
        _cmp_ops.TUNE["cuda"].update(topn_elems=elems, topn_warps=warps)
        entry = dict(T=T, topn_elems=elems, topn_warps=warps)
        try:
            out.fill_(-7)
            _cmp_ops.topn_launch(sc, out, 0, nb, cfg)
            entry["equal_reference"] = bool((out == ref).all())
            entry["topn_ms"] = bench(lambda: _cmp_ops.topn_launch(sc, out, 0, nb, cfg))
        except Exception as e:  # noqa: BLE001
            entry["error"] = f"{type(e).__name__}: {e}"[:300]
        res["tune_topn"].append(entry)
        print("tune_topn", entry, flush=True)
    _cmp_ops.TUNE["cuda"].update(base)


def tune_sweep(res, T=65536, fwd=True, bwd=True):
    """Tile variants of the Triton cmp/win kernels at one T (rows per program, keys per tile, warps,
    stages; forward, then backward)."""
    cfg = cfg_for()
    x = inputs(cfg, 1, T, torch.bfloat16, seed=3)
    base = dict(_cmp_ops.TUNE["cuda"])
    # compressed forward: (rows, block_n, warps, stages, score_lo, lse_n)
    for rows, bn, warps, stages, lo, lse_n in ((64, 64, 4, 2, True, 128), (64, 64, 4, 2, True, 64),
                                               (64, 64, 4, 2, False, 128), (128, 64, 8, 3, True, 128),
                                               (128, 64, 8, 2, True, 128), (64, 64, 4, 2, True, 256))[: None if fwd else 0]:
        _cmp_ops.TUNE["cuda"].update(rows=rows, block_n=bn, warps=warps, stages=stages, score_lo=lo, lse_n=lse_n)
        entry = dict(rows=rows, block_n=bn, warps=warps, stages=stages, score_lo=lo, lse_n=lse_n)
        try:
            with torch.no_grad():
                entry["cmp_fwd"] = bench(lambda: compressed_branch(x["q"], x["kc"], x["vc"], cfg), rep=100)
        except Exception as e:  # noqa: BLE001
            entry["error"] = f"{type(e).__name__}: {e}"[:300]
        res["tune_fwd"].append(entry)
        print("tune", entry, flush=True)
    _cmp_ops.TUNE["cuda"].update(base)
    # window forward: (win_rows, win_block_n, win_warps, win_stages, win_maxnreg); the uncapped variants
    # BENCHMARKS cites (16:32 UTC), then the capped default of the fourth session
    for rows, bn, warps, stages, cap in ((64, 64, 4, 2, None), (128, 64, 8, 2, None), (128, 128, 8, 2, None),
                                         (64, 128, 4, 2, None), (128, 64, 4, 2, None), (128, 64, 8, 3, None),
                                         (128, 64, 8, 2, 128))[: None if fwd else 0]:
        _cmp_ops.TUNE["cuda"].update(win_rows=rows, win_block_n=bn, win_warps=warps, win_stages=stages,
                                     win_maxnreg=cap)
        entry = dict(win_rows=rows, win_block_n=bn, win_warps=warps, win_stages=stages, win_maxnreg=cap)
        try:
            with torch.no_grad():
                entry["win_fwd"] = bench(lambda: sliding_window_attention(x["q"], x["kw"], x["vw"], cfg), rep=100)
        except Exception as e:  # noqa: BLE001
            entry["error"] = f"{type(e).__name__}: {e}"[:300]
        res["tune_fwd"].append(entry)
        print("tune", entry, flush=True)
    _cmp_ops.TUNE["cuda"].update(base)
    base = dict(_cmp_ops.TUNE["cuda"])
    # (64, 64, 4, 2, 1024, 1): no query split, the backward before the split existed
    for rows, bn, warps, stages, progs, smax in ((128, 64, 8, 2, 4096, 32), (128, 64, 8, 2, 1024, 16),
                                                 (64, 64, 4, 2, 4096, 32), (64, 64, 4, 2, 1024, 16),
                                                 (64, 64, 4, 2, 1024, 1))[: None if bwd else 0]:
        _cmp_ops.TUNE["cuda"].update(bwd_rows=rows, bwd_block_n=bn, bwd_warps=warps, bwd_stages=stages,
                                     bwd_programs=progs, bwd_split_max=smax)
        entry = dict(bwd_rows=rows, bwd_block_n=bn, bwd_warps=warps, bwd_stages=stages, bwd_programs=progs,
                     bwd_split_max=smax)
        try:
            for name, fn, xs in (
                ("cmp", lambda q, k, v: compressed_branch(q, k, v, cfg)[0], [x["q"], x["kc"], x["vc"]]),
                ("win", lambda q, k, v: sliding_window_attention(q, k, v, cfg), [x["q"], x["kw"], x["vw"]]),
            ):
                xs = [t.detach().requires_grad_() for t in xs]
                o = fn(*xs)
                do = torch.randn_like(o)
                entry[name + "_bwd"] = bench(
                    lambda: torch.autograd.grad(o, xs, do, retain_graph=True), rep=100
                )
        except Exception as e:  # noqa: BLE001
            entry["error"] = f"{type(e).__name__}: {e}"[:300]
        res["tune_bwd"].append(entry)
        print("tune", entry, flush=True)
    _cmp_ops.TUNE["cuda"].update(base)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "outputs"))
    ap.add_argument("--T", default="8192,16384,32768,65536")
    ap.add_argument("--quick", action="store_true", help="skip the tile sweep")
    ap.add_argument("--tune-bwd", action="store_true", help="only the backward part of the tile sweep")
    ap.add_argument("--tune-fwd", action="store_true", help="only the forward part of the tile sweep")
    ap.add_argument("--tune-topn", action="store_true", help="only the top-n launch sweep (TOPN_VARIANTS) at 64k")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    res = dict(
        date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        torch=torch.__version__,
        triton=triton.__version__,
        device=torch.cuda.get_device_name(),
        fa2_impl=fa2_backend.BACKEND.impl,
        tune=_cmp_ops.TUNE["cuda"],
        check_cmp=[],
        check_win=[],
        times=[],
        tune_fwd=[],
        tune_bwd=[],
        tune_topn=[],
    )
    path = os.path.join(a.out, "cmp_win.json")
    t0 = time.time()
    stages = (
        ("check", lambda: check(res)),
        ("parts", lambda: parts(res)),
        ("times", lambda: timings(res, [int(t) for t in a.T.split(",")])),
        ("tune", (lambda: None) if a.quick else (lambda: tune_sweep(res, fwd=not a.tune_bwd, bwd=not a.tune_fwd))),
    )
    if a.tune_topn:
        stages = (("tune_topn", lambda: tune_topn(res)),)
    for stage, fn in stages:
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            res[stage + "_error"] = f"{type(e).__name__}: {e}"[:1000]
            traceback.print_exc()
        res[stage + "_s"] = time.time() - t0
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    print("\n== checks (rel. errors vs fp32 reference) ==")
    for e in res["check_cmp"] + res["check_win"]:
        print({k: (round(v, 5) if isinstance(v, float) else v) for k, v in e.items()})
    print("\n== times, ms (median), B=1 HQ=64 H=4 D=128 bf16 ==")
    cols = [
        "cmp_triton_fwd",
        "cmp_triton_fwdbwd",
        "cmp_flex_o_only_fwd",
        "cmp_flex_o_only_fwdbwd",
        "win_triton_fwd",
        "win_triton_fwdbwd",
        "win_flex_fwd",
        "win_flex_fwdbwd",
        "win_fa2_fwd",
        "win_fa2_fwdbwd",
    ]
    print("T".rjust(6) + "".join(c.replace("_o_only", "").rjust(19) for c in cols))
    for r in res["times"]:
        print(str(r["T"]).rjust(6) + "".join((f"{r[c]:.3f}" if c in r else "err").rjust(19) for c in cols))
    print(f"json: {path}")


if __name__ == "__main__":
    main()
