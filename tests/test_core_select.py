"""Top-n block selection (spec step 4, Eqs. 11-12) on constructed scores via nsa.functional.select_blocks."""
from __future__ import annotations

import oracle
import pytest
import torch
from conftest import make_config

from nsa import functional as fn


def cfg_of(n_sel, n_init, n_local, l_sel=4):
    return make_config(HQ=2, H=1, Dk=4, Dv=4, l=4, d=4, l_sel=l_sel, n_sel=n_sel, w=4,
                       n_init=n_init, n_local=n_local)


def last_row(scores, cfg, T):
    """Indices of the query at t = T-1 for a single score row given for every block."""
    s = torch.tensor(scores, dtype=torch.float64)[None, None, None, :].expand(1, T, 1, len(scores))
    return fn.select_blocks(s.contiguous(), cfg)[0, -1, 0].tolist()


def test_equal_scores_go_to_the_lower_index():
    cfg = cfg_of(n_sel=3, n_init=0, n_local=0)
    assert last_row([1.0] * 8, cfg, T=32) == [0, 1, 2]
    assert last_row([0, 5, 1, 5, 5, 1, 5, 0], cfg, T=32) == [1, 3, 4]
    assert last_row([0, 0, 0, 0, 0, 0, 0, 2], cfg, T=32) == [0, 1, 7]
    assert last_row([3, 1, 1, 1, 2, 2, 2, 0], cfg, T=32) == [0, 4, 5]


def test_forced_initial_and_local_blocks_win_even_with_zero_score():
    cfg = cfg_of(n_sel=4, n_init=1, n_local=2)
    # Block 0 and the two newest candidates (6, 7 at t = 31) score 0, others high: still chosen.
    assert last_row([0, 9, 8, 7, 9.5, 6, 0, 0], cfg, T=32) == [0, 4, 6, 7]
    # n_init = 2, n_local = 0: blocks 0 and 1 forced, two more by score.
    cfg = cfg_of(n_sel=4, n_init=2, n_local=0)
    assert last_row([0, 0, 1, 1, 3, 2, 3, 0], cfg, T=32) == [0, 1, 4, 6]
    # All slots forced: the scores do not matter.
    cfg = cfg_of(n_sel=3, n_init=1, n_local=2)
    assert last_row([0, 9, 9, 9, 9, 9, 0, 0], cfg, T=32) == [0, 6, 7]


def test_local_forcing_is_relative_to_each_query():
    """The n_local newest candidates are those of the query's own position t (blocks <= t // l_sel)."""
    cfg = cfg_of(n_sel=3, n_init=0, n_local=2)
    T = 32
    s = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0], dtype=torch.float64)
    s[0] = 1.0
    idx = fn.select_blocks(s.expand(1, T, 1, 8).contiguous(), cfg)[0, :, 0]
    for t in range(T):
        last = t // 4
        if last + 1 <= 3:
            want = list(range(last + 1)) + [-1] * (3 - last - 1)
        else:
            want = [0, last - 1, last]
        assert idx[t].tolist() == want, t


def test_fewer_candidates_than_n_sel_take_all_and_pad():
    cfg = cfg_of(n_sel=5, n_init=1, n_local=1)
    T = 10  # candidates at t: 0..t//4, at most 3: three columns (n_sel bounded by the blocks), -1 padded
    s = torch.rand(2, T, 1, 3, dtype=torch.float64)
    idx = fn.select_blocks(s, cfg)
    assert idx.shape == (2, T, 1, 3)
    for t in range(T):
        n = t // 4 + 1
        assert idx[:, t, 0].tolist() == [list(range(n)) + [-1] * (3 - n)] * 2


def test_future_blocks_are_never_candidates():
    """Scores given for blocks after t // l_sel (e.g. in decode, all S // l_sel blocks) are ignored."""
    cfg = cfg_of(n_sel=2, n_init=0, n_local=0)
    s = torch.tensor([1, 2, 3, 100, 100, 100], dtype=torch.float64)[None, None, None, :]
    # one query at t = 13 (block 3 is its newest), q_start = 13
    assert fn.select_blocks(s, cfg, q_start=13)[0, 0, 0].tolist() == [2, 3]
    assert fn.select_blocks(s, cfg, q_start=11)[0, 0, 0].tolist() == [1, 2]
    assert fn.select_blocks(s, cfg, q_start=3)[0, 0, 0].tolist() == [0, -1]


@pytest.mark.parametrize("n_sel,n_init,n_local,l_sel", [(3, 0, 0, 4), (4, 1, 2, 4), (2, 2, 0, 8),
                                                        (5, 0, 3, 4),
                                                        (1, 0, 1, 4), (1, 1, 0, 4), (6, 1, 1, 4)])
def test_many_ties_match_oracle_and_are_ascending(n_sel, n_init, n_local, l_sel):
    """Integer scores in {0,1,2} tie everywhere; the choice must equal the oracle's exactly."""
    B, T, H = 2, 50, 3
    g = torch.Generator().manual_seed(n_sel * 100 + n_init * 10 + n_local)
    nb = -(-T // l_sel) + 2  # two extra (future) blocks
    cfg = make_config(HQ=H, H=H, Dk=4, Dv=4, l=4, d=4, l_sel=l_sel, n_sel=n_sel, w=4, n_init=n_init,
                        n_local=n_local)
    s = torch.randint(0, 3, (B, T, H, nb), generator=g).to(torch.float64)
    got = fn.select_blocks(s, cfg)
    want = oracle.select_blocks(s, l_sel, n_sel, n_init, n_local)
    assert got.dtype == torch.int64
    assert torch.equal(got, want)
    valid = got >= 0
    # ascending among valid entries, padding only at the end
    assert torch.all((got[..., 1:] > got[..., :-1]) | ~valid[..., 1:])
    assert torch.all(valid[..., :-1] | ~valid[..., 1:])


def test_float32_scores_work_the_same():
    cfg = cfg_of(n_sel=3, n_init=0, n_local=0)
    s = torch.tensor([0, 5, 1, 5, 5, 1, 5, 0], dtype=torch.float32)[None, None, None, :]
    assert fn.select_blocks(s, cfg, q_start=31)[0, 0, 0].tolist() == [1, 3, 4]
