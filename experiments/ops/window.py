"""op=window: sliding-window attention alone (the last w tokens, spec step 6),
``nsa.backends.triton.window.sliding_window_attention``, forward and forward+backward.

Inputs: q ``[B,T,HQ,Dk]``, k/v ``[B,T,H,D]`` (standard normal). Peer rows (``kernels.peers``): the window
branch of the ``sdpa`` backend (FlexAttention on CUDA, SDPA with a band mask on a CPU) and of the
``fa2`` backend (FlashAttention-2: flash-attn, or PyTorch's own); one that cannot run here is skipped
with its backend's reason. Peers are checked too (metrics ``check_<peer>_*``) but only this project's
kernel fails the job. FLOPs: 2 (Dk + Dv) per query head and key in its window.
"""
from __future__ import annotations

import torch

from nsa import dispatch, reference
from nsa.backends.triton.utils import poisoned_outputs

from .bench import Bench, backward_of, leaves

PEERS = ("sdpa", "fa2")


def inputs(b: Bench, T: int):
    c = b.c
    return (b.randn(b.B, T, c.n_heads, c.d_k), b.randn(b.B, T, c.n_kv_heads, c.d_k),
            b.randn(b.B, T, c.n_kv_heads, c.d_v), b.randn(b.B, T, c.n_heads, c.d_v))


def backends(b: Bench) -> dict:
    """``triton`` and the peers that can run here (the others skipped with their reason)."""
    out = {"triton": dispatch.choose("win", "triton", b.dev, b.dt, None)}
    for peer in PEERS if b.k.peers else ():
        try:
            out[peer] = dispatch.choose("win", peer, b.dev, b.dt, None)
        except dispatch.BackendUnavailable as e:
            b.skip(peer, str(e))
    return out


def call(be, c):
    return lambda q, k, v: be.window(q, k, v, c, scale=q.shape[-1] ** -0.5, q_start=0)


def check(b: Bench) -> None:
    q, k, v, do = inputs(b, b.check_seq)
    xr = b.upcast(q, k, v, grad=True)
    o_r = reference.sliding_window_attention(*xr, b.c)
    o_r.backward(do.to(b.ref_dtype))
    for name, be in backends(b).items():
        xs = leaves(q, k, v)
        with poisoned_outputs():
            o = call(be, b.c)(*xs)
            o.backward(do)
        prefix, hold = ("", True) if name == "triton" else (f"{name}_", False)
        b.compare(f"{prefix}o", o, o_r, hold)
        b.compare_grads(prefix, ("dq", "dk", "dv"), xs, xr, hold)


def timed(b: Bench) -> None:
    c = b.c
    q, k, v, do = inputs(b, b.T)
    t = torch.arange(b.T, dtype=torch.float64)
    flop = 2.0 * (c.d_k + c.d_v) * c.n_heads * b.B * float(torch.clamp(t + 1, max=c.w).sum())
    for name, be in backends(b).items():
        fn, xs = call(be, c), leaves(q, k, v)
        b.row(name, lambda fn=fn: fn(q, k, v), backward_of(lambda fn=fn, xs=xs: fn(*xs), xs, do), flop=flop)


def once(b: Bench) -> None:
    q, k, v, _ = inputs(b, b.T)
    with torch.no_grad():
        call(dispatch.choose("win", "triton", b.dev, b.dt, None), b.c)(q, k, v)
