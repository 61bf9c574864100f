"""Every bad input raises a clear error naming what is wrong; dispatch names and records backends."""
from __future__ import annotations

import warnings

import pytest
import torch
from conftest import ARG_ORDER, check_empty_inputs, make_config, random_inputs

from nsa import NSAAttention, NSAConfig, dispatch, reference
from nsa import functional as fn

BASE = dict(dim=16, n_heads=4, n_kv_heads=2, d_k=8, d_v=4, l=8, d=4, l_sel=8, n_sel=3, w=8, n_init=1,
            n_local=1)


def cfg(**kw):
    return NSAConfig(**{**BASE, **kw})


# ------------------------------------------------------------------------------------------------
# NSAConfig
# ------------------------------------------------------------------------------------------------
def test_base_config_is_valid():
    c = cfg()
    assert c.G == 2 and c.n_cmp(7) == 0 and c.n_cmp(8) == 1 and c.n_cmp(15) == 2 and c.n_blocks(17) == 3


@pytest.mark.parametrize("kw,field", [
    (dict(l=12, d=8), "l"),               # d does not divide l
    (dict(l=8, d=4, l_sel=10), "l_sel"),  # d does not divide l_sel
    (dict(n_heads=4, n_kv_heads=3), "n_heads"),
    (dict(n_sel=2, n_init=1, n_local=2), "n_sel"),
    (dict(n_sel=1, n_init=0, n_local=2), "n_sel"),
    (dict(phi="conv"), "phi"),
    (dict(phi="MLP"), "phi"),
    (dict(rope_base=0.0), "rope_base"),
    (dict(rope_base=float("nan")), "rope_base"),
    (dict(rope_base=None), "rope_base"),  # was a TypeError before the fix in nsa/config.py
    (dict(rope_base="1e4"), "rope_base"),
    (dict(rope_base=float("inf")), "rope_base"),  # accepted before: RoPE then rotates nothing
    (dict(n_init=-1), "n_init"),
    (dict(n_local=-1), "n_local"),
    (dict(gate_hidden=-1), "gate_hidden"),
    (dict(phi_hidden=-2), "phi_hidden"),
    (dict(l=8.0), "l"),
    (dict(n_sel=True), "n_sel"),
    (dict(w="8"), "w"),
    (dict(gate_bias=[0.0, 1.0]), "gate_bias"),           # one per branch: three
    (dict(gate_bias=[0.0, "1", 2.0]), "gate_bias"),
    (dict(gate_bias=[0.0, float("nan"), 2.0]), "gate_bias"),
    (dict(gate_bias=2.0), "gate_bias"),
    (dict(shared_kv="yes"), "shared_kv"),
    (dict(qkv_bias=1), "qkv_bias"),
    (dict(o_bias="no"), "o_bias"),
    (dict(phi_init="zeros"), "phi_init"),
    (dict(phi_init="mean", phi_hidden=8), "phi_init"),   # the mean needs 2 * max(d_k, d_v) = 16 hidden units
])
def test_config_rule_raises_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"NSAConfig\.{field}="):
        cfg(**kw)


@pytest.mark.parametrize("field", ["dim", "n_heads", "n_kv_heads", "d_k", "d_v", "l", "d", "l_sel", "n_sel",
                                   "w"])
@pytest.mark.parametrize("value", [0, -4])
def test_non_positive_sizes_raise(field, value):
    with pytest.raises(ValueError, match=rf"NSAConfig\.{field}={value}: must be positive"):
        cfg(**{field: value})


def test_config_limits_that_are_allowed():
    # n_sel == n_init + n_local, no forcing at all, l == d, l_sel < l: all legal.
    cfg(n_sel=2, n_init=1, n_local=1)
    cfg(n_init=0, n_local=0, n_sel=1)
    cfg(l=4, d=4, l_sel=4)
    cfg(l=16, d=4, l_sel=4)


def test_module_rejects_odd_d_k_for_rope():
    """One rule (NSAConfig.rope_rule) for the layer, the experiments' config and the training loop's; the
    functional API has no RoPE and takes an odd d_k."""
    assert cfg(d_k=5).rope_rule() == "must be even for RoPE (it rotates pairs of dims)" and cfg().rope_rule() is None
    with pytest.raises(ValueError, match=r"^NSAConfig.d_k=5: must be even for RoPE \(it rotates pairs of dims\)$"):
        NSAAttention(cfg(d_k=5))


# ------------------------------------------------------------------------------------------------
# Functional API
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def inputs():
    c = cfg()
    x = random_inputs(c, 2, 20, seed=0)
    return c, x


def _call(c, x, **over):
    args = {**x, **over}
    return fn.nsa_attention(*(args[a] for a in ARG_ORDER), c)


def test_valid_inputs_run(inputs):
    c, x = inputs
    assert _call(c, x).shape == (2, 20, 4, 4)


@pytest.mark.parametrize("name,make,match", [
    ("q", lambda x: x["q"][..., 0], r"q: expected 4 dims"),
    ("q", lambda x: x["q"][:, :, :3], r"q: expected \[B,T,4,8\]"),
    ("q", lambda x: x["q"][..., :6], r"q: expected \[B,T,4,8\]"),
    ("q", lambda x: x["q"].to(torch.int64), r"q: expected a floating dtype"),
    ("k_sel", lambda x: x["k_sel"].float(), r"k_sel: dtype torch.float32 differs from q's torch.float64"),
    ("v_sel", lambda x: x["v_sel"][:, :-1], r"v_sel: length 19 differs from k_sel's 20"),
    ("k_sel", lambda x: x["k_sel"][:1], r"k_sel: expected \[2,S,2,8\]"),
    ("k_sel", lambda x: x["k_sel"][:, :-1], r"v_sel: length 20 differs from k_sel's 19"),
    ("k_sel+v_sel", lambda x: (x["k_sel"][:, :-1], x["v_sel"][:, :-1]),
     r"k_sel: 19 keys but queries reach position 19"),
    ("v_win", lambda x: x["v_win"][..., :3], r"v_win: expected \[2,20,2,4\]"),
    ("k_win+v_win", lambda x: (x["k_win"][:, :-1], x["v_win"][:, :-1]), r"k_win: expected 20 tokens"),
    ("k_win", lambda x: x["k_win"][:, :, :1], r"k_win: expected \[2,20,2,8\]"),
    ("v_win", lambda x: x["v_win"].float(), r"v_win: dtype"),
    ("k_cmp+v_cmp", lambda x: (x["k_cmp"][:, :-1], x["v_cmp"][:, :-1]), r"k_cmp: expected 4 tokens"),
    ("v_cmp", lambda x: x["v_cmp"][..., :2], r"v_cmp: expected"),
    ("k_cmp", lambda x: x["k_cmp"].float(), r"k_cmp: dtype"),
    ("gates", lambda x: x["gates"][..., :2], r"gates: expected shape \[2, 20, 4, 3\]"),
    ("gates", lambda x: x["gates"].float(), r"gates: dtype"),
    ("gates", lambda x: x["gates"][0], r"gates: expected 4 dims"),
    ("k_sel", lambda x: x["k_sel"].to("meta"), r"k_sel: device meta differs from q's cpu"),
    ("gates", lambda x: x["gates"].to("meta"), r"gates: device meta differs"),
    ("v_win", lambda x: x["v_win"].tolist(), r"v_win: expected a torch.Tensor"),
])
def test_nsa_attention_bad_argument_names_it(inputs, name, make, match):
    c, x = inputs
    bad = make(x)
    names = name.split("+")
    over = dict(zip(names, bad if len(names) > 1 else (bad,), strict=True))
    with pytest.raises(ValueError, match=match):
        _call(c, x, **over)


@pytest.mark.parametrize("scale", [float("nan"), -0.5, 0.0, float("inf"), True, "0.1"])
def test_bad_scale_names_it(inputs, scale):
    """Refused: nan and negative scales gave NaN or inverted attention silently."""
    c, x = inputs
    with pytest.raises(ValueError, match=r"scale=.*: must be a positive finite number"):
        fn.nsa_attention(*(x[a] for a in ARG_ORDER), c, scale=scale)
    fn.nsa_attention(*(x[a] for a in ARG_ORDER), c, scale=0.25)  # a positive finite one runs


@pytest.mark.parametrize("q_start", [-1, 1.0, True])
def test_bad_q_start(inputs, q_start):
    c, x = inputs
    with pytest.raises(ValueError, match="q_start"):
        fn.nsa_attention(*(x[a] for a in ARG_ORDER), c, q_start=q_start)


def test_q_start_beyond_the_keys(inputs):
    c, x = inputs
    args = [x[a] for a in ARG_ORDER]
    args[0], args[7] = args[0][:, 15:], args[7][:, 15:]
    with pytest.raises(ValueError, match=r"k_sel: 20 keys but queries reach position 20"):
        fn.nsa_attention(*args, c, q_start=16)
    assert fn.nsa_attention(*args, c, q_start=15).shape == (2, 5, 4, 4)


def test_branch_functions_bad_arguments(inputs):
    c, x = inputs
    q = x["q"]
    with pytest.raises(ValueError, match="x: expected 4 dims"):
        fn.compress(x["k_sel"][0], c)
    with pytest.raises(ValueError, match="k_cmp: dtype"):
        fn.compressed_attention(q, x["k_cmp"].float(), x["v_cmp"], c)
    # was an AttributeError before the fix in nsa/functional.py
    with pytest.raises(ValueError, match="k_cmp: expected a torch.Tensor"):
        fn.compressed_attention(q, x["k_cmp"].tolist(), x["v_cmp"], c)
    with pytest.raises(ValueError, match="k_cmp: expected 4 dims"):
        fn.compressed_attention(q, x["k_cmp"][0], x["v_cmp"], c)
    with pytest.raises(ValueError, match="v_cmp: length"):
        fn.compressed_attention(q, x["k_cmp"], x["v_cmp"][:, :2], c)
    with pytest.raises(ValueError, match="q: expected"):
        fn.compressed_attention(q[..., :4], x["k_cmp"], x["v_cmp"], c)
    with pytest.raises(ValueError, match="p_cmp: expected 4 heads"):
        fn.selection_scores(torch.zeros(2, 20, 3, 4, dtype=torch.float64), c, 3)
    with pytest.raises(ValueError, match="scores: expected 2 groups"):
        fn.select_blocks(torch.zeros(2, 20, 4, 3, dtype=torch.float64), c)
    with pytest.raises(ValueError, match=r"scores: 2 blocks but queries up to position 19 need 3"):
        fn.select_blocks(torch.zeros(2, 20, 2, 2, dtype=torch.float64), c)
    with pytest.raises(ValueError, match="scores: expected a floating dtype"):
        fn.select_blocks(torch.zeros(2, 20, 2, 3, dtype=torch.int64), c)
    idx = torch.zeros(2, 20, 2, 3, dtype=torch.int64)
    fn.selected_attention(q, x["k_sel"], x["v_sel"], idx, c)  # valid
    with pytest.raises(ValueError, match="indices: expected an int32/int64"):
        fn.selected_attention(q, x["k_sel"], x["v_sel"], idx.double(), c)
    fn.selected_attention(q, x["k_sel"], x["v_sel"], idx[..., :2], c)  # fewer columns than n_sel: valid
    for bad in (idx[..., :0], torch.zeros(2, 20, 2, 4, dtype=torch.int64), idx[:, :19]):
        with pytest.raises(ValueError, match=r"indices: expected shape \[2, 20, 2, k\] \[B,Tq,H,k\] with 1 <= k <= "
                                             r"n_sel=3, got"):
            fn.selected_attention(q, x["k_sel"], x["v_sel"], bad, c)
    with pytest.raises(ValueError, match="indices: device"):
        fn.selected_attention(q, x["k_sel"], x["v_sel"], idx.to("meta"), c)
    with pytest.raises(ValueError, match="v_sel: dtype"):
        fn.selected_attention(q, x["k_sel"], x["v_sel"].float(), idx, c)
    with pytest.raises(ValueError, match="k_win: expected"):
        fn.sliding_window_attention(q, x["k_win"][..., :2], x["v_win"], c)
    with pytest.raises(ValueError, match="k_win: 20 keys but queries reach position 21"):
        fn.sliding_window_attention(q, x["k_win"], x["v_win"], c, q_start=2)


@pytest.mark.parametrize("bad,match", [
    (1000, r"indices: block index 1000 out of range; valid block indices are 0\.\.2 \(ceil\(S / l_sel\) = 3 "
           r"blocks of S=20 keys\), and -1 for none"),
    (3, r"indices: block index 3 out of range"),  # one past the last block
    (-5, r"indices: block index -5 out of range; valid block indices are 0\.\.2"),
    (-2, r"indices: block index -2 out of range"),
])
def test_selected_attention_rejects_out_of_range_indices(inputs, bad, match):
    """Out-of-range block indices used to give NaN or garbage silently; -1 (none) and 0..nb-1 are valid."""
    c, x = inputs
    idx = torch.full((2, 20, 2, 3), -1, dtype=torch.int64)
    idx[..., 0] = 0
    idx[1, 19, 1, 1] = 2
    assert torch.isfinite(fn.selected_attention(x["q"], x["k_sel"], x["v_sel"], idx, c)).all()
    idx[1, 7, 0, 2] = bad
    with pytest.raises(ValueError, match=match):
        fn.selected_attention(x["q"], x["k_sel"], x["v_sel"], idx, c)


def test_indices_checked_once_then_passed_unchecked(inputs, monkeypatch):
    """check_block_indices is the per-call range check, once; check_indices=False skips it (its reduction and,
    on a GPU, the host sync that cost a benchmark's layer 1.1 ms a call at 8k) and changes nothing else."""
    c, x = inputs
    idx = torch.full((2, 20, 2, 3), -1, dtype=torch.int64)
    idx[..., 0] = 0
    idx[1, 19, 1, 1] = 2
    fn.check_block_indices(idx, c, 20)
    bad = idx.clone()
    bad[1, 7, 0, 2] = 3
    with pytest.raises(ValueError, match=r"^prefill\.indices: block index 3 out of range; valid block indices are 0\.\.2"):
        fn.check_block_indices(bad, c, 20, name="prefill.indices")
    args = [x[k] for k in ("q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win", "gates")]
    checked = fn.nsa_attention(*args, c, block_indices=idx)
    sel_checked = fn.selected_attention(x["q"], x["k_sel"], x["v_sel"], idx, c)
    calls = []
    aminmax = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda *a, **k: calls.append(1) or aminmax(*a, **k))
    assert torch.equal(fn.nsa_attention(*args, c, block_indices=idx, check_indices=False), checked)
    assert torch.equal(fn.selected_attention(x["q"], x["k_sel"], x["v_sel"], idx, c, check_indices=False), sel_checked)
    assert calls == []
    fn.nsa_attention(*args, c, block_indices=idx)
    assert calls == [1]  # the default checks, with the reduction counted above


@pytest.mark.parametrize("B,T", [(0, 20), (2, 0), (0, 0)], ids=["B0", "T0", "B0-T0"])
@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_empty_inputs_give_empty_outputs(B, T, backend):
    """B = 0 or T = 0 used to raise IndexError, a reshape error or ZeroDivisionError. ``sdpa`` (its
    CPU path) runs the window branch, the reference the others."""
    check_empty_inputs("reference", B, T, win=backend)


def test_module_bad_inputs():
    c = cfg()
    layer = NSAAttention(c).double()
    with pytest.raises(ValueError, match=r"x: expected \[B,T,16\]"):
        layer(torch.zeros(1, 5, 15, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x: expected \[B,T,16\]"):
        layer(torch.zeros(5, 16, dtype=torch.float64))
    cache = layer.new_cache(2, 10)
    with pytest.raises(ValueError, match="x: batch 1 differs from the cache's batch_size 2"):
        layer(torch.zeros(1, 3, 16, dtype=torch.float64), cache)
    assert cache.length == 0
    with pytest.raises(ValueError, match="cache: device/dtype"):
        layer(torch.zeros(2, 3, 16, dtype=torch.float64), layer.new_cache(2, 10, dtype=torch.float32))
    # a float32 input to a float64 layer: named, not torch's raw matmul error
    with pytest.raises(ValueError, match="x: dtype float32 differs from the layer's float64"):
        layer(torch.zeros(1, 5, 16, dtype=torch.float32))
    with pytest.raises(ValueError, match="batch_size"):
        layer.new_cache(0, 10)
    with pytest.raises(ValueError, match="max_len"):
        layer.new_cache(1, 0)


# ------------------------------------------------------------------------------------------------
# Dispatch
# ------------------------------------------------------------------------------------------------
def test_unknown_backend_name_raises(inputs):
    c, x = inputs
    args = [x[a] for a in ARG_ORDER]
    with pytest.raises(ValueError, match=r"backend\[cmp\]='nope': unknown backend"):
        fn.nsa_attention(*args, c, backend="nope")
    with pytest.raises(ValueError, match=r"backend\[sel\]='nope': unknown backend"):
        fn.nsa_attention(*args, c, backend={"sel": "nope"})
    with pytest.raises(ValueError, match=r"backend: unknown branch \['attn'\]"):
        fn.nsa_attention(*args, c, backend={"attn": "reference"})
    with pytest.raises(ValueError, match="backend='nope': unknown backend"):
        fn.sliding_window_attention(x["q"], x["k_win"], x["v_win"], c, backend="nope")
    with pytest.raises(ValueError, match="backend='nope': unknown backend"):
        dispatch.get("nope")
    with pytest.raises(ValueError, match="unknown backend"):
        NSAAttention(make_config(HQ=2, H=1, Dk=4, Dv=4, l=4, d=2, l_sel=4, n_sel=3, w=3),
                     backend="nope").double()(torch.zeros(1, 4, 8, dtype=torch.float64))


def test_record_names_the_backend_of_each_branch(inputs):
    c, x = inputs
    args = [x[a] for a in ARG_ORDER]
    fn.nsa_attention(*args, c)  # outside a record: nothing to see, and no error
    with dispatch.record() as rec:
        assert rec.ran == {} and rec.calls == 0
        fn.nsa_attention(*args, c)
        fn.nsa_attention(*args, c)
    assert rec.ran == {"cmp": "reference", "sel": "reference", "win": "reference"}
    assert rec.calls == 2 and rec.fallbacks == []
    fn.nsa_attention(*args, c)
    assert rec.calls == 2  # the record closed with its block


class _Spy(dispatch.Backend):
    """The reference operators under another name, counting calls per branch."""

    def __init__(self, name, reason=None):
        self.name, self.reason, self.calls = name, reason, []

    def unavailable(self, branch, device, dtype):
        return self.reason

    def compressed(self, *a, **k):
        self.calls.append("cmp")
        return super().compressed(*a, **k)

    def selected(self, *a, **k):
        self.calls.append("sel")
        return super().selected(*a, **k)

    def window(self, *a, **k):
        self.calls.append("win")
        return super().window(*a, **k)


@pytest.fixture
def spies(monkeypatch):
    ok, broken = _Spy("spy_ok"), _Spy("spy_broken", reason="needs a device this test lacks")
    monkeypatch.setitem(dispatch._REGISTRY, ok.name, ok)
    monkeypatch.setitem(dispatch._REGISTRY, broken.name, broken)
    monkeypatch.setattr(dispatch, "_WARNED", set())
    return ok, broken


def test_record_shows_a_per_branch_backend_that_really_ran(inputs, spies):
    c, x = inputs
    ok, _ = spies
    args = [x[a] for a in ARG_ORDER]
    want = fn.nsa_attention(*args, c)
    with dispatch.record() as rec:
        got = fn.nsa_attention(*args, c, backend={"sel": "spy_ok"})
    assert rec.ran == {"cmp": "reference", "sel": "spy_ok", "win": "reference"}
    assert ok.calls == ["sel"]
    assert torch.equal(got, want)
    layer = NSAAttention(make_config(HQ=4, H=2, Dk=4, Dv=4, l=4, d=2, l_sel=4, n_sel=3, w=3),
                         backend="spy_ok").double()
    with dispatch.record() as rec:
        layer(torch.randn(1, 9, 16, dtype=torch.float64))
    assert rec.ran == {"cmp": "spy_ok", "sel": "spy_ok", "win": "spy_ok"} and rec.calls == 1
    assert ok.calls == ["sel", "cmp", "sel", "win"]


def test_unavailable_backend_raises_unless_a_fallback_is_named(inputs, spies):
    c, x = inputs
    _, broken = spies
    args = [x[a] for a in ARG_ORDER]
    match = r"'spy_broken' cannot run branch 'win'.*needs a device"
    with pytest.raises(dispatch.BackendUnavailable, match=match):
        fn.nsa_attention(*args, c, backend={"win": "spy_broken"})
    want = fn.nsa_attention(*args, c)
    with dispatch.record() as rec, pytest.warns(RuntimeWarning, match="win: spy_broken -> reference"):
        got = fn.nsa_attention(*args, c, backend={"win": "spy_broken"}, fallback="reference")
    assert broken.calls == []
    assert rec.ran == {"cmp": "reference", "sel": "reference", "win": "reference"}
    assert rec.fallbacks == ["win: spy_broken -> reference (needs a device this test lacks)"]
    assert torch.equal(got, want)
    # The warning is given once; the record still lists the fallback on every run.
    with dispatch.record() as rec, warnings.catch_warnings():
        warnings.simplefilter("error")
        fn.nsa_attention(*args, c, backend={"win": "spy_broken"}, fallback="reference")
    assert rec.fallbacks == ["win: spy_broken -> reference (needs a device this test lacks)"]


def test_reference_backend_is_the_reference_module():
    be = dispatch.get("reference")
    assert be.name == "reference" and be.unavailable("sel", torch.device("cpu"), torch.float64) is None
    assert "reference" in dispatch.known_backends()
    assert reference.selected_attention is not None
