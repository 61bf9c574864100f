"""The ``sdpa`` backend: PyTorch's own attention fast paths for the sliding-window branch.

* CUDA: FlexAttention (``torch.nn.attention.flex_attention``, compiled once with ``torch.compile``)
  with a sliding-window ``BlockMask`` (u in [t-w+1, t], spec step 6) built from block indices
  (``band_block_mask``: O(T/128 * w/128), where ``create_block_mask`` evaluates every pair), grouped
  heads via ``enable_gqa``. Block masks are cached per (Tq, S, w, q_start, device); the query offset
  is a captured tensor, so decode steps do not recompile the kernel. Past FLEX_RECOMPILE_LIMIT
  compilations a call raises instead of running FlexAttention eagerly.
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

from ..compat import block_mask_from_kv_blocks, no_eager_fallback, sdpa_gqa
from ..dispatch import Backend

_FLEX = None
_MASKS: dict = {}
_MAX_MASKS = 16


def compiled_flex_attention():
    """torch.compile'd ``flex_attention``, compiled on the first call and kept for the process.

    Returns:
        The compiled function (FlexAttention runs fused only compiled).
    """
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention)
    return _FLEX


FLEX_BLOCK = 128  # FlexAttention's block size (query and key)
# Compilations of FlexAttention one process may make (one per head layout, dtype, mask kind; lengths
# become dynamic after the first change). Past it, an error: dynamo's default would run FlexAttention
# eagerly, which materializes every score (the kernel tests' 8th shape asked an H200 for 64 GiB).
FLEX_RECOMPILE_LIMIT = 64


def band_block_mask(Tq: int, S: int, w: int, q_start: int, device, doc: torch.Tensor | None = None):
    """FlexAttention BlockMask of the sliding window (spec step 6: key u in [t-w+1, t] for the query at
    t = q_start + i), and with ``doc`` (the document of each packed token, q_start = 0, Tq = S) only
    inside the query's document, built from block indices in O(Tq/128 * w/128).

    ``create_block_mask`` evaluates the mask at every (query, key) pair: at T = 128k that is a
    17e9-element intermediate (it asked an H200 for 128 GiB). Here each query block lists the key
    blocks its rows can reach: ``full`` when every pair of the two blocks is inside the band (and one
    document), partial otherwise (``mask_mod`` then decides per element)."""
    BS = FLEX_BLOCK
    i64 = dict(device=device, dtype=torch.int64)
    nq, nk = -(-Tq // BS), -(-S // BS)
    qb = torch.arange(nq, **i64)
    t0 = q_start + qb * BS                               # first and last query position of each block
    t1 = q_start + torch.clamp((qb + 1) * BS, max=Tq) - 1
    lo = torch.clamp(t0 - w + 1, min=0)                  # the keys any row of the block can reach
    hi = torch.clamp(t1, max=S - 1)
    if doc is not None:
        doc = doc.to(device=device, dtype=torch.int64)
        lo = torch.maximum(lo, torch.searchsorted(doc, doc[t0]))  # the first query's document start
    blo = lo // BS
    count = hi // BS - blo + 1
    maxc = min(nk, (BS + w - 2) // BS + 2)
    blk = blo[:, None] + torch.arange(maxc, **i64)[None, :]
    valid = torch.arange(maxc, **i64)[None, :] < count[:, None]
    k0, k1 = blk * BS, torch.clamp(blk * BS + BS - 1, max=S - 1)
    full = valid & (k1 <= t0[:, None]) & (k0 >= t1[:, None] - w + 1) & (blk * BS + BS <= S)
    full &= ((t1 - t0) == BS - 1)[:, None]
    if doc is not None:
        dq0, dq1 = doc[t0], doc[t1]
        full &= (dq0 == dq1)[:, None] & (doc[k0.clamp(max=S - 1)] == dq0[:, None]) & (doc[k1] == dq0[:, None])
    part = valid & ~full

    def pack(sel):  # each row's chosen blocks first, ascending: [1, 1, nq, nk] int32 (the width is nk:
        # BlockMask reads the last dimension as the number of key blocks)
        order = torch.sort(torch.where(sel, blk, blk + nk + maxc), dim=1).indices
        idx = torch.zeros(nq, nk, **i64)
        idx[:, :maxc] = torch.gather(torch.where(sel, blk, 0), 1, order)
        return sel.sum(1).to(torch.int32)[None, None], idx.to(torch.int32)[None, None]

    qs = torch.tensor(q_start, **i64)
    if doc is None:
        def mask_mod(b, h, qi, ki):
            t = qi + qs
            return (ki <= t) & (ki > t - w)
    else:
        def mask_mod(b, h, qi, ki):
            return (doc[qi] == doc[ki]) & (ki <= qi) & (ki > qi - w)

    (n_part, i_part), (n_full, i_full) = pack(part), pack(full)
    return block_mask_from_kv_blocks(n_part, i_part, n_full, i_full, BLOCK_SIZE=BS, mask_mod=mask_mod,
                                     seq_lengths=(Tq, S))


def window_block_mask(Tq: int, S: int, w: int, q_start: int, device):
    """The sliding window's BlockMask for queries at q_start.. over S keys, cached per shape."""
    key = (Tq, S, w, q_start, str(device))
    bm = _MASKS.get(key)
    if bm is None:
        bm = band_block_mask(Tq, S, w, q_start, device)
        if len(_MASKS) >= _MAX_MASKS:
            _MASKS.pop(next(iter(_MASKS)))
        _MASKS[key] = bm
    return bm


def document_window_mask(varlen, w: int, device):
    """The sliding window inside each packed document (spec "Varlen"), kept with the documents."""
    return varlen.kept(("flex_window", w, str(device)),
                       lambda: band_block_mask(varlen.total, varlen.total, w, 0, device, varlen.row_doc(device)))


def flex_window(q, k, v, w: int, scale: float, q_start: int, varlen=None):
    """[B,Tq,HQ,Dk] x [B,S,H,*] -> [B,Tq,HQ,Dv] through compiled FlexAttention."""
    if varlen is None:
        bm = window_block_mask(q.shape[1], k.shape[1], w, q_start, q.device)
    else:
        bm = document_window_mask(varlen, w, q.device)
    with no_eager_fallback(FLEX_RECOMPILE_LIMIT):
        o = compiled_flex_attention()(
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
        """Returns: which kernel runs the window branch on each device, for the run's record."""
        return "sdpa:flex_attention (CUDA) / sdpa-band-mask (CPU)"

    def unavailable(self, branch, device, dtype):
        """The window branch only: FlexAttention on CUDA (not float64), SDPA with a band mask on the CPU.
        Arguments and Returns: as :meth:`nsa.dispatch.Backend.unavailable`.
        """
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
        """FlexAttention with a band block mask on CUDA (:func:`flex_window`), SDPA with a dense band
        mask on the CPU (:func:`sdpa_window`). Arguments and Returns: as :meth:`nsa.dispatch.Backend.window`.
        """
        S = q_start + q.shape[1]
        k, v = k_win[:, :S], v_win[:, :S]
        if q.device.type == "cuda":
            return flex_window(q, k, v, config.w, scale, q_start, varlen)
        return sdpa_window(q, k, v, config.w, scale, q_start, varlen)


BACKEND = SDPABackend()
