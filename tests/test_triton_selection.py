"""The Triton selected-attention kernels (forward and dq/dk/dv) against ``nsa.reference``.

Runs the kernels through Triton's interpreter on CPU tensors at tiny shapes, in float32 (tight) and
float16 (reference on upcast inputs), both kernel families ("query"-outer and "block"-outer),
G in {1,2,3,4,16}, Dk != Dv, non-power-of-two dims, T not a multiple of l_sel, -1 padding, decode-like
q_start > 0, batched and varlen layouts. Outputs are poisoned with NaN so an unwritten element fails.
bfloat16 is not tested here: the interpreter's bf16 dot is wrong (the backend refuses it there);
bf16 runs on a GPU (experiments.parity).
"""
from __future__ import annotations

import os

# The interpreter must be chosen before triton is first imported (tests/conftest.py does not set it).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from nsa import NSAConfig, reference
from nsa.backends.triton import poisoned_outputs, selection, triton_unsupported, tuning
from nsa.numerics import rel_l2
from nsa.varlen import Varlen

_OLD_INTERPRETER = triton_unsupported()  # from triton.__version__: None on triton >= 3.0
pytestmark = pytest.mark.skipif(_OLD_INTERPRETER is not None, reason=_OLD_INTERPRETER or "")

F64 = torch.float64

# (B, Tq, q_start, S, HQ, H, Dk, Dv, l_sel, n_sel)
CASES = [
    (2, 20, 0, None, 2, 2, 16, 16, 16, 2),     # G=1, T not a multiple of l_sel
    (1, 16, 32, 48, 4, 2, 32, 16, 16, 3),      # G=2, Dk != Dv, chunked prefill (q_start > 0)
    (1, 40, 0, None, 16, 1, 16, 32, 16, 3),    # G=16, Dv > Dk
    (1, 36, 0, None, 4, 1, 24, 16, 32, 2),     # G=4, Dk not a power of two, l_sel=32
    (2, 3, 61, 64, 8, 2, 16, 16, 16, 3),       # decode-like: 3 queries at the end of 64 keys
    (1, 1, 70, 75, 4, 1, 16, 16, 16, 4),       # one query, S > q_start + Tq
    (1, 30, 0, None, 3, 1, 16, 24, 8, 4),      # G=3, l_sel=8 < the smallest tile
    (1, 8, 90, 98, 2, 1, 16, 16, 96, 2),       # l_sel=96: two sub-tiles per block in query mode
]
IDS = [f"B{c[0]}-T{c[1]}-qs{c[2]}-HQ{c[4]}-H{c[5]}-Dk{c[6]}-Dv{c[7]}-ls{c[8]}-n{c[9]}" for c in CASES]


def _config(HQ, H, Dk, Dv, l_sel, n_sel):
    d = min(8, l_sel)
    return NSAConfig(dim=HQ * Dk, n_heads=HQ, n_kv_heads=H, d_k=Dk, d_v=Dv, l=2 * d, d=d, l_sel=l_sel,
                     n_sel=n_sel, n_init=1 if n_sel > 1 else 0, n_local=1, w=32)


def random_indices(cfg, B, Tq, q_start, S, gen, drop=0.3):
    """Random valid selections: reference top-n on random scores (forced blocks included, ascending,
    -1 padded), then some non-forced entries dropped to -1 for extra padding."""
    nb = cfg.n_blocks(S)
    scores = torch.rand(B, Tq, cfg.n_kv_heads, nb, generator=gen, dtype=F64)
    idx = reference.select_blocks(scores, cfg, q_start=q_start)
    t = (q_start + torch.arange(Tq))[None, :, None, None]
    keep = (torch.rand(idx.shape, generator=gen) > drop) | (idx == t // cfg.l_sel)
    idx = torch.where(keep, idx, torch.full_like(idx, -1))
    big = torch.iinfo(torch.int64).max
    idx = torch.sort(torch.where(idx < 0, torch.full_like(idx, big), idx), dim=-1).values
    return torch.where(idx == big, torch.full_like(idx, -1), idx)


def _inputs(case, dtype, seed):
    B, Tq, q_start, S, HQ, H, Dk, Dv, l_sel, n_sel = case
    S = q_start + Tq if S is None else S
    cfg = _config(HQ, H, Dk, Dv, l_sel, n_sel)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, HQ, Dk, generator=g, dtype=F64) * 1.5
    k = torch.randn(B, S, H, Dk, generator=g, dtype=F64) * 1.5
    v = torch.randn(B, S, H, Dv, generator=g, dtype=F64)
    w = torch.randn(B, Tq, HQ, Dv, generator=g, dtype=F64)
    idx = random_indices(cfg, B, Tq, q_start, S, g)
    return cfg, q_start, [x.to(dtype) for x in (q, k, v)], w, idx


@pytest.fixture(autouse=True)
def _poison():
    with poisoned_outputs():
        yield


def _check(fn, cfg, q_start, xs, w, idx, dtype, ref_fn=None):
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    xs_t = [x.clone().requires_grad_(True) for x in xs]
    o = fn(*xs_t, idx)
    assert o.dtype == dtype and o.shape == xs[0].shape[:-1] + (xs[2].shape[-1],)
    (o.to(F64) * w).sum().backward()
    xs_r = [x.to(F64).requires_grad_(True) for x in xs]  # reference on upcast inputs
    ref_fn = ref_fn or (lambda q, k, v, i: reference.selected_attention(q, k, v, i, cfg, q_start=q_start))
    o_r = ref_fn(*xs_r, idx)
    (o_r * w).sum().backward()
    assert rel_l2(o, o_r) <= tol, ("o", rel_l2(o, o_r))
    for name, a, b in zip(("dq", "dk", "dv"), xs_t, xs_r):
        assert a.grad.dtype == dtype
        assert rel_l2(a.grad, b.grad) <= tol, (name, rel_l2(a.grad, b.grad))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: log2(0), 0/0 in masked-off rows
@pytest.mark.parametrize("mode", ["query", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_selected_attention_matches_reference(case, dtype, mode):
    cfg, q_start, xs, w, idx = _inputs(case, dtype, seed=CASES.index(case) * 4 + (dtype == torch.float16) * 2 + (mode == "block"))

    def fn(q, k, v, i):
        # query mode: dq from the query-outer kernel (dq_part=False); block mode: dq per slot
        with tuning.overrides({"selection": {"mode": mode, "dq_part": mode == "block"}}):
            return selection.selected_attention(q, k, v, i, cfg, q_start=q_start)

    _check(fn, cfg, q_start, xs, w, idx, dtype)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("mode", ["query", "block"])
@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
def test_partials_in_row_chunks(varlen, mode):
    """Per-slot partials over ``part_bytes_max`` (long T): the block-outer kernels run in row chunks,
    dq per slot after a query-outer forward (as with Dk > 128), and with mode=block the forward's
    partial outputs too. Each chunk's plan names rows of the whole tensor and its partials are stored
    from its first row, so output and gradients equal the reference's (a chunk offset off by one row
    moves o, dq and dK)."""
    cfg = _config(8, 2, 24, 16, 16, 3)  # Dk 24: part row = HQ * n_sel * Dk * 4 bytes = 2304
    g = torch.Generator().manual_seed(11)
    lens = [37, 5, 30] if varlen else [72]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    N = int(cu[-1])
    q, k = torch.randn(N, 8, 24, generator=g) * 1.5, torch.randn(N, 2, 24, generator=g) * 1.5
    v = torch.randn(N, 2, 16, generator=g)
    w = torch.randn(N, 8, 16, generator=g, dtype=F64)
    idx = torch.cat([random_indices(cfg, 1, n, 0, n, g)[0] for n in lens])
    calls = []
    plan = selection._block_outer_plan

    def counting(*a, **kw):
        calls.append(kw.get("row0", 0))
        return plan(*a, **kw)

    def fn(q, k, v, i):  # backward: 7 rows per chunk (forward: 10); chunks start inside documents, end at N
        with tuning.overrides({"selection": {"mode": mode, "dq_part": True, "part_bytes_max": 7 * 2304}}):
            return selection.selected_attention(q[None], k[None], v[None], i[None], cfg,
                                                varlen=Varlen(cu) if varlen else None)[0]

    def ref(q, k, v, i):
        outs = [reference.selected_attention(q[None, a:b], k[None, a:b], v[None, a:b], i[None, a:b], cfg)[0]
                for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
        return torch.cat(outs)

    selection._block_outer_plan = counting
    try:
        _check(fn, cfg, 0, [q, k, v], w, idx, torch.float32, ref_fn=ref)
    finally:
        selection._block_outer_plan = plan
    # forward partials: HQ * n_sel * Dv * 4 = 1536 bytes a row, 10 rows a chunk; backward 7
    assert calls == (list(range(0, N, 10)) if mode == "block" else []) + list(range(0, N, 7)), calls


@pytest.mark.parametrize("gib, want", [(24, 3 << 30), (80, 8 << 30), (141, 8 << 30)])
def test_partials_budget_follows_the_card(monkeypatch, gib, want):
    """``part_bytes_max=None``: 8 GiB of per-slot partials, at most an eighth of the GPU's memory; off
    CUDA 8 GiB; a value given is kept."""
    props = type("Props", (), {"total_memory": gib << 30})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    tune = tuning.params("selection", "cuda")
    assert tune["part_bytes_max"] is None
    assert selection._part_budget(tune, torch.device("cuda", 0)) == want
    assert selection._part_budget(tune, torch.device("cpu")) == 8 << 30
    assert selection._part_budget({**tune, "part_bytes_max": 12345}, torch.device("cuda", 0)) == 12345


@pytest.mark.parametrize("row0", [0, 13])
def test_block_outer_plan_lists_every_entry_once(row0):
    """The inverted index: every valid (row, head, slot) entry once, in the work items of its (sequence,
    head, block) segment, rows ascending inside a segment, at most chunk_rows // G entries an item, and
    the items in segment order; -1 and out-of-range blocks left out; as many items as ``_plan_items`` bounds
    (known from the shapes: no host sync), those past the real count empty. ``row0``: a chunk's rows."""
    g = torch.Generator().manual_seed(row0)
    H, NB, n_sel, G, chunk_rows = 3, 7, 4, 2, 10
    cu = torch.tensor([0, 20, 50], dtype=torch.int32)
    lay = selection._Layout(cu, cu, torch.cat([torch.zeros(20), torch.ones(30)]).to(torch.int32), 0, NB)
    idx = torch.randint(-1, NB + 1, (50 - row0, H, n_sel), generator=g, dtype=torch.int32)
    plan = selection._block_outer_plan(idx, lay, H, G, chunk_rows, row0=row0)
    seen, last_key, empty = [], -1, 0
    assert plan["n_items"] == selection._plan_items(idx.numel(), 2 * H * NB, chunk_rows // G)
    assert all(plan[k].shape == (plan["n_items"],) for k in ("item_key", "item_start", "item_end"))
    for it in range(plan["n_items"]):
        key, a, b = (int(plan[k][it]) for k in ("item_key", "item_start", "item_end"))
        if a == b:  # past the real count: every later item empty too
            assert (key, a) == (0, 0)
            empty += 1
            continue
        assert not empty and key >= last_key and 0 < b - a <= chunk_rows // G
        last_key = key
        rows = plan["ent_row"][a:b].tolist()
        assert rows == sorted(rows)
        seq, h, j = key // (NB * H), key // NB % H, key % NB
        for r, sl in zip(rows, plan["ent_slot"][a:b].tolist()):
            assert int(lay.row_seq[r]) == seq and int(idx[r - row0, h, sl]) == j
            seen.append((r, h, sl))
    want = [(r + row0, h, sl) for r, h, sl in ((idx >= 0) & (idx < NB)).nonzero().tolist()]
    assert sorted(seen) == sorted(want) and len(set(seen)) == len(seen)
    per, segs = chunk_rows // G, {}
    for r, h, sl in want:
        key = (int(lay.row_seq[r]), h, int(idx[r - row0, h, sl]))
        segs[key] = segs.get(key, 0) + 1
    assert plan["n_items"] - empty == sum(-(-c // per) for c in segs.values())  # the real items, each full but the last


def test_indices_from_compressed_branch():
    """Indices from the reference compressed branch (the real producer), auto mode, G=4."""
    cfg = NSAConfig(dim=128, n_heads=8, n_kv_heads=2, d_k=16, d_v=16, l=16, d=8, l_sel=16, n_sel=3, w=32)
    g = torch.Generator().manual_seed(3)
    B, T = 1, 72
    q = torch.randn(B, T, 8, 16, generator=g) * 2
    k = torch.randn(B, T, 2, 16, generator=g) * 2
    v = torch.randn(B, T, 2, 16, generator=g)
    kc, vc = reference.compress(k, cfg), reference.compress(v, cfg)
    _, idx = reference.compressed_branch(q, kc, vc, cfg)
    w = torch.randn(B, T, 8, 16, generator=g, dtype=F64)

    def fn(q, k, v, i):
        return selection.selected_attention(q, k, v, i, cfg)

    _check(fn, cfg, 0, [q, k, v], w, idx, torch.float32)


@pytest.mark.parametrize("mode", ["query", "block"])
def test_varlen_matches_per_sequence_reference(mode):
    cfg = _config(8, 2, 16, 24, 16, 3)
    g = torch.Generator().manual_seed(5)
    lens = [13, 5, 30]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    N = int(cu[-1])
    q = torch.randn(N, 8, 16, generator=g) * 1.5
    k = torch.randn(N, 2, 16, generator=g) * 1.5
    v = torch.randn(N, 2, 24, generator=g)
    w = torch.randn(N, 8, 24, generator=g, dtype=F64)
    idx = torch.cat([random_indices(cfg, 1, n, 0, n, g)[0] for n in lens])

    def fn(q, k, v, i):
        with tuning.overrides({"selection": {"mode": mode, "dq_part": mode == "block"}}):
            return selection.selected_attention(q[None], k[None], v[None], i[None], cfg, varlen=Varlen(cu))[0]

    def ref(q, k, v, i):
        outs = [reference.selected_attention(q[None, a:b], k[None, a:b], v[None, a:b], i[None, a:b], cfg)[0]
                for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
        return torch.cat(outs)

    _check(fn, cfg, 0, [q, k, v], w, idx, torch.float32, ref_fn=ref)


def test_backend_dispatch_runs_triton():
    from nsa import dispatch

    case = CASES[1]
    cfg, q_start, xs, _, idx = _inputs(case, torch.float32, seed=7)
    with dispatch.record() as rec:
        be = dispatch.choose("sel", "triton", xs[0].device, xs[0].dtype, None)
        o = be.selected(*xs, idx, cfg, scale=None, q_start=q_start)
    assert rec.ran["sel"] == "triton"
    ref = reference.selected_attention(*(x.to(F64) for x in xs), idx, cfg, q_start=q_start)
    assert rel_l2(o, ref) <= 1e-5


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("mode", ["query", "block", "block_chunks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES[:5], ids=IDS[:5])
def test_selected_gated_matches_reference(monkeypatch, case, dtype, mode):
    """Eq. 5 in the selection kernel's epilogue (forward only): g_cmp o_cmp + g_sel o_sel + g_win o_win
    against the float64 reference selected branch and the plain gated sum, both kernel families;
    block_chunks: block-outer in chunks of 3 query rows (each chunk's gated epilogue on its rows)."""
    cfg, q_start, xs, _, idx = _inputs(case, dtype, seed=100 + CASES.index(case) * 4 + (mode != "query"))
    g = torch.Generator().manual_seed(CASES.index(case))
    B, Tq, HQ = xs[0].shape[:3]
    Dv = xs[2].shape[-1]
    o_cmp, o_win = (torch.randn(B, Tq, HQ, Dv, generator=g).to(dtype) for _ in range(2))
    gates = torch.rand(B, Tq, HQ, 3, generator=g).to(dtype)
    row_bytes = HQ * cfg.n_sel * Dv * xs[0].element_size()
    tune = {"mode": "block", "part_bytes_max": 3 * row_bytes} if mode == "block_chunks" else {"mode": mode}
    plans = []
    plan = selection._block_outer_plan
    monkeypatch.setattr(selection, "_block_outer_plan", lambda *a, **kw: plans.append(kw.get("row0", 0)) or plan(*a, **kw))
    with tuning.overrides({"selection": tune}):
        o = selection.selected_gated(*xs, idx, cfg, o_cmp, o_win, gates, q_start=q_start)
    # one plan per chunk of rows (none for query-outer)
    assert plans == {"query": [], "block": [0], "block_chunks": list(range(0, B * Tq, 3))}[mode], plans
    o_sel = reference.selected_attention(*(x.to(F64) for x in xs), idx, cfg, q_start=q_start)
    gg = gates.to(F64).unsqueeze(-1)
    ref = gg[..., 0, :] * o_cmp.to(F64) + gg[..., 1, :] * o_sel + gg[..., 2, :] * o_win.to(F64)
    assert o.dtype == dtype and o.shape == ref.shape
    assert rel_l2(o, ref) <= (1e-6 if dtype == torch.float32 else 2e-3), rel_l2(o, ref)


def test_selected_gated_refuses_gradients_and_bad_shapes():
    cfg, q_start, xs, _, idx = _inputs(CASES[1], torch.float32, seed=9)
    B, Tq, HQ = xs[0].shape[:3]
    oc = torch.zeros(B, Tq, HQ, xs[2].shape[-1])
    gates = torch.ones(B, Tq, HQ, 3)
    q = xs[0].clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="selected_gated: forward only"):
        selection.selected_gated(q, *xs[1:], idx, cfg, oc, oc, gates, q_start=q_start)
    with pytest.raises(ValueError, match="selected_gated: o_cmp"):
        selection.selected_gated(*xs, idx, cfg, oc[..., :-1], oc[..., :-1], gates, q_start=q_start)
    with pytest.raises(ValueError, match="selected_gated: gates"):
        selection.selected_gated(*xs, idx, cfg, oc, oc, gates[..., :2], q_start=q_start)
