"""The CPU twin of tests/test_kernels_gpu.py: the same checks (tests/kernel_cases.py) through Triton's
interpreter on CPU tensors, float32 against the float64 reference, at tiny block sizes (l=8, d=4,
l_sel=8, n_sel=4, w=16) so that a few dozen tokens cross every tile (16 rows / 16 keys) and selection
block: G in {1, 2, 4, 8, 16, 32}, Dk != Dv, T not a multiple of any size, B > 1. The window runs on
triton and sdpa (fa2 is CUDA-only). ``python -m experiments.validate hardware=cpu`` runs this module as
its kernel check: the interpreter's arithmetic, not the compiled kernels.

Tolerance: rel-L2 1e-5 for outputs and gradients (float32 products are IEEE in the kernels; measured
~1e-7), and the top-n exactly equal.
"""
from __future__ import annotations

import os

# The interpreter must be chosen before triton is first imported (tests/conftest.py does not set it).
os.environ.setdefault("TRITON_INTERPRET", "1")

import kernel_cases as kc  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nsa.backends.triton import triton_unsupported  # noqa: E402

_OLD = triton_unsupported()
pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs on CPU tensors under TRITON_INTERPRET=1"),
    pytest.mark.skipif(_OLD is not None, reason=_OLD or ""),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # the interpreter: log2(0), 0/0 in masked-off rows
    pytest.mark.usefixtures("fast_interpreter"),
]

F32, F64 = torch.float32, torch.float64
TOL = kc.Tol(out=1e-5, grad=1e-5, index=0.0)
TINY = (8, 4, 8, 4, 16)  # l, d, l_sel, n_sel, w
CASES = [
    kc.Case(B=2, T=41, H=1, G=1, Dk=24, Dv=16, blocks=TINY, rows=8),
    kc.Case(B=1, T=43, H=2, G=2, Dk=16, Dv=16, blocks=TINY, rows=8),
    kc.Case(B=1, T=45, H=1, G=4, Dk=24, Dv=16, blocks=TINY, rows=8),
    kc.Case(B=1, T=42, H=1, G=8, Dk=16, Dv=16, blocks=TINY, rows=8),
    kc.Case(B=1, T=47, H=1, G=16, Dk=24, Dv=16, blocks=TINY, rows=8),
    kc.Case(B=1, T=41, H=1, G=32, Dk=16, Dv=8, blocks=TINY, rows=8),
]
WIN = ("triton", "sdpa")

test_cmp, test_sel, test_win, test_layer = kc.tests(
    CASES, "cpu", F32, F64, TOL, WIN, [kc.param(CASES[0], "triton"), kc.param(CASES[4], "triton"), kc.param(CASES[2], "sdpa")])
