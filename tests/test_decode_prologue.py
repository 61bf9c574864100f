"""The decode step's prologue kernels (nsa/backends/triton/decode_prologue.py: RoPE, cache writes, phi, gates after
the one input GEMM; ``tuning.decode.prologue=triton``) against the torch prologue (``prologue=torch``, the
reference path of ``nsa.decode.GraphDecoder``), through the Triton interpreter on CPU tensors, float32.

Over a ragged batch (rows at different positions: blocks complete at each row's own steps), phi = MLP and
mean, a gate MLP and a plain gate Linear, Dk not a power of two, Dk != Dv, phi's hidden width not a multiple
of the kernels' unit share, phi's first layer split over block rows (several partial sums, the last share
cut short by the block's end) and phi's programs over several sequences (the last one's rows past the
batch): every step's output, q and gates, and every cache the steps write.
The path a prologue must not take raises: the torch ops under ``triton``, the kernels under ``torch``.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

import pytest
import torch

pytest.importorskip("triton")

from conftest import cu_of
from test_decode_gpu_path import TOL

from nsa import NSAAttention, NSAConfig
from nsa.backends.triton import poisoned_outputs, triton_unsupported, tuning
from nsa.backends.triton import decode_prologue as step_kernels
from nsa.decode import GraphDecoder

_OLD_INTERPRETER = triton_unsupported()
pytestmark = [pytest.mark.skipif(_OLD_INTERPRETER is not None, reason=_OLD_INTERPRETER or ""),
              pytest.mark.usefixtures("fast_interpreter")]

CACHES = ("k_cmp_raw", "v_cmp_raw", "k_sel", "v_sel", "k_win", "v_win", "k_cmp", "v_cmp")
LENS, STEPS = [3, 0, 13], 10  # l=8, d=4: blocks complete at t = 4i + 7


# (config overrides, StepPrologue class attributes). SHARE: phi fc1 elements per program, 1536 with D=16
# (BD 16) and 32 units -> 3 block rows a share: shares of rows 0-2, 3-5, 6-7. ROWS: (sequence, group) rows
# per phi program, 4 with H=2 -> 2 sequences a program: programs for rows (0, 1) and (2, -)
CASES = {
    "mlp-gateMLP-Dk12-Dv8": (dict(d_k=12, d_v=8, phi="mlp", gate_hidden=16), {}),
    "mlp-hidden40-rowshares-2seqs": (dict(d_k=16, d_v=16, phi="mlp", gate_hidden=8, phi_hidden=40),
                                     {"SHARE": 1536, "ROWS": 4}),
    "mean-gateLinear": (dict(d_k=16, d_v=8, phi="avg", gate_hidden=0), {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_prologue_kernels_equal_the_torch_prologue(name, monkeypatch):
    over, attrs = CASES[name]

    def patch():
        for k, v in attrs.items():
            monkeypatch.setattr(step_kernels.StepPrologue, k, v)

    patch()
    torch.manual_seed(0)
    cfg = NSAConfig(dim=24, n_heads=4, n_kv_heads=2, l=8, d=4, l_sel=8, n_sel=3, w=12, n_init=1, n_local=1, **over)
    m = NSAAttention(cfg).eval()
    B = len(LENS)
    x = torch.randn(1, sum(LENS), cfg.dim)
    new = torch.randn(B, STEPS, cfg.dim)
    runs = {}
    for pro in ("torch", "triton"):
        with tuning.overrides({"decode": {"prologue": pro}}):
            dec = GraphDecoder(m, m.new_cache(B, max(LENS) + STEPS), backend="triton")
        assert dec.kernel_params()["prologue"] == pro
        if pro == "triton":
            pk = dec._kernels.prologue
            if attrs:
                assert max(pk.nr.values()) == 3 and pk.bb == 2, (pk.nr, pk.bb)
            monkeypatch.setattr(dec, "_emit", lambda: (_ for _ in ()).throw(AssertionError("torch phi ran")))
        else:
            assert dec._kernels.prologue is None
            monkeypatch.setattr(step_kernels, "_step_project", None)  # subscripting it would raise
        dec.prefill(x, cu_seqlens=cu_of(LENS))
        ys, qs, gs = [], [], []
        for s in range(STEPS):
            with poisoned_outputs():
                ys.append(dec.step(new[:, s:s + 1]))
            qs.append(dec.last["q"].clone())
            gs.append(dec.last["gates"].clone())
        monkeypatch.undo()
        patch()
        runs[pro] = dict(y=torch.cat(ys, 1), q=torch.stack(qs), gates=torch.stack(gs),
                         **{n: getattr(dec.cache, n).clone() for n in CACHES})
        assert dec.cache.lengths.tolist() == [n + STEPS for n in LENS]
    for k, ref in runs["torch"].items():
        torch.testing.assert_close(runs["triton"][k], ref, **TOL, msg=f"{name}: {k}")
    # the steps did emit compressed tokens (rows 0 and 2 complete blocks 1 and 3 within the 10 steps)
    assert runs["torch"]["k_cmp"][0, 1].abs().sum() > 0 and runs["torch"]["k_cmp"][2, 3].abs().sum() > 0


def test_prologue_choice_is_validated():
    with pytest.raises(ValueError, match="tuning.decode.prologue='fused'"):
        with tuning.overrides({"decode": {"prologue": "fused"}}):
            pass
    assert tuning.params("decode", "interpret")["prologue"] == tuning.params("decode", "cuda")["prologue"] == "triton"
