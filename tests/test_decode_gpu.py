"""The decode step's kernels compiled on a CUDA GPU, in bfloat16, replayed from CUDA graphs, in three
launch modes: serial (four kernels), with programmatic dependent launch (``tuning.decode.pdl``, sm_90+),
and fused (``tuning.decode.fuse``: two kernels, the top-n and the combine run by the last program of
their pass, found by an atomic count per group).

PDL lets each kernel start launching while the one before it still runs; every kernel waits
(``griddepcontrol.wait``) before it reads anything. The fused kernels hand partials from program to
program within one launch through a release/acquire count. A read too early in either would differ
between replays, or from the serial launch, at some position if not at all. So: every replay at a
position is bit-identical to the others and to the eager call; PDL is bit-identical to serial; fused
differs from serial only by the rounding of its sums (fewer warps reduce them), which may flip a
near-tie of the top-n (at most 1e-3 of the slots, as in the kernel tests); each matches the reference
branches.

Marked ``gpu`` (tests/conftest.py deselects it without CUDA). Its CPU twin, the same kernels under the
interpreter, is tests/test_decode_gpu_path.py.
"""
from __future__ import annotations

import pytest
import torch

from nsa import NSAAttention, NSAConfig, dispatch, env, reference
from nsa.backends.triton import tuning
from nsa.backends.triton.decode import pdl_supported
from nsa.decode import GraphDecoder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(env.triton_interpret(), reason="TRITON_INTERPRET=1 interprets the kernels; these tests "
                                                      "check the compiled bf16 kernels"),
]

BF16 = torch.bfloat16
CACHES = ("k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win")


def _decoder(B, S, G, tune):
    cfg = NSAConfig(dim=256, n_heads=4 * G, n_kv_heads=4, d_k=128, d_v=128)  # the paper's blocks (spec defaults)
    torch.manual_seed(0)
    m = NSAAttention(cfg, backend="triton").to("cuda", BF16).eval()
    cache = m.new_cache(B, S, "cuda", BF16)
    gen = torch.Generator("cuda").manual_seed(1)
    for name in CACHES:
        getattr(cache, name).normal_(generator=gen)
    cache.length = S - 1
    with tuning.overrides({"decode": tune}):
        dec = GraphDecoder(m, cache)
    assert {k: dec.kernel_params()[k] for k in tune} == tune
    return cfg, cache, dec


MODES = {"serial": dict(pdl=False, fuse=False), "pdl": dict(pdl=True, fuse=False), "fused": dict(pdl=True, fuse=True)}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.skipif(not torch.cuda.is_available() or not pdl_supported(),
                    reason="programmatic dependent launch needs sm_90+ and triton >= 3.4")
@pytest.mark.parametrize("B,S,G", [(1, 65_536, 16), (1, 8_192, 4), (64, 16_384, 16)], ids=["B1-64k-G16", "B1-8k-G4",
                                                                                          "B64-16k-G16"])
def test_launch_modes_agree_replay_after_replay_and_match_the_reference(B, S, G):
    outs = {}
    for mode, tune in MODES.items():
        cfg, cache, dec = _decoder(B, S, G, tune)
        gen = torch.Generator("cuda").manual_seed(2)
        q = torch.randn(B, cfg.n_heads, cfg.d_k, device="cuda", dtype=BF16, generator=gen)
        g = torch.rand(B, cfg.n_heads, 3, device="cuda", dtype=BF16, generator=gen)
        graph = dec.graph(lambda dec=dec, q=q, g=g: dec.attend(q, g))
        runs = []
        for t in (S - 1, S - 1 - 777, S // 2 + 13, 4_000):  # positions read from the device at each replay
            out = dec.attend(q, g, position=t)  # sets the position, runs eagerly; the graph's workspace
            eager = (out.clone(), dec.indices().clone())
            for r in range(3):  # replays back to back: a race shows as a difference between them
                graph.replay()
                o, i = out.clone(), dec.indices().clone()
                assert torch.equal(i, eager[1]) and torch.equal(o, eager[0]), f"{mode}: t={t} replay {r} != eager"
            runs.append((t, *eager))
        assert not dec._kernels.sem.any(), f"{mode}: the per-group counts did not return to zero"
        torch.cuda.synchronize()
        outs[mode] = runs
        # the step itself is right: the first position against the reference branches in float32 (the
        # selected branch over the kernels' own blocks: bf16 may flip a near-tie of the top-n)
        t, o, idx = runs[0]
        S1 = t + 1
        f = lambda z, S1=S1: z[:, :S1].float()  # noqa: E731
        qr, nc = q.float()[:, None], cfg.n_cmp(S1)
        o_c, _ = reference.compressed_branch(qr, cache.k_cmp[:, :nc].float(), cache.v_cmp[:, :nc].float(), cfg,
                                             q_start=t, n_keys=S1)
        o_s = reference.selected_attention(qr, f(cache.k_sel), f(cache.v_sel), idx, cfg, q_start=t)
        o_w = reference.sliding_window_attention(qr, f(cache.k_win), f(cache.v_win), cfg, q_start=t)
        o_ref = dispatch.get("reference").combine(o_c, o_s, o_w, g.float()[:, None])[:, 0]
        assert _rel(o, o_ref) <= 5e-3, f"{mode}: decode step vs reference: rel-L2 {_rel(o, o_ref):.3g}"
        del dec, cache
    for (t, o0, i0), (_, o1, i1), (_, o2, i2) in zip(outs["serial"], outs["pdl"], outs["fused"]):
        assert torch.equal(i0, i1) and torch.equal(o0, o1), f"t={t}: PDL changed the step"
        # the fused top-n sums the group's probabilities with fewer warps: a near-tie may flip (kernel tests: 1e-3)
        mismatch = (i0 != i2).float().mean().item()
        assert mismatch <= 1e-3, f"t={t}: the fused step selected other blocks in {mismatch:.2%} of the slots"
        assert _rel(o2, o0) <= 1e-3, f"t={t}: fused vs serial rel-L2 {_rel(o2, o0):.3g}"
