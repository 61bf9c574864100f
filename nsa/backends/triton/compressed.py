"""Triton compressed branch (spec steps 1-4; paper Eqs. 5, 8-12), same contract as
``nsa.reference.compressed_branch``.

The forward kernel (``_cmp_kernels._fwd_kernel`` with SCORES) fuses compressed attention with the
Eq. 9/10 block scores, so no [H, T, Tc] probability tensor is ever formed; it writes a float32
``[B, chunk, H, nb]`` score buffer for a chunk of queries, which ``_cmp_ops.topn_launch`` turns into
the top-n indices (forcing, ties to the lower index) before the next chunk. Backward (dq, dk_cmp,
dv_cmp) is a flash-style Triton backward with the visibility mask i*d + l - 1 <= t.
"""

from __future__ import annotations

from ._cmp_ops import CompressedAttention, default_scale


def compressed_branch(q, k_cmp, v_cmp, config, *, scale=None, q_start: int = 0, n_keys=None, on_scored=None):
    """Returns ``(o_cmp [B,Tq,HQ,Dv], indices [B,Tq,H,n_sel] int64)``; see the module docstring.
    ``on_scored()`` (optional, no arguments, no autograd work) is called once the attention and scoring
    kernel is queued, before the top-n: ``nsa.functional`` records a CUDA event there."""
    scale = default_scale(q, scale)
    S = q_start + q.shape[1] if n_keys is None else n_keys
    return CompressedAttention.apply(q, k_cmp, v_cmp, config, scale, int(q_start), config.n_blocks(S), on_scored)
