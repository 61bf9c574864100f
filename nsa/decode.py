"""GPU decode path of the NSA layer: one query per sequence per step, CUDA-graph capturable.

    layer = NSAAttention(cfg, backend="triton").cuda().bfloat16()
    cache = layer.new_cache(B, max_len)
    dec = GraphDecoder(layer, cache)        # takes the cache over (see below)
    dec.prefill(x_prompt)                   # the module's own cached forward fills the caches
    # or, ragged (continuous batching): B prompts packed in one row, one per cache row
    dec.prefill(x_packed, cu_seqlens=cu)    # x_packed [1,N,dim], cu = [0, L_0, L_0 + L_1, .., N]
    y = dec.step(x_t)                       # eager step: [B,1,dim] -> [B,1,dim]
    dec.capture()                           # one CUDA graph for every later step
    y = dec.replay(x_t)                     # same as step(), no host sync, no Python per kernel

The reference is the module itself: ``layer.forward(x_t, cache)`` (spec "Decode"). Every step here
gives what it gives (tests/test_decode_gpu_path.py).

Design: the positions live in a device tensor ``_pos`` ``[B]``, one per sequence (all equal in a
uniform batch; after a packed prefill each row at its own length: a ragged batch, spec "Module
level"); the step projects (one GEMM for q, the six branch keys/values and the gate's first Linear),
then the backend's prologue kernels (``tuning.decode.prologue=triton``: nsa/backends/triton/decode_prologue.py)
apply RoPE at each row's position, write the new raw tokens there, compute the gates and, for the
rows whose compression block completes (t = i*d + l - 1), phi into compressed row i. The reference
path of that prologue (``prologue=torch``) is torch ops: the module's RoPE (``nsa.module.apply_rope``)
from a table gathered at each row's position, one ``index_put_`` per buffer (row b at ``_pos[b]``),
and phi over each row's last l raw compression keys/values at every step, into compressed row i when
the block completes, otherwise into a scratch row past the end (the compressed cache has one extra
row; ``cache.k_cmp`` / ``v_cmp`` are views of the first Tc rows, so the module's own forward keeps
working on the same cache). Then the backend's decode
kernels (``nsa.dispatch``: the backend is chosen per branch like the prefill path, so
``dispatch.record()`` says what ran and an unavailable backend raises ``BackendUnavailable``; the
``triton`` backend's are ``nsa.backends.triton.decode_attention``, each query at its row's position):
split-KV compressed attention, combine + Eq. 9-12 top-n in registers, split-KV selected + window
attention, combine with gates.
Finally every position advances by one on the device; the host keeps a mirror (``cache.length``,
or ``cache.lengths`` for a ragged cache).

Timing a branch: ``dec.graph(lambda: dec.attend(q, gates, branches=("sel",)))`` captures that
branch's kernels alone; ``dec.graph(dec.step_fn(x, advance=False))`` the whole layer step at a fixed
position. Token counts: ``tokens_read`` (independent, from indices) and the kernels' own counters
(``step(..., count=True)``, then ``token_counts()``).
"""
from __future__ import annotations

import torch

from . import dispatch
from .dispatch import BRANCHES
from .config import NSAConfig
from .module import NSAAttention, NSACache, apply_rope, rope_cos_sin

# How a cached layer of a transformers model runs one new token (nsa.integrations.hf): GraphDecoder's step in a
# CUDA graph, the step eager, the layer's own cached forward, or auto (graph on a GPU backend with decode kernels).
DECODE_PATHS = ("auto", "graph", "step", "module")


def tokens_read(config: NSAConfig, S: int, indices: torch.Tensor) -> dict:
    """Key/value tokens read for the query at position t = S-1, per sequence and group,
    counted from the selected block ``indices`` ``[B,H,n_sel]`` (or ``[B,1,H,n_sel]``; -1 = none).

    Returns ``{"cmp", "sel", "win", "read", "distinct", "formula"}`` with ``[B,H]`` int64 tensors
    (formula an int): cmp = visible compressed tokens; sel = tokens <= t of the selected blocks;
    win = min(w, S). The selection and window branches read different tensors (their own
    projections), so ``read`` = cmp + sel + win; ``distinct`` counts positions (cmp + |sel ∪ win|),
    the quantity the paper formula ``config.decode_tokens_formula(S)`` bounds.

    A ragged batch: ``S`` per sequence (a ``[B]`` sequence or tensor, e.g. ``cache.lengths`` after
    the step); ``formula`` is then a ``[B]`` int64 tensor.

    Arguments:
        config: the layer's :class:`NSAConfig`.
        S: keys in the cache (the query at t = S - 1): an int, or (B,) ints for a ragged batch.
        indices: (B, H, n_sel) or (B, 1, H, n_sel) selected blocks, -1 for none (``GraphDecoder.indices()``).
    Returns:
        counts: ``{"cmp", "sel", "win", "read", "distinct"}``: (B, H) int64 each; ``"formula"``: an int,
            or (B,) int64 for a ragged batch.
    """
    if indices.dim() == 4:
        indices = indices[:, -1]
    idx = indices.to(torch.int64).cpu()
    B, H = idx.shape[:2]
    if not isinstance(S, int):
        Ss = torch.as_tensor(S, dtype=torch.int64).cpu()
        if Ss.shape != (B,):
            raise ValueError(f"S: expected an int or {B} lengths (one per sequence), got shape {tuple(Ss.shape)}")
        rows = [tokens_read(config, int(s), idx[b:b + 1]) for b, s in enumerate(Ss.tolist())]
        out = {k: torch.cat([r[k] for r in rows]) for k in ("cmp", "sel", "win", "read", "distinct")}
        out["formula"] = torch.tensor([r["formula"] for r in rows], dtype=torch.int64)
        return out
    t = S - 1
    ls = config.l_sel
    off = torch.arange(ls)
    tok = idx[..., None] * ls + off  # [B,H,n_sel,ls]
    valid = (idx[..., None] >= 0) & (tok <= t)
    sel = valid.flatten(-2).sum(-1)
    w0 = max(0, t - config.w + 1)
    in_win = valid & (tok >= w0)
    win = min(config.w, S)
    cmp_ = config.n_cmp(S)
    full = lambda v: torch.full((B, H), v, dtype=torch.int64)
    return {"cmp": full(cmp_), "sel": sel, "win": full(win), "read": cmp_ + sel + win,
            "distinct": cmp_ + sel - in_win.flatten(-2).sum(-1) + win,
            "formula": config.decode_tokens_formula(S)}


class GraphDecoder:
    """Decode state for one :class:`NSAAttention` and its :class:`NSACache` (see module docstring).

    ``backend`` (default: the layer's own, ``module.backend``; a name or ``{branch: name}``, one backend
    for all three branches) provides the decode kernels through ``nsa.dispatch``; ``n_sm`` sizes their
    split-KV grids (default: the device's multiprocessor count). Launch parameters come from the
    backend's tuning at construction (``nsa.backends.triton.tuning.overrides``). The decoder copies the
    layer's projection weights at construction (``refresh_weights()`` after changing them). ``cache.length`` (``cache.lengths``
    for a ragged cache) stays the host mirror of the device positions ``_pos`` ``[B]`` int64.
    ``last`` holds the q ``[B,HQ,Dk]`` and gates ``[B,HQ,3]`` of the last step.

    Arguments:
        module: the layer whose steps this decoder runs (its weights copied now).
        cache: the layer's cache, (B rows, max_len positions), on a CUDA device for the triton kernels;
            the decoder takes it over (its compressed buffers get one scratch row).
        backend: one backend name for the three branches (or ``{branch: name}`` naming one backend); None:
            the layer's (``module.backend``), so that the layer decides its decode path as it does its
            prefill. Name another only to decode elsewhere than the layer runs (e.g. the triton
            kernels beside a reference layer that checks them).
        n_sm: multiprocessors the split-KV grids are sized for; None: the device's.
    """

    def __init__(self, module: NSAAttention, cache: NSACache, *, backend=None, n_sm: int | None = None):
        c = self.config = module.config
        module.check_cache(cache)  # a cache of another config: one line, not a shape error in a kernel
        self.module, self.cache = module, cache
        ref = cache.k_sel
        self.B, self.max_len, self.device, self.dtype = cache.batch_size, cache.max_len, ref.device, ref.dtype
        plan = dispatch.resolve(module.backend if backend is None else backend)
        chosen = {b: dispatch.choose(b, plan[b], self.device, self.dtype, None) for b in BRANCHES}
        be = chosen["cmp"]
        if any(x is not be for x in chosen.values()):
            raise ValueError(f"backend={plan}: GraphDecoder runs the three branches in one backend's decode "
                             "kernels; name one backend")
        # n_sel bounded by the cache's blocks (NSAConfig.bounded): kernels and index buffers sized by them
        self._kernels = be.decode_kernels(c.bounded(self.max_len), self.B, self.max_len, self.device, self.dtype,
                                          n_sm=n_sm)
        if self._kernels is None:
            raise dispatch.BackendUnavailable(f"backend {be.name!r} cannot run branches {', '.join(BRANCHES)} in "
                                              "GraphDecoder: it has no decode kernels (the 'triton' backend has)")
        self._ran = {b: be.name for b in BRANCHES}
        H = c.n_kv_heads
        self.Tc = c.n_cmp(self.max_len)
        # Compressed cache with one scratch row (index Tc) for steps where no block completes.
        for name, D in (("k_cmp", c.d_k), ("v_cmp", c.d_v)):
            old = getattr(cache, name)
            ext = torch.zeros(self.B, self.Tc + 1, H, D, device=self.device, dtype=self.dtype)
            ext[:, : self.Tc] = old
            setattr(self, "_" + name + "_ext", ext)
            setattr(cache, name, ext[:, : self.Tc])
        self._pos = torch.zeros(self.B, device=self.device, dtype=torch.int64)  # each row's position
        self._b = torch.arange(self.B, device=self.device)
        self.sync_position()
        acc = torch.float64 if self.dtype == torch.float64 else torch.float32
        self._cos, self._sin = rope_cos_sin(torch.arange(self.max_len, device=self.device), c.d_k, c.rope_base, acc)
        self._prologue = getattr(self._kernels, "prologue", None)  # the backend's kernels for _project, if any
        self.refresh_weights()
        self._graph = self._y = None
        self._graph_advances = False
        self._x = torch.zeros(self.B, 1, c.dim, device=self.device, dtype=self.dtype)
        self.last = {}

    # ------------------------------------------------------------------------------------------
    def refresh_weights(self):
        """Copy the layer's projection weights into the decoder's concatenated GEMM operands; call after
        the module's weights change (a training step, ``load_state_dict``), before the next step.
        """
        m, c = self.module, self.config
        names = ["k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win"]
        HQ, H, Dk, Dv = c.n_heads, c.n_kv_heads, c.d_k, c.d_v
        self._split_sizes = [HQ * Dk] + [H * (Dk if n[0] == "k" else Dv) for n in names]
        n_qkv = sum(self._split_sizes)
        with torch.no_grad():
            lins = [m.q_proj] + [m.kv_proj[n] for n in names]
            ws = [lin.weight for lin in lins]
            # the input projections' biases (NSAConfig.qkv_bias, e.g. Qwen2's), else zeros
            b_qkv = (torch.cat([lin.bias for lin in lins]) if c.qkv_bias else
                     m.q_proj.weight.new_zeros(n_qkv)).detach().clone()
            if self._prologue is not None:  # and the gate's (first) Linear, with its bias: one GEMM
                g1 = m.gate[0] if c.gate_hidden else m.gate
                self._w_cat = torch.cat(ws + [g1.weight], 0).detach().clone()
                self._b_cat = torch.cat([b_qkv, g1.bias]).detach().clone()
            else:
                self._w_qkv = torch.cat(ws, 0).detach().clone()
                self._b_qkv = b_qkv

    def sync_position(self):
        """After the cache was filled by other means (``module.forward(x, cache)``): the device
        positions from the cache's per-row lengths."""
        cache = self.cache
        self._length, self._rows = cache.length, cache.lengths if cache.ragged else None
        if self._rows is None:
            self._pos.fill_(self._length)
        else:
            self._pos.copy_(self._rows)

    @property
    def captured(self) -> bool:
        """A step was captured (:meth:`capture`): :meth:`replay` runs it."""
        return self._graph is not None

    def moved(self) -> bool:
        """Returns: whether the cache's positions differ from this decoder's host mirror (then
        :meth:`sync_position`)."""
        cache = self.cache
        if cache.length != self._length or cache.ragged != (self._rows is not None):
            return True
        return self._rows is not None and not torch.equal(cache.lengths, self._rows)

    @torch.no_grad()
    def prefill(self, x: torch.Tensor, *, cu_seqlens=None) -> torch.Tensor:
        """Append ``x`` through the module's own cached forward (prefill or a chunk), or, with
        ``cu_seqlens``, fill an empty cache with packed prompts (one document per row: a ragged cache,
        each row at its own length).

        Arguments:
            x: (B, T, dim); packed: (1, N, dim).
            cu_seqlens: int32 (B + 1,) document boundaries of the packed prompts, or None.
        Returns:
            y: the layer's output, shaped as x.
        """
        if self.moved():
            raise RuntimeError("cache.length moved outside this decoder; call sync_position()")
        y = self.module(x, self.cache, cu_seqlens=cu_seqlens)
        self.sync_position()
        return y

    # ------------------------------------------------------------------------------------------
    def _project(self, x: torch.Tensor):
        """Projections + RoPE at each row's position; writes the raw tokens there and emits the
        compressed tokens: the backend's prologue kernels, or (``prologue=torch``) the torch ops below.
        Returns (q [B,HQ,Dk], gates [B,HQ,3])."""
        c, cache, m = self.config, self.cache, self.module
        B, HQ, H, Dk, Dv = self.B, c.n_heads, c.n_kv_heads, c.d_k, c.d_v
        x2 = x.reshape(B, c.dim)
        if self._prologue is not None:
            raw = (cache.k_cmp_raw, cache.v_cmp_raw, cache.k_sel, cache.v_sel, cache.k_win, cache.v_win)
            P = torch.addmm(self._b_cat, x2, self._w_cat.t())
            return self._prologue(P, self._pos, self._cos, self._sin, raw, self._k_cmp_ext, self._v_cmp_ext, m)
        q, kc, vc, ks, vs, kw, vw = torch.addmm(self._b_qkv, x2, self._w_qkv.t()).split(self._split_sizes, dim=-1)
        cos = self._cos.index_select(0, self._pos)[:, None]  # [B,1,Dk]: row b's position, every head
        sin = self._sin.index_select(0, self._pos)[:, None]
        q = apply_rope(q.view(B, HQ, Dk), cos, sin)
        kc = apply_rope(kc.view(B, H, Dk), cos, sin)
        ks = apply_rope(ks.view(B, H, Dk), cos, sin)
        kw = apply_rope(kw.view(B, H, Dk), cos, sin)
        for buf, val in ((cache.k_cmp_raw, kc), (cache.v_cmp_raw, vc.view(B, H, Dv)), (cache.k_sel, ks),
                         (cache.v_sel, vs.view(B, H, Dv)), (cache.k_win, kw), (cache.v_win, vw.view(B, H, Dv))):
            buf.index_put_((self._b, self._pos), val)  # row b at position _pos[b]
        self._emit()
        gates = torch.sigmoid(m.gate(x2)).view(B, HQ, 3)
        return q, gates

    def _emit(self):
        """Per row: compressed token i = phi(raw[i*d : i*d+l]) when its t = i*d + l - 1, else into the
        scratch row."""
        c, cache, m = self.config, self.cache, self.module
        if self.max_len < c.l:
            return
        start = self._pos - (c.l - 1)  # [B]
        emit = (start >= 0) & (torch.remainder(start, c.d) == 0)
        row = torch.where(emit, torch.div(start, c.d, rounding_mode="floor"), torch.full_like(start, self.Tc))
        idx = start.clamp(min=0)[:, None] + torch.arange(c.l, device=self.device)  # [B,l]
        for raw, ext, phi in ((cache.k_cmp_raw, self._k_cmp_ext, m.phi_k), (cache.v_cmp_raw, self._v_cmp_ext, m.phi_v)):
            blk = raw[self._b[:, None], idx].permute(0, 2, 1, 3).unsqueeze(1)  # [B,1,H,l,D]
            new = blk.mean(dim=3) if phi is None else phi(blk)
            ext.index_put_((self._b, row), new[:, 0])

    def attend(self, q, gates, *, position=None, branches=BRANCHES, combine=True, count=False,
               combine_branches=None, topk=True):
        """The attention kernels alone for the queries at the decoder's positions (``position``, if given,
        sets them first: an int for every row, or ``[B]`` ints, one per row) -> ``[B,HQ,Dv]`` (a
        workspace, overwritten by the next call): the sum over ``branches`` of g_b * o_b;
        ``combine=False`` skips the gated sum (timing); ``count=True`` fills :meth:`token_counts`. The
        selected branch reads the blocks the last cmp branch chose. Timing the parts
        (``experiments.kernels op=decode``): ``branches=(), combine_branches=BRANCHES`` runs the
        combine alone; ``topk=False`` the compressed pass without its top-n.

        Arguments:
            q: (B, HQ, Dk) queries, RoPE applied (``last["q"]`` of a step).
            gates: (B, HQ, 3) gates in the order (cmp, sel, win).
            position: an int for every row, or (B,) ints; None: the decoder's positions.
            branches: the branches to run, a subset of ``("cmp", "sel", "win")``.
        Returns:
            o: (B, HQ, Dv), a workspace overwritten by the next call.
        """
        if position is not None:
            if isinstance(position, int):
                self._pos.fill_(position)
            else:
                self._pos.copy_(torch.as_tensor(position, dtype=torch.int64))
        cache = self.cache
        dispatch.record_ran({b: self._ran[b] for b in branches})
        return self._kernels.attend(q, gates, self._pos, self._k_cmp_ext, self._v_cmp_ext, cache.k_sel, cache.v_sel,
                                    cache.k_win, cache.v_win, branches=branches, combine=combine, count=count,
                                    combine_branches=combine_branches, topk=topk)

    def _body(self, x, branches=BRANCHES, count=False, advance=True):
        c = self.config
        q, gates = self._project(x)
        o = self.attend(q, gates, branches=branches, count=count)
        self.last = {"q": q, "gates": gates}
        y = self.module.o_proj(o.reshape(self.B, c.n_heads * c.d_v)).view(self.B, 1, c.dim)
        if advance:
            self._pos.add_(1)
        return y

    def step_body(self, x: torch.Tensor) -> torch.Tensor:
        """One step on the device alone (projections .. o_proj, each row at its device position, which then
        advances): what a caller captures inside a larger CUDA graph (a whole model's step). The host mirror is
        the caller's: :meth:`check_room` before, :meth:`advance_host` after each run.

        Arguments:
            x: (B, 1, dim), the new token of every row.
        Returns:
            y: (B, 1, dim).
        """
        return self._body(x)

    @property
    def positions(self) -> torch.Tensor:
        """Each row's position on the device, ``[B]`` int64 (what the steps read; :meth:`sync_position` sets it)."""
        return self._pos

    def check_room(self) -> None:
        """A one-line error where the cache's positions moved outside this decoder or the next step would not fit."""
        self._check_room()

    def advance_host(self) -> None:
        """The host mirror (``cache.length`` / ``cache.lengths``) one step on, after a :meth:`step_body` ran."""
        self._advanced()

    def _check_room(self, n=1):
        if self.moved():
            raise RuntimeError("cache.length moved outside this decoder; call sync_position()")
        if self._length + n > self.max_len:  # the longest row's
            where = "" if self._rows is None else " (the longest row)"
            raise ValueError(f"cache: step at position {self._length}{where} exceeds max_len={self.max_len}")

    def _advanced(self):
        self._length += 1
        if self._rows is None:
            self.cache.length = self._length
        else:
            self._rows += 1
            self.cache.lengths = self._rows

    @torch.no_grad()
    def step(self, x: torch.Tensor, *, branches=BRANCHES, count: bool = False) -> torch.Tensor:
        """Eager decode step at each row's position; the positions advance by one.

        Arguments:
            x: (B, 1, dim), the new token of every row.
            branches: all three (the layer's output), or a subset: the sum of those gated branches.
            count: fill :meth:`token_counts`.
        Returns:
            y: (B, 1, dim), a new tensor.
        """
        if x.shape != (self.B, 1, self.config.dim):
            raise ValueError(f"x: expected [{self.B},1,{self.config.dim}], got {tuple(x.shape)}")
        self._check_room()
        y = self._body(x, branches=branches, count=count).clone()
        self._advanced()
        return y

    @torch.no_grad()
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """A chunk as T single steps (replays of the captured graph when there is one, else eager steps).

        Arguments:
            x: (B, T, dim).
        Returns:
            y: (B, T, dim).
        """
        ys = []
        for i in range(x.shape[1]):
            xt = x[:, i:i + 1]
            ys.append(self.replay(xt).clone() if self._graph is not None and self._graph_advances else self.step(xt))
        return torch.cat(ys, dim=1)

    def indices(self) -> torch.Tensor:
        """Selected blocks of the last step, ``[B,1,H,n_sel]`` int64 (the reference's layout)."""
        return self._kernels.indices.to(torch.int64).unsqueeze(1)

    def token_counts(self) -> torch.Tensor:
        """Key/value tokens the kernels loaded in the last counted step (``count=True``) per sequence
        and group: ``[B,H,3]`` int64, (cmp, sel, win)."""
        return self._kernels.counts.view(self.B, self.config.n_kv_heads, 3).long()

    def kernel_params(self) -> dict:
        """The decode kernels' launch parameters (tiles, splits, warps)."""
        return dict(self._kernels.p)

    # ------------------------------------------------------------------------------------------
    def step_fn(self, x: torch.Tensor | None = None, *, branches=BRANCHES, advance: bool = True):
        """A callable of no arguments running one whole layer step (projections .. o_proj) on the
        static input, for :meth:`graph`; ``x`` (optional) is copied into the static input now.
        ``advance=False`` keeps the position (timing at a fixed context). Returns the step's output."""
        if x is not None:
            self._x.copy_(x)
        return lambda: self._body(self._x, branches=branches, advance=advance)

    @torch.no_grad()
    def graph(self, fn) -> torch.cuda.CUDAGraph:
        """``fn`` (e.g. :meth:`step_fn`, or a lambda around :meth:`attend`) captured in a new CUDA
        graph, after two warm-up runs on a side stream (compiles kernels, warms the allocator) that
        leave the position as it was. Replaying it reads the position from the device."""
        return self._capture(fn)[0]

    def _capture(self, fn):
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need CUDA tensors")
        saved = self._pos.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
                self._pos.copy_(saved)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fn()
        return g, out

    @torch.no_grad()
    def capture(self, *, advance: bool = True):
        """Capture one full step (projections .. o_proj, the position advanced if ``advance``) as the
        CUDA graph :meth:`replay` runs."""
        self._graph, self._y = self._capture(self.step_fn(advance=advance))
        self._graph_advances = advance
        return self._graph

    @torch.no_grad()
    def replay(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """One captured step (:meth:`capture`).

        Arguments:
            x: (B, 1, dim), copied into the static input; None: the static input as it is.
        Returns:
            y: (B, 1, dim), the static output (overwritten by the next replay).
        """
        if self._graph is None:
            raise RuntimeError("capture() first")
        if self._graph_advances:
            self._check_room()
        if x is not None:
            self._x.copy_(x)
        self._graph.replay()
        dispatch.record_ran(self._ran)
        if self._graph_advances:
            self._advanced()
        return self._y


__all__ = ["DECODE_PATHS", "GraphDecoder", "tokens_read"]
