"""Passkey retrieval in text: does a byte-level model use its long context?

A passkey sequence is a held-out document's text with, at a chosen depth, the needle ``NEEDLE`` (a random
``DIGITS``-digit number) and, at its end, ``QUESTION`` followed by the number again. :func:`insert` writes one
into a window of tokens. A model that retrieves predicts the answer's digits from the needle, however far back
it lies; a model that does not can only guess (one in ten per digit).

* Training (``data.passkey_share``, :class:`experiments.lm.data.Text`): that share of a batch's rows carry a
  passkey (the loss on every byte, as the rest of the text), so the task is learnt.
* Evaluation (``train.passkey``, :func:`grid`): at the end of a run, for each length (up to 4x the training
  context) and depth (the needle's position as a fraction of the text before the question), ``samples``
  held-out sequences; a sequence counts when the model's argmax at every answer digit is that digit (teacher
  forced: one forward per sequence). Metrics ``passkey_acc_<length>_<depth%>`` and ``passkey_acc`` (their
  mean); a heat map (:func:`heatmap`, as the paper's Figure 5) logged on the run.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

NEEDLE = b" The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = b" What is the pass key? The pass key is "
DIGITS = 5


@dataclass(frozen=True)
class Passkey:
    """The ``train.passkey`` node: the evaluation grid (``lengths`` in tokens; empty: no evaluation),
    ``depths`` (fractions in [0, 1]) and ``samples`` sequences per cell."""

    lengths: tuple = ()
    depths: tuple = (0.1, 0.5, 0.9)
    samples: int = 8

    def __post_init__(self):
        for name in ("lengths", "depths"):
            v = getattr(self, name)
            if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
                raise ValueError(f"train.passkey.{name}={v!r}: must be a list")
            object.__setattr__(self, name, tuple(v))
        for n in self.lengths:
            if isinstance(n, bool) or not isinstance(n, int) or n < span():
                raise ValueError(f"train.passkey.lengths: {n!r} must be an integer >= {span()} (a needle, a "
                                 "question and the answer fit)")
        for x in self.depths:
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1:
                raise ValueError(f"train.passkey.depths: {x!r} must be a number in [0, 1]")
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(f"train.passkey.samples={self.samples!r}: must be an integer >= 1")


def span() -> int:
    """Tokens a passkey takes: the needle, the question and the answer (bytes)."""
    key = b"0" * DIGITS
    return len(NEEDLE.replace(b"{key}", key)) + len(QUESTION) + DIGITS


def key_of(g: torch.Generator) -> bytes:
    return str(int(torch.randint(10 ** (DIGITS - 1), 10 ** DIGITS, (1,), generator=g))).encode()


def insert(tokens: torch.Tensor, depth: float, key: bytes) -> torch.Tensor:
    """``tokens`` [T] (bytes as int64) with the needle at ``depth`` of the text before the question, and the
    question and ``key`` as its last tokens; returns the answer's positions [DIGITS] (where each digit is the
    target: the token before it predicts it)."""
    T = tokens.shape[0]
    needle = torch.tensor(list(NEEDLE.replace(b"{key}", key)), dtype=tokens.dtype)
    tail = torch.tensor(list(QUESTION + key), dtype=tokens.dtype)
    room = T - len(tail) - len(needle)
    if room < 0:
        raise ValueError(f"passkey: {T} tokens hold no needle ({len(needle)}) and question ({len(tail)})")
    at = int(round(depth * room))
    tokens[at:at + len(needle)] = needle
    tokens[T - len(tail):] = tail
    return torch.arange(T - DIGITS, T)


def generator(seed: int, *what) -> torch.Generator:
    key = hashlib.blake2b("/".join(map(str, (seed, *what))).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)


def text(task, length: int, g: torch.Generator) -> torch.Tensor:
    """``length`` held-out bytes of ``task`` (a :class:`~experiments.lm.data.Text`): consecutive windows' bytes from a
    random start in its validation split (documents may join; the passkey is what is asked)."""
    data = task.split_bytes("val")
    if len(data) <= length:
        raise ValueError(f"train.passkey.lengths: {length} is longer than the held-out text ({len(data)} bytes)")
    start = int(torch.randint(0, len(data) - length, (1,), generator=g))
    return data[start:start + length].long()


@torch.no_grad()
def grid(model, task, pk: Passkey, seed: int, device, autocast) -> dict[str, float]:
    """The evaluation grid's accuracies (module docstring), one forward per sequence."""
    was = model.training
    model.eval()
    out = {}
    try:
        for n in pk.lengths:
            for depth in pk.depths:
                hits = 0
                for s in range(pk.samples):
                    g = generator(seed, n, depth, s)
                    tok = text(task, n, g)
                    at = insert(tok, float(depth), key_of(g))
                    with autocast():
                        logits = model(tok[None].to(device))
                    hits += int(bool((logits[0, at - 1].argmax(-1).cpu() == tok[at]).all()))
                out[f"passkey_acc_{n}_{round(100 * float(depth))}"] = hits / pk.samples
    finally:
        model.train(was)
    if out:
        out["passkey_acc"] = sum(out.values()) / len(out)
    return out


def heatmap(acc: dict[str, float], pk: Passkey, title: str, path) -> None:
    """Accuracy by length (x) and depth (y), one cell each, as the paper's Figure 5; a PNG at ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    depths = [round(100 * float(d)) for d in pk.depths]
    cells = [[acc[f"passkey_acc_{n}_{d}"] for n in pk.lengths] for d in depths]
    fig = Figure(figsize=(1.2 * len(pk.lengths) + 2.5, 0.6 * len(depths) + 1.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    im = ax.imshow(cells, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(pk.lengths)), [str(n) for n in pk.lengths])
    ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths])
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("needle depth")
    for i, row in enumerate(cells):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=9)
    fig.colorbar(im, ax=ax, label="passkey accuracy")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def passkey_rows(batch: torch.Tensor, share: float, g: torch.Generator) -> None:
    """Training: in place, about ``share`` of ``batch``'s rows [B, T+1] (tokens and the next byte) get a passkey
    at a random depth."""
    for b in range(batch.shape[0]):
        if float(torch.rand((), generator=g)) < share:
            insert(batch[b], float(torch.rand((), generator=g)), key_of(g))


__all__ = ["DIGITS", "NEEDLE", "Passkey", "QUESTION", "grid", "heatmap", "insert", "passkey_rows", "span"]
