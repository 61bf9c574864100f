"""Non-finite keys and values (docs/nsa-spec.md, "Non-finite inputs"): a NaN or Inf at position u reaches no
output row t < u, so the first bad token can be located and prefill agrees with decode.

Reference backend and the module in float64: each branch (compressed, selected, window), the whole NSA output
and the layer's input, with NaN and separately +Inf in a key or a value. Rows that cannot see the bad value
are exactly the output without it; rows that see it are non-finite. (+Inf keys: the query is made positive,
so q.k = +Inf and the softmax is NaN, as it would be without the masking.) Gradients of the rows that cannot
see it (alone in the graph) are those of the clean run.

Triton backend under the interpreter in float32 (tiny tiles, TMA descriptor loads and pointer loads): rows in
query tiles before the first one holding a row that sees the value (window: and after the last one) are finite
and equal to the clean run; the rows that see it are non-finite.
"""
from __future__ import annotations

import dataclasses

import os

# The interpreter must be chosen before triton is first imported (tests/conftest.py does not set it).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import ARG_ORDER, random_inputs  # noqa: E402

from nsa import NSAAttention, NSAConfig, reference  # noqa: E402
from nsa import functional as fn  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter warns of the NaN it computes

F64 = torch.float64
BAD = {"nan": float("nan"), "inf": float("inf")}
# T = 40 rows; compressed token i covers [4i, 4i+8) and is seen from t = 4i + 7; blocks of 8; window 6
CFG = NSAConfig(dim=32, n_heads=4, n_kv_heads=2, d_k=8, d_v=6, l=8, d=4, l_sel=8, n_sel=3, w=6, n_init=1,
                n_local=1)
B, T = 2, 40


def spoil(x: torch.Tensor, pos: int, bad: str) -> torch.Tensor:
    """x [B,T,...] with every element of token ``pos`` (all heads) set to the bad value."""
    y = x.detach().clone()
    y[:, pos] = BAD[bad]
    return y


def inputs(bad: str, key: bool, cfg: NSAConfig = CFG, T: int = T, dtype=F64) -> dict:
    x = random_inputs(cfg, B, T, dtype=dtype)
    if bad == "inf" and key:
        x["q"] = x["q"].abs()  # q.k = +Inf at a visible +Inf key: a NaN softmax, not a dropped key
    return x


def check_rows(out, clean, hit, what=""):
    """out / clean [B,T,HQ,D]; hit [B,T,HQ] (bool): the rows that see the bad value. Every other row equals
    the clean run exactly, every row in ``hit`` has a non-finite element."""
    hit = hit.expand(out.shape[:3])
    assert hit.any(), f"{what}: the case has no row that sees the bad value"
    assert torch.isfinite(out[~hit]).all(), f"{what}: a row that cannot see the bad value is not finite"
    assert torch.equal(out[~hit], clean[~hit]), f"{what}: a row that cannot see the bad value changed"
    assert (~torch.isfinite(out[hit])).any(-1).all(), f"{what}: a row that sees the bad value is finite"


def rows_from(first: int, T: int = T) -> torch.Tensor:
    """[1,T,1]: rows t >= first."""
    return (torch.arange(T) >= first)[None, :, None]


def sel_hit(idx, u, cfg=CFG, T=T):
    """[B,T,HQ]: rows t >= u whose selected blocks include u's (group g's blocks for its G heads)."""
    t = torch.arange(T)[None, :, None]
    sees = (idx == u // cfg.l_sel).any(-1) & (t >= u)
    return sees.repeat_interleave(cfg.n_heads // cfg.n_kv_heads, dim=2)


# ------------------------------------------------------------------------------------------------
# Reference, float64
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("i", [0, 4, 8])  # 8: the last compressed token, seen only by the last row
def test_reference_compressed_branch(bad, kind, i):
    x = inputs(bad, kind == "k")
    q, k, v = x["q"], x["k_cmp"], x["v_cmp"]
    k2, v2 = (spoil(k, i, bad), v) if kind == "k" else (k, spoil(v, i, bad))
    first = i * CFG.d + CFG.l - 1
    o0, p0 = fn.compressed_attention(q, k, v, CFG)
    o1, p1 = fn.compressed_attention(q, k2, v2, CFG)
    check_rows(o1, o0, rows_from(first), "o_cmp")
    assert torch.equal(p1[:, :first], p0[:, :first])
    # the dispatch's operator: the output and the top-n (Eqs. 8-12) of every row that cannot see token i
    oc0, idx0 = reference.compressed_branch(q, k, v, CFG)
    oc1, idx1 = reference.compressed_branch(q, k2, v2, CFG)
    check_rows(oc1, oc0, rows_from(first), "compressed_branch")
    assert torch.equal(idx1[:, :first], idx0[:, :first])
    if kind == "v":  # values do not enter the selection scores
        assert torch.equal(idx1, idx0)


@pytest.mark.usefixtures("attend_path")  # both reference forms (gathered lists, masked keys)
@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("u", [5, 21, 39])  # block 0 (forced), a middle block, the last token
def test_reference_selected_branch(bad, kind, u):
    x = inputs(bad, kind == "k")
    q, k, v = x["q"], x["k_sel"], x["v_sel"]
    _, idx = reference.compressed_branch(q, x["k_cmp"], x["v_cmp"], CFG)
    k2, v2 = (spoil(k, u, bad), v) if kind == "k" else (k, spoil(v, u, bad))
    o0 = fn.selected_attention(q, k, v, idx, CFG)
    o1 = fn.selected_attention(q, k2, v2, idx, CFG)
    check_rows(o1, o0, sel_hit(idx, u), "o_sel")


@pytest.mark.usefixtures("attend_path")  # both reference forms (gathered lists, masked keys)
@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("u", [0, 21, 39])
def test_reference_window_branch(bad, kind, u):
    x = inputs(bad, kind == "k")
    q, k, v = x["q"], x["k_win"], x["v_win"]
    k2, v2 = (spoil(k, u, bad), v) if kind == "k" else (k, spoil(v, u, bad))
    o0 = fn.sliding_window_attention(q, k, v, CFG)
    o1 = fn.sliding_window_attention(q, k2, v2, CFG)
    check_rows(o1, o0, rows_from(u) & ~rows_from(u + CFG.w), "o_win")


@pytest.mark.usefixtures("attend_path")  # both reference forms (gathered lists, masked keys)
@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("name", ["k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win"])
def test_reference_nsa_output(bad, name):
    """The gated output (Eq. 5): raw position u = 21, or the compressed token i = 4 that covers it
    ([16, 24), seen from t = 23)."""
    x = inputs(bad, name.startswith("k"))
    u = 4 if name.endswith("cmp") else 21
    x2 = dict(x, **{name: spoil(x[name], u, bad)})
    o0, idx0 = fn.nsa_attention(*(x[n] for n in ARG_ORDER), CFG, return_indices=True)
    o1, idx1 = fn.nsa_attention(*(x2[n] for n in ARG_ORDER), CFG, return_indices=True)
    if name.endswith("cmp"):
        first = u * CFG.d + CFG.l - 1
        hit = rows_from(first)
        assert torch.equal(idx1[:, :first], idx0[:, :first])
    else:
        assert torch.equal(idx1, idx0)
        hit = sel_hit(idx0, u) if name.endswith("sel") else rows_from(u) & ~rows_from(u + CFG.w)
    check_rows(o1, o0, hit, name)


@pytest.mark.parametrize("bad", list(BAD))
def test_reference_packed_documents(bad):
    """Two packed documents of 20 tokens: every key and value of doc 0's last token (packed row 19) and of its
    last compressed token (which covers it) non-finite. Only that row sees them: doc 0's other rows and all
    of doc 1 (after it in the packing) are the clean run's."""
    x = inputs(bad, key=True)
    x = {n: t[:1] for n, t in x.items()}
    cu = torch.tensor([0, 20, 40], dtype=torch.int32)
    n_cmp = CFG.n_cmp(20)
    x["k_cmp"], x["v_cmp"] = x["k_cmp"][:, :2 * n_cmp], x["v_cmp"][:, :2 * n_cmp]
    x2 = dict(x)
    for n in ("k_sel", "v_sel", "k_win", "v_win"):
        x2[n] = spoil(x[n], 19, bad)
    for n in ("k_cmp", "v_cmp"):
        x2[n] = spoil(x[n], n_cmp - 1, bad)
    o0 = fn.nsa_attention(*(x[n] for n in ARG_ORDER), CFG, cu_seqlens=cu)
    o1 = fn.nsa_attention(*(x2[n] for n in ARG_ORDER), CFG, cu_seqlens=cu)
    check_rows(o1, o0, (torch.arange(40) == 19)[None, :, None], "packed")


@pytest.mark.usefixtures("attend_path")  # both reference forms (gathered lists, masked keys)
@pytest.mark.parametrize("name", ["k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win"])
def test_reference_gradients_of_rows_before_a_nan(name):
    """The queries t < u (which cannot see the NaN at u) over all T keys: every input's gradient is that of
    the clean run and finite (the NaN's own gradient included: zero). Rows that see a NaN are left out of the
    graph: autograd multiplies their zero upstream gradient by the NaN (0 x NaN), as in any attention."""
    x = random_inputs(CFG, B, T)
    u = 4 if name.endswith("cmp") else 21
    first = u * CFG.d + CFG.l - 1 if name.endswith("cmp") else u
    w = torch.randn(B, first, CFG.n_heads, CFG.d_v, dtype=F64, generator=torch.Generator().manual_seed(3))
    grads = []
    for spoilt in (False, True):
        leaves = {n: (spoil(x[n], u, "nan") if spoilt and n == name else x[n].detach().clone()) for n in ARG_ORDER}
        leaves = {n: (t[:, :first] if n in ("q", "gates") else t).requires_grad_() for n, t in leaves.items()}
        o = fn.nsa_attention(*(leaves[n] for n in ARG_ORDER), CFG)
        grads.append(torch.autograd.grad((o * w).sum(), [leaves[n] for n in ARG_ORDER]))
    for n, g0, g1 in zip(ARG_ORDER, *grads):
        assert torch.isfinite(g1).all(), f"d{n}"
        torch.testing.assert_close(g1, g0, rtol=0, atol=1e-12, msg=f"d{n}")


# ------------------------------------------------------------------------------------------------
# The module, float64: a bad input token
# ------------------------------------------------------------------------------------------------
def small_layer(phi: str) -> NSAAttention:
    torch.manual_seed(0)
    cfg = NSAConfig(dim=16, n_heads=4, n_kv_heads=2, d_k=4, d_v=6, l=8, d=4, l_sel=8, n_sel=3, w=6, n_init=1,
                    n_local=1, phi=phi, gate_hidden=8)
    return NSAAttention(cfg).double()


@pytest.mark.usefixtures("attend_path")  # both reference forms (gathered lists, masked keys)
@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("phi", ["mlp", "avg"])
def test_module_bad_input_token(bad, phi):
    """x at token u = 20 non-finite: rows t < u are the clean run's, every row t >= u is non-finite (the window
    sees u until the compressed tokens covering it are emitted); decode token by token gives the same."""
    layer = small_layer(phi)
    u = 20
    x = torch.randn(B, T, 16, dtype=F64, generator=torch.Generator().manual_seed(1))
    x2 = spoil(x, u, bad)
    with torch.no_grad():
        y0, y1 = layer(x), layer(x2)
        cache = layer.new_cache(B, max_len=T)
        y_dec = torch.cat([layer(x2[:, s:s + 1], cache) for s in range(T)], dim=1)
    check_rows(y1[:, :, None], y0[:, :, None], rows_from(u), "prefill")
    torch.testing.assert_close(y_dec[:, :u], y1[:, :u], rtol=0, atol=1e-10)
    assert (~torch.isfinite(y_dec[:, u:])).any(-1).all()


# ------------------------------------------------------------------------------------------------
# Triton backend under the interpreter, float32: rows in query tiles before u's tile are the clean run's
# ------------------------------------------------------------------------------------------------
def _triton():
    """The triton modules, or a skip where they cannot run here."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs on CPU tensors under TRITON_INTERPRET=1")
    pytest.importorskip("triton")
    from nsa.backends import triton as tb
    if tb.triton_unsupported() is not None:
        pytest.skip(tb.triton_unsupported())
    return tb


# T = 64; compressed token i seen from t = 4i + 7 (Tc = 15); blocks of 8; window 16. G = 2: query tiles of
# rows // 2 = 8 positions (compressed, window), key tiles of 16 keys, so a query tile's last key tile
# reaches past its rows.
TCFG = NSAConfig(dim=64, n_heads=4, n_kv_heads=2, d_k=16, d_v=16, l=8, d=4, l_sel=8, n_sel=4, w=16, n_init=1,
                 n_local=2)
TT = 64
SMALL = {"compressed": dict(rows=16, block_n=16, lse_n=32, warps=4, stages=1),
         "window": dict(rows=16, block_n=16, warps=4, stages=1)}
BLOCK_M = 8


def t_inputs(bad, key):
    x = inputs(bad, key, TCFG, TT, dtype=torch.float32)
    return {n: t.detach() for n, t in x.items()}


def check_tiles(out, clean, first, last=None, T=TT, what=""):
    """Rows before the query tile of position ``first`` (the first row that sees the bad value) and, if
    given, after the tile of ``last`` (the last one) equal the clean run; rows first..last are non-finite."""
    t = torch.arange(T)
    lo = first // BLOCK_M * BLOCK_M
    hi = T if last is None else (last // BLOCK_M + 1) * BLOCK_M
    keep = (t < lo) | (t >= hi)
    assert torch.isfinite(out[:, keep]).all(), f"{what}: a row in an earlier (or later) tile is not finite"
    assert torch.equal(out[:, keep], clean[:, keep]), f"{what}: a row in an earlier (or later) tile changed"
    sees = (t >= first) & (t <= (T - 1 if last is None else last))
    assert (~torch.isfinite(out[:, sees])).any(-1).all(), f"{what}: a row that sees the bad value is finite"


# i: seen from t = 39 (mid-tile), 63 (the last row only). The interpreter is slow: the cases that tell the
# load paths apart (+Inf values: the reference's tests).
@pytest.mark.usefixtures("fast_interpreter")
@pytest.mark.parametrize("tma,kind,bad,i", [(True, "v", "nan", 8), (True, "v", "nan", 14), (False, "v", "nan", 14),
                                            (True, "k", "nan", 14), (False, "v", "inf", 8)])
def test_triton_compressed_branch(tma, bad, kind, i):
    tb = _triton()
    from nsa.backends.triton.compressed import compressed_branch
    x = t_inputs(bad, kind == "k")
    q, k, v = x["q"], x["k_cmp"], x["v_cmp"]
    k2, v2 = (spoil(k, i, bad), v) if kind == "k" else (k, spoil(v, i, bad))
    first = i * TCFG.d + TCFG.l - 1
    with tb.poisoned_outputs(), tb.tuning.overrides({"compressed": {**SMALL["compressed"], "tma": tma}}):
        o0, idx0 = compressed_branch(q, k, v, TCFG)
        o1, idx1 = compressed_branch(q, k2, v2, TCFG)
    check_tiles(o1, o0, first, what="o_cmp")
    assert torch.equal(idx1[:, :first], idx0[:, :first])  # p (and so Eq. 9's scores) of rows t < first: exact


@pytest.mark.usefixtures("fast_interpreter")
@pytest.mark.parametrize("kind,bad,u", [("v", "nan", 30), ("v", "nan", 32), ("v", "nan", 63), ("k", "nan", 32)])
def test_triton_window_branch(bad, kind, u):  # 32: the first key of a key tile that the tile of rows 48.. starts at
    tb = _triton()
    from nsa.backends.triton.window import sliding_window_attention
    x = t_inputs(bad, kind == "k")
    q, k, v = x["q"], x["k_win"], x["v_win"]
    k2, v2 = (spoil(k, u, bad), v) if kind == "k" else (k, spoil(v, u, bad))
    with tb.poisoned_outputs(), tb.tuning.overrides(SMALL):
        o0 = sliding_window_attention(q, k, v, TCFG)
        o1 = sliding_window_attention(q, k2, v2, TCFG)
    check_tiles(o1, o0, u, min(u + TCFG.w - 1, TT - 1), what="o_win")


class _Spy:
    """Stands for a kernel: records the TMA flag of each launch, then launches the kernel."""

    def __init__(self, kernel, seen):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.seen.append(kw["TMA"])
            return self.kernel[grid](*args, **kw)
        return launch


@pytest.mark.usefixtures("fast_interpreter")
@pytest.mark.parametrize("mode", ["query-tma", "query", "block"])
@pytest.mark.parametrize("kind,bad,u", [("v", "nan", 37), ("k", "nan", 63)])
def test_triton_selected_branch(monkeypatch, mode, bad, kind, u):
    """Query-outer: one row per program, so every row t < u is the clean run's. Block-outer: a program loads
    u's block for a work item of chunk_rows / G = 4 queries that selected it, in row order; the rows of
    u's block (from 32 on here) select it (the newest candidate, forced), so its items start at 32, 36, ..:
    rows before u's item are the clean run's. Through descriptors (``query-tma``) with 16-token blocks, one
    key tile each (a tile of 16 would reach past an 8-token block: those take pointer loads): u's block is
    then partly before and partly after the rows that hold it. A bad value sends the kernel down its path
    for non-finite values (t's block first, its values past t zeroed), the clean run down the finite one:
    the same sums in another order, so the rows that cannot see u agree to float32 rounding there."""
    tb = _triton()
    from nsa.backends.triton import selection
    cfg = dataclasses.replace(TCFG, l_sel=16) if mode == "query-tma" else TCFG
    x = t_inputs(bad, kind == "k")
    q, k, v = x["q"], x["k_sel"], x["v_sel"]
    _, idx = reference.compressed_branch(q, x["k_cmp"], x["v_cmp"], cfg)
    k2, v2 = (spoil(k, u, bad), v) if kind == "k" else (k, spoil(v, u, bad))
    tune = {"mode": mode.split("-")[0], "tma": mode == "query-tma", "chunk_rows": 8}
    kernel, seen = selection.fwd_q_kernel, []
    monkeypatch.setattr(selection, "fwd_q_kernel", _Spy(kernel, seen))
    with tb.poisoned_outputs(), tb.tuning.overrides({"selection": tune}):
        o0 = selection.selected_attention(q, k, v, idx, cfg)
        o1 = selection.selected_attention(q, k2, v2, idx, cfg)
    assert seen == ([mode == "query-tma"] * 2 if mode != "block" else [])  # the load path named by the case
    j0 = u // cfg.l_sel * cfg.l_sel
    lo = u if mode != "block" else j0 + (u - j0) // 4 * 4
    hit = sel_hit(idx, u, cfg, TT)
    keep = ~hit & (torch.arange(TT) < lo)[None, :, None]
    assert torch.isfinite(o1[keep]).all() and (~torch.isfinite(o1[hit])).any(-1).all()
    if mode == "query-tma":  # every row that cannot see u: finite, and the clean run's to rounding
        assert torch.isfinite(o1[~hit]).all()
        torch.testing.assert_close(o1[~hit], o0[~hit], rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(o1[keep], o0[keep])
    if mode == "query":  # one row per program: exactly the reference's rows
        check_rows(o1, o0, hit, mode)


@pytest.mark.usefixtures("fast_interpreter")
@pytest.mark.parametrize("name", ["v_cmp", "v_sel", "v_win"])
def test_triton_nsa_output(name):
    """The whole layer on the triton backend (its own top-n, the gate fused into the selected branch, the
    query-outer selection at these sizes): NaN at raw position u = 41, or in the compressed token i = 9
    that covers it (seen from 43); rows before u's query tile are the clean run's."""
    tb = _triton()
    x = t_inputs("nan", False)
    u = 9 if name.endswith("cmp") else 41
    first = u * TCFG.d + TCFG.l - 1 if name.endswith("cmp") else u
    x2 = dict(x, **{name: spoil(x[name], u, "nan")})
    with tb.poisoned_outputs(), tb.tuning.overrides(SMALL):
        o0 = fn.nsa_attention(*(x[n] for n in ARG_ORDER), TCFG, backend="triton")
        o1 = fn.nsa_attention(*(x2[n] for n in ARG_ORDER), TCFG, backend="triton")
    lo = first // BLOCK_M * BLOCK_M
    assert torch.isfinite(o1[:, :lo]).all() and torch.equal(o1[:, :lo], o0[:, :lo])
    assert (~torch.isfinite(o1[:, first])).any(-1).all()
