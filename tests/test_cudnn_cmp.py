"""The ``cudnn`` backend's compressed branch: the fold of Eq. 5's compressed attention into causal attention
(d queries per row block folded into the heads), the unfold of its output and lse, and the triton score-only
pass (``SCORE_ONLY``) from that lse, against ``nsa.reference`` on the CPU.

cuDNN itself runs on a GPU only (tests/test_cudnn_gpu.py); here the folded attention is computed by
``math_attend`` (an explicit causal softmax over the folded layout), so everything around the cuDNN call runs
as on the GPU: the fold, the unfold, the lse convention and the triton kernel under the interpreter.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nsa import reference  # noqa: E402
from nsa.backends import cudnn  # noqa: E402
from nsa.backends.triton import poisoned_outputs, triton_unsupported, tuning  # noqa: E402
from nsa.backends.triton.compressed import compressed_branch as triton_compressed  # noqa: E402
from nsa.toolchain import parse_version  # noqa: E402
from test_triton_compressed import CMP_CASES, CMP_IDS, close, cmp_inputs, rand  # noqa: E402

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the score kernel in the interpreter"),
    pytest.mark.skipif(triton_unsupported() is not None, reason=triton_unsupported() or ""),
]


@pytest.fixture(autouse=True)
def _poison():
    small = {"compressed": dict(rows=16, block_n=16, warps=4, stages=1, lse_n=32), "topn": dict(elems=64, warps=2)}
    with poisoned_outputs(), tuning.overrides(small):
        yield


def math_attend(qf, kf, vf, scale):
    """Causal attention over the folded layout ``[B,Hq,n,D]`` x ``[B,H,n,D]`` with its natural-log lse, as the
    cuDNN op returns them (top-left causal: row k sees keys 0..k)."""
    G = qf.shape[1] // kf.shape[1]
    k, v = kf.repeat_interleave(G, 1).double(), vf.repeat_interleave(G, 1).double()
    s = qf.double() @ k.transpose(-1, -2) * scale
    n = s.shape[-1]
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return (torch.softmax(s, -1) @ v).to(qf.dtype), torch.logsumexp(s, -1).float()


# q_start = 0 cases (the backend's domain)
CASES = [(c, i) for c, i in zip(CMP_CASES, CMP_IDS) if c[2] == 0]


@pytest.mark.parametrize("case", [c for c, _ in CASES], ids=[i for _, i in CASES])
def test_fold_forward_indices_and_grads(case):
    cfg, qs, q, k, v = cmp_inputs(case, torch.float32)
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    o, idx = cudnn.compressed_branch(*xs, cfg, attend=math_attend)
    rx = [t.clone().requires_grad_() for t in (q, k, v)]
    ro, ridx = reference.compressed_branch(*rx, cfg)
    close(o, ro, 1e-5)
    assert torch.equal(idx, ridx)
    if k.shape[1] == 0:  # T < l: no query sees a compressed key
        assert not o.requires_grad and not o.any()
        return
    do = rand(*o.shape, seed=9)
    for a, b in zip(torch.autograd.grad(o, xs, do), torch.autograd.grad(ro, rx, do)):
        close(a, b, 1e-5)


@pytest.mark.parametrize("T,l,d", [(40, 8, 4), (41, 8, 4), (43, 8, 4), (7, 8, 4), (11, 8, 4), (64, 16, 8), (33, 4, 2)])
def test_fold_is_a_view_and_unfolds(T, l, d):
    """Query t = l - 1 + k*d + r of a whole row block sits at row k, folded head r*HQ + hq, in a view of q;
    key head r*H + h of the folded keys is key head h; the unfold returns rows l - 1 .. l - 2 + n*d."""
    HQ, H = 4, 2
    q = rand(2, T, HQ, 5)
    qf = cudnn.fold_queries(q, l, d)
    n = cudnn.n_rows(T, l, d)
    assert qf.shape == (2, d * HQ, n, 5) and (n == 0 or qf.data_ptr() == q[:, l - 1:].data_ptr())
    for t in range(l - 1, l - 1 + n * d):
        k, r = divmod(t - l + 1, d)
        assert torch.equal(qf[:, r * HQ + torch.arange(HQ), k], q[:, t])
    assert torch.equal(cudnn.unfold_rows(qf, d), q[:, l - 1:l - 1 + n * d])
    kc = rand(2, n + 1, H, 5, seed=3)
    kf = cudnn.fold_keys(kc, n, d)
    assert kf.shape == (2, d * H, n, 5)
    for r in range(d):
        assert torch.equal(kf[:, r * H + torch.arange(H)], kc[:, :n].transpose(1, 2))
    lse_f = torch.randn(2, d * HQ, n)
    lse = cudnn.unfold_lse(lse_f, d)
    for t in range(l - 1, l - 1 + n * d):
        k, r = divmod(t - l + 1, d)
        close(lse[:, :, t - l + 1], lse_f[:, r * HQ + torch.arange(HQ), k] / torch.log(torch.tensor(2.0)), 1e-6)


@pytest.mark.parametrize("limit,want", [(10**9, (2, 4)), (2 * 4 * 2 * 10 * 16, (2, 4)), (4 * 2 * 10 * 16, (1, 4)),
                                        (2 * 2 * 10 * 16, (1, 2)), (2 * 10 * 16, (1, 1)), (5, (1, 1))])
def test_pieces_keep_each_call_under_the_limit(limit, want):
    assert cudnn.pieces(2, 4, 2, 10, 16, limit) == want


def test_attention_in_pieces_equals_one_call():
    """Calls split over batch rows and fold offsets (as past 2^31 elements) give the one call's output,
    lse and gradients."""
    cfg, _, q, k, v = cmp_inputs((2, 80, 0, 4, 2, 16, 16, {}), torch.float32)  # d = 4, n = 18 rows
    calls = []

    def counted(*a):
        calls.append(a[0].shape)
        return math_attend(*a)
    res = []
    for limit in (cudnn.MAX_ELEMS, 2 * 4 * 18 * 16):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        o, lse = cudnn.attention(*xs, cfg, 0.25, counted, limit)
        res.append((o, lse, torch.autograd.grad(o, xs, torch.ones_like(o))))
    assert calls[0] == (2, 16, 18, 16) and calls[1:] == [(1, 8, 18, 16)] * 4
    (o1, lse1, g1), (o2, lse2, g2) = res
    fin = torch.isfinite(lse1)
    assert torch.equal(fin, torch.isfinite(lse2)) and fin.any() and not fin.all()  # rows t < l - 1: +inf
    close(lse2[fin], lse1[fin], 1e-6)
    for a, b in zip((o2, *g2), (o1, *g1)):
        close(a, b, 1e-6)


def test_score_only_pass_matches_the_two_pass_kernel():
    """The triton kernel's SCORE_ONLY launch, given the lse its own pass 1 found, picks the same blocks."""
    from nsa.backends.triton.compressed import compressed_forward

    cfg, qs, q, k, v = cmp_inputs(CMP_CASES[8], torch.float32)
    nb = cfg.n_blocks(q.shape[1])
    tune = tuning.params("compressed", q.device)
    o, lse, idx = compressed_forward(q, k, v, cfg, scale=q.shape[-1] ** -0.5, q_start=0, n_blocks=nb, on_scored=None, tune=tune)
    none, lse2, idx2 = compressed_forward(q, k, v, cfg, scale=q.shape[-1] ** -0.5, q_start=0, n_blocks=nb, on_scored=None,
                                tune=tune, lse_in=lse.clone())
    assert none is None and torch.equal(lse2, lse)
    assert torch.equal(idx2, idx)
    assert torch.equal(triton_compressed(q, k, v, cfg)[1], idx)


def test_refuses_q_start_and_other_branches():
    cfg, qs, q, k, v = cmp_inputs(CMP_CASES[0], torch.float32)
    with pytest.raises(ValueError, match="q_start=5"):
        cudnn.compressed_branch(q, k, v, cfg, q_start=5, attend=math_attend)
    be = cudnn.BACKEND
    assert "compressed branch only" in be.unavailable("sel", torch.device("cuda"), torch.bfloat16)
    assert "CUDA" in be.unavailable("cmp", torch.device("cpu"), torch.bfloat16)
    assert "float16, bfloat16" in be.unavailable("cmp", torch.device("cuda"), torch.float32)
    assert "cu_seqlens" in be.varlen_unavailable("cmp", torch.device("cuda"), torch.bfloat16)


@pytest.mark.skipif(parse_version(torch.__version__) < (2, 11), reason="Dynamo checked from torch 2.11")
def test_compiles_fullgraph(fast_interpreter):
    """torch.compile(fullgraph=True) of the branch (aot_eager: Dynamo and AOTAutograd, eager kernels): the same
    output, indices and gradients as eager; the score pass is one node (nsa::compressed_scores)."""
    cfg, _, q, k, v = cmp_inputs(CMP_CASES[0], torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *x: cudnn.compressed_branch(*x, cfg, attend=math_attend), fullgraph=True,
                             backend="aot_eager")
    res = []
    for fn in (compiled, lambda *x: cudnn.compressed_branch(*x, cfg, attend=math_attend)):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        o, idx = fn(*xs)
        res.append((o, idx, torch.autograd.grad(o, xs, torch.ones_like(o))))
    (o1, i1, g1), (o2, i2, g2) = res
    assert torch.equal(i1, i2)
    for a, b in zip((o1, *g1), (o2, *g2)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
