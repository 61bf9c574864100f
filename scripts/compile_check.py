"""Compile the prefill kernels for a GPU target on a machine without a GPU, before spending GPU time.

    python scripts/compile_check.py [--arch 90] [--dk 128,192]

Triton compiles to PTX and runs its bundled ptxas without a device, so this prints, per kernel and
launch shape the triton backend uses on CUDA (``_cmp_ops.TUNE["cuda"]``, the top-n buckets, the gated
sum, the backward's row dot, the selection forward): compile seconds, shared memory (bytes; the H200
allows 232448 per block), registers per thread and spill-store bytes (from ptxas -v). A shape that
needs too much shared memory, or a compile that takes minutes, shows here instead of inside a GPU
call. Exit code 1 if a kernel fails to compile or exceeds --smem. A compile time near 0 s is a hit
in Triton's on-disk cache. Timings need the GPU.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nsa.backends.triton import _cmp_kernels as K  # noqa: E402
from nsa.backends.triton import _cmp_ops, gate, rowdot, selection  # noqa: E402


def compile_one(fn, consts, ptrs, target, i64=(), **opts):
    """(compile seconds, shared bytes, registers, spill-store bytes) of one kernel. Pointers and
    integer arguments are marked divisible by 16, as a launch specializes them for contiguous tensors
    with dims that are multiples of 16 (without it, loads are not vectorized and the figures are a
    different kernel's). Registers and spills come from ptxas -v (Triton's bundled ptxas)."""
    sig = {}
    for p in inspect.signature(fn.fn).parameters:
        if p in consts:
            sig[p] = "constexpr"
        elif p in ptrs:
            sig[p] = ptrs[p]
        elif p in ("scale_log2", "scale"):
            sig[p] = "fp32"
        else:
            sig[p] = "i64" if p in i64 else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t not in ("constexpr", "fp32")}
    t0 = time.time()
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=target, options=opts)
    sec = time.time() - t0
    regs, spill = _ptxas_usage(k.asm["ptx"], target.arch)
    return sec, int(k.metadata.shared), regs, spill


def _ptxas_usage(ptx, arch):
    """(registers per thread, spill-store bytes) from ``ptxas -v`` on the kernel's PTX."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        sm = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        r = subprocess.run([ptxas, "-v", "--gpu-name", sm, src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True, check=True)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores", r.stderr)
    return int(regs.group(1)) if regs else -1, int(spill.group(1)) if spill else 0


def cases(dk, dv):
    """(name, kernel, constexprs, pointer types, int64 args, launch options) as the launchers use them."""
    tune = _cmp_ops.TUNE["cuda"]
    bf, f32 = "*bf16", "*fp32"
    geo, _ = _cmp_ops._geom(64, 4, dk, dv, _Cuda)
    wgeo, _ = _cmp_ops._geom(64, 4, dk, dv, _Cuda, "win")
    bgeo, _ = _cmp_ops._geom(64, 4, dk, dv, _Cuda, "bwd")
    io = dict(Q=bf, K=bf, V=bf, Out=bf, LSE=f32, SC=f32)
    yield ("cmp fwd (scores)", K._fwd_kernel,
           dict(geo, PREC="tf32", BLOCK_N=64, NSTEP=64, STRIDE=16, OFFSET=31, WINDOW=0, SCORES=True, D_CMP=16,
                L_CMP=32, L_SEL=64, BJ=16, BJP=16, SCORE_DOT=True, SCORE_LO=tune["score_lo"], LSE_N=tune["lse_n"],
                SPILL_W=1),
           io, (), _cmp_ops.fwd_launch(tune, True, geo["BLOCK_M"] * geo["GP"]))
    wn = tune["win_block_n"]
    yield ("win fwd", K._fwd_kernel,
           dict(wgeo, PREC="tf32", BLOCK_N=wn, NSTEP=wn, STRIDE=1, OFFSET=0, WINDOW=512, SCORES=False, D_CMP=1,
                L_CMP=1, L_SEL=1, BJ=1, BJP=1, SCORE_DOT=False, SCORE_LO=False, LSE_N=tune["lse_n"], SPILL_W=0),
           io, (), _cmp_ops.fwd_launch(tune, False, wgeo["BLOCK_M"] * wgeo["GP"]))
    bwd = dict(bgeo, PREC="tf32", BLOCK_N=tune["bwd_block_n"], STRIDE=16, OFFSET=31, WINDOW=0)
    opts = dict(num_warps=tune["bwd_warps"], num_stages=tune["bwd_stages"])
    yield ("cmp bwd dq", K._bwd_dq_kernel, bwd, dict(Q=bf, K=bf, V=bf, DO=bf, LSE=f32, DELTA=f32, DQ=bf), (), opts)
    yield ("cmp bwd dk/dv", K._bwd_dkdv_kernel, bwd,
           dict(Q=bf, K=bf, V=bf, DO=bf, LSE=f32, DELTA=f32, DK_=f32, DV_=f32), ("sdk_s", "sdv_s"), opts)
    sel = dict(G=16, N_SEL=16, L_SEL=64, DK=dk, DV=dv, BLOCK_G=16, PREC="tf32", **selection._meta(dk, dv, 64))
    sel_io = dict(Q=bf, K=bf, V=bf, IDX="*i32", O=bf, LSE=f32, ROW_SEQ="*i32", CU_Q="*i32", CU_K="*i32", OC=bf,
                  OW=bf, GT=bf)
    for gated in (False, True):
        yield ("sel fwd" + (" gated" if gated else ""), selection._fwd_q_kernel, dict(sel, GATED=gated), sel_io, (),
               dict(num_warps=4, num_stages=2))
    if dk == 128:
        for width in (1, 64, 1024):  # the smallest, a middle and the 64k top-n bucket
            rb = _cmp_ops.topn_rows(width, 16, tune)
            yield (f"top-n width {width}", K._topn_kernel,
                   dict(H=4, NBP=width, N_SEL=16, NSP=16, N_INIT=1, N_LOCAL=2, L_SEL=64, RB=rb,
                        SEG=min(_cmp_ops.TOPN_SEG, width)),
                   dict(SC=f32, IDX="*i64"), ("ssc_b", "sidx_b"), dict(num_warps=tune["topn_warps"]))
        g = dict(D=dv, BD=triton.next_power_of_2(dv), BLOCK_R=gate.BLOCK_R)
        yield ("gated sum fwd", gate._gate_fwd_kernel, g, dict(OC=bf, OS=bf, OW=bf, GT=bf, O=bf), (), dict(num_warps=4))
        yield ("gated sum bwd", gate._gate_bwd_kernel, g,
               dict(OC=bf, OS=bf, OW=bf, GT=bf, DO=bf, DOC=bf, DOS=bf, DOW=bf, DG=bf), (), dict(num_warps=4))
        yield ("row dot (delta)", rowdot._row_dot_kernel, dict(D=dv, BD=triton.next_power_of_2(dv), BLOCK_R=rowdot.BLOCK_R),
               dict(A=bf, B=bf, OUT=f32), (), dict(num_warps=4))


class _Cuda:
    type = "cuda"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200), 89, 80")
    ap.add_argument("--dk", default="128,192", help="Dk values to check (Dv = 128)")
    ap.add_argument("--smem", type=int, default=232448, help="shared memory per block of the target (bytes)")
    a = ap.parse_args()
    target = GPUTarget("cuda", a.arch, 32)
    bad = 0
    print(f"{'kernel':<18} {'Dk':>4} {'compile s':>9} {'shared B':>9} {'regs':>5} {'spill B':>8}")
    for dk in (int(x) for x in a.dk.split(",")):
        for name, fn, consts, ptrs, i64, opts in cases(dk, 128):
            try:
                sec, smem, regs, spills = compile_one(fn, consts, ptrs, target, i64, **opts)
            except Exception as e:  # noqa: BLE001  (the row says which kernel failed)
                print(f"{name:<18} {dk:>4} FAILED {type(e).__name__}: {str(e)[:200]}")
                bad += 1
                continue
            over = smem > a.smem
            bad += over
            print(f"{name:<18} {dk:>4} {sec:>9.1f} {smem:>9d} {regs:>5d} {spills:>8d}"
                  + ("  OVER the shared-memory limit" if over else ""), flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
