"""Triton sliding-window branch (spec step 6), same contract as
``nsa.reference.sliding_window_attention``: attention over u in [max(0, t-w+1), t].

One-pass online-softmax forward over the at most w + BLOCK_M - 1 keys a query tile sees, GQA rows
(a program holds all G heads of a group), flash-style backward (dq per query tile, dk/dv per key tile).
"""

from __future__ import annotations

from ._cmp_ops import WindowAttention, default_scale


def sliding_window_attention(q, k_win, v_win, config, *, scale=None, q_start: int = 0):
    scale = default_scale(q, scale)
    return WindowAttention.apply(q, k_win, v_win, int(config.w), scale, int(q_start))
