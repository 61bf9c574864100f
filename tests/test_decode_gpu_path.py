"""The GPU decode path (nsa.decode.GraphDecoder, kernels in nsa/backends/triton/decode_attention.py) against
the reference decode (the module's own cached forward) and one prefill.

Runs the Triton kernels through the interpreter on CPU tensors, float32, tiny shapes: eager steps
(CUDA graphs are GPU-only; experiments.decode runs the captured graphs in bf16 on a GPU).
Covers B=1 from an empty cache (no compressed token visible, fewer candidates than n_sel, the first
emissions) and B=3 after a prefill (more candidates than n_sel, emissions at t = i*d + l - 1),
G in {2, 4}, Dk != Dv, split-KV partials (several splits per branch), forced-branch outputs, and
the kernels' token counters against an independent count. The kernel output workspace is poisoned
with NaN before each step so an unwritten element fails.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

import pytest
import torch

pytest.importorskip("triton")

from nsa import NSAAttention, NSAConfig, dispatch, reference
from nsa.backends.triton import poisoned_outputs, triton_unsupported, tuning
from nsa.decode import GraphDecoder, tokens_read

_OLD_INTERPRETER = triton_unsupported()  # from triton.__version__: None on triton >= 3.0
pytestmark = [pytest.mark.skipif(_OLD_INTERPRETER is not None, reason=_OLD_INTERPRETER or ""),
              pytest.mark.usefixtures("fast_interpreter")]

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _cfg(HQ, H, Dk, Dv, **kw):
    base = {"l": 8, "d": 4, "l_sel": 8, "n_sel": 3, "w": 12, "n_init": 1, "n_local": 1}
    base.update(kw)
    return NSAConfig(dim=24, n_heads=HQ, n_kv_heads=H, d_k=Dk, d_v=Dv, **base)


def _reference_branches(cfg, cache, q, t):
    """Reference o_cmp / indices / o_sel / o_win for the query q [B,HQ,Dk] at position t."""
    S = t + 1
    nc = cfg.n_cmp(S)
    qq = q[:, None]
    o_c, idx = reference.compressed_branch(qq, cache.k_cmp[:, :nc], cache.v_cmp[:, :nc], cfg, q_start=t, n_keys=S)
    o_s = reference.selected_attention(qq, cache.k_sel[:, :S], cache.v_sel[:, :S], idx, cfg, q_start=t)
    o_w = reference.sliding_window_attention(qq, cache.k_win[:, :S], cache.v_win[:, :S], cfg, q_start=t)
    return {"cmp": o_c[:, 0], "sel": o_s[:, 0], "win": o_w[:, 0]}, idx


# (B, HQ, H, Dk, Dv, prefill, steps, config overrides, tuning)
CASES = [
    (1, 4, 2, 16, 8, 0, 20, {"l_sel": 4}, {"block_c": 4, "nsc": 2, "mode": "four", "topn": "argmax"}),
    (3, 4, 1, 16, 16, 22, 11, {"n_sel": 4, "n_local": 2, "phi": "avg", "gate_hidden": 0},
     {"block_c": 4, "nsc": 2, "mode": "four", "topn": "argmax"}),
]
IDS = ["B1-G2-DkneDv-lsel<l-mlp-from-empty", "B3-G4-avg-after-prefill"]
FOUR = len(CASES)
# projection biases (NSAConfig.qkv_bias, o_bias: a converted Qwen2's or biased Llama's attention)
CASES.append((2, 4, 2, 16, 16, 13, 9, {"qkv_bias": True, "o_bias": True},
              {"block_c": 4, "nsc": 2, "mode": "four", "topn": "argmax"}))
IDS.append("B2-G2-qkv-and-o-biases")
CASES.append(CASES[-1][:-1] + ({**CASES[-1][-1], "prologue": "torch"},))
IDS.append("B2-G2-qkv-and-o-biases-torch-prologue")
# tuning.decode.mode: two (the top-n and the combine run in the last program of their pass); three (the
# window beside the compressed pass, the top-n in every selected-branch program; sel_per=2 with n_sel=3:
# one program gets one slot and an empty one; the combine in 4 programs a group, 4 value dims each); topn:
# n_sel argmaxes (the base cases) or tl.topk (n_sel = 3 and 4: k = 4)
for mode, extra in (("two", {}), ("three", {}), ("three", {"sel_per": 2, "win_per": 2, "combine_split": 4}),
                    ("four", {"topn": "bitonic"}), ("three", {"topn": "bitonic"})):
    CASES += [case[:-1] + ({**case[-1], "mode": mode, **extra},) for case in CASES[:FOUR]]
    IDS += [f"{i}-{mode}" + "".join(f"-{k}{v}" for k, v in extra.items()) for i in IDS[:FOUR]]


# The kernels a launch mode must not need: they raise if launched.
NOT_LAUNCHED = {"four": (), "two": ("dec_cmp_topk", "dec_combine"),
                "three": ("dec_cmp_partial", "dec_cmp_topk", "dec_sv_partial", "dec_combine")}


def _refuse(monkeypatch, mode):
    from nsa.backends.triton import decode_attention as kernels

    class Refused:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            raise AssertionError(f"mode {mode} launched {self.name}")

    for name in NOT_LAUNCHED[mode]:
        monkeypatch.setattr(kernels, name, Refused(name))


@pytest.mark.parametrize("B,HQ,H,Dk,Dv,P,steps,over,over_tuning", CASES, ids=IDS)
def test_decode_equals_reference_decode_and_prefill(B, HQ, H, Dk, Dv, P, steps, over, over_tuning, monkeypatch):
    import triton

    if over_tuning.get("topn") == "bitonic" and not hasattr(triton.language, "topk"):
        pytest.skip(f"tuning.decode.topn=bitonic needs tl.topk (triton >= 3.3); triton {triton.__version__}")
    _refuse(monkeypatch, over_tuning["mode"])
    torch.manual_seed(0)
    cfg = _cfg(HQ, H, Dk, Dv, **over)
    m = NSAAttention(cfg).eval()
    T = P + steps
    x = torch.randn(B, T, cfg.dim) * 2
    with torch.no_grad():
        y_prefill = m(x)
    cache, cref = m.new_cache(B, T), m.new_cache(B, T)
    with tuning.overrides({"decode": over_tuning}):
        dec = GraphDecoder(m, cache, backend="triton")
    p = dec.kernel_params()
    assert p["mode"] == over_tuning["mode"]
    assert p["nsc"] >= 2 and p["ns_sel"] >= 2 and p["topn"] == over_tuning["topn"]
    if P:
        dec.prefill(x[:, :P])
        with torch.no_grad():
            m(x[:, :P], cref)
    for t in range(P, T):
        with poisoned_outputs():  # the kernels' output workspace is NaN until they write it
            y = dec.step(x[:, t:t + 1])
        with torch.no_grad():
            y_ref = m(x[:, t:t + 1], cref)
        assert cache.length == cref.length == t + 1
        torch.testing.assert_close(y, y_ref, **TOL, msg=f"step t={t} vs the module's decode")
        torch.testing.assert_close(y[:, 0], y_prefill[:, t], **TOL, msg=f"step t={t} vs prefill")
        # the top-n of the fused kernel equals the reference's (ties to the lower index, forcing)
        _, idx = _reference_branches(cfg, cref, dec.last["q"], t)
        assert torch.equal(dec.indices(), idx), f"t={t}: {dec.indices().tolist()} vs {idx.tolist()}"
    assert not dec._kernels.sem.any()  # counts back at zero
    # emitted compressed tokens equal the module's (the scratch row took the non-emitting steps)
    nc = cfg.n_cmp(T)
    torch.testing.assert_close(cache.k_cmp[:, :nc], cref.k_cmp[:, :nc], **TOL)
    torch.testing.assert_close(cache.v_cmp[:, :nc], cref.v_cmp[:, :nc], **TOL)


@pytest.mark.parametrize("tune", [{"mode": "four"}, {"mode": "two"}, {"mode": "three"}],
                         ids=["four-launches", "two", "three"])
def test_forced_branches_and_token_counts(tune):
    """One branch at a time (the four-kernel path, whatever the mode) adds up to the whole step, and
    the kernels' token counters agree with a count from the indices."""
    torch.manual_seed(1)
    cfg = _cfg(4, 2, 16, 16, n_sel=3, n_local=1)
    m = NSAAttention(cfg).eval()
    B, T = 2, 46
    x = torch.randn(B, T, cfg.dim) * 2
    cache = m.new_cache(B, T)
    with tuning.overrides({"decode": {"block_c": 4, "nsc": 2, **tune}}):
        dec = GraphDecoder(m, cache, backend="triton")
    dec.prefill(x[:, :T - 1])
    t = T - 1
    y = dec.step(x[:, t:t + 1], count=True)
    cnt = dec.token_counts()
    q, g = dec.last["q"], dec.last["gates"]
    ref, idx = _reference_branches(cfg, cache, q, t)
    assert torch.equal(dec.indices(), idx)
    full = dec.attend(q, g, position=t).clone()  # attend again at the same position, one branch at a time
    parts = {}
    for i, b in enumerate(("cmp", "sel", "win")):
        with poisoned_outputs():
            o = dec.attend(q, g, branches=(b,)).clone()
        torch.testing.assert_close(o, g[..., i, None] * ref[b], **TOL, msg=f"branch {b}")
        parts[b] = o
    torch.testing.assert_close(full, parts["cmp"] + parts["sel"] + parts["win"], **TOL)
    assert torch.isfinite(y).all()

    # token counters (from the kernels' load masks) == independent counts from the indices
    S = t + 1
    assert cnt.shape == (B, cfg.n_kv_heads, 3) and cnt.dtype == torch.int64
    ind = tokens_read(cfg, S, dec.indices())
    assert torch.equal(cnt[..., 0], ind["cmp"]) and torch.equal(cnt[..., 1], ind["sel"])
    assert torch.equal(cnt[..., 2], ind["win"])
    # a literal count, position by position
    for b in range(B):
        for h in range(cfg.n_kv_heads):
            blocks = [j for j in idx[b, 0, h].tolist() if j >= 0]
            sel = {u for j in blocks for u in range(j * cfg.l_sel, (j + 1) * cfg.l_sel) if u <= t}
            win = set(range(max(0, t - cfg.w + 1), t + 1))
            ncmp = sum(1 for i in range(S) if i * cfg.d + cfg.l - 1 <= t)
            assert ind["cmp"][b, h] == ncmp and ind["sel"][b, h] == len(sel) and ind["win"][b, h] == len(win)
            assert ind["distinct"][b, h] == ncmp + len(sel | win)
            assert ind["read"][b, h] <= ind["formula"]
    assert ind["formula"] == cfg.decode_tokens_formula(S)


def test_decode_chunk_equals_prefill():
    """decode(x [B,T,dim]) = T single steps; equals prefill at those positions."""
    torch.manual_seed(2)
    cfg = _cfg(4, 2, 16, 16)
    m = NSAAttention(cfg).eval()
    x = torch.randn(1, 14, cfg.dim)
    with torch.no_grad():
        y_prefill = m(x)
    with tuning.overrides({"decode": {"nsc": 1}}):
        dec = GraphDecoder(m, m.new_cache(1, 14), backend="triton")
    dec.prefill(x[:, :9])
    torch.testing.assert_close(dec.decode(x[:, 9:]), y_prefill[:, 9:], **TOL)


def test_step_guards():
    cfg = _cfg(4, 2, 16, 16)
    m = NSAAttention(cfg)
    cache = m.new_cache(1, 3)
    dec = GraphDecoder(m, cache, backend="triton")
    with pytest.raises(ValueError, match="expected"):
        dec.step(torch.randn(2, 1, cfg.dim))
    for _ in range(3):
        dec.step(torch.randn(1, 1, cfg.dim))
    with pytest.raises(ValueError, match="max_len"):
        dec.step(torch.randn(1, 1, cfg.dim))
    with pytest.raises(RuntimeError, match="CUDA"):
        dec.capture()


def test_decoder_goes_through_the_dispatch():
    """The decode kernels come from the backend chosen through nsa.dispatch: record() names it for
    every branch of a step, and a backend that cannot run here (bf16 in the interpreter, a backend
    without decode kernels, mixed backends) is refused at construction, naming branch and reason."""
    cfg = _cfg(4, 2, 16, 16)
    m = NSAAttention(cfg).eval()
    dec = GraphDecoder(m, m.new_cache(1, 4), backend="triton")
    with dispatch.record() as rec:
        dec.step(torch.randn(1, 1, cfg.dim))
    assert rec.ran == {"cmp": "triton", "sel": "triton", "win": "triton"}
    with dispatch.record() as rec:
        dec.attend(dec.last["q"], dec.last["gates"], position=0, branches=("win",))
    assert rec.ran == {"win": "triton"}
    with pytest.raises(dispatch.BackendUnavailable, match=r"branch 'cmp'.*interpreter.*bf16 tl.dot"):
        GraphDecoder(m.bfloat16(), m.new_cache(1, 4), backend="triton")
    m.float()
    with pytest.raises(dispatch.BackendUnavailable, match="'reference' cannot run branches cmp, sel, win in GraphDecoder"):
        GraphDecoder(m, m.new_cache(1, 4), backend="reference")
    with pytest.raises(ValueError, match="one backend"):
        GraphDecoder(m, m.new_cache(1, 4), backend={"cmp": "triton", "sel": "triton", "win": "reference"})


def test_decoder_takes_the_layers_backend():
    """Without a backend argument the decoder runs the layer's own: one place decides the decode path.
    A layer on triton decodes on triton; a layer on the reference (no decode kernels) is refused, not
    switched to triton behind the caller's back."""
    cfg = _cfg(4, 2, 16, 16)
    m = NSAAttention(cfg, backend="triton").eval()
    with dispatch.record() as rec:
        GraphDecoder(m, m.new_cache(1, 4)).step(torch.randn(1, 1, cfg.dim))
    assert rec.ran == {"cmp": "triton", "sel": "triton", "win": "triton"}
    ref = NSAAttention(cfg).eval()
    assert ref.backend == "reference"
    with pytest.raises(dispatch.BackendUnavailable, match="'reference' cannot run branches cmp, sel, win in GraphDecoder"):
        GraphDecoder(ref, ref.new_cache(1, 4))


def test_programmatic_dependent_launch_is_off_in_the_interpreter_and_refused_where_unsupported():
    """``tuning.decode.pdl``: derived (None) on CUDA, False in the interpreter's table; True without an
    sm_90 GPU is a one-line error naming the key, not a silent serial launch."""
    m = NSAAttention(_cfg(4, 2, 16, 16)).eval()
    assert GraphDecoder(m, m.new_cache(1, 32), backend="triton").kernel_params()["pdl"] is False
    with tuning.overrides({"decode": {"pdl": True}}), \
            pytest.raises(ValueError, match=r"^tuning.decode.pdl=True: programmatic dependent launch needs a CUDA GPU"):
        GraphDecoder(m, m.new_cache(1, 32), backend="triton")
    with pytest.raises(ValueError, match=r"tuning.decode.pdl='yes': must be true or false"):
        tuning.validate({"decode": {"pdl": "yes"}})
