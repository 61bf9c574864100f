"""Launchers of the decode-step kernels (``_dec_kernels``): one query per sequence, position read
from a device tensor, fixed grids, preallocated workspaces -- CUDA-graph capturable.

:class:`DecodeKernels` owns the workspaces for one (batch, cache size) and runs
``attend(q, gates, ...)`` over the caches it is given. Branch subsets (``branches``) run only the
kernels of those branches, so each can be timed alone.
"""
from __future__ import annotations

import math

import torch

from ..._compat import triton_version
from . import _interp  # noqa: F401  (interpreter shim, applied on import)
from ._dec_kernels import _dec_cmp_partial, _dec_cmp_topk, _dec_combine, _dec_sv_partial

LOG2E = 1.4426950408889634
# Smallest tl.dot dimension the running triton accepts: 3.0 asserts every one >= 16 (compiled and
# interpreted); later versions ask the target (the interpreter takes any size).
_DOT_MIN = 16 if triton_version() < (3, 1) else 1


def _p2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << max(0, (int(n) - 1).bit_length()))


class DecodeKernels:
    """Workspaces + launch parameters of the decode step for ``B`` sequences and caches of
    ``max_len`` raw tokens (``tc_rows`` rows of compressed cache, scratch row included).

    ``n_sm`` (default: the device's multiprocessor count, 4 on CPU) sizes the split-KV grids so
    that B=1 still fills the GPU. ``tuning`` may override: ``block_c``, ``nsc``, ``sel_per``,
    ``win_per``, ``bw``, ``num_warps``.
    """

    def __init__(self, config, B: int, max_len: int, device, *, dtype, n_sm: int | None = None,
                 tuning: dict | None = None):
        c = self.config = config
        tuning = dict(tuning or {})
        device = torch.device(device)
        self.B, self.max_len, self.device, self.dtype = B, max_len, device, dtype
        H, G = c.n_kv_heads, c.G
        if n_sm is None:
            n_sm = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        self.BG = _p2(G, 16)
        self.BDK = _p2(c.d_k, 16)
        self.BDV = _p2(c.d_v, 16)
        tc_max = c.n_cmp(max_len)
        self.TCS = max(tc_max, 1)
        self.block_c = tuning.get("block_c", 64 if device.type == "cuda" else 16)
        # split the compressed pass so that B*H*nsc programs fill the SMs ~4x, but keep >= 4 tiles
        # per split (the combine is unrolled over the splits)
        nsc_default = max(1, min(-(-4 * n_sm // (B * H)), -(-self.TCS // (4 * self.block_c)), 32))
        if device.type != "cuda":
            nsc_default = min(2, nsc_default)
        self.nsc = tuning.get("nsc", nsc_default)
        self.NB_PAD = _p2(c.n_blocks(max_len), 16)
        self.BSEL = _p2(c.n_sel, 2)
        self.BLS = _p2(c.l_sel, 16)
        gpu = device.type == "cuda"
        w_eff = min(c.w, max_len)
        # The interpreter (CPU tests) runs programs one by one: few, large programs there.
        self.bw = tuning.get("bw", 64 if gpu else _p2(w_eff, 16))
        self.nwc = -(-w_eff // self.bw)
        big = B * H >= n_sm
        self.sel_per = tuning.get("sel_per", (4 if big else 1) if gpu else max(1, c.n_sel // 2))
        self.sel_vec = tuning.get("sel_vec", 1 if gpu else _p2(self.sel_per))
        self.win_per = tuning.get("win_per", (4 if big else 1) if gpu else self.nwc)
        self.ns_sel = -(-c.n_sel // self.sel_per)
        self.ns_win = -(-self.nwc // self.win_per)
        self.ns_tot = self.ns_sel + self.ns_win
        self.num_warps = tuning.get("num_warps", 4)
        self.topk_warps = tuning.get("topk_warps", 8 if gpu else 4)
        self.interp = device.type != "cuda"
        self.prec = "ieee" if dtype == torch.float32 else "tf32"
        f32 = {"device": device, "dtype": torch.float32}
        BH = B * H
        self.scores = torch.empty(BH, G, self.TCS, **f32)
        self.psum = torch.empty(BH, self.TCS, **f32)
        self.cm = torch.empty(BH, self.nsc, self.BG, **f32)
        self.cl = torch.empty(BH, self.nsc, self.BG, **f32)
        self.cacc = torch.empty(BH, self.nsc, self.BG, self.BDV, **f32)
        self.o_cmp = torch.zeros(B, c.n_heads, c.d_v, **f32)
        self.sm = torch.empty(BH, self.ns_tot, self.BG, **f32)
        self.sl = torch.empty(BH, self.ns_tot, self.BG, **f32)
        self.sacc = torch.empty(BH, self.ns_tot, self.BG, self.BDV, **f32)
        self.indices = torch.full((B, H, c.n_sel), -1, device=device, dtype=torch.int32)
        self.counts = torch.zeros(BH, 3, device=device, dtype=torch.int32)
        self.out = torch.empty(B, c.n_heads, c.d_v, device=device, dtype=dtype)

    def params(self) -> dict:
        return {k: getattr(self, k) for k in ("BG", "BDK", "BDV", "TCS", "block_c", "nsc", "NB_PAD", "BLS", "bw",
                                             "nwc", "sel_per", "sel_vec", "win_per", "ns_sel", "ns_win", "num_warps")}

    # ------------------------------------------------------------------------------------------
    def attend(self, q, gates, pos, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, *, scale=None,
               branches=("cmp", "sel", "win"), combine=True, combine_branches=None, count=False, topk=True):
        """One decode step's attention for the query at position ``pos`` (a device int tensor [1]).

        q ``[B,HQ,Dk]`` (rows contiguous), gates ``[B,HQ,3]``, caches ``[B,*,H,D]`` (any strides
        with unit stride on D). Returns ``out [B,HQ,Dv]`` = sum over ``branches`` of g_b * o_b
        (a workspace tensor, overwritten by the next call). ``combine=False`` skips the combine
        kernel (timing); ``combine_branches`` (default ``branches``) says which branches it adds
        (``branches=(), combine_branches=BRANCHES`` times the combine alone). The selected branch
        reads ``self.indices`` (written by the cmp branch).
        """
        c = self.config
        H, G = c.n_kv_heads, c.G
        BH = self.B * H
        scale = 1.0 / math.sqrt(c.d_k) if scale is None else scale
        qk = scale * LOG2E
        nw = self.num_warps
        assert q.stride(-1) == 1 and k_cmp.stride(-1) == 1 and k_sel.stride(-1) == 1 and k_win.stride(-1) == 1
        if count:
            self.counts.zero_()
        if "cmp" in branches:
            _dec_cmp_partial[(BH, self.nsc)](
                q, k_cmp, v_cmp, pos, self.scores, self.cm, self.cl, self.cacc, self.counts,
                q.stride(0), q.stride(1), k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2),
                v_cmp.stride(0), v_cmp.stride(1), v_cmp.stride(2), qk, self.TCS,
                H=H, G=G, DK=c.d_k, DV=c.d_v, L=c.l, D=c.d, NSC=self.nsc,
                BG=self.BG, BDK=self.BDK, BDV=self.BDV, BLOCK_C=self.block_c, PREC=self.prec, COUNT=count,
                SMALL_DOT=self.block_c < _DOT_MIN, num_warps=nw)
            _dec_cmp_topk[(BH,)](
                pos, self.scores, self.cm, self.cl, self.cacc, self.psum, self.o_cmp, self.indices, self.TCS,
                H=H, G=G, DV=c.d_v, L=c.l, D=c.d, LS=c.l_sel, NSC=self.nsc, NSC_PAD=_p2(self.nsc, 2),
                N_SEL=c.n_sel, N_INIT=c.n_init, N_LOCAL=c.n_local,
                BG=self.BG, BDV=self.BDV, BLOCK_T=256 if self.device.type == "cuda" else 16, NB_PAD=self.NB_PAD,
                BSEL=self.BSEL, DO_TOPK=topk, num_warps=self.topk_warps)
        has_sel, has_win = "sel" in branches, "win" in branches
        if has_sel or has_win:
            off = 0 if has_sel else self.ns_sel
            n = (self.ns_sel if has_sel else 0) + (self.ns_win if has_win else 0)
            _dec_sv_partial[(BH, n)](
                q, k_sel, v_sel, k_win, v_win, self.indices, pos, self.sm, self.sl, self.sacc, self.counts,
                q.stride(0), q.stride(1),
                k_sel.stride(0), k_sel.stride(1), k_sel.stride(2), v_sel.stride(0), v_sel.stride(1), v_sel.stride(2),
                k_win.stride(0), k_win.stride(1), k_win.stride(2), v_win.stride(0), v_win.stride(1), v_win.stride(2),
                qk, H=H, G=G, DK=c.d_k, DV=c.d_v, LS=c.l_sel, W=c.w, N_SEL=c.n_sel,
                NS_SEL=self.ns_sel, SEL_PER=self.sel_per, SEL_VEC=self.sel_vec, NS_TOT=self.ns_tot, WIN_PER=self.win_per,
                NWC=self.nwc, SPLIT_OFF=off, BG=self.BG, BDK=self.BDK, BDV=self.BDV, BLS=self.BLS, BW=self.bw,
                PREC=self.prec, COUNT=count, num_warps=nw)
        cb = branches if combine_branches is None else combine_branches
        if combine:
            _dec_combine[(BH,)](
                self.sm, self.sl, self.sacc, self.o_cmp, gates, self.out,
                gates.stride(0), gates.stride(1), self.out.stride(0), self.out.stride(1),
                H=H, G=G, DV=c.d_v, NS_SEL=self.ns_sel, NS_TOT=self.ns_tot,
                HAS_CMP="cmp" in cb, HAS_SEL="sel" in cb, HAS_WIN="win" in cb,
                BG=self.BG, BDV=self.BDV, num_warps=nw)
        return self.out
