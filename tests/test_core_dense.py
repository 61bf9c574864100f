"""Limits where NSA is dense causal attention (spec steps 4-6), against attention written here."""
from __future__ import annotations

import pytest
import torch
from conftest import ARG_ORDER, dense_causal_attention, make_config, random_inputs

from nsa import functional as fn

TOL = 1e-10
SHAPES = [  # (B, T, HQ, H, Dk, Dv)
    (2, 37, 2, 2, 8, 4),   # G = 1
    (1, 50, 4, 2, 4, 6),   # G = 2
    (2, 29, 8, 2, 6, 6),   # G = 4
    (1, 24, 16, 1, 4, 2),  # G = 16
]


def _gated(x, gates):
    args = [x[a] for a in ARG_ORDER]
    args[7] = torch.tensor(gates, dtype=torch.float64).expand_as(x["gates"]).contiguous()
    return args


@pytest.mark.parametrize("B,T,HQ,H,Dk,Dv", SHAPES)
@pytest.mark.parametrize("l_sel", [4, 8])
def test_selection_of_every_block_is_full_causal_attention(B, T, HQ, H, Dk, Dv, l_sel):
    n_blocks = -(-T // l_sel)
    cfg = make_config(HQ=HQ, H=H, Dk=Dk, Dv=Dv, l=8, d=4, l_sel=l_sel, n_sel=n_blocks, w=3,
                      n_init=1, n_local=1)
    x = random_inputs(cfg, B, T, seed=T)
    o, idx = fn.nsa_attention(*_gated(x, (0.0, 1.0, 0.0)), cfg, return_indices=True)
    want = dense_causal_attention(x["q"], x["k_sel"], x["v_sel"])
    assert (o - want).abs().max().item() <= TOL
    assert torch.equal(idx[:, -1], torch.arange(n_blocks).expand(B, H, n_blocks))


@pytest.mark.parametrize("B,T,HQ,H,Dk,Dv", SHAPES)
@pytest.mark.parametrize("extra", [0, 5])
def test_window_covering_the_sequence_is_full_causal_attention(B, T, HQ, H, Dk, Dv, extra):
    cfg = make_config(HQ=HQ, H=H, Dk=Dk, Dv=Dv, l=8, d=4, l_sel=4, n_sel=2, w=T + extra, n_init=1, n_local=1)
    x = random_inputs(cfg, B, T, seed=T + 1)
    o = fn.nsa_attention(*_gated(x, (0.0, 0.0, 1.0)), cfg)
    want = dense_causal_attention(x["q"], x["k_win"], x["v_win"])
    assert (o - want).abs().max().item() <= TOL


@pytest.mark.parametrize("B,T,HQ,H,Dk,Dv", SHAPES)
def test_compression_with_l_eq_d_eq_1_is_full_causal_attention(B, T, HQ, H, Dk, Dv):
    """l = d = 1: compressed token i is raw token i, visible iff i <= t."""
    cfg = make_config(HQ=HQ, H=H, Dk=Dk, Dv=Dv, l=1, d=1, l_sel=4, n_sel=2, w=3, n_init=1, n_local=1)
    x = random_inputs(cfg, B, T, seed=T + 2)
    assert x["k_cmp"].shape[1] == T
    o = fn.nsa_attention(*_gated(x, (1.0, 0.0, 0.0)), cfg)
    want = dense_causal_attention(x["q"], x["k_cmp"], x["v_cmp"])
    assert (o - want).abs().max().item() <= TOL


def test_window_smaller_than_the_sequence_is_not_full_attention():
    """The dense equality above is not vacuous: with w < T the window branch differs from it."""
    B, T, HQ, H, Dk, Dv = SHAPES[1]
    cfg = make_config(HQ=HQ, H=H, Dk=Dk, Dv=Dv, l=8, d=4, l_sel=4, n_sel=2, w=T - 1, n_init=1, n_local=1)
    x = random_inputs(cfg, B, T, seed=3)
    o = fn.nsa_attention(*_gated(x, (0.0, 0.0, 1.0)), cfg)
    want = dense_causal_attention(x["q"], x["k_win"], x["v_win"])
    diff = (o - want).abs().amax(dim=(0, 2, 3))
    assert torch.all(diff[: T - 1] <= TOL) and diff[T - 1] > 1e-3
