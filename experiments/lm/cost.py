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


def memory_lower_bound(cfg, n_params: int) -> dict[str, float]:
    """Bytes one rank holds at once in the training's largest stage, at least (``cfg``: a RunConfig): what no
    step can do without, so that a size far past the device is refused before a run exists, never one that fits.

    * ``states``: fp32 weights, gradients and AdamW's two moments, 16 bytes a parameter, sharded over dp (FSDP2);
    * ``logits``: each micro-batch's logits in float32 for the loss and their gradient, 8 bytes a token and
      vocabulary entry;
    * ``activations``: what backward needs of each layer, at least the block's input, q, the attention's output
      and o_proj's (4 x dim) and the MLP's hidden pre- and post-activation (2 x mlp_hidden), a token each, in
      the training dtype.
    A micro-batch is ``batch / (dp x grad_accum)`` rows of ``seq_len / cp`` tokens."""
    elem = torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()
    per_token = cfg.lm.n_layers * (4 * cfg.lm.dim + 2 * cfg.lm.mlp_hidden) * elem
    stages = []
    for _, task, batch in cfg.stages():
        tokens = max(1, batch // (cfg.dp * cfg.train.grad_accum)) * max(1, task.seq_len // cfg.cp)
        stages.append({"states": 16.0 * n_params / cfg.dp, "logits": 8.0 * tokens * task.vocab_size,
                       "activations": float(tokens * per_token)})
    return max(stages, key=lambda parts: sum(parts.values()))
