"""op=layer: the whole NSA attention forward without gradient (the prefill/inference path),
``nsa.functional.gated_branches`` with the triton backend on every branch: compressed attention and
scores, top-n, selected attention, window, gated sum.

Inputs: q ``[B,T,HQ,Dk]``, compressed keys/values ``[B,n_cmp(T),H,*]`` (std 2 for q and k_cmp, as
op=compressed), selected and window keys/values ``[B,T,H,*]``, gates ``[B,T,HQ,3]``. Rows (``op.paths``:
``default`` is the first only, ``all`` the six):

* ``default``: what ``nsa_attention`` runs: the gated sum in the selection kernel's epilogue, the window
  on a second stream started when the compressed kernel is done (``on_scored``);
* ``separate_gate``: the gated sum as its own kernel (the path with a gradient);
* ``window_first`` / ``separate_gate_window_first``: the side stream's window started before the
  compressed kernel;
* ``one_stream`` / ``separate_gate_one_stream``: streams off.

Each row's output is compared with the first's (``rel_diff_vs_first``: rounding only). The second
stream exists on CUDA only (and from ``nsa.functional.STREAM_MIN_QUERIES`` queries). ``once``: the
default path with streams off, one call (``ncu -k 'regex:fwd_q_kernel|fwd_kernel|topn_kernel'``).
"""
from __future__ import annotations

import torch

from nsa import dispatch, functional
from nsa.numerics import rel_l2
from nsa.backends.triton.utils import poisoned_outputs

from .bench import Bench

# name: (gate as its own kernel, streams, window started before the compressed kernel)
PATHS = {
    "default": (False, True, False),
    "separate_gate": (True, True, False),
    "window_first": (False, True, True),
    "separate_gate_window_first": (True, True, True),
    "one_stream": (False, False, False),
    "separate_gate_one_stream": (True, False, False),
}


def inputs(b: Bench, T: int):
    c = b.c
    H, HQ, Dk, Dv, Tc = c.n_kv_heads, c.n_heads, c.d_k, c.d_v, c.n_cmp(T)
    return (b.randn(b.B, T, HQ, Dk, std=2.0), b.randn(b.B, Tc, H, Dk, std=2.0), b.randn(b.B, Tc, H, Dv),
            b.randn(b.B, T, H, Dk), b.randn(b.B, T, H, Dv), b.randn(b.B, T, H, Dk), b.randn(b.B, T, H, Dv),
            b.rand(b.B, T, HQ, 3))


def _window_first(tri):
    class WindowFirst(type(tri)):  # the side stream's window starts before the compressed kernel
        def compressed(self, *a, on_scored=None, **k):
            if on_scored is not None:
                on_scored()
            return super().compressed(*a, **k)

    return WindowFirst()


def forward(b: Bench, x, path: str):
    separate, streams, first = PATHS[path]
    tri = dispatch.choose("cmp", "triton", b.dev, b.dt, None)
    be = {"cmp": _window_first(tri) if first else tri, "sel": tri, "win": tri}
    return lambda: functional.gated_branches(*x, b.c, be, scale=b.c.d_k ** -0.5, streams=streams,
                                             fuse_gate=not separate)[0]


def check(b: Bench) -> None:
    x = inputs(b, b.check_seq)
    with torch.no_grad(), poisoned_outputs():
        o = forward(b, x, "default")()
        o_r = functional.nsa_attention(*b.upcast(*x), b.c, backend="reference")
    b.compare("o", o, o_r)


def timed(b: Bench) -> None:
    x = inputs(b, b.T)
    first = None
    for path in PATHS if b.op.paths == "all" else ("default",):
        fn = forward(b, x, path)
        with torch.no_grad():
            o = fn()
        first = o if first is None else first
        b.row(path, fn, rel_diff_vs_first=rel_l2(o, first))


def once(b: Bench) -> None:
    x = inputs(b, b.T)
    with torch.no_grad():
        forward(b, x, "one_stream")()
