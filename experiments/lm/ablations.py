"""Ablations of NSA's selection and gates (why NSA learns needle retrieval slower than dense
attention), each a switch of ``experiments.train``'s ``train.ablation`` node (:class:`Ablation`), applied
in training and in evaluation alike. Dense and window attention ignore them.

``selection`` (which blocks the selected branch reads; paper Section 3.3.2, spec steps 2-5):

* ``topn``: the paper's: the top-n of the compressed scores (Eqs. 8-12), the layer's own selection.
* ``full``: the top-n of full attention's block mass instead of the compressed scores: softmax(scale * q . k_sel)
  over every causal key u <= t, with the layer's own queries and selection keys (``probes.full_attention_probs``),
  summed per l_sel block (``probes.block_mass``, the block-aligned Eq. 9) and over the G heads of a group (Eq. 10's
  group sharing); the n_init initial and n_local local blocks stay forced and the rest go to the highest mass
  (Eqs. 11-12, ``nsa.functional.select_blocks``). Does the selected branch learn to read the blocks that a
  perfect block scorer would pick?
* ``oracle``: the layer's own top-n, but at each answer position the block holding the answer's source token
  (the needle; ``data.Needles.sources``) is forced in beside the n_init / n_local forced blocks, displacing the
  lowest-scored picked block if it was not picked. Does the selected branch learn to read the needle once it is
  handed the right block?

Both feed ``NSAAttention.forward(x, block_indices=...)`` (``nsa.functional.nsa_attention``'s ``block_indices``):
only the blocks the selected branch reads change; the compressed branch runs and learns as it does. The indices
are computed without a gradient (the top-n is not differentiable either), in the layer's parameter dtype
(float32 in training, also under bf16 autocast), from the layer's
projections of its input (:meth:`NSAAttention.project` runs once more for them).

``branches`` (paper Eq. 5, o = sum_c g_c o_c over c in (cmp, sel, win)): the branches whose gates the gate MLP
sets; every other branch's gate is held at 0 (:class:`BranchGates`), so the output is the gated sum of the listed
branches alone and the others get no gradient: e.g. ``[cmp]`` the compressed branch alone, ``[sel]`` the selected
branch alone (its blocks still picked by the compressed scores, whose branch then learns only through them: not
at all under ``topn``), ``[win]`` the window alone.

The metrics ``sel_mass`` / ``sel_recall`` keep their meaning under every ablation: the quality of the compressed
scores' top-n (``probes.selection_quality``), not of the blocks the ablation feeds the selected branch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nsa import NSAAttention, functional
from nsa.dispatch import BRANCHES

from . import probes

SELECTIONS = ("topn", "full", "oracle")


@dataclass(frozen=True)
class Ablation:
    """The ``train.ablation`` node; its defaults are the paper's method (no ablation)."""

    selection: str = "topn"
    branches: tuple = BRANCHES

    def __post_init__(self):
        if not isinstance(self.selection, str) or self.selection not in SELECTIONS:
            raise ValueError(f"train.ablation.selection={self.selection!r}: must be one of {SELECTIONS}")
        b = self.branches
        if isinstance(b, str) or not isinstance(b, (list, tuple)) or not b or len(set(b)) != len(b) \
                or not all(isinstance(x, str) and x in BRANCHES for x in b):
            raise ValueError(f"train.ablation.branches={b!r}: must be a non-empty list of distinct branches "
                             f"among {list(BRANCHES)}")
        object.__setattr__(self, "branches", tuple(x for x in BRANCHES if x in b))  # in Eq. 5's order

    @property
    def is_default(self) -> bool:
        return self == Ablation()


# ------------------------------------------------------------------------------------------------
# Selection: the blocks fed to the selected branch
# ------------------------------------------------------------------------------------------------
def full_attention_scores(q, k_sel, config, q_start: int = 0, rows_per_chunk: int | None = None):
    """Full attention's block mass per group: q ``[B,Tq,HQ,Dk]`` at positions ``q_start..``, k_sel ``[B,S,H,Dk]``
    -> ``[B,Tq,H,ceil(S / l_sel)]`` float32 (the ``full`` selection's scores: causal softmax over all keys,
    summed per l_sel block and over the G heads of each group). Query rows are taken in chunks
    (``probes.rows_per_chunk``)."""
    B, Tq, HQ, _ = q.shape
    H, S = k_sel.shape[2], k_sel.shape[1]
    step = rows_per_chunk or probes.rows_per_chunk(B, HQ, S)
    out = []
    for a in range(0, Tq, step):
        mass = probes.block_mass(probes.full_attention_probs(q[:, a:a + step], k_sel, q_start + a), config.l_sel)
        out.append(probes.group_mass(mass, H))
    return torch.cat(out, 1)


def force_sources(scores, sources, l_sel: int):
    """``scores [B,T,H,nb]`` with, at each row (b, t) whose ``sources[b, t] >= 0``, the block of that source
    token raised above every score (the dtype's largest finite value: under the +inf that select_blocks gives
    its forced blocks, so those stay forced and the source's block takes the first picked slot)."""
    src = sources.to(scores.device)
    b, t = (src >= 0).nonzero(as_tuple=True)
    out = scores.clone()
    out[b, t, :, src[b, t] // l_sel] = torch.finfo(out.dtype).max
    return out


@torch.no_grad()
def block_indices(layer: NSAAttention, x, selection: str, sources=None):
    """The blocks the ``selection`` ablation feeds ``layer``'s selected branch on its input ``x [B,T,dim]`` (a whole
    sequence at positions 0..T-1): ``[B,T,H,k]`` in ``nsa.functional.select_blocks``' layout. ``sources``
    (``[B,T]``, ``data.*.sources``) is needed by ``oracle``."""
    if selection not in SELECTIONS or selection == "topn":
        raise ValueError(f"selection={selection!r}: block_indices computes {SELECTIONS[1:]} (topn: the layer's own)")
    c = layer.config
    B, T, _ = x.shape
    with torch.autocast(x.device.type, enabled=False):
        # float32 (float64 for a float64 layer), whatever autocast the forward runs under
        q, kv, _ = layer.project(x.to(layer.q_proj.weight.dtype), torch.arange(T, device=x.device))
        if selection == "full":
            scores = full_attention_scores(q, kv["k_sel"], c)
        else:
            if sources is None or tuple(sources.shape) != (B, T):
                raise ValueError(f"sources: the oracle selection needs each answer's source position [B,T] = "
                                 f"{[B, T]}, got {None if sources is None else tuple(sources.shape)}")
            scores = force_sources(probes.compressed_scores(layer, q, kv), sources, c.l_sel)
        return functional.select_blocks(scores, c)


# ------------------------------------------------------------------------------------------------
# Branches: gates held at 0
# ------------------------------------------------------------------------------------------------
class BranchGates:
    """Holds the gates of the branches not in ``branches`` at 0 (Eq. 5's g_c = sigmoid(-inf) = 0 exactly): a
    forward hook on each layer's gate MLP sets those logits (laid out ``[.., HQ, 3]``, branch minor) to -inf, so
    the layer's output is the gated sum of the other branches and the held ones get no gradient. Register it
    after ``probes.HoldGatesOpen`` (which replaces the whole output) and before ``probes.GateMeans`` (which
    then reports 0 for the held branches). No hooks when every branch is listed."""

    def __init__(self, layers: list[NSAAttention], branches=BRANCHES):
        off = torch.tensor([b not in branches for b in BRANCHES])
        self._handles = [] if not off.any() else [
            layer.gate.register_forward_hook(self._hook(off.repeat(layer.config.n_heads))) for layer in layers]

    @staticmethod
    def _hook(off):
        def hook(module, args, out):
            return out.masked_fill(off.to(out.device), -torch.inf)
        return hook

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles = []
