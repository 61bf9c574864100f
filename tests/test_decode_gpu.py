"""The decode step's kernels compiled on a CUDA GPU, in bfloat16, replayed from CUDA graphs: with and
without programmatic dependent launch (``tuning.decode.pdl``, sm_90+) they must give bit-identical
outputs and top-n indices at every position, and both must match the reference branches.

PDL lets each of the step's four kernels start launching while the one before it still runs; every
kernel waits (``griddepcontrol.wait``) before it reads anything. A kernel that read its predecessor's
partials or indices too early would differ from the serial launch, at some position if not at all.

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


def _decoder(B, S, G, pdl):
    cfg = NSAConfig(dim=256, n_heads=4 * G, n_kv_heads=4, d_k=128, d_v=128)  # the paper's blocks (spec defaults)
    torch.manual_seed(0)
    m = NSAAttention(cfg, backend="triton").to("cuda", BF16).eval()
    cache = m.new_cache(B, S, "cuda", BF16)
    gen = torch.Generator("cuda").manual_seed(1)
    for name in CACHES:
        getattr(cache, name).normal_(generator=gen)
    cache.length = S - 1
    with tuning.overrides({"decode": {"pdl": pdl}}):
        dec = GraphDecoder(m, cache)
    assert dec.kernel_params()["pdl"] is pdl
    return cfg, cache, dec


@pytest.mark.skipif(not torch.cuda.is_available() or not pdl_supported(),
                    reason="programmatic dependent launch needs sm_90+ and triton >= 3.4")
@pytest.mark.parametrize("B,S,G", [(1, 65_536, 16), (1, 8_192, 4), (64, 16_384, 16)], ids=["B1-64k-G16", "B1-8k-G4",
                                                                                          "B64-16k-G16"])
def test_pdl_is_bit_identical_to_serial_launch_and_matches_the_reference(B, S, G):
    outs = {}
    for pdl in (False, True):
        cfg, cache, dec = _decoder(B, S, G, pdl)
        gen = torch.Generator("cuda").manual_seed(2)
        q = torch.randn(B, cfg.n_heads, cfg.d_k, device="cuda", dtype=BF16, generator=gen)
        g = torch.rand(B, cfg.n_heads, 3, device="cuda", dtype=BF16, generator=gen)
        graph = dec.graph(lambda dec=dec, q=q, g=g: dec.attend(q, g))
        runs = []
        for t in (S - 1, S - 1 - 777, S // 2 + 13, 4_000):  # positions read from the device at each replay
            out = dec.attend(q, g, position=t)  # sets the position (and runs once eagerly); the graph's workspace
            for _ in range(3):  # replays back to back: a race shows as a difference between them
                graph.replay()
                runs.append((t, out.clone(), dec.indices().clone()))
        torch.cuda.synchronize()
        outs[pdl] = runs
    for (t, o0, i0), (_, o1, i1) in zip(outs[False], outs[True]):
        assert torch.equal(i0, i1), f"t={t}: PDL changed the selected blocks"
        assert torch.equal(o0, o1), f"t={t}: PDL changed the output (max diff {(o0 - o1).abs().max().item():.3g})"
    # and the step itself is right: the last position against the reference branches in float32 (the
    # selected branch over the kernels' own blocks: bf16 may flip a near-tie of the top-n)
    t, o, idx = outs[True][0]
    S = t + 1
    f = lambda z: z[:, :S].float()  # noqa: E731
    qr, nc = q.float()[:, None], cfg.n_cmp(S)
    o_c, _ = reference.compressed_branch(qr, cache.k_cmp[:, :nc].float(), cache.v_cmp[:, :nc].float(), cfg,
                                         q_start=t, n_keys=S)
    o_s = reference.selected_attention(qr, f(cache.k_sel), f(cache.v_sel), idx, cfg, q_start=t)
    o_w = reference.sliding_window_attention(qr, f(cache.k_win), f(cache.v_win), cfg, q_start=t)
    o_ref = dispatch.get("reference").combine(o_c, o_s, o_w, g.float()[:, None])[:, 0]
    err = ((o.float() - o_ref).norm() / o_ref.norm()).item()
    assert err <= 5e-3, f"decode step vs reference: rel-L2 {err:.3g}"
