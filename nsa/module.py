"""NSAAttention: the NSA layer as an ``nn.Module``, with prefill and cached decode.

Paper Section 3 (Yuan et al., arXiv 2502.11089): one query projection, independent key/value
projections for each branch (Section 3.3.3), compression phi (Eq. 7), gates g = sigmoid(MLP(x))
(Eq. 5), output projection.

Positions (the project's choice, spec "Module level"): RoPE rotates queries and the selection and
window keys at their absolute positions. The compression branch's raw keys are rotated at their
absolute positions *before* phi, so each compressed key summarizes keys that already carry their
position; phi's learnable intra-block position embedding (Eq. 7) is added on top. Values are not
rotated.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import functional
from .compat import autocast_enabled
from .config import NSAConfig
from .varlen import as_varlen


def rope_cos_sin(pos: torch.Tensor, D: int, base: float, dtype: torch.dtype):
    """RoPE's cos and sin tables ``[T, D]`` at absolute positions ``pos [T]``, in ``dtype``."""
    inv = base ** (-torch.arange(0, D, 2, device=pos.device, dtype=dtype) / D)
    ang = pos.to(dtype)[:, None] * inv[None, :]  # [T, D/2]
    return torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` (last dim D) with tables broadcast against it, computed in the
    tables' dtype and returned in x's."""
    xa = x.to(cos.dtype)
    x1, x2 = xa.chunk(2, dim=-1)
    return (xa * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


def rope(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary embedding (rotate-half form) of ``x [B,T,H,D]`` at absolute positions ``pos [T]``."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = rope_cos_sin(pos, x.shape[-1], base, acc)
    return apply_rope(x, cos[None, :, None, :], sin[None, :, None, :])


class PhiMLP(nn.Module):
    """Eq. 7's phi: a learnable MLP over a block of l keys (or values) plus an intra-block
    position embedding, l*D -> hidden -> D."""

    def __init__(self, l: int, D: int, hidden: int):  # noqa: E741
        super().__init__()
        pe = torch.empty(l, D)
        # On the meta device (parameter counts, memory estimates) there is no value to draw: a meta randn and
        # multiply run Python kernels whose first calls cost ~2 s of a CLI's start (torch._dynamo's import).
        self.pe = nn.Parameter(pe if pe.is_meta else torch.randn(l, D) * 0.02)
        self.fc1 = nn.Linear(l * D, hidden)
        self.fc2 = nn.Linear(hidden, D)

    @torch.no_grad()
    def init_mean(self) -> None:
        """Start as mean pooling over the block: hidden units j and D + j read +-mean_j (the mean of dim j over
        the l keys), fc2 writes GELU(m) - GELU(-m) = m to dim j. Hidden units past 2D keep their fc1 weights and
        write nothing yet (fc2 columns zero). The position embedding is left as it is."""
        l, D = self.pe.shape
        H = self.fc1.out_features
        if H < 2 * D:
            raise ValueError(f"phi: mean init needs a hidden width >= 2 * D = {2 * D}, got {H}")
        mean = torch.zeros(D, l, D, dtype=self.fc1.weight.dtype, device=self.fc1.weight.device)
        mean[torch.arange(D), :, torch.arange(D)] = 1.0 / l  # [out dim j, position i, in dim j]
        self.fc1.weight[:D] = mean.flatten(1)
        self.fc1.weight[D:2 * D] = -mean.flatten(1)
        self.fc1.bias[:2 * D] = 0.0
        self.fc2.weight.zero_()
        self.fc2.weight[:, :D] = torch.eye(D)
        self.fc2.weight[:, D:2 * D] = -torch.eye(D)
        self.fc2.bias.zero_()

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:  # [B,Tc,H,l,D] -> [B,Tc,H,D]
        """Arguments:
            blocks: the raw tokens of each compression block ``[B,Tc,H,l,D]``.

        Returns:
            One compressed token per block ``[B,Tc,H,D]`` (paper Eq. 7's phi: an MLP over the block plus its
            intra-block position embedding).
        """
        return self.fc2(F.gelu(self.fc1((blocks + self.pe).flatten(-2))))


@dataclass
class NSACache:
    """Preallocated decode cache: each branch's raw keys/values and the compressed stream.

    ``k_cmp_raw`` holds the compression branch's rotated raw keys; compressed token i is written
    when its block completes (position i*d + l - 1), as in prefill.

    Positions (spec "Module level", ragged decode): row b holds the tokens at positions
    0 .. lengths[b]-1 and appends its next token at lengths[b]. A uniform cache has every row at
    ``length`` (an int). A packed prefill (``NSAAttention.forward(x, cache, cu_seqlens=cu)``, one
    document per row) leaves a *ragged* cache: ``lengths`` differ per row (``ragged`` is true) and
    ``length`` is then the longest row's, the one that bounds what still fits in ``max_len``.
    Assigning ``length`` puts every row there (uniform again; ``reset()`` is ``length = 0``);
    assigning ``lengths`` (a ``[B]`` int sequence or tensor) sets each row's, uniform when all are equal.
    """

    k_cmp_raw: torch.Tensor
    v_cmp_raw: torch.Tensor
    k_cmp: torch.Tensor
    v_cmp: torch.Tensor
    k_sel: torch.Tensor
    v_sel: torch.Tensor
    k_win: torch.Tensor
    v_win: torch.Tensor
    max_len: int
    length: int = 0

    def __setattr__(self, name, value):
        if name == "length":  # an int length: every row is there
            object.__setattr__(self, "_rows", None)
        object.__setattr__(self, name, value)

    @property
    def batch_size(self) -> int:
        """Returns: the number of sequences (rows) the cache holds."""
        return self.k_sel.shape[0]

    @property
    def ragged(self) -> bool:
        """True while rows hold different numbers of tokens (after a packed prefill)."""
        return self._rows is not None

    @property
    def lengths(self) -> torch.Tensor:
        """Tokens held by each row: int64 ``[B]`` on the CPU (a copy; assign to change)."""
        if self._rows is None:
            return torch.full((self.batch_size,), int(self.length), dtype=torch.int64)
        return self._rows.clone()

    @lengths.setter
    def lengths(self, value) -> None:
        rows = torch.as_tensor(value).detach().to("cpu", torch.int64).clone()
        B = self.batch_size
        if rows.shape != (B,):
            raise ValueError(f"cache.lengths: expected {B} row lengths (batch_size), got shape {tuple(rows.shape)}")
        if int(rows.min()) < 0 or int(rows.max()) > self.max_len:
            raise ValueError(f"cache.lengths: each must be in [0, max_len={self.max_len}], got {rows.tolist()}")
        if bool((rows == rows[0]).all()):
            self.length = int(rows[0])
        else:
            object.__setattr__(self, "length", int(rows.max()))
            object.__setattr__(self, "_rows", rows)

    def row(self, b: int) -> NSACache:
        """Row b alone: a cache of one sequence whose buffers are views of row b's (writes land in this
        cache), at that row's length. Its positions do not flow back: set ``lengths`` afterwards."""
        names = ("k_cmp_raw", "v_cmp_raw", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win")
        n = int(self._rows[b]) if self._rows is not None else self.length
        return NSACache(*(getattr(self, f)[b:b + 1] for f in names), max_len=self.max_len, length=n)

    def reset(self) -> None:
        """Empty every row (length 0), keeping the buffers."""
        self.length = 0


def forward_rows(step, x: torch.Tensor, cache: NSACache) -> torch.Tensor:
    """A ragged cache: each row's T tokens of ``x [B,T,dim]`` at its own position, through ``step(x_b,
    cache_b)`` (a layer's one-sequence cached forward) on the row's views (the reference: a loop over
    rows). Nothing is written unless every row fits."""
    B, T, _ = x.shape
    if B != cache.batch_size:
        raise ValueError(f"x: batch {B} differs from the cache's batch_size {cache.batch_size}")
    lengths = cache.lengths
    if cache.length + T > cache.max_len:
        raise ValueError(f"cache: appending {T} tokens at position {cache.length} (its longest row) exceeds "
                         f"max_len={cache.max_len}")
    y = torch.cat([step(x[b:b + 1], cache.row(b)) for b in range(B)], 0)
    cache.lengths = lengths + T
    return y


class NSAAttention(nn.Module):
    """The NSA attention layer. ``forward(x [B,T,dim], cache=None, *, cu_seqlens=None) -> [B,T,dim]``.

    Without a cache, x is a whole sequence at positions 0..T-1 (prefill / training). With a
    cache, x's tokens are appended at positions cache.length.. (a prefill chunk or decode steps)
    and attend to everything cached before them; the result equals prefill at those positions.
    With ``cu_seqlens`` (no cache), x ``[1,N,dim]`` holds documents packed along N (see
    :mod:`nsa.varlen`): each is its own sequence at positions 0..L_i-1, as if run alone.

    Ragged batches (continuous batching): ``forward(x [1,N,dim], cache, cu_seqlens=cu)`` is a prefill
    of packed prompts into an empty cache, one document per row (document i -> row i, at positions
    0..L_i-1, compressed as if alone); the output is the packed forward's and ``cache.lengths``
    becomes (L_0, ..). Later calls ``forward(x [B,T,dim], cache)`` append each row's T tokens at its
    own position ``cache.lengths[b]`` (decode steps, or chunks): row b equals its sequence run alone.

    Context parallelism: ``forward(x_r, cp_group=group)`` with x_r this rank's part of one sequence
    (:func:`nsa.context_parallel.shard`) gives this rank's part of the output (:mod:`nsa.context_parallel`);
    each rank's parameter gradients then sum, over the ranks, to the single-device ones. With
    ``cu_seqlens`` (the whole packed sequence's, on every rank; x_r ``[1,2C,dim]`` its shard) the same for
    packed documents, each at positions from its own start, as ``forward(x, cu_seqlens=..)`` gives them.

    ``backend`` / ``fallback`` / ``streams`` are passed to :func:`nsa.functional.nsa_attention`.
    """

    def __init__(self, config: NSAConfig, *, backend="reference", fallback: str | None = None, streams: bool = True):
        super().__init__()
        c = self.config = config
        if c.rope_rule():
            raise ValueError(f"NSAConfig.d_k={c.d_k}: {c.rope_rule()}")
        self.backend, self.fallback, self.streams = backend, fallback, streams
        HQ, H, Dk, Dv = c.n_heads, c.n_kv_heads, c.d_k, c.d_v
        self.q_proj = nn.Linear(c.dim, HQ * Dk, bias=c.qkv_bias)
        if c.shared_kv:
            # One key and one value projection for every branch: the same module under each branch's name
            # (the selection's first, so parameter listings name each weight once, as the selection's), so
            # every reader of kv_proj["k_cmp"] etc. (decode, context parallel) gets the shared one.
            k, v = nn.Linear(c.dim, H * Dk, bias=c.qkv_bias), nn.Linear(c.dim, H * Dv, bias=c.qkv_bias)
            self.kv_proj = nn.ModuleDict({f"{kind}_{branch}": k if kind == "k" else v
                                          for branch in ("sel", "cmp", "win") for kind in ("k", "v")})
        else:
            self.kv_proj = nn.ModuleDict({
                f"{kind}_{branch}": nn.Linear(c.dim, H * (Dk if kind == "k" else Dv), bias=c.qkv_bias)
                for branch in ("cmp", "sel", "win") for kind in ("k", "v")
            })
        hidden = c.phi_hidden or None
        self.phi_k = PhiMLP(c.l, Dk, hidden or 2 * Dk) if c.phi == "mlp" else None
        self.phi_v = PhiMLP(c.l, Dv, hidden or 2 * Dv) if c.phi == "mlp" else None
        if c.gate_hidden:
            self.gate = nn.Sequential(nn.Linear(c.dim, c.gate_hidden), nn.SiLU(), nn.Linear(c.gate_hidden, 3 * HQ))
        else:
            self.gate = nn.Linear(c.dim, 3 * HQ)
        self.o_proj = nn.Linear(HQ * Dv, c.dim, bias=c.o_bias)
        self.apply_init()

    def apply_init(self) -> None:
        """The config's initialisation choices, over whatever init the parameters have (a model that
        re-initialises its layers calls this after): ``phi_init="mean"`` starts phi's MLPs as mean pooling;
        ``gate_bias`` sets the gate's output bias per branch (every head alike), so the gates start at
        sigmoid(bias); ``kv_init="tied"`` copies the selected branch's key/value projections into the compressed
        and window branches' (separate parameters, equal at the start). Their defaults leave the parameters as
        they are."""
        if self.config.phi_init == "mean" and self.phi_k is not None:
            self.phi_k.init_mean()
            self.phi_v.init_mean()
        if self.config.kv_init == "tied" and not self.config.shared_kv:
            with torch.no_grad():
                for kind in ("k", "v"):
                    src = self.kv_proj[f"{kind}_sel"]
                    for branch in ("cmp", "win"):
                        dst = self.kv_proj[f"{kind}_{branch}"]
                        dst.weight.copy_(src.weight)
                        if dst.bias is not None:
                            dst.bias.copy_(src.bias)
        if self.config.gate_bias is None:
            return
        last = self.gate[-1] if isinstance(self.gate, nn.Sequential) else self.gate
        with torch.no_grad():  # the logits are laid out [.., HQ, 3]: head-major, branch (cmp, sel, win) minor
            last.bias.copy_(torch.tensor(self.config.gate_bias, dtype=last.bias.dtype).repeat(self.config.n_heads))

    # The steps of forward, public for the benchmarks that time the attention core alone (experiments/measure)
    # and for context parallelism: project, compress, append_to_cache, then nsa.functional.nsa_attention.
    def project(self, x: torch.Tensor, pos: torch.Tensor):
        """The attention inputs of ``x``: queries, the raw keys/values of each branch, and the gates.

        Arguments:
            x: (B, T, dim).
            pos: (T,) int, each token's position (RoPE rotates q and every branch's keys).
        Returns:
            q: (B, T, HQ, Dk); kv: dict of ``k_cmp_raw``, ``k_sel``, ``k_win`` (B, T, H, Dk) and ``v_cmp_raw``,
            ``v_sel``, ``v_win`` (B, T, H, Dv) (one tensor for all three with shared_kv); gates: (B, T, HQ, 3),
            Eq. 5's g in the order (cmp, sel, win).
        """
        c = self.config
        B, T, _ = x.shape
        H = c.n_kv_heads

        done = {}  # shared_kv: each shared projection computed once

        def proj(name, D):
            m = self.kv_proj[name]
            if id(m) not in done:
                done[id(m)] = m(x).view(B, T, H, D)
            return done[id(m)]

        q = rope(self.q_proj(x).view(B, T, c.n_heads, c.d_k), pos, c.rope_base)
        kv = {
            "k_cmp_raw": rope(proj("k_cmp", c.d_k), pos, c.rope_base),
            "v_cmp_raw": proj("v_cmp", c.d_v),
            "k_sel": rope(proj("k_sel", c.d_k), pos, c.rope_base),
            "v_sel": proj("v_sel", c.d_v),
            "k_win": rope(proj("k_win", c.d_k), pos, c.rope_base),
            "v_win": proj("v_win", c.d_v),
        }
        gates = torch.sigmoid(self.gate(x)).view(B, T, c.n_heads, 3)  # Eq. 5's g, order (cmp, sel, win)
        return q, kv, gates

    def compress(self, k_raw, v_raw, docs=None):
        """Eq. 7's compressed keys and values (B, n_cmp(T), H, D) from the raw ones (B, T, H, D), with the
        layer's phi; ``docs``: packed documents (nsa.varlen.Varlen or cu_seqlens), each compressed alone."""
        return (functional.compress(k_raw, self.config, self.phi_k, cu_seqlens=docs),
                functional.compress(v_raw, self.config, self.phi_v, cu_seqlens=docs))

    def new_cache(self, batch_size: int, max_len: int, device=None, dtype=None) -> NSACache:
        """An empty cache for ``batch_size`` sequences of up to ``max_len`` tokens."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be >= 1")
        if max_len < 1:
            raise ValueError(f"max_len={max_len}: must be >= 1")
        p = self.q_proj.weight
        device = p.device if device is None else torch.device(device)
        dtype = p.dtype if dtype is None else dtype
        c = self.config
        H, Tc = c.n_kv_heads, c.n_cmp(max_len)

        def buf(T, D):
            return torch.zeros(batch_size, T, H, D, device=device, dtype=dtype)

        return NSACache(buf(max_len, c.d_k), buf(max_len, c.d_v), buf(Tc, c.d_k), buf(Tc, c.d_v),
                        buf(max_len, c.d_k), buf(max_len, c.d_v), buf(max_len, c.d_k), buf(max_len, c.d_v),
                        max_len=max_len)

    def forward(self, x: torch.Tensor, cache: NSACache | None = None, *, cu_seqlens=None, cp_group=None,
                block_indices=None) -> torch.Tensor:
        """The layer's output for the tokens x (the class docstring says where they sit).

        Arguments:
            x: (B, T, dim) in the parameters' dtype (or under ``torch.autocast``); with ``cu_seqlens``
                (1, N, dim), documents packed along N.
            cache: None (a whole sequence at positions 0..T-1), or the :class:`NSACache` of
                :meth:`new_cache` the tokens are appended to (at ``cache.length``, or per row at
                ``cache.lengths[b]`` for a ragged cache); updated in place.
            cu_seqlens: int32 (n_docs + 1,) document boundaries (or a :class:`nsa.varlen.Varlen`); with a cache,
                an empty one with a row per document.
            cp_group: a ``torch.distributed`` group: x is this rank's part of one sequence (no cache, no
                cu_seqlens).
            block_indices: None (the paper's top-n of the compressed scores), or (B, T, H, k) blocks the
                selected branch reads instead, for x's T queries (:func:`nsa.functional.nsa_attention`'s
                ``block_indices``: select_blocks' layout, block numbers counted from position 0, packed: from
                the row's document start). Not with ``cp_group`` or a ragged cache.
        Returns:
            y: (B, T, dim); packed: (1, N, dim); context parallel: this rank's part.
        """
        c = self.config
        if x.dim() != 3 or x.shape[-1] != c.dim:
            raise ValueError(f"x: expected [B,T,{c.dim}] (dim), got {tuple(x.shape)}")
        B, T, _ = x.shape
        wdt = self.q_proj.weight.dtype
        if x.dtype != wdt and not autocast_enabled(x.device.type):
            raise ValueError(f"x: dtype {str(x.dtype).replace('torch.', '')} differs from the layer's "
                             f"{str(wdt).replace('torch.', '')} (its parameters); cast one to the other, or run under "
                             "torch.autocast")
        if cp_group is not None:
            if block_indices is not None:
                raise ValueError("block_indices: not supported with cp_group (context parallelism)")
            if cache is not None:
                raise ValueError("cp_group: context parallelism runs a whole sequence or packed documents (no cache)")
            return self._forward_cp(x, cp_group, as_varlen(cu_seqlens))
        docs = as_varlen(cu_seqlens)
        if docs is not None:
            if B != 1:
                raise ValueError(f"x: expected [1,N,{c.dim}] with cu_seqlens (documents packed along N), "
                                 f"got {tuple(x.shape)}")
            docs.check_total(T, "x")
            if cache is not None:
                self._check_packed_prefill(cache, docs)
        elif cache is not None and cache.ragged:
            if block_indices is not None:
                raise ValueError("block_indices: not supported with a ragged cache (run each row alone)")
            return forward_rows(self, x, cache)
        start = 0 if cache is None or docs is not None else cache.length
        pos = torch.arange(start, start + T, device=x.device) if docs is None else docs.row_pos(x.device)
        q, kv, gates = self.project(x, pos)
        if cache is None or docs is not None:
            k_cmp, v_cmp = self.compress(kv["k_cmp_raw"], kv["v_cmp_raw"], docs)
            keys = dict(k_sel=kv["k_sel"], v_sel=kv["v_sel"], k_win=kv["k_win"], v_win=kv["v_win"])
            if cache is not None:
                self._fill_rows(cache, x, kv, k_cmp, v_cmp, docs)
        else:
            k_cmp, v_cmp, keys = self.append_to_cache(cache, x, kv)
        o = functional.nsa_attention(q, k_cmp, v_cmp, keys["k_sel"], keys["v_sel"], keys["k_win"],
                                     keys["v_win"], gates, c, backend=self.backend, q_start=start,
                                     fallback=self.fallback, streams=self.streams, cu_seqlens=docs,
                                     block_indices=block_indices)
        if cache is not None:
            if docs is None:
                cache.length = start + T
            else:
                cache.lengths = docs.lens
        return self.o_proj(o.reshape(B, T, c.n_heads * c.d_v))

    def _forward_cp(self, x: torch.Tensor, group, docs=None) -> torch.Tensor:
        """This rank's part of a sequence (``nsa.context_parallel.shard`` of it) -> its part of the output;
        ``docs``: the packed documents of the whole sequence (RoPE positions from each document's start)."""
        import torch.distributed as dist

        from . import context_parallel as cp

        c = self.config
        B, T2, _ = x.shape
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if docs is not None:
            if B != 1:
                raise ValueError(f"x: expected [1,2C,{c.dim}] with cu_seqlens (documents packed along the token "
                                 f"axis), got {tuple(x.shape)}")
            docs.check_total(T2 * world, f"the whole sequence (x's 2C={T2} tokens x {world} ranks)")
        q, kv, gates = self.project(x, cp.positions(T2 * world, rank, world, x.device, cu_seqlens=docs))
        o = cp.nsa_attention(q, kv["k_cmp_raw"], kv["v_cmp_raw"], kv["k_sel"], kv["v_sel"], kv["k_win"], kv["v_win"],
                             gates, c, phi_k=self.phi_k, phi_v=self.phi_v, group=group, backend=self.backend,
                             fallback=self.fallback, cu_seqlens=docs)
        return self.o_proj(o.reshape(B, T2, c.n_heads * c.d_v))

    @staticmethod
    def _check_packed_prefill(cache: NSACache, docs) -> None:
        if docs.n_docs != cache.batch_size:
            raise ValueError(f"cu_seqlens: a packed prefill into a cache takes one document per batch row: "
                             f"{docs.n_docs} documents for a cache of batch_size={cache.batch_size}")
        if cache.length != 0:
            raise ValueError(f"cache: a packed prefill (cu_seqlens) fills an empty cache; this one holds "
                             f"{cache.lengths.tolist()} tokens per row (reset() it first)")
        for i, n in enumerate(docs.lens):
            if n > cache.max_len:
                raise ValueError(f"cu_seqlens: document {i} has {n} tokens, more than the cache's "
                                 f"max_len={cache.max_len}")

    def check_cache(self, cache: NSACache) -> None:
        """ValueError (one line) where ``cache`` was not made by :meth:`new_cache` of this layer's config: each
        buffer ``[B,T,H,D]`` has this config's key/value heads and head dims, and the compressed ones
        n_cmp(max_len) tokens (l and d)."""
        c = self.config
        for name in ("k_cmp_raw", "v_cmp_raw", "k_sel", "v_sel", "k_win", "v_win", "k_cmp", "v_cmp"):
            t = getattr(cache, name)
            T = c.n_cmp(cache.max_len) if name in ("k_cmp", "v_cmp") else cache.max_len
            want = (T, c.n_kv_heads, c.d_k if name.startswith("k") else c.d_v)
            if t.dim() != 4 or tuple(t.shape[1:]) != want:
                raise ValueError(
                    f"cache.{name}: shape {tuple(t.shape)}, this layer's is [B, {', '.join(map(str, want))}] "
                    f"(n_kv_heads={c.n_kv_heads}, d_k={c.d_k}, d_v={c.d_v}, l={c.l}, d={c.d}, max_len={cache.max_len}): "
                    "a cache made for a layer of another config; make it with this layer's new_cache()")

    def _check_cache_dtype(self, cache: NSACache, x: torch.Tensor, kv: dict) -> None:
        self.check_cache(cache)
        if x.device != cache.k_sel.device or kv["k_sel"].dtype != cache.k_sel.dtype:
            raise ValueError(f"cache: device/dtype {cache.k_sel.device}/{cache.k_sel.dtype} differ from the "
                             f"layer's {x.device}/{kv['k_sel'].dtype}")

    def _fill_rows(self, cache: NSACache, x: torch.Tensor, kv: dict, k_cmp, v_cmp, docs) -> None:
        """Packed prefill: document i's raw tokens and compressed tokens into row i at positions 0.."""
        self._check_cache_dtype(cache, x, kv)
        n_cmp = docs.cmp_counts(self.config)
        c0 = 0
        for i, (s, n, nc) in enumerate(zip(docs.starts, docs.lens, n_cmp)):
            for name, val in kv.items():
                getattr(cache, name)[i, :n] = val[0, s:s + n]
            cache.k_cmp[i, :nc] = k_cmp[0, c0:c0 + nc]
            cache.v_cmp[i, :nc] = v_cmp[0, c0:c0 + nc]
            c0 += nc

    def append_to_cache(self, cache: NSACache, x: torch.Tensor, kv: dict):
        """Write the new tokens ``x`` (B, T, dim) with their keys/values ``kv`` (:meth:`project`'s) into the
        cache at its length (which the caller then advances by T) and emit the compressed tokens whose block
        just completed (i with i*d + l - 1 in [start, end)). Returns the cached views to attend to:
        k_cmp, v_cmp (B, n_cmp(end), H, D) and a dict of k_sel, v_sel, k_win, v_win (B, end, H, D)."""
        c = self.config
        B, T, _ = x.shape
        start, end = cache.length, cache.length + T
        if B != cache.batch_size:
            raise ValueError(f"x: batch {B} differs from the cache's batch_size {cache.batch_size}")
        if end > cache.max_len:
            raise ValueError(f"cache: appending {T} tokens at position {start} exceeds max_len={cache.max_len}")
        self._check_cache_dtype(cache, x, kv)
        for name, val in kv.items():
            getattr(cache, name)[:, start:end] = val
        i0, i1 = c.n_cmp(start), c.n_cmp(end)
        if i1 > i0:
            span = slice(i0 * c.d, (i1 - 1) * c.d + c.l)
            k_new, v_new = self.compress(cache.k_cmp_raw[:, span], cache.v_cmp_raw[:, span])
            cache.k_cmp[:, i0:i1] = k_new
            cache.v_cmp[:, i0:i1] = v_new
        keys = {n: getattr(cache, n)[:, :end] for n in ("k_sel", "v_sel", "k_win", "v_win")}
        return cache.k_cmp[:, :i1], cache.v_cmp[:, :i1], keys
