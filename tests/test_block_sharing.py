"""``measure.tokens.block_union_fraction``: how much neighbouring queries share their selected blocks (the
metric ``experiments.prefill`` logs as ``sel_block_union_frac_m<m>``), on hand-made indices."""
from __future__ import annotations

import math

import torch

from experiments.measure.tokens import block_union_fraction


def _idx(rows):
    """[1, T, 1, n] from a list of per-row block lists."""
    return torch.tensor(rows, dtype=torch.int32).view(1, len(rows), 1, -1)


def test_identical_rows_share_everything_and_disjoint_rows_nothing():
    same = _idx([[0, 3, 5]] * 4)
    assert block_union_fraction(same, 1) == 1.0
    assert block_union_fraction(same, 2) == 0.5 and block_union_fraction(same, 4) == 0.25
    disjoint = _idx([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]])
    assert block_union_fraction(disjoint, 2) == 1.0 and block_union_fraction(disjoint, 4) == 1.0


def test_padding_heads_and_the_ragged_tail():
    # rows 0-1 share block 0 and carry -1 padding; tiles of 2: {0, -1} + {0, 1} -> 2 distinct of 3 valid
    idx = _idx([[0, -1], [0, 1], [2, 3], [2, 4], [7, 8]])  # row 4: the tail of 5 rows in tiles of 2, left out
    assert math.isclose(block_union_fraction(idx, 2), (2 + 3) / (3 + 4))
    # heads are tiled apart: the same blocks in two heads are not shared
    two_heads = torch.tensor([[0, 1], [0, 1]], dtype=torch.int32).view(1, 1, 2, 2).expand(1, 2, 2, 2)
    assert block_union_fraction(two_heads, 2) == 0.5  # per head: rows 0 and 1 pick the same 2 blocks
    assert math.isnan(block_union_fraction(idx[:, :1], 2))  # no whole tile
