"""The triton backend on packed documents (cu_seqlens) under Triton's interpreter, float32: every branch
(compressed attention + scores + top-n, selection, window, their backwards, the gate) against the float64
reference run on each document alone; indices exactly equal. Documents of lengths 1, l-1, l, l_sel+3, 0
(empty), w+5 and one over two compressed-key tiles; G in {1, 2, 4, 16}; Dk != Dv. Small tiles, so that
tiles, score-buffer chunks and the backward's query shares cut through documents. Outputs are
NaN-poisoned before the kernels write them.
"""
from __future__ import annotations

import os

# The interpreter must be chosen before triton is first imported (tests/conftest.py does not set it).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import ARG_ORDER, cu_of, make_config, packed_inputs, per_document  # noqa: E402

pytest.importorskip("triton")

from nsa import dispatch  # noqa: E402
from nsa import functional as fn  # noqa: E402
from nsa.backends.triton import poisoned_outputs, triton_unsupported, tuning  # noqa: E402
from nsa.numerics import rel_l2  # noqa: E402
from nsa.varlen import Varlen  # noqa: E402

_OLD_INTERPRETER = triton_unsupported()
pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="kernel tests run on CPU tensors under TRITON_INTERPRET=1"),
    pytest.mark.skipif(_OLD_INTERPRETER is not None, reason=_OLD_INTERPRETER or ""),
]

F64 = torch.float64
LENS = [1, 3, 4, 7, 0, 13, 40]  # 1, l-1, l, l_sel+3, empty, w+5, 19 compressed tokens (two key tiles of 16)
# Tiles of 16 rows / keys; the dk/dv kernel splits key tiles into up to 4 query shares.
SMALL = {"compressed": dict(rows=16, block_n=16, warps=4, stages=1, lse_n=32),
         "window": dict(rows=32, block_n=16, warps=4, stages=1),
         "attention_bwd": dict(rows=16, block_n=16, warps=4, stages=1, programs=64, split_max=4),
         "topn": dict(elems=64, warps=2)}


def _cfg(G, Dk=16, Dv=8, **kw):
    H = 2 if G < 16 else 1
    return make_config(HQ=G * H, H=H, Dk=Dk, Dv=Dv, **{**dict(l=4, d=2, l_sel=4, n_sel=5, w=8, n_init=1,
                                                                 n_local=2), **kw})


@pytest.fixture(autouse=True)
def _poison():
    with poisoned_outputs(), tuning.overrides(SMALL):
        yield


def _run(cfg, backend, x, cu, **kw):
    return fn.nsa_attention(*(x[a] for a in ARG_ORDER), cfg, backend=backend, cu_seqlens=cu, return_indices=True,
                            **kw)


def _reference_per_document(cfg, x):
    x64 = {k: v.detach().to(F64).requires_grad_() for k, v in x.items()}
    o, idx = per_document(lambda *a: fn.nsa_attention(*a, cfg, return_indices=True), cfg, LENS, x64)
    return x64, o, idx


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: log2(0), 0/0 in masked-off rows
@pytest.mark.parametrize("G,Dk,Dv,mode", [(1, 16, 8, "auto"), (2, 16, 32, "block"), (4, 24, 8, "auto"),
                                          (16, 16, 8, "auto")], ids=["G1", "G2-block", "G4-Dk24", "G16"])
def test_nsa_attention_matches_each_document_alone(G, Dk, Dv, mode):
    """Output, indices and the gradient of every input (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win,
    gates): every triton kernel of the layer with gradients."""
    cfg = _cfg(G, Dk, Dv)
    x = packed_inputs(cfg, LENS, seed=G, dtype=torch.float32, requires_grad=True)
    with dispatch.record() as rec, tuning.overrides({"selection": {"mode": mode}} if mode != "auto" else {}):
        o, idx = _run(cfg, "triton", x, cu_of(LENS))
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1))
        grads = torch.autograd.grad(o, [x[a] for a in ARG_ORDER], w)
    assert rec.ran == {"cmp": "triton", "sel": "triton", "win": "triton"}
    x64, ro, ridx = _reference_per_document(cfg, x)
    assert o.dtype == torch.float32 and rel_l2(o, ro) <= 1e-5, rel_l2(o, ro)
    assert torch.equal(idx, ridx)
    rgrads = torch.autograd.grad(ro, [x64[a] for a in ARG_ORDER], w.to(F64))
    for name, g, rg in zip(ARG_ORDER, grads, rgrads):
        assert rel_l2(g, rg) <= 1e-5, (name, rel_l2(g, rg))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("G", [4])
def test_forward_without_gradient_fused_gate_and_score_chunks(G):
    """No gradient: the gated sum in the selection kernel's epilogue (both kernel families); a score buffer of
    a few rows, so that the compressed forward's chunks cut documents (its tile tables clipped to a chunk)."""
    cfg = _cfg(G)
    x = packed_inputs(cfg, LENS, seed=10 + G, dtype=torch.float32)
    _, ro, ridx = _reference_per_document(cfg, x)
    rows = 24 * 2 * cfg.n_blocks(max(LENS)) * 4  # bytes of 24 rows: chunks of 24 positions
    for mode in ("query", "block"):
        with torch.no_grad(), tuning.overrides({"compressed": {"score_buffer_bytes": rows},
                                                "selection": {"mode": mode}}):
            o, idx = _run(cfg, "triton", x, Varlen(cu_of(LENS)))
        assert torch.equal(idx, ridx), mode
        assert rel_l2(o, ro) <= 1e-5, (mode, rel_l2(o, ro))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_half_precision_equals_the_same_kernels_on_each_document():
    """float16 (the compressed scores through tensor-core products): packed documents give what each
    document gives alone on the same kernels; output and indices exactly."""
    cfg = _cfg(4)
    x = packed_inputs(cfg, LENS, seed=7, dtype=torch.float16)
    with torch.no_grad():
        o, idx = _run(cfg, "triton", x, cu_of(LENS))
        ro, ridx = per_document(lambda *a: fn.nsa_attention(*a, cfg, backend="triton", return_indices=True),
                                cfg, LENS, x)
    assert torch.equal(idx, ridx)
    assert torch.equal(o, ro)


def test_only_empty_documents_give_empty_outputs():
    cfg = _cfg(2)
    x = packed_inputs(cfg, [0, 0], dtype=torch.float32, requires_grad=True)
    args = [x[a] for a in ARG_ORDER]
    o, idx = _run(cfg, "triton", x, cu_of([0, 0]))
    assert o.shape == (1, 0, 4, 8) and idx.shape == (1, 0, 2, 3)  # no block: n_sel bounded to n_init + n_local
    grads = torch.autograd.grad(o.sum(), args, allow_unused=True)
    assert all(g is None or g.shape == a.shape for g, a in zip(grads, args))
