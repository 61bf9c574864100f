"""Diagnosis on a CUDA GPU, one part per call (BENCHMARKS.md, "Validation on the H200" cites its figures):

    PYTHONPATH=tests python3 scripts/gpu_diag.py sel      # the selected branch's gradients vs the reference,
                                                          # per dq path and head dim, with the worst dK rows
                                                          # (the Dk=192 dK fault)
    PYTHONPATH=tests python3 scripts/gpu_diag.py compile  # one cmp kernel check twice: compile vs run time
    PYTHONPATH=tests python3 scripts/gpu_diag.py varlen   # the whole layer: 12 packed documents vs one
                                                          # sequence of 64k tokens
    PYTHONPATH=tests python3 scripts/gpu_diag.py replay <selections file> [8192,65536]  # a trained layer's
                                                          # selections (train.save_selections) against the
                                                          # layer's own top-n at these lengths: the selected
                                                          # branch alone and the layer, with block_indices'
                                                          # range check on and off

From the repository root with the project installed: it takes its cases from the test suite
(tests/kernel_cases.py, which imports tests/conftest.py), hence tests/ on PYTHONPATH;
`bash scripts/bench.sh diag` runs the first three.
"""
import sys
import time
from functools import partial

import torch

import kernel_cases as kc  # tests/kernel_cases.py, on PYTHONPATH (see above)

from nsa import NSAConfig, reference
from nsa import functional as fn
from nsa.backends.triton import tuning

PAPER = (32, 16, 64, 16, 512)
TOL = kc.Tol(out=5e-3, grad=8e-3, index=1e-3)
BF16 = torch.bfloat16
what = sys.argv[1]

def sel_detail(case, ov):
    t = time.time()
    cfg, S, dev = case.config(), case.T, torch.device("cuda")
    with tuning.overrides(ov):
        x = kc.inputs(case, dev, BF16)
        with torch.no_grad():
            cmp = kc.dispatch.choose("cmp", "triton", dev, BF16, None)
            _, idx = cmp.compressed(x["q"], x["k_cmp"], x["v_cmp"], cfg, scale=case.Dk ** -0.5, q_start=0, n_keys=S)
        c = kc.Compare(case, x, ("q", "k_sel", "v_sel"), torch.float32)
        o = fn.selected_attention(x["q"], x["k_sel"], x["v_sel"], idx, cfg, backend="triton")
        g = c.kernel_grads(o)
        r = c.ref
        o_ref = reference.selected_attention(r["q"], r["k_sel"], r["v_sel"], idx[:, -case.rows:], cfg, q_start=S - case.rows)
        gr = c.ref_grads(o_ref)
    errs = {n: kc.rel_l2(g[n][:, -case.rows:] if n == "q" else g[n], gr[n]) for n in ("q", "k_sel", "v_sel")}
    print(case.id, ov, f"{time.time() - t:.1f}s", {k: f"{v:.2e}" for k, v in errs.items()}, flush=True)
    if errs["k_sel"] > 8e-3:
        d = (g["k_sel"].double() - gr["k_sel"].double()).norm(dim=-1)  # [B,T,H]
        ref_n = gr["k_sel"].double().norm(dim=-1)
        top = torch.topk(d.flatten(), 12).indices
        B, T, H = d.shape
        for f in top.tolist():
            b, t, h = f // (T * H), (f // H) % T, f % H
            print(f"  b={b} t={t} blk={t // 64} h={h} err={d[b, t, h]:.3e} ref={ref_n[b, t, h]:.3e} "
                  f"kern={g['k_sel'][b, t, h].double().norm():.3e}", flush=True)
        rowsel = (idx[:, -case.rows:] == (top[0].item() // H % T) // 64).sum().item()
        print("  slots choosing the worst block among compared rows:", rowsel, flush=True)
        bad_t = (d > 0.05 * ref_n.max()).nonzero()
        print("  positions with error > 5% of max ref norm:", bad_t.shape[0], "t range",
              (bad_t[:, 1].min().item(), bad_t[:, 1].max().item()) if bad_t.numel() else None, flush=True)


def bench(fn_, args, dO):
    """(fwd ms, fwd+bwd ms) of fn_() by triton's do_bench; the backward's gradients are those of ``args``."""
    from triton.testing import do_bench
    with torch.no_grad():
        f = do_bench(fn_, warmup=20, rep=200)
    return f, do_bench(lambda: torch.autograd.grad(fn_(), args, dO), warmup=10, rep=200)


def ascending(idx):
    """Block indices sorted by block, -1 (none) last, as the top-n's."""
    s = idx.masked_fill(idx < 0, 1 << 40).sort(-1).values
    return s.masked_fill(s == 1 << 40, -1)


def one_set(idx, l_sel):
    """Every row reads the last row's blocks, those its own position can see (the rest -1): one set for all."""
    T = idx.shape[1]
    last = idx[:, -1:].expand_as(idx)
    visible = last <= (torch.arange(T, device=idx.device) // l_sel)[None, :, None, None]
    return ascending(last.masked_fill(~visible, -1))


def replay_diag(path, seqs=(8192, 65536)):
    """h200bench's layer at ``seqs``: the selected branch and the whole layer on the trained selections of
    ``path`` (each head of the file repeated over h200bench's 4), as saved, sorted by block, shared by tiles of
    64 / 512 queries (each row reads its tile's first row's blocks), one set for every row (:func:`one_set`),
    against the top-n of random inputs; the layer with block_indices' range check (one host sync a call) and
    without it (check_indices=False)."""
    from experiments.measure import replay
    cfg = NSAConfig(dim=8192, n_heads=64, n_kv_heads=4, d_k=128, d_v=128)
    g = torch.Generator(device="cuda").manual_seed(0)
    for T in seqs:
        def r(*shape, std=1.0):
            return (torch.randn(*shape, generator=g, device="cuda") * std).to(BF16).requires_grad_()
        Tc = cfg.n_cmp(T)
        x = [r(1, T, 64, 128, std=2.0), r(1, Tc, 4, 128, std=2.0), r(1, Tc, 4, 128), r(1, T, 4, 128, std=2.0),
             r(1, T, 4, 128), r(1, T, 4, 128, std=2.0), r(1, T, 4, 128),
             torch.rand(1, T, 64, 3, generator=g, device="cuda").to(BF16).requires_grad_()]
        dO = torch.randn(1, T, 64, 128, device="cuda", dtype=BF16)
        with torch.no_grad():
            _, own = fn.nsa_attention(*x, cfg, backend="triton", return_indices=True)
        trained = replay.load(path, T, cfg)[0].to("cuda", torch.int64)[None]
        rows = torch.arange(T, device="cuda")
        sets = {"own top-n (random inputs)": own, "trained": trained, "trained, sorted": ascending(trained),
                "shared by 64": trained[:, rows // 64 * 64], "shared by 512": trained[:, rows // 512 * 512],
                "one set for all": one_set(trained, cfg.l_sel)}
        for name, idx in sets.items():
            f, b = bench(partial(fn.selected_attention, x[0], x[3], x[4], idx, cfg, backend="triton",
                                 check_indices=False), [x[0], x[3], x[4]], dO)
            print(f"replay T={T} {name}: selected branch fwd {f:.3f} ms, fwd+bwd {b:.3f} ms", flush=True)
        for name, kw in (("trained, check on", {"block_indices": trained}),
                         ("trained, check off", {"block_indices": trained, "check_indices": False}),
                         ("own top-n", {})):
            f, b = bench(partial(fn.nsa_attention, *x, cfg, backend="triton", **kw), x, dO)
            print(f"replay T={T} layer, {name}: fwd {f:.3f} ms, fwd+bwd {b:.3f} ms", flush=True)


if what == "sel":
    C = lambda T, Dk, B=2: kc.Case(B=B, T=T, H=4, G=16, Dk=Dk, Dv=128, blocks=PAPER, rows=256)
    sel_detail(C(8191, 192), {})
    sel_detail(C(8191, 192), {"selection": {"dq_part": False}})
    sel_detail(C(8191, 128), {"selection": {"dq_part": False}})
    sel_detail(C(40000, 192, 1), {})
    sel_detail(C(131149, 128), {})
    sel_detail(C(131149, 192), {})
    sel_detail(C(131149, 192), {"selection": {"chunk_rows": 1 << 20}})
elif what == "compile":
    case = kc.Case(B=2, T=3001, H=4, G=1, Dk=192, Dv=128, blocks=PAPER, rows=256)
    for i in range(2):
        t = time.time()
        kc.cmp_branch(case, "cuda", BF16, torch.float32, TOL)
        torch.cuda.synchronize()
        print(f"cmp check G1 T3001 call {i}: {time.time() - t:.1f} s", flush=True)
elif what == "varlen":
    from triton.testing import do_bench
    lens = [16384, 8192, 1024, 4096, 2048, 8192, 1024, 4096, 16384, 2048, 1024, 1024]
    cfg = NSAConfig(dim=8192, n_heads=64, n_kv_heads=4, d_k=128, d_v=128)
    N = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(0)
    def mk(lens_):
        Tc = sum(cfg.n_cmp(n) for n in lens_)
        r = lambda *s, std=1.0: (torch.randn(*s, generator=g, device="cuda") * std).to(BF16).requires_grad_()
        return [r(1, N, 64, 128, std=2.0), r(1, Tc, 4, 128, std=2.0), r(1, Tc, 4, 128), r(1, N, 4, 128, std=2.0),
                r(1, N, 4, 128), r(1, N, 4, 128, std=2.0), r(1, N, 4, 128),
                torch.rand(1, N, 64, 3, generator=g, device="cuda").to(BF16).requires_grad_()]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device="cuda", dtype=torch.int32)
    rows = {"one sequence": (mk([N]), None), "packed 12 docs": (mk(lens), cu)}
    dO = torch.randn(1, N, 64, 128, device="cuda", dtype=BF16)
    for name, (x, c) in rows.items():
        def f(x=x, c=c):
            return fn.nsa_attention(*x, cfg, backend="triton", cu_seqlens=c)

        def fb(x=x, f=f):
            torch.autograd.grad(f(), x, dO)

        with torch.no_grad():
            fwd = do_bench(f, warmup=50, rep=300)
        both = do_bench(fb, warmup=50, rep=300)
        print(f"varlen N={N} {name}: fwd {fwd:.3f} ms, fwd+bwd {both:.3f} ms", flush=True)
elif what == "replay":
    replay_diag(sys.argv[2], *([tuple(int(t) for t in sys.argv[3].split(","))] if len(sys.argv) > 3 else []))
