"""op=compressed: compressed attention (Eqs. 7-8) with the fused Eq. 9 block scores and the Eq. 10-12
top-n, ``nsa.backends.triton.compressed.compressed_branch``.

Inputs: q ``[B,T,HQ,Dk]`` and compressed keys ``[B,Tc,H,Dk]`` (normal, std 2: peaked probabilities, so
the top-n is decided by clear margins), values ``[B,Tc,H,Dv]``, Tc = n_cmp(T). Row ``triton``: the
output and the indices, forward and forward+backward. Row ``cudnn``: the same on the ``cudnn`` backend
(cuDNN attention over the folded queries, then the triton score-only pass; ``nsa/backends/cudnn.py``),
checked and held like ``triton``; skipped with its backend's reason where it cannot run (no CUDA, float32).
Peer row ``flex`` (``kernels.peers``, CUDA): the same
output on FlexAttention with a mask over the visible compressed tokens (no scores, no top-n, so it
does less). FLOPs: 2 (Dk + Dv) per query head and visible compressed token (the kernel's two passes
and the Eq. 9 product are not counted).
"""
from __future__ import annotations

import torch

from nsa import dispatch, reference
from nsa.backends.triton.compressed import compressed_branch
from nsa.backends.triton.utils import poisoned_outputs

from .bench import Bench, backward_of, leaves


def inputs(b: Bench, T: int):
    c = b.c
    Tc = c.n_cmp(T)
    return (b.randn(b.B, T, c.n_heads, c.d_k, std=2.0), b.randn(b.B, Tc, c.n_kv_heads, c.d_k, std=2.0),
            b.randn(b.B, Tc, c.n_kv_heads, c.d_v), b.randn(b.B, T, c.n_heads, c.d_v))


def designs(b: Bench) -> dict:
    """``triton`` and, where its backend can run here, ``cudnn`` (else skipped with the reason)."""
    out = {"triton": lambda q, k, v: compressed_branch(q, k, v, b.c)}
    why = dispatch.get("cudnn").unavailable("cmp", b.dev, b.dt)
    if why:
        b.skip("cudnn", why)
    else:
        from nsa.backends.cudnn import compressed_branch as cudnn_branch

        out["cudnn"] = lambda q, k, v: cudnn_branch(q, k, v, b.c)
    return out


def check(b: Bench) -> None:
    q, k, v, do = inputs(b, b.check_seq)
    xr = b.upcast(q, k, v, grad=True)
    o_r, idx_r = reference.compressed_branch(*xr, b.c)
    o_r.backward(do.to(b.ref_dtype))
    for name, fn in designs(b).items():
        xs = leaves(q, k, v)
        with poisoned_outputs():
            o, idx = fn(*xs)
            o.backward(do)
        prefix = "" if name == "triton" else f"{name}_"
        b.compare(f"{prefix}o", o, o_r)
        b.compare_indices(f"{prefix}indices", idx, idx_r)
        b.compare_grads(prefix, ("dq", "dk", "dv"), xs, xr)


def flex_unavailable(b: Bench) -> str | None:
    if b.dev.type != "cuda":
        return "FlexAttention (compiled) is timed on CUDA only"
    try:
        from torch.nn.attention.flex_attention import create_block_mask  # noqa: F401
    except ImportError as e:
        return f"FlexAttention is not in this PyTorch ({torch.__version__}): {e}"
    return None


def flex(b: Bench, T: int):
    """o_cmp on FlexAttention: query t sees compressed token j when its block ends at or before t."""
    from torch.nn.attention.flex_attention import create_block_mask

    from nsa.backends.sdpa import compiled_flex_attention

    c = b.c
    bm = create_block_mask(lambda _b, _h, qi, ki: ki * c.d + c.l - 1 <= qi, None, None, T, c.n_cmp(T), device=b.dev)
    run = compiled_flex_attention()
    return lambda q, k, v: run(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm,
                               enable_gqa=True).transpose(1, 2)


def timed(b: Bench) -> None:
    c = b.c
    q, k, v, do = inputs(b, b.T)
    t = torch.arange(b.T, dtype=torch.float64)
    visible = float(torch.where(t + 1 >= c.l, (t + 1 - c.l) // c.d + 1, 0).sum())  # per sequence and group
    flop = 2.0 * (c.d_k + c.d_v) * c.G * c.n_kv_heads * b.B * visible
    variants = designs(b)
    if b.k.peers:
        why = flex_unavailable(b)
        if why:
            b.skip("flex", why)
        else:
            variants["flex"] = flex(b, b.T)
    for name, fn in variants.items():
        xs = leaves(q, k, v)
        b.row(name, lambda fn=fn: fn(q, k, v), backward_of(lambda fn=fn, xs=xs: fn(*xs), xs, do), flop=flop,
              computes="o only" if name == "flex" else "o, Eq. 9 scores, top-n")


def once(b: Bench) -> None:
    q, k, v, _ = inputs(b, b.T)
    with torch.no_grad():
        compressed_branch(q, k, v, b.c)
