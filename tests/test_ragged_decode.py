"""Ragged batches (continuous batching) through the module, reference backend, float64: a packed prefill
of prompts of different lengths into one cache (``forward(x, cache, cu_seqlens=cu)``), then decode steps
and chunks with each row at its own position. Every row equals its sequence decoded alone (a cache of one
row filled with that prompt, then the same inputs) and the no-cache forward of the whole sequence."""
from __future__ import annotations

import pytest
import torch
from conftest import cu_of

from nsa import NSAAttention, NSAConfig

F64 = torch.float64
TOL = 1e-10
BUFFERS = ("k_cmp_raw", "v_cmp_raw", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win")

# l=8, d=4: compressed token i is emitted at t = 4i + 7 (7, 11, 15, 19, ...); l_sel=8, n_sel=3, w=6.
# Prompts: empty; 3 (no compressed token visible for the first steps); 7 and 11 (the first step completes
# a compressed block); 17 (more selection blocks than n_sel); 22 (past the window and several blocks).
LENS = [3, 7, 0, 11, 17, 22]


def _layer(phi="mlp", **over) -> NSAAttention:
    kw = dict(dim=16, n_heads=4, n_kv_heads=2, d_k=4, d_v=6, l=8, d=4, l_sel=8, n_sel=3, w=6, n_init=1,
              n_local=1, phi=phi, gate_hidden=8)
    torch.manual_seed(0)
    return NSAAttention(NSAConfig(**{**kw, **over})).double()


def _inputs(lens, n_new, dim=16, seed=1):
    """Prompts (a list of [1,L_b,dim]) and the tokens appended after them ([B,n_new,dim])."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randn(1, n, dim, generator=g, dtype=F64) for n in lens]
    return prompts, torch.randn(len(lens), n_new, dim, generator=g, dtype=F64)


def _close(a, b, what=""):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= TOL, (what, err)


@torch.no_grad()
def _alone(layer, prompt, new, chunks, max_len):
    """One sequence in a cache of its own: its prompt, then ``new`` [1,n,dim] in ``chunks``."""
    cache = layer.new_cache(1, max_len)
    if prompt.shape[1]:
        layer(prompt, cache)
    outs, s = [], 0
    for n in chunks:
        outs.append(layer(new[:, s:s + n], cache))
        s += n
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("phi", ["mlp", "avg"])
@pytest.mark.parametrize("chunks", [[1] * 6, [3, 1, 2]], ids=["steps", "chunks"])
def test_each_row_equals_its_sequence_decoded_alone(phi, chunks):
    layer = _layer(phi)
    n_new, max_len = sum(chunks), 32
    prompts, new = _inputs(LENS, n_new)
    B = len(LENS)
    cache = layer.new_cache(B, max_len)
    with torch.no_grad():
        packed = torch.cat(prompts, 1)
        y0 = layer(packed, cache, cu_seqlens=cu_of(LENS))
        assert torch.equal(y0, layer(packed, cu_seqlens=cu_of(LENS)))  # the packed no-cache forward
        assert cache.ragged and cache.lengths.tolist() == LENS and cache.length == max(LENS)
        outs, s = [], 0
        for n in chunks:
            outs.append(layer(new[:, s:s + n], cache))
            s += n
            assert cache.lengths.tolist() == [L + s for L in LENS] and cache.length == max(LENS) + s
        got = torch.cat(outs, 1)
    for b, L in enumerate(LENS):
        want, alone = _alone(layer, prompts[b], new[b:b + 1], chunks, max_len)
        _close(got[b:b + 1], want, f"row {b} (prompt {L})")
        with torch.no_grad():  # ... and what prefill gives at those positions
            full = layer(torch.cat([prompts[b], new[b:b + 1]], 1))
        _close(got[b:b + 1], full[:, L:], f"row {b} vs prefill")
        # the row's cache holds what the sequence's own cache holds (compressed stream included)
        S = L + n_new
        for name in BUFFERS:
            n = layer.config.n_cmp(S) if name in ("k_cmp", "v_cmp") else S
            _close(getattr(cache, name)[b:b + 1, :n], getattr(alone, name)[:, :n], f"row {b} {name}")


def test_ragged_cache_positions():
    """lengths / ragged / length / row(): what the cache says about its rows, and how to set it."""
    layer = _layer()
    cache = layer.new_cache(3, 10)
    assert not cache.ragged and cache.lengths.tolist() == [0, 0, 0] and cache.lengths.dtype == torch.int64
    cache.lengths = torch.tensor([2, 5, 0])
    assert cache.ragged and cache.length == 5 and cache.lengths.tolist() == [2, 5, 0]
    cache.lengths.add_(1)  # a copy: the cache does not change
    assert cache.lengths.tolist() == [2, 5, 0]
    r = cache.row(1)
    assert r.batch_size == 1 and r.length == 5 and not r.ragged and r.k_sel.data_ptr() == cache.k_sel[1].data_ptr()
    cache.length = 4  # an int: every row there
    assert not cache.ragged and cache.lengths.tolist() == [4, 4, 4]
    cache.lengths = [3, 3, 3]  # equal lengths: uniform
    assert not cache.ragged and cache.length == 3
    cache.lengths = [1, 2, 3]
    cache.reset()
    assert not cache.ragged and cache.length == 0
    with pytest.raises(ValueError, match=r"^cache.lengths: expected 3 row lengths \(batch_size\), got shape \(2,\)"):
        cache.lengths = [1, 2]
    with pytest.raises(ValueError, match=r"^cache.lengths: each must be in \[0, max_len=10\], got \[1, 11, 0\]"):
        cache.lengths = [1, 11, 0]


def test_equal_prompts_give_a_uniform_cache():
    """Packed prompts of equal length: a uniform cache (the batched path), the same numbers."""
    layer = _layer()
    prompts, new = _inputs([9, 9], 3)
    cache, ref = layer.new_cache(2, 16), layer.new_cache(2, 16)
    with torch.no_grad():
        layer(torch.cat(prompts, 1), cache, cu_seqlens=cu_of([9, 9]))
        assert not cache.ragged and cache.length == 9
        layer(torch.cat(prompts, 0), ref)
        _close(layer(new, cache), layer(new, ref))


def test_packed_prefill_rules():
    """Each broken rule is one ValueError line naming the argument; the cache is left as it was."""
    layer = _layer()
    prompts, new = _inputs([3, 9], 2)
    packed, cu = torch.cat(prompts, 1), cu_of([3, 9])
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"^cu_seqlens: a packed prefill into a cache takes one document per "
                                             r"batch row: 2 documents for a cache of batch_size=3$"):
            layer(packed, layer.new_cache(3, 16), cu_seqlens=cu)
        with pytest.raises(ValueError, match=r"^cu_seqlens: document 1 has 9 tokens, more than the cache's "
                                             r"max_len=8$"):
            layer(packed, layer.new_cache(2, 8), cu_seqlens=cu)
        cache = layer.new_cache(2, 16)
        layer(new[:, :1], cache)
        with pytest.raises(ValueError, match=r"^cache: a packed prefill \(cu_seqlens\) fills an empty cache; this "
                                             r"one holds \[1, 1\] tokens per row \(reset\(\) it first\)$"):
            layer(packed, cache, cu_seqlens=cu)
        assert cache.length == 1
        with pytest.raises(ValueError, match=r"^x: expected \[1,N,16\] with cu_seqlens"):
            layer(torch.cat([packed, packed]), layer.new_cache(2, 16), cu_seqlens=cu)

        # a ragged cache: the longest row bounds what fits, and nothing is written when it does not
        cache = layer.new_cache(2, 11)
        layer(packed, cache, cu_seqlens=cu)
        before = {n: getattr(cache, n).clone() for n in BUFFERS}
        with pytest.raises(ValueError, match=r"^cache: appending 3 tokens at position 9 \(its longest row\) "
                                             r"exceeds max_len=11$"):
            layer(torch.randn(2, 3, 16, dtype=F64), cache)
        with pytest.raises(ValueError, match=r"^x: batch 1 differs from the cache's batch_size 2$"):
            layer(new[:1, :1], cache)
        assert cache.lengths.tolist() == [3, 9]
        for n, t in before.items():
            assert torch.equal(getattr(cache, n), t), n
        with pytest.raises(ValueError, match=r"^cache: a packed prefill"):
            layer(packed, cache, cu_seqlens=cu)  # ragged is not empty either
        layer(new, cache)  # exactly fills the longest row
        assert cache.lengths.tolist() == [5, 11]
        cache.reset()
        layer(packed, cache, cu_seqlens=cu)  # reset: empty again
        assert cache.lengths.tolist() == [3, 9]
