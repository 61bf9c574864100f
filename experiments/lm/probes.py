"""What the NSA layers do while they train: their gates, and how well they select.

* :class:`GateMeans`: a forward hook on each layer's gate MLP (``NSAAttention.gate``, whose output
  the layer maps through a sigmoid to ``[B,T,HQ,3]`` in the order (cmp, sel, win), paper Eq. 5)
  accumulates the mean gate value per branch on the device, without a host sync per step; with a
  ``mask`` ([B,T], the answer positions of a retrieval task) also the mean over those positions alone,
  where the long-range branches must do their work (over all positions, filler dominates).
* :class:`HoldGatesOpen`: a forward hook that holds every gate at 1 while active (``train.gates_open_steps``).
* :func:`selection_quality`: for the last ``rows`` query positions of a sequence, in float32,
  the share of full attention's probability mass that falls inside the blocks the layer selects
  (``mass``), the recall of the ``n_sel`` blocks full attention weighs most (``recall``), and how much
  neighbouring queries share their blocks (``share``: ``selections.tile_sharing`` over tiles of 64 rows).
  "Full attention" is softmax(scale * q . k_sel) over every key u <= t, with the layer's own
  queries and selection-branch keys, per query head; blocks are ranked per group by the mass
  summed over the group's G heads, as NSA scores them (Eq. 10).
"""
from __future__ import annotations

import contextlib
import math

import torch

from nsa import NSAAttention, functional
from nsa.dispatch import BRANCHES

from .selections import tile_sharing


class _GateHooks:
    """Forward hooks on the layers' gate MLPs (``self._handles``), removed together."""

    _handles: list

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles = []


class GateMeans(_GateHooks):
    """Mean gate per branch and layer over the forwards seen while ``active``. The sums and counts are
    device tensors updated in place by the hooks (no Python state changes per forward), so a model under
    ``torch.compile`` traces the hooks into its graph instead of recompiling at each step."""

    def __init__(self, layers: list[NSAAttention]):
        self.active = True
        self.mask = None  # [B,T] bool: the positions of the next forwards whose gates are also averaged apart
        dev = next(layers[0].parameters()).device if layers else None
        L = len(layers)
        self._sum = torch.zeros(L, 3, device=dev)      # per layer: sum over forwards of the mean gate
        self._n = torch.zeros(L, 1, device=dev)        # forwards seen
        self._ans = torch.zeros(L, 3, device=dev)      # sum of gates at the mask (positions x heads)
        self._ans_n = torch.zeros(L, 1, device=dev)    # masked positions x heads
        self._masked = torch.zeros(L, 1, device=dev)   # forwards seen with a mask
        self._handles = [layer.gate.register_forward_hook(self._hook(i, layer.config.n_heads))
                         for i, layer in enumerate(layers)]

    def _hook(self, i: int, HQ: int):
        def hook(module, args, out):
            if self.active:
                g = torch.sigmoid(out.detach().float()).unflatten(-1, (HQ, 3))  # [B,T,HQ,3]
                self._sum[i].add_(g.mean(dim=(0, 1, 2)))
                self._n[i].add_(1)
                if self.mask is not None:
                    w = self.mask.to(g.dtype)
                    self._ans[i].add_(torch.einsum("bthc,bt->c", g, w))
                    self._ans_n[i].add_(w.sum() * HQ)
                    self._masked[i].add_(1)
        return hook

    def take(self, reduce=None) -> dict[str, float]:
        """``gate_<branch>`` (mean over layers) and ``gate_<branch>_l<i>``; where every forward had a mask,
        ``gate_<branch>_answers`` and ``gate_<branch>_answers_l<i>`` too; resets the sums. ``reduce``: sums a
        tensor in place over the processes of one training (each saw its part of the batch), first."""
        if not self._handles:
            return {}
        if reduce is not None:
            for t in (self._sum, self._n, self._ans, self._ans_n, self._masked):
                reduce(t)
        n, masked = self._n.cpu(), self._masked.cpu()
        if not bool((n > 0).all()):
            return {}
        out = _per_branch("gate_{}", self._sum.cpu() / n, BRANCHES)
        if bool((masked == n).all()):
            out.update(_per_branch("gate_{}_answers", self._ans.cpu() / self._ans_n.cpu().clamp(min=1), BRANCHES))
        for t in (self._sum, self._n, self._ans, self._ans_n, self._masked):
            t.zero_()
        return out


class HoldGatesOpen(_GateHooks):
    """While ``active``, each layer's gates are 1: a forward hook replaces the gate MLP's output (Eq. 5's
    pre-sigmoid logits) with a constant whose sigmoid is 1 in float32, so no gradient reaches the MLP."""

    OPEN = 30.0  # sigmoid(30) = 1 - 9.4e-14: 1.0 in float32 and bfloat16

    def __init__(self, layers: list[NSAAttention]):
        self.active = False
        self._handles = [layer.gate.register_forward_hook(self._hook) for layer in layers]

    def _hook(self, module, args, out):
        return torch.full_like(out, self.OPEN) if self.active else None


def _per_branch(name: str, per_layer: torch.Tensor, branches) -> dict[str, float]:
    """``name`` per branch, the mean over layers, and ``name_l<i>`` per layer, from ``[layers, 3]``."""
    out = {name.format(b): float(per_layer[:, j].mean()) for j, b in enumerate(branches)}
    out.update({f"{name.format(b)}_l{i}": float(per_layer[i, j]) for i in range(len(per_layer))
                for j, b in enumerate(branches)})
    return out


@contextlib.contextmanager
def layer_inputs(layers: list[NSAAttention]):
    """Inside the block, ``xs[i]`` is the input ``x [B,T,dim]`` of the last forward of ``layers[i]``."""
    xs = [None] * len(layers)

    def pre_hook(i):
        return lambda module, args: xs.__setitem__(i, args[0].detach())

    handles = [layer.register_forward_pre_hook(pre_hook(i)) for i, layer in enumerate(layers)]
    try:
        yield xs
    finally:
        for h in handles:
            h.remove()


# ------------------------------------------------------------------------------------------------
# Selection quality: pure functions on probabilities and indices (tested on hand-built cases)
# ------------------------------------------------------------------------------------------------
def full_attention_probs(q, k, q_start: int, scale: float | None = None):
    """Causal softmax(scale * q . k) in float32: q ``[B,R,HQ,Dk]`` at positions ``q_start..``, k
    ``[B,S,H,Dk]`` (query head h reads key head h // G) -> ``[B,R,HQ,S]``."""
    B, R, HQ, Dk = q.shape
    H = k.shape[2]
    scale = 1.0 / math.sqrt(Dk) if scale is None else scale
    s = torch.einsum("brhgd,bshd->brhgs", q.float().unflatten(2, (H, HQ // H)), k.float()).flatten(2, 3) * scale
    t = q_start + torch.arange(R, device=q.device)
    future = torch.arange(k.shape[1], device=q.device)[None, :] > t[:, None]  # [R,S]
    return torch.softmax(s.masked_fill(future[None, :, None, :], -math.inf), dim=-1)


def block_mass(p, l_sel: int):
    """Probability per selection block: ``[..., S]`` -> ``[..., ceil(S / l_sel)]`` (block j covers
    tokens [j*l_sel, (j+1)*l_sel))."""
    S = p.shape[-1]
    nb = -(-S // l_sel)
    return torch.nn.functional.pad(p, (0, nb * l_sel - S)).unflatten(-1, (nb, l_sel)).sum(-1)


def group_mass(mass, H: int):
    """Each group's mass (Eq. 10's sharing of the selection over a group's G = HQ / H heads):
    ``[B,R,HQ,nb]`` -> ``[B,R,H,nb]``."""
    return mass.unflatten(2, (H, mass.shape[2] // H)).sum(3)


def rows_per_chunk(B: int, HQ: int, S: int) -> int:
    """Query rows per chunk of full attention's probabilities ``[B,rows,HQ,S]``: at most 256 MiB of float32."""
    return max(1, (1 << 26) // max(1, B * HQ * S))


def compressed_scores(layer: NSAAttention, q, kv, q_start: int = 0):
    """The layer's selection scores (Eqs. 8-10) for its queries ``q [B,R,HQ,Dk]`` at positions ``q_start..``
    from the raw compression keys/values of the whole sequence in ``kv`` (:meth:`NSAAttention.project`'s):
    ``[B,R,H,ceil((q_start + R) / l_sel)]``."""
    c = layer.config
    k_cmp, v_cmp = layer.compress(kv["k_cmp_raw"], kv["v_cmp_raw"])
    _, p_cmp = functional.compressed_attention(q, k_cmp.to(q.dtype), v_cmp.to(q.dtype), c, q_start=q_start)
    return functional.selection_scores(p_cmp, c, c.n_blocks(q_start + q.shape[1]))


def mass_in_selected(mass, indices):
    """Share of each head's mass in its group's selected blocks: mass ``[B,R,HQ,nb]``, indices
    ``[B,R,H,n]`` (-1 = none) -> ``[B,R,HQ]``."""
    B, R, HQ, nb = mass.shape
    H, n = indices.shape[2], indices.shape[3]
    idx = indices.clamp(min=0)[:, :, :, None, :].expand(B, R, H, HQ // H, n)
    got = mass.unflatten(2, (H, HQ // H)).gather(-1, idx) * (indices >= 0)[:, :, :, None, :]
    return got.sum(-1).flatten(2, 3)


def topn_recall(mass, indices, n: int, q_start: int, l_sel: int):
    """Share of the n blocks with the most group mass (mass ``[B,R,HQ,nb]`` summed over each group's
    heads, among the candidates j <= t // l_sel) that ``indices [B,R,H,n_sel]`` contains -> ``[B,R,H]``."""
    B, R, HQ, nb = mass.shape
    H = indices.shape[2]
    group = group_mass(mass, H)  # [B,R,H,nb]
    t = q_start + torch.arange(R, device=mass.device)
    cand = torch.arange(nb, device=mass.device)[None, :] <= (t // l_sel)[:, None]  # [R,nb]
    if int(cand.sum(-1).min()) < n:
        raise ValueError(f"topn_recall: a row has fewer than n={n} candidate blocks")
    top = group.masked_fill(~cand[None, :, None, :], -math.inf).topk(n, dim=-1).indices
    hit = (top[..., :, None] == indices[..., None, :]).any(-1)
    return hit.float().mean(-1)


@torch.no_grad()
def selection_quality(layer: NSAAttention, x: torch.Tensor, rows: int, answers: torch.Tensor | None = None
                      ) -> dict[str, float]:
    """``mass`` and ``recall`` (means over batch, the last ``rows`` positions and heads/groups) of
    ``layer`` on its input ``x [B,T,dim]``, recomputed in float32 with the reference operators; with
    ``answers`` (bool ``[B, rows]``: which of those positions are a retrieval task's answers),
    ``mass_answers`` and ``recall_answers``, the same means over those positions alone.

    The blocks are those the reference top-n picks from the float32 compressed scores: a GPU
    backend's bf16 forward picks the same blocks except at near-ties of scores. The layer's
    projections are reached through ``NSAAttention.project`` / ``compress`` (the forward returns
    no queries or keys); ``tests/test_lm_probes.py`` holds the recomputation to the layer's
    own forward. Rows start at T - rows, which must leave more than n_sel candidate blocks."""
    c = layer.config
    B, T, _ = x.shape
    r0 = T - rows
    if rows < 1 or r0 < c.n_sel * c.l_sel:
        raise ValueError(f"selection_quality: rows={rows} of T={T}: needs 1 <= rows <= T - n_sel * l_sel = "
                         f"{T - c.n_sel * c.l_sel} (every row must have more than n_sel candidate blocks)")
    with torch.autocast(x.device.type, enabled=False):
        # the projections in the parameters' dtype (float32 in one process; FSDP2's compute dtype, bfloat16 on a
        # GPU, over several: experiments/lm/distributed.py), the scores and masses in float32
        q, kv, _ = layer.project(x.to(layer.q_proj.weight.dtype), torch.arange(T, device=x.device))
        q = q[:, r0:].float()
        idx = functional.select_blocks(compressed_scores(layer, q, kv, r0), c, q_start=r0)
        kv = {**kv, "k_sel": kv["k_sel"].float()}
    mass, recall = [], []
    step = rows_per_chunk(B, c.n_heads, T)
    for a in range(0, rows, step):
        m = block_mass(full_attention_probs(q[:, a:a + step], kv["k_sel"], r0 + a), c.l_sel)
        i = idx[:, a:a + step]
        mass.append(mass_in_selected(m, i))
        recall.append(topn_recall(m, i, c.n_sel, r0 + a, c.l_sel))
    mass, recall = torch.cat(mass, 1), torch.cat(recall, 1)  # [B,rows,HQ], [B,rows,H]
    out = {"mass": float(mass.mean()), "recall": float(recall.mean()), "share": tile_sharing(idx, min(64, rows))}
    if answers is not None:
        if answers.shape != (B, rows):
            raise ValueError(f"selection_quality: answers has shape {tuple(answers.shape)}, needs [B, rows] = {(B, rows)}")
        if answers.any():
            out["mass_answers"], out["recall_answers"] = float(mass[answers].mean()), float(recall[answers].mean())
    return out
