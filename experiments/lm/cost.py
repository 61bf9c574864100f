"""Floating-point operations of one training step (forward + backward), to size runs and to log the
achieved TFLOP/s beside a device's peak.

Matrix products: 6 flops per weight and row it multiplies (2 forward, 4 backward), rows being tokens
for every linear layer except phi (Eq. 7), whose rows are the compressed tokens of each key/value
head; the tied head counts as a ``dim x vocab`` product. Attention: 2 (Dk + Dv) flops per query
head and attended key forward, 3.5x that for forward + backward (the convention of BENCHMARKS.md).
Keys attended by the query at position t: dense t + 1; window min(w, t + 1); NSA the compressed
tokens visible at t, min(n_sel * l_sel, t + 1) selected and min(w, t + 1) window tokens (spec,
"Memory read per decode step"). Element-wise work (norms, RoPE, softmax, gates) is not counted.
"""
from __future__ import annotations

import torch
from torch import nn

from nsa import NSAConfig

from .model import LM


def attended_keys(attention: str, c: NSAConfig, T: int) -> int:
    """Keys per query head summed over the query positions 0..T-1 of one sequence."""
    t = torch.arange(T, dtype=torch.float64)
    win = torch.clamp(t + 1, max=c.w)
    if attention == "dense":
        return int((t + 1).sum())
    if attention == "window":
        return int(win.sum())
    cmp = torch.where(t + 1 >= c.l, torch.div(t + 1 - c.l, c.d, rounding_mode="floor") + 1, torch.zeros_like(t))
    return int((cmp + torch.clamp(t + 1, max=c.n_sel * c.l_sel) + win).sum())


def step_flops(model: LM, T: int, B: int) -> dict[str, float]:
    """``{"matmul", "attention", "total"}``: flops of one forward + backward over ``B`` sequences of ``T`` tokens."""
    c = model.cfg.attention_config()
    matmul = 6.0 * B * T * model.emb.weight.numel()  # the tied head
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            rows = B * c.n_cmp(T) * c.n_kv_heads if ".phi_" in f".{name}" else B * T
            matmul += 6.0 * rows * m.weight.numel()
    attention = 3.5 * 2 * (c.d_k + c.d_v) * c.n_heads * B * attended_keys(model.attention, c, T) * model.cfg.n_layers
    return {"matmul": matmul, "attention": attention, "total": matmul + attention}
