"""The ``sdpa`` backend: PyTorch's own attention fast paths for the sliding-window branch.

* CUDA: FlexAttention (``torch.nn.attention.flex_attention``, compiled once with ``torch.compile``)
  with a sliding-window ``BlockMask`` (u in [t-w+1, t], spec step 6), grouped heads via
  ``enable_gqa``. Block masks are cached per (Tq, S, w, q_start, device); the query offset is a
  captured tensor, so decode steps do not recompile the kernel.
* CPU: ``F.scaled_dot_product_attention`` with an explicit boolean band mask (O(Tq*S) memory; for
  tests and small shapes). FlexAttention is not used on CPU: torch raises for its backward there and
  its eager CPU forward is a debugging path.
* Packed documents (``varlen``): the same masks and a document mask (query and key in one document);
  FlexAttention's block mask is kept with the documents (``Varlen.kept``), one per window size.

The ``cmp`` and ``sel`` branches are reported unavailable (reasons in ``unavailable``); nothing falls
back inside this backend.
"""

from __future__ import annotations

import torch

from .._compat import sdpa_gqa
from ..dispatch import Backend

_FLEX = None
_MASKS: dict = {}
_MAX_MASKS = 16


def _flex_attention():
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention)
    return _FLEX


def window_block_mask(Tq: int, S: int, w: int, q_start: int, device):
    """FlexAttention BlockMask of the sliding window for queries at q_start.. over S keys."""
    key = (Tq, S, w, q_start, str(device))
    bm = _MASKS.get(key)
    if bm is None:
        from torch.nn.attention.flex_attention import create_block_mask

        qs = torch.tensor(q_start, device=device, dtype=torch.int64)

        def mask_mod(b, h, qi, ki):
            t = qi + qs
            return (ki <= t) & (ki > t - w)

        bm = create_block_mask(mask_mod, None, None, Tq, S, device=device)
        if len(_MASKS) >= _MAX_MASKS:
            _MASKS.pop(next(iter(_MASKS)))
        _MASKS[key] = bm
    return bm


def document_window_mask(varlen, w: int, device):
    """FlexAttention BlockMask of the sliding window inside each packed document (spec "Varlen")."""
    from torch.nn.attention.flex_attention import create_block_mask

    def make():
        doc = varlen.row_doc(device)

        def mask_mod(b, h, qi, ki):
            return (doc[qi] == doc[ki]) & (ki <= qi) & (ki > qi - w)

        return create_block_mask(mask_mod, None, None, varlen.total, varlen.total, device=device)

    return varlen.kept(("flex_window", w, str(device)), make)


def flex_window(q, k, v, w: int, scale: float, q_start: int, varlen=None):
    """[B,Tq,HQ,Dk] x [B,S,H,*] -> [B,Tq,HQ,Dv] through compiled FlexAttention."""
    if varlen is None:
        bm = window_block_mask(q.shape[1], k.shape[1], w, q_start, q.device)
    else:
        bm = document_window_mask(varlen, w, q.device)
    o = _flex_attention()(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        block_mask=bm,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return o.transpose(1, 2)


def sdpa_window(q, k, v, w: int, scale: float, q_start: int, varlen=None):
    """The same through SDPA with a boolean band mask (any device; O(Tq*S) mask)."""
    Tq, S = q.shape[1], k.shape[1]
    t = q_start + torch.arange(Tq, device=q.device)[:, None]
    u = torch.arange(S, device=q.device)[None, :]
    band = (u <= t) & (u > t - w)
    if varlen is not None:
        doc = varlen.row_doc(q.device)
        band = band & (doc[:, None] == doc[None, :])
    o = sdpa_gqa(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=band,
        scale=scale,
    )
    return o.transpose(1, 2)


class SDPABackend(Backend):
    name = "sdpa"

    @property
    def impl(self) -> str:
        return "sdpa:flex_attention (CUDA) / sdpa-band-mask (CPU)"

    def unavailable(self, branch, device, dtype):
        if branch == "cmp":
            return (
                "the compressed branch needs the Eq. 9 block scores from its own probabilities; "
                "FlexAttention returns only the output and log-sum-exp (not implemented here); "
                "use the 'triton' or 'reference' backend"
            )
        if branch == "sel":
            return (
                "the selected branch attends to per-query block sets (Eq. 12); a FlexAttention mask "
                "over a [B,H,T,n_blocks] membership is not implemented here; use 'triton' or 'reference'"
            )
        if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            return f"dtype {dtype} unsupported"
        if device.type == "cuda":
            try:
                from torch.nn.attention import flex_attention  # noqa: F401
            except ImportError as e:
                return f"FlexAttention is not in this PyTorch ({torch.__version__}): {e}"
            if dtype == torch.float64:
                return "FlexAttention on CUDA: float64 unsupported"
            return None
        if device.type == "cpu":
            return None
        return f"no {device.type} path (CUDA: FlexAttention; CPU: SDPA with a band mask)"

    def window(self, q, k_win, v_win, config, *, scale, q_start, varlen=None):
        S = q_start + q.shape[1]
        k, v = k_win[:, :S], v_win[:, :S]
        if q.device.type == "cuda":
            return flex_window(q, k, v, config.w, scale, q_start, varlen)
        return sdpa_window(q, k, v, config.w, scale, q_start, varlen)


BACKEND = SDPABackend()
