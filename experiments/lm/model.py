"""A small decoder language model whose attention is NSA, dense, or the sliding window alone.

nanoGPT's shape: token embedding, ``n_layers`` pre-norm blocks (RMSNorm -> attention -> residual,
RMSNorm -> MLP -> residual), a final RMSNorm and a head tied to the embedding. No absolute
position embedding: every attention variant rotates its queries and keys (RoPE, ``nsa.module.rope``).

``attention``:

* ``nsa``: :class:`nsa.NSAAttention` (Yuan et al., arXiv 2502.11089), ``backend`` passed through.
* ``dense``: causal grouped-query attention over all previous tokens, torch's
  ``scaled_dot_product_attention`` (``nsa.compat.sdpa_gqa``), with NSA's heads and dims.
* ``window``: the same projections, attending only to the last ``w`` tokens (NSA's window branch
  alone, ``nsa.functional.sliding_window_attention`` on ``backend``'s ``win`` backend).

All three share ``n_heads``, ``n_kv_heads``, ``d_k``, ``d_v`` (and ``w``) from one :class:`nsa.NSAConfig`.
The NSA layer carries parameters the other two lack: key/value projections for three branches
instead of one, the compression MLPs phi (Eq. 7) and the gate MLP (Eq. 5).
:func:`count_parameters` reports them apart.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from nsa import NSAAttention, NSAConfig, functional
from nsa import context_parallel as cpar
from nsa.compat import sdpa_gqa
from nsa.module import rope

from . import ablations, recipe

ATTENTION = ("nsa", "dense", "window")


@dataclass(frozen=True)
class LMConfig:
    """The model's shape (``conf/lm/*.yaml``). ``nsa`` holds :class:`nsa.NSAConfig`'s fields except
    ``dim`` (which is ``dim`` here); dense and window attention use its heads, dims, ``w`` and
    ``rope_base``."""

    dim: int
    n_layers: int
    mlp_hidden: int
    nsa: Mapping = field(default_factory=dict)
    name: str = ""
    hf: Mapping | None = None  # lm=hf: {arch, path} of a transformers model of this shape (experiments/lm/hf.py)

    def __post_init__(self):
        for f in ("dim", "n_layers", "mlp_hidden"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"lm.{f}={v!r}: must be a positive integer")
        known = {f.name for f in fields(NSAConfig)} - {"dim"}
        extra = sorted(set(self.nsa) - known)
        if extra:
            raise ValueError(f"lm.nsa: unknown field(s) {extra}; NSAConfig takes {sorted(known)}")

    def attention_config(self) -> NSAConfig:
        """The layer's NSAConfig (its checks name the broken field as ``NSAConfig.<field>``)."""
        return NSAConfig(dim=self.dim, **dict(self.nsa))


class RMSNorm(nn.Module):
    """x / rms(x) * weight (Zhang & Sennrich 2019). ``nn.RMSNorm`` needs torch >= 2.4; the project
    supports torch 2.3."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class GQAAttention(nn.Module):
    """Causal grouped-query attention with RoPE over ``[B,T,dim]``: dense (``window=False``, SDPA)
    or the sliding window of ``cfg.w`` tokens (``window=True``, NSA's window branch on
    ``backend``). Query head h reads key/value head h // G, as in NSA."""

    def __init__(self, cfg: NSAConfig, *, window: bool, backend="reference"):
        super().__init__()
        self.cfg, self.window, self.backend = cfg, window, backend
        HQ, H, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v
        self.q_proj = nn.Linear(cfg.dim, HQ * Dk, bias=False)
        self.k_proj = nn.Linear(cfg.dim, H * Dk, bias=False)
        self.v_proj = nn.Linear(cfg.dim, H * Dv, bias=False)
        self.o_proj = nn.Linear(HQ * Dv, cfg.dim, bias=False)

    def forward(self, x, cp_group=None):
        """``x [B,T,dim]``; with ``cp_group`` this rank's part of one sequence (``nsa.context_parallel.shard``'s
        layout): RoPE at the rank's positions, dense attention over the gathered keys
        (``nsa.context_parallel.causal_attention``; the window model does not run context parallel)."""
        c = self.cfg
        B, T, _ = x.shape
        if cp_group is None:
            pos = torch.arange(T, device=x.device)
        else:
            import torch.distributed as dist

            if self.window:
                raise ValueError("attention.kind=window: does not run context parallel (parallel.cp > 1)")
            world = dist.get_world_size(cp_group)
            pos = cpar.positions(T * world, dist.get_rank(cp_group), world, x.device)
        q = rope(self.q_proj(x).view(B, T, c.n_heads, c.d_k), pos, c.rope_base)
        k = rope(self.k_proj(x).view(B, T, c.n_kv_heads, c.d_k), pos, c.rope_base)
        v = self.v_proj(x).view(B, T, c.n_kv_heads, c.d_v)
        if cp_group is not None:
            o = cpar.causal_attention(q, k, v, cp_group)
        elif self.window:
            win = self.backend if isinstance(self.backend, str) else self.backend.get("win", "reference")
            o = functional.sliding_window_attention(q, k, v, c, backend=win)
        else:
            o = sdpa_gqa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
        return self.o_proj(o.reshape(B, T, c.n_heads * c.d_v))


class Block(nn.Module):
    def __init__(self, cfg: LMConfig, attention: str, backend, fallback, streams: bool, selection: str = "topn"):
        super().__init__()
        self.selection = selection
        acfg = cfg.attention_config()
        self.norm1, self.norm2 = RMSNorm(cfg.dim), RMSNorm(cfg.dim)
        if attention == "nsa":
            self.attn = NSAAttention(acfg, backend=backend, fallback=fallback, streams=streams)
        else:
            self.attn = GQAAttention(acfg, window=attention == "window", backend=backend)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, cfg.mlp_hidden, bias=False), nn.GELU(),
                                 nn.Linear(cfg.mlp_hidden, cfg.dim, bias=False))

    def forward(self, x, sources=None, sel_rows=None, detach_q=True, cp_group=None):
        """``x`` after the block; with ``sel_rows`` (NSA: experiments.lm.recipe's selection loss) also this
        layer's selection loss on its attention input, else None. ``cp_group``: x is this rank's part of one
        sequence (context parallel); the selection loss then reads the whole sequence's input, gathered."""
        h = self.norm1(x)
        if self.selection != "topn" and isinstance(self.attn, NSAAttention):  # experiments.lm.ablations
            x = x + self.attn(h, block_indices=ablations.block_indices(self.attn, h, self.selection, sources))
        elif cp_group is not None:
            x = x + self.attn(h, cp_group=cp_group)
        else:
            x = x + self.attn(h)
        aux = None
        if sel_rows is not None and isinstance(self.attn, NSAAttention):
            whole = h if cp_group is None else cpar.gather_sequence(h, cp_group)
            aux = recipe.selection_kl(self.attn, whole, sel_rows, detach_q)
        return x + self.mlp(self.norm2(x)), aux


class LM(nn.Module):
    """``forward(idx [B,T] int64, sources=None) -> logits [B,T,vocab]`` (head tied to the embedding).

    ``selection`` (``experiments.lm.ablations``; NSA only, the other attentions ignore it): ``topn`` the
    paper's selection, ``full`` / ``oracle`` the blocks that ablation feeds each NSA layer's selected branch;
    ``oracle`` needs ``sources`` ([B,T], each answer's source position: the task's ``sources``).

    ``forward(idx, sources, sel_rows=[B,R])`` (training with ``train.recipe.sel_loss``, ``experiments.lm.recipe``)
    returns ``(logits, the NSA layers' mean selection loss)``. ``forward(idx_r, .., cp_group=group)``: ``idx_r`` is
    this rank's part of each sequence (``nsa.context_parallel.shard``), the logits are that part's."""

    def __init__(self, cfg: LMConfig, vocab_size: int, attention: str, *, backend="reference", fallback=None,
                 streams: bool = True, selection: str = "topn"):
        super().__init__()
        if attention not in ATTENTION:
            raise ValueError(f"attention.kind={attention!r}: must be one of {ATTENTION}")
        if selection not in ablations.SELECTIONS:
            raise ValueError(f"train.ablation.selection={selection!r}: must be one of {ablations.SELECTIONS}")
        self.selection = selection if attention == "nsa" else "topn"
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
            raise ValueError(f"vocab_size={vocab_size!r}: must be an integer >= 2")
        self.cfg, self.attention = cfg, attention
        self.emb = nn.Embedding(vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, attention, backend, fallback, streams, self.selection)
                                    for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.apply(self._init)
        # GPT-2's scaled init of the projections that write into the residual stream.
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layers))
        for layer in self.nsa_layers():  # NSAConfig.gate_bias / phi_init, which _init replaced
            layer.apply_init()

    @staticmethod
    def _init(m):
        # One init for every variant, the NSA layer's projections, phi and gate MLPs included.
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, sources=None, sel_rows=None, detach_q=True, cp_group=None):
        x = self.emb(idx)
        aux = []
        for block in self.blocks:
            x, a = block(x, sources, sel_rows, detach_q, cp_group)
            if a is not None:
                aux.append(a)
        logits = F.linear(self.norm(x), self.emb.weight)
        if sel_rows is None:
            return logits
        return logits, (torch.stack(aux).mean() if aux else torch.zeros((), device=logits.device))

    def nsa_layers(self) -> list[NSAAttention]:
        return [b.attn for b in self.blocks if isinstance(b.attn, NSAAttention)]


# Parameter kinds, by the module that owns them; ``attn_extra`` is what the dense layer lacks.
def _kind(name: str) -> str:
    if name.startswith("emb.") or ".embed_tokens." in name or ".lm_head." in name:  # lm=hf: transformers' names
        return "embedding"
    if ".mlp." in name:
        return "mlp"
    if "norm" in name.split(".")[-2]:
        return "norm"
    if ".phi_" in name or ".gate." in name:
        return "attn_extra"
    if ".kv_proj." in name:  # NSA: one key/value pair per branch; dense has one pair
        return "attn" if "_sel." in name else "attn_extra"
    return "attn"


def count_parameters(model: LM) -> dict[str, int]:
    """Parameters by kind: ``embedding`` (tied with the head), ``attn`` (what a dense layer of the
    same heads/dims holds: q, one key/value pair, o), ``attn_extra`` (NSA only: the compressed
    and window branches' key/value projections, phi (Eq. 7) and the gates (Eq. 5)), ``mlp``,
    ``norm``, and ``total``."""
    out = dict.fromkeys(("embedding", "attn", "attn_extra", "mlp", "norm"), 0)
    for name, p in model.named_parameters():
        out[_kind(name)] += p.numel()
    out["total"] = sum(out.values())
    return out
