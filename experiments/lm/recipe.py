"""The training recipe: what a training run may add to the paper's NSA without changing the model
that is trained and served. Each ingredient is a field of ``train.recipe`` (:class:`Recipe`), off by default (the
plain method); dense and window attention ignore it.

* ``gate_lr``: the learning rate of the gate MLPs (Eq. 5's g = sigmoid(MLP(x))) as a multiple of ``train.lr``.
  With free gates from step 0 the gates close (0.02-0.05 at the answers) before any branch has learned to
  read the needles, and a closed gate scales its branch's gradient by its value (BENCHMARKS.md "Why NSA did
  not learn the lookup"); a slower gate lets the branches learn first, and the gates still learn throughout.
  Its partner is an initialisation, ``lm.nsa.gate_bias`` (the gates' starting value, sigmoid(bias)).
* ``sel_loss``: the weight of an auxiliary loss that teaches the compressed branch's block scores (the
  selection's importance scores, Eqs. 8-10) where attention goes, as later sparse-attention work warms up its
  indexer (DeepSeek-V3.2's lightning indexer: a KL term to the main attention's distribution): on
  ``sel_loss_rows`` query rows per sequence, drawn among the positions whose next token is scored
  (:func:`sample_rows`), KL(target || scores) over the blocks the top-n chooses among (the candidates that
  are not forced, Eqs. 11-12 with the spec's n_init / n_local), where the target is full attention's block
  mass (softmax(q . k_sel) over every causal key with the layer's own queries and selection keys, summed per
  l_sel block and over each group's G heads, Eq. 10; no gradient) and the scores are Eq. 9-10's p_slc from the
  layer's compressed attention. Its gradient reaches the compression keys (the k_cmp projection and phi_k,
  Eq. 7) and, unless ``sel_loss_detach_q``, the queries. ``sel_loss_steps``: on for the first this many steps
  (0: the whole run).

The model trained and served is the paper's whatever the recipe: the loss and the learning rates shape
training only (no parameter is added, held or replaced; the checkpoints load into ``nsa.NSAAttention``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nsa import NSAAttention, functional
from nsa.module import apply_rope, rope_cos_sin

from . import probes


@dataclass(frozen=True)
class Recipe:
    """The ``train.recipe`` node; its defaults are the plain method (no ingredient)."""

    gate_lr: float = 1.0
    sel_loss: float = 0.0
    sel_loss_rows: int = 16
    sel_loss_steps: int = 0
    sel_loss_detach_q: bool = True

    def __post_init__(self):
        for f in ("gate_lr", "sel_loss"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"train.recipe.{f}={v!r}: must be a finite number >= 0")
        if not self.gate_lr > 0:
            raise ValueError(f"train.recipe.gate_lr={self.gate_lr!r}: must be positive (a multiple of train.lr)")
        for f, lo in (("sel_loss_rows", 1), ("sel_loss_steps", 0)):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"train.recipe.{f}={v!r}: must be an integer >= {lo}")
        if not isinstance(self.sel_loss_detach_q, bool):
            raise ValueError(f"train.recipe.sel_loss_detach_q={self.sel_loss_detach_q!r}: must be true or false")

    def sel_loss_at(self, step: int) -> float:
        """The selection loss's weight at update ``step`` (1-based)."""
        return self.sel_loss if self.sel_loss_steps == 0 or step <= self.sel_loss_steps else 0.0


def first_row(config) -> int:
    """The first query position whose top-n chooses among more than n_sel blocks (n_sel * l_sel): the selection
    loss reads rows from here, and a sequence no longer than it has none."""
    return config.n_sel * config.l_sel


def gate_parameters(model) -> list[torch.nn.Parameter]:
    """The gate MLPs' parameters (Eq. 5) of every NSA layer of ``model``."""
    return [p for m in model.modules() if isinstance(m, NSAAttention) for p in m.gate.parameters()]


def sample_rows(scored: torch.Tensor, rows: int, first: int, generator: torch.Generator) -> torch.Tensor:
    """``rows`` query positions per sequence for the selection loss: ``scored [B,T]`` bool (the positions
    whose next token the loss scores), drawn uniformly among those at ``first`` or later (where the top-n
    chooses), with replacement where fewer are there; a sequence with none draws among all positions from
    ``first``. Returns ``[B, rows]`` int64 (on the CPU: ``scored``'s device must be the CPU)."""
    B, T = scored.shape
    if not 0 <= first < T:
        raise ValueError(f"sample_rows: first={first} must lie in [0, T={T})")
    w = scored.clone().float()
    w[:, :first] = 0
    w[w.sum(1) == 0, first:] = 1
    return torch.multinomial(w, rows, replacement=True, generator=generator)


def _rope_at(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """RoPE of ``x [B,R,Hx,D]`` at per-row positions ``pos [B,R]`` (``nsa.module.rope`` takes one [T] vector)."""
    cos, sin = rope_cos_sin(pos.flatten(), x.shape[-1], base, torch.float32)
    shape = (*pos.shape, 1, x.shape[-1])
    return apply_rope(x, cos.view(shape), sin.view(shape))


def selection_kl(layer: NSAAttention, x: torch.Tensor, rows: torch.Tensor, detach_q: bool = True) -> torch.Tensor:
    """The selection loss of one NSA layer (the module docstring): ``x [B,T,dim]`` the layer's input (a whole
    sequence at positions 0..T-1), ``rows [B,R]`` int64 query positions in [n_sel * l_sel, T) (where the top-n
    chooses; :func:`sample_rows` draws them there, and nothing here reads them on the host, which would
    break a compiled graph). Returns a float32 scalar, the mean over rows and groups of
    KL(full attention's block mass || the compressed scores), both over the row's unforced candidates."""
    c = layer.config
    B, T, _ = x.shape
    R = rows.shape[1]
    H, HQ, G, Dk = c.n_kv_heads, c.n_heads, c.G, c.d_k
    with torch.autocast(x.device.type, enabled=False):
        # the projections in the parameters' dtype (float32 in one process; FSDP2's compute dtype, bfloat16 on a
        # GPU, over several: experiments/lm/distributed.py), the scores and the divergence in float32
        x = x.to(layer.q_proj.weight.dtype)
        pos = torch.arange(T, device=x.device)
        xr = x.gather(1, rows[..., None].expand(B, R, x.shape[-1]))
        q = _rope_at(layer.q_proj(xr).view(B, R, HQ, Dk).float(), rows, c.rope_base)
        k_cmp_raw = layer.kv_proj["k_cmp"](x).view(B, T, H, Dk)
        k_cmp = functional.compress(_rope_at(k_cmp_raw, pos.expand(B, T), c.rope_base), c, layer.phi_k).float()
        Tc, nb = k_cmp.shape[1], c.n_blocks(T)
        qs = q.detach() if detach_q else q
        # Eq. 8 at each row's own position: compressed token i is visible iff i * d + l - 1 <= t
        s = torch.einsum("brhgd,bchd->brhgc", qs.view(B, R, H, G, Dk), k_cmp) / math.sqrt(Dk)
        visible = (torch.arange(Tc, device=x.device) * c.d + c.l - 1)[None, None, :] <= rows[..., None]  # [B,R,Tc]
        p_cmp = torch.softmax(s.masked_fill(~visible[:, :, None, None], -math.inf), -1)
        scores = functional.selection_scores(p_cmp.flatten(2, 3), c, nb)  # Eqs. 9-10: [B,R,H,nb]
        with torch.no_grad():
            k_sel = _rope_at(layer.kv_proj["k_sel"](x).view(B, T, H, Dk).float(), pos.expand(B, T), c.rope_base)
            full = torch.einsum("brhgd,bshd->brhgs", q.detach().view(B, R, H, G, Dk), k_sel) / math.sqrt(Dk)
            future = pos[None, None, :] > rows[..., None]  # [B,R,T]
            p_full = torch.softmax(full.masked_fill(future[:, :, None, None], -math.inf), -1)
            target = probes.block_mass(p_full, c.l_sel).sum(3)  # [B,R,H,nb]: per l_sel block, over the G heads
            j = torch.arange(nb, device=x.device)
            last = (rows // c.l_sel)[..., None]  # [B,R,1]
            cand = ((j <= last) & (j >= c.n_init) & (j <= last - c.n_local))[:, :, None, :]  # unforced, [B,R,1,nb]
            target = target * cand
            target = target / target.sum(-1, keepdim=True).clamp(min=1e-30)
        pred = (scores * cand).clamp(min=1e-30)
        log_pred = pred.log() - pred.sum(-1, keepdim=True).log()
        kl = (target * (target.clamp(min=1e-30).log() - log_pred)).masked_fill(~cand, 0).sum(-1)
        return kl.mean()
