"""Ragged batches on the GPU decode path (nsa.decode.GraphDecoder and the triton decode kernels, each
sequence at its own position), through the Triton interpreter on CPU tensors, float32, tiny shapes.

A packed prefill of prompts of different lengths (``dec.prefill(x, cu_seqlens=cu)``), then eager steps:
every step equals the module's ragged decode (the reference) row by row, with the same top-n per row and
the kernels' token counters equal to a per-row count from the indices; and every row equals its sequence
decoded alone through a GraphDecoder of one row. Split-KV partials (several splits per branch), the two- and
three-launch modes, Dk != Dv, l_sel < l (top-n choosing among more candidates than n_sel).
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

import pytest
import torch

pytest.importorskip("triton")

from conftest import cu_of
from test_decode_gpu_path import TOL, _reference_branches

from nsa import NSAAttention, NSAConfig
from nsa.backends.triton import poisoned_outputs, triton_unsupported, tuning
from nsa.decode import GraphDecoder, tokens_read

_OLD_INTERPRETER = triton_unsupported()  # from triton.__version__: None on triton >= 3.0
pytestmark = [pytest.mark.skipif(_OLD_INTERPRETER is not None, reason=_OLD_INTERPRETER or ""),
              pytest.mark.usefixtures("fast_interpreter")]

# l=8, d=4: compressed token i is emitted at t = 4i + 7. Prompts: 3 (no compressed token visible for the
# first steps, its first emission at the last), 7 (the first step completes a block), empty, 18 (past the
# window w=12; 5-6 selection blocks of l_sel=4 for n_sel=3; an emission at 19).
LENS = [3, 7, 0, 18]
STEPS = 5


def _cfg(**kw):
    base = {"l": 8, "d": 4, "l_sel": 4, "n_sel": 3, "w": 12, "n_init": 1, "n_local": 1}
    base.update(kw)
    return NSAConfig(dim=24, n_heads=4, n_kv_heads=2, d_k=16, d_v=8, **base)  # G = 2, Dk != Dv


TUNINGS = {  # the first also decodes each sequence alone (the others equal the module, which equals that)
    "split-kv": {"block_c": 4, "nsc": 2, "mode": "four"},
    "fused": {"block_c": 4, "nsc": 2, "mode": "two"},
    "three": {"block_c": 4, "nsc": 2, "mode": "three"},
}


def _decoder(m, cache, tune):
    with tuning.overrides({"decode": tune}):
        return GraphDecoder(m, cache, backend="triton")


@pytest.mark.parametrize("tune", list(TUNINGS.values()), ids=list(TUNINGS))
def test_ragged_steps_equal_the_module_and_each_sequence_alone(tune):
    torch.manual_seed(0)
    cfg = _cfg(phi="mlp")
    m = NSAAttention(cfg).eval()
    B, max_len = len(LENS), max(LENS) + STEPS
    prompts = [torch.randn(1, n, cfg.dim) * 2 for n in LENS]
    new = torch.randn(B, STEPS, cfg.dim) * 2
    packed, cu = torch.cat(prompts, 1), cu_of(LENS)

    cache, cref = m.new_cache(B, max_len), m.new_cache(B, max_len)
    dec = _decoder(m, cache, tune)
    p = dec.kernel_params()
    assert p["mode"] == tune["mode"]
    assert p["nsc"] >= 2 and p["ns_sel"] >= 2  # partials combined
    with torch.no_grad():
        y0 = dec.prefill(packed, cu_seqlens=cu)
        torch.testing.assert_close(y0, m(packed, cref, cu_seqlens=cu), **TOL)
    assert cache.ragged and cache.lengths.tolist() == LENS and dec._pos.tolist() == LENS

    ys = []
    for s in range(STEPS):
        with poisoned_outputs():  # the kernels' output workspace is NaN until they write it
            y = dec.step(new[:, s:s + 1], count=True)
        with torch.no_grad():
            y_ref = m(new[:, s:s + 1], cref)
        pos = [L + s for L in LENS]
        assert cache.lengths.tolist() == cref.lengths.tolist() == [t + 1 for t in pos]
        assert dec._pos.tolist() == [t + 1 for t in pos]
        torch.testing.assert_close(y, y_ref, **TOL, msg=f"step {s} (positions {pos}) vs the module's decode")
        # each row's top-n is the reference's at that row's own position
        for b, t in enumerate(pos):
            idx = _reference_branches(cfg, cref.row(b), dec.last["q"][b:b + 1], t)[1]
            assert torch.equal(dec.indices()[b:b + 1], idx), f"step {s} row {b} (t={t})"
        # the kernels' counters, per row, equal a count from the indices at each row's own length
        ind = tokens_read(cfg, cache.lengths, dec.indices())
        cnt = dec.token_counts()
        for i, br in enumerate(("cmp", "sel", "win")):
            assert torch.equal(cnt[..., i], ind[br]), (s, br, cnt[..., i].tolist(), ind[br].tolist())
        ys.append(y)
    y = torch.cat(ys, 1)
    assert not dec._kernels.sem.any()  # counts back at zero
    for b, L in enumerate(LENS):  # emitted compressed tokens equal the module's, row by row
        nc = cfg.n_cmp(L + STEPS)
        torch.testing.assert_close(cache.k_cmp[b, :nc], cref.k_cmp[b, :nc], **TOL)
        torch.testing.assert_close(cache.v_cmp[b, :nc], cref.v_cmp[b, :nc], **TOL)

    # each row == its sequence decoded alone through a decoder of one row
    if tune != TUNINGS["split-kv"]:
        return
    for b, L in enumerate(LENS):
        alone = _decoder(m, m.new_cache(1, max_len), tune)
        if L:
            alone.prefill(prompts[b])
        y_alone = torch.cat([alone.step(new[b:b + 1, s:s + 1]) for s in range(STEPS)], 1)
        torch.testing.assert_close(y[b:b + 1], y_alone, **TOL, msg=f"row {b} (prompt {L}) vs alone")


def test_ragged_positions_on_the_host_and_the_device():
    """The longest row bounds the steps; a cache moved outside the decoder is refused until
    sync_position(), which reads the per-row lengths; attend(position=[...]) sets each row's."""
    torch.manual_seed(1)
    cfg = _cfg(phi="avg", gate_hidden=0)
    m = NSAAttention(cfg).eval()
    lens = [5, 9]
    x = torch.randn(1, sum(lens), cfg.dim)
    cache = m.new_cache(2, 11)
    with tuning.overrides({"decode": {"nsc": 1}}):
        dec = GraphDecoder(m, cache, backend="triton")
    dec.prefill(x, cu_seqlens=cu_of(lens))
    xs = torch.randn(2, 3, cfg.dim)
    dec.step(xs[:, :1])
    with torch.no_grad():
        m(xs[:, 1:2], cache)  # the module's own step: the decoder's mirror is stale
    with pytest.raises(RuntimeError, match="moved outside this decoder; call sync_position"):
        dec.step(xs[:, 2:3])
    dec.sync_position()
    assert dec._pos.tolist() == [7, 11] == cache.lengths.tolist()
    with pytest.raises(ValueError, match=r"^cache: step at position 11 \(the longest row\) exceeds max_len=11$"):
        dec.step(xs[:, 2:3])
    q, g = dec.last["q"], dec.last["gates"]
    dec.attend(q, g, position=[6, 10])
    assert dec._pos.tolist() == [6, 10]
    dec.attend(q, g, position=3)
    assert dec._pos.tolist() == [3, 3]
