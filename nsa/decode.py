"""GPU decode path of the NSA layer: one query per sequence per step, CUDA-graph capturable.

    layer = NSAAttention(cfg).cuda().bfloat16()
    cache = layer.new_cache(B, max_len)
    dec = GraphDecoder(layer, cache)        # takes the cache over (see below)
    dec.prefill(x_prompt)                   # the module's own cached forward fills the caches
    y = dec.step(x_t)                       # eager step: [B,1,dim] -> [B,1,dim]
    dec.capture()                           # one CUDA graph for every later step
    y = dec.replay(x_t)                     # same as step(), no host sync, no Python per kernel

The reference is the module itself: ``layer.forward(x_t, cache)`` (spec "Decode"). Every step here
gives what it gives (tests/test_decode_gpu_path.py).

Design (nsa/backends/triton/_dec_kernels.py): the position lives in a device tensor ``pos``; the
step projects (one fused GEMM for q and the six branch keys/values), applies RoPE from a table
indexed by ``pos``, writes the new raw tokens with ``index_copy_`` at ``pos``, and always runs the
compression phi over the last l raw compression keys/values: when a block completes
(t = i*d + l - 1) the result goes to compressed row i, otherwise to a scratch row past the end
(the compressed cache gets one extra row; ``cache.k_cmp`` / ``v_cmp`` become views of the first
Tc rows, so the module's own forward keeps working on the same cache). Then four kernels: split-KV
compressed attention, combine + Eq. 9-12 top-n in registers, split-KV selected + window attention,
combine with gates. Finally ``pos += 1`` on the device; the host keeps a mirror (``length``).

Branch timing: ``attend(branches=("sel",))`` etc. run only that branch's kernels; ``capture_attention``
captures any subset. Token counts: ``tokens_read`` (independent, from indices) and the kernels'
own counters (``count=True``).
"""
from __future__ import annotations

import torch

from ._compat import sdpa_gqa
from .config import NSAConfig
from .module import NSAAttention, NSACache

BRANCHES = ("cmp", "sel", "win")


def tokens_read(config: NSAConfig, S: int, indices: torch.Tensor) -> dict:
    """Key/value tokens read for the query at position t = S-1, per sequence and group,
    counted from the selected block ``indices`` ``[B,H,n_sel]`` (or ``[B,1,H,n_sel]``; -1 = none).

    Returns ``{"cmp", "sel", "win", "read", "distinct", "formula"}`` with ``[B,H]`` int64 tensors
    (formula an int): cmp = visible compressed tokens; sel = tokens <= t of the selected blocks;
    win = min(w, S). The selection and window branches read different tensors (their own
    projections), so ``read`` = cmp + sel + win; ``distinct`` counts positions (cmp + |sel ∪ win|),
    the quantity the paper formula ``config.decode_tokens_formula(S)`` bounds.
    """
    if indices.dim() == 4:
        indices = indices[:, -1]
    idx = indices.to(torch.int64).cpu()
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
    B, H = idx.shape[:2]
    full = lambda v: torch.full((B, H), v, dtype=torch.int64)
    return {"cmp": full(cmp_), "sel": sel, "win": full(win), "read": cmp_ + sel + win,
            "distinct": cmp_ + sel - in_win.flatten(-2).sum(-1) + win,
            "formula": config.decode_tokens_formula(S)}


def bytes_read(config: NSAConfig, tokens: torch.Tensor | int, elem_size: int) -> torch.Tensor | int:
    """Bytes of keys and values for ``tokens`` tokens of one group: tokens * (Dk + Dv) * elem_size."""
    return tokens * (config.d_k + config.d_v) * elem_size


class GraphDecoder:
    """Decode state for one :class:`NSAAttention` and its :class:`NSACache` (see module docstring).

    The decoder copies the layer's projection weights at construction (``refresh_weights()`` after
    changing them). ``cache.length`` stays the host mirror of the device position.
    """

    def __init__(self, module: NSAAttention, cache: NSACache, *, n_sm: int | None = None,
                 tuning: dict | None = None):
        from .backends.triton.decode import DecodeKernels

        c = self.config = module.config
        self.module, self.cache = module, cache
        ref = cache.k_sel
        self.B, self.max_len, self.device, self.dtype = cache.batch_size, cache.max_len, ref.device, ref.dtype
        H = c.n_kv_heads
        self.Tc = c.n_cmp(self.max_len)
        # Compressed cache with one scratch row (index Tc) for steps where no block completes.
        for name, D in (("k_cmp", c.d_k), ("v_cmp", c.d_v)):
            old = getattr(cache, name)
            ext = torch.zeros(self.B, self.Tc + 1, H, D, device=self.device, dtype=self.dtype)
            ext[:, : self.Tc] = old
            setattr(self, name + "_ext", ext)
            setattr(cache, name, ext[:, : self.Tc])
        self.pos = torch.tensor([cache.length], device=self.device, dtype=torch.int64)
        self.length = cache.length
        # RoPE tables, computed as nsa.module.rope computes them.
        D = c.d_k
        acc = torch.float64 if self.dtype == torch.float64 else torch.float32
        inv = c.rope_base ** (-torch.arange(0, D, 2, device=self.device, dtype=acc) / D)
        ang = torch.arange(self.max_len, device=self.device).to(acc)[:, None] * inv[None, :]
        self.cos = torch.cat([ang.cos(), ang.cos()], -1)
        self.sin = torch.cat([ang.sin(), ang.sin()], -1)
        self.acc_dtype = acc
        self.kernels = DecodeKernels(c, self.B, self.max_len, self.device, dtype=self.dtype, n_sm=n_sm,
                                     tuning=tuning)
        self.refresh_weights()
        self.graph = None
        self.x_static = torch.zeros(self.B, 1, c.dim, device=self.device, dtype=self.dtype)
        self.y_static = None
        self.last = {}

    # ------------------------------------------------------------------------------------------
    def refresh_weights(self):
        m, c = self.module, self.config
        names = ["k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win"]
        with torch.no_grad():
            self.w_qkv = torch.cat([m.q_proj.weight] + [m.kv_proj[n].weight for n in names], 0).detach().clone()
        HQ, H, Dk, Dv = c.n_heads, c.n_kv_heads, c.d_k, c.d_v
        self.split_sizes = [HQ * Dk] + [H * (Dk if n[0] == "k" else Dv) for n in names]

    def sync_position(self):
        """After the cache was filled by other means (``module.forward(x, cache)``)."""
        self.pos.fill_(self.cache.length)
        self.length = self.cache.length

    @torch.no_grad()
    def prefill(self, x: torch.Tensor) -> torch.Tensor:
        """Append ``x [B,T,dim]`` through the module's own cached forward (prefill or a chunk)."""
        if self.cache.length != self.length:
            raise RuntimeError("cache.length moved outside this decoder; call sync_position()")
        y = self.module(x, self.cache)
        self.sync_position()
        return y

    # ------------------------------------------------------------------------------------------
    def _rope(self, x, cos, sin):  # x [B,n,D]; cos/sin [1,D]; as nsa.module.rope
        xa = x.to(self.acc_dtype)
        x1, x2 = xa.chunk(2, dim=-1)
        return (xa * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)

    def project(self, x: torch.Tensor):
        """Projections + RoPE at ``pos``; writes the raw tokens and emits the compressed token.
        Returns (q [B,HQ,Dk], gates [B,HQ,3])."""
        c, cache, m = self.config, self.cache, self.module
        B, HQ, H, Dk, Dv = self.B, c.n_heads, c.n_kv_heads, c.d_k, c.d_v
        x2 = x.reshape(B, c.dim)
        q, kc, vc, ks, vs, kw, vw = torch.matmul(x2, self.w_qkv.t()).split(self.split_sizes, dim=-1)
        cos = self.cos.index_select(0, self.pos)
        sin = self.sin.index_select(0, self.pos)
        q = self._rope(q.view(B, HQ, Dk), cos, sin)
        kc = self._rope(kc.view(B, H, Dk), cos, sin)
        ks = self._rope(ks.view(B, H, Dk), cos, sin)
        kw = self._rope(kw.view(B, H, Dk), cos, sin)
        for buf, val in ((cache.k_cmp_raw, kc), (cache.v_cmp_raw, vc.view(B, H, Dv)), (cache.k_sel, ks),
                         (cache.v_sel, vs.view(B, H, Dv)), (cache.k_win, kw), (cache.v_win, vw.view(B, H, Dv))):
            buf.index_copy_(1, self.pos, val.unsqueeze(1))
        self._emit()
        gates = torch.sigmoid(m.gate(x2)).view(B, HQ, 3)
        return q, gates

    def _emit(self):
        """Compressed token i = phi(raw[i*d : i*d+l]) when t = i*d + l - 1, else into the scratch row."""
        c, cache, m = self.config, self.cache, self.module
        if self.max_len < c.l:
            return
        start = self.pos - (c.l - 1)  # [1]
        emit = (start >= 0) & (torch.remainder(start, c.d) == 0)
        row = torch.where(emit, torch.div(start, c.d, rounding_mode="floor"), torch.full_like(start, self.Tc))
        idx = start.clamp(min=0) + torch.arange(c.l, device=self.device)
        for raw, ext, phi in ((cache.k_cmp_raw, self.k_cmp_ext, m.phi_k), (cache.v_cmp_raw, self.v_cmp_ext, m.phi_v)):
            blk = raw.index_select(1, idx).permute(0, 2, 1, 3).unsqueeze(1)  # [B,1,H,l,D]
            new = blk.mean(dim=3) if phi is None else phi(blk)
            ext.index_copy_(1, row, new)

    def attend(self, q, gates, *, branches=BRANCHES, combine=True, combine_branches=None, count=False, topk=True):
        """The attention kernels alone for the query at ``pos`` -> ``[B,HQ,Dv]`` (a workspace);
        see :meth:`nsa.backends.triton.decode.DecodeKernels.attend`."""
        cache = self.cache
        return self.kernels.attend(q, gates, self.pos, self.k_cmp_ext, self.v_cmp_ext, cache.k_sel, cache.v_sel,
                                   cache.k_win, cache.v_win, branches=branches, combine=combine,
                                   combine_branches=combine_branches, count=count, topk=topk)

    def _body(self, x, branches=BRANCHES, count=False, advance=True):
        c = self.config
        q, gates = self.project(x)
        o = self.attend(q, gates, branches=branches, count=count)
        self.last = {"q": q, "gates": gates}
        y = self.module.o_proj(o.reshape(self.B, c.n_heads * c.d_v)).view(self.B, 1, c.dim)
        if advance:
            self.pos.add_(1)
        return y

    def _check_room(self, n=1):
        if self.cache.length != self.length:
            raise RuntimeError("cache.length moved outside this decoder; call sync_position()")
        if self.length + n > self.max_len:
            raise ValueError(f"cache: step at position {self.length} exceeds max_len={self.max_len}")

    @torch.no_grad()
    def step(self, x: torch.Tensor, *, branches=BRANCHES, count: bool = False) -> torch.Tensor:
        """Eager decode step: ``x [B,1,dim] -> y [B,1,dim]`` (a new tensor). ``branches`` other than
        all three gives the forced-branch output (sum of the chosen gated branches); ``count``
        fills ``self.kernels.counts`` ([B*H, 3]: cmp, sel, win tokens read)."""
        if x.shape != (self.B, 1, self.config.dim):
            raise ValueError(f"x: expected [{self.B},1,{self.config.dim}], got {tuple(x.shape)}")
        self._check_room()
        y = self._body(x, branches=branches, count=count).clone()
        self.length += 1
        self.cache.length = self.length
        return y

    @torch.no_grad()
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """A chunk ``x [B,T,dim]`` as T single steps (replays of the captured graph when there
        is one, else eager steps) -> ``[B,T,dim]``."""
        ys = []
        for i in range(x.shape[1]):
            xt = x[:, i:i + 1]
            ys.append(self.replay(xt).clone() if self.graph is not None and self.graph_advances else self.step(xt))
        return torch.cat(ys, dim=1)

    def indices(self) -> torch.Tensor:
        """Selected blocks of the last step, ``[B,1,H,n_sel]`` int64 (the reference's layout)."""
        return self.kernels.indices.to(torch.int64).unsqueeze(1)

    # ------------------------------------------------------------------------------------------
    def _warm(self, fn):
        """Run fn on a side stream (compiles kernels, allocator warm-up) and restore the position."""
        saved = self.pos.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
                self.pos.copy_(saved)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()

    @torch.no_grad()
    def capture(self, *, advance: bool = True):
        """Capture one full step (projections .. o_proj, pos += 1 if ``advance``) as a CUDA graph
        reading ``self.x_static``."""
        if self.device.type != "cuda":
            raise RuntimeError("capture() needs CUDA tensors")
        self._warm(lambda: self._body(self.x_static, advance=False))
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.y_static = self._body(self.x_static, advance=advance)
        self.graph_advances = advance
        return self.graph

    @torch.no_grad()
    def replay(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """One captured step; ``x`` is copied into the static input. Returns the static output."""
        if self.graph is None:
            raise RuntimeError("capture() first")
        if self.graph_advances:
            self._check_room()
        if x is not None:
            self.x_static.copy_(x)
        self.graph.replay()
        if self.graph_advances:
            self.length += 1
            self.cache.length = self.length
        return self.y_static

    @torch.no_grad()
    def capture_attention(self, q, gates, **kw):
        """A CUDA graph of the attention kernels alone (given q [B,HQ,Dk], gates [B,HQ,3]; ``kw`` as
        :meth:`attend`), reading the position from ``pos`` at replay: for timing the step or one branch."""
        self._warm(lambda: self.attend(q, gates, **kw))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self.attend(q, gates, **kw)
        return g

    @torch.no_grad()
    def capture_body(self, *, advance: bool = False):
        """A CUDA graph of the whole layer step on ``self.x_static`` (``advance=False``: the
        position stays, for timing at a fixed context)."""
        self._warm(lambda: self._body(self.x_static, advance=False))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self._body(self.x_static, advance=advance)
        return g


DecodeState = GraphDecoder


def reference_decode_step(module: NSAAttention, cache: NSACache, x: torch.Tensor) -> torch.Tensor:
    """The reference: the module's own cached forward for one step."""
    with torch.no_grad():
        return module(x, cache)


def dense_decode_sdpa(q, k, v):
    """Dense decode baseline: q [B,HQ,1,D], k/v [B,HQ or H,S,D] (grouped heads: ``nsa._compat.sdpa_gqa``)."""
    return sdpa_gqa(q, k, v)


__all__ = ["DecodeState", "GraphDecoder", "bytes_read", "dense_decode_sdpa", "reference_decode_step", "tokens_read"]
