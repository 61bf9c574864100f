"""The backward's row statistic delta = rowsum(dO * O) (flash-attention backward, per query row and
head) as one Triton pass in float32.

The PyTorch expression ``(do.float() * o.float()).sum(-1)`` writes two float32 copies and their
product: about 15 bytes moved per input element. This kernel reads each input once (4 bytes per
element for bf16 dO and O); BENCHMARKS.md ("Tuning choices") has the time it saves.
"""

# No ``from __future__ import annotations`` here: triton 2.3/3.0's JIT reads the kernel annotations
# as objects (string annotations make ``tl.constexpr`` parameters plain runtime arguments).
import torch
import triton
import triton.language as tl

from .tiles import row_tile

BLOCK_R = 32  # rows per program


@triton.jit
def row_dot_kernel(A, B, OUT, n_rows, D: tl.constexpr, BD: tl.constexpr, BLOCK_R: tl.constexpr):
    """One program per BLOCK_R rows: ``OUT[r] = sum_d A[r, d] * B[r, d]`` in float32.

    Arguments:
        A, B: ``n_rows`` contiguous rows of D; OUT: float32 ``[n_rows]``; BD: D's power-of-2 tile;
        BLOCK_R: rows per program.
    """
    r, ok, mask, off = row_tile(n_rows, D, BD, BLOCK_R)
    a = tl.load(A + off, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + off, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + r, tl.sum(a * b, 1), mask=ok)


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a.float() * b.float()).sum(-1)`` for two same-shape tensors: float32, shape ``a.shape[:-1]``."""
    if a.shape != b.shape:
        raise ValueError(f"row_dot: shapes {tuple(a.shape)} and {tuple(b.shape)} differ")
    a, b = a.contiguous(), b.contiguous()
    D = a.shape[-1]
    out = torch.empty(a.shape[:-1], device=a.device, dtype=torch.float32)
    n_rows = out.numel()
    if n_rows and D:
        row_dot_kernel[(triton.cdiv(n_rows, BLOCK_R),)](
            A=a,
            B=b,
            OUT=out,
            n_rows=n_rows,
            D=D,
            BD=triton.next_power_of_2(D),
            BLOCK_R=BLOCK_R,
            num_warps=4,
        )
    elif n_rows:
        out.zero_()
    return out
