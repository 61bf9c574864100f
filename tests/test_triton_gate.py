"""The Triton gated sum (paper Eq. 5, ``nsa.backends.triton.gate``) against the plain expression in
float64, forward and backward, and its use by ``nsa_attention`` with ``backend="triton"``.

Runs through Triton's interpreter on CPU tensors; outputs and gradients are NaN-poisoned before the
kernels write them, so an unwritten element fails.
"""
from __future__ import annotations

import os

# The interpreter must be chosen before triton is first imported (tests/conftest.py does not set it).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nsa import dispatch, functional  # noqa: E402
from nsa.backends.triton import gate, poisoned_outputs, rowdot, triton_unsupported  # noqa: E402

from conftest import make_config, random_inputs  # noqa: E402

_OLD = triton_unsupported()
pytestmark = pytest.mark.skipif(_OLD is not None, reason=_OLD or "")


def _plain(oc, os_, ow, g):
    g = g.unsqueeze(-1)
    return g[..., 0, :] * oc + g[..., 1, :] * os_ + g[..., 2, :] * ow


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
@pytest.mark.parametrize("shape", [(2, 5, 3, 24), (1, 17, 4, 16), (1, 1, 1, 1)])  # rows not a multiple of 16
def test_gated_sum_matches_plain_expression(shape, dtype, tol):
    gen = torch.Generator().manual_seed(sum(shape))
    xs = [torch.randn(*shape, generator=gen).to(dtype) for _ in range(3)]
    g = torch.rand(*shape[:3], 3, generator=gen).to(dtype)
    do = torch.randn(*shape, generator=gen).to(dtype)
    a = [t.clone().requires_grad_() for t in (*xs, g)]
    with poisoned_outputs():
        o = gate.gated_sum(*a)
        grads = torch.autograd.grad(o, a, do)
    r = [t.double().requires_grad_() for t in (*xs, g)]
    ro = _plain(*r)
    rgrads = torch.autograd.grad(ro, r, do.double())
    assert o.dtype == dtype and o.shape == ro.shape
    for got, want in zip((o, *grads), (ro, *rgrads)):
        assert not torch.isnan(got).any(), "unwritten element"
        err = (got.double() - want).abs().max().item()
        assert err <= tol * max(1.0, want.abs().max().item()), err


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_nsa_attention_uses_fused_gate(monkeypatch, grad):
    """backend="triton" sums the branches with the Triton gate kernel when a gradient is needed and
    in the selection kernel's epilogue (``selected_gated``) when none is; both equal the reference
    backend's result (float32, tiny shapes)."""
    from nsa.backends.triton import selection

    cfg = make_config(HQ=4, H=2, Dk=16, Dv=16, l=8, d=4, l_sel=8, n_sel=3, w=8)
    x = random_inputs(cfg, B=1, T=24, dtype=torch.float32)
    args = [x[n].clone().requires_grad_(grad) for n in ("q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win",
                                                        "gates")]
    calls = []
    real, real_gated = gate.GatedSum.apply, selection.selected_gated
    monkeypatch.setattr(gate.GatedSum, "apply", lambda *a: calls.append("sum") or real(*a))
    monkeypatch.setattr(selection, "selected_gated", lambda *a, **k: calls.append("epilogue") or real_gated(*a, **k))
    with dispatch.record() as rec:
        o = functional.nsa_attention(*args, cfg, backend="triton")
    with torch.no_grad():
        ref = functional.nsa_attention(*args, cfg, backend="reference")
    assert calls == (["sum"] if grad else ["epilogue"]) and o.requires_grad == grad
    assert rec.ran == {"cmp": "triton", "sel": "triton", "win": "triton"}
    assert (o - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("shape", [(2, 37, 3, 24), (1, 5, 16, 128), (0, 4, 2, 8)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 1e-6)])
def test_row_dot_matches_plain_expression(shape, dtype, tol):
    """The backward's delta = rowsum(dO * O) in float32: rows not a multiple of the program's rows,
    a head dim that is not a power of two, an empty batch."""
    g = torch.Generator().manual_seed(sum(shape))
    a = torch.randn(*shape, generator=g).to(dtype)
    b = torch.randn(*shape, generator=g).to(dtype)
    out = rowdot.row_dot(a, b)
    ref = (a.double() * b.double()).sum(-1)
    assert out.dtype == torch.float32 and out.shape == shape[:-1]
    assert torch.allclose(out.double(), ref, rtol=tol, atol=tol * 10)
    with pytest.raises(ValueError, match="row_dot: shapes"):
        rowdot.row_dot(a, b[..., :-1])



def test_fuse_gate_refuses_a_gradient():
    cfg = make_config(HQ=4, H=2, Dk=16, Dv=16, l=8, d=4, l_sel=8, n_sel=3, w=8)
    x = random_inputs(cfg, B=1, T=16, dtype=torch.float32)
    args = [x[n].clone().requires_grad_(n == "q") for n in ("q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win",
                                                             "v_win", "gates")]
    be = {b: dispatch.get("triton") for b in ("cmp", "sel", "win")}
    with pytest.raises(ValueError, match="fuse_gate=True needs a forward without gradients"):
        functional.gated_branches(*args, cfg, be, scale=0.25, fuse_gate=True)
