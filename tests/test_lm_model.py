"""The training experiment's model (experiments/lm/model.py): every attention variant runs forward and
backward, is causal, sees what it should, and its parameters are counted by kind."""
from __future__ import annotations

import pytest
import torch

from experiments.lm.model import LM, LMConfig, count_parameters

NSA = dict(n_heads=4, n_kv_heads=2, d_k=8, d_v=8, l=8, d=4, l_sel=8, n_sel=3, w=8, n_init=1, n_local=1,
           phi="mlp", gate_hidden=8, phi_hidden=16)
VOCAB, T = 20, 40


def model(attention, n_layers=2, **nsa):
    torch.manual_seed(0)
    cfg = LMConfig(dim=32, n_layers=n_layers, mlp_hidden=64, nsa={**NSA, **nsa})
    return LM(cfg, VOCAB, attention).double()


def tokens(B=2, seed=1):
    return torch.randint(VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attention", ["nsa", "dense", "window"])
def test_forward_backward_reach_every_parameter(attention):
    m = model(attention)
    logits = m(tokens())
    assert logits.shape == (2, T, VOCAB) and logits.dtype == torch.float64
    logits.logsumexp(-1).sum().backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())


@pytest.mark.parametrize("attention", ["nsa", "dense", "window"])
def test_causal(attention):
    """A token changed at position 25 moves no logit before it, and moves the logits from it on."""
    m = model(attention)
    a = tokens(B=1)
    b = a.clone()
    b[0, 25] = (b[0, 25] + 1) % VOCAB
    with torch.no_grad():
        la, lb = m(a), m(b)
    assert torch.equal(la[:, :25], lb[:, :25])
    assert not torch.allclose(la[:, 25:], lb[:, 25:])


def test_window_sees_only_w_tokens():
    """One window layer: the logit at t does not depend on tokens before t - w + 1; dense's does."""
    a = tokens(B=1)
    b = a.clone()
    b[0, 5] = (b[0, 5] + 1) % VOCAB
    t_far = 5 + NSA["w"]  # position 5 lies outside the window of every t >= 5 + w
    for attention, changes in (("window", False), ("dense", True)):
        m = model(attention, n_layers=1)
        with torch.no_grad():
            moved = not torch.allclose(m(a)[:, t_far:], m(b)[:, t_far:], rtol=0, atol=1e-12)
        assert moved == changes, attention


def test_window_as_wide_as_the_sequence_is_dense():
    """The window model (NSA's reference window branch) with w >= T computes the dense model (SDPA)."""
    dense, window = model("dense", w=T), model("window", w=T)
    window.load_state_dict(dense.state_dict())
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(window(x), dense(x), rtol=0, atol=1e-12)


def test_parameter_counts_name_what_nsa_adds():
    counts = {a: count_parameters(model(a)) for a in ("nsa", "dense", "window")}
    for c, a in zip(counts.values(), counts):
        assert c["total"] == sum(p.numel() for p in model(a).parameters())
        assert c["total"] == sum(v for k, v in c.items() if k != "total")
    assert counts["dense"] == counts["window"] and counts["dense"]["attn_extra"] == 0
    for kind in ("embedding", "attn", "mlp", "norm"):
        assert counts["nsa"][kind] == counts["dense"][kind], kind
    dim, H, HQ, Dk, Dv, l, hid = 32, NSA["n_kv_heads"], NSA["n_heads"], NSA["d_k"], NSA["d_v"], NSA["l"], NSA["phi_hidden"]
    kv_pairs = 2 * dim * H * (Dk + Dv)  # the compressed and window branches' key/value projections
    phi = sum(l * D + l * D * hid + hid + hid * D + D for D in (Dk, Dv))  # pe, fc1, fc2 (Eq. 7)
    gate = dim * NSA["gate_hidden"] + NSA["gate_hidden"] + NSA["gate_hidden"] * 3 * HQ + 3 * HQ  # Eq. 5's MLP
    assert counts["nsa"]["attn_extra"] == 2 * (kv_pairs + phi + gate)  # two layers


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"lm.nsa: unknown field\(s\) \['heads'\]"):
        LMConfig(dim=32, n_layers=1, mlp_hidden=8, nsa={**NSA, "heads": 2})
    with pytest.raises(ValueError, match=r"lm.n_layers=0"):
        LMConfig(dim=32, n_layers=0, mlp_hidden=8, nsa=NSA)
    with pytest.raises(ValueError, match=r"NSAConfig.n_sel=1"):
        model("nsa", n_sel=1)
    with pytest.raises(ValueError, match=r"attention.kind='sparse'"):
        model("sparse")


def test_gate_bias_sets_where_the_gates_start():
    """lm.nsa.gate_bias survives the model's own init (which zeroes biases): each head's gates start at
    sigmoid(bias) of its branch; without it every gate starts at 0.5."""
    x = torch.randn(2, T, 32, dtype=torch.float64)
    for bias, want in ((None, [0.5, 0.5, 0.5]), ([-2.0, 0.0, 3.0], torch.sigmoid(torch.tensor([-2.0, 0.0, 3.0])))):
        layer = model("nsa", gate_bias=bias).blocks[0].attn
        g = torch.sigmoid(layer.gate(x)).view(2, T, NSA["n_heads"], 3)
        assert torch.allclose(g.mean((0, 1, 2)), torch.as_tensor(want, dtype=torch.float64), atol=0.02)


def test_shared_kv_gives_every_branch_one_projection():
    """lm.nsa.shared_kv: the three branches read one key and one value projection (its gradient the sum of
    theirs), counted once as the dense layer's pair; the per-branch layer holds three pairs."""
    shared, apart = model("nsa", shared_kv=True), model("nsa")
    kv = shared.blocks[0].attn.kv_proj
    assert kv["k_cmp"] is kv["k_sel"] is kv["k_win"] and kv["v_cmp"] is kv["v_sel"] is kv["v_win"]
    assert apart.blocks[0].attn.kv_proj["k_cmp"] is not apart.blocks[0].attn.kv_proj["k_sel"]
    pair = 32 * (NSA["n_kv_heads"] * (NSA["d_k"] + NSA["d_v"]))  # one key + one value projection, per layer
    a, s = count_parameters(apart), count_parameters(shared)
    assert a["attn"] == s["attn"] and a["attn_extra"] - s["attn_extra"] == 2 * pair * 2  # 2 layers, 2 pairs gone
    logits = shared(tokens())
    logits.logsumexp(-1).sum().backward()
    assert kv["k_sel"].weight.grad is not None and kv["k_sel"].weight.grad.abs().sum() > 0


def test_phi_init_mean_starts_phi_as_mean_pooling():
    """lm.nsa.phi_init=mean: phi's MLP (Eq. 7) computes the block mean at the start (up to its small position
    embedding), so the compressed keys and values start as phi=avg's; the default init starts ~50x smaller."""
    from nsa import functional

    layer = model("nsa", phi_init="mean").blocks[0].attn
    raw = torch.randn(2, T, NSA["n_kv_heads"], NSA["d_k"], dtype=torch.float64)
    avg = functional.compress(raw, layer.config, None)
    layer.phi_k.pe.data.zero_()
    assert torch.allclose(functional.compress(raw, layer.config, layer.phi_k), avg, atol=1e-12)
    default = model("nsa").blocks[0].attn
    assert functional.compress(raw, default.config, default.phi_k).std() < avg.std() / 10
