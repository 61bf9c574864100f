"""What a trained NSA layer selects: how much neighbouring queries share, and the selections
themselves saved for benchmarks to replay.

* :func:`tile_sharing`: of a tile of ``tile`` consecutive queries, the mean share of the tile's queries that
  read each block the tile reads (per key/value group): ``sum_t |S_t| / (tile * |U|)`` with S_t the blocks
  query t selects and U their union. 1 when every query of the tile picks the same blocks; 1 / tile when no
  two share one. A kernel that loads each block once for every query of a tile that picked it (block-outer)
  loads |U| blocks where a query-outer one loads sum_t |S_t|: their ratio is ``tile * share``. ``picked``
  counts the top-n's own picks only (the forced initial and local blocks left out, which neighbours share
  by construction).
* :func:`layer_selections`: the blocks a layer selects for every query of a sequence (the reference top-n,
  Eqs. 8-12, in float32), in ``nsa.functional.select_blocks``' layout.
* :func:`save`: a trained model's selections of one layer on held-out sequences of several lengths, one
  file (``torch.save`` of plain tensors and strings: ``torch.load(..., weights_only=True)`` reads it).
"""
from __future__ import annotations

import torch

from nsa import NSAAttention, reference


def tile_sharing(indices: torch.Tensor, tile: int, *, q_start: int = 0, l_sel: int | None = None, n_init: int = 0,
                 n_local: int = 0, picked: bool = False) -> float:
    """The mean tile sharing (module docstring) of ``indices [B,R,H,n]`` (-1: no block) for the queries at
    positions ``q_start..``, over the whole tiles of ``tile`` rows (a last partial tile is left out). With
    ``picked``, the n_init first and the n_local newest candidate blocks of each row (``l_sel`` needed) are
    left out."""
    B, R, H, n = indices.shape
    if not 1 <= tile <= R:
        raise ValueError(f"tile={tile}: must lie in [1, rows={R}]")
    idx = indices[:, : R - R % tile]
    valid = idx >= 0
    if picked:
        if l_sel is None:
            raise ValueError("tile_sharing: picked=True needs l_sel")
        last = (q_start + torch.arange(idx.shape[1], device=idx.device)) // l_sel  # [R']
        valid = valid & (idx >= n_init) & (idx <= last[None, :, None, None] - n_local)
    nb = int(idx.max()) + 1 if bool(valid.any()) else 1
    onehot = torch.zeros(*idx.shape[:3], nb + 1, dtype=torch.bool, device=idx.device)
    onehot.scatter_(-1, torch.where(valid, idx, nb).long(), True)
    onehot = onehot[..., :nb].unflatten(1, (-1, tile))  # [B, tiles, tile, H, nb]
    reads = onehot.sum(2)  # per block: how many of the tile's queries read it
    total, union = reads.sum(-1).float(), (reads > 0).sum(-1).float()  # [B, tiles, H]
    ok = union > 0
    if not bool(ok.any()):
        return float("nan")
    return float((total[ok] / (tile * union[ok])).mean())


@torch.no_grad()
def layer_selections(layer: NSAAttention, x: torch.Tensor) -> torch.Tensor:
    """The blocks ``layer`` selects for its input ``x [B,T,dim]`` (a whole sequence at 0..T-1): ``[B,T,H,n_sel]``
    int64, by the reference top-n in float32 (a GPU backend's bf16 forward picks the same blocks except at
    near-ties of scores), in query chunks (``nsa.reference.compressed_branch``)."""
    c = layer.config
    with torch.autocast(x.device.type, enabled=False):
        q, kv, _ = layer.project(x.float(), torch.arange(x.shape[1], device=x.device))
        k_cmp, v_cmp = layer.compress(kv["k_cmp_raw"], kv["v_cmp_raw"])
        _, idx = reference.compressed_branch(q, k_cmp, v_cmp, c)
    return idx


@torch.no_grad()
def save(model, task_at, lengths, layer: int, path, device, autocast) -> dict[str, float]:
    """Saves the selections of NSA layer ``layer`` (an index into ``model.nsa_layers()``) on held-out
    sequence 0 of ``task_at(T)`` for each T in ``lengths`` to ``path``: ``{"T<T>": [T,H,n_sel] int32, ...,
    "config": the layer's NSAConfig as a string}``. Returns the tile sharing of each (``share_T<T>`` over tiles
    of 64 queries, ``share_picked_T<T>`` of the top-n's own picks)."""
    layers = model.nsa_layers()
    if not -len(layers) <= layer < len(layers):
        raise ValueError(f"train.selection_layer={layer}: the model has {len(layers)} NSA layers")
    target, c = layers[layer], layers[layer].config
    out, stats = {"config": repr(c)}, {}
    model.eval()
    seen = []
    hook = target.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    try:
        for T in lengths:
            tokens, _ = task_at(T).batch("val", 0, 1)
            with autocast():
                model(tokens.to(device))
            _record(out, stats, T, layer_selections(target, seen.pop()), c)
    finally:
        hook.remove()
    model.train()
    torch.save(out, path)
    return stats


def _record(out: dict, stats: dict, T: int, idx: torch.Tensor, c) -> None:
    """One length's selections into ``out`` and their tile sharing into ``stats``."""
    out[f"T{T}"] = idx[0].to(torch.int32).cpu()
    tile = min(64, T)
    stats[f"share_T{T}"] = tile_sharing(idx, tile)
    stats[f"share_picked_T{T}"] = tile_sharing(idx, tile, l_sel=c.l_sel, n_init=c.n_init, n_local=c.n_local, picked=True)
