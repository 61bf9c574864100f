"""Packed documents on a CUDA GPU: compiled kernels in bfloat16 at a realistic size (documents of 1k-16k tokens
beside the edge cases 1, 7 (< l), 0 and 511 (< w) tokens; HQ=64, H=4, Dk=Dv=128, the paper's l, d, l_sel,
n_sel, w). Every backend that runs packed documents against the same backend on each document alone.

Marked ``gpu``: deselected where CUDA is not available (tests/conftest.py). Run them compiled:
``python -m pytest -q -m gpu tests/test_varlen_gpu.py`` (without TRITON_INTERPRET).

Tolerance: a packed run and the per-document runs do the same float32 arithmetic per query row, except
where partial sums meet in another order (the dk/dv query shares, the selection backward's atomic adds),
so results differ by bfloat16 rounding: at most one ulp of 2^-8 per element, so 4e-3 in relative norm.
The top-n indices come from identical block scores: exactly equal.
"""
from __future__ import annotations

import pytest
import torch
from conftest import ARG_ORDER, cu_of, per_document, skip_unavailable
from kernel_cases import BIG

from nsa import NSAAttention, NSAConfig, dispatch, env
from nsa import functional as fn
from nsa.numerics import rel_l2
from nsa.varlen import Varlen

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.xdist_group(BIG),  # 26k packed tokens of the paper's heads: up to ~19 GB each
    pytest.mark.skipif(env.triton_interpret(), reason="TRITON_INTERPRET=1 interprets the kernels; these tests "
                                                      "check the compiled bf16 kernels"),
]

LENS = [1024, 16384, 3001, 7, 0, 511, 5000, 1]
CFG = NSAConfig(dim=8192, n_heads=64, n_kv_heads=4, d_k=128, d_v=128)  # l=32, d=16, l_sel=64, n_sel=16, w=512
TOL = 4e-3
BF16 = torch.bfloat16


def _inputs(cfg, lens, seed=0):
    """Packed inputs on the GPU (bfloat16, with gradients), compressed keys/values packed per document."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    N, Tc, H, HQ = sum(lens), sum(cfg.n_cmp(n) for n in lens), cfg.n_kv_heads, cfg.n_heads

    def r(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * std).to(BF16).requires_grad_()

    gates = torch.rand(1, N, HQ, 3, generator=g, device="cuda").to(BF16).requires_grad_()
    return dict(q=r(1, N, HQ, cfg.d_k, std=2.0), k_cmp=r(1, Tc, H, cfg.d_k, std=2.0), v_cmp=r(1, Tc, H, cfg.d_v),
                k_sel=r(1, N, H, cfg.d_k, std=2.0), v_sel=r(1, N, H, cfg.d_v), k_win=r(1, N, H, cfg.d_k, std=2.0),
                v_win=r(1, N, H, cfg.d_v), gates=gates)


def _fwd_bwd(f, inputs, w):
    out = f(*inputs)
    o = out[0] if isinstance(out, tuple) else out
    return out, torch.autograd.grad(o, inputs, w)


@pytest.mark.parametrize("mode", ["auto", "block"])
def test_triton_layer_equals_each_document_alone(mode):
    """nsa_attention on the triton backend (compressed + scores + top-n, selection in both kernel families,
    window, gate, every backward): output, indices and the gradient of every input."""
    from nsa.backends.triton import tuning

    x = _inputs(CFG, LENS)
    args = [x[a] for a in ARG_ORDER]
    w = torch.randn(1, sum(LENS), CFG.n_heads, CFG.d_v, device="cuda", dtype=BF16)
    with tuning.overrides({"selection": {"mode": mode}} if mode != "auto" else {}), dispatch.record() as rec:
        (o, idx), grads = _fwd_bwd(lambda *a: fn.nsa_attention(*a, CFG, backend="triton", cu_seqlens=cu_of(LENS, "cuda"),
                                                                return_indices=True), args, w)
        (ro, ridx), rgrads = _fwd_bwd(lambda *a: per_document(
            lambda *d: fn.nsa_attention(*d, CFG, backend="triton", return_indices=True), CFG, LENS,
            dict(zip(ARG_ORDER, a))), args, w)
    assert rec.ran == {"cmp": "triton", "sel": "triton", "win": "triton"}
    assert torch.equal(idx, ridx)
    assert rel_l2(o, ro) <= TOL, rel_l2(o, ro)
    for name, g, rg in zip(ARG_ORDER, grads, rgrads):
        assert rel_l2(g, rg) <= TOL, (name, rel_l2(g, rg))


def test_triton_forward_without_gradient_equals_each_document_alone():
    """The no-gradient forward (the gated sum in the selection kernel's epilogue)."""
    x = _inputs(CFG, LENS, seed=1)
    with torch.no_grad():
        o = fn.nsa_attention(*(x[a] for a in ARG_ORDER), CFG, backend="triton", cu_seqlens=cu_of(LENS, "cuda"))
        ro = per_document(lambda *d: fn.nsa_attention(*d, CFG, backend="triton"), CFG, LENS, x)
    assert rel_l2(o, ro) <= TOL, rel_l2(o, ro)


@pytest.mark.parametrize("backend", ["sdpa", "fa2", "triton"])
def test_window_backends_equal_each_document_alone(backend):
    """The window branch on FlexAttention with a document mask (sdpa), varlen FlashAttention-2 (fa2) and
    triton, forward and backward. fa2 without flash-attn needs a torch whose varlen_attn has window_size:
    where it has not, the test reports the backend's reason as a skip (unavailable here)."""
    reason = dispatch.get(backend).varlen_unavailable("win", torch.device("cuda"), BF16)
    if reason is not None:
        skip_unavailable(reason)
    x = _inputs(CFG, LENS, seed=2)
    ins = [x["q"], x["k_win"], x["v_win"]]
    w = torch.randn(1, sum(LENS), CFG.n_heads, CFG.d_v, device="cuda", dtype=BF16)
    o, grads = _fwd_bwd(lambda *a: fn.sliding_window_attention(*a, CFG, backend=backend,
                                                                cu_seqlens=cu_of(LENS, "cuda")), ins, w)
    ro, rgrads = _fwd_bwd(lambda *a: per_document(lambda *d: fn.sliding_window_attention(*d, CFG, backend=backend),
                                                  CFG, LENS, dict(q=a[0], k_win=a[1], v_win=a[2]),
                                                  names=("q", "k_win", "v_win")), ins, w)
    assert rel_l2(o, ro) <= TOL, rel_l2(o, ro)
    for name, g, rg in zip(("q", "k_win", "v_win"), grads, rgrads):
        assert rel_l2(g, rg) <= TOL, (name, rel_l2(g, rg))


def test_module_equals_each_document_alone():
    """The layer (projections, per-document RoPE and compression, triton branches) on packed documents,
    and the gradient of its input, against each document run alone."""
    torch.manual_seed(0)
    cfg = NSAConfig(dim=2048, n_heads=64, n_kv_heads=4, d_k=128, d_v=128)
    layer = NSAAttention(cfg, backend="triton").cuda().to(BF16)
    lens = [4096, 1, 2000, 0, 9000]
    x = torch.randn(1, sum(lens), cfg.dim, device="cuda", dtype=BF16, requires_grad=True)
    w = torch.randn(1, sum(lens), cfg.dim, device="cuda", dtype=BF16)
    y, (gx,) = _fwd_bwd(lambda t: layer(t, cu_seqlens=Varlen(cu_of(lens, "cuda"))), [x], w)
    ry, (rgx,) = _fwd_bwd(lambda t: per_document(layer, cfg, lens, {"x": t}, names=("x",)), [x], w)
    assert rel_l2(y, ry) <= TOL, rel_l2(y, ry)
    assert rel_l2(gx, rgx) <= TOL, rel_l2(gx, rgx)
