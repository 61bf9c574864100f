"""Launch parameters of every triton operation: one table per architecture key, overridable.

    from nsa.backends.triton import tuning
    tuning.params("compressed", q.device)         # {"rows": 64, "block_n": 64, ...}
    with tuning.overrides({"compressed": {"rows": 128}, "topn": {"warps": 4}}):
        y = layer(x)                              # every launch inside uses the overrides

The table is chosen by :func:`key`: ``"sm<major><minor>"`` where that architecture has its own
table, else ``"cuda"`` for a CUDA device, and ``"interpret"`` for CPU tensors under Triton's
interpreter (small tiles, so that tests at tiny shapes cross tile borders). The ``"cuda"`` table was
measured on an H200 (sm_90); BENCHMARKS.md ("Tuning choices") has the figures behind each value.

:func:`overrides` is the one way to change a value: a context manager, validated (an unknown op or
key, or a value of the wrong type, raises ValueError naming it), nested blocks merge, and leaving
the block restores what was there. It is process-wide (not per thread), so a backward that autograd
runs on its own thread sees the same values; the operations read their parameters when they are
called (the forward also fixes its backward's), so a backward outside the block still uses the
values of its forward.
"""
from __future__ import annotations

import contextlib
from typing import Any, Mapping

import torch

from .utils import capability

# Keys every tiled attention forward has.
_TILES: dict[str, tuple[Any, str]] = {
    "block_n": (int, "keys per tile"),
    "warps": (int, "warps per program"),
    "stages": (int, "software-pipelining stages"),
    "maxnreg": (int, "registers per thread (ptxas .maxnreg); None: no cap"),
}

# Tiles through TMA descriptors leave shared memory and registers for a third stage; pointer loads
# with 3 stages exceed the H100's shared memory at some shapes (packed documents at Dk=192).
_STAGES_BY_PATH = "software-pipelining stages; None: 3 through TMA descriptors, 2 with pointer loads"
STAGES_TMA, STAGES_POINTERS = 3, 2

# op -> key -> (type, or a tuple of allowed values; what it sets). A value of None in a table means
# "derived from the shape by the launcher" (the rule is in the op's module).
KEYS: dict[str, dict[str, tuple[Any, str]]] = {
    "compressed": {
        "rows": (int, "query rows per program (BLOCK_M x next_pow2(G)); at most 64 when Dk or Dv > 128"),
        **_TILES,
        "stages": (int, _STAGES_BY_PATH),
        "lse_n": (int, "compressed keys per tile of pass 1 (log-sum-exp only); a power of two"),
        "score_lo": (bool, "half inputs: add the fp16 remainder product to the Eq. 9 scores (exact top-n)"),
        "score_buffer_bytes": (int, "bytes of the [B, chunk, H, nb] float32 score buffer; more queries: chunks"),
        "tma": (bool, "load q, k, v through TMA descriptors (one sequence per batch row, G a power of two, "
                      "tiles without padding columns); None: on sm_90+ and under the interpreter"),
    },
    "window": {
        "rows": (int, "query rows per program; at most 64 when Dk or Dv > 128 (then 4 warps, no cap)"),
        **_TILES,
    },
    "attention_bwd": {
        "rows": (int, "query rows per program of the compressed and window backward"),
        **{k: _TILES[k] for k in ("block_n", "warps")},
        "stages": (int, _STAGES_BY_PATH),
        "programs": (int, "the dk/dv kernel splits each key tile's queries until about this many programs run"),
        "split_max": (int, "at most this many query shares per key tile (float32 partials, summed after)"),
        "tma": (bool, "load q, dO, k, v through TMA descriptors (one sequence per batch row, G a power of two); "
                      "None: on sm_90+ and under the interpreter"),
    },
    "topn": {
        "elems": (int, "score elements per top-n program (rows = elems // width)"),
        "warps": _TILES["warps"],
    },
    "selection": {
        "mode": (("auto", "query", "block"), "kernel family; auto: block-outer for G < 16 from 512 query rows, else query"),
        "warps": (int, "warps per query-outer program (forward; dq too unless dq_warps)"),
        "stages": (int, "stages of the query-outer kernels"),
        "block_s": (int, "keys per query-outer tile (a selection block is cut into l_sel / block_s)"),
        "rows": (int, "rows (queries x heads) per block-outer forward tile; None: 128 for G = 1, else 64"),
        "kv_warps": (int, "warps per block-outer forward program"),
        "kv_stages": (int, "stages of the block-outer forward; None: 2 for G = 1, else 3"),
        "chunk_rows": (int, "rows (queries x heads) per block-outer work item"),
        "bwd_rows": (int, "rows per block-outer backward tile; None: 64 for G >= 16 without dq partials, else 128"),
        "bwd_warps": (int, "warps per block-outer backward program; None: 4 for G >= 16 without dq partials, else 8"),
        "bwd_stages": (int, "stages of the block-outer backward; None: 3 for 16-bit inputs, 2 for 32-bit"),
        "dq_part": (bool, "dq per slot from the block-outer backward; None: when the partials fit"),
        "part_bytes_max": (int, "bytes of per-slot partials a row chunk of the block-outer kernels holds; "
                                "None: 8 GiB, at most 1/8 of the GPU's memory"),
        "tma": (bool, "the query-outer forward loads key/value tiles through TMA descriptors; "
                      "None: on sm_90+ and under the interpreter"),
        "dq_warps": (int, "warps per query-outer dq program; None: warps"),
        "dq_stages": (int, "stages of the query-outer dq kernel; None: stages"),
    },
    "gate": {
        "rows": (int, "(query, head) rows per program of the gated sum"),
        "warps": _TILES["warps"],
    },
    "decode": {
        "block_c": (int, "compressed tokens per tile of the split-KV compressed pass"),
        "nsc": (int, "splits of the compressed pass; None: fill the SMs about 4x, >= 4 tiles a split (mode three: "
                     "one tile a split, at most 8)"),
        "bw": (int, "window tokens per tile; None: the whole window in one tile"),
        "sel_per": (int, "selected blocks per split; None: 4 when B*H fills the SMs, else 1"),
        "sel_vec": (int, "selected blocks per tile; None: all of a split's"),
        "win_per": (int, "window tiles per split; None: 4 when B*H fills the SMs, else 1"),
        "warps": (int, "warps of the attention and combine kernels"),
        "topk_warps": (int, "warps of the combine + top-n kernel"),
        "pdl": (bool, "programmatic dependent launch between the step's kernels; None: where supported (sm_90+)"),
        "block_t": (int, "compressed tokens per step of the top-n's Eq. 10 sum"),
        "topn": (("auto", "argmax", "bitonic"), "the top-n of the block scores: n_sel dependent argmaxes, or a "
                                                 "bitonic top-k (tl.topk, triton >= 3.3); auto: bitonic where it "
                                                 "exists, but argmax from 1024 blocks at B*H >= 32"),
        "mode": (("auto", "four", "two", "three"),
                 "launches per step: four (compressed pass, top-n, selected + window, combine); two (the top-n and "
                 "the combine in the last program of their pass); three (the window beside the compressed pass, "
                 "the top-n in every selected-branch program, the combine); auto: on a GPU, three while "
                 "B*H*n_sel programs fit the SMs and the cache has at most 512 selection blocks, else four"),
        "sel_warps": (int, "warps of the selected-branch programs of mode three (they pick the top-n); None: warps"),
        "combine_split": (int, "programs per group of mode three's combine, each on a share of the value dims (a "
                               "power of two); None: about 2 programs an SM, at least 16 dims each"),
        "prologue": (("triton", "torch"),
                     "GraphDecoder's layer step between its input GEMM and the attention (RoPE, cache writes, phi, "
                     "gates): two Triton kernels (nsa/backends/triton/decode_prologue.py), or the torch ops of the reference "
                     "path"),
    },
}

# Every CUDA device until an architecture has its own table: the values measured fastest on an H200
# at 64k (BENCHMARKS.md, "Tuning choices"), except score_lo, which keeps the top-n exact.
_CUDA = {
    # 1 GiB of block scores holds T = 64k (H=4, l_sel=64) in one chunk: one forward launch
    "compressed": dict(rows=64, block_n=64, lse_n=128, warps=4, stages=None, maxnreg=None, score_lo=True,
                       score_buffer_bytes=1 << 30, tma=None),
    # the register cap lets two programs of 8 warps share an SM
    "window": dict(rows=128, block_n=64, warps=8, stages=2, maxnreg=128),
    # at 64k the compressed backward has only Tc/64 x H = 256 key tiles: split their queries
    "attention_bwd": dict(rows=128, block_n=64, warps=8, stages=None, programs=4096, split_max=32, tma=None),
    "topn": dict(elems=1024, warps=1),
    # query-outer forward: one warp a program, 5 % faster at 64k on an H100 (its dq: 4 warps, one is 13 % slower)
    "selection": dict(mode="auto", warps=1, stages=2, block_s=64, rows=None, kv_warps=4, kv_stages=None,
                      chunk_rows=2048, bwd_rows=None, bwd_warps=None, bwd_stages=None, dq_part=None,
                      part_bytes_max=None, tma=None, dq_warps=4, dq_stages=None),
    "gate": dict(rows=16, warps=4),
    "decode": dict(block_c=64, nsc=None, bw=64, sel_per=None, sel_vec=1, win_per=None, warps=4, topk_warps=8,
                   block_t=256, pdl=None, mode="auto", topn="auto", sel_warps=None, combine_split=None, prologue="triton"),
}

# The interpreter runs programs one after another: tests want small tiles (borders crossed at tiny
# shapes), the decode step few large programs.
_INTERPRET = {
    **_CUDA,
    "compressed": dict(_CUDA["compressed"], rows=16, block_n=16, lse_n=32, stages=1),
    "window": dict(rows=16, block_n=16, warps=4, stages=1, maxnreg=None),
    "attention_bwd": dict(rows=16, block_n=16, warps=4, stages=1, programs=8, split_max=4, tma=None),
    "topn": dict(elems=2048, warps=4),
    "decode": dict(block_c=16, nsc=None, bw=None, sel_per=None, sel_vec=None, win_per=None, warps=4, topk_warps=4,
                   block_t=16, pdl=False, mode="auto", topn="auto", sel_warps=None, combine_split=None, prologue="triton"),
}

TABLES: dict[str, dict[str, dict[str, Any]]] = {"cuda": _CUDA, "interpret": _INTERPRET}

_OVERRIDES: dict[str, dict[str, Any]] = {}  # changed only by overrides()


def key(device: torch.device) -> str:
    """The table for tensors on ``device``: "interpret" off CUDA, "sm<cc>" where TABLES has one, else "cuda"."""
    if device.type != "cuda":
        return "interpret"
    arch = "sm%d%d" % capability(device)
    return arch if arch in TABLES else "cuda"


def params(op: str, where: torch.device | str) -> dict[str, Any]:
    """The launch parameters of ``op`` for tensors on a device (a ``torch.device``) or for a table
    key (a str: "cuda", "interpret", ...), the active overrides applied. A new dict each call."""
    if op not in KEYS:
        raise ValueError(f"tuning: unknown op {op!r}; ops: {', '.join(KEYS)}")
    return {**TABLES[where if isinstance(where, str) else key(where)][op], **_OVERRIDES.get(op, {})}


def by_path(tune: dict[str, Any], tma: bool, itemsize: int = 2) -> dict[str, Any]:
    """``tune`` with ``stages`` resolved where it is None: ``STAGES_TMA`` when the kernel loads through TMA
    descriptors, else ``STAGES_POINTERS``; one stage fewer for 4-byte inputs (``itemsize``), whose tiles take
    twice the shared memory (float32 at Dk=64 and 128 query rows: 258 KiB at 3 stages, above the H100's 227)."""
    if tune.get("stages") is not None:
        return tune
    return {**tune, "stages": (STAGES_TMA if tma else STAGES_POINTERS) - (itemsize > 2)}


def to_ints(op: str, tune: Mapping[str, Any]) -> list[int]:
    """``tune`` as the ints a custom op's schema carries (``nsa::*`` ops take the parameters their caller read).

    Arguments:
        op: a key of ``KEYS``.
        tune: its parameters (``params(op, ..)``).

    Returns:
        One int per key in ``KEYS[op]``'s order: None -1, a bool 0/1, a choice its index in the choices.
        :func:`from_ints` inverts it.
    """
    out = []
    for k, (kind, _) in KEYS[op].items():
        v = tune[k]
        out.append(-1 if v is None else kind.index(v) if isinstance(kind, tuple) else int(v))
    return out


def from_ints(op: str, values: list[int]) -> dict[str, Any]:
    """The parameters of ``op`` from :func:`to_ints`' ints.

    Arguments:
        op: a key of ``KEYS``.
        values: :func:`to_ints`' list for it.

    Returns:
        key -> value, as ``params(op, ..)`` gave them.
    """
    out = {}
    for (k, (kind, _)), v in zip(KEYS[op].items(), values):
        out[k] = kind[v] if isinstance(kind, tuple) else None if v == -1 else kind(v)
    return out


def table(where: torch.device | str) -> dict[str, dict[str, Any]]:
    """Every op's parameters (as :func:`params`): what a run used."""
    return {op: params(op, where) for op in KEYS}


def validate(values: Mapping[str, Mapping[str, Any]]) -> None:
    """Raise ValueError naming the first unknown op, unknown key or value of the wrong type."""
    if not isinstance(values, Mapping):
        raise ValueError(f"tuning: expected a mapping {{op: {{key: value}}}}, got {type(values).__name__}")
    for op, kv in values.items():
        if op not in KEYS:
            raise ValueError(f"tuning: unknown op {op!r}; ops: {', '.join(KEYS)}")
        if not isinstance(kv, Mapping):
            raise ValueError(f"tuning.{op}: expected a mapping {{key: value}}, got {type(kv).__name__}")
        for k, v in kv.items():
            if k not in KEYS[op]:
                raise ValueError(f"tuning.{op}: unknown key {k!r}; keys: {', '.join(KEYS[op])}")
            kind = KEYS[op][k][0]
            if isinstance(kind, tuple):
                if v not in kind:
                    raise ValueError(f"tuning.{op}.{k}={v!r}: one of {', '.join(map(repr, kind))}")
            elif v is None:
                if all(TABLES[t][op][k] is not None for t in TABLES):
                    raise ValueError(f"tuning.{op}.{k}=None: needs a value ({kind.__name__})")
            elif kind is bool and not isinstance(v, bool):
                raise ValueError(f"tuning.{op}.{k}={v!r}: must be true or false")
            elif kind is int and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"tuning.{op}.{k}={v!r}: must be a positive integer")


@contextlib.contextmanager
def overrides(values: Mapping[str, Mapping[str, Any]]):
    """Inside the block, ``values`` ({op: {key: value}}) replace the table's values for every
    device; validated first (see :func:`validate`)."""
    global _OVERRIDES
    validate(values)
    saved = _OVERRIDES
    _OVERRIDES = {op: dict(saved.get(op, {})) for op in saved}
    for op, kv in values.items():
        _OVERRIDES.setdefault(op, {}).update(kv)
    try:
        yield
    finally:
        _OVERRIDES = saved
