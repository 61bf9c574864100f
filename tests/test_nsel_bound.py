"""n_sel larger than the selection blocks that exist: the work and the index tensors are
sized by the blocks (``NSAConfig.sel_count``), not by n_sel, on every backend, and the outputs equal those
of n_sel = the number of blocks (Eq. 12 with fewer candidates than n_sel takes them all).

The widths are the check (a timed test would not be): with n_sel = 10^4 at T = 40 the index tensors were
[B,T,H,10^4] and the reference's gather n_sel * l_sel tokens per row before the bound.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

import dataclasses

import pytest
import torch

from nsa import NSAAttention, NSAConfig, functional

HUGE = 10_000
T = 40


def _cfg(n_sel: int, **kw) -> NSAConfig:
    base = dict(dim=16, n_heads=4, n_kv_heads=2, d_k=8, d_v=6, l=8, d=4, l_sel=8, n_sel=n_sel, w=12, n_init=1,
                n_local=1, gate_hidden=8, phi_hidden=10)
    base.update(kw)
    return NSAConfig(**base)


def test_sel_count_is_bounded_by_the_blocks_and_the_forced_ones():
    c = _cfg(HUGE)
    assert c.sel_count(5) == 5 and c.sel_count(0) == 2 and _cfg(3).sel_count(5) == 3
    assert c.bounded(T).n_sel == 5 and c.bounded(T) == dataclasses.replace(c, n_sel=5)
    c3 = _cfg(3)
    assert c3.bounded(T) is c3


def _inputs(c: NSAConfig, dtype, B=2):
    torch.manual_seed(0)
    r = lambda *s: torch.randn(*s, dtype=dtype)  # noqa: E731
    q = r(B, T, c.n_heads, c.d_k)
    kc, vc = r(B, c.n_cmp(T), c.n_kv_heads, c.d_k), r(B, c.n_cmp(T), c.n_kv_heads, c.d_v)
    kv = [r(B, T, c.n_kv_heads, d) for d in (c.d_k, c.d_v, c.d_k, c.d_v)]
    gates = torch.rand(B, T, c.n_heads, 3, dtype=dtype)
    return q, kc, vc, *kv, gates


@pytest.mark.parametrize("backend,dtype", [("reference", torch.float64), ("triton", torch.float32)])
def test_attention_with_a_huge_n_sel_equals_all_blocks(backend, dtype):
    if backend == "triton":
        pytest.importorskip("triton")
    big, all_blocks = _cfg(HUGE), _cfg(_cfg(HUGE).n_blocks(T))
    x = _inputs(big, dtype)
    o, idx = functional.nsa_attention(*x, big, backend=backend, return_indices=True)
    o_ref, idx_ref = functional.nsa_attention(*x, all_blocks, backend=backend, return_indices=True)
    assert idx.shape == (2, T, 2, big.n_blocks(T)), idx.shape
    assert torch.equal(idx, idx_ref)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)


def test_select_blocks_and_selected_attention_take_bounded_indices():
    c = _cfg(HUGE)
    scores = torch.rand(1, T, 2, c.n_blocks(T), dtype=torch.float64)
    idx = functional.select_blocks(scores, c)
    assert idx.shape == (1, T, 2, c.n_blocks(T))
    q, _, _, ks, vs, _, _, _ = _inputs(c, torch.float64, B=1)
    o = functional.selected_attention(q, ks, vs, idx, c)
    assert torch.equal(o, functional.selected_attention(q, ks, vs, idx, _cfg(c.n_blocks(T))))
    with pytest.raises(ValueError, match=r"indices: expected shape \[1, 40, 2, k\] \[B,Tq,H,k\] with 1 <= k <= "
                                         r"n_sel=3, got \(1, 40, 2, 5\)"):
        functional.selected_attention(q, ks, vs, idx, _cfg(3))


def test_module_prefill_and_cached_decode_with_a_huge_n_sel():
    """The layer (reference backend, float64): prefill and the cached step-by-step forward equal the layer
    with n_sel = the number of blocks, parameters shared."""
    big, small = _cfg(HUGE), _cfg(_cfg(HUGE).n_blocks(T))
    torch.manual_seed(2)
    m_small = NSAAttention(small).double()
    m_big = NSAAttention(big).double()
    m_big.load_state_dict(m_small.state_dict())
    x = torch.randn(2, T, big.dim, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(m_big(x), m_small(x), rtol=0, atol=0)
        cb, cs = m_big.new_cache(2, T), m_small.new_cache(2, T)
        for t in range(T):
            torch.testing.assert_close(m_big(x[:, t:t + 1], cb), m_small(x[:, t:t + 1], cs), rtol=0, atol=0)


@pytest.mark.usefixtures("fast_interpreter")
def test_graph_decoder_sizes_its_kernels_by_the_cache_blocks():
    pytest.importorskip("triton")
    from nsa.decode import GraphDecoder

    torch.manual_seed(3)
    c = _cfg(HUGE, phi="avg", gate_hidden=0)
    m = NSAAttention(c).eval()
    n = 14
    x = torch.randn(1, n, c.dim)
    dec, cref = GraphDecoder(m, m.new_cache(1, n), backend="triton"), m.new_cache(1, n)
    assert dec._kernels.config.n_sel == c.n_blocks(n) == 2
    assert dec._kernels.indices.shape == (1, 2, 2)
    for t in range(n):
        y = dec.step(x[:, t:t + 1])
        with torch.no_grad():
            torch.testing.assert_close(y, m(x[:, t:t + 1], cref), rtol=1e-5, atol=1e-5, msg=f"t={t}")
