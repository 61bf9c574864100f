"""Packed documents (cu_seqlens) on the reference backend: every public function, nsa_attention and the
module against each document run alone (the package's own path on each slice, and tests/oracle.py), forward
and every input gradient, float64 <= 1e-10; the sdpa window (CPU band mask); the rules of cu_seqlens."""
from __future__ import annotations

import oracle
import pytest
import torch
from conftest import (ARG_ORDER, cu_of, doc_lengths, document_slices, make_config, oracle_kwargs, packed_inputs,
                      per_document)

from nsa import NSAAttention, NSAConfig, dispatch
from nsa import functional as fn
from nsa.varlen import Varlen

F64 = torch.float64
TOL = 1e-10

CONFIGS = {
    # G = 2, Dk != Dv, l > d
    "G2": dict(HQ=4, H=2, Dk=8, Dv=6, l=8, d=4, l_sel=8, n_sel=3, w=16, n_init=1, n_local=1),
    # G = 1, l == d, l_sel = 2 l, no forcing
    "G1_l=d": dict(HQ=3, H=3, Dk=4, Dv=6, l=4, d=4, l_sel=8, n_sel=2, w=8, n_init=0, n_local=0),
    # G = 4, l_sel < l: a compressed token spans two selection blocks
    "G4_lsel<l": dict(HQ=8, H=2, Dk=6, Dv=4, l=16, d=4, l_sel=8, n_sel=4, w=12, n_init=1, n_local=2),
    # G = 16
    "G16": dict(HQ=16, H=1, Dk=4, Dv=8, l=8, d=4, l_sel=16, n_sel=2, w=10, n_init=1, n_local=1),
}


def _grads(out, inputs, seed=5):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return torch.autograd.grad(out, inputs, w, allow_unused=True)


def _close(a, b, tol=TOL, what=""):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    assert (a - b).abs().max().item() <= tol, (what, (a - b).abs().max().item())


def _zero_or(g, x):
    return torch.zeros_like(x) if g is None else g


@pytest.mark.parametrize("name", list(CONFIGS))
def test_nsa_attention_equals_each_document_alone(name):
    cfg = make_config(**CONFIGS[name])
    lens = doc_lengths(cfg)
    x = packed_inputs(cfg, lens, requires_grad=True)
    args = [x[a] for a in ARG_ORDER]
    o, idx = fn.nsa_attention(*args, cfg, cu_seqlens=cu_of(lens), return_indices=True)
    ro, ridx = per_document(lambda *a: fn.nsa_attention(*a, cfg, return_indices=True), cfg, lens, x)
    _close(o, ro, what="o")
    assert torch.equal(idx, ridx)
    for n, g, rg, a in zip(ARG_ORDER, _grads(o, args), _grads(ro, args), args):
        _close(_zero_or(g, a), _zero_or(rg, a), what=n)


@pytest.mark.parametrize("name", ["G2", "G4_lsel<l"])
def test_nsa_attention_equals_the_oracle_on_each_document(name):
    cfg = make_config(**CONFIGS[name])
    lens = doc_lengths(cfg)
    x = packed_inputs(cfg, lens, seed=3)
    o, idx = fn.nsa_attention(*(x[a] for a in ARG_ORDER), cfg, cu_seqlens=cu_of(lens), return_indices=True)
    ro, ridx = per_document(lambda *a: oracle.nsa(*a, **oracle_kwargs(cfg)), cfg, lens, x)
    _close(o, ro, what="o")
    assert torch.equal(idx, ridx)


@pytest.mark.parametrize("phi", [None, "mlp"])
def test_compress_each_document_alone(phi):
    cfg = make_config(**CONFIGS["G4_lsel<l"])
    lens = doc_lengths(cfg)
    torch.manual_seed(1)
    f = None if phi is None else NSAAttention(cfg).double().phi_k
    x = torch.randn(1, sum(lens), 2, 6, dtype=F64, requires_grad=True)
    got = fn.compress(x, cfg, f, cu_seqlens=cu_of(lens))
    want = per_document(lambda t: fn.compress(t, cfg, f), cfg, lens, {"x": x}, names=("x",))
    assert got.shape == (1, sum(cfg.n_cmp(n) for n in lens), 2, 6)
    _close(got, want)
    _close(*(torch.autograd.grad(y, x, torch.ones_like(y))[0] for y in (got, want)))


@pytest.mark.parametrize("name", ["G2", "G16"])
def test_every_branch_function_equals_each_document_alone(name):
    """compressed_attention (output and p_cmp, block-diagonal over the packed compressed tokens),
    selection_scores, select_blocks, selected_attention and sliding_window_attention, with gradients."""
    cfg = make_config(**CONFIGS[name])
    lens = doc_lengths(cfg)
    cu = Varlen(cu_of(lens))
    x = packed_inputs(cfg, lens, seed=2, requires_grad=True)
    nb = cfg.n_blocks(max(lens))
    q = x["q"]

    o, p = fn.compressed_attention(q, x["k_cmp"], x["v_cmp"], cfg, cu_seqlens=cu)
    parts = [fn.compressed_attention(q[:, r], x["k_cmp"][:, c], x["v_cmp"][:, c], cfg)
             for r, c in document_slices(cfg, lens)]
    _close(o, torch.cat([a for a, _ in parts], 1), what="o_cmp")
    p_want = torch.zeros_like(p)
    for (r, c), (_, pd) in zip(document_slices(cfg, lens), parts):
        p_want[:, r, :, c] = pd
    _close(p, p_want, what="p_cmp")
    _close(torch.autograd.grad((o * o).sum() + (p * p).sum(), q)[0],
           torch.autograd.grad(sum((a * a).sum() + (b * b).sum() for a, b in parts), q)[0], what="dq_cmp")

    with torch.no_grad():
        scores = fn.selection_scores(p, cfg, nb, cu_seqlens=cu)
        s_want = torch.cat([fn.selection_scores(pd, cfg, nb) for _, pd in parts], 1)
        _close(scores, s_want, what="scores")
        idx = fn.select_blocks(scores, cfg, cu_seqlens=cu)
        assert torch.equal(idx, torch.cat([fn.select_blocks(s_want[:, r], cfg) for r, _ in document_slices(cfg, lens)],
                                          1))

    for name_, call, keys in (
        ("sel", lambda q, k, v, i=None, cu=None, r=slice(None): fn.selected_attention(
            q, k, v, idx[:, r], cfg, cu_seqlens=cu), ("q", "k_sel", "v_sel")),
        ("win", lambda q, k, v, cu=None, r=None: fn.sliding_window_attention(q, k, v, cfg, cu_seqlens=cu),
         ("q", "k_win", "v_win")),
    ):
        ins = [x[k] for k in keys]
        got = call(*ins, cu=cu)
        want = torch.cat([call(*(t[:, r] for t in ins), r=r) for r, _ in document_slices(cfg, lens)], 1)
        _close(got, want, what=name_)
        for n, g, rg in zip(keys, _grads(got, ins), _grads(want, ins)):
            _close(g, rg, what=f"{name_} d{n}")


def test_sdpa_window_on_cpu_equals_each_document_alone():
    cfg = make_config(**CONFIGS["G2"])
    lens = doc_lengths(cfg)
    x = packed_inputs(cfg, lens, seed=4, requires_grad=True)
    ins = [x["q"], x["k_win"], x["v_win"]]
    with dispatch.record() as rec:
        got = fn.sliding_window_attention(*ins, cfg, backend="sdpa", cu_seqlens=cu_of(lens))
    assert rec.ran == {"win": "sdpa"}
    want = per_document(lambda *a: fn.sliding_window_attention(*a, cfg), cfg, lens, x, names=("q", "k_win", "v_win"))
    _close(got, want)
    for g, rg in zip(_grads(got, ins), _grads(want, ins)):
        _close(g, rg)


@pytest.mark.parametrize("phi", ["mlp", "avg"])
def test_module_equals_each_document_alone(phi):
    """RoPE restarts at each document; compression, gates and every branch stay inside it. Gradients of
    the input and of every parameter."""
    cfg = NSAConfig(dim=16, n_heads=4, n_kv_heads=2, d_k=4, d_v=6, l=8, d=4, l_sel=8, n_sel=3, w=6, n_init=1,
                    n_local=1, phi=phi, gate_hidden=8)
    torch.manual_seed(0)
    layer = NSAAttention(cfg).double()
    lens = doc_lengths(cfg)
    x = torch.randn(1, sum(lens), 16, dtype=F64, requires_grad=True)
    docs = Varlen(cu_of(lens))
    y = layer(x, cu_seqlens=docs)
    want = per_document(layer, cfg, lens, {"x": x}, names=("x",))
    _close(y, want)
    params = [x, *layer.parameters()]
    for g, rg in zip(_grads(y, params), _grads(want, params)):
        _close(_zero_or(g, x), _zero_or(rg, x) if g is None else rg)
    assert torch.equal(layer(x, cu_seqlens=cu_of(lens)), y)  # a tensor or a Varlen: the same


# ------------------------------------------------------------------------------------------------
# The rules
# ------------------------------------------------------------------------------------------------
def _small():
    cfg = make_config(**CONFIGS["G2"])
    lens = [3, 9, 0, 20]
    return cfg, lens, packed_inputs(cfg, lens)


@pytest.mark.parametrize("cu,what", [
    (torch.tensor([0, 3, 12, 12, 32]), "int64"),
    (torch.tensor([[0, 3, 12, 12, 32]], dtype=torch.int32), r"shape \(1, 5\)"),
    (torch.tensor([0], dtype=torch.int32), r"shape \(1,\)"),
    (torch.tensor([1, 3, 12, 12, 32], dtype=torch.int32), "first offset is 1"),
    (torch.tensor([0, 3, 12, 11, 32], dtype=torch.int32), r"offset 3 \(11\) is below offset 2 \(12\)"),
    (torch.tensor([0, 3, 12, 12, 31], dtype=torch.int32), "last offset N=31 must be the token count of q"),
    ([0, 3, 12, 12, 32], "got list"),
])
def test_bad_cu_seqlens_is_one_line_naming_it(cu, what):
    cfg, lens, x = _small()
    with pytest.raises(ValueError, match=rf"^cu_seqlens: .*{what}") as e:
        fn.nsa_attention(*(x[a] for a in ARG_ORDER), cfg, cu_seqlens=cu)
    assert "\n" not in str(e.value)


def test_packed_inputs_rules():
    cfg, lens, x = _small()
    cu = cu_of(lens)
    args = [x[a] for a in ARG_ORDER]
    with pytest.raises(ValueError, match=r"^q_start=4: must be 0 with cu_seqlens"):
        fn.nsa_attention(*args, cfg, cu_seqlens=cu, q_start=4)
    two = [torch.cat([a, a]) for a in args]
    with pytest.raises(ValueError, match=r"^q: expected batch 1 with cu_seqlens"):
        fn.nsa_attention(*two, cfg, cu_seqlens=cu)
    k_cmp = fn.compress(x["k_sel"], cfg)  # compressed as one sequence, not per document: 7 tokens, not 5
    with pytest.raises(ValueError, match=r"^k_cmp: expected 5 compressed tokens \(n_cmp of each document"):
        fn.nsa_attention(args[0], k_cmp, k_cmp[..., :6], *args[3:], cfg, cu_seqlens=cu)
    idx = torch.zeros(1, 32, 2, 3, dtype=torch.int64)
    idx[0, 5, 1, 2] = 2  # token 5 is in document 1 (9 tokens: blocks 0 and 1)
    with pytest.raises(ValueError, match=r"^indices: a block index of token 5 is out of range: its document 1 has 9"):
        fn.selected_attention(x["q"], x["k_sel"], x["v_sel"], idx, cfg, cu_seqlens=cu)
    scores = torch.zeros(1, 32, 2, 2, dtype=F64)
    with pytest.raises(ValueError, match=r"^scores: 2 blocks but the longest document of cu_seqlens \(20 tokens\)"):
        fn.select_blocks(scores, cfg, cu_seqlens=cu)
    layer = NSAAttention(make_config(**CONFIGS["G2"])).double()
    with pytest.raises(ValueError, match=r"^cu_seqlens: a packed prefill into a cache takes one document per batch "
                                         r"row: 4 documents for a cache of batch_size=1"):
        layer(torch.zeros(1, 32, layer.config.dim, dtype=F64), layer.new_cache(1, 64), cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"^cu_seqlens: its last offset N=32 must be the token count of x"):
        layer(torch.zeros(1, 31, layer.config.dim, dtype=F64), cu_seqlens=cu)


class _NoVarlen(dispatch.Backend):
    name = "novarlen"

    def varlen_unavailable(self, branch, device, dtype):
        return "this test's backend takes one sequence per batch row"


def test_a_backend_without_varlen_is_refused_naming_branch_and_reason(monkeypatch):
    monkeypatch.setitem(dispatch._REGISTRY, "novarlen", _NoVarlen())
    cfg, lens, x = _small()
    args = [x[a] for a in ARG_ORDER]
    one = [fn.compress(x["k_sel"], cfg), fn.compress(x["v_sel"], cfg)]  # the tokens as one sequence: fine
    fn.nsa_attention(args[0], *one, *args[3:], cfg, backend="novarlen")
    with pytest.raises(dispatch.BackendUnavailable, match=r"'novarlen' cannot run branch 'cmp' on cpu/float64 with "
                                                          r"packed documents \(cu_seqlens\): this test's backend"):
        fn.nsa_attention(*args, cfg, backend="novarlen", cu_seqlens=cu_of(lens))
    with pytest.raises(dispatch.BackendUnavailable, match=r"'novarlen' cannot run branch 'win'"):
        fn.sliding_window_attention(x["q"], x["k_win"], x["v_win"], cfg, backend="novarlen", cu_seqlens=cu_of(lens))


def test_fa2_says_what_varlen_needs(monkeypatch):
    from nsa.backends import fa2

    monkeypatch.setattr(fa2, "_flash_attn_varlen_func", None)
    monkeypatch.setattr(fa2, "_TORCH_VARLEN", None)
    monkeypatch.setattr(fa2, "_NO_TORCH_VARLEN", "torch 9.9 has no torch.nn.attention.varlen.varlen_attn")
    reason = fa2.BACKEND.varlen_unavailable("win", torch.device("cuda"), torch.bfloat16)
    assert reason == ("packed documents need flash-attn's flash_attn_varlen_func, which is not installed, or "
                      "torch 9.9 has no torch.nn.attention.varlen.varlen_attn")
    monkeypatch.setattr(fa2, "_TORCH_VARLEN", lambda *a, **k: None)
    assert fa2.BACKEND.varlen_unavailable("win", torch.device("cuda"), torch.bfloat16) is None


def test_varlen_tables():
    """The documents' derived tables: positions, compressed offsets and the triton tile tables."""
    cfg = make_config(**CONFIGS["G2"])
    docs = Varlen(cu_of([3, 9, 0, 20]))
    assert docs.lens == (3, 9, 0, 20) and docs.total == 32 and docs.max_len == 20 and docs.n_blocks(cfg) == 3
    assert docs.row_pos("cpu").tolist() == [*range(3), *range(9), *range(20)]
    assert docs.cmp_counts(cfg) == (0, 1, 0, 4) and docs.cu_keys("cpu", cfg.d, cfg.l - 1).tolist() == [0, 0, 1, 1, 5]
    # query tiles of 8 positions over rows [5, 30): document 1 from its row 2, document 3 up to its row 18
    assert docs.query_tiles(8, "cpu", 5, 30).tolist() == [[3, 16], [3, 8], [1, 2], [3, 0]]
    # key tiles of 2 compressed tokens, by the queries that see their first key: 13, 5 (20 - 2*4 - 7), 2
    assert docs.key_tiles(2, "cpu", cfg.d, cfg.l - 1).tolist() == [[3, 0], [3, 2], [1, 0]]
    assert docs.kept("x", lambda: [1]) is docs.kept("x", lambda: [2])


@pytest.mark.parametrize("win", ["reference", "sdpa"])
def test_only_empty_documents_give_empty_outputs(win):
    """N = 0 (every document empty): empty outputs and gradients of the inputs' shapes, as for B = 0."""
    cfg = make_config(**CONFIGS["G2"])
    x = packed_inputs(cfg, [0, 0], requires_grad=True)
    args = [x[a] for a in ARG_ORDER]
    o, idx = fn.nsa_attention(*args, cfg, backend={"win": win}, cu_seqlens=cu_of([0, 0]), return_indices=True)
    assert o.shape == (1, 0, 4, 6) and idx.shape == (1, 0, 2, 2)  # no block: n_sel bounded to n_init + n_local
    grads = torch.autograd.grad(o.sum(), args, allow_unused=True)
    assert all(g is None or g.shape == a.shape for g, a in zip(grads, args))
    layer = NSAAttention(cfg).double()
    assert layer(torch.zeros(1, 0, cfg.dim, dtype=F64), cu_seqlens=cu_of([0])).shape == (1, 0, cfg.dim)
