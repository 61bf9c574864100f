"""The ``cudnn`` backend: the compressed branch's attention (spec steps 2-3, paper Eq. 5 on the compressed
keys) by cuDNN's fused attention, its Eq. 9/10 block scores and Eqs. 11-12 top-n by the triton backend.

Compressed key i covers tokens [i*d, i*d + l), so the query at t sees keys i with i*d + l - 1 <= t.
With t' = t - (l - 1) = k*d + r (0 <= r < d) that is i <= k: the d queries of "row block" k all see keys
0..k. Folding r into the head axis makes the branch plain causal attention over the row blocks and as many
keys: ``fold_queries`` is a view of q (rows t = l - 1 + k*d + r of a [B,T,HQ,D] tensor are rows k of
[B, n, d*HQ, D], folded head r*HQ + hq), and ``fold_keys`` repeats the T/d compressed keys once per r (key
head r*H + h), so that the grouping cuDNN applies (query head j reads key head j // G) pairs them right.
``torch.ops.aten._scaled_dot_product_cudnn_attention`` runs it with its log-sum-exp; the fewer than d rows
past the last whole row block see every key and are computed by ``tail_attention``; rows t < l - 1 see no
key (output 0, lse +inf). Everything is a differentiable torch operation: the backward is cuDNN's
(``_scaled_dot_product_cudnn_attention_backward``, registered by PyTorch). The block scores need the
normalized probabilities: ``nsa.backends.triton.compressed`` recomputes them from this lse in its score-only
pass (q k^T once, no p @ v) and the top-n follows as on the triton backend.

torch.compile traces it whole: the fold, cuDNN's op and the score pass (the custom op ``nsa::compressed_scores``)
are graph nodes; the stream hook ``on_scored`` runs in eager only, as on the triton backend.

Runs from the sequence's start (``q_start = 0``) on one sequence per batch row; chunked prefill and context
parallelism (q_start > 0) and packed documents are the triton backend's: a call with q_start > 0 is an
error naming it. ``sel`` and ``win`` are reported unavailable.
"""

from __future__ import annotations

import torch

from ..dispatch import Backend
from .triton.utils import LOG2E
CMP_ONLY = ("cudnn runs the compressed branch only (its attention folded into causal attention over the "
            "compressed keys); use backend.{branch}=triton")


def n_rows(T: int, l: int, d: int) -> int:
    """Row blocks whose d queries all exist: (T - l + 1) // d (0 when T < l - 1 + d)."""
    return max(0, T - l + 1) // d


def fold_queries(q: torch.Tensor, l: int, d: int) -> torch.Tensor:
    """q ``[B,T,HQ,D]`` (contiguous) -> ``[B, d*HQ, n, D]``, a view (no copy): row k, folded head r*HQ + hq hold
    the query at t = l - 1 + k*d + r, for the n = ``n_rows`` whole row blocks."""
    B, T, HQ, D = q.shape
    n = n_rows(T, l, d)
    return q[:, l - 1:l - 1 + n * d].view(B, n, d * HQ, D).transpose(1, 2)


def fold_keys(k: torch.Tensor, n: int, d: int) -> torch.Tensor:
    """Compressed keys/values ``[B,N,H,D]`` -> ``[B, d*H, n, D]``, keys 0..n-1 once per r (folded key head
    r*H + h): folded query head r*HQ + h*G + g then reads key head (r*HQ + h*G + g) // G = r*H + h, cuDNN's
    grouping. d copies of T/d keys: about as many bytes as one more key tensor at full length."""
    return k[:, :n].repeat(1, 1, d, 1).transpose(1, 2)


def unfold_rows(of: torch.Tensor, d: int) -> torch.Tensor:
    """``[B, d*HQ, n, D]`` -> ``[B, n*d, HQ, D]``, the rows t = l - 1 .. l - 2 + n*d in order (a view where
    cuDNN wrote the layout of ``fold_queries``)."""
    B, HDd, n, D = of.shape
    return of.transpose(1, 2).reshape(B, n * d, HDd // d, D)


def unfold_lse(lse_f: torch.Tensor, d: int) -> torch.Tensor:
    """cuDNN's natural-log lse ``[B, d*HQ, n(, 1)]`` -> ``[B, HQ, n*d]`` base 2, rows t = l - 1 + k*d + r."""
    B, HDd, n = lse_f.shape[:3]
    return lse_f.reshape(B, d, HDd // d, n).permute(0, 2, 3, 1).reshape(B, HDd // d, n * d).float() * LOG2E


def tail_attention(q, k, v, scale: float):
    """The last rows (fewer than d, past the whole row blocks), each of which sees all of k: o ``[B,r,HQ,Dv]``
    and lse ``[B,HQ,r]`` base 2, by plain float32 torch operations (differentiable)."""
    B, r, HQ, D = q.shape
    H = k.shape[2]
    s = torch.einsum("bthgd,bnhd->bthgn", q.reshape(B, r, H, HQ // H, D).float(), k.float()) * scale
    lse = torch.logsumexp(s, -1)
    o = torch.einsum("bthgn,bnhd->bthgd", torch.exp(s - lse[..., None]), v.float())
    return o.reshape(B, r, HQ, v.shape[-1]).to(q.dtype), lse.reshape(B, r, HQ).transpose(1, 2) * LOG2E


# Elements one cuDNN call may hold in a tensor. Past 2^31, its backward went wrong on an H100 (2026-11-27,
# cuDNN 9.19: B = 2, T = 128k, HQ = 64, Dv = 128 folded to o of 2.15e9 elements: output right, dq and dk
# rel-L2 0.5, dv right, the rows past element 2^31 wrong); `pieces` keeps every call under it.
MAX_ELEMS = 2**31 - 1


def pieces(B: int, d: int, HQ: int, n: int, D: int, limit: int = MAX_ELEMS) -> tuple[int, int]:
    """(batch rows, fold offsets r) per cuDNN call: all of them when the folded tensors hold at most ``limit``
    elements, else one batch row and the largest divisor of d whose heads fit (one r at least)."""
    if B * d * HQ * n * D <= limit:
        return B, d
    rs = max((g for g in range(1, d + 1) if d % g == 0 and g * HQ * n * D <= limit), default=1)
    return 1, rs


def attend_in_pieces(qf, kf, vf, scale: float, attend, d: int, D: int, limit: int = MAX_ELEMS):
    """``attend`` over the folded layout in calls of at most ``limit`` elements a tensor (``pieces``): each
    call's queries a contiguous copy of its batch rows and folded heads (r*HQ .. for its offsets r), its
    keys the matching folded key heads; outputs and lse concatenated back. One call where all fits."""
    B, HD, n, _ = qf.shape
    HQ, H = HD // d, kf.shape[1] // d
    bs, rs = pieces(B, d, HQ, n, D, limit)
    if (bs, rs) == (B, d):
        return attend(qf, kf, vf, scale)
    outs, lses = [], []
    for b in range(0, B, bs):
        row_o, row_l = [], []
        for r in range(0, d, rs):
            hq, hk = slice(r * HQ, (r + rs) * HQ), slice(r * H, (r + rs) * H)
            o, lse = attend(qf[b:b + bs, hq].contiguous(), kf[b:b + bs, hk], vf[b:b + bs, hk], scale)
            row_o.append(o)
            row_l.append(lse)
        outs.append(torch.cat(row_o, 1))
        lses.append(torch.cat(row_l, 1))
    return torch.cat(outs, 0), torch.cat(lses, 0)


def cudnn_attention(qf, kf, vf, scale: float):
    """(out, natural-log lse) of causal attention ``[B,Hq,n,D]`` x ``[B,H,n,D]`` by PyTorch's cuDNN op."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(qf, kf, vf, None, True, 0.0, True, False, scale=scale)
    return out[0], out[1]


def attention(q, k_cmp, v_cmp, config, scale: float, attend=cudnn_attention, limit: int = MAX_ELEMS):
    """Eq. 5's compressed attention from the sequence's start: (o ``[B,T,HQ,Dv]``, lse ``[B,HQ,T]`` float32
    base 2, +inf where a row sees no key; the lse carries no gradient)."""
    B, T, HQ, _ = q.shape
    N, Dv = k_cmp.shape[1], v_cmp.shape[3]
    l, d = config.l, config.d
    n = n_rows(T, l, d)               # whole row blocks: cuDNN
    t0 = l - 1 + n * d                # rows t0..T-1 (fewer than d): they see keys 0..n, tail_attention
    n_need = -(-max(0, T - l + 1) // d)
    if N < n_need:
        raise ValueError(f"backend cudnn: {N} compressed keys for {T} queries; the fold needs ceil((T - l + 1) / d)"
                         f" = {n_need} (a compression of the same tokens)")
    q = q.contiguous()
    parts = [q.new_zeros(B, min(T, l - 1), HQ, Dv)]  # t < l - 1: no compressed key is visible
    lse = torch.full((B, HQ, T), float("inf"), device=q.device, dtype=torch.float32)
    if n:
        of, lse_f = attend_in_pieces(fold_queries(q, l, d), fold_keys(k_cmp, n, d), fold_keys(v_cmp, n, d), scale,
                                     attend, d, max(q.shape[3], Dv), limit)
        parts.append(unfold_rows(of, d))
        lse[:, :, l - 1:t0] = unfold_lse(lse_f.detach(), d)
    if t0 < T and n_need:
        o_t, lse_t = tail_attention(q[:, t0:], k_cmp[:, :n_need], v_cmp[:, :n_need], scale)
        parts.append(o_t)
        lse[:, :, t0:] = lse_t.detach()
    return (torch.cat(parts, 1) if len(parts) > 1 else parts[0]), lse


def compressed_branch(q, k_cmp, v_cmp, config, *, scale=None, q_start: int = 0, n_keys=None, on_scored=None,
                      attend=cudnn_attention):
    """``(o_cmp [B,T,HQ,Dv], indices [B,T,H,n_sel])``, as ``nsa.reference.compressed_branch`` for q_start = 0.
    ``attend(qf, kf, vf, scale) -> (out, lse)``: the folded causal attention (cuDNN; tests pass another)."""
    from .triton import tuning
    from .triton.compressed import compressed_forward, compressed_scores_op
    from .triton.utils import Blocks, default_scale

    if q_start != 0:
        raise ValueError(f"backend cudnn: q_start={q_start}: the compressed branch runs from the sequence's start "
                         "only (q_start=0); backend.cmp=triton runs chunked prefill and context parallelism")
    scale = float(default_scale(q, scale))
    o, lse = attention(q, k_cmp, v_cmp, config, scale, attend)
    nb = config.n_blocks(q.shape[1] if n_keys is None else n_keys)
    tune = tuning.params("compressed", q.device)
    q, k_cmp, v_cmp = (x.detach().contiguous() for x in (q, k_cmp, v_cmp))
    with torch.no_grad():
        if on_scored is None:  # one custom op (nsa::compressed_scores): torch.compile traces it as one node
            idx = compressed_scores_op(q, k_cmp, v_cmp, lse, list(Blocks.of(config)), scale, int(nb),
                                       tuning.to_ints("compressed", tune))
        else:  # the stream hook between the scores and the top-n: eager
            idx = compressed_forward(q, k_cmp, v_cmp, config, scale=scale, q_start=0, n_blocks=nb, on_scored=on_scored,
                           tune=tune, lse_in=lse)[2]
    return o, idx


class CudnnBackend(Backend):
    name = "cudnn"

    def unavailable(self, branch, device, dtype):
        """The compressed branch only, on a CUDA device in float16/bfloat16 with cuDNN 9+ and a triton
        that runs the block scores and top-n. Arguments and Returns: as :meth:`nsa.dispatch.Backend.unavailable`.
        """
        if branch != "cmp":
            return CMP_ONLY.format(branch=branch)
        if device.type != "cuda":
            return f"needs a CUDA device (cuDNN attention), got {device.type}"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"dtype {dtype} unsupported (cuDNN attention: float16, bfloat16)"
        if not torch.backends.cudnn.is_available():
            return "this PyTorch has no cuDNN"
        if (torch.backends.cudnn.version() or 0) < 90000:
            return f"cuDNN {torch.backends.cudnn.version()} has no fused attention for these shapes (needs >= 9.0)"
        from .triton import triton_unsupported

        return triton_unsupported()  # the block scores and top-n are triton kernels

    def varlen_unavailable(self, branch, device, dtype):
        """Always a reason: packed documents run on ``backend.cmp=triton``.
        Arguments and Returns: as :meth:`nsa.dispatch.Backend.varlen_unavailable`."""
        return "cudnn: packed documents (cu_seqlens) run on backend.cmp=triton"

    def compressed(self, q, k_cmp, v_cmp, config, *, scale, q_start, n_keys, on_scored=None, varlen=None):
        """cuDNN's fused attention for o_cmp and its log-sum-exp, triton's kernels for the block scores and
        the top-n (:func:`compressed_branch`); q_start = 0 only.
        Arguments and Returns: as :meth:`nsa.dispatch.Backend.compressed`.
        """
        return compressed_branch(q, k_cmp, v_cmp, config, scale=scale, q_start=q_start, n_keys=n_keys,
                                 on_scored=on_scored)


BACKEND = CudnnBackend()
