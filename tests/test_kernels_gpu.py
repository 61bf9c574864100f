"""The kernels compiled on a CUDA GPU, in bfloat16, against the float32 reference: forward and every input
gradient of each branch (cmp and sel on triton; the window on triton, sdpa (FlexAttention) and fa2
(flash-attn where installed, else PyTorch's own FlashAttention-2)) and of the whole layer, over G in
{1, 2, 4, 8, 16, 32}, Dk != Dv (192/128), T not a multiple of any block or tile size, B > 1, and
T = 128k + 77 with B = 2 and the paper's heads (q holds 3.2e9 elements: offsets past 2^31 must be 64-bit;
the whole layer at 128k + 261 with Dk = Dv = 128).
How: tests/kernel_cases.py (the last 256 query rows compared, the kernel runs them all).

Marked ``gpu``: deselected where CUDA is not available (tests/conftest.py). Run them compiled:
``python -m pytest -m gpu`` (which collects only tests/test_*_gpu.py), or through
``python -m experiments.validate``. Their CPU twin is tests/test_kernels_interpret.py.

Tolerances (bfloat16 inputs, float32 accumulation, the reference on the same values in float32): outputs
rel-L2 <= 5e-3 and input gradients <= 8e-3, where the H200 measured 2.7-3.6e-3 and 3.2-4.1e-3 at
16k-64k (BENCHMARKS.md, "Parity", P and P4); a wrong mask, tile or offset gives 1e-2 or more, a skipped
element NaN. Top-n slots: at most 1e-3 differ from the reference's (measured 1e-6 to 8e-6: near-ties
that bf16 rounding flips).
"""
from __future__ import annotations

import kernel_cases as kc
import pytest
import torch

from nsa import env

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(env.triton_interpret(), reason="TRITON_INTERPRET=1 interprets the kernels; these tests "
                                                      "check the compiled bf16 kernels"),
]

BF16, F32 = torch.bfloat16, torch.float32
TOL = kc.Tol(out=5e-3, grad=8e-3, index=1e-3)
PAPER = (32, 16, 64, 16, 512)  # l, d, l_sel, n_sel, w (docs/nsa-spec.md)
PAPER_G16 = kc.Case(B=2, T=8191, H=4, G=16, Dk=192, Dv=128, blocks=PAPER, rows=256)  # the paper's heads and dims
CASES = [
    kc.Case(B=2, T=3001, H=4, G=1, Dk=192, Dv=128, blocks=PAPER, rows=256),
    kc.Case(B=1, T=5099, H=4, G=2, Dk=128, Dv=128, blocks=PAPER, rows=256),
    kc.Case(B=2, T=4097, H=2, G=4, Dk=192, Dv=128, blocks=PAPER, rows=256),
    kc.Case(B=1, T=6143, H=2, G=8, Dk=128, Dv=128, blocks=PAPER, rows=256),
    PAPER_G16,
    kc.Case(B=1, T=2049, H=1, G=32, Dk=192, Dv=128, blocks=PAPER, rows=256),
    # G=1 on 64 key/value heads: the block-outer partials (256 KiB a query row) exceed 8 GiB past 32768
    # rows, so forward and backward run in row chunks (two on cards of 64 GiB and more), the compared
    # rows in the last
    kc.Case(B=1, T=40_000, H=64, G=1, Dk=128, Dv=128, blocks=PAPER, rows=256),
    # 128k + 77 tokens, two sequences: q and dq hold 2 x 131149 x 64 x 192 = 3.2e9 elements, o 2.1e9 > 2^31
    BRANCH_128K := kc.Case(B=2, T=131_149, H=4, G=16, Dk=192, Dv=128, blocks=PAPER, rows=256),
]
# The whole layer at 128k + 261 tokens in the shape the benchmarks time (Dk = Dv = 128; Dk = 192 at 128k is
# checked per branch above): q and o hold 2 x 131333 x 64 x 128 = 2.15e9 elements, and every row compared
# (the second sequence's last 256) lies past element 2^31 of both. Peak 41.5 GiB of GPU memory (H200 and
# H100, 2026-11-26; the report's kernel table lists each test's peak).
LAYER_128K = kc.Case(B=2, T=131_333, H=4, G=16, Dk=128, Dv=128, blocks=PAPER, rows=256)

test_cmp, test_sel, test_win, test_layer = kc.tests(
    CASES, "cuda", BF16, F32, TOL, kc.WIN_BACKENDS,
    [kc.param(c, "triton") for c in CASES if c is not BRANCH_128K] + [kc.param(LAYER_128K, "triton")]
    + [kc.param(PAPER_G16, b) for b in ("sdpa", "fa2")])


@pytest.mark.kernel("cmp")
@pytest.mark.parametrize("case", [kc.param(c) for c in CASES])
def test_cmp_cudnn(case):
    """The cudnn backend's compressed branch (cuDNN attention on the folded queries, then the triton score-only
    pass and top-n) on every case at the same tolerances; at 128k (B = 2) the folded tensors pass 2^31
    elements, so the calls are split (``nsa.backends.cudnn.pieces``)."""
    kc.cmp_branch(case, "cuda", BF16, F32, TOL, backend="cudnn")


@pytest.mark.kernel("layer")
@pytest.mark.parametrize("case", [kc.param(PAPER_G16)])
def test_layer_cudnn(case):
    """The whole layer with backend.cmp=cudnn (the triton window and selection); 128k: test_cmp_cudnn."""
    kc.layer(case, "cuda", BF16, F32, TOL, "triton", cmp="cudnn")
