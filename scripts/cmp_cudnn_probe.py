"""The compressed branch on two designs, one process, one GPU: the triton backend (two passes: lse, then
p @ v with the Eq. 9/10 scores) and the cudnn backend (queries folded into causal attention run by cuDNN, then
the triton score-only pass). Checks both against a float32 reference, then times forward and forward+backward
and the cudnn design's parts. Prints one table; writes $OUT/cmp_cudnn.json.
    python scripts/cmp_cudnn_probe.py [--seqs 8192,65536] [--shapes 64x4x128,8x2x64]
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton

from nsa import NSAConfig, reference
from nsa.numerics import rel_l2
from nsa.backends import cudnn
from nsa.backends.triton import tuning
from nsa.backends.triton.compressed import compressed_forward
from nsa.backends.triton.compressed import compressed_branch as triton_cmp


def cfg_of(HQ, H, D):
    return NSAConfig(dim=HQ * D, n_heads=HQ, n_kv_heads=H, d_k=D, d_v=D, l=32, d=16, l_sel=64, n_sel=16, w=512,
                     n_init=1, n_local=2)


def inputs(cfg, T, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    N = cfg.n_cmp(T)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.float32).to(dtype)  # noqa: E731
    return r(1, T, cfg.n_heads, cfg.d_k), r(1, N, cfg.n_kv_heads, cfg.d_k), r(1, N, cfg.n_kv_heads, cfg.d_v)


def check(cfg, T):
    """rel-L2 of o and the three gradients against the float32 reference, and the share of top-n index
    sets equal to the reference's, for both designs."""
    q, k, v = inputs(cfg, T, torch.bfloat16, seed=1)
    do = torch.randn(1, T, cfg.n_heads, cfg.d_v, device="cuda").to(torch.bfloat16)
    rx = [t.float().requires_grad_() for t in (q, k, v)]
    ro, ridx = reference.compressed_branch(*rx, cfg)
    rg = torch.autograd.grad(ro, rx, do.float())
    out = {}
    for name, fn in (("triton", triton_cmp), ("cudnn", cudnn.compressed_branch)):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        o, idx = fn(*xs, cfg)
        g = torch.autograd.grad(o, xs, do)
        same = (idx.sort(-1).values == ridx.sort(-1).values).all(-1).float().mean().item()
        out[name] = dict(o=rel_l2(o, ro), dq=rel_l2(g[0], rg[0]), dk=rel_l2(g[1], rg[1]), dv=rel_l2(g[2], rg[2]), idx_same=same)
        assert not torch.isnan(o).any()
    return out


def bench(fn, rep=300):
    return triton.testing.do_bench(fn, warmup=50, rep=rep, return_mode="median")


def times(cfg, T):
    q, k, v = inputs(cfg, T, torch.bfloat16)
    do = torch.randn(1, T, cfg.n_heads, cfg.d_v, device="cuda").to(torch.bfloat16)
    scale = cfg.d_k ** -0.5
    res = {}
    for name, fn in (("triton", triton_cmp), ("cudnn", cudnn.compressed_branch)):
        res[f"{name}_fwd"] = bench(lambda fn=fn: fn(q, k, v, cfg))
        xs = [t.clone().requires_grad_() for t in (q, k, v)]

        def fb(fn=fn, xs=xs):
            o, _ = fn(*xs, cfg)
            o.backward(do)
        res[f"{name}_fwdbwd"] = bench(fb)
    n = cudnn.n_rows(T, cfg.l, cfg.d)
    qf = cudnn.fold_queries(q, cfg.l, cfg.d)
    kf, vf = cudnn.fold_keys(k, n, cfg.d), cudnn.fold_keys(v, n, cfg.d)
    res["attention"] = bench(lambda: cudnn.attention(q, k, v, cfg, scale))
    res["cudnn_op"] = bench(lambda: cudnn.cudnn_attention(qf, kf, vf, scale))
    _, lse = cudnn.attention(q, k, v, cfg, scale)
    tune = tuning.params("compressed", q.device)
    nb = cfg.n_blocks(T)
    res["score_only"] = bench(lambda: compressed_forward(q, k, v, cfg, scale=scale, q_start=0, n_blocks=nb, on_scored=None,
                                               tune=tune, lse_in=lse))
    # the cuDNN op's own backward on the folded layout
    qf2, kf2, vf2 = (t.detach().clone().requires_grad_() for t in (qf, kf, vf))
    o2, _ = cudnn.cudnn_attention(qf2, kf2, vf2, scale)
    g2 = torch.randn_like(o2)
    res["cudnn_op_bwd"] = bench(lambda: torch.autograd.grad(o2, (qf2, kf2, vf2), g2, retain_graph=True))
    res["out_strides"] = list(o2.stride())
    # FLOPs of the compressed attention (causal over n rows of HQ*d folded heads): q k^T and p v
    pairs = n * (n + 1) // 2 * cfg.d * cfg.n_heads
    res["attn_tflop"] = 2 * 2 * pairs * cfg.d_k / 1e12
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="8192,16384,32768,65536")
    ap.add_argument("--shapes", default="64x4x128")
    ap.add_argument("--check-seq", type=int, default=8192)
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, "cudnn", torch.backends.cudnn.version())
    rows, out = [], {}
    for shape in a.shapes.split(","):
        HQ, H, D = map(int, shape.split("x"))
        cfg = cfg_of(HQ, H, D)
        c = check(cfg, a.check_seq)
        print(shape, "check at", a.check_seq, json.dumps(c))
        out[f"{shape}_check"] = c
        for T in map(int, a.seqs.split(",")):
            r = times(cfg, T)
            out[f"{shape}_{T}"] = r
            rows.append((shape, T, r))
            print(shape, T, json.dumps(r), flush=True)
    print(f"{'shape':>10} {'T':>6} | {'tri fwd':>8} {'cud fwd':>8} {'x':>5} | {'tri f+b':>8} {'cud f+b':>8} {'x':>5} |"
          f" {'attn':>7} {'op':>7} {'score':>7} {'op bwd':>7} | op TFLOP/s")
    for shape, T, r in rows:
        print(f"{shape:>10} {T:>6} | {r['triton_fwd']:8.3f} {r['cudnn_fwd']:8.3f} {r['triton_fwd'] / r['cudnn_fwd']:5.2f} |"
              f" {r['triton_fwdbwd']:8.3f} {r['cudnn_fwdbwd']:8.3f} {r['triton_fwdbwd'] / r['cudnn_fwdbwd']:5.2f} |"
              f" {r['attention']:7.3f} {r['cudnn_op']:7.3f} {r['score_only']:7.3f} {r['cudnn_op_bwd']:7.3f} |"
              f" {r['attn_tflop'] / r['cudnn_op'] * 1e3:6.0f}")
    with open(os.path.join(os.environ.get("OUT", "."), "cmp_cudnn.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
