"""Training data, generated or read in process (no download): a long-range retrieval task and a
small real text corpus.

A task hands out batches ``(tokens [B,T] int64, targets [B,T] int64)``; ``targets`` is
``IGNORE`` (-100, ``F.cross_entropy``'s ``ignore_index``) where no loss is taken. Batch ``i`` of a
split is a pure function of ``(seed, split, i)``: the data position is one integer (batches
consumed), stored in the checkpoint, and a resumed run sees the batches an uninterrupted one sees.

* :class:`Retrieval`: multi-query associative recall (MQAR; Arora et al. 2023, "Zoology") over a
  long context. ``n_pairs`` key/value pairs ``k v`` lie at random positions among filler tokens;
  the last ``2 * n_queries`` tokens ask ``n_queries`` of the keys again, each followed by its
  value. The loss is taken at the queried keys only (predict the value that follows). No pair lies
  within ``gap`` tokens of the query region. A stack of L sliding-window layers reaches L (w - 1)
  tokens back, so with ``gap >= L (w - 1)`` the window model can only guess (accuracy 1 / n_values);
  with a smaller gap it can relay the last pairs through its layers.
* :class:`Needles`: multi-needle retrieval, single hop (one value of each slot hidden in filler; the
  query names the slot): the long-range lookup a small model learns quickly.
* :class:`Text`: byte-level language modelling on text that CPython ships: its English documentation
  (``data.corpus=pydoc``: ``pydoc_data.topics``, ~465 KB in 3.11, short topics) or its standard library's
  source files (``data.corpus=stdlib``: one document a file, hundreds longer than 8k bytes, for long-context
  training), every 8th document held out for validation; or the source files of every installed package
  (``data.corpus=site``: hundreds of MB, a training reads it once; one file in 8 held out by a hash of its
  path). Training windows are drawn without replacement, reshuffled every epoch.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import ClassVar

import torch

from . import passkey

IGNORE = -100
SPLITS = ("train", "val")


def generator(seed: int, split: str, index: int) -> torch.Generator:
    """A CPU generator for batch ``index`` of ``split``, the same on every machine and Python."""
    key = hashlib.blake2b(f"{seed}/{split}/{index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)


def _check_split(split):
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: must be one of {SPLITS}")


def _int_at_least(name: str, v, lo: int):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name}={v!r}: must be an integer >= {lo}")
    if v > 2**63 - 1:
        raise ValueError(f"{name}={v!r}: must be an integer from {lo} to 2**63 - 1 (torch's int64)")


def _positive(prefix: str, obj, names):
    for f in names:
        _int_at_least(f"{prefix}.{f}", getattr(obj, f), 1)


def _ask(tok: torch.Tensor, g: torch.Generator, cues: torch.Tensor, answers: torch.Tensor, n_queries: int):
    """The query region of a lookup task, in place in ``tok [B,T]``: its last ``2 * n_queries`` tokens ask
    ``n_queries`` of the ``cues [B,N]`` (drawn without repeats, in random order), each followed by its
    answer (``answers [B,N]``); returns the targets: the answer at each cue, IGNORE elsewhere."""
    B, T = tok.shape
    ask = torch.rand(cues.shape, generator=g).argsort(-1)[:, :n_queries]  # which cues are asked, in which order
    qpos = T - 2 * n_queries + 2 * torch.arange(n_queries)
    rows = torch.arange(B)[:, None]
    tok[rows, qpos], tok[rows, qpos + 1] = cues.gather(1, ask), answers.gather(1, ask)
    tgt = torch.full((B, T), IGNORE, dtype=torch.int64)
    tgt[rows, qpos] = answers.gather(1, ask)
    return tgt


class _Lookup:
    """What the lookup tasks share: ``n_queries`` questions in the last ``2 * n_queries`` tokens (``_ask``),
    ``gap`` tokens before them, and what they ask about in the ``context`` tokens before the gap."""

    # the loss is taken at a few answer positions (the probes also report NSA's gates and selection there)
    answers_only: ClassVar[bool] = True

    @property
    def context(self) -> int:
        """Tokens before the gap: where the task hides what it asks about."""
        return self.seq_len - 2 * self.n_queries - self.gap

    def sources(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Where each answer's source token sits (``experiments.lm.ablations``' oracle selection): ``[B,T]``
        int64, at each answer position (targets != IGNORE) the position of the context token the answer
        copies (:meth:`_source`), -1 elsewhere. A pure function of a batch ``(tokens, targets)``."""
        src = torch.full_like(targets, -1)
        b, t = (targets != IGNORE).nonzero(as_tuple=True)
        if len(b):
            src[b, t] = self._source(tokens, targets, b, t)
        return src

    def _check_room(self, tokens: int, what: str):
        """``tokens`` tokens must fit in ``context``; else a one-line error naming ``what`` they hold."""
        if self.context < tokens:
            need = tokens + 2 * self.n_queries + self.gap
            raise ValueError(f"data.seq_len={self.seq_len}: too short for {what}, the gap of {self.gap} "
                             f"and {self.n_queries} queries (needs >= {need})")


@dataclass(frozen=True)
class Retrieval(_Lookup):
    """MQAR (see the module docstring). Token ids: values ``[0, n_values)``, keys
    ``[n_values, n_values + n_keys)``, filler after them."""

    seq_len: int
    n_pairs: int
    n_queries: int
    n_keys: int
    n_values: int
    n_filler: int
    gap: int
    seed: int = 0
    task: str = "retrieval"

    def __post_init__(self):
        _positive("data", self, ("seq_len", "n_pairs", "n_queries", "n_keys", "n_values", "n_filler"))
        _int_at_least("data.gap", self.gap, 0)
        if self.n_pairs > self.n_keys:
            raise ValueError(f"data.n_pairs={self.n_pairs}: must be <= n_keys={self.n_keys} (keys are distinct)")
        if self.n_queries > self.n_pairs:
            raise ValueError(f"data.n_queries={self.n_queries}: must be <= n_pairs={self.n_pairs}")
        self._check_room(2 * self.n_pairs, f"{self.n_pairs} pairs")  # the pairs lie in [0, context)

    @property
    def vocab_size(self) -> int:
        return self.n_values + self.n_keys + self.n_filler

    def batch(self, split: str, index: int, batch_size: int):
        _check_split(split)
        g = generator(self.seed, split, index)
        B, P, Q, V = batch_size, self.n_pairs, self.n_queries, self.n_values
        tok = V + self.n_keys + torch.randint(self.n_filler, (B, self.seq_len), generator=g)
        keys = V + torch.rand(B, self.n_keys, generator=g).argsort(-1)[:, :P]  # distinct keys per row
        vals = torch.randint(V, (B, P), generator=g)
        # P non-overlapping pair starts in [0, context - 1): sorted distinct draws s_i, start_i = s_i + i.
        s = torch.rand(B, self.context - P, generator=g).argsort(-1)[:, :P].sort(-1).values
        start = s + torch.arange(P)
        rows = torch.arange(B)[:, None]
        tok[rows, start], tok[rows, start + 1] = keys, vals
        return tok, _ask(tok, g, keys, vals, Q)  # at a queried key, predict its value

    @staticmethod
    def _source(tokens, targets, b, t):
        """The value after the queried key's first (in context: only) occurrence; keys are distinct per row
        and no filler or value token is a key."""
        return (tokens[b] == tokens[b, t][:, None]).int().argmax(-1) + 1


@dataclass(frozen=True)
class Needles(_Lookup):
    """Multi-needle retrieval (single hop; RULER's multi-key needle-in-a-haystack, Hsieh et al. 2024, in
    its simplest form). Each of ``n_slots`` slots owns ``n_values`` value tokens; every sequence hides one
    value of each slot (the needle) at a random position among filler tokens; the last ``2 * n_queries``
    tokens ask ``n_queries`` of the slots (a slot token, then its needle), and the loss is taken at the slot
    tokens (predict the slot's needle). No needle lies within ``gap`` tokens of the queries. Where MQAR
    needs two attention hops (find the key, read the token after it), a needle is found and read in one,
    so a small model learns it in hundreds of steps where MQAR takes many thousands; beyond a window stack's
    reach (``gap``) only the long-range branches can fetch it. Token ids: slot j's values
    ``[j * n_values, (j + 1) * n_values)``, then the slot tokens, then filler."""

    seq_len: int
    n_slots: int
    n_queries: int
    n_values: int
    n_filler: int
    gap: int
    seed: int = 0
    task: str = "needles"

    def __post_init__(self):
        _positive("data", self, ("seq_len", "n_slots", "n_queries", "n_values", "n_filler"))
        _int_at_least("data.gap", self.gap, 0)
        if self.n_queries > self.n_slots:
            raise ValueError(f"data.n_queries={self.n_queries}: must be <= n_slots={self.n_slots}")
        self._check_room(self.n_slots, f"{self.n_slots} needles")  # the needles lie in [0, context)

    @property
    def vocab_size(self) -> int:
        return self.n_slots * (self.n_values + 1) + self.n_filler

    def batch(self, split: str, index: int, batch_size: int):
        _check_split(split)
        g = generator(self.seed, split, index)
        B, S, Q, V = batch_size, self.n_slots, self.n_queries, self.n_values
        first_slot = S * V
        tok = first_slot + S + torch.randint(self.n_filler, (B, self.seq_len), generator=g)
        needle = torch.arange(S) * V + torch.randint(V, (B, S), generator=g)  # slot j's needle, in its range
        pos = torch.rand(B, self.context, generator=g).argsort(-1)[:, :S]  # distinct positions
        rows = torch.arange(B)[:, None]
        tok[rows, pos] = needle
        slots = (first_slot + torch.arange(S)).expand(B, S)
        return tok, _ask(tok, g, slots, needle, Q)  # at a slot token, predict that slot's needle

    @staticmethod
    def _source(tokens, targets, b, t):
        """The needle: the first occurrence of the answer's value token (a slot's values occur only as its
        needle, in the context, and as answers in the query region after it)."""
        return (tokens[b] == targets[b, t][:, None]).int().argmax(-1)


CORPORA = ("pydoc", "stdlib", "site")


@functools.lru_cache(maxsize=1)
def stdlib_documents() -> tuple[tuple[str, bytes], ...]:
    """The Python standard library's own source files (``sysconfig``'s ``stdlib`` folder, ``*.py``, outside
    its tests, ``site-packages`` and ``idlelib``), ``(relative path, bytes)`` sorted by path: real, public
    text (code, docstrings and comments by CPython's authors, PSF licence), each file one document, hundreds
    of them longer than 8k bytes. Python ships it: nothing is downloaded (it differs between Python versions)."""
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "__pycache__"}
    docs = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if skip.isdisjoint(rel.parts):
            docs.append((rel.as_posix(), f.read_bytes()))
    return tuple(docs)


@functools.lru_cache(maxsize=1)
def site_documents() -> tuple[tuple[str, bytes], ...]:
    """The Python source files of the interpreter's installed packages (``sysconfig``'s purelib and platlib
    folders, ``*.py`` outside ``__pycache__``), ``(relative path, bytes)`` sorted by path: tens of thousands of
    files, hundreds of MB on a host with torch and its peers (real code, docstrings and comments under their
    packages' licences), enough that a long training reads it once. Nothing is downloaded; it is what this
    environment has installed, which the run's fingerprint records (:meth:`Text.fingerprint`)."""
    import sysconfig
    from pathlib import Path

    docs = {}
    for root in sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")}):
        for f in Path(root).rglob("*.py"):
            rel = f.relative_to(root).as_posix()
            if "__pycache__" not in f.parts and rel not in docs and f.is_file():
                docs[rel] = f.read_bytes()
    return tuple(sorted(docs.items()))


def held_out(name: str, val_stride: int) -> bool:
    """A ``site`` file in the validation split: one in ``val_stride`` by a hash of its path, so that installing or
    removing a package moves no other file between the splits."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") % val_stride == 0


def corpus_files(corpus: str, split: str, val_stride: int) -> list[tuple[str, bytes]]:
    """The documents of ``corpus`` in ``split``, ``(name, bytes)`` in sorted order. ``pydoc``: the topics of
    ``pydoc_data.topics`` (CPython's documentation text, short: a median of ~1.7 KB) and ``stdlib``
    (:func:`stdlib_documents`): every ``val_stride``-th one (indices val_stride-1, 2*val_stride-1, ..) in ``val``,
    the rest in ``train``; ``site`` (:func:`site_documents`): the files :func:`held_out` names in ``val``."""
    _check_split(split)
    if corpus == "pydoc":
        from pydoc_data.topics import topics

        docs = [(k, topics[k].encode("utf-8")) for k in sorted(topics)]
    elif corpus == "stdlib":
        docs = list(stdlib_documents())
    elif corpus == "site":
        return [d for d in site_documents() if held_out(d[0], val_stride) == (split == "val")]
    else:
        raise ValueError(f"data.corpus={corpus!r}: must be one of {CORPORA}")
    return [d for i, d in enumerate(docs) if (i % val_stride == val_stride - 1) == (split == "val")]


def corpus_documents(corpus: str, split: str, val_stride: int) -> list[bytes]:
    """The documents' bytes of :func:`corpus_files`."""
    return [b for _, b in corpus_files(corpus, split, val_stride)]


def corpus_bytes(split: str, val_stride: int) -> torch.Tensor:
    """The text of ``pydoc_data.topics`` (CPython's standard library) as bytes: topics in sorted order,
    every ``val_stride``-th one (indices val_stride-1, 2*val_stride-1, ..) in ``val``, the rest in ``train``."""
    text = b"\n\n".join(corpus_documents("pydoc", split, val_stride))
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).clone()


@functools.lru_cache(maxsize=4)
def _windows(corpus: str, split: str, val_stride: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A split's bytes and the start of each of its windows (made once per process: a run builds its task
    several times, and ``site``'s bytes are hundreds of MB)."""
    if corpus == "pydoc":
        text = corpus_bytes(split, val_stride)
        return text, torch.arange((len(text) - 1) // seq_len, device="cpu") * seq_len
    docs = corpus_documents(corpus, split, val_stride)
    text = torch.frombuffer(bytearray(b"".join(docs)), dtype=torch.uint8).clone()
    # explicit CPU tensors: a task is also made under torch.device("meta") (loop.parameter_counts)
    offsets = torch.tensor([0, *(len(d) for d in docs)], device="cpu").cumsum(0)
    starts = torch.cat([o + torch.arange(max(0, (len(d) - 1) // seq_len), device="cpu") * seq_len
                        for o, d in zip(offsets.tolist(), docs)])
    return text, starts


@dataclass(frozen=True)
class Text:
    """Byte-level next-token prediction (vocabulary 256) on a corpus split by document (``corpus``):
    ``pydoc`` (:func:`corpus_bytes`: the topics joined, windows across them), ``stdlib``
    (:func:`stdlib_documents`) or ``site`` (:func:`site_documents`: windows inside one file each, so every window
    is one document's; files shorter than a window are left out). A split's windows are non-overlapping
    ``seq_len + 1``-byte windows; training visits them in a fresh permutation every epoch, validation batch i takes
    windows i*B.. of one fixed permutation."""

    # every position is a target
    answers_only: ClassVar[bool] = False
    seq_len: int
    val_stride: int = 8
    corpus: str = "pydoc"
    seed: int = 0
    task: str = "text"
    # the share of training rows that carry a passkey (experiments/lm/passkey.py), so that the task is learnt
    passkey_share: float = 0.0

    def __post_init__(self):
        _positive("data", self, ("seq_len",))
        _int_at_least("data.val_stride", self.val_stride, 2)
        if self.corpus not in CORPORA:
            raise ValueError(f"data.corpus={self.corpus!r}: must be one of {CORPORA}")
        share = self.passkey_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise ValueError(f"data.passkey_share={share!r}: must be a number in [0, 1]")
        if share and self.seq_len < passkey.span():
            raise ValueError(f"data.passkey_share={share}: data.seq_len={self.seq_len} holds no passkey "
                             f"({passkey.span()} tokens)")
        text, starts = {}, {}
        for split in SPLITS:
            text[split], starts[split] = _windows(self.corpus, split, self.val_stride, self.seq_len)
            if len(starts[split]) == 0:
                raise ValueError(f"data.seq_len={self.seq_len}: the {split} split of corpus {self.corpus!r} holds no "
                                 f"window of {self.seq_len + 1} bytes")
        object.__setattr__(self, "_bytes", text)
        object.__setattr__(self, "_starts", starts)

    @property
    def vocab_size(self) -> int:
        return 256

    def windows(self, split: str) -> int:
        return len(self._starts[split])

    def fingerprint(self) -> dict[str, str]:
        """What the corpus was, per split: its files, bytes and a hash of their names in order (``data_files_train``,
        ``data_bytes_train``, ``data_names_train``, the same for val), logged as the run's params."""
        out = {}
        for split in SPLITS:
            files = corpus_files(self.corpus, split, self.val_stride)
            names = hashlib.blake2b("\n".join(n for n, _ in files).encode(), digest_size=8).hexdigest()
            out.update({f"data_files_{split}": str(len(files)), f"data_bytes_{split}": str(sum(len(b) for _, b in files)),
                        f"data_names_{split}": names})
        return out

    def batch(self, split: str, index: int, batch_size: int):
        _check_split(split)
        n = self.windows(split)
        items = range(index * batch_size, (index + 1) * batch_size)
        # Item i is window perm_e[i % n] of epoch e = i // n (validation: always epoch 0).
        epochs = {i // n if split == "train" else 0 for i in items}
        perms = {e: torch.randperm(n, generator=generator(self.seed, split, e)) for e in epochs}
        win = torch.stack([perms[i // n if split == "train" else 0][i % n] for i in items])
        idx = self._starts[split][win][:, None] + torch.arange(self.seq_len + 1)
        chunk = self._bytes[split][idx].long()
        if self.passkey_share and split == "train":
            passkey.passkey_rows(chunk, self.passkey_share, generator(self.seed, "passkey", index))
        return chunk[:, :-1], chunk[:, 1:]

    def split_bytes(self, split: str) -> torch.Tensor:
        """The split's text, its documents joined (uint8)."""
        return self._bytes[split]


TASKS = {"retrieval": Retrieval, "needles": Needles, "text": Text}


def make_task(data: dict, seed: int):
    """The task named by ``data['task']`` (``conf/data/*.yaml``), with the run's seed."""
    data = dict(data)
    task = data.get("task")
    if task not in TASKS:
        raise ValueError(f"data.task={task!r}: must be one of {tuple(TASKS)}")
    known = {f for f in TASKS[task].__dataclass_fields__}
    extra = sorted(set(data) - known)
    if extra:
        raise ValueError(f"data: unknown field(s) {extra} for task {task!r}; known: {sorted(known - {'seed'})}")
    return TASKS[task](**{**data, "seed": seed})
