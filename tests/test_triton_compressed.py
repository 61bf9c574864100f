"""The Triton ``cmp`` (compressed attention + Eq. 9/10 scores + top-n) and ``win`` operators against
``nsa.reference``.

Kernels run through Triton's interpreter on CPU tensors at tiny shapes (tiles of 16 rows / 16 keys,
so a few rows and keys cross tile borders). float32: outputs and gradients tight, indices exactly
equal on random inputs and on constructed ties; float16: outputs against the reference on upcast
inputs. Outputs are NaN-poisoned before the kernels write them. bfloat16 runs on a GPU only (the
interpreter's bf16 dot is wrong, so the backend refuses it there: test_triton_refuses_bf16_in_the_interpreter).
"""

from __future__ import annotations

import os

# The interpreter must be chosen before triton is first imported (tests/conftest.py does not set it).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nsa import NSAConfig, reference  # noqa: E402
from nsa.backends.triton import compressed, poisoned_outputs, topn, triton_unsupported, tuning  # noqa: E402
from nsa.backends.triton.compressed import compressed_branch  # noqa: E402
from nsa.backends.triton.window import sliding_window_attention  # noqa: E402

_OLD_INTERPRETER = triton_unsupported()  # from triton.__version__: None on triton >= 3.0
pytestmark = [
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1",
        reason="kernel tests run on CPU tensors under TRITON_INTERPRET=1",
    ),
    pytest.mark.skipif(_OLD_INTERPRETER is not None, reason=_OLD_INTERPRETER or ""),
]


@pytest.fixture(autouse=True)
def _poison():
    # lse_n != block_n and window rows != compressed rows: pass 1 and the window use their own tiles;
    # top-n: 4 to 64 rows per program at these widths
    small = {"compressed": dict(rows=16, block_n=16, warps=4, stages=1, lse_n=32),
             "window": dict(rows=32, block_n=16, warps=4, stages=1),
             "attention_bwd": dict(rows=16, block_n=16, warps=4, stages=1, programs=8, split_max=4),
             "topn": dict(elems=64, warps=2)}
    with poisoned_outputs(), tuning.overrides(small):
        yield


def cfg_of(HQ, H, Dk, Dv, l=8, d=4, l_sel=8, n_sel=4, w=16, n_init=1, n_local=2):  # noqa: E741
    return NSAConfig(
        dim=HQ * Dk,
        n_heads=HQ,
        n_kv_heads=H,
        d_k=Dk,
        d_v=Dv,
        l=l,
        d=d,
        l_sel=l_sel,
        n_sel=n_sel,
        w=w,
        n_init=n_init,
        n_local=n_local,
    )


def rand(*shape, dtype=torch.float32, std=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * std).to(dtype)


def close(a, b, tol):
    a, b = a.double(), b.double()
    assert not torch.isnan(a).any(), "NaN in kernel output (unwritten element?)"
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), f"max abs err {err}"


# (B, Tq, q_start, HQ, H, Dk, Dv, config kwargs); n_sel above n_init + n_local (1 + 2) leaves free
# slots, so the indices depend on the scores
CMP_CASES = [
    (1, 40, 0, 4, 2, 16, 32, {}),  # G=2, Dk != Dv, Tc=9 tokens, 5 blocks
    (1, 20, 0, 16, 1, 16, 16, {}),  # G=16: one query per program
    (2, 6, 0, 2, 2, 16, 16, {}),  # G=1, T < l: no compressed token at all
    (1, 3, 61, 8, 2, 16, 16, {}),  # G=4, decode-like: 3 queries after 61
    (1, 56, 0, 2, 1, 16, 16, dict(l=4, d=2, l_sel=4, n_sel=5)),  # Tc=27: key tiles cross (carry path)
    (1, 48, 0, 2, 1, 16, 16, dict(l=16, d=4, l_sel=8, n_sel=5)),  # l > l_sel: spill over two blocks
    (1, 28, 0, 6, 2, 24, 16, dict(l=8, d=8, l_sel=16, n_sel=3, n_init=0, n_local=1)),  # G=3, l=d, Dk=24
    (1, 64, 0, 6, 2, 16, 16, dict(l=4, d=2, l_sel=4, n_sel=5)),  # G=3 (a padding head row) over unmasked tiles
    # nothing forced: every candidate's score counts, including blocks only the last tile's carry
    # writes (G=16: one position per program, so some programs end exactly on a tile)
    (1, 80, 0, 16, 1, 16, 16, dict(n_init=0, n_local=0)),
]
CMP_IDS = [f"B{c[0]}-T{c[1]}-qs{c[2]}-HQ{c[3]}-H{c[4]}-Dk{c[5]}-Dv{c[6]}-{c[7]}" for c in CMP_CASES]


def cmp_inputs(case, dtype, seed=0):
    B, Tq, qs, HQ, H, Dk, Dv, kw = case
    cfg = cfg_of(HQ, H, Dk, Dv, **kw)
    Tc = cfg.n_cmp(qs + Tq)
    q = rand(B, Tq, HQ, Dk, dtype=dtype, std=2.0, seed=seed)
    k = rand(B, Tc, H, Dk, dtype=dtype, std=2.0, seed=seed + 1)
    v = rand(B, Tc, H, Dv, dtype=dtype, seed=seed + 2)
    return cfg, qs, q, k, v


@pytest.mark.parametrize("case", CMP_CASES, ids=CMP_IDS)
def test_compressed_fp32_forward_indices_and_grads(case):
    cfg, qs, q, k, v = cmp_inputs(case, torch.float32)
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    o, idx = compressed_branch(*xs, cfg, q_start=qs)
    rx = [t.clone().requires_grad_() for t in (q, k, v)]
    ro, ridx = reference.compressed_branch(*rx, cfg, q_start=qs)
    close(o, ro, 1e-5)
    assert idx.dtype == torch.int64 and idx.shape == ridx.shape
    assert torch.equal(idx, ridx)
    do = rand(*o.shape, seed=9)
    g = torch.autograd.grad(o, xs, do, allow_unused=True)
    if k.shape[1] == 0:
        assert torch.equal(o, torch.zeros_like(o))
        close(g[0], torch.zeros_like(q), 0)
        return
    rg = torch.autograd.grad(ro, rx, do)
    for a, b in zip(g, rg):
        close(a, b, 1e-5)


@pytest.mark.parametrize("score_lo", [True, False])
@pytest.mark.parametrize("case", [CMP_CASES[i] for i in (0, 3, 4, 5, 6, 8)], ids=[CMP_IDS[i] for i in (0, 3, 4, 5, 6, 8)])
def test_compressed_fp16_forward(case, score_lo):
    """Half inputs take the tensor-core score path: p as fp16 (score_lo=False) or fp16 plus its fp16
    remainder (score_lo=True, the CUDA default); the mass past a tile's end (the blocks its last keys
    reach: none with l = d, two with l - d > l_sel) in float32."""
    cfg, qs, q, k, v = cmp_inputs(case, torch.float16, seed=3)
    with tuning.overrides({"compressed": {"score_lo": score_lo}}):
        o, idx = compressed_branch(q, k, v, cfg, q_start=qs)
    ro, ridx = reference.compressed_branch(q.float(), k.float(), v.float(), cfg, q_start=qs)
    assert o.dtype == torch.float16
    close(o, ro, 4e-3)
    assert torch.equal(idx, ridx)  # these inputs have no near-ties; fp16 products are exact in fp32


# tol: relative to the largest score. fp32 and the fp16 hi+lo product land within ~7e-7 on these inputs;
# fp16 p alone is off by up to 2^-12 (its rounding) relative to each score.
@pytest.mark.parametrize("dtype,score_lo,tol", [(torch.float32, True, 3e-6), (torch.float16, True, 3e-6),
                                                (torch.float16, False, 3e-4)], ids=["fp32", "fp16-lo", "fp16"])
@pytest.mark.parametrize("case", [CMP_CASES[i] for i in (0, 4, 5, 6, 8)], ids=[CMP_IDS[i] for i in (0, 4, 5, 6, 8)])
def test_block_scores_match_reference(case, dtype, score_lo, tol, monkeypatch):
    """The kernel's Eq. 9/10 block scores themselves (the buffer the top-n reads), every candidate
    block j <= t // l_sel, against ``reference.selection_scores`` in float64 on the same inputs:
    main blocks, the mass carried past each tile's end, the last tile's carry."""
    cfg, qs, q, k, v = cmp_inputs(case, dtype, seed=13)
    got = []
    monkeypatch.setattr(compressed, "topn_launch", lambda sc, *a, **k: got.append(sc.clone()) or topn.topn_launch(sc, *a, **k))
    with tuning.overrides({"compressed": {"score_lo": score_lo}}):
        compressed_branch(q, k, v, cfg, q_start=qs)
    Tq = q.shape[1]
    nb = cfg.n_blocks(qs + Tq)
    _, p = reference.compressed_attention(q.double(), k.double(), v.double(), cfg, q_start=qs)
    ref = reference.selection_scores(p, cfg, nb)
    sc = torch.cat(got, 1).double()
    cand = torch.arange(nb)[None, :] <= ((qs + torch.arange(Tq)) // cfg.l_sel)[:, None]  # [Tq, nb]
    cand = cand[None, :, None, :].expand_as(ref)
    assert sc.shape == ref.shape and not torch.isnan(sc[cand]).any()
    err = (sc - ref).abs()[cand].max().item()
    assert err <= tol * max(1.0, ref.abs().max().item()), err


def test_compressed_fp16_grads():
    cfg, qs, q, k, v = cmp_inputs(CMP_CASES[0], torch.float16, seed=5)
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    o, _ = compressed_branch(*xs, cfg, q_start=qs)
    rx = [t.float().requires_grad_() for t in (q, k, v)]
    ro, _ = reference.compressed_branch(*rx, cfg, q_start=qs)
    do = rand(*o.shape, seed=11)
    for a, b in zip(torch.autograd.grad(o, xs, do.half()), torch.autograd.grad(ro, rx, do)):
        close(a, b, 1e-2)


@pytest.mark.parametrize("kind", ["zero_q", "equal_keys"])
def test_compressed_ties_go_to_lower_index(kind):
    """Uniform compressed probabilities give equal interior block scores: the lower index wins."""
    cfg = cfg_of(4, 2, 16, 16, l=4, d=2, l_sel=4, n_sel=4)
    B, T = 1, 40
    Tc = cfg.n_cmp(T)
    q = rand(B, T, 4, 16, seed=1)
    k = rand(B, Tc, 2, 16, seed=2)
    if kind == "zero_q":
        q = torch.zeros_like(q)
    else:
        k = k[:, :1].expand(B, Tc, 2, 16).contiguous()
    v = rand(B, Tc, 2, 16, seed=3)
    o, idx = compressed_branch(q, k, v, cfg)
    ro, ridx = reference.compressed_branch(q, k, v, cfg)
    close(o, ro, 1e-5)
    assert torch.equal(idx, ridx)
    # with n_init=1, n_local=2, n_sel=4 the one free slot goes to block 1, the lowest tied index
    # (its score equals the later interior blocks'), once at least 5 candidates exist
    t = torch.arange(T)
    many = t // cfg.l_sel >= 4
    assert (idx[0, many, :, 1] == 1).all()


# (n_init, n_local) with n_sel = 5: forced blocks placed directly, then 2, 5, 0 or 2 rounds over the rest
@pytest.mark.parametrize("forcing", [(1, 2), (0, 0), (2, 3), (3, 0)], ids=lambda f: f"init{f[0]}-local{f[1]}")
@pytest.mark.parametrize("nb,c,q_start", [(7, 28, 0), (40, 5, 150), (3, 4, 0), (40, 160, 0), (40, 100, 37)])
def test_topn_kernel_matches_select_blocks(nb, c, q_start, forcing):
    """The top-n launch (position ranges bucketed by candidate count) on scores with many exact ties."""
    cfg = cfg_of(4, 2, 16, 16, l_sel=4, n_sel=5, n_init=forcing[0], n_local=forcing[1])
    g = torch.Generator().manual_seed(nb)
    scores = torch.randint(0, 4, (2, c, 2, nb), generator=g).float() / 4  # many exact ties
    out = torch.full((2, c, 2, cfg.n_sel), -7, dtype=torch.int64)
    topn.topn_launch(scores, out, q_start, nb, cfg)
    assert torch.equal(out, reference.select_blocks(scores, cfg, q_start=q_start))


def test_topn_launch_rejects_too_few_blocks():
    cfg = cfg_of(4, 2, 16, 16, l_sel=4, n_sel=5)
    scores = torch.zeros(1, 30, 2, 7)  # position 29 has 8 candidate blocks
    with pytest.raises(ValueError, match="nb=7"):
        topn.topn_launch(scores, torch.empty(1, 30, 2, 5, dtype=torch.int64), 0, 7, cfg)


def test_compressed_chunked_score_buffer():
    """A score buffer smaller than all queries: several chunks, same result."""
    cfg, qs, q, k, v = cmp_inputs(CMP_CASES[4], torch.float32, seed=7)
    with tuning.overrides({"compressed": {"score_buffer_bytes": 4 * 20 * 16}}):  # 16 rows of 20 blocks
        o, idx = compressed_branch(q, k, v, cfg, q_start=qs)
    ro, ridx = reference.compressed_branch(q, k, v, cfg, q_start=qs)
    close(o, ro, 1e-5)
    assert torch.equal(idx, ridx)


@pytest.mark.parametrize("chunked", [False, True], ids=["one-chunk", "chunked"])
def test_on_scored_runs_once_before_the_last_top_n(monkeypatch, chunked):
    """``on_scored`` (where nsa.functional starts the side stream's window) fires once, after every
    attention/scoring kernel and before the last chunk's top-n; the result is unchanged. The
    reference backend calls it at the end."""
    from nsa import dispatch

    cfg, qs, q, k, v = cmp_inputs(CMP_CASES[4], torch.float32, seed=7)
    log = []
    real_fwd = compressed.fwd_kernel

    class Spy:  # records each launch of the attention/scoring kernel
        def __getitem__(self, grid):
            return lambda *a, **kw: log.append("kernel") or real_fwd[grid](*a, **kw)

    monkeypatch.setattr(compressed, "fwd_kernel", Spy())
    monkeypatch.setattr(compressed, "topn_launch", lambda *a, **k: log.append("topn") or topn.topn_launch(*a, **k))
    # chunked: 16 rows of 20 blocks per chunk, 4 chunks
    with tuning.overrides({"compressed": {"score_buffer_bytes": 4 * 20 * 16 if chunked else 1 << 30}}):
        o, idx = compressed_branch(q, k, v, cfg, q_start=qs, on_scored=lambda: log.append("scored"))
    assert log.count("scored") == 1 and log[-1] == "topn" and log[-2] == "scored"
    assert log.count("kernel") == (4 if chunked else 1) and log.index("scored") > max(
        i for i, e in enumerate(log) if e == "kernel")
    ro, ridx = reference.compressed_branch(q, k, v, cfg, q_start=qs)
    close(o, ro, 1e-5)
    assert torch.equal(idx, ridx)
    calls = []
    dispatch.get("reference").compressed(q, k, v, cfg, scale=cfg.d_k ** -0.5, q_start=qs, n_keys=qs + q.shape[1],
                                         on_scored=lambda: calls.append(1))
    assert calls == [1]


def test_compressed_n_keys_beyond_queries():
    """n_keys > q_start + Tq (the dispatch's S): more selection blocks exist than any query sees."""
    cfg, qs, q, k, v = cmp_inputs(CMP_CASES[3], torch.float32, seed=8)
    o, idx = compressed_branch(q, k, v, cfg, q_start=qs, n_keys=qs + q.shape[1] + 20)
    ro, ridx = reference.compressed_branch(q, k, v, cfg, q_start=qs, n_keys=qs + q.shape[1] + 20)
    close(o, ro, 1e-5)
    assert torch.equal(idx, ridx)


# ---------------------------------------------------------------------------------------------
# sliding window
# ---------------------------------------------------------------------------------------------
# (B, Tq, q_start, S, HQ, H, Dk, Dv, w)
WIN_CASES = [
    (1, 40, 0, None, 4, 2, 16, 32, 16),  # G=2, Dk != Dv, window crosses key tiles
    (1, 20, 0, None, 16, 1, 16, 16, 8),  # G=16
    (2, 12, 0, None, 2, 2, 16, 16, 64),  # G=1, w > T
    (1, 3, 45, None, 8, 2, 16, 16, 16),  # G=4, decode-like
    (1, 2, 30, 40, 4, 1, 24, 16, 5),  # S > q_start + Tq, Dk=24, w not a multiple of tiles
    (1, 33, 0, None, 6, 2, 16, 16, 1),  # G=3, w=1: each query sees itself
    (1, 80, 0, None, 2, 1, 16, 16, 40),  # G=2, w=40: the window spans several key and query tiles
]
WIN_IDS = [f"B{c[0]}-T{c[1]}-qs{c[2]}-S{c[3]}-HQ{c[4]}-H{c[5]}-Dk{c[6]}-Dv{c[7]}-w{c[8]}" for c in WIN_CASES]


def win_inputs(case, dtype, seed=0):
    B, Tq, qs, S, HQ, H, Dk, Dv, w = case
    S = qs + Tq if S is None else S
    cfg = cfg_of(HQ, H, Dk, Dv, w=w)
    q = rand(B, Tq, HQ, Dk, dtype=dtype, std=2.0, seed=seed)
    k = rand(B, S, H, Dk, dtype=dtype, std=2.0, seed=seed + 1)
    v = rand(B, S, H, Dv, dtype=dtype, seed=seed + 2)
    return cfg, qs, q, k, v


@pytest.mark.parametrize("case", WIN_CASES, ids=WIN_IDS)
def test_window_fp32_forward_and_grads(case):
    cfg, qs, q, k, v = win_inputs(case, torch.float32)
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    o = sliding_window_attention(*xs, cfg, q_start=qs)
    rx = [t.clone().requires_grad_() for t in (q, k, v)]
    ro = reference.sliding_window_attention(*rx, cfg, q_start=qs)
    close(o, ro, 1e-5)
    do = rand(*o.shape, seed=9)
    for a, b in zip(torch.autograd.grad(o, xs, do), torch.autograd.grad(ro, rx, do)):
        close(a, b, 1e-5)


@pytest.mark.parametrize("case", [WIN_CASES[i] for i in (0, 3)], ids=[WIN_IDS[i] for i in (0, 3)])
def test_window_fp16(case):
    cfg, qs, q, k, v = win_inputs(case, torch.float16, seed=4)
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    o = sliding_window_attention(*xs, cfg, q_start=qs)
    rx = [t.float().requires_grad_() for t in (q, k, v)]
    ro = reference.sliding_window_attention(*rx, cfg, q_start=qs)
    assert o.dtype == torch.float16
    close(o, ro, 4e-3)
    do = rand(*o.shape, seed=10)
    for a, b in zip(torch.autograd.grad(o, xs, do.half()), torch.autograd.grad(ro, rx, do)):
        close(a, b, 1e-2)


def test_dispatch_runs_triton_cmp_and_win():
    """nsa_attention with cmp/win on triton equals the reference (sel on the reference)."""
    from nsa import dispatch
    from nsa.functional import nsa_attention

    cfg = cfg_of(4, 2, 16, 16, l=4, d=2, l_sel=4, n_sel=3, w=8)
    B, T = 1, 24
    S = T
    x = dict(
        q=rand(B, T, 4, 16, std=2.0, seed=1),
        k_cmp=rand(B, cfg.n_cmp(S), 2, 16, std=2.0, seed=2),
        v_cmp=rand(B, cfg.n_cmp(S), 2, 16, seed=3),
        k_sel=rand(B, S, 2, 16, seed=4),
        v_sel=rand(B, S, 2, 16, seed=5),
        k_win=rand(B, S, 2, 16, seed=6),
        v_win=rand(B, S, 2, 16, seed=7),
        gates=torch.rand(B, T, 4, 3, generator=torch.Generator().manual_seed(8)),
    )
    with dispatch.record() as rec:
        o, idx = nsa_attention(
            **x, config=cfg, backend={"cmp": "triton", "win": "triton"}, return_indices=True
        )
    assert rec.ran == {"cmp": "triton", "sel": "reference", "win": "triton"}
    ro, ridx = nsa_attention(**x, config=cfg, return_indices=True)
    close(o, ro, 1e-5)
    assert torch.equal(idx, ridx)
