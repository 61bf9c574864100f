"""``torch.compile(fullgraph=True)`` of the NSA layer, on CPU: forward and backward of the compiled
module equal eager (output, every parameter's gradient and the input's) with the reference backend and with
the triton backend (its kernels through Triton's interpreter, float32), and every triton custom op
(``nsa::*``) passes ``torch.library.opcheck`` (schema, fake tensors, autograd registration, AOT dispatch).

Compile backends: "aot_eager" traces the whole graph (Dynamo, then AOTAutograd's joint forward/backward)
and runs it with the eager kernels, so the results are bit-identical to eager; "inductor" (the reference
backend only: it generates C++ for every op on CPU, about a minute of compiling) is checked to float32
rounding. The GPU twin, bf16 with inductor: tests/test_compile_gpu.py.
"""
from __future__ import annotations

import os

# The interpreter must be chosen before triton is first imported (tests/conftest.py does not set it).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from nsa import NSAAttention, NSAConfig, dispatch  # noqa: E402
from nsa.toolchain import parse_version  # noqa: E402

# the custom ops need torch >= 2.4; Dynamo before 2.11 is not checked
pytestmark = pytest.mark.skipif(parse_version(torch.__version__) < (2, 11), reason="checked from torch 2.11")

try:
    import triton  # noqa: F401
    from nsa.backends.triton import triton_unsupported
    _NO_TRITON = triton_unsupported()
except ImportError as e:
    _NO_TRITON = f"triton is not installed ({e})"

_TRITON_MARKS = (
    pytest.mark.skipif(_NO_TRITON is not None, reason=_NO_TRITON or ""),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs on CPU tensors under TRITON_INTERPRET=1"),
    pytest.mark.usefixtures("fast_interpreter"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # the interpreter: log2(0), 0/0 in masked-off rows
)


def needs_triton(fn):
    for mark in _TRITON_MARKS:
        fn = mark(fn)
    return fn


# T = 40 keys: 5 selection blocks for n_sel = 3 (a real top-n), 9 compressed tokens, past the window
CFG = NSAConfig(dim=32, n_heads=4, n_kv_heads=2, d_k=8, d_v=8, l=8, d=4, l_sel=8, n_sel=3, w=8, n_init=1, n_local=1,
                gate_hidden=16)
B, T = 1, 40


def _layer(backend):
    torch.manual_seed(0)
    return NSAAttention(CFG, backend=backend)


def _step(m, x, run=None):
    """Output and the gradients of every parameter of m and of x, for the loss sum(y^2) of y = run(x) (m's
    forward, or m compiled)."""
    x = x.clone().requires_grad_(True)
    y = (m if run is None else run)(x)
    y.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)
    return y.detach(), grads, x.grad


def _check_compiled(backend, compiler, tol):
    m = _layer(backend)
    x = torch.randn(B, T, CFG.dim, generator=torch.Generator().manual_seed(1))
    y0, g0, gx0 = _step(m, x)
    torch._dynamo.reset()
    with dispatch.record() as rec:
        y1, g1, gx1 = _step(m, x, torch.compile(m, fullgraph=True, backend=compiler))
    # a compiled call is recorded when traced (dispatch._note runs at trace time)
    assert rec.ran == {"cmp": backend, "sel": backend, "win": backend} and rec.calls == 1, rec
    torch.testing.assert_close(y1, y0, **tol)
    assert set(g1) == set(g0) and all(g is not None for g in g1.values())
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], **tol, msg=lambda m, name=name: f"{name}: {m}")
    torch.testing.assert_close(gx1, gx0, **tol)


EXACT = dict(rtol=1e-6, atol=1e-7)  # aot_eager runs eager's kernels: equal but for summation order in autograd


@pytest.mark.parametrize("attend_path", ["gather"], indirect=True)
def test_reference_layer_compiles_fullgraph(attend_path):
    """Against eager's gathered form: a graph keeps that form (reference._masked_cheaper), so EXACT holds."""
    _check_compiled("reference", "aot_eager", EXACT)


@pytest.mark.slow
def test_reference_layer_compiles_fullgraph_with_inductor():
    _check_compiled("reference", "inductor", dict(rtol=1e-4, atol=1e-5))


@needs_triton
@pytest.mark.parametrize("mode", ["query", "block"])
def test_triton_layer_compiles_fullgraph(mode, monkeypatch):
    """Both selection kernel families: the block-outer one's forward hands its plan (work items: a count
    bounded by the shapes) to the backward as op outputs, which reuses it (one plan per step, as in eager)."""
    from nsa.backends.triton import selection, tuning

    plans = []
    plan = selection._block_outer_plan
    monkeypatch.setattr(selection, "_block_outer_plan", lambda *a, **kw: plans.append(1) or plan(*a, **kw))
    with tuning.overrides({"selection": {"mode": mode}}):
        _check_compiled("triton", "aot_eager", EXACT)
    # one plan a step, eager and compiled: block-outer, the forward's, reused by the backward; query-outer,
    # the backward's (its dq partials fit)
    assert len(plans) == 2, plans


@needs_triton
def test_triton_layer_compiles_fullgraph_without_grad():
    """No gradient: the selected branch's kernel computes the gated sum in its epilogue (``selected_gated``)."""
    m = _layer("triton")
    x = torch.randn(B, T, CFG.dim, generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(m, fullgraph=True, backend="aot_eager")(x), m(x), **EXACT)


@needs_triton
@pytest.mark.parametrize("plan", ["triton", {"cmp": "triton", "sel": "triton", "win": "sdpa"}], ids=["triton", "mixed"])
def test_a_backend_first_used_under_compile_registers_in_the_trace(plan, monkeypatch):
    """A process whose first call of the lazily registered backends is compiled (no eager call before, as in a
    fresh process): they register while the call is traced, and the graph finds them (it read the registry
    after they registered, not before)."""
    monkeypatch.setattr(dispatch, "_REGISTRY", {"reference": dispatch.get("reference")})  # none registered yet
    m = _layer(plan)
    x = torch.randn(B, T, CFG.dim, generator=torch.Generator().manual_seed(4))
    torch._dynamo.reset()
    with torch.no_grad():
        y = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
    assert set(dispatch._REGISTRY) == {"reference", *dispatch.resolve(plan).values()}
    with torch.no_grad():
        torch.testing.assert_close(y, m(x), **EXACT)


def _op_cases():
    """(name, op, args) of every triton custom op at a small shape (B=1, T=20, G=2), from a real forward."""
    from nsa.backends.triton import attention_bwd, compressed, gate, selection, tuning, window
    from nsa.backends.triton.utils import Blocks

    g = torch.Generator().manual_seed(3)
    Tq, HQ, H, D = 20, CFG.n_heads, CFG.n_kv_heads, CFG.d_k
    q, k, v = (torch.randn(1, Tq, h, D, generator=g) for h in (HQ, H, H))
    kc, vc = (torch.randn(1, CFG.n_cmp(Tq), H, D, generator=g) for _ in range(2))
    scale, nb = D ** -0.5, CFG.n_blocks(Tq)

    def tune(op, **kw):
        return tuning.to_ints(op, {**tuning.params(op, "interpret"), **kw})

    cases = []
    args = (q, kc, vc, list(Blocks.of(CFG)), scale, 0, nb, tune("compressed"))
    o, lse, idx = compressed._compressed_fwd_op.op(*args)
    do = torch.randn(o.shape, generator=g)
    cases += [("compressed_fwd", compressed._compressed_fwd_op.op, args),
              ("compressed_scores", compressed.compressed_scores_op.op,
               (q, kc, vc, lse, list(Blocks.of(CFG)), scale, nb, tune("compressed"))),
              ("attention_bwd", attention_bwd._attention_bwd_op.op,
               (q, kc, vc, o, lse, do, scale, 0, CFG.d, CFG.l - 1, 0, tune("attention_bwd"))),
              ("window_fwd", window._window_fwd_op.op, (q, k, v, CFG.w, scale, 0, tune("window")))]
    outs = [torch.randn(o.shape, generator=g) for _ in range(3)]
    gates = torch.rand(*o.shape[:3], 3, generator=g)
    cases += [("gate_fwd", gate._gate_fwd_op.op, (*outs, gates, tune("gate"))),
              ("gate_bwd", gate._gate_bwd_op.op, (*outs, gates, do, tune("gate")))]
    lay = selection._layout(q, k, CFG, 0, None)
    flat = [x.reshape(Tq, x.shape[2], D) for x in (q, k, v)]
    idx32 = idx.reshape(Tq, H, -1).to(torch.int32)
    for mode in ("query", "block"):
        args = (*flat, idx32, lay.cu_q, lay.cu_k, lay.row_seq, 0, nb, scale, CFG.l_sel, mode,
                tune("selection", part_bytes_max=8 << 30))
        fwd, bwd = selection._selection_fwd_op.op, selection._selection_bwd_op.op
        o_sel, lse_sel, *plan = fwd(*args, None, None, None)
        assert plan[0].numel() == (Tq * H * idx32.shape[2] if mode == "block" else 0)  # the plan is kept
        gated = [x.reshape(Tq, HQ, -1) for x in (outs[0], outs[2], gates)]
        cases += [(f"selection_fwd-{mode}", fwd, (*args, None, None, None)),
                  (f"selection_fwd-{mode}-gated", fwd, (*args, *gated)),
                  (f"selection_bwd-{mode}", bwd, (do.reshape(Tq, HQ, D), *flat, o_sel, lse_sel, idx32, *args[4:], *plan))]
    return cases


@needs_triton
def test_triton_custom_ops_pass_opcheck():
    """Each op's schema, fake (meta) function against its real outputs (shapes, strides, dtypes; the
    selection plan's work items: a count bounded by the shapes), autograd registration (none: the
    autograd.Functions call the ops) and AOT dispatch, static and dynamic shapes."""
    for name, op, args in _op_cases():
        try:
            torch.library.opcheck(op, args)
        except Exception as e:
            raise AssertionError(f"{name}: {e}") from e
