"""Packed batches of documents ("varlen"): ``cu_seqlens`` checked once, and what the backends derive from it.

The layout of flash-attn's ``*_varlen_func`` and of fla (docs/nsa-spec.md, "Varlen"): documents of lengths
L_0 .. L_{n-1} are concatenated along the token axis of ``[1, N, heads, D]`` tensors, and
``cu_seqlens = [0, L_0, L_0 + L_1, ..., N]`` (int32, ``n_docs + 1`` entries, empty documents allowed).
Every document starts at position 0 and sees nothing of another. Its compressed keys/values are packed
in document order too: document i owns compressed rows ``cu_cmp[i] .. cu_cmp[i+1]``, with n_cmp(L_i) of
them.

    docs = Varlen(cu_seqlens)        # validates (one host sync for a CUDA tensor)
    y = layer(x, cu_seqlens=docs)    # pass the same object to every layer: no further sync, tables kept

A key stream (``nsa.backends.triton.tiles``) with key i ending at raw position i*stride + offset has
``max(0, (L - 1 - offset) // stride + 1)`` keys in a document of L tokens: the raw keys (stride 1,
offset 0) and the compressed tokens (stride d, offset l - 1, i.e. n_cmp(L)) are both such streams.
"""
from __future__ import annotations

import torch

_RULE = "a 1-D int32 tensor [n_docs + 1] of non-decreasing token offsets, 0 first and N last"


def _fail(msg: str):
    raise ValueError(msg)


class Varlen:
    """The documents of a packed batch, from ``cu_seqlens`` (checked: a ValueError names the rule).

    Host-side: ``lens`` / ``starts`` (tuples of ints), ``total`` (N), ``max_len``. Device tensors and the
    triton backend's tile tables are made on first use and kept (one object per batch, shared by layers).

    Arguments:
        cu_seqlens: (n_docs + 1,) int32, non-decreasing token offsets, 0 first and N last (empty documents
            allowed); on any device (a CUDA tensor costs one host sync, here only).
    Attributes:
        cu_seqlens: the same offsets, contiguous.
        starts: (n_docs,) ints, each document's first token in the packed axis.
        lens: (n_docs,) ints, the documents' lengths L_i.
        total: N, the packed tokens.
        max_len: the longest document's length.
    """

    def __init__(self, cu_seqlens: torch.Tensor):
        if isinstance(cu_seqlens, Varlen):
            raise TypeError("Varlen(cu_seqlens): already a Varlen; pass it as it is")
        if not isinstance(cu_seqlens, torch.Tensor):
            _fail(f"cu_seqlens: must be {_RULE}; got {type(cu_seqlens).__name__}")
        if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            _fail(f"cu_seqlens: must be {_RULE}; got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
        cu = cu_seqlens.tolist()  # one host sync on a CUDA tensor
        if cu[0] != 0:
            _fail(f"cu_seqlens: must be {_RULE}; its first offset is {cu[0]}")
        for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
            if b < a:
                _fail(f"cu_seqlens: must be {_RULE}; offset {i + 1} ({b}) is below offset {i} ({a})")
        self.cu_seqlens = cu_seqlens.contiguous()  # the kernels index it as a dense array
        self.starts = tuple(cu[:-1])
        self.lens = tuple(b - a for a, b in zip(cu[:-1], cu[1:]))
        self.total = cu[-1]
        self.max_len = max(self.lens)
        self._kept: dict = {}

    def __repr__(self) -> str:
        return f"Varlen(n_docs={self.n_docs}, total={self.total}, max_len={self.max_len})"

    @property
    def n_docs(self) -> int:
        """Returns: the number of packed documents."""
        return len(self.lens)

    def check_total(self, n: int, name: str) -> None:
        """``name`` holds n packed tokens: they must be the N of cu_seqlens."""
        if n != self.total:
            _fail(f"cu_seqlens: its last offset N={self.total} must be the token count of {name}, which has {n}")

    def kept(self, key, make):
        """``make()``, made once per key and kept with the documents (what a backend derives from them)."""
        if key not in self._kept:
            self._kept[key] = make()
        return self._kept[key]

    # --- key streams -------------------------------------------------------------------------------
    def key_counts(self, stride: int = 1, offset: int = 0) -> tuple[int, ...]:
        """Keys per document of the stream whose key i ends at raw position i*stride + offset."""
        return tuple(max(0, (n - 1 - offset) // stride + 1) for n in self.lens)

    def cmp_counts(self, config) -> tuple[int, ...]:
        """n_cmp(L_i) compressed tokens per document (Eq. 7 over each document alone)."""
        return self.key_counts(config.d, config.l - 1)

    def n_blocks(self, config) -> int:
        """Selection blocks of the longest document: the width of score and index tensors."""
        return config.n_blocks(self.max_len)

    # --- device tensors (int32) ----------------------------------------------------------------------
    def _tensor(self, values, device) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).to(device)

    def cu(self, device) -> torch.Tensor:
        """cu_seqlens on ``device`` (int32)."""
        device = torch.device(device)
        if self.cu_seqlens.device == device:
            return self.cu_seqlens
        return self.kept(("cu", device), lambda: self.cu_seqlens.to(device))

    def cu_keys(self, device, stride: int = 1, offset: int = 0) -> torch.Tensor:
        """Offsets of each document's keys in a packed key stream (``cu`` for raw keys), int32."""
        if (stride, offset) == (1, 0):
            return self.cu(device)

        def make():
            counts = torch.tensor((0,) + self.key_counts(stride, offset), dtype=torch.int64)
            return counts.cumsum(0).to(torch.int32).to(device)

        return self.kept(("cu_keys", stride, offset, torch.device(device)), make)

    def row_doc(self, device) -> torch.Tensor:
        """Document of each packed token [N], int32."""
        def make():
            lens = torch.tensor(self.lens, dtype=torch.int64)
            return torch.repeat_interleave(torch.arange(self.n_docs, dtype=torch.int32), lens).to(device)

        return self.kept(("row_doc", torch.device(device)), make)

    def row_pos(self, device) -> torch.Tensor:
        """Position of each packed token in its document [N], int32."""
        def make():
            doc = self.row_doc("cpu").to(torch.int64)
            start = torch.tensor(self.starts, dtype=torch.int64)
            return (torch.arange(self.total) - start[doc]).to(torch.int32).to(device)

        return self.kept(("row_pos", torch.device(device)), make)

    def cmp_tokens(self, config, device):
        """(document, index in it) of every packed compressed token [sum n_cmp(L_i)], int64: token i of
        document k summarizes the raw rows cu[k] + i*d .. + l (Eq. 7 over the document alone)."""
        def make():
            counts = torch.tensor(self.cmp_counts(config), dtype=torch.int64)
            doc = torch.repeat_interleave(torch.arange(self.n_docs), counts)
            index = torch.arange(int(counts.sum())) - (counts.cumsum(0) - counts)[doc]
            return doc.to(device), index.to(device)

        return self.kept(("cmp_tokens", config.l, config.d, torch.device(device)), make)

    # --- tile tables of the triton backend -------------------------------------------------------------
    def query_tiles(self, block: int, device, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """``[n_tiles, 2]`` int32 (document, first position) of the tiles of ``block`` query positions that
        cover the packed rows [lo, hi) (each document's part of them, tiles from its first row there), the
        tiles that start latest first: their causal key ranges are the longest."""
        hi = self.total if hi is None else hi
        return self.kept(("query_tiles", block, lo, hi, torch.device(device)),
                          lambda: _tiles(self.lens, self.starts, block, lo, hi, None).to(device))

    def key_tiles(self, block: int, device, stride: int = 1, offset: int = 0, window: int = 0) -> torch.Tensor:
        """``[n_tiles, 2]`` int32 (document, first key) of the tiles of ``block`` keys of a key stream, the
        tiles that the most queries see first (a query at t sees key i iff i*stride + offset <= t, and
        t < i*stride + offset + window with a window)."""
        counts = self.key_counts(stride, offset)

        def work(doc, n0):  # queries that see the tile's first key
            n_q = torch.tensor(self.lens, dtype=torch.int64)[doc] - (n0 * stride + offset)
            return n_q.clamp(max=window + block * stride) if window else n_q

        return self.kept(("key_tiles", block, stride, offset, window, torch.device(device)),
                          lambda: _tiles(counts, None, block, 0, None, work).to(device))


def _tiles(counts, starts, block, lo, hi, work) -> torch.Tensor:
    """Tiles of ``block`` rows over each document's ``counts`` rows, restricted to packed rows [lo, hi)
    when ``starts`` is given; ordered by ``work(doc, first)`` (default: the first row), largest first."""
    c = torch.tensor(counts, dtype=torch.int64)
    if starts is None:
        a, b = torch.zeros_like(c), c
    else:
        s = torch.tensor(starts, dtype=torch.int64)
        a = (lo - s).clamp(min=0)
        b = torch.minimum(c, (hi - s).clamp(min=0))
    n = ((b - a).clamp(min=0) + block - 1) // block
    doc = torch.repeat_interleave(torch.arange(len(counts)), n)
    first = a[doc] + (torch.arange(int(n.sum())) - (n.cumsum(0) - n)[doc]) * block
    key = first if work is None else work(doc, first)
    order = torch.sort(key, descending=True, stable=True).indices
    return torch.stack([doc, first], 1)[order].to(torch.int32).contiguous()


def as_varlen(cu_seqlens) -> Varlen | None:
    """The packed documents of a ``cu_seqlens`` argument.

    Arguments:
        cu_seqlens: None, a :class:`Varlen`, or an int32 (n_docs + 1,) tensor of offsets.
    Returns:
        docs: None for None, the Varlen as it is, or a new Varlen (checked).
    """
    if cu_seqlens is None or isinstance(cu_seqlens, Varlen):
        return cu_seqlens
    return Varlen(cu_seqlens)
