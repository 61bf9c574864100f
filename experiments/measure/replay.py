"""Selections of a trained model as a benchmark's block indices: ``prefill.indices=<file>``,
``kernels.indices=<file>`` (op=selection).

A run of ``experiments.train ... train.save_selections=true`` saves the blocks one trained NSA layer selects for
every query of held-out sequences of several lengths (``selections/layer<i>.pt`` on the run, with its
``artifacts/`` copy in the job's output folder; ``experiments.lm.selections.save``: ``{"T<T>": [T,H,n] int32,
"config": the layer's NSAConfig as a string}``). :func:`load` gives them for one length as the selected branch's
``block_indices``, so a benchmark times the kernels on what a trained model reads instead of the top-n of random
inputs, whose neighbouring queries share almost no block.

The file's blocks must be the benchmark's: the same ``l_sel`` and at most its ``n_sel`` a query. A file of H
key/value heads replays on a model of H x r heads with the trained pattern repeated per head (each of the r heads
of a group of the benchmark reads what head h of the trained layer read); the note says so on the run.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from nsa import NSAConfig

RANDOM = "random"  # the benchmark's own top-n of random inputs (the default)


def _read(path: Path, key: str) -> dict:
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a pickle of another kind, a truncated file
        raise ValueError(f"{key}={str(path)!r}: not a selections file of train.save_selections "
                         f"({type(e).__name__})") from e
    if not isinstance(data, dict) or not isinstance(data.get("config"), str):
        raise ValueError(f"{key}={str(path)!r}: not a selections file of train.save_selections (no "
                         "'config' entry)")
    return data


def lengths(data: dict) -> list[int]:
    """The sequence lengths a selections file holds."""
    return sorted(int(k[1:]) for k in data if re.fullmatch(r"T\d+", k))


def load(source: str, seq: int, config: NSAConfig, key: str = "prefill.indices") -> tuple[torch.Tensor, str]:
    """The selections of the file ``source`` for a sequence of ``seq`` tokens, as ``[seq, H, n]`` int32 block
    indices of ``config``'s H key/value heads (CPU), and a one-line note of what they are.

    Arguments:
        source: a selections file (``train.save_selections``).
        seq: the benchmark's sequence length; the file must hold that length.
        config: the benchmark layer's config (l_sel, n_sel, key/value heads).
        key: the option that named the file, for the errors (``prefill.indices``, ``kernels.indices``).
    Returns:
        (indices, note). Raises ValueError (one line naming ``key``) where the file cannot serve."""
    path = Path(source).expanduser()
    if not path.is_file():
        raise ValueError(f"{key}={source!r}: no such file (a selections file saved by "
                         "train.save_selections=true, or 'random')")
    data = _read(path, key)
    have = lengths(data)
    if seq not in have:
        raise ValueError(f"{key}={source!r}: no selections at seq={seq}; the file holds "
                         f"{', '.join(map(str, have)) or 'none'}")
    m = re.search(r"\bl_sel=(\d+)", data["config"])
    l_sel = int(m.group(1)) if m else None
    if l_sel != config.l_sel:
        raise ValueError(f"{key}={source!r}: its blocks are l_sel={l_sel} tokens, the benchmark's "
                         f"model.nsa.l_sel={config.l_sel}")
    idx = data[f"T{seq}"]
    if idx.dim() != 3 or idx.shape[0] != seq:
        raise ValueError(f"{key}={source!r}: T{seq} has shape {tuple(idx.shape)}, expected [{seq}, H, n]")
    H, n = idx.shape[1], idx.shape[2]
    k = config.bounded(seq).n_sel
    if n > k:
        raise ValueError(f"{key}={source!r}: {n} blocks a query, more than the benchmark's n_sel={k} "
                         f"at seq={seq} (model.nsa.n_sel)")
    want = config.n_kv_heads
    if want % H:
        raise ValueError(f"{key}={source!r}: {H} key/value heads do not divide the model's "
                         f"n_kv_heads={want}")
    note = f"{path.name} at seq={seq}: {H} key/value head(s), {n} blocks a query, l_sel={l_sel}"
    if want != H:
        idx = idx.repeat(1, want // H, 1)  # head j of the benchmark reads what trained head j % H read
        note += f"; the trained pattern repeated x{want // H} over the model's {want} key/value heads"
    return idx.to(torch.int32).contiguous(), note
