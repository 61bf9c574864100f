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
        self.pe = nn.Parameter(torch.randn(l, D) * 0.02)
        self.fc1 = nn.Linear(l * D, hidden)
        self.fc2 = nn.Linear(hidden, D)

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:  # [B,Tc,H,l,D] -> [B,Tc,H,D]
        return self.fc2(F.gelu(self.fc1((blocks + self.pe).flatten(-2))))


@dataclass
class NSACache:
    """Preallocated decode cache: each branch's raw keys/values and the compressed stream.

    ``k_cmp_raw`` holds the compression branch's rotated raw keys; compressed token i is written
    when its block completes (position i*d + l - 1), as in prefill.
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

    @property
    def batch_size(self) -> int:
        return self.k_sel.shape[0]

    def reset(self) -> None:
        self.length = 0


class NSAAttention(nn.Module):
    """The NSA attention layer. ``forward(x [B,T,dim], cache=None, *, cu_seqlens=None) -> [B,T,dim]``.

    Without a cache, x is a whole sequence at positions 0..T-1 (prefill / training). With a
    cache, x's tokens are appended at positions cache.length.. (a prefill chunk or decode steps)
    and attend to everything cached before them; the result equals prefill at those positions.
    With ``cu_seqlens`` (no cache), x ``[1,N,dim]`` holds documents packed along N (see
    :mod:`nsa.varlen`): each is its own sequence at positions 0..L_i-1, as if run alone.

    ``backend`` / ``fallback`` / ``streams`` are passed to :func:`nsa.functional.nsa_attention`.
    """

    def __init__(self, config: NSAConfig, *, backend="reference", fallback: str | None = None, streams: bool = True):
        super().__init__()
        c = self.config = config
        if c.d_k % 2:
            raise ValueError(f"NSAConfig.d_k={c.d_k}: must be even for RoPE (rotates pairs of dims)")
        self.backend, self.fallback, self.streams = backend, fallback, streams
        HQ, H, Dk, Dv = c.n_heads, c.n_kv_heads, c.d_k, c.d_v
        self.q_proj = nn.Linear(c.dim, HQ * Dk, bias=False)
        self.kv_proj = nn.ModuleDict({
            f"{kind}_{branch}": nn.Linear(c.dim, H * (Dk if kind == "k" else Dv), bias=False)
            for branch in ("cmp", "sel", "win") for kind in ("k", "v")
        })
        hidden = c.phi_hidden or None
        self.phi_k = PhiMLP(c.l, Dk, hidden or 2 * Dk) if c.phi == "mlp" else None
        self.phi_v = PhiMLP(c.l, Dv, hidden or 2 * Dv) if c.phi == "mlp" else None
        if c.gate_hidden:
            self.gate = nn.Sequential(nn.Linear(c.dim, c.gate_hidden), nn.SiLU(), nn.Linear(c.gate_hidden, 3 * HQ))
        else:
            self.gate = nn.Linear(c.dim, 3 * HQ)
        self.o_proj = nn.Linear(HQ * Dv, c.dim, bias=False)

    # ---------------------------------------------------------------------------------------
    def _project(self, x: torch.Tensor, pos: torch.Tensor):
        c = self.config
        B, T, _ = x.shape
        H = c.n_kv_heads

        def proj(name, D):
            return self.kv_proj[name](x).view(B, T, H, D)

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

    def _compress(self, k_raw, v_raw, docs=None):
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

    def forward(self, x: torch.Tensor, cache: NSACache | None = None, *, cu_seqlens=None) -> torch.Tensor:
        c = self.config
        if x.dim() != 3 or x.shape[-1] != c.dim:
            raise ValueError(f"x: expected [B,T,{c.dim}] (dim), got {tuple(x.shape)}")
        B, T, _ = x.shape
        docs = as_varlen(cu_seqlens)
        if docs is not None:
            if cache is not None:
                raise ValueError("cu_seqlens: packed documents are for prefill/training; a cache (decode) "
                                 "takes one sequence per batch row")
            if B != 1:
                raise ValueError(f"x: expected [1,N,{c.dim}] with cu_seqlens (documents packed along N), "
                                 f"got {tuple(x.shape)}")
            docs.check_total(T, "x")
        start = 0 if cache is None else cache.length
        pos = torch.arange(start, start + T, device=x.device) if docs is None else docs.row_pos(x.device)
        q, kv, gates = self._project(x, pos)
        if cache is None:
            k_cmp, v_cmp = self._compress(kv["k_cmp_raw"], kv["v_cmp_raw"], docs)
            keys = dict(k_sel=kv["k_sel"], v_sel=kv["v_sel"], k_win=kv["k_win"], v_win=kv["v_win"])
        else:
            k_cmp, v_cmp, keys = self._append(cache, x, kv)
        o = functional.nsa_attention(q, k_cmp, v_cmp, keys["k_sel"], keys["v_sel"], keys["k_win"],
                                     keys["v_win"], gates, c, backend=self.backend, q_start=start,
                                     fallback=self.fallback, streams=self.streams, cu_seqlens=docs)
        if cache is not None:
            cache.length = start + T
        return self.o_proj(o.reshape(B, T, c.n_heads * c.d_v))

    def _append(self, cache: NSACache, x: torch.Tensor, kv: dict):
        """Write the new tokens into the cache and emit the compressed tokens whose block just
        completed (i with i*d + l - 1 in [start, end)). Returns the cached views to attend to."""
        c = self.config
        B, T, _ = x.shape
        start, end = cache.length, cache.length + T
        if B != cache.batch_size:
            raise ValueError(f"x: batch {B} differs from the cache's batch_size {cache.batch_size}")
        if end > cache.max_len:
            raise ValueError(f"cache: appending {T} tokens at position {start} exceeds max_len={cache.max_len}")
        if x.device != cache.k_sel.device or kv["k_sel"].dtype != cache.k_sel.dtype:
            raise ValueError(f"cache: device/dtype {cache.k_sel.device}/{cache.k_sel.dtype} differ from the "
                             f"layer's {x.device}/{kv['k_sel'].dtype}")
        for name, val in kv.items():
            getattr(cache, name)[:, start:end] = val
        i0, i1 = c.n_cmp(start), c.n_cmp(end)
        if i1 > i0:
            span = slice(i0 * c.d, (i1 - 1) * c.d + c.l)
            k_new, v_new = self._compress(cache.k_cmp_raw[:, span], cache.v_cmp_raw[:, span])
            cache.k_cmp[:, i0:i1] = k_new
            cache.v_cmp[:, i0:i1] = v_new
        keys = {n: getattr(cache, n)[:, :end] for n in ("k_sel", "v_sel", "k_win", "v_win")}
        return cache.k_cmp[:, :i1], cache.v_cmp[:, :i1], keys
