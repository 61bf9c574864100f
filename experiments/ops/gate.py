"""op=gate: the gated sum of the three branch outputs (Eq. 5: o = sum_c g_c o_c),
``nsa.backends.triton.gate.gated_sum``, forward and forward+backward, beside ``torch``: the reference
backend's PyTorch expression (``Backend.combine``).

Inputs: o_cmp, o_sel, o_win ``[B,T,HQ,Dv]`` (standard normal), gates ``[B,T,HQ,3]`` (uniform). Memory
bound: ``fwd_bytes`` counts what the forward must move (three outputs and the gates read, one
written), against the profile's ``peak_hbm_gbps``.
"""
from __future__ import annotations

import torch

from nsa import dispatch
from nsa.backends.triton.gate import gated_sum
from nsa.backends.triton.utils import poisoned_outputs

from .bench import Bench, backward_of, leaves


def inputs(b: Bench, T: int):
    c = b.c
    o = [b.randn(b.B, T, c.n_heads, c.d_v) for _ in range(3)]
    return (*o, b.rand(b.B, T, c.n_heads, 3), b.randn(b.B, T, c.n_heads, c.d_v))


def check(b: Bench) -> None:
    *x, do = inputs(b, b.check_seq)
    xs = leaves(*x)
    with poisoned_outputs():
        o = gated_sum(*xs)
        o.backward(do)
    xr = b.upcast(*x, grad=True)
    o_r = dispatch.get("reference").combine(*xr)
    o_r.backward(do.to(b.ref_dtype))
    b.compare("o", o, o_r)
    b.compare_grads("", ("do_cmp", "do_sel", "do_win", "dgates"), xs, xr)


def timed(b: Bench) -> None:
    c = b.c
    *x, do = inputs(b, b.T)
    n = b.B * b.T * c.n_heads
    nbytes = float(n * (4 * c.d_v + 3) * x[0].element_size())
    for name, fn in (("triton", gated_sum), ("torch", dispatch.get("reference").combine)):
        xs = leaves(*x)
        b.row(name, lambda fn=fn: fn(*x), backward_of(lambda fn=fn, xs=xs: fn(*xs), xs, do), nbytes=nbytes)


def once(b: Bench) -> None:
    *x, _ = inputs(b, b.T)
    with torch.no_grad():
        gated_sum(*x)
