"""NSA grown from a trained dense model (``train.init_from``): how sparse attention is brought to an existing model.

``train.init_from=<folder>`` names a dense run of ``experiments.train`` (its output folder, or the ``ckpt``
folder in it, or the ``last.pt`` file). An ``attention=nsa`` run of the same model shape then starts from it
instead of its random init: the embedding, the norms and the MLPs are the dense model's; in each layer the
query and output projections are the dense layer's, and each branch's key and value projections (compressed,
selected, window) start as copies of the dense ones (Section 3.3.3's independent keys and values, started
alike); phi and the gates keep the NSA layer's own init, which ``lm.nsa.phi_init=mean`` (a compressed key starts
as its block's mean) and ``lm.nsa.gate_bias`` (the gates started open) choose. The run then trains from step 0 on
its own schedule; the recipe's selection loss (``train.recipe.sel_loss``, ``sel_loss_steps``) warms the compressed
scores up to the selection the dense attention implies. A resumed run reads its own checkpoint, not the dense one.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from . import checkpoint

# the lm node's fields the dense model and the NSA model must share (the NSA settings l, d, n_sel, ... are NSA's)
SHAPE = ("dim", "n_layers", "mlp_hidden")
HEADS = ("n_heads", "n_kv_heads", "d_k", "d_v", "rope_base")
BRANCHES = ("cmp", "sel", "win")


def _ckpt_dir(path: Path) -> Path:
    """The checkpoint folder ``path`` names: itself, its ``ckpt`` folder (a run's output folder), or the folder of
    a ``last.pt`` file."""
    if path.is_file():
        return path.parent
    return path / "ckpt" if (path / "ckpt").is_dir() else path


def source(cfg) -> dict:
    """The dense checkpoint ``cfg.train.init_from`` names, checked against ``cfg`` (one-line ValueErrors naming
    ``train.init_from``): ``{"path", "state" (its model's state dict, on the CPU), "config", "run_id", "step",
    "val_loss" (its last held-out loss; None where it was never evaluated)}``."""
    where = f"train.init_from={cfg.train.init_from}"
    if cfg.attention != "nsa":
        raise ValueError(f"{where}: grows an NSA model from a dense one; attention={cfg.attention} starts from its own "
                         "init (set attention=nsa)")
    path = Path(str(cfg.train.init_from)).expanduser()
    if not path.exists():
        raise ValueError(f"{where}: no such file or folder (a dense run's output folder, its ckpt folder or last.pt)")
    d = _ckpt_dir(path)
    state = checkpoint.load(d)
    if state is None:
        sharded = checkpoint.meta(d) is not None
        raise ValueError(f"{where}: " + ("a sharded checkpoint (dcp/); resume it in one process (python -m "
                                         "experiments.train ...) to write last.pt, then grow from that" if sharded
                                         else f"no checkpoint there ({checkpoint.path(d)})"))
    src = state["config"]
    if src.get("attention") != "dense":
        raise ValueError(f"{where}: the checkpoint's attention is {src.get('attention')!r}; NSA grows from a dense "
                         "model (attention=dense)")
    ours, theirs = cfg.to_dict()["lm"], src.get("lm", {})
    wrong = [f"lm.{k}={ours[k]!r} (it has {theirs.get(k)!r})" for k in SHAPE if ours[k] != theirs.get(k)]
    wrong += [f"lm.nsa.{k}={ours['nsa'][k]!r} (it has {theirs.get('nsa', {}).get(k)!r})" for k in HEADS
              if ours["nsa"][k] != theirs.get("nsa", {}).get(k)]
    if wrong:
        raise ValueError(f"{where}: the dense model's shape differs in {'; '.join(wrong)}")
    v = state.get("val_loss")  # None in a checkpoint of a run never evaluated
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf):
        raise ValueError(f"{where}: the checkpoint's val_loss={v!r} is not a held-out loss (a finite number > 0)")
    return {"path": checkpoint.path(d), "state": state["model"], "config": src, "run_id": state["run_id"],
            "step": state["step"], "val_loss": state.get("val_loss")}


def loss_target(cfg, dense_val_loss: float | None) -> float | None:
    """The held-out loss a run is timed to (``train.loss_target``): the one set, else for a grown run 1.01 x the
    dense model's last held-out loss (within 1 % of it), else None."""
    if cfg.train.loss_target is not None:
        return float(cfg.train.loss_target)
    return None if dense_val_loss is None else 1.01 * float(dense_val_loss)


def into(model, dense: dict) -> list[str]:
    """``dense``'s weights (a dense LM's state dict) into ``model`` (an NSA LM of its shape), as the module
    docstring says; returns the names of the NSA model's parameters that kept their own init (phi, the gates).
    A tensor of another shape (another vocabulary) is a one-line ValueError."""
    own = model.state_dict()
    new, taken = {}, set()
    for name in own:
        parts = name.split(".")
        src = name
        if ".attn.kv_proj." in name:  # blocks.i.attn.kv_proj.<k|v>_<branch>.weight <- blocks.i.attn.<k|v>_proj.weight
            i = parts.index("kv_proj")
            src = ".".join(parts[:i] + [f"{parts[i + 1].split('_')[0]}_proj"] + parts[i + 2:])
        if src in dense:
            if dense[src].shape != own[name].shape:
                raise ValueError(f"train.init_from: {src} is {tuple(dense[src].shape)} in the dense model, "
                                 f"{tuple(own[name].shape)} here (another vocabulary or shape)")
            new[name] = dense[src]
            taken.add(src)
    missing = sorted(set(dense) - taken)
    if missing:
        raise ValueError(f"train.init_from: the dense model's {', '.join(missing[:4])} have no place in the NSA model")
    with torch.no_grad():
        for name, value in new.items():
            own[name].copy_(value)
    return sorted(set(own) - set(new))
