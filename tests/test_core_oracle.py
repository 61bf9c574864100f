"""nsa.functional against the independent per-token oracle (tests/oracle.py), float64, <= 1e-10."""
from __future__ import annotations

import oracle
import pytest
import torch
from conftest import ARG_ORDER, make_config, oracle_kwargs, random_inputs

from nsa import functional as fn
from nsa import reference

TOL = 1e-10

# Each row: shape and sparsity; the id says what it covers.
CONFIGS = {
    # T < l: no compressed token at all, one selection block.
    "T<l": dict(B=1, T=12, HQ=2, H=1, Dk=8, Dv=8, l=16, d=8, l_sel=16, n_sel=2, w=8, n_init=1, n_local=1),
    # T crosses n_sel*l_sel = 32 and w = 32; Dk != Dv; B > 1; l > d; l_sel == l.
    "cross_nsel_w": dict(B=2, T=100, HQ=4, H=2, Dk=8, Dv=6, l=8, d=4, l_sel=8, n_sel=4, w=32,
                         n_init=1, n_local=2),
    # G = 16, l == d, l_sel > l, no forcing at all.
    "G16_l=d_noforce": dict(B=1, T=64, HQ=16, H=1, Dk=4, Dv=4, l=8, d=8, l_sel=16, n_sel=2, w=16,
                            n_init=0, n_local=0),
    # G = 4, l_sel == l, only local forcing.
    "G4_local_only": dict(B=2, T=120, HQ=8, H=2, Dk=6, Dv=4, l=16, d=4, l_sel=16, n_sel=3, w=20,
                          n_init=0, n_local=2),
    # G = 1, l_sel = 3 l, only initial forcing (2 blocks).
    "G1_init_only": dict(B=1, T=90, HQ=3, H=3, Dk=4, Dv=6, l=8, d=4, l_sel=24, n_sel=3, w=10,
                         n_init=2, n_local=0),
    # l_sel < l, w = 1 (window is the token itself).
    "lsel<l_w1": dict(B=1, T=80, HQ=4, H=2, Dk=8, Dv=4, l=16, d=4, l_sel=8, n_sel=5, w=1,
                      n_init=1, n_local=1),
    # n_sel = 1: only the newest block (forced local), Dk > Dv.
    "nsel1": dict(B=2, T=70, HQ=4, H=2, Dk=8, Dv=2, l=8, d=4, l_sel=8, n_sel=1, w=7, n_init=0, n_local=1),
    # Paper-like proportions at small scale; T = 200 not a multiple of anything; w >= T.
    "paperlike_T200": dict(B=1, T=200, HQ=4, H=2, Dk=8, Dv=8, l=32, d=16, l_sel=32, n_sel=4, w=256,
                           n_init=1, n_local=2),
}


def _case(name):
    spec = CONFIGS[name]
    cfg = make_config(**spec)
    return cfg, spec["B"], spec["T"]


_ORACLE_CACHE: dict = {}


_RULE = reference._masked_cheaper  # the rule, before conftest's attend_path forces either path
pytestmark = pytest.mark.usefixtures("attend_path")


def test_masked_path_is_taken_where_it_is_smaller():
    """The rule: the CPU smoke presets' shapes (4 query heads on 2, S = 256, lists of n_sel * l_sel = 128
    keys and a window of 32, dims 16) take the masked form; a 32k sequence with 16 query heads on one of
    dim 64 and a 1024-key list does not."""
    assert _RULE(4, 2, 256, 128, 16, 16) and _RULE(4, 2, 256, 32, 16, 16)
    assert not _RULE(16, 1, 32768, 1024, 64, 64)


def test_masked_and_gathered_paths_agree_with_gradients(monkeypatch):
    """The two paths give the same outputs and gradients (float64, 1e-12), with -1 padded lists and a
    q_start past 0."""
    cfg, x, _, idx, _ = _oracle_run("cross_nsel_w")
    idx = idx.clone()
    idx[..., -1] = -1  # a padded last entry in every list
    outs = {}
    for path in ("gather", "masked"):
        monkeypatch.setattr(reference, "_masked_cheaper", lambda *a, p=path: p == "masked")
        xs = {k: v.detach().clone().requires_grad_(True) for k, v in x.items()}
        q = xs["q"][:, 40:]
        o_sel = fn.selected_attention(q, xs["k_sel"], xs["v_sel"], idx[:, 40:], cfg, q_start=40)
        o_win = fn.sliding_window_attention(q, xs["k_win"], xs["v_win"], cfg, q_start=40)
        grads = torch.autograd.grad((o_sel.square().sum() + o_win.sin().sum()),
                                    [xs[a] for a in ("q", "k_sel", "v_sel", "k_win", "v_win")])
        outs[path] = (o_sel, o_win, *grads)
    for a, b in zip(outs["gather"], outs["masked"], strict=True):
        assert (a - b).abs().max().item() <= 1e-12


def _oracle_run(name, seed=0):
    """Inputs and the oracle's output for a named config (computed once per session)."""
    key = (name, seed)
    if key not in _ORACLE_CACHE:
        cfg, B, T = _case(name)
        x = random_inputs(cfg, B, T, seed=seed)
        _ORACLE_CACHE[key] = (cfg, x, *oracle.nsa(*(x[a] for a in ARG_ORDER), **oracle_kwargs(cfg),
                                                  return_parts=True))
    return _ORACLE_CACHE[key]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_nsa_attention_matches_oracle(name):
    cfg, x, o_ref, idx_ref, _ = _oracle_run(name)
    o, idx = fn.nsa_attention(*(x[a] for a in ARG_ORDER), cfg, return_indices=True)
    assert o.dtype == torch.float64 and o.shape == o_ref.shape
    assert idx.shape == idx_ref.shape
    assert torch.equal(idx.to(torch.int64), idx_ref)
    assert (o - o_ref).abs().max().item() <= TOL


def test_oracle_configs_exercise_the_selection():
    """The table above really covers a top-n choice: the last query has more candidates than n_sel and
    fills its free slot by score, and that choice differs between queries and heads."""
    cfg, _, _, idx, _ = _oracle_run("cross_nsel_w")
    T = idx.shape[1]
    assert T > cfg.n_sel * cfg.l_sel and T > cfg.w
    last = idx[0, -1, 0]
    newest = (T - 1) // cfg.l_sel
    chosen_by_score = [j for j in last.tolist() if j >= cfg.n_init and j <= newest - cfg.n_local]
    assert len(chosen_by_score) == cfg.n_sel - cfg.n_init - cfg.n_local
    # The score-chosen block differs between queries/heads: selection depends on the data.
    flat = idx[:, -cfg.l_sel:].reshape(-1, cfg.n_sel)
    assert len({tuple(r) for r in flat.tolist()}) > 1


@pytest.mark.parametrize("name", ["T<l", "cross_nsel_w", "G16_l=d_noforce", "lsel<l_w1"])
def test_compress_mean_pooling(name):
    cfg, B, T = _case(name)
    x = torch.randn(B, T, cfg.n_kv_heads, cfg.d_k, dtype=torch.float64)
    got = fn.compress(x, cfg)
    want = oracle.mean_compress(x, cfg.l, cfg.d)
    assert got.shape == want.shape == (B, cfg.n_cmp(T), cfg.n_kv_heads, cfg.d_k)
    if want.numel():
        assert (got - want).abs().max().item() <= TOL


def test_compress_with_phi_sees_exactly_each_block():
    cfg = make_config(HQ=2, H=1, Dk=4, Dv=4, l=8, d=4, l_sel=8, n_sel=3, w=4)
    x = torch.randn(2, 30, 1, 4, dtype=torch.float64)
    seen = []

    def phi(blocks):  # [B,Tc,H,l,D] -> [B,Tc,H,D]: the first row of each block
        seen.append(blocks.shape)
        return blocks[..., 0, :]

    out = fn.compress(x, cfg, phi)
    Tc = (30 - 8) // 4 + 1
    assert seen == [torch.Size([2, Tc, 1, 8, 4])]
    assert torch.equal(out, x[:, 0: (Tc - 1) * 4 + 1: 4])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_branch_functions_match_oracle_pieces(name):
    cfg, x, _, idx_ref, parts = _oracle_run(name)
    T = x["q"].shape[1]
    nb = cfg.n_blocks(T)

    o_cmp, p_cmp = fn.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], cfg)
    o_cmp_ref, p_cmp_ref = parts["o_cmp"], parts["p_cmp"]
    assert p_cmp.shape == p_cmp_ref.shape
    assert (o_cmp - o_cmp_ref).abs().max().item() <= TOL
    if p_cmp.numel():
        assert (p_cmp - p_cmp_ref).abs().max().item() <= TOL

    scores = fn.selection_scores(p_cmp, cfg, nb)
    scores_ref = parts["scores"]
    assert scores.shape == scores_ref.shape
    assert (scores - scores_ref).abs().max().item() <= TOL

    idx = fn.select_blocks(scores, cfg)
    assert torch.equal(idx.to(torch.int64), idx_ref)
    idx_oracle = oracle.select_blocks(scores_ref, cfg.l_sel, cfg.n_sel, cfg.n_init, cfg.n_local)
    assert torch.equal(idx_oracle, idx_ref)

    o_sel = fn.selected_attention(x["q"], x["k_sel"], x["v_sel"], idx_ref, cfg)
    o_sel_ref = parts["o_sel"]
    assert (o_sel - o_sel_ref).abs().max().item() <= TOL

    o_win = fn.sliding_window_attention(x["q"], x["k_win"], x["v_win"], cfg)
    o_win_ref = parts["o_win"]
    assert (o_win - o_win_ref).abs().max().item() <= TOL


@pytest.mark.parametrize("name", ["cross_nsel_w", "G4_local_only", "G1_init_only", "lsel<l_w1",
                                  "paperlike_T200"])
def test_eq9_overlap_form_equals_double_sum(name):
    """The spec's two statements of Eq. 9 agree, on the oracle's own probabilities."""
    cfg, x, _, _, parts = _oracle_run(name)
    p = parts["p_cmp"]
    nb = cfg.n_blocks(x["q"].shape[1])
    rows = p.reshape(-1, p.shape[-1])[::7]
    for row in rows:
        a = oracle.block_scores_overlap(row, nb, cfg.l, cfg.d, cfg.l_sel)
        b = oracle.block_scores_double_sum(row, nb, cfg.l, cfg.d, cfg.l_sel)
        assert max(abs(u - v) for u, v in zip(a, b, strict=True)) <= 1e-12
    # A p_cmp row with a single one picks out the overlap of that compressed token with each block.
    for i in range(p.shape[-1]):
        one = torch.zeros(p.shape[-1], dtype=torch.float64)
        one[i] = 1.0
        a = oracle.block_scores_double_sum(one, nb, cfg.l, cfg.d, cfg.l_sel)
        assert a == [oracle.overlap_weight(i, j, cfg.l, cfg.d, cfg.l_sel) for j in range(nb)]
        assert sum(a) == cfg.l // cfg.d  # every compressed token's l raw tokens lie in some block


def test_selection_scores_sum_to_group_size_times_l_over_d():
    """Each head's p_cmp sums to 1 (when any token is visible), and each compressed token spreads l/d
    over the blocks, so a group's scores sum to G * l / d."""
    cfg, x, _, _, _ = _oracle_run("G4_local_only")
    _, p = fn.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], cfg)
    T = x["q"].shape[1]
    s = fn.selection_scores(p, cfg, cfg.n_blocks(T)).sum(-1)
    t = torch.arange(T)
    has = (t >= cfg.l - 1)[None, :, None].expand_as(s)
    assert torch.allclose(s[has], torch.full_like(s[has], cfg.G * cfg.l / cfg.d), atol=1e-12, rtol=0)
    assert torch.all(s[~has] == 0)


@pytest.mark.parametrize("name,q_start", [("cross_nsel_w", 57), ("G4_local_only", 1), ("lsel<l_w1", 79),
                                          ("paperlike_T200", 130)])
def test_q_start_equals_rows_of_full_prefill(name, q_start):
    """Queries at the end of a longer key sequence give the prefill rows at those positions."""
    cfg, x, o_ref, idx_ref, _ = _oracle_run(name)
    args = [x[a] for a in ARG_ORDER]
    args[0] = x["q"][:, q_start:]
    args[7] = x["gates"][:, q_start:]
    o, idx = fn.nsa_attention(*args, cfg, return_indices=True, q_start=q_start)
    assert torch.equal(idx.to(torch.int64), idx_ref[:, q_start:])
    assert (o - o_ref[:, q_start:]).abs().max().item() <= TOL


def test_oracle_q_start_path_equals_its_prefill_rows():
    cfg, x, o_ref, idx_ref, _ = _oracle_run("nsel1")
    q_start = 45
    args = [x[a] for a in ARG_ORDER]
    args[0], args[7] = x["q"][:, q_start:], x["gates"][:, q_start:]
    o2, idx2 = oracle.nsa(*args, **oracle_kwargs(cfg), q_start=q_start)
    assert torch.equal(idx2, idx_ref[:, q_start:])
    assert (o2 - o_ref[:, q_start:]).abs().max().item() <= 1e-12


def test_q_start_with_keys_beyond_the_queries_are_ignored():
    """Extra keys after the last query (S > q_start + Tq) must not leak into any branch."""
    cfg, x, o_ref, idx_ref, _ = _oracle_run("cross_nsel_w")
    T = x["q"].shape[1]
    q_start, Tq = 40, 20
    S = q_start + Tq
    args = [x["q"][:, q_start:S], x["k_cmp"], x["v_cmp"], x["k_sel"], x["v_sel"], x["k_win"], x["v_win"],
            x["gates"][:, q_start:S]]
    assert T > S
    o, idx = fn.nsa_attention(*args, cfg, return_indices=True, q_start=q_start)
    assert torch.equal(idx.to(torch.int64)[..., : cfg.n_sel], idx_ref[:, q_start:S])
    assert (o - o_ref[:, q_start:S]).abs().max().item() <= TOL


@pytest.mark.parametrize("scale", [0.3, 1.7])
def test_explicit_scale(scale):
    cfg, x, _, _, _ = _oracle_run("lsel<l_w1")
    x = {k: v[:, :40] if k in ("q", "gates", "k_sel", "v_sel", "k_win", "v_win") else v for k, v in x.items()}
    x["k_cmp"], x["v_cmp"] = x["k_cmp"][:, : cfg.n_cmp(40)], x["v_cmp"][:, : cfg.n_cmp(40)]
    o, idx = fn.nsa_attention(*(x[a] for a in ARG_ORDER), cfg, scale=scale, return_indices=True)
    o_ref, idx_ref = oracle.nsa(*(x[a] for a in ARG_ORDER), **{**oracle_kwargs(cfg), "scale": scale})
    assert torch.equal(idx, idx_ref)
    assert (o - o_ref).abs().max().item() <= TOL
    o_default = fn.nsa_attention(*(x[a] for a in ARG_ORDER), cfg)
    assert (o - o_default).abs().max().item() > 1e-3  # the scale matters


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_branches_follow_the_oracle(dtype):
    """Half/single inputs compute in float32 and return their own dtype; given fixed indices (so no top-n
    flip can occur), the selected and window branches match the oracle run on the same rounded inputs."""
    cfg, x, _, idx_ref, _ = _oracle_run("cross_nsel_w")
    lo = {k: v.to(dtype) for k, v in x.items()}
    sc = oracle_kwargs(cfg)["scale"]
    # Outputs reach |o| ~ 3.4: half an output ulp there is 7.8e-3 (bf16) and 9.8e-4 (fp16); fp32 rounding
    # over the float32 computation stays near 1e-6.
    tol = {torch.bfloat16: 1e-2, torch.float16: 1.5e-3, torch.float32: 5e-6}[dtype]
    o_sel = fn.selected_attention(lo["q"], lo["k_sel"], lo["v_sel"], idx_ref, cfg)
    o_win = fn.sliding_window_attention(lo["q"], lo["k_win"], lo["v_win"], cfg)
    assert o_sel.dtype == o_win.dtype == dtype
    want_sel = oracle.selected_attention(lo["q"], lo["k_sel"], lo["v_sel"], idx_ref, cfg.l_sel, sc)
    want_win = oracle.sliding_window_attention(lo["q"], lo["k_win"], lo["v_win"], cfg.w, sc)
    assert (o_sel.double() - want_sel).abs().max().item() <= tol
    assert (o_win.double() - want_win).abs().max().item() <= tol


@pytest.mark.parametrize("chunk_bytes", [40000, 100000])
def test_query_chunking_changes_nothing(monkeypatch, chunk_bytes):
    """At long T the reference splits queries into chunks (recomputed in backward). Force that path at a
    small T: uneven chunks (3 to 52 queries, by branch) give the oracle's output and unchunked gradients."""
    import nsa.reference

    cfg, x, o_ref, idx_ref, _ = _oracle_run("cross_nsel_w")
    xs = {k: v.detach().clone().requires_grad_(True) for k, v in x.items()}
    o_full = fn.nsa_attention(*(xs[a] for a in ARG_ORDER), cfg)
    g_full = torch.autograd.grad(o_full.square().sum(), [xs[a] for a in ARG_ORDER])

    monkeypatch.setattr(nsa.reference, "CHUNK_BYTES", chunk_bytes)
    spans = []
    real = nsa.reference._chunks
    monkeypatch.setattr(nsa.reference, "_chunks", lambda *a: spans.append(real(*a)) or spans[-1])
    o, idx = fn.nsa_attention(*(xs[a] for a in ARG_ORDER), cfg, return_indices=True)
    assert torch.equal(idx, idx_ref)
    assert (o - o_ref).abs().max().item() <= TOL
    assert len(spans) == 3 and all(len(sp) > 1 for sp in spans)  # every branch really ran in chunks
    g = torch.autograd.grad(o.square().sum(), [xs[a] for a in ARG_ORDER])
    for name, a, b in zip(ARG_ORDER, g, g_full, strict=True):
        assert (a - b).abs().max().item() <= 1e-12, name
