"""Counting what is read: tokens of keys/values whose scores enter a softmax, per branch and query group,
from the indices a step used (:func:`selected_tokens`, :func:`branch_tokens`) and from the paper's
formula (:func:`formula_tokens`)."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from nsa import NSAConfig
from nsa.dispatch import BRANCHES

from .branches import selection_indices
from .inputs import CoreInputs



def selected_tokens(idx: torch.Tensor, config: NSAConfig, q_start: int) -> torch.Tensor:
    """Distinct raw tokens u <= t in the selected blocks, per query and group: ``[B,Tq,H]``.
    idx ``[B,Tq,H,n_sel]`` (-1 padded); query i sits at position q_start + i."""
    t = q_start + torch.arange(idx.shape[1], device=idx.device)[None, :, None, None]
    per_block = (t + 1 - idx * config.l_sel).clamp(0, config.l_sel)
    return torch.where(idx >= 0, per_block, torch.zeros_like(per_block)).sum(-1)


def block_union_fraction(idx: torch.Tensor, m: int) -> float:
    """How much neighbouring queries share their selected blocks: over tiles of ``m`` consecutive query rows
    of one sequence and key/value head, the distinct valid blocks they selected divided by the valid entries
    (what a kernel that loads each row's blocks on its own reads). 1.0: no sharing; 1/m: all the same blocks.
    idx ``[B,Tq,H,n_sel]`` (-1 padded); the last Tq % m rows are left out."""
    B, T, H, n = idx.shape
    T = (T // m) * m
    if T == 0:
        return float("nan")
    tiles = idx[:, :T].reshape(B, T // m, m, H, n).permute(0, 1, 3, 2, 4).reshape(B, T // m, H, m * n).long()
    s = tiles.sort(-1).values
    valid = s >= 0
    first = torch.ones_like(valid)
    first[..., 1:] = s[..., 1:] != s[..., :-1]
    distinct = (first & valid).sum().item()
    return distinct / max(valid.sum().item(), 1)


def branch_tokens(config: NSAConfig, t: torch.Tensor, sel: torch.Tensor) -> dict[str, torch.Tensor]:
    """Key/value tokens each branch reads for queries at positions t (broadcast against sel [B,Tq,H])."""
    n_cmp = torch.where(t + 1 >= config.l, (t + 1 - config.l) // config.d + 1, torch.zeros_like(t))
    win = torch.clamp(t + 1, max=config.w)
    return {"cmp": n_cmp.expand_as(sel), "sel": sel, "win": win.expand_as(sel)}


def variant_tokens(variant: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """Tokens a timed variant reads: all branches, one forced branch (sel also reads the compressed
    tokens it scores with), per query and group."""
    if variant in ("none", "nsa", "layer"):
        return parts["cmp"] + parts["sel"] + parts["win"]
    if variant == "sel":
        return parts["cmp"] + parts["sel"]
    return parts[variant]


def formula_tokens(variant: str, config: NSAConfig, S: int) -> int:
    """Paper Table 4's count at context S for the same variant (NSAConfig.decode_tokens_formula)."""
    cmp, sel, win = config.n_cmp(S), min(config.n_sel * config.l_sel, S), min(config.w, S)
    return {"cmp": cmp, "sel": cmp + sel, "win": win}.get(variant, config.decode_tokens_formula(S))


def ragged_parts(rows: list[CoreInputs], config: NSAConfig, plan: Mapping[str, str],
                 fallback: str | None) -> dict[str, torch.Tensor]:
    """``branch_tokens`` of a ragged step, ``[B,1,H]`` per branch: each row's selected blocks from the
    configured cmp backend at its own position (``selection_indices`` on the row's inputs)."""
    per = []
    for x in rows:
        idx = selection_indices(x, config, plan, fallback)
        t = torch.tensor(x.q_start, device=idx.device)
        per.append(branch_tokens(config, t, selected_tokens(idx, config, x.q_start)))
    return {b: torch.cat([p[b] for p in per], 0) for b in BRANCHES}
