"""Decode-step benchmark of the NSA GPU decode path (nsa.decode.GraphDecoder), one H200.

    PYTHONUNBUFFERED=1 python3 scripts/bench_decode.py            # writes $OUT/decode.json (or ./decode.json)

1. bf16 correctness against the reference decode (the module's own cached forward) for B=1 and
   B=64, over steps that emit compressed tokens; and the attention kernels against the fp32
   reference ops on the same (upcast) caches and the same q/gates.
2. CUDA-graph timings (median of do_bench over graph replays, L2 flushed between replays) of the
   attention step, each branch alone, the combine alone, and the full layer step (projections,
   cache writes, phi emission, attention, o_proj), at S = 8k..64k, B = 1 and 64, paper shape
   (HQ=64, H=4, D=128, n_sel=16, l_sel=64, w=512, l=32, d=16); dense SDPA decode at the same S.
   One captured graph serves every S: the position is a device tensor.
3. Tokens read per step: the kernels' own counters vs an independent count from the indices vs
   the paper formula; bytes and the HBM floor.
4. The earlier codebase's bench shape (dim 256, 8 heads, 2 kv heads, dk=dv=32, B=1, S=512..4096).

Imports only nsa, torch and triton.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from nsa import NSAAttention, NSAConfig, reference
from nsa.decode import GraphDecoder, tokens_read

DEV = "cuda"
BW_TBS = 4.3  # measured device copy bandwidth (anchors.md), TB/s
OUT = os.environ.get("OUT", ".")
RES: dict = {"env": {}, "correctness": [], "timing": [], "small": []}


def log(*a):
    print(*a, flush=True)


def bench(fn, n_rep=200):
    return triton.testing.do_bench(fn, warmup=25, rep=n_rep, return_mode="median")


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def paper_cfg(dim=2048):
    return NSAConfig(dim=dim, n_heads=64, n_kv_heads=4, d_k=128, d_v=128, l=32, d=16, l_sel=64, n_sel=16,
                     w=512, n_init=1, n_local=2)


# ----------------------------------------------------------------------------------------------
def correctness(B, P=2048, steps=40, dim=2048):
    torch.manual_seed(1 + B)
    cfg = paper_cfg(dim)
    m = NSAAttention(cfg).to(DEV, torch.bfloat16).eval()
    T = P + steps
    x = torch.randn(B, T, cfg.dim, device=DEV, dtype=torch.bfloat16)
    cache, cref = m.new_cache(B, T), m.new_cache(B, T)
    dec = GraphDecoder(m, cache)
    with torch.no_grad():
        dec.prefill(x[:, :P])
        m(x[:, :P], cref)
    dec.capture()
    worst_e2e, worst_attn, idx_agree, emitted = 0.0, 0.0, [], 0
    for i in range(steps):
        t = P + i
        xt = x[:, t:t + 1]
        y = dec.replay(xt).clone()  # graph replay, position from the device tensor
        with torch.no_grad():
            yr = m(xt, cref)
        worst_e2e = max(worst_e2e, rel(y, yr))
        emitted += int((t - cfg.l + 1) >= 0 and (t - cfg.l + 1) % cfg.d == 0)
        if i % 8 == 0 or i == steps - 1:
            # kernels vs fp32 reference ops on the same caches / q / gates (q, gates of this step)
            with torch.no_grad():
                S = t + 1
                dec.pos.fill_(t)
                q, g = dec.project(xt)  # this step's q/gates again (rewrites the same cache values)
                o = dec.attend(q, g).float()
                idx = dec.indices()
                f = lambda z: z.float()
                nc = cfg.n_cmp(S)
                o_c, idx_r = reference.compressed_branch(f(q)[:, None], f(cache.k_cmp[:, :nc]), f(cache.v_cmp[:, :nc]),
                                                         cfg, q_start=t, n_keys=S)
                agree = (idx_r == idx).float().mean().item()
                idx_agree.append(agree)
                o_s = reference.selected_attention(f(q)[:, None], f(cache.k_sel[:, :S]), f(cache.v_sel[:, :S]), idx, cfg,
                                                   q_start=t)
                o_w = reference.sliding_window_attention(f(q)[:, None], f(cache.k_win[:, :S]), f(cache.v_win[:, :S]),
                                                         cfg, q_start=t)
                gg = f(g)[:, None, :, :, None]
                o_ref = (gg[..., 0, :] * o_c + gg[..., 1, :] * o_s + gg[..., 2, :] * o_w)[:, 0]
                worst_attn = max(worst_attn, rel(o, o_ref))
                dec.pos.fill_(t + 1)
    r = {"B": B, "prefill": P, "steps": steps, "emitted": emitted, "rel_err_step_vs_module_decode": worst_e2e,
             "rel_err_attn_vs_fp32_ref": worst_attn, "index_agreement_min": min(idx_agree)}
    log("correctness", r)
    RES["correctness"].append(r)
    del dec, cache, cref, m
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
def timing(B, Ss, dim=2048, max_len=65536):
    torch.manual_seed(7)
    cfg = paper_cfg(dim)
    m = NSAAttention(cfg).to(DEV, torch.bfloat16).eval()
    cache = m.new_cache(B, max_len)
    for name in ("k_cmp_raw", "v_cmp_raw", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win"):
        getattr(cache, name).normal_()
    dec = GraphDecoder(m, cache)
    dec.k_cmp_ext.normal_()
    dec.v_cmp_ext.normal_()
    HQ, H, D = cfg.n_heads, cfg.n_kv_heads, cfg.d_k
    q = torch.randn(B, HQ, D, device=DEV, dtype=torch.bfloat16)
    gates = torch.rand(B, HQ, 3, device=DEV, dtype=torch.bfloat16)
    dec.x_static.normal_()
    t0 = time.time()
    dec.pos.fill_(Ss[0] - 1)
    graphs = {
        "attn": dec.capture_attention(q, gates),
        "cmp": dec.capture_attention(q, gates, branches=("cmp",), combine=False),
        "cmp_no_topk": dec.capture_attention(q, gates, branches=("cmp",), combine=False, topk=False),
        "sel": dec.capture_attention(q, gates, branches=("sel",), combine=False),
        "win": dec.capture_attention(q, gates, branches=("win",), combine=False),
        "combine": dec.capture_attention(q, gates, branches=(), combine_branches=("cmp", "sel", "win")),
        "layer": dec.capture_body(advance=False),
    }
    log(f"B={B}: compiled + captured in {time.time() - t0:.1f}s; params {dec.kernels.params()}")
    for S in Ss:
        dec.pos.fill_(S - 1)  # the query at t = S-1 sees S tokens; same graphs
        dec.length = cache.length = S - 1
        torch.cuda.synchronize()
        ms = {k: bench(g.replay) for k, g in graphs.items()}
        # counters from the kernels (eager run with count=True) vs independent count vs formula
        dec.attend(q, gates, count=True)
        cnt = dec.kernels.counts.view(B, H, 3).cpu().long()
        ind = tokens_read(cfg, S, dec.kernels.indices)
        agree = bool(torch.equal(cnt[..., 0], ind["cmp"]) and torch.equal(cnt[..., 1], ind["sel"])
                     and torch.equal(cnt[..., 2], ind["win"]))
        read_tok = cnt.sum(-1).double().mean().item()
        distinct = ind["distinct"].double().mean().item()
        elem = 2
        kv_bytes = cnt.sum().item() * (cfg.d_k + cfg.d_v) * elem
        # extra traffic of the kernels besides K/V: fp32 scores written+read, partials
        Tc = cfg.n_cmp(S)
        scratch = B * H * (cfg.G * Tc * 4 * 2 + Tc * 4 * 2)
        floor_ms = kv_bytes / (BW_TBS * 1e12) * 1e3
        # dense SDPA decode at the same S
        kd = torch.randn(B, H, S, D, device=DEV, dtype=torch.bfloat16)
        vd = torch.randn(B, H, S, D, device=DEV, dtype=torch.bfloat16)
        qd = torch.randn(B, HQ, 1, D, device=DEV, dtype=torch.bfloat16)
        dense = bench(lambda qd=qd, kd=kd, vd=vd: torch.nn.functional.scaled_dot_product_attention(
            qd, kd, vd, enable_gqa=True))
        dense_floor = B * H * S * 2 * D * elem / (BW_TBS * 1e12) * 1e3
        del kd, vd
        r = {"B": B, "S": S, "attn_ms": ms["attn"], "cmp_ms": ms["cmp"], "sel_ms": ms["sel"], "win_ms": ms["win"],
             "combine_ms": ms["combine"], "cmp_no_topk_ms": ms["cmp_no_topk"],
             "overhead_ms": ms["attn"] - ms["cmp"] - ms["sel"] - ms["win"],
             "layer_ms": ms["layer"], "dense_sdpa_ms": dense, "speedup_vs_dense": dense / ms["attn"],
             "tokens_read_per_group": read_tok, "tokens_distinct_per_group": distinct,
             "tokens_formula": cfg.decode_tokens_formula(S), "counters_match_independent": agree,
             "kv_bytes": kv_bytes, "scratch_bytes": scratch, "nsa_floor_ms": floor_ms, "dense_floor_ms": dense_floor,
             "achieved_TBs": kv_bytes / (ms["attn"] * 1e-3) / 1e12}
        log("timing", json.dumps(r))
        RES["timing"].append(r)
    del graphs, dec, cache, m
    torch.cuda.empty_cache()


def small_shape():
    """The earlier codebase's decode bench: dim 256, 8 heads, 2 kv heads, dk=dv=32, B=1."""
    cfg = NSAConfig(dim=256, n_heads=8, n_kv_heads=2, d_k=32, d_v=32)
    m = NSAAttention(cfg).to(DEV, torch.bfloat16).eval()
    cache = m.new_cache(1, 4096)
    for name in ("k_cmp_raw", "v_cmp_raw", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win"):
        getattr(cache, name).normal_()
    dec = GraphDecoder(m, cache)
    dec.x_static.normal_()
    q = torch.randn(1, 8, 32, device=DEV, dtype=torch.bfloat16)
    gates = torch.rand(1, 8, 3, device=DEV, dtype=torch.bfloat16)
    dec.pos.fill_(511)
    ga = dec.capture_attention(q, gates)
    gl = dec.capture_body(advance=False)
    # eager module decode (what the earlier codebase timed), one step
    for S in (512, 1024, 2048, 4096):
        dec.pos.fill_(S - 1)
        dec.length = cache.length = S - 1
        a, lay = bench(ga.replay), bench(gl.replay)
        xs = torch.randn(1, 1, 256, device=DEV, dtype=torch.bfloat16)

        def eager_ref(S=S, xs=xs):
            cache.length = S - 1
            with torch.no_grad():
                m(xs, cache)
        ref = bench(eager_ref, n_rep=50)
        r = {"S": S, "attn_ms": a, "layer_ms": lay, "module_reference_eager_ms": ref}
        log("small", r)
        RES["small"].append(r)


def main():
    p = torch.cuda.get_device_properties(0)
    RES["env"] = {"device": p.name, "sms": p.multi_processor_count, "torch": torch.__version__, "triton": triton.__version__,
                      "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    log(RES["env"])
    Ss = [8192, 16384, 32768, 65536]
    only = os.environ.get("BENCH_ONLY", "")
    try:
        if not only or "corr" in only:
            correctness(1)
            correctness(64, P=1024, steps=24)
        if not only or "time" in only:
            timing(1, Ss)
            timing(64, Ss)
        if not only or "small" in only:
            small_shape()
    finally:
        with open(os.path.join(OUT, "decode.json"), "w") as f:
            json.dump(RES, f, indent=1)
    log("\n== NSA decode step, bf16, HQ=64 H=4 D=128 n_sel=16 l_sel=64 w=512 l=32 d=16 (ms, CUDA-graph medians)")
    log(f"{'B':>3} {'S':>6} {'attn':>7} {'cmp':>7} {'sel':>7} {'win':>7} {'comb':>7} {'layer':>7} {'dense':>7} "
        f"{'x':>5} {'floor':>6} {'TB/s':>5} {'read':>6} {'dist':>6} {'formula':>7} cnt_ok  cmp-topk")
    for r in RES["timing"]:
        log(f"{r['B']:>3} {r['S']:>6} {r['attn_ms']:7.4f} {r['cmp_ms']:7.4f} {r['sel_ms']:7.4f} {r['win_ms']:7.4f} "
            f"{r['combine_ms']:7.4f} {r['layer_ms']:7.4f} {r['dense_sdpa_ms']:7.4f} {r['speedup_vs_dense']:5.2f} "
            f"{r['nsa_floor_ms']:6.4f} {r['achieved_TBs']:5.2f} {r['tokens_read_per_group']:6.0f} "
            f"{r['tokens_distinct_per_group']:6.0f} {r['tokens_formula']:7d} {r['counters_match_independent']} "
            f"{r['cmp_no_topk_ms']:7.4f}")
    for r in RES["correctness"]:
        log(f"correct B={r['B']}: step vs module decode rel {r['rel_err_step_vs_module_decode']:.2e}, "
            f"attn vs fp32 ref rel {r['rel_err_attn_vs_fp32_ref']:.2e}, idx agree {r['index_agreement_min']:.4f}, "
            f"emitted {r['emitted']}")
    for r in RES["small"]:
        log(f"small B=1 S={r['S']}: attn {r['attn_ms']:.4f} layer {r['layer_ms']:.4f} "
            f"module eager {r['module_reference_eager_ms']:.3f} ms")


if __name__ == "__main__":
    main()
