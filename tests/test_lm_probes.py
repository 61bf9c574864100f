"""What the loop measures on the NSA layers (experiments/lm/probes.py): selection quality on hand-built
cases whose answer is known, against a plain per-row computation, and the gate means."""
from __future__ import annotations

import math

import pytest
import torch

from experiments.lm import probes, selections
from nsa import NSAAttention, NSAConfig, functional

F64 = torch.float64


def test_block_mass_by_hand():
    p = torch.tensor([[0.1, 0.2, 0.3, 0.05, 0.05, 0.3, 0.0]])
    torch.testing.assert_close(probes.block_mass(p, 3), torch.tensor([[0.6, 0.4, 0.0]]))  # last block: 1 token


def test_mass_and_recall_by_hand():
    """One query row, H=2 groups of G=2 heads, 5 blocks, n_sel=2; row t=9 with l_sel=2 has candidates 0..4."""
    mass = torch.tensor([[[
        [0.50, 0.10, 0.10, 0.20, 0.10],  # head 0, group 0
        [0.00, 0.60, 0.00, 0.30, 0.10],  # head 1, group 0: group sums 0.5 0.7 0.1 0.5 0.2
        [0.25, 0.25, 0.25, 0.25, 0.00],  # head 2, group 1
        [0.00, 0.00, 0.10, 0.10, 0.80],  # head 3, group 1: group sums 0.25 0.25 0.35 0.35 0.8
    ]]])
    idx = torch.tensor([[[[1, 3], [0, -1]]]])  # group 0 took blocks 1 and 3; group 1 took block 0 only
    share = probes.mass_in_selected(mass, idx)
    torch.testing.assert_close(share, torch.tensor([[[0.30, 0.90, 0.25, 0.00]]]))
    # Full attention's top-2 per group: group 0 {1, then 0 or 3: 0.5 each}; group 1 {4, then 2 or 3}.
    # Break the ties so that the answer is unique: block 3 of group 0 gets a little more.
    mass[0, 0, 0, 3] += 0.01
    recall = probes.topn_recall(mass, idx, n=2, q_start=9, l_sel=2)
    torch.testing.assert_close(recall, torch.tensor([[[1.0, 0.0]]]))  # group 0: {1, 3} found; group 1: {4, 2|3} missed


def test_recall_ignores_blocks_after_the_query():
    """Row t=3 with l_sel=2 has candidates 0 and 1 only; a later block's mass cannot enter the top-n."""
    mass = torch.tensor([[[[0.2, 0.1, 0.9, 0.9]]]])  # one head, one group
    idx = torch.tensor([[[[0, 1]]]])
    assert float(probes.topn_recall(mass, idx, n=2, q_start=3, l_sel=2)) == 1.0
    with pytest.raises(ValueError, match="fewer than n=3 candidate blocks"):
        probes.topn_recall(mass, idx, n=3, q_start=3, l_sel=2)


def test_full_attention_probs_by_hand():
    """Two query heads on one key head (G=2): scores are q.k / sqrt(Dk); keys after t get nothing."""
    q = torch.tensor([[[[1.0, 0.0], [0.0, 2.0]]]])  # [B=1, R=1, HQ=2, Dk=2] at position 1
    k = torch.tensor([[[[1.0, 0.0]], [[0.0, 1.0]], [[5.0, 5.0]]]])  # [B=1, S=3, H=1, 2]; key 2 is in the future
    p = probes.full_attention_probs(q, k, q_start=1)
    s = 1 / math.sqrt(2)
    head0 = torch.softmax(torch.tensor([s * 1.0, 0.0]), 0)
    head1 = torch.softmax(torch.tensor([0.0, s * 2.0]), 0)
    torch.testing.assert_close(p[0, 0], torch.stack([torch.cat([head0, torch.zeros(1)]), torch.cat([head1, torch.zeros(1)])]))


def _layer(seed=0):
    torch.manual_seed(seed)
    cfg = NSAConfig(dim=24, n_heads=4, n_kv_heads=2, d_k=8, d_v=8, l=8, d=4, l_sel=8, n_sel=3, w=8, n_init=1,
                    n_local=1, gate_hidden=8, phi_hidden=16)
    layer = NSAAttention(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.mul_(3.0)  # sharper attention than the default init, so that blocks differ in weight
    return layer


def test_recomputed_projections_reproduce_the_layer():
    """selection_quality reaches the layer's queries and keys through NSAAttention.project / _compress:
    with them, nsa_attention gives the layer's own output, so the blocks measured are the layer's."""
    layer = _layer()
    x = torch.randn(2, 60, 24)
    T = x.shape[1]
    q, kv, gates = layer.project(x, torch.arange(T))
    k_cmp, v_cmp = layer.compress(kv["k_cmp_raw"], kv["v_cmp_raw"])
    o = functional.nsa_attention(q, k_cmp, v_cmp, kv["k_sel"], kv["v_sel"], kv["k_win"], kv["v_win"], gates, layer.config)
    torch.testing.assert_close(layer.o_proj(o.flatten(2)), layer(x), rtol=0, atol=0)


def test_selection_quality_matches_a_plain_loop():
    """mass and recall against a float64 loop over rows, heads and groups written from the definitions."""
    layer = _layer(1)
    c = layer.config
    B, T, rows = 2, 64, 20
    x = torch.randn(B, T, 24, generator=torch.Generator().manual_seed(2))
    answers = torch.rand(B, rows, generator=torch.Generator().manual_seed(3)) < 0.3
    got = probes.selection_quality(layer, x, rows, answers)
    with torch.no_grad():
        q, kv, _ = layer.project(x, torch.arange(T))
        k_cmp, v_cmp = layer.compress(kv["k_cmp_raw"], kv["v_cmp_raw"])
        _, idx = functional.nsa_attention(q, k_cmp, v_cmp, kv["k_sel"], kv["v_sel"], kv["k_win"], kv["v_win"],
                                          torch.rand(B, T, c.n_heads, 3), c, return_indices=True)
    G = c.G
    shares, recalls, at_answer_s, at_answer_r = [], [], [], []
    for b in range(B):
        for t in range(T - rows, T):
            ans = bool(answers[b, t - (T - rows)])
            blocks = [j for j in range(c.n_blocks(T)) if j * c.l_sel <= t]
            for g in range(c.n_kv_heads):
                sel = {int(j) for j in idx[b, t, g] if j >= 0}
                group_mass = {j: 0.0 for j in blocks}
                for h in range(g * G, (g + 1) * G):
                    s = [float(q[b, t, h].double() @ kv["k_sel"][b, u, g].double()) / math.sqrt(c.d_k) for u in range(t + 1)]
                    z = sum(math.exp(v - max(s)) for v in s)
                    p = [math.exp(v - max(s)) / z for v in s]
                    shares.append(sum(p[u] for u in range(t + 1) if u // c.l_sel in sel))
                    at_answer_s.append(ans)
                    for u in range(t + 1):
                        group_mass[u // c.l_sel] += p[u]
                top = sorted(blocks, key=lambda j: -group_mass[j])[: c.n_sel]
                recalls.append(len(sel & set(top)) / c.n_sel)
                at_answer_r.append(ans)
    want_mass, want_recall = sum(shares) / len(shares), sum(recalls) / len(recalls)
    assert 0.2 < want_mass < 0.95 and 0.2 < want_recall < 0.95  # a case where selection is neither perfect nor empty
    assert got["mass"] == pytest.approx(want_mass, abs=1e-6)
    # One block chosen differently moves recall by 1 / (n_sel * groups * rows * B) = 1/240; float32 means agree to 1e-7.
    assert got["recall"] == pytest.approx(want_recall, abs=1e-6)
    # the same means over the answer rows alone (a third of them, drawn at random)
    ans_s = [v for v, a in zip(shares, at_answer_s) if a]
    ans_r = [v for v, a in zip(recalls, at_answer_r) if a]
    assert 0 < len(ans_r) < len(recalls)
    assert got["mass_answers"] == pytest.approx(sum(ans_s) / len(ans_s), abs=1e-6)
    assert got["recall_answers"] == pytest.approx(sum(ans_r) / len(ans_r), abs=1e-6)
    assert abs(got["mass_answers"] - got["mass"]) > 1e-3  # the subset differs from the whole: the mask is used
    assert set(probes.selection_quality(layer, x, rows)) == {"mass", "recall", "share"}
    none = torch.zeros(B, rows, dtype=torch.bool)
    assert set(probes.selection_quality(layer, x, rows, none)) == {"mass", "recall", "share"}  # no answer among the rows
    # share: the tile sharing of the blocks the layer selects for these rows (one tile of all of them here)
    q, kv, _ = layer.project(x.float(), torch.arange(x.shape[1]))
    idx = functional.select_blocks(probes.compressed_scores(layer, q[:, -rows:], kv, x.shape[1] - rows), layer.config,
                                   q_start=x.shape[1] - rows)
    assert got["share"] == pytest.approx(selections.tile_sharing(idx, rows), abs=1e-9) and 0 < got["share"] <= 1
    with pytest.raises(ValueError, match=r"answers has shape \(2, 19\), needs \[B, rows\] = \(2, 20\)"):
        probes.selection_quality(layer, x, rows, answers[:, 1:])


def test_selection_quality_rows_must_have_a_choice():
    layer = _layer()
    with pytest.raises(ValueError, match=r"rows=40 of T=60: needs 1 <= rows <= T - n_sel \* l_sel = 36"):
        probes.selection_quality(layer, torch.randn(1, 60, 24), 40)


def test_gate_means():
    layers = [_layer(0), _layer(1)]
    gm = probes.GateMeans(layers)
    xs = [torch.randn(2, 30, 24), torch.randn(2, 30, 24)]
    with torch.no_grad():
        for x in xs:  # each forward runs both layers on x
            for layer in layers:
                layer(x)
        gm.active = False
        layers[0](torch.randn(2, 30, 24) * 100)  # not counted
    got = gm.take()
    HQ = layers[0].config.n_heads
    for i, layer in enumerate(layers):
        with torch.no_grad():
            want = torch.stack([torch.sigmoid(layer.gate(x)).unflatten(-1, (HQ, 3)).mean((0, 1, 2)) for x in xs]).mean(0)
        for j, b in enumerate(("cmp", "sel", "win")):
            assert got[f"gate_{b}_l{i}"] == pytest.approx(float(want[j]), abs=1e-6)
    assert got["gate_sel"] == pytest.approx((got["gate_sel_l0"] + got["gate_sel_l1"]) / 2)
    gm.active = True
    assert gm.take() == {}  # reset by take
    # with a mask: also the means over the masked positions alone (two forwards of different masks)
    masks = [torch.rand(2, 30) < 0.2, torch.rand(2, 30) < 0.5]
    with torch.no_grad():
        for x, mk in zip(xs, masks):
            gm.mask = mk
            for layer in layers:
                layer(x)
    got = gm.take()
    for i, layer in enumerate(layers):
        with torch.no_grad():
            gs = [torch.sigmoid(layer.gate(x)).unflatten(-1, (HQ, 3)) for x in xs]
        num = sum(g[mk].sum((0, 1)) for g, mk in zip(gs, masks))  # [3]: over masked positions and heads
        den = sum(int(mk.sum()) * HQ for mk in masks)
        for j, b in enumerate(("cmp", "sel", "win")):
            assert got[f"gate_{b}_answers_l{i}"] == pytest.approx(float(num[j]) / den, abs=1e-6)
            assert got[f"gate_{b}_answers_l{i}"] != pytest.approx(got[f"gate_{b}_l{i}"], abs=1e-4)
    gm.mask = None
    gm.remove()
    layers[0](xs[0])
    assert gm.take() == {}  # hooks removed


def test_hold_gates_open():
    """Active: the layer's output is the one with every gate at 1, and its gate MLP gets no gradient;
    inactive or removed: the layer's own gates."""
    layer = _layer(2)
    c = layer.config
    x = torch.randn(2, 30, 24, generator=torch.Generator().manual_seed(4))
    held = probes.HoldGatesOpen([layer])
    q, kv, gates = layer.project(x, torch.arange(30))
    assert gates.detach().mean() < 0.9  # its own gates are not all open
    k_cmp, v_cmp = layer.compress(kv["k_cmp_raw"], kv["v_cmp_raw"])
    branches = (q, k_cmp, v_cmp, kv["k_sel"], kv["v_sel"], kv["k_win"], kv["v_win"])
    ones = layer.o_proj(functional.nsa_attention(*branches, torch.ones_like(gates), c).flatten(2))
    own = layer.o_proj(functional.nsa_attention(*branches, gates, c).flatten(2))
    torch.testing.assert_close(layer(x), own, rtol=0, atol=0)
    held.active = True
    y = layer(x)
    torch.testing.assert_close(y, ones, rtol=0, atol=0)
    assert (y - own).abs().max() > 1e-3  # holding them open changes the output
    layer.zero_grad(set_to_none=True)
    y.square().sum().backward()
    assert all(p.grad is None for p in layer.gate.parameters())
    assert layer.q_proj.weight.grad is not None and layer.q_proj.weight.grad.abs().sum() > 0
    held.remove()
    torch.testing.assert_close(layer(x), own, rtol=0, atol=0)
