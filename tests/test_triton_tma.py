"""The TMA descriptor loads (``tuning.<op>.tma``): where they are taken, and that they compute exactly
what the per-element pointer loads compute.

Under Triton's interpreter on CPU tensors, float32. Each case runs the same inputs twice, ``tma`` on
and off, and asserts bit-equal outputs and gradients (the selection forward: equal to float32
rounding, see there), and that the launch received descriptors (on) or none (off). The shapes cross
every edge a descriptor block can cross: batch rows (B=2), the last query and key tiles (T not a
multiple of the tile), padded head dims (D=24 in blocks of 32), and for the selection forward, indices
of -1 and blocks whose tile reaches past the query's position.
"""
from __future__ import annotations

import os

# The interpreter must be chosen before triton is first imported (tests/conftest.py does not set it).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nsa import NSAConfig  # noqa: E402
from nsa.backends.triton import attention_bwd, compressed, poisoned_outputs, selection, triton_unsupported, tuning  # noqa: E402
from nsa.backends.triton.utils import tma_ok  # noqa: E402
from nsa.varlen import Varlen  # noqa: E402

from test_triton_selection import random_indices  # noqa: E402

_OLD = triton_unsupported()
pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs on CPU tensors under TRITON_INTERPRET=1"),
    pytest.mark.skipif(_OLD is not None, reason=_OLD or ""),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # interpreter: log2(0) in masked-off rows
]

SMALL = {"compressed": dict(rows=16, block_n=16, warps=4, stages=1, lse_n=32),
         "attention_bwd": dict(rows=16, block_n=16, warps=4, stages=1, programs=8, split_max=4),
         "topn": dict(elems=64, warps=2)}


def _cfg(HQ, H, Dk, Dv, l_sel, n_sel):
    return NSAConfig(dim=HQ * Dk, n_heads=HQ, n_kv_heads=H, d_k=Dk, d_v=Dv, l=8, d=4, l_sel=l_sel, n_sel=n_sel,
                     n_init=1, n_local=1, w=16)


def _spy(monkeypatch, module, kernel):
    """Record the TMA flag of every launch of ``module.kernel``."""
    seen = []
    real = getattr(module, kernel)

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(kw["TMA"])
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(module, kernel, Spy())
    return seen


def _run_twice(fn, xs, tune_key):
    """fn(*xs) forward and backward with ``tuning.<op>.tma`` on, then off: (outputs, grads) of each."""
    results = []
    for on in (True, False):
        leaves = [x.clone().requires_grad_(x.is_floating_point()) for x in xs]
        with poisoned_outputs(), tuning.overrides({**SMALL, **{op: {"tma": on} for op in tune_key}}):
            outs = fn(*leaves)
            w = torch.randn(outs[0].shape, generator=torch.Generator().manual_seed(1))
            (outs[0] * w).sum().backward()
        results.append(([o.detach() for o in outs], [x.grad for x in leaves if x.requires_grad]))
    return results


@pytest.mark.parametrize("G", [1, 4])
def test_compressed_branch_same_through_descriptors(monkeypatch, G):
    """Compressed forward (q, pass 1 and pass 2 key tiles) and its backward (q, dO, k, v) through
    descriptors: the same o, indices, dq, dk, dv as the pointer loads."""
    H, B, T, Dk, Dv = 2, 2, 45, 24, 16
    cfg = _cfg(H * G, H, Dk, Dv, l_sel=8, n_sel=3)
    g = torch.Generator().manual_seed(G)
    n_cmp = cfg.n_cmp(T)
    xs = [torch.randn(B, T, H * G, Dk, generator=g) * 2, torch.randn(B, n_cmp, H, Dk, generator=g) * 2,
          torch.randn(B, n_cmp, H, Dv, generator=g)]
    fwd = _spy(monkeypatch, compressed, "fwd_kernel")
    dq = _spy(monkeypatch, attention_bwd, "bwd_dq_kernel")
    dkdv = _spy(monkeypatch, attention_bwd, "bwd_dkdv_kernel")
    (on_out, on_grad), (off_out, off_grad) = _run_twice(
        lambda q, k, v: compressed.compressed_branch(q, k, v, cfg), xs, ("compressed", "attention_bwd"))
    assert fwd == [True, False] and dq == [True, False] and dkdv == [True, False]
    for a, b in zip(on_out + on_grad, off_out + off_grad):
        assert torch.isfinite(a.double()).all() and torch.equal(a, b)


def test_selection_forward_same_through_descriptors(monkeypatch):
    """The query-outer selection forward reads key/value tiles through descriptors: rows outside the
    selected block (past t, j = -1, the other sequence of the batch) are data, not zeros, and must
    still contribute nothing. Same o and gradients as the pointer loads, to float32 rounding."""
    B, T, HQ, H, Dk, Dv, l_sel = 2, 40, 4, 2, 24, 16, 16
    cfg = _cfg(HQ, H, Dk, Dv, l_sel=l_sel, n_sel=3)
    g = torch.Generator().manual_seed(3)
    idx = random_indices(cfg, B, T, 0, T, g, drop=0.5)
    assert (idx < 0).any()
    xs = [torch.randn(B, T, HQ, Dk, generator=g), torch.randn(B, T, H, Dk, generator=g),
          torch.randn(B, T, H, Dv, generator=g)]
    fwd = _spy(monkeypatch, selection, "fwd_q_kernel")
    with tuning.overrides({"selection": {"mode": "query"}}):
        (on_out, on_grad), (off_out, off_grad) = _run_twice(
            lambda q, k, v: (selection.selected_attention(q, k, v, idx, cfg),), xs, ("selection",))
    assert fwd == [True, False]
    # A row that leaked into the sums would move them by O(1). The interpreter's float32 products
    # (numpy's matmul) of tiles that hold other data in the masked rows need not round alike: numpy 2.4.6
    # with OpenBLAS 0.3.31 on this CPU differs in the last bits (<= 1e-6 here), so to float32 rounding.
    for a, b in zip(on_out + on_grad, off_out + off_grad):
        assert torch.isfinite(a.double()).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_descriptors_only_where_they_apply():
    """``tma_ok``: the tuning value, one sequence per batch row, a power-of-two group, and tensors a
    descriptor can describe (unit last stride, 16-byte strides and base); None means on under the
    interpreter."""
    x = torch.zeros(2, 8, 4, 16)
    assert tma_ok(None, None, 2, 2, x) and tma_ok(True, None, 2, 2, x)
    assert not tma_ok(False, None, 2, 2, x)
    assert not tma_ok(True, Varlen(torch.tensor([0, 3, 8], dtype=torch.int32)), 2, 2, x)  # packed documents: pointer loads
    assert not tma_ok(True, None, 3, 4, x)  # G=3 in blocks of 4 heads would read the next group's
    assert not tma_ok(True, None, 2, 2, torch.zeros(2, 8, 4, 18)[..., :17])  # 68-byte rows
    assert not tma_ok(True, None, 2, 2, x.transpose(-1, -2))  # last stride 8
    assert not tma_ok(True, None, 2, 2, torch.zeros(2, 0, 4, 16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("tma", [True, False])
def test_stages_follow_the_load_path(monkeypatch, tma, dtype):
    """``stages=None`` (the CUDA table's value for the compressed forward and the compressed/window
    backward): 3 stages through descriptors, 2 with pointer loads (3 exceed shared memory there); one
    fewer for float32 (its window backward at Dk=64 asked an H100 for 258 KiB at 3 stages)."""
    cfg = _cfg(4, 2, 16, 16, l_sel=8, n_sel=3)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 20, 4, 16, generator=g).to(dtype).requires_grad_(True)
    k, v = (torch.randn(1, cfg.n_cmp(20), 2, 16, generator=g).to(dtype).requires_grad_(True) for _ in range(2))
    seen = []
    for mod, name in ((compressed, "fwd_kernel"), (attention_bwd, "bwd_dq_kernel"), (attention_bwd, "bwd_dkdv_kernel")):
        real = getattr(mod, name)

        class Spy:
            def __getitem__(self, grid, real=real, name=name):
                return lambda *a, **kw: seen.append((name, kw["TMA"], kw["num_stages"])) or real[grid](*a, **kw)

        monkeypatch.setattr(mod, name, Spy())
    with tuning.overrides({**SMALL, "compressed": {**SMALL["compressed"], "stages": None, "tma": tma},
                           "attention_bwd": {**SMALL["attention_bwd"], "stages": None, "tma": tma}}):
        o, _ = compressed.compressed_branch(q, k, v, cfg)
        o.sum().backward()
    want = (tuning.STAGES_TMA if tma else tuning.STAGES_POINTERS) - (dtype == torch.float32)
    assert seen == [(n, tma, want) for n in ("fwd_kernel", "bwd_dq_kernel", "bwd_dkdv_kernel")]
