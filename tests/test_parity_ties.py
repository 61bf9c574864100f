"""experiments.parity.near_ties tells a near-tie from a wrong selection."""
from __future__ import annotations

import torch

from experiments.parity import near_ties
from nsa import NSAConfig, reference

CFG = NSAConfig(dim=32, n_heads=4, n_kv_heads=2, d_k=8, d_v=8, l=8, d=4, l_sel=8, n_sel=3, w=8,
                n_init=1, n_local=1)
T = 64


def _inputs():
    g = torch.Generator().manual_seed(3)
    x = {"q": torch.randn(1, T, 4, 8, generator=g, dtype=torch.float64),
         "k_cmp": torch.randn(1, CFG.n_cmp(T), 2, 8, generator=g, dtype=torch.float64),
         "v_cmp": torch.randn(1, CFG.n_cmp(T), 2, 8, generator=g, dtype=torch.float64)}
    _, idx = reference.compressed_branch(x["q"], x["k_cmp"], x["v_cmp"], CFG, scale=8 ** -0.5)
    return x, idx


def _swap_free_block(idx, t=60, h=0):
    """Replace the row's one non-forced block by an unselected, non-forced candidate."""
    last = t // CFG.l_sel
    forced = {0, last}
    row = idx[0, t, h].tolist()
    free = [j for j in row if j not in forced]
    other = next(j for j in range(last + 1) if j not in row and j not in forced)
    new = sorted([j for j in row if j != free[0]] + [other])
    out = idx.clone()
    out[0, t, h] = torch.tensor(new)
    return out


def test_identical_indices_check_nothing():
    x, idx = _inputs()
    assert near_ties(x, idx, idx.clone(), CFG, 8 ** -0.5, 0.0, 100) == (0, 0)


def test_swap_is_a_near_tie_only_within_the_tolerance():
    x, idx = _inputs()
    test = _swap_free_block(idx)
    assert near_ties(x, idx, test, CFG, 8 ** -0.5, 1.0, 100) == (1, 0)  # any swap is within 100 %
    assert near_ties(x, idx, test, CFG, 8 ** -0.5, 1e-9, 100) == (1, 1)  # random scores are not tied


def test_dropping_a_forced_block_is_never_a_tie():
    x, idx = _inputs()
    test = idx.clone()
    row = test[0, 60, 1].tolist()
    test[0, 60, 1] = torch.tensor(sorted([j for j in row if j != 0] + [next(j for j in range(8) if j not in row)]))
    assert near_ties(x, idx, test, CFG, 8 ** -0.5, 1.0, 100) == (1, 1)
