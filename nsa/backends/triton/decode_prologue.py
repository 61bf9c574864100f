"""Triton kernels of the decode step's prologue: what lies between the layer's input projection and the
attention kernels (``nsa.decode.GraphDecoder``, ``tuning.decode.prologue``).

The reference is ``GraphDecoder._project`` with ``prologue=torch`` (about forty small torch launches at
B=1); here, after the one GEMM of every projection (``P = x @ [W_q; W_k_cmp; ..; W_v_win; W_gate1]^T + b``):

1. ``_step_project``  grid (B, HQ + H + 1 + phi programs): per query head RoPE -> q; per key/value
   group the six raw tokens (keys rotated) into the caches at the row's position; one program for
   the gates (Eq. 5: sigmoid(MLP(x)), the MLP's hidden layer taken from P); and, only for the rows
   whose compression block completes at their position (t = i*d + l - 1), the first layer of phi
   (Eq. 7) over the block's l raw tokens plus the intra-block position embedding: each phi program
   takes a share of hidden units x block rows for BB sequences x every group (the programs of
   sequences b % BB == 0), partial sums in float32 (phi = mean: one program per group, the
   compressed token itself). The block's newest token is rotated from P in the phi program itself,
   so no program waits for another.
2. ``_step_phi_out``  grid (cdiv(B, BB), output chunks of k and v): the partial sums added in a fixed
   order, fc1's bias, GELU and phi's second layer into compressed row i (nothing where no block
   completes; not launched for phi = mean).

Every program reads the position from device memory, so one CUDA graph serves every step.
Intermediate values are rounded to the layer's dtype where the torch reference rounds them (each
Linear's output, the activations), so both paths agree to the kernels' accumulation order.
"""

# No ``from __future__ import annotations``: triton 2.3/3.0 reads the kernel annotations as objects.
import torch
import triton
import triton.language as tl

from .pdl import pdl_enter
from .utils import p2

PHI_MEAN, PHI_MLP = 1, 2


@triton.jit
def _token(src, cos_row, sin_row, offs, dmask, D: tl.constexpr, ROPE: tl.constexpr):
    """The D values at ``src`` in float32; with ROPE rotated (rotate-half: x * cos + [-x2, x1] * sin)."""
    x = tl.load(src + offs, mask=dmask, other=0.0).to(tl.float32)
    if ROPE:
        HALF: tl.constexpr = D // 2
        lo = offs < HALF
        xp = tl.load(src + tl.where(lo, offs + HALF, offs - HALF), mask=dmask, other=0.0).to(tl.float32)
        c = tl.load(cos_row + offs, mask=dmask, other=0.0)
        s = tl.load(sin_row + offs, mask=dmask, other=0.0)
        x = x * c + tl.where(lo, -xp, xp) * s
    return x


@triton.jit
def _phi_mean(raw_base, st, new_src, cos_row, sin_row, start, c_out, D: tl.constexpr, BD: tl.constexpr,
              L: tl.constexpr, ROPE: tl.constexpr):
    """phi = mean: the compressed token of the block of L raw tokens from ``start`` (the last one this
    step's, from P) at ``c_out``."""
    dt = c_out.dtype.element_ty
    offs = tl.arange(0, BD)
    dm = offs < D
    acc = _token(new_src, cos_row, sin_row, offs, dm, D, ROPE).to(dt).to(tl.float32)  # as the cache holds it
    for r in range(L - 1):
        acc += tl.load(raw_base + (start + r) * st + offs, mask=dm, other=0.0).to(tl.float32)
    tl.store(c_out + offs, (acc / L).to(dt), mask=dm)


@triton.jit
def _block_rows(pos_ptr, stride_pos, b0, B, H: tl.constexpr, BB: tl.constexpr, BM: tl.constexpr, L: tl.constexpr,
                DSTR: tl.constexpr):
    """Rows m < BB*H of a phi program: sequence b0 + m // H, group m % H, its position t, its block's first
    token ``start`` and whether a block completes there (``emit``)."""
    mm = tl.arange(0, BM)
    bm = b0 + mm // H
    hm = mm % H
    live = (bm < B) & (mm < BB * H)
    t = tl.load(pos_ptr + bm * stride_pos, mask=live, other=0)
    start = t - (L - 1)
    emit = live & (start >= 0) & (start % DSTR == 0)
    return bm, hm, t, start, emit


@triton.jit
def _phi_part(raw_ptr, skb, st, p_ptr, stride_p, pos_ptr, stride_pos, cos_ptr, sin_ptr, stride_cs, b0, B, pe_ptr,
              w1_ptr, h_ptr, KIND: tl.constexpr, ch, rc, H: tl.constexpr, BB: tl.constexpr, BM: tl.constexpr,
              D: tl.constexpr,
              BD: tl.constexpr, L: tl.constexpr, DSTR: tl.constexpr, HID: tl.constexpr, HIDM: tl.constexpr,
              NRM: tl.constexpr, BHID: tl.constexpr, RPER: tl.constexpr, ROPE: tl.constexpr, PREC: tl.constexpr):
    """phi's first Linear (Eq. 7, fc1 over the flattened block + pe), one share of it for BM (sequence, group)
    rows at once: hidden units ch*BHID.. over the block's rows rc*RPER.. (the last row is this step's token,
    rotated from P); partial sums (without fc1's bias) to ``hidden[b, KIND, rc, h, unit]``. Rows whose
    block does not complete now are masked."""
    dt = raw_ptr.dtype.element_ty
    bm, hm, t, start, emit = _block_rows(pos_ptr, stride_pos, b0, B, H, BB, BM, L, DSTR)
    if tl.max(emit.to(tl.int32), 0) > 0:
        dd = tl.arange(0, BD)
        m2 = emit[:, None] & (dd < D)[None, :]
        new = _token(p_ptr + bm[:, None] * stride_p + hm[:, None] * D, cos_ptr + t[:, None] * stride_cs,
                     sin_ptr + t[:, None] * stride_cs, dd[None, :], m2, D, ROPE).to(dt).to(tl.float32)
        units = ch * BHID + tl.arange(0, BHID)
        wm = (units < HID)[:, None] & (dd < D)[None, :]
        rows = raw_ptr + bm[:, None] * skb + start[:, None] * st + hm[:, None] * D + dd[None, :]
        acc = tl.zeros([BM, BHID], dtype=tl.float32)
        for k in range(RPER):
            r = rc * RPER + k
            x = tl.load(rows + r * st, mask=m2 & (r < L - 1), other=0.0).to(tl.float32)
            x = tl.where(r == L - 1, new, x)
            x = (x + tl.load(pe_ptr + r * D + dd, mask=(dd < D) & (r < L), other=0.0).to(tl.float32)[None, :]).to(dt)
            w = tl.load(w1_ptr + units[:, None] * (L * D) + r * D + dd[None, :], mask=wm & (r < L), other=0.0)
            acc += tl.dot(x, tl.trans(w.to(dt)), input_precision=PREC)
        out = h_ptr + ((bm * 2 + KIND) * NRM + rc)[:, None] * (H * HIDM) + hm[:, None] * HIDM + units[None, :]
        tl.store(out, acc, mask=emit[:, None] & (units < HID)[None, :])


@triton.jit
def _step_project(p_ptr, stride_p, pos_ptr, stride_pos, B, cos_ptr, sin_ptr, stride_cs, q_ptr, g_ptr,
                  kc_ptr, vc_ptr, ks_ptr, vs_ptr, kw_ptr, vw_ptr, skb, skt, svb, svt,
                  ck_ptr, cv_ptr, sckb, sckt, scvb, scvt,
                  gw2_ptr, gb2_ptr, pek_ptr, w1k_ptr, pev_ptr, w1v_ptr, h_ptr,
                  HQ: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr,
                  BDV: tl.constexpr, L: tl.constexpr, DSTR: tl.constexpr, GH: tl.constexpr, BGH: tl.constexpr,
                  BGO: tl.constexpr, PHI: tl.constexpr, HIDK: tl.constexpr, HIDV: tl.constexpr, HIDM: tl.constexpr,
                  NRM: tl.constexpr, BHID: tl.constexpr, NCHK: tl.constexpr, NCHV: tl.constexpr, NRK: tl.constexpr,
                  NRV: tl.constexpr, RPERK: tl.constexpr, RPERV: tl.constexpr, BB: tl.constexpr, BM: tl.constexpr,
                  PREC: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    b = tl.program_id(0)
    j = tl.program_id(1)
    t = tl.load(pos_ptr + b * stride_pos)
    dt = q_ptr.dtype.element_ty
    p_row = p_ptr + b * stride_p
    cos_row = cos_ptr + t * stride_cs
    sin_row = sin_ptr + t * stride_cs
    offk = tl.arange(0, BDK)
    offv = tl.arange(0, BDV)
    mk = offk < DK
    mv = offv < DV
    # offsets of the projections in P's row: q, then (k, v) of cmp, sel, win, then the gate's input
    OKC: tl.constexpr = HQ * DK
    OKS: tl.constexpr = OKC + H * (DK + DV)
    OKW: tl.constexpr = OKS + H * (DK + DV)
    OG: tl.constexpr = OKW + H * (DK + DV)
    NG: tl.constexpr = 3 * HQ
    if j < HQ:  # query head j
        x = _token(p_row + j * DK, cos_row, sin_row, offk, mk, DK, True)
        tl.store(q_ptr + (b * HQ + j) * DK + offk, x.to(dt), mask=mk)
    elif j < HQ + H:  # group h: the six raw tokens at position t
        h = j - HQ
        ko = b * skb + t * skt + h * DK
        vo = b * svb + t * svt + h * DV
        x = _token(p_row + OKC + h * DK, cos_row, sin_row, offk, mk, DK, True)
        tl.store(kc_ptr + ko + offk, x.to(dt), mask=mk)
        x = _token(p_row + OKS + h * DK, cos_row, sin_row, offk, mk, DK, True)
        tl.store(ks_ptr + ko + offk, x.to(dt), mask=mk)
        x = _token(p_row + OKW + h * DK, cos_row, sin_row, offk, mk, DK, True)
        tl.store(kw_ptr + ko + offk, x.to(dt), mask=mk)
        tl.store(vc_ptr + vo + offv, tl.load(p_row + OKC + H * DK + h * DV + offv, mask=mv), mask=mv)
        tl.store(vs_ptr + vo + offv, tl.load(p_row + OKS + H * DK + h * DV + offv, mask=mv), mask=mv)
        tl.store(vw_ptr + vo + offv, tl.load(p_row + OKW + H * DK + h * DV + offv, mask=mv), mask=mv)
    elif j == HQ + H:  # Eq. 5's gates, [HQ, 3] (cmp, sel, win) per head
        if GH > 0:  # P holds the MLP's first Linear: SiLU, the second Linear, sigmoid
            kk = tl.arange(0, BGH)
            hid = tl.load(p_row + OG + kk, mask=kk < GH, other=0.0).to(tl.float32)
            hid = (hid * tl.sigmoid(hid)).to(dt).to(tl.float32)
            for r0 in range(0, NG, BGO):
                rows = r0 + tl.arange(0, BGO)
                w = tl.load(gw2_ptr + rows[:, None] * GH + kk[None, :], mask=(rows < NG)[:, None] & (kk < GH)[None, :],
                            other=0.0).to(tl.float32)
                z = tl.sum(w * hid[None, :], 1) + tl.load(gb2_ptr + rows, mask=rows < NG, other=0.0).to(tl.float32)
                z = z.to(dt).to(tl.float32)
                tl.store(g_ptr + b * NG + rows, tl.sigmoid(z).to(dt), mask=rows < NG)
        else:  # P holds the gate's Linear
            for r0 in range(0, NG, BGO):
                rows = r0 + tl.arange(0, BGO)
                z = tl.load(p_row + OG + rows, mask=rows < NG, other=0.0).to(tl.float32)
                tl.store(g_ptr + b * NG + rows, tl.sigmoid(z).to(dt), mask=rows < NG)
    elif PHI == 1:  # phi = mean, one program per (kind, group), if the row's block completes at t
        start = t - (L - 1)
        if (start >= 0) & (start % DSTR == 0):
            k = j - (HQ + H + 1)
            i = start // DSTR
            h = k % H
            if k < H:
                _phi_mean(kc_ptr + b * skb + h * DK, skt, p_row + OKC + h * DK, cos_row, sin_row, start,
                          ck_ptr + b * sckb + i * sckt + h * DK, DK, BDK, L, True)
            else:
                _phi_mean(vc_ptr + b * svb + h * DV, svt, p_row + OKC + H * DK + h * DV, cos_row, sin_row, start,
                          cv_ptr + b * scvb + i * scvt + h * DV, DV, BDV, L, False)
    elif b % BB == 0:  # phi = MLP: fc1's share (hidden chunk, block-rows chunk) for sequences b..b+BB-1
        k = j - (HQ + H + 1)
        if k < NCHK * NRK:
            _phi_part(kc_ptr, skb, skt, p_ptr + OKC, stride_p, pos_ptr, stride_pos, cos_ptr, sin_ptr, stride_cs, b, B,
                      pek_ptr, w1k_ptr, h_ptr, 0, k // NRK, k % NRK, H, BB, BM, DK, BDK, L, DSTR, HIDK, HIDM, NRM, BHID,
                      RPERK, True, PREC)
        else:
            k -= NCHK * NRK
            _phi_part(vc_ptr, svb, svt, p_ptr + OKC + H * DK, stride_p, pos_ptr, stride_pos, cos_ptr, sin_ptr,
                      stride_cs, b, B, pev_ptr, w1v_ptr, h_ptr, 1, k // NRV, k % NRV, H, BB, BM, DV, BDV, L, DSTR, HIDV,
                      HIDM, NRM, BHID, RPERV, False, PREC)


@triton.jit
def _phi_out(h_ptr, pos_ptr, stride_pos, b0, B, b1_ptr, w2_ptr, b2_ptr, c_ptr, scb, sct, d0, KIND: tl.constexpr,
             NR: tl.constexpr, H: tl.constexpr, BB: tl.constexpr, BM: tl.constexpr, D: tl.constexpr, L: tl.constexpr,
             DSTR: tl.constexpr, HID: tl.constexpr, HIDM: tl.constexpr, NRM: tl.constexpr, BH: tl.constexpr,
             BDO: tl.constexpr, PREC: tl.constexpr):
    """phi's output for BM (sequence, group) rows: fc1 = the NR partial sums + b1, GELU (erf form), then
    output dims d0.. of fc2 -> compressed token i = start // d of each row whose block completes now."""
    dt = c_ptr.dtype.element_ty
    bm, hm, t, start, emit = _block_rows(pos_ptr, stride_pos, b0, B, H, BB, BM, L, DSTR)
    if tl.max(emit.to(tl.int32), 0) > 0:
        kk = tl.arange(0, BH)
        km = kk < HID
        hrow = h_ptr + ((bm * 2 + KIND) * NRM)[:, None] * (H * HIDM) + hm[:, None] * HIDM + kk[None, :]
        hmask = emit[:, None] & km[None, :]
        x = tl.zeros([BM, BH], dtype=tl.float32) + tl.load(b1_ptr + kk, mask=km, other=0.0).to(tl.float32)[None, :]
        for r in range(NR):
            x += tl.load(hrow + r * (H * HIDM), mask=hmask, other=0.0)
        x = x.to(dt).to(tl.float32)
        g = (0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))).to(dt)
        rows = d0 + tl.arange(0, BDO)
        rm = rows < D
        w = tl.load(w2_ptr + rows[:, None] * HID + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        o = tl.dot(g, tl.trans(w.to(dt)), input_precision=PREC)
        o += tl.load(b2_ptr + rows, mask=rm, other=0.0).to(tl.float32)[None, :]
        i = tl.where(emit, start // DSTR, 0)
        out = c_ptr + (bm * scb + i * sct + hm * D)[:, None] + rows[None, :]
        tl.store(out, o.to(dt), mask=emit[:, None] & rm[None, :])


@triton.jit
def _step_phi_out(pos_ptr, stride_pos, B, h_ptr, b1k_ptr, w2k_ptr, b2k_ptr, b1v_ptr, w2v_ptr, b2v_ptr, ck_ptr, cv_ptr,
                  sckb, sckt, scvb, scvt, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, L: tl.constexpr,
                  DSTR: tl.constexpr, HIDK: tl.constexpr, HIDV: tl.constexpr, HIDM: tl.constexpr, NRM: tl.constexpr,
                  NRK: tl.constexpr, NRV: tl.constexpr, BHK: tl.constexpr, BHV: tl.constexpr, BDO: tl.constexpr,
                  BB: tl.constexpr, BM: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr):
    """grid (cdiv(B, BB), output chunks of k and v): phi's fc2 for sequences BB*program_id(0).. ."""
    pdl_enter(PDL)
    b0 = tl.program_id(0) * BB
    j = tl.program_id(1)
    NDK: tl.constexpr = (DK + BDO - 1) // BDO
    if j < NDK:
        _phi_out(h_ptr, pos_ptr, stride_pos, b0, B, b1k_ptr, w2k_ptr, b2k_ptr, ck_ptr, sckb, sckt, j * BDO, 0, NRK, H,
                 BB, BM, DK, L, DSTR, HIDK, HIDM, NRM, BHK, BDO, PREC)
    else:
        _phi_out(h_ptr, pos_ptr, stride_pos, b0, B, b1v_ptr, w2v_ptr, b2v_ptr, cv_ptr, scvb, scvt, (j - NDK) * BDO, 1,
                 NRV, H, BB, BM, DV, L, DSTR, HIDV, HIDM, NRM, BHV, BDO, PREC)


class StepPrologue:
    """Workspaces and launches of the prologue for ``B`` sequences (see the module docstring).

    ``__call__(P, pos, cos, sin, raw, k_ext, v_ext, module)`` -> ``(q [B,HQ,Dk], gates [B,HQ,3])``
    (workspaces, overwritten by the next call). ``P`` ``[B, N]``: the projections, rows contiguous;
    ``raw``: the six raw caches (k_cmp_raw, v_cmp_raw, k_sel, v_sel, k_win, v_win), ``[B,T,H,D]``
    with contiguous heads; ``k_ext``/``v_ext``: the compressed caches; ``module``: the layer, whose
    gate and phi parameters are read at each call.

    phi's fc1 (l*D x hidden per kind: 2 MiB at D=128, l=32) is read by programs of BHID hidden units x
    block rows (about 32 KiB each, SHARE elements) for BB sequences x every group at once (the weights
    are read once per BB sequences); partial sums in float32, added in a fixed order by the fc2 kernel
    (deterministic, no atomics).
    """

    BHID = 32  # phi's hidden units per program
    BDO = 32  # phi's fc2 output rows per program
    SHARE = 16384  # phi's fc1 elements (units x block rows x D) per program
    ROWS = 64  # (sequence, group) rows per phi program, at most

    def __init__(self, config, B: int, device, dtype, *, pdl: bool = False, warps: int = 4, prec: str = "tf32"):
        c = self.config = config
        self.B, self.pdl, self.warps, self.prec = B, pdl, warps, prec
        self.phi = PHI_MLP if c.phi == "mlp" else PHI_MEAN
        H = c.n_kv_heads
        if self.phi == PHI_MLP:
            hid = c.phi_hidden or None
            self.hid = {"k": hid or 2 * c.d_k, "v": hid or 2 * c.d_v}
            self.nch = {k: -(-h // self.BHID) for k, h in self.hid.items()}
            self.rper = {k: max(1, min(c.l, self.SHARE // (self.BHID * p2(D, 16)))) for k, D in
                         (("k", c.d_k), ("v", c.d_v))}
            self.nr = {k: -(-c.l // r) for k, r in self.rper.items()}
            self.n_phi = sum(self.nch[k] * self.nr[k] for k in "kv")
        else:
            self.hid, self.nch, self.rper, self.nr = ({"k": 1, "v": 1} for _ in range(4))
            self.n_phi = 2 * H
        self.hid_m, self.nr_m = max(self.hid.values()), max(self.nr.values())
        # phi MLP programs take BB sequences x H groups (BM rows, >= 16 for tl.dot): its weights are read
        # once per BB sequences
        self.bb = min(p2(B, 1), max(1, self.ROWS // H))
        self.bm = p2(self.bb * H, 16)
        self.q = torch.empty(B, c.n_heads, c.d_k, device=device, dtype=dtype)
        self.gates = torch.empty(B, c.n_heads, 3, device=device, dtype=dtype)
        self.hidden = torch.empty(B, 2, self.nr_m, H, self.hid_m, device=device, dtype=torch.float32)

    def n_programs(self) -> int:
        """Programs per sequence of the first kernel: query heads, groups, the gates, phi's shares."""
        c = self.config
        return c.n_heads + c.n_kv_heads + 1 + self.n_phi

    def __call__(self, P, pos, cos, sin, raw, k_ext, v_ext, module):
        c, B = self.config, self.B
        HQ, H, DK, DV = c.n_heads, c.n_kv_heads, c.d_k, c.d_v
        kc, vc, ks, vs, kw, vw = raw
        for k_, v_ in ((ks, vs), (kw, vw)):
            if k_.stride() != kc.stride() or v_.stride() != vc.stride():
                raise ValueError("StepPrologue: the raw key (value) caches must share one layout")
        for x in (P, cos, kc, vc, k_ext, v_ext):
            assert x.stride(-1) == 1
        assert kc.stride(2) == DK and vc.stride(2) == DV and k_ext.stride(2) == DK and v_ext.stride(2) == DV
        gate = module.gate
        gw2, gb2 = (gate[2].weight, gate[2].bias) if c.gate_hidden else (P, P)  # (P: not read)
        mlp = self.phi == PHI_MLP
        pk, pv = (module.phi_k, module.phi_v) if mlp else (None, None)
        phi_in = (pk.pe, pk.fc1.weight, pv.pe, pv.fc1.weight) if mlp else (P,) * 4
        spos = 0 if pos.shape[0] == 1 else pos.stride(0)
        pdl = dict(PDL=True, launch_pdl=True) if self.pdl else dict(PDL=False)
        _step_project[(B, self.n_programs())](
            p_ptr=P, stride_p=P.stride(0), pos_ptr=pos, stride_pos=spos, B=B, cos_ptr=cos, sin_ptr=sin, stride_cs=cos.stride(0),
            q_ptr=self.q, g_ptr=self.gates, kc_ptr=kc, vc_ptr=vc, ks_ptr=ks, vs_ptr=vs, kw_ptr=kw, vw_ptr=vw, skb=kc.stride(0),
            skt=kc.stride(1), svb=vc.stride(0), svt=vc.stride(1), ck_ptr=k_ext, cv_ptr=v_ext, sckb=k_ext.stride(0),
            sckt=k_ext.stride(1), scvb=v_ext.stride(0), scvt=v_ext.stride(1), gw2_ptr=gw2, gb2_ptr=gb2, pek_ptr=phi_in[0],
            w1k_ptr=phi_in[1], pev_ptr=phi_in[2], w1v_ptr=phi_in[3], h_ptr=self.hidden, HQ=HQ, H=H, DK=DK, DV=DV, BDK=p2(DK, 16),
            BDV=p2(DV, 16), L=c.l, DSTR=c.d, GH=c.gate_hidden, BGH=p2(max(c.gate_hidden, 1), 2), BGO=min(p2(3 * HQ, 2), 64),
            PHI=self.phi, HIDK=self.hid["k"], HIDV=self.hid["v"], HIDM=self.hid_m, NRM=self.nr_m, BHID=self.BHID,
            NCHK=self.nch["k"], NCHV=self.nch["v"], NRK=self.nr["k"], NRV=self.nr["v"], RPERK=self.rper["k"],
            RPERV=self.rper["v"], BB=self.bb, BM=self.bm, PREC=self.prec, num_warps=self.warps, **pdl,
        )
        if mlp:
            n_out = -(-DK // self.BDO) + -(-DV // self.BDO)
            _step_phi_out[(-(-B // self.bb), n_out)](
                pos_ptr=pos, stride_pos=spos, B=B, h_ptr=self.hidden, b1k_ptr=pk.fc1.bias, w2k_ptr=pk.fc2.weight,
                b2k_ptr=pk.fc2.bias, b1v_ptr=pv.fc1.bias, w2v_ptr=pv.fc2.weight, b2v_ptr=pv.fc2.bias, ck_ptr=k_ext, cv_ptr=v_ext,
                sckb=k_ext.stride(0), sckt=k_ext.stride(1), scvb=v_ext.stride(0), scvt=v_ext.stride(1), H=H, DK=DK, DV=DV, L=c.l,
                DSTR=c.d, HIDK=self.hid["k"], HIDV=self.hid["v"], HIDM=self.hid_m, NRM=self.nr_m, NRK=self.nr["k"],
                NRV=self.nr["v"], BHK=p2(self.hid["k"], 16), BHV=p2(self.hid["v"], 16), BDO=self.BDO, BB=self.bb, BM=self.bm,
                PREC=self.prec, num_warps=self.warps, **pdl,
            )
        return self.q, self.gates
