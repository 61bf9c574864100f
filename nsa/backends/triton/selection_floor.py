"""The memory floor of the query-outer selected-attention forward: its key/value loads and nothing else.

``fwd_q_kernel`` (nsa/backends/triton/selection.py) runs one program per (query row, key/value head) and
loads the whole l_sel-token blocks the row selected, through the same TMA descriptors, in the same grid
order; this kernel issues exactly those loads and reduces each tile to a column sum (so that no load is
dead code), with no scores, softmax or p @ v. Its time is the gather bound of that design on this card:
for a row and head it moves n_valid * l_sel * (Dk + Dv) elements, 512 KiB at the paper's shape, most of
it from L2 (neighbouring rows select from the same head's keys). ``op=selection`` times it as row
``gather_floor``.
"""
import torch
import triton
import triton.language as tl

from . import tuning
from .selection import kv_descriptors, sel_tile, tile_meta


@triton.jit
def _gather_kernel(KD, VD, IDX, SK, SV, si_n, si_h, T, H,
                   N_SEL: tl.constexpr, L_SEL: tl.constexpr, N_SUB: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # flattened (batch, row)
    h = tl.program_id(1).to(tl.int64)
    k0 = (r // T) * T  # the row's sequence starts here in the flattened keys
    sk = tl.zeros([BLOCK_DK], tl.float32)
    sv = tl.zeros([BLOCK_DV], tl.float32)
    slots = tl.arange(0, BLOCK_N)
    ids = tl.load(IDX + r * si_n + h * si_h + slots, mask=slots < N_SEL, other=-1)
    n_live = tl.max(tl.where(ids >= 0, slots + 1, 0), 0)
    for i in range(n_live * N_SUB):  # one flat loop to the last valid slot, as the forward's
        s = i // N_SUB
        sb = i % N_SUB
        j = tl.load(IDX + r * si_n + h * si_h + s).to(tl.int64)
        row = tl.where(j >= 0, k0 + j * L_SEL + sb * BLOCK_S, -BLOCK_S)  # -1: rows outside the tensor, zeros
        sk += tl.sum(sel_tile(KD, row, h, BLOCK_S, BLOCK_DK).to(tl.float32), 0)
        sv += tl.sum(sel_tile(VD, row, h, BLOCK_S, BLOCK_DV).to(tl.float32), 0)
    tl.store(SK + (r * H + h) * BLOCK_DK + tl.arange(0, BLOCK_DK), sk)
    tl.store(SV + (r * H + h) * BLOCK_DV + tl.arange(0, BLOCK_DV), sv)


def unavailable(k: torch.Tensor, v: torch.Tensor, l_sel: int) -> str | None:
    """Why the floor cannot run on these keys (it loads through the forward's TMA descriptors only)."""
    tune = tuning.params("selection", k.device)
    if kv_descriptors(tune, k.flatten(0, 1), v.flatten(0, 1), l_sel)[0] is None:
        return "the query-outer forward loads through pointers here (no TMA descriptors): no floor of its design"
    return None


def gather_sums(k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, l_sel: int, *, warps: int | None = None,
                stages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (batch, row, head): the float32 column sums over the tokens of every selected block (whole
    blocks, past-t tokens included, as the forward loads them) of k and of v. k, v ``[B,T,H,D]``, idx
    ``[B,T,H,n_sel]`` (-1 ignored). Launch: the forward's warps and stages unless given."""
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    tune = tuning.params("selection", k.device)
    kf, vf = k.flatten(0, 1), v.flatten(0, 1)
    kd, vd = kv_descriptors(tune, kf, vf, l_sel)
    if kd is None:
        raise ValueError("gather_sums: these keys have no TMA descriptors (see unavailable())")
    meta = tile_meta(Dk, Dv, l_sel, tune["block_s"])
    ix = idx.flatten(0, 1)
    sk = torch.empty(B * T, H, meta["BLOCK_DK"], device=k.device, dtype=torch.float32)
    sv = torch.empty(B * T, H, meta["BLOCK_DV"], device=k.device, dtype=torch.float32)
    _gather_kernel[(B * T, H)](
        KD=kd,
        VD=vd,
        IDX=ix,
        SK=sk,
        SV=sv,
        si_n=ix.stride(0),
        si_h=ix.stride(1),
        T=T,
        H=H,
        N_SEL=idx.shape[-1],
        L_SEL=l_sel,
        BLOCK_N=max(2, triton.next_power_of_2(idx.shape[-1])),
        num_warps=warps or tune["warps"],
        num_stages=stages or tune["stages"],
        **meta,
    )
    return sk[..., :Dk].view(B, T, H, Dk), sv[..., :Dv].view(B, T, H, Dv)


def gather_sums_reference(k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, l_sel: int):
    """``gather_sums`` in torch (float64): the same tokens, i.e. whole blocks of the flattened [B*T] keys, so
    a sequence's last, partial block runs into the next sequence (zeros past the last), as the loads do."""
    B, T, H, _ = k.shape
    j = idx.long()
    start = torch.arange(B, device=k.device).view(B, 1, 1, 1) * T + j.clamp(min=0) * l_sel  # [B,T,H,n]
    heads = torch.arange(H, device=k.device).view(1, 1, H, 1)
    out = []
    for x in (k, v):
        x = torch.nn.functional.pad(x.flatten(0, 1).double(), (0, 0, 0, 0, 0, l_sel))  # [B*T + l_sel, H, D]
        cs = torch.cat([x.new_zeros(1, *x.shape[1:]), x.cumsum(0)])  # cs[u] = sum of tokens < u
        blk = cs[start + l_sel, heads] - cs[start, heads]  # [B,T,H,n,D]
        out.append((blk * (j >= 0).unsqueeze(-1)).sum(3))
    return out[0], out[1]


def floor_bytes(idx: torch.Tensor, l_sel: int, Dk: int, Dv: int, itemsize: int) -> float:
    """Bytes the forward's key/value loads move: whole blocks of every valid index."""
    return float((idx >= 0).sum()) * l_sel * (Dk + Dv) * itemsize
