"""Triton gated sum of the three branch outputs (paper Eq. 5, spec step 7), forward and backward.

    o = g_cmp * o_cmp + g_sel * o_sel + g_win * o_win          (per query head; gates [.., 3])
    d o_c = g_c * do,   d g_c = sum_d do * o_c                  (backward)

One pass over rows (query, head) in float32, so the three 1 GB products at 64k are never written
separately (the plain PyTorch expression reads and writes about 12 bytes per output byte; this
kernel reads 3 and writes 1 forward, reads 4 and writes 3 backward). Launch parameters:
``tuning.params("gate")``.
"""

# No ``from __future__ import annotations`` here: triton 2.3/3.0's JIT reads the kernel annotations
# as objects (string annotations make ``tl.constexpr`` parameters plain runtime arguments).
from typing import Sequence

import torch
import triton
import triton.language as tl

from ...compat import custom_op
from . import tuning
from .tiles import row_tile
from .utils import empty


@triton.jit
def gate_rows(o_sel, OC, OW, GT, off, g_off, ok, mask):
    """Eq. 5 on a tile of (query, head) rows, in float32: g_cmp o_cmp + g_sel o_sel + g_win o_win, with
    o_sel given (float32), o_cmp/o_win loaded at ``off`` and the gates at ``g_off`` (+0, +1, +2). Used
    by the gate kernel and by the selection kernels' epilogues."""
    g0 = tl.load(GT + g_off, mask=ok, other=0.0).to(tl.float32)
    g1 = tl.load(GT + g_off + 1, mask=ok, other=0.0).to(tl.float32)
    g2 = tl.load(GT + g_off + 2, mask=ok, other=0.0).to(tl.float32)
    o = g0[:, None] * tl.load(OC + off, mask=mask, other=0.0).to(tl.float32)
    o += g1[:, None] * o_sel
    return o + g2[:, None] * tl.load(OW + off, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def gate_fwd_kernel(OC, OS, OW, GT, O, n_rows, D: tl.constexpr, BD: tl.constexpr, BLOCK_R: tl.constexpr):
    """One program per BLOCK_R rows: ``O = GT[:, 0] * OC + GT[:, 1] * OS + GT[:, 2] * OW``.

    Arguments:
        OC, OS, OW: the branches' outputs, ``n_rows`` rows of D (contiguous); GT: the gates, 3 a row.
        O: the output; D, BD: the row length and its power-of-2 tile; BLOCK_R: rows per program.
    """
    r, ok, mask, off = row_tile(n_rows, D, BD, BLOCK_R)
    o = gate_rows(tl.load(OS + off, mask=mask, other=0.0).to(tl.float32), OC, OW, GT, off, r * 3, ok, mask)
    tl.store(O + off, o.to(O.dtype.element_ty), mask=mask)


@triton.jit
def _gate_bwd_one(SRC, DST, GT, DG, do, r, ok, off, mask, c: tl.constexpr):
    g = tl.load(GT + r * 3 + c, mask=ok, other=0.0).to(tl.float32)
    oc = tl.load(SRC + off, mask=mask, other=0.0).to(tl.float32)
    tl.store(DST + off, (g[:, None] * do).to(DST.dtype.element_ty), mask=mask)
    tl.store(DG + r * 3 + c, tl.sum(do * oc, 1).to(DG.dtype.element_ty), mask=ok)


@triton.jit
def gate_bwd_kernel(OC, OS, OW, GT, DO, DOC, DOS, DOW, DG, n_rows, D: tl.constexpr, BD: tl.constexpr,
                     BLOCK_R: tl.constexpr):
    """One program per BLOCK_R rows: ``DOC, DOS, DOW = g_c * DO`` and ``DG[:, c] = rowsum(DO * O_c)``.

    Arguments:
        OC, OS, OW, GT: as :func:`gate_fwd_kernel`; DO: the output's gradient.
        DOC, DOS, DOW, DG: the gradients written; n_rows, D, BD, BLOCK_R: as :func:`gate_fwd_kernel`.
    """
    r, ok, mask, off = row_tile(n_rows, D, BD, BLOCK_R)
    do = tl.load(DO + off, mask=mask, other=0.0).to(tl.float32)
    _gate_bwd_one(OC, DOC, GT, DG, do, r, ok, off, mask, 0)
    _gate_bwd_one(OS, DOS, GT, DG, do, r, ok, off, mask, 1)
    _gate_bwd_one(OW, DOW, GT, DG, do, r, ok, off, mask, 2)


def _gate_fwd_fake(o_cmp, o_sel, o_win, gates, tune):
    return o_cmp.new_empty(o_cmp.shape)


@custom_op("nsa::gate_fwd", _gate_fwd_fake)
def _gate_fwd_op(o_cmp: torch.Tensor, o_sel: torch.Tensor, o_win: torch.Tensor, gates: torch.Tensor,
                 tune: Sequence[int]) -> torch.Tensor:
    """Eq. 5 of contiguous inputs; ``tune`` from ``tuning.to_ints``."""
    tune = tuning.from_ints("gate", tune)
    D = o_cmp.shape[-1]
    n_rows = o_cmp.numel() // max(D, 1)
    o = empty(o_cmp.shape, o_cmp)
    if n_rows:
        gate_fwd_kernel[(triton.cdiv(n_rows, tune["rows"]),)](
            OC=o_cmp, OS=o_sel, OW=o_win, GT=gates, O=o, n_rows=n_rows, D=D, BD=triton.next_power_of_2(D), BLOCK_R=tune["rows"],
            num_warps=tune["warps"],
        )
    return o


def _gate_bwd_fake(oc, os_, ow, gates, do, tune):
    return tuple(x.new_empty(x.shape) for x in (oc, os_, ow, gates))


@custom_op("nsa::gate_bwd", _gate_bwd_fake)
def _gate_bwd_op(oc: torch.Tensor, os_: torch.Tensor, ow: torch.Tensor, gates: torch.Tensor, do: torch.Tensor,
                 tune: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d o_cmp, d o_sel, d o_win, d gates) of contiguous inputs; ``tune`` from ``tuning.to_ints``."""
    tune = tuning.from_ints("gate", tune)
    D = oc.shape[-1]
    n_rows = oc.numel() // max(D, 1)
    d_o = [empty(x.shape, x) for x in (oc, os_, ow)]
    dg = empty(gates.shape, gates)
    if n_rows:
        gate_bwd_kernel[(triton.cdiv(n_rows, tune["rows"]),)](
            OC=oc, OS=os_, OW=ow, GT=gates, DO=do, DOC=d_o[0], DOS=d_o[1], DOW=d_o[2], DG=dg, n_rows=n_rows, D=D,
            BD=triton.next_power_of_2(D), BLOCK_R=tune["rows"], num_warps=tune["warps"],
        )
    return (*d_o, dg)


class GatedSum(torch.autograd.Function):
    """``o [B,Tq,HQ,Dv] = sum_c gates[..., c, None] * o_c`` over (o_cmp, o_sel, o_win), by the custom ops
    ``nsa::gate_fwd`` and ``nsa::gate_bwd`` (see the package docstring)."""

    @staticmethod
    def forward(ctx, o_cmp, o_sel, o_win, gates):
        """Arguments:
            ctx: autograd's context; o_cmp, o_sel, o_win: ``[B,Tq,HQ,Dv]``; gates: ``[B,Tq,HQ,3]``.

        Returns:
            ``o [B,Tq,HQ,Dv]``.
        """
        xs = [x.contiguous() for x in (o_cmp, o_sel, o_win, gates)]
        ctx.tune = tuning.to_ints("gate", tuning.params("gate", xs[0].device))  # the backward's too
        ctx.save_for_backward(*xs)
        return _gate_fwd_op(*xs, ctx.tune)

    @staticmethod
    def backward(ctx, do):
        """Arguments:
            ctx: autograd's context; do: the gradient of o.

        Returns:
            The gradients of o_cmp, o_sel, o_win and gates.
        """
        return _gate_bwd_op(*ctx.saved_tensors, do.contiguous(), ctx.tune)


def gated_sum(o_cmp, o_sel, o_win, gates):
    """Eq. 5 with the gates: see ``GatedSum``."""
    return GatedSum.apply(o_cmp, o_sel, o_win, gates)
