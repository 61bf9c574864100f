"""Public functional API of NSA (``docs/nsa-spec.md``), with input checks and backend dispatch.

Layouts (batch-first): q ``[B,Tq,HQ,Dk]``; raw keys/values of a branch ``[B,S,H,Dk]`` /
``[B,S,H,Dv]``; compressed ``[B,Tc,H,*]`` with Tc = 0 if S < l else (S-l)//d + 1; gates
``[B,Tq,HQ,3]`` in the order (cmp, sel, win); output ``[B,Tq,HQ,Dv]``.

Prefill: Tq = S and ``q_start=0``. Decode / chunked prefill over a cache: the Tq queries sit at
absolute positions ``q_start .. q_start+Tq-1`` and S = q_start + Tq keys are given. Empty inputs
(B = 0 or Tq = 0) give empty outputs of the right shape on every backend, as
``torch.nn.functional.scaled_dot_product_attention`` does.

Packed documents (every function's ``cu_seqlens``; docs/nsa-spec.md, "Varlen"): B = 1 and the N tokens of
all documents along the token axis, ``cu_seqlens`` int32 ``[n_docs + 1]`` (0 first, N last,
non-decreasing; or a :class:`nsa.varlen.Varlen` made from one, which skips the check and keeps its
tables), compressed keys/values packed per document (``[1, sum_i n_cmp(L_i), H, D]``), block indices
counted from each document's start; q_start = 0. No branch attends across a document boundary.
"""
from __future__ import annotations

import functools
import math
from typing import Mapping

import torch

from . import dispatch, reference
from .config import NSAConfig
from .varlen import Varlen, as_varlen

__all__ = [
    "nsa_attention",
    "gated_branches",
    "compress",
    "compressed_attention",
    "selection_scores",
    "select_blocks",
    "selected_attention",
    "sliding_window_attention",
]


def _fail(msg: str):
    raise ValueError(msg)


def _check_4d(name, x):
    if not isinstance(x, torch.Tensor):
        _fail(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        _fail(f"{name}: expected 4 dims [B,T,heads,dim], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        _fail(f"{name}: expected a floating dtype, got {x.dtype}")


def _check_same(ref_name, ref, **named):
    for name, x in named.items():
        if x.dtype != ref.dtype:
            _fail(f"{name}: dtype {x.dtype} differs from {ref_name}'s {ref.dtype}")
        if x.device != ref.device:
            _fail(f"{name}: device {x.device} differs from {ref_name}'s {ref.device}")


def _check_q(q, config: NSAConfig):
    _check_4d("q", q)
    if q.shape[2] != config.n_heads or q.shape[3] != config.d_k:
        _fail(f"q: expected [B,T,{config.n_heads},{config.d_k}] (n_heads, d_k), got {tuple(q.shape)}")


def _check_kv(q, k, v, kname, vname, config: NSAConfig, T: int | None, q_start: int):
    _check_4d(kname, k)
    _check_4d(vname, v)
    B, Tq = q.shape[:2]
    want_t = "S" if T is None else str(T)
    for name, x, D, dname in ((kname, k, config.d_k, "d_k"), (vname, v, config.d_v, "d_v")):
        if x.shape[0] != B or x.shape[2] != config.n_kv_heads or x.shape[3] != D:
            _fail(f"{name}: expected [{B},{want_t},{config.n_kv_heads},{D}] (B, n_kv_heads, {dname}), "
                  f"got {tuple(x.shape)}")
    if k.shape[1] != v.shape[1]:
        _fail(f"{vname}: length {v.shape[1]} differs from {kname}'s {k.shape[1]}")
    if T is not None and k.shape[1] != T:
        _fail(f"{kname}: expected {T} tokens, got {k.shape[1]}")
    if T is None and k.shape[1] < q_start + Tq:
        _fail(f"{kname}: {k.shape[1]} keys but queries reach position {q_start + Tq - 1} "
              f"(need S >= q_start + Tq = {q_start + Tq})")
    _check_same("q", q, **{kname: k, vname: v})


def _check_q_start(q_start):
    if isinstance(q_start, bool) or not isinstance(q_start, int) or q_start < 0:
        _fail(f"q_start={q_start!r}: must be a non-negative integer")


def _packed(cu_seqlens, name, x, q_start: int = 0) -> Varlen | None:
    """The documents of ``cu_seqlens`` (None without), checked against ``x [1, N, ...]``."""
    if cu_seqlens is None:
        return None
    docs = as_varlen(cu_seqlens)
    if x.shape[0] != 1:
        _fail(f"{name}: expected batch 1 with cu_seqlens (documents packed along the token axis), "
              f"got shape {tuple(x.shape)}")
    if q_start != 0:
        _fail(f"q_start={q_start}: must be 0 with cu_seqlens (every packed document starts at position 0)")
    docs.check_total(x.shape[1], name)
    return docs


def _n_cmp(config: NSAConfig, S: int, docs: Varlen | None) -> int:
    return config.n_cmp(S) if docs is None else sum(docs.cmp_counts(config))


def _check_packed_cmp(name, k_cmp, config, docs):
    if docs is not None and k_cmp.shape[1] != _n_cmp(config, 0, docs):
        _fail(f"{name}: expected {_n_cmp(config, 0, docs)} compressed tokens (n_cmp of each document of "
              f"cu_seqlens, packed in document order), got shape {tuple(k_cmp.shape)}")


def _scale(q, scale):
    if scale is None:
        return 1.0 / math.sqrt(q.shape[-1])
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < float(scale) < math.inf:
        _fail(f"scale={scale!r}: must be a positive finite number (None: 1/sqrt(Dk))")
    return float(scale)


def compress(x: torch.Tensor, config: NSAConfig, phi=None, *, cu_seqlens=None) -> torch.Tensor:
    """Compression (paper Eq. 7): every block of l tokens at stride d becomes one compressed token.

    Arguments:
        x: (B, T, H, D) raw keys or values of the compressed branch.
        config: the layer's :class:`NSAConfig` (l, d).
        phi: callable (B, Tc, H, l, D) -> (B, Tc, H, D), e.g. ``PhiMLP``; None: mean pooling.
        cu_seqlens: packed documents, int32 (n_docs + 1,) or a ``Varlen``: x is (1, N, H, D) and each
            document is compressed alone.
    Returns:
        x_cmp: (B, Tc, H, D), Tc = 0 if T < l else (T - l) // d + 1; packed: (1, sum_i n_cmp(L_i), H, D) in
            document order.
    """
    _check_4d("x", x)
    return reference.compress(x, config, phi, _packed(cu_seqlens, "x", x))


def compressed_attention(q, k_cmp, v_cmp, config: NSAConfig, *, scale=None, q_start: int = 0, cu_seqlens=None):
    """Compressed branch (spec step 1, paper Eq. 5 over Eq. 7's tokens): compressed token i is visible to
    the query at position t iff i*d + l - 1 <= t.

    Arguments:
        q: (B, Tq, HQ, Dk), queries at positions q_start .. q_start + Tq - 1.
        k_cmp: (B, Tc, H, Dk) compressed keys (:func:`compress`); HQ a multiple of H.
        v_cmp: (B, Tc, H, Dv) compressed values.
        config: the layer's :class:`NSAConfig`.
        scale: softmax scale; None: 1 / sqrt(Dk).
        q_start: absolute position of the first query (decode, chunked prefill).
        cu_seqlens: packed documents (module docstring); B = 1, q_start = 0.
    Returns:
        o_cmp: (B, Tq, HQ, Dv).
        p_cmp: (B, Tq, HQ, Tc) attention probabilities; packed: the columns are all packed compressed
            tokens, zero outside the row's document.
    """
    _check_q(q, config)
    _check_q_start(q_start)
    docs = _packed(cu_seqlens, "q", q, q_start)
    _check_4d("k_cmp", k_cmp)
    _check_packed_cmp("k_cmp", k_cmp, config, docs)
    _check_kv(q, k_cmp, v_cmp, "k_cmp", "v_cmp", config, k_cmp.shape[1], 0)
    return reference.compressed_attention(q, k_cmp, v_cmp, config, scale=_scale(q, scale), q_start=q_start,
                                          varlen=docs)


def selection_scores(p_cmp, config: NSAConfig, n_blocks: int, *, cu_seqlens=None):
    """Selection scores (Eq. 9 block-aligned, Eq. 10 summed over the G query heads of a group).

    Arguments:
        p_cmp: (B, Tq, HQ, Tc) compressed probabilities (:func:`compressed_attention`).
        config: the layer's :class:`NSAConfig`.
        n_blocks: selection blocks to score, ceil(S / l_sel) for S keys.
        cu_seqlens: packed documents; blocks counted from each document's start.
    Returns:
        scores: (B, Tq, H, n_blocks).
    """
    _check_4d("p_cmp", p_cmp)
    if p_cmp.shape[2] != config.n_heads:
        _fail(f"p_cmp: expected {config.n_heads} heads (n_heads), got shape {tuple(p_cmp.shape)}")
    docs = _packed(cu_seqlens, "p_cmp", p_cmp)
    if docs is not None and p_cmp.shape[3] != _n_cmp(config, 0, docs):
        _fail(f"p_cmp: expected {_n_cmp(config, 0, docs)} columns (the packed compressed tokens of "
              f"cu_seqlens' documents), got shape {tuple(p_cmp.shape)}")
    return reference.selection_scores(p_cmp, config, n_blocks, varlen=docs)


def select_blocks(scores, config: NSAConfig, *, q_start: int = 0, cu_seqlens=None):
    """Top-n with forcing (Eqs. 11-12): the initial and local blocks are always taken, ties go to the
    lower index.

    Arguments:
        scores: (B, Tq, H, nb) selection scores (:func:`selection_scores`).
        config: the layer's :class:`NSAConfig`.
        q_start: absolute position of the first query.
        cu_seqlens: packed documents; positions and blocks counted from each document's start.
    Returns:
        indices: (B, Tq, H, k) int64 block numbers, ascending, -1 padded; k = ``config.sel_count(nb)``
            (n_sel, bounded by the nb blocks).
    """
    _check_4d("scores", scores)
    _check_q_start(q_start)
    if scores.shape[2] != config.n_kv_heads:
        _fail(f"scores: expected {config.n_kv_heads} groups (n_kv_heads), got shape {tuple(scores.shape)}")
    docs = _packed(cu_seqlens, "scores", scores, q_start)
    if docs is not None and scores.shape[3] < docs.n_blocks(config):
        _fail(f"scores: {scores.shape[3]} blocks but the longest document of cu_seqlens ({docs.max_len} tokens) "
              f"needs {docs.n_blocks(config)} (ceil(L / l_sel))")
    config = config.bounded(scores.shape[3] * config.l_sel)  # n_sel beyond the candidate blocks selects them all
    need = config.n_blocks(q_start + scores.shape[1])
    if docs is None and scores.shape[3] < need:
        _fail(f"scores: {scores.shape[3]} blocks but queries up to position {q_start + scores.shape[1] - 1} "
              f"need {need} (ceil(S / l_sel))")
    return reference.select_blocks(scores, config, q_start=q_start, varlen=docs)


def _check_indices(q, indices, config, name="indices"):
    if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int32, torch.int64):
        _fail(f"{name}: expected an int32/int64 tensor [B,Tq,H,n_sel]")
    want = (q.shape[0], q.shape[1], config.n_kv_heads)
    if indices.dim() != 4 or tuple(indices.shape[:3]) != want or not 1 <= indices.shape[3] <= config.n_sel:
        _fail(f"{name}: expected shape [{', '.join(map(str, want))}, k] [B,Tq,H,k] with 1 <= k <= n_sel="
              f"{config.n_sel}, got {tuple(indices.shape)}")
    if indices.device != q.device:
        _fail(f"{name}: device {indices.device} differs from q's {q.device}")


def _check_index_range(indices, config: NSAConfig, S: int, docs: Varlen | None = None, name: str = "indices"):
    """Block indices lie in [0, ceil(S / l_sel)) (packed: ceil(L / l_sel) of the row's document) or are -1
    (none); the kernels do not check them. One reduction and one host sync per call: checked in eager only
    (torch.compile cannot trace the sync; a compiled call is not checked)."""
    if indices.numel() == 0 or torch.compiler.is_compiling():
        return
    if docs is not None:
        dev = indices.device
        doc = docs.row_doc(dev).to(torch.int64)
        nb = -(-torch.tensor(docs.lens, device=dev)[doc] // config.l_sel)  # blocks of each token's document
        bad = ((indices < -1) | (indices >= nb[None, :, None, None])).flatten(2).any(-1)[0]
        if bool(bad.any()):
            r = int(bad.nonzero()[0, 0])
            k = int(doc[r])
            _fail(f"{name}: a block index of token {r} is out of range: its document {k} has {docs.lens[k]} "
                  f"tokens, valid block indices are 0..{int(nb[r]) - 1} (ceil(L / l_sel)), and -1 for none")
        return
    lo, hi = (int(x) for x in torch.aminmax(indices))
    nb = config.n_blocks(S)
    if lo < -1 or hi >= nb:
        bad = lo if lo < -1 else hi
        valid = f"0..{nb - 1} (ceil(S / l_sel) = {nb} blocks of S={S} keys)" if nb else f"none (S={S} keys)"
        _fail(f"{name}: block index {bad} out of range; valid block indices are {valid}, and -1 for none")


def check_block_indices(indices, config: NSAConfig, S: int, *, name: str = "block_indices") -> None:
    """The range check of :func:`nsa_attention`'s ``block_indices`` (and :func:`selected_attention`'s ``indices``),
    once: a caller that passes the same indices to many calls checks them here and passes ``check_indices=False``.

    Arguments:
        indices: (B, Tq, H, k) block numbers of a sequence of ``S`` keys, -1 for none.
        config: the layer's :class:`NSAConfig` (l_sel).
        S: the number of keys.
        name: the argument's name in the error.
    Returns:
        None; raises ValueError (one line naming ``name``) where an index lies outside [0, ceil(S / l_sel)) and
        is not -1."""
    _check_index_range(indices, config, S, None, name)


def selected_attention(q, k_sel, v_sel, indices, config: NSAConfig, *, scale=None, q_start: int = 0,
                       backend: str = "reference", cu_seqlens=None, check_indices: bool = True):
    """Selected branch (spec step 5): attention over the tokens u <= t of the selected blocks.

    Arguments:
        q: (B, Tq, HQ, Dk), queries at positions q_start .. q_start + Tq - 1.
        k_sel: (B, S, H, Dk) raw keys of the selected branch, S = q_start + Tq.
        v_sel: (B, S, H, Dv).
        indices: (B, Tq, H, k) int32/int64, k <= n_sel: block numbers in [0, ceil(S / l_sel)), -1 for none
            (checked: a ValueError names a value out of range); packed: counted from the row's document start.
        config: the layer's :class:`NSAConfig`.
        scale: softmax scale; None: 1 / sqrt(Dk).
        q_start: absolute position of the first query.
        backend: the backend's name (``nsa.dispatch``).
        cu_seqlens: packed documents (module docstring).
        check_indices: check the range of ``indices`` (one reduction and one host sync a call, which on a GPU
            holds the host back until the device is idle); False where the caller checked the same indices
            once (:func:`check_block_indices`), e.g. a benchmark's timing loop.
    Returns:
        o_sel: (B, Tq, HQ, Dv).
    """
    _check_q(q, config)
    _check_q_start(q_start)
    docs = _packed(cu_seqlens, "q", q, q_start)
    _check_kv(q, k_sel, v_sel, "k_sel", "v_sel", config, None if docs is None else q.shape[1], q_start)
    _check_indices(q, indices, config)
    if check_indices:
        _check_index_range(indices, config, k_sel.shape[1], docs)
    be = dispatch.choose("sel", backend, q.device, q.dtype, None, varlen=docs is not None)
    return be.selected(q, k_sel, v_sel, indices, config, scale=_scale(q, scale), q_start=q_start, varlen=docs)


def sliding_window_attention(q, k_win, v_win, config: NSAConfig, *, scale=None, q_start: int = 0,
                             backend: str = "reference", cu_seqlens=None):
    """Sliding branch (spec step 6): attention over the keys u in [max(0, t-w+1), t].

    Arguments:
        q: (B, Tq, HQ, Dk), queries at positions q_start .. q_start + Tq - 1.
        k_win: (B, S, H, Dk) raw keys of the sliding branch, S = q_start + Tq.
        v_win: (B, S, H, Dv).
        config: the layer's :class:`NSAConfig` (w).
        scale: softmax scale; None: 1 / sqrt(Dk).
        q_start: absolute position of the first query.
        backend: the backend's name (``nsa.dispatch``).
        cu_seqlens: packed documents (module docstring); u and t in the row's document.
    Returns:
        o_win: (B, Tq, HQ, Dv).
    """
    _check_q(q, config)
    _check_q_start(q_start)
    docs = _packed(cu_seqlens, "q", q, q_start)
    _check_kv(q, k_win, v_win, "k_win", "v_win", config, None if docs is None else q.shape[1], q_start)
    be = dispatch.choose("win", backend, q.device, q.dtype, None, varlen=docs is not None)
    return be.window(q, k_win, v_win, config, scale=_scale(q, scale), q_start=q_start, varlen=docs)


# Queries (B * Tq) from which ``streams=True`` runs the sliding branch on a second CUDA stream; smaller
# calls (decode steps) stay on one stream: their kernels are too short to overlap.
STREAM_MIN_QUERIES = 1024
_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device):
    s = _SIDE_STREAMS.get(device)
    if s is None:
        s = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return s


def nsa_attention(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, config: NSAConfig, *, scale=None,
                  backend: str | Mapping[str, str] = "reference", return_indices: bool = False,
                  q_start: int = 0, fallback: str | None = None, streams: bool = True, cu_seqlens=None,
                  block_indices=None, check_indices: bool = True):
    """NSA attention output (paper Eq. 5 summed over branches with gates, spec step 7).

    o = g_cmp * o_cmp + g_sel * o_sel + g_win * o_win, with o_cmp over compressed keys k_cmp/v_cmp
    (``[B,Tc,H,*]``), o_sel over the top-n blocks chosen from the compressed probabilities
    (Eqs. 8-12) and o_win over the last w tokens. ``backend`` is a name or ``{branch: name}``;
    ``fallback`` names the backend to use where the chosen one cannot run (warned and recorded),
    None to raise instead. ``streams``: on CUDA (from ``STREAM_MIN_QUERIES`` queries), the sliding
    branch runs on a second stream, beside the top-n and the selected branch (it depends on neither),
    from when the compressed attention and scoring kernel is done; its backward then runs on that
    stream too. The result is the same either way. Without a gradient (prefill, inference), the
    selected branch's backend may compute the gated sum in its own epilogue (the triton backend does:
    o_sel is then summed in float32 before rounding, so bf16 outputs differ from the path with a
    gradient by rounding only).

    Arguments:
        q: (B, Tq, HQ, Dk), queries at positions q_start .. q_start + Tq - 1; HQ a multiple of H.
        k_cmp: (B, Tc, H, Dk) compressed keys (:func:`compress`), Tc = n_cmp(S).
        v_cmp: (B, Tc, H, Dv) compressed values.
        k_sel: (B, S, H, Dk) raw keys of the selected branch, S = q_start + Tq.
        v_sel: (B, S, H, Dv).
        k_win: (B, S, H, Dk) raw keys of the sliding branch.
        v_win: (B, S, H, Dv).
        gates: (B, Tq, HQ, 3) per-query gates in the order (cmp, sel, win).
        config: the layer's :class:`NSAConfig`.
        scale: softmax scale; None: 1 / sqrt(Dk).
        backend: a backend name, or ``{"cmp": .., "sel": .., "win": ..}``.
        return_indices: also return the selected blocks.
        q_start: absolute position of the first query (decode, chunked prefill).
        fallback: the backend to use where the chosen one cannot run (warned and recorded); None: raise.
        streams: run the sliding branch on a second CUDA stream (above).
        cu_seqlens: packed documents (module docstring), prefill only: B = 1, q_start = 0.
        block_indices: None (the paper's selection: the top-n of the compressed scores, Eqs. 8-12), or
            (B, Tq, H, k) int32/int64 blocks the selected branch reads instead (spec step 5 over these blocks;
            fla's ``parallel_nsa(block_indices=...)``), in :func:`select_blocks`' layout: k <= n_sel, block
            numbers in [0, ceil(S / l_sel)) (packed: of the row's document), -1 for none; checked as
            :func:`selected_attention` checks its ``indices``. The compressed branch still runs as it does
            (its output and gradient are the same); only the blocks the selected branch reads change. For
            ablations (``experiments.lm.ablations``): every backend takes them, through the path
            ``experiments.parity`` runs the backends on the reference's indices with.
        check_indices: check the range of ``block_indices`` as :func:`selected_attention` does (one host sync a
            call); False where the caller checked the same indices once (:func:`check_block_indices`).
    Returns:
        o: (B, Tq, HQ, Dv).
        indices: (B, Tq, H, k), only with ``return_indices``: the selected blocks, ascending, -1 padded;
            k = ``config.sel_count(ceil(S / l_sel))`` (n_sel bounded by the blocks of the S keys, packed: of
            the longest document; a larger n_sel selects every block, at the cost of the blocks that exist).
            With ``block_indices``: those (the blocks the selected branch read).

    ``torch.compile(fullgraph=True)`` traces this function (reference and triton backends, forward and backward;
    not with ``cu_seqlens``): the shape checks run when it is traced, the branches on one stream, and
    ``dispatch.record()`` notes the backends when the call is traced, not each time its graph runs.
    """
    _check_q(q, config)
    _check_q_start(q_start)
    plan = dispatch.resolve(backend)
    docs = _packed(cu_seqlens, "q", q, q_start)
    _check_kv(q, k_sel, v_sel, "k_sel", "v_sel", config, None if docs is None else q.shape[1], q_start)
    S = k_sel.shape[1]
    _check_kv(q, k_win, v_win, "k_win", "v_win", config, S, q_start)
    _check_4d("k_cmp", k_cmp)
    _check_packed_cmp("k_cmp", k_cmp, config, docs)
    _check_kv(q, k_cmp, v_cmp, "k_cmp", "v_cmp", config, _n_cmp(config, S, docs), q_start)
    _check_4d("gates", gates)
    if tuple(gates.shape) != (*q.shape[:3], 3):
        _fail(f"gates: expected shape {[*q.shape[:3], 3]} [B,Tq,HQ,3], got {tuple(gates.shape)}")
    _check_same("q", q, gates=gates)
    if block_indices is not None:
        _check_indices(q, block_indices, config, "block_indices")
        if check_indices:
            _check_index_range(block_indices, config, S, docs, "block_indices")
    sc = _scale(q, scale)
    # n_sel beyond the blocks of S keys (packed: of the longest document) selects them all: work sized by them
    config = config.bounded(S if docs is None else docs.max_len)
    dev, dt = q.device, q.dtype
    dispatch.count_call()

    backends = dispatch.choose_plan(plan, dev, dt, fallback, varlen=docs is not None)
    o, idx = gated_branches(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, config, backends, scale=sc,
                            q_start=q_start, streams=streams, indices=block_indices, varlen=docs)
    return (o, idx if block_indices is None else block_indices) if return_indices else o


def gated_branches(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, config: NSAConfig, backends, *, scale,
                   q_start=0, streams=True, indices=None, fuse_gate=None, varlen=None):
    """The body of :func:`nsa_attention` on checked inputs and chosen backends ``{branch: Backend}``:
    returns ``(o, indices of the compressed top-n)``. ``indices`` (optional) replaces the top-n's for
    the selected branch: ``experiments.parity`` runs the backends under test on the reference's
    indices, so that a near-tie does not move the outputs it compares.

    ``streams`` (CUDA, from STREAM_MIN_QUERIES queries): the sliding branch runs on a second stream,
    started when the compressed attention and scoring kernel is done (``on_scored``), so that it runs
    beside the top-n and the selected branch instead of taking SMs from the compressed kernel.
    ``fuse_gate``: the selected branch's backend computes Eq. 5 itself (``selected_gated``, forward
    only); None: when no gradient is needed. ``varlen``: the packed documents (a :class:`nsa.varlen.Varlen`).

    Arguments:
        q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, config: as :func:`nsa_attention`'s, checked.
        backends: ``{"cmp", "sel", "win"}`` -> the chosen ``nsa.dispatch`` Backend of each branch.
        scale: the softmax scale (a float).
        indices: None, or (B, Tq, H, k) blocks the selected branch reads instead of the top-n's.
    Returns:
        o: (B, Tq, HQ, Dv).
        indices: (B, Tq, H, k), the compressed branch's top-n.
    """
    S = k_sel.shape[1]
    dev = q.device
    be_cmp, be_sel, be_win = backends["cmp"], backends["sel"], backends["win"]
    grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates))
    fuse = (not grad) if fuse_gate is None else bool(fuse_gate)
    if fuse and grad:
        raise ValueError("gated_branches: fuse_gate=True needs a forward without gradients")
    side = hook = None
    # torch.compile: one stream (the graph orders the kernels; the event hook fits no op schema)
    if streams and dev.type == "cuda" and q.shape[0] * q.shape[1] >= STREAM_MIN_QUERIES \
            and not torch.compiler.is_compiling():
        main, side = torch.cuda.current_stream(dev), _side_stream(dev)
        scored = torch.cuda.Event()
        hook = functools.partial(scored.record, main)  # every backend calls on_scored (Backend.compressed)
    o_cmp, idx = be_cmp.compressed(q, k_cmp, v_cmp, config, scale=scale, q_start=q_start, n_keys=S, on_scored=hook,
                                   varlen=varlen)
    if side is not None:
        side.wait_event(scored)  # q, k_win, v_win and the compressed kernel are done
        with torch.cuda.stream(side):
            o_win = be_win.window(q, k_win, v_win, config, scale=scale, q_start=q_start, varlen=varlen)
    sel_idx = idx if indices is None else indices
    if not fuse:
        o_sel = be_sel.selected(q, k_sel, v_sel, sel_idx, config, scale=scale, q_start=q_start, varlen=varlen)
    if side is None:
        o_win = be_win.window(q, k_win, v_win, config, scale=scale, q_start=q_start, varlen=varlen)
    else:
        main.wait_stream(side)
        o_win.record_stream(main)  # allocated on the side stream, read on this one
    if not fuse:
        return be_sel.combine(o_cmp, o_sel, o_win, gates), idx
    return be_sel.selected_gated(q, k_sel, v_sel, sel_idx, config, o_cmp, o_win, gates, scale=scale,
                                 q_start=q_start, varlen=varlen), idx
