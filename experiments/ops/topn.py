"""op=topn: the top-n alone (Eqs. 11-12), ``nsa.backends.triton.topn.topn_launch``: every bucket launch
over one ``[B, T, H, n_blocks(T)]`` float32 buffer of uniform random scores, as the compressed forward
runs it when T fits one chunk. Checked for exact equality with ``reference.select_blocks`` (the same
scores in). Row ``triton``: forward only; ``fwd_bytes`` counts the candidate scores (t // l_sel + 1 per
query and group), the least a top-n must read.
"""
from __future__ import annotations

import torch

from nsa import reference
from nsa.backends.triton.topn import topn_launch
from nsa.backends.triton.utils import empty, poisoned_outputs

from .bench import Bench


def inputs(b: Bench, T: int):
    c = b.c
    nb = c.n_blocks(T)
    sc = b.rand(b.B, T, c.n_kv_heads, nb, dtype=torch.float32)
    return sc, nb


def check(b: Bench) -> None:
    sc, nb = inputs(b, b.check_seq)
    with poisoned_outputs():
        out = empty((*sc.shape[:3], b.c.n_sel), sc, torch.int64)
        topn_launch(sc, out, 0, nb, b.c)
    b.compare_indices("indices", out, reference.select_blocks(sc, b.c, q_start=0), exact=True)


def timed(b: Bench) -> None:
    c = b.c
    sc, nb = inputs(b, b.T)
    out = torch.empty(*sc.shape[:3], c.n_sel, device=b.dev, dtype=torch.int64)
    candidates = float((torch.arange(b.T, dtype=torch.float64) // c.l_sel + 1).sum()) * b.B * c.n_kv_heads
    b.row("triton", lambda: topn_launch(sc, out, 0, nb, c), nbytes=4.0 * candidates, n_blocks=nb)


def once(b: Bench) -> None:
    sc, nb = inputs(b, b.T)
    topn_launch(sc, torch.empty(*sc.shape[:3], b.c.n_sel, device=b.dev, dtype=torch.int64), 0, nb, b.c)
