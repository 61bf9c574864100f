"""The triton backend as a whole: what it refuses (bfloat16 under the interpreter), its one tuning
mechanism (``nsa.backends.triton.tuning``), and empty inputs. Runs through Triton's interpreter on
CPU tensors.
"""
from __future__ import annotations

import os

# The interpreter must be chosen before triton is first imported (tests/conftest.py does not set it).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nsa import NSAAttention, dispatch, functional  # noqa: E402
from nsa.backends.triton import triton_unsupported, tuning  # noqa: E402

from conftest import ARG_ORDER, check_empty_inputs, make_config, random_inputs  # noqa: E402

_OLD = triton_unsupported()
pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs on CPU tensors under TRITON_INTERPRET=1"),
    pytest.mark.skipif(_OLD is not None, reason=_OLD or ""),
]


def test_triton_refuses_bf16_in_the_interpreter():
    """The interpreter's bf16 tl.dot is wrong (outputs off by up to 2e9): bf16 on CPU tensors is
    refused with that reason, for every branch, through the functional API and the module, instead
    of finishing with wrong numbers. float16 and float32 still run."""
    cpu = torch.device("cpu")
    for branch in ("cmp", "sel", "win"):
        with pytest.raises(dispatch.BackendUnavailable,
                           match=rf"backend 'triton' cannot run branch '{branch}' on cpu/bfloat16: bfloat16 under "
                                 r"Triton's interpreter .* bf16 tl.dot returns wrong products"):
            dispatch.choose(branch, "triton", cpu, torch.bfloat16, None)
        for dt in (torch.float16, torch.float32):
            assert dispatch.choose(branch, "triton", cpu, dt, None).name == "triton"
    cfg = make_config(HQ=4, H=2, Dk=16, Dv=16, l=8, d=4, l_sel=8, n_sel=3, w=8)
    x = random_inputs(cfg, B=1, T=16, dtype=torch.bfloat16)
    with pytest.raises(dispatch.BackendUnavailable, match="bf16 tl.dot"):
        functional.nsa_attention(*(x[a] for a in ARG_ORDER), cfg, backend="triton")
    with pytest.raises(dispatch.BackendUnavailable, match="bf16 tl.dot"):
        NSAAttention(cfg, backend="triton").bfloat16()(torch.zeros(1, 16, cfg.dim, dtype=torch.bfloat16))


@pytest.mark.parametrize("B,T", [(0, 20), (2, 0), (0, 0)], ids=["B0", "T0", "B0-T0"])
def test_empty_inputs_give_empty_outputs(B, T):
    """B = 0 or T = 0 used to raise ZeroDivisionError or a reshape error on this backend."""
    check_empty_inputs("triton", B, T, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# tuning
# ---------------------------------------------------------------------------------------------
def test_tables_name_every_key_with_its_type():
    for key, table in tuning.TABLES.items():
        assert set(table) == set(tuning.KEYS), key
        for op, values in table.items():
            assert set(values) == set(tuning.KEYS[op]), (key, op)
            tuning.validate({op: {k: v for k, v in values.items() if v is not None}})
    assert tuning.key(torch.device("cpu")) == "interpret"


@pytest.mark.parametrize("values,match", [
    ({"compresed": {"rows": 64}}, r"tuning: unknown op 'compresed'; ops: compressed, window"),
    ({"compressed": {"row": 64}}, r"tuning.compressed: unknown key 'row'; keys: rows, block_n"),
    ({"compressed": {"rows": 0}}, r"tuning.compressed.rows=0: must be a positive integer"),
    ({"compressed": {"rows": True}}, r"tuning.compressed.rows=True: must be a positive integer"),
    ({"compressed": {"rows": None}}, r"tuning.compressed.rows=None: needs a value \(int\)"),
    ({"compressed": {"score_lo": 1}}, r"tuning.compressed.score_lo=1: must be true or false"),
    ({"selection": {"mode": "fast"}}, r"tuning.selection.mode='fast': one of 'auto', 'query', 'block'"),
    ({"topn": 4}, r"tuning.topn: expected a mapping"),
    ([("topn", {})], r"tuning: expected a mapping"),
])
def test_overrides_are_validated(values, match):
    before = tuning.params("compressed", "cuda")
    with pytest.raises(ValueError, match=match):
        with tuning.overrides(values):
            pass
    assert tuning.params("compressed", "cuda") == before


def test_overrides_nest_and_restore():
    base = tuning.table("interpret")
    with tuning.overrides({"compressed": {"rows": 32}, "decode": {"nsc": 3}}):
        with tuning.overrides({"compressed": {"block_n": 32}, "selection": {"mode": "query", "dq_part": False}}):
            p = tuning.params("compressed", torch.device("cpu"))
            assert (p["rows"], p["block_n"], p["lse_n"]) == (32, 32, base["compressed"]["lse_n"])
            assert tuning.params("selection", "cuda")["mode"] == "query"  # overrides apply to every table
            assert tuning.params("decode", "interpret")["nsc"] == 3
        assert tuning.params("compressed", "interpret")["block_n"] == base["compressed"]["block_n"]
        assert tuning.params("compressed", "interpret")["rows"] == 32
    assert tuning.table("interpret") == base
    with pytest.raises(ValueError, match="unknown op"):
        tuning.params("nope", "cuda")


def test_the_int_form_round_trips_and_no_function_is_named_like_an_op():
    """tuning.to_ints / from_ints (the parameters as a custom op's schema carries them): every op's values of
    every table, overridden too (None, bools, choices), come back as they were; and no function of tuning is
    named like an op (the int form's inverse was ``tuning.decode``, beside the decode op's parameters)."""
    with tuning.overrides({"selection": {"mode": "block", "dq_part": False}, "decode": {"mode": "three"}}):
        for where in tuning.TABLES:
            for op in tuning.KEYS:
                t = tuning.params(op, where)
                ints = tuning.to_ints(op, t)
                assert all(type(i) is int for i in ints) and len(ints) == len(tuning.KEYS[op])
                assert tuning.from_ints(op, ints) == t, (where, op)
    assert not set(tuning.KEYS) & {n for n, f in vars(tuning).items() if callable(f)}


def test_an_override_reaches_the_launch(monkeypatch):
    """The override is what the kernel launch gets (window rows -> BLOCK_M), and the forward fixes
    its backward's parameters: a backward outside the block still uses them."""
    from nsa.backends.triton import attention_bwd, window

    cfg = make_config(HQ=4, H=2, Dk=16, Dv=16, l=8, d=4, l_sel=8, n_sel=3, w=8)
    x = random_inputs(cfg, B=1, T=40, dtype=torch.float32, requires_grad=True)
    seen = []
    for mod, name in ((window, "fwd_kernel"), (attention_bwd, "bwd_dq_kernel")):
        real = getattr(mod, name)

        class Spy:
            def __getitem__(self, grid, real=real):
                return lambda *a, **kw: seen.append(kw["BLOCK_M"]) or real[grid](*a, **kw)

        monkeypatch.setattr(mod, name, Spy())
    with tuning.overrides({"window": {"rows": 32}, "attention_bwd": {"rows": 8}}):
        o = window.sliding_window_attention(x["q"], x["k_win"], x["v_win"], cfg)
    o.sum().backward()
    assert seen == [32 // 2, 8 // 2]  # BLOCK_M = rows // next_pow2(G), G = 2


def test_capability_is_asked_once_per_device(monkeypatch):
    """The table key and the TMA and PDL checks share one capability query per device
    (``utils.capability``), which the launchers make on every call; a device without an index is the
    current one."""
    from nsa.backends.triton import pdl, utils

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: asked.append(i) or {0: (9, 0), 1: (8, 9)}[i])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    utils._capability.cache_clear()
    try:
        assert tuning.key(torch.device("cuda", 0)) == "cuda" and tuning.key(torch.device("cuda")) == "cuda"
        assert utils.capability(0) == (9, 0) and utils.capability(None) == (8, 9)
        assert pdl.pdl_supported(torch.device("cuda", 1)) is False
        assert pdl.pdl_supported(0) is pdl.HAS_GDC
        x = torch.zeros(1, 8, 2, 16)
        assert utils.tma_ok(None, None, 2, 2, x)  # CPU tensors: the interpreter, no query
        assert sorted(asked) == [0, 1]
    finally:
        utils._capability.cache_clear()
