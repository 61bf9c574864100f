"""Compile the prefill kernels for a GPU target on a machine without a GPU, before spending GPU time.

    python scripts/compile_check.py [--arch 90] [--dk 128,192] [--ptx DIR]

Triton compiles to PTX and runs its bundled ptxas without a device, so this prints, per kernel and
launch shape the triton backend uses on CUDA (``tuning.TABLES["cuda"]``, the top-n buckets, the gated
sum, the backward's row dot, every selection kernel, the decode-step kernels at B=1 and B=64):
compile seconds, shared memory (bytes; the H200 allows 232448 per block), registers per thread and
spill-store bytes (from ptxas -v). The kernels that can load through TMA descriptors are compiled on their
pointer-load path (``TMA=False``, the stages that path takes): a descriptor argument needs a GPU. A shape
that needs too much shared memory, or a compile that takes minutes, shows here instead of inside a GPU
call. Exit code 1 if a kernel fails to compile or exceeds --smem. A compile time near 0 s is a hit in
Triton's on-disk cache. Timings need the GPU.

``--ptx DIR`` also writes each kernel's PTX with its instructions only (``DIR/<kernel>-dk<Dk>.ptx``:
no debug lines, comments or kernel name; parameters by their Python name), so that two trees can be
compared with ``diff -r``: a refactoring that must not change what compiles shows no difference.
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

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nsa import NSAConfig
from nsa.backends.triton import attention_bwd, compressed, gate, rowdot, selection, tiles, topn
from nsa.backends.triton import decode_attention as decode
from nsa.backends.triton import tuning, window
from nsa.backends.triton.utils import launch_options, p2


def compile_one(fn, consts, ptrs, target, i64=(), floats=("scale_log2", "scale"), **opts):
    """(compile seconds, shared bytes, registers, spill-store bytes, PTX) of one kernel. Pointers and
    integer arguments are marked divisible by 16, as a launch specializes them for contiguous tensors
    with dims that are multiples of 16 (without it, loads are not vectorized and the figures are a
    different kernel's). Registers and spills come from ptxas -v (Triton's bundled ptxas)."""
    sig = {}
    for p in inspect.signature(fn.fn).parameters:
        if p in consts:
            sig[p] = "constexpr"
        elif p in ptrs:
            sig[p] = ptrs[p]
        elif p in floats:
            sig[p] = "fp32"
        else:
            sig[p] = "i64" if p in i64 else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t not in ("constexpr", "fp32")}
    t0 = time.time()
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=target, options=opts)
    sec = time.time() - t0
    ptx = k.asm["ptx"]
    regs, spill = _ptxas_usage(ptx, target.arch)
    return sec, int(k.metadata.shared), regs, spill, _instructions(ptx, [p for p, t in sig.items() if t != "constexpr"])


def _instructions(ptx, params):
    """The PTX's instruction stream: no debug sections, ``.loc``/``.file`` lines, debug labels or
    comments; the kernel's name replaced and its parameters named after the Python arguments (``params``, in order)."""
    ptx = ptx.split("\t.section\t.debug", 1)[0]
    entry = re.search(r"\.entry (\w+)\(", ptx).group(1)
    keep = []
    for line in ptx.splitlines():
        s = line.split("//", 1)[0].rstrip()
        if not s.strip() or s.lstrip().startswith((".loc", ".file", "$L__tmp")):  # $L__tmp: debug-info labels
            continue
        keep.append(s)
    out = "\n".join(keep) + "\n"

    def param(m):
        i = int(m.group(1))
        return "%param:" + (params[i] if i < len(params) else f"extra{i - len(params)}")

    out = re.sub(re.escape(entry) + r"_param_(\d+)", param, out)
    return out.replace(entry, "KERNEL")


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


# The key-stream kernels and the top-n on one sequence per batch row (their tables None: constexpr), and
# their packed-documents specialisation (the "varlen" rows).
ONE = dict(TILES=None, CU_Q=None, CU_K=None, VARLEN=False)
DOCS = dict(TILES="*i32", CU_Q="*i32", CU_K="*i32")


def cases(dk, dv, arch=90):
    """(name, kernel, constexprs, pointer types, int64 args, launch options[, float args]) as the
    launchers use them."""
    tune = tuning.table("cuda")
    # the pointer-load paths (TMA=False below), with their stage count as the launchers resolve it
    cmp_t, win_t, bwd_t = (tuning.by_path(tune["compressed"], False), tune["window"],
                           tuning.by_path(tune["attention_bwd"], False))
    bf, f32 = "*bf16", "*fp32"
    geo = tiles.geometry(64, 4, dk, dv, cmp_t["rows"])
    wgeo = tiles.geometry(64, 4, dk, dv, win_t["rows"])
    bgeo = tiles.geometry(64, 4, dk, dv, bwd_t["rows"])
    io = dict(Q=bf, K=bf, V=bf, Out=bf, LSE=f32, SC=f32)
    cmp_fwd = dict(geo, PREC="tf32", BLOCK_N=64, NSTEP=64, STRIDE=16, OFFSET=31, D_CMP=16, L_CMP=32, L_SEL=64, BJ=16,
                   BJP=16, SCORE_DOT=True, SCORE_LO=cmp_t["score_lo"], LSE_N=cmp_t["lse_n"], SPILL_W=1, TMA=False,
                   SCORE_ONLY=False)
    wn = win_t["block_n"]
    wide = wgeo["BLOCK_M"] * wgeo["GP"] >= win_t["rows"]  # as window._forward: else 4 warps, no cap
    win_fwd = dict(wgeo, PREC="tf32", BLOCK_N=wn, NSTEP=wn, WINDOW=512)
    win_opts = launch_options(win_t) if wide else dict(num_warps=4, num_stages=win_t["stages"])
    bwd = dict(bgeo, PREC="tf32", BLOCK_N=bwd_t["block_n"], STRIDE=16, OFFSET=31, WINDOW=0, TMA=False)
    wbwd = dict(bwd, STRIDE=1, OFFSET=0, WINDOW=512)
    opts = dict(num_warps=bwd_t["warps"], num_stages=bwd_t["stages"])
    dq_io = dict(Q=bf, K=bf, V=bf, DO=bf, LSE=f32, DELTA=f32, DQ=bf)
    dkdv_io = dict(Q=bf, K=bf, V=bf, DO=bf, LSE=f32, DELTA=f32, DK_=f32, DV_=f32)
    for varlen in (False, True):
        tag, c, p = (" varlen", dict(VARLEN=True), DOCS) if varlen else ("", ONE, {})
        yield ("cmp fwd (scores)" + tag, compressed.fwd_kernel, dict(cmp_fwd, **c), dict(io, **p), (),
               launch_options(cmp_t))
        yield ("win fwd" + tag, window.fwd_kernel, dict(win_fwd, **c), dict(io, **p), (), win_opts)
        yield ("cmp bwd dq" + tag, attention_bwd.bwd_dq_kernel, dict(bwd, **c), dict(dq_io, **p), (), opts)
        yield ("cmp bwd dk/dv" + tag, attention_bwd.bwd_dkdv_kernel, dict(bwd, **c), dict(dkdv_io, **p),
               ("sdk_s", "sdv_s"), opts)
        yield ("win bwd dq" + tag, attention_bwd.bwd_dq_kernel, dict(wbwd, **c), dict(dq_io, **p), (), opts)
        yield ("win bwd dk/dv" + tag, attention_bwd.bwd_dkdv_kernel, dict(wbwd, **c), dict(dkdv_io, **p),
               ("sdk_s", "sdv_s"), opts)
    sel_t = tune["selection"]
    sel = dict(G=16, N_SEL=16, L_SEL=64, DK=dk, DV=dv, BLOCK_G=16, PREC="tf32",
               **selection.tile_meta(dk, dv, 64, sel_t["block_s"]))
    sel_io = dict(Q=bf, K=bf, V=bf, IDX="*i32", O=bf, LSE=f32, ROW_SEQ="*i32", CU_Q="*i32", CU_K="*i32", OC=bf,
                  OW=bf, GT=bf)
    for gated in (False, True):
        yield ("sel fwd" + (" gated" if gated else ""), selection.fwd_q_kernel,
               dict(sel, GATED=gated, BLOCK_N=16, TMA=False), sel_io, (),
               dict(num_warps=sel_t["warps"], num_stages=sel_t["stages"]))
    yield ("sel bwd dq", selection.bwd_dq_kernel, sel,
           dict(Q=bf, K=bf, V=bf, DO=bf, IDX="*i32", LSE=f32, DELTA=f32, DQ=bf, ROW_SEQ="*i32", CU_Q="*i32",
                CU_K="*i32"), (), dict(num_warps=sel_t["dq_warps"] or sel_t["warps"],
                                       num_stages=sel_t["dq_stages"] or sel_t["stages"]))
    for G in (16, 4, 1):  # block-outer kernels at the group sizes the plans of BENCHMARKS.md use
        GP, BQ = selection.block_q(G, max(dk, dv), sel_t["rows"] or (128 if G == 1 else 64))
        kv = dict(G=G, GP=GP, L_SEL=64, DK=dk, DV=dv, BLOCK_Q=BQ, BLOCK_L=64, BLOCK_DK=p2(dk, 16),
                  BLOCK_DV=p2(dv, 16), PREC="tf32", INTERP=False)
        ent = dict(ENT_ROW="*i32", ENT_SLOT="*i32", ITEM_KEY="*i64", ITEM_START="*i64", ITEM_END="*i64",
                   CU_Q="*i32", CU_K="*i32")
        yield (f"sel fwd kv G{G}", selection.fwd_kv_kernel, kv, dict(Q=bf, K=bf, V=bf, OPART=bf, LPART=f32, **ent),
               (), dict(num_warps=sel_t["kv_warps"], num_stages=sel_t["kv_stages"] or (2 if G == 1 else 3)))
        for write_dq in (False, True):
            bwd = selection.bwd_launch(sel_t, G, 2, write_dq)
            GPb, BQb = selection.block_q(G, max(dk, dv), bwd["rows"])
            yield (f"sel bwd kv G{G}" + (" dq" if write_dq else ""), selection.bwd_kv_kernel,
                   dict(kv, GP=GPb, BLOCK_Q=BQb, WRITE_DQ=write_dq),
                   dict(Q=bf, K=bf, V=bf, DO=bf, LSE=f32, DELTA=f32, DK32=f32, DV32=f32, DQPART=bf if write_dq else f32,
                        **ent), (),
                   dict(num_warps=bwd["warps"], num_stages=bwd["stages"]))
    if dk == 128:
        for gated in (False, True):
            yield ("sel combine" + (" gated" if gated else ""), selection.combine_kernel,
                   dict(N_SEL=16, DV=dv, BLOCK_R=16, BLOCK_N=16, BLOCK_DV=p2(dv, 16), GATED=gated),
                   dict(OPART=bf, LPART=f32, O=bf, LSE=f32, OC=bf, OW=bf, GT=bf), (), dict(num_warps=4))
    yield ("sel dq combine", selection.dq_combine_kernel,
           dict(G=16, N_SEL=16, DK=dk, BLOCK_R=16, BLOCK_DK=p2(dk, 16)),
           dict(DQPART=bf, IDX="*i32", DQ=bf), (), dict(num_warps=4))
    if dk == 128:
        # the smallest, a middle and the 64k top-n bucket; packed documents: one bucket (16k documents: 256)
        for width, varlen in ((1, False), (64, False), (1024, False), (256, True)):
            rb = topn.topn_rows(width, 16, tune["topn"])
            yield (f"top-n width {width}" + (" varlen" if varlen else ""), topn.topn_kernel,
                   dict(H=4, NBP=width, N_SEL=16, NSP=16, N_INIT=1, N_LOCAL=2, L_SEL=64, RB=rb,
                        SEG=min(topn.TOPN_SEG, width), VARLEN=varlen, **({} if varlen else dict(POS=None))),
                   dict(SC=f32, IDX="*i64", **(dict(POS="*i32") if varlen else {})), ("ssc_b", "sidx_b"),
                   dict(num_warps=tune["topn"]["warps"]))
        g = dict(D=dv, BD=triton.next_power_of_2(dv), BLOCK_R=tune["gate"]["rows"])
        gw = dict(num_warps=tune["gate"]["warps"])
        yield ("gated sum fwd", gate.gate_fwd_kernel, g, dict(OC=bf, OS=bf, OW=bf, GT=bf, O=bf), (), gw)
        yield ("gated sum bwd", gate.gate_bwd_kernel, g,
               dict(OC=bf, OS=bf, OW=bf, GT=bf, DO=bf, DOC=bf, DOS=bf, DOW=bf, DG=bf), (), gw)
        yield ("row dot (delta)", rowdot.row_dot_kernel, dict(D=dv, BD=triton.next_power_of_2(dv), BLOCK_R=rowdot.BLOCK_R),
               dict(A=bf, B=bf, OUT=f32), (), dict(num_warps=4))
    yield from decode_cases(dk, dv, pdl=arch >= 90)


def decode_cases(dk, dv, n_sm=132, max_len=65536, pdl=True):
    """The decode-step kernels as ``DecodeKernels`` launches them on CUDA (H200: 132 SMs) for
    ``model=h200bench`` at B=1 and B=64, caches of 64k tokens; ``pdl``: with programmatic dependent
    launch (``tuning.decode.pdl``, the default from sm_90)."""
    cfg = NSAConfig(dim=8192, n_heads=64, n_kv_heads=4, d_k=dk, d_v=dv, l=32, d=16, l_sel=64, n_sel=16, w=512)
    H, G = cfg.n_kv_heads, cfg.G
    bf, f32, i32 = "*bf16", "*fp32", "*i32"
    for B in (1, 64):
        p = decode.launch_params(cfg, B, max_len, gpu=True, n_sm=n_sm, tune=tuning.params("decode", "cuda"))
        common = dict(H=H, G=G, BG=p["BG"], BDV=p["BDV"], PDL=pdl)
        launch = dict(launch_pdl=True) if pdl else {}
        topk = dict(LS=cfg.l_sel, NSC_PAD=p2(p["nsc"], 2), N_SEL=cfg.n_sel, N_INIT=cfg.n_init, N_LOCAL=cfg.n_local,
                    NB_PAD=p["NB_PAD"], BSEL=p["BSEL"], BLOCK_T=p["block_t"], TOPK=p["topk"])
        for fuse in (False, True):  # tuning.decode.mode=two: the top-n (the combine) in the pass's last program
            yield (f"dec cmp partial B{B}" + (" fused" if fuse else ""), decode.dec_cmp_partial,
                   dict(common, DK=dk, DV=dv, L=cfg.l, D=cfg.d, NSC=p["nsc"], BDK=p["BDK"], BLOCK_C=p["block_c"],
                        PREC="tf32", COUNT=False, SMALL_DOT=False, FUSE=fuse, **topk),
                   dict(q_ptr=bf, kc_ptr=bf, vc_ptr=bf, pos_ptr="*i64", sc_ptr=f32, pm_ptr=f32, pl_ptr=f32,
                        pacc_ptr=f32, cnt_ptr=i32, psum_ptr=f32, ocmp_ptr=f32, idx_ptr=i32, sem_ptr=i32), (),
                   dict(num_warps=p["warps"], **launch), ("qk_scale",))
        yield (f"dec cmp topk B{B}", decode.dec_cmp_topk,
               dict(common, DV=dv, L=cfg.l, D=cfg.d, NSC=p["nsc"], DO_TOPK=True, **topk),
               dict(pos_ptr="*i64", sc_ptr=f32, pm_ptr=f32, pl_ptr=f32, pacc_ptr=f32, psum_ptr=f32, ocmp_ptr=f32,
                    idx_ptr=i32), (), dict(num_warps=p["topk_warps"], **launch), ())
        for fuse in (False, True):
            yield (f"dec sel/win B{B}" + (" fused" if fuse else ""), decode.dec_sv_partial,
                   dict(common, DK=dk, DV=dv, LS=cfg.l_sel, W=cfg.w, N_SEL=cfg.n_sel, NS_SEL=p["ns_sel"],
                        SEL_PER=p["sel_per"], SEL_VEC=p["sel_vec"], NS_TOT=p["ns_tot"], WIN_PER=p["win_per"],
                        NWC=p["nwc"], SPLIT_OFF=0, BDK=p["BDK"], BLS=p["BLS"], BW=p["bw"], PREC="tf32", COUNT=False,
                        FUSE=fuse),
                   dict(q_ptr=bf, ks_ptr=bf, vs_ptr=bf, kw_ptr=bf, vw_ptr=bf, idx_ptr=i32, pos_ptr="*i64", pm_ptr=f32,
                        pl_ptr=f32, pacc_ptr=f32, cnt_ptr=i32, ocmp_ptr=f32, g_ptr=bf, out_ptr=bf, sem_ptr=i32), (),
                   dict(num_warps=p["warps"], **launch), ("qk_scale",))
        mode3 = dict(H=H, G=G, DK=dk, DV=dv, L=cfg.l, D=cfg.d, BG=p["BG"], BDK=p["BDK"], BDV=p["BDV"], PREC="tf32",
                     COUNT=False, PDL=pdl)
        yield (f"dec three: cmp+win B{B}", decode.dec_cw_partial,
               dict(mode3, W=cfg.w, NSC=p["nsc"], NS_SEL=p["ns_sel"], NS_TOT=p["ns_tot"], WIN_PER=p["win_per"],
                    NWC=p["nwc"], BLOCK_C=p["block_c"], BW=p["bw"], SMALL_DOT=False),
               dict(q_ptr=bf, kc_ptr=bf, vc_ptr=bf, kw_ptr=bf, vw_ptr=bf, pos_ptr="*i64", sc_ptr=f32, cm_ptr=f32,
                    cl_ptr=f32, cacc_ptr=f32, pm_ptr=f32, pl_ptr=f32, pacc_ptr=f32, cnt_ptr=i32), (),
               dict(num_warps=p["warps"], **launch), ("qk_scale",))
        yield (f"dec three: sel+top-n B{B}", decode.dec_sel_topn,
               dict(mode3, LS=cfg.l_sel, N_SEL=cfg.n_sel, N_INIT=cfg.n_init, N_LOCAL=cfg.n_local, NSC=p["nsc"],
                    NSC_PAD=p2(p["nsc"], 2), SEL_PER=p["sel_per"], NS_SEL=p["ns_sel"], NS_TOT=p["ns_tot"],
                    BLS=p["BLS"], NB_PAD=p["NB_PAD"], BSEL=p["BSEL"], BLOCK_T=p["block_t"], TOPK=p["topk"]),
               dict(q_ptr=bf, ks_ptr=bf, vs_ptr=bf, pos_ptr="*i64", sc_ptr=f32, psum_ptr=f32, cm_ptr=f32, cl_ptr=f32,
                    idx_ptr=i32,
                    pm_ptr=f32, pl_ptr=f32, pacc_ptr=f32, cnt_ptr=i32), (),
               dict(num_warps=p["sel_warps"], **launch), ("qk_scale",))
        yield (f"dec three: combine B{B}", decode.dec_combine3,
               dict(H=H, G=G, DV=dv, NSC=p["nsc"], NS_SEL=p["ns_sel"], NS_TOT=p["ns_tot"], BG=p["BG"], BDV=p["BDV"],
                      BDVC=p["BDV"] // p["combine_split"], PDL=pdl),
               dict(cm_ptr=f32, cl_ptr=f32, cacc_ptr=f32, pm_ptr=f32, pl_ptr=f32, pacc_ptr=f32, g_ptr=bf, out_ptr=bf),
               (), dict(num_warps=p["warps"], **launch), ())
        yield (f"dec combine B{B}", decode.dec_combine,
               dict(common, DV=dv, NS_SEL=p["ns_sel"], NS_TOT=p["ns_tot"], HAS_CMP=True, HAS_SEL=True, HAS_WIN=True),
               dict(pm_ptr=f32, pl_ptr=f32, pacc_ptr=f32, ocmp_ptr=f32, g_ptr=bf, out_ptr=bf), (),
               dict(num_warps=p["warps"], **launch), ())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200), 89, 80")
    ap.add_argument("--dk", default="128,192", help="Dk values to check (Dv = 128)")
    ap.add_argument("--smem", type=int, default=232448, help="shared memory per block of the target (bytes)")
    ap.add_argument("--ptx", metavar="DIR", help="write each kernel's PTX instruction stream to DIR")
    a = ap.parse_args()
    target = GPUTarget("cuda", a.arch, 32)
    if a.ptx:
        os.makedirs(a.ptx, exist_ok=True)
    bad = 0
    print(f"{'kernel':<22} {'Dk':>4} {'compile s':>9} {'shared B':>9} {'regs':>5} {'spill B':>8}")
    for dk in (int(x) for x in a.dk.split(",")):
        for name, fn, consts, ptrs, i64, opts, *floats in cases(dk, 128, a.arch):
            kw = dict(floats=floats[0]) if floats else {}
            try:
                sec, smem, regs, spills, ptx = compile_one(fn, consts, ptrs, target, i64, **kw, **opts)
            except Exception as e:  # noqa: BLE001  (the row says which kernel failed)
                print(f"{name:<22} {dk:>4} FAILED {type(e).__name__}: {str(e)[:200]}")
                bad += 1
                continue
            if a.ptx:
                with open(os.path.join(a.ptx, f"{re.sub(r'[^A-Za-z0-9]+', '_', name)}-dk{dk}.ptx"), "w") as f:
                    f.write(ptx)
            over = smem > a.smem
            bad += over
            print(f"{name:<22} {dk:>4} {sec:>9.1f} {smem:>9d} {regs:>5d} {spills:>8d}"
                  + ("  OVER the shared-memory limit" if over else ""), flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
