"""experiments.decode with ``decode.ragged=true``: each sequence of the batch at its own context
length L_b in [seq/2, seq] (from ``seed``), the step of row b at position L_b - 1 over L_b keys.

Through the real CLI into a temporary store: the run finishes, its lengths are logged, in range, the same
for a seed and others for another, the rows layer/nsa/dense are there and their token counts are the
literal per-row counts. In-process (float64, the reference): each row's step (layer, forced branch, core,
dense, token counts) equals that sequence stepped alone in a cache of one row holding only its own tokens;
bad values are config errors; the memory estimate."""
from __future__ import annotations

import csv
import json
from pathlib import Path
from types import SimpleNamespace

import entrypoints
import pytest
import torch
from entrypoints import one_line, start, wait
from hydra import compose, initialize_config_dir

from experiments import decode
from experiments.framework import config, hardware
from experiments.measure.branches import ForcedBranch, core, ragged_core
from experiments.measure.dense import dense_attention, dense_attention_ragged, key_mask
from experiments.measure.inputs import cache_inputs, fill_cache, ragged_inputs
from experiments.measure.tokens import ragged_parts, variant_tokens
from nsa import NSAAttention, NSAConfig, reference
from nsa.backends.triton import tuning
from nsa.decode import tokens_read

CONF = Path(__file__).resolve().parent.parent / "conf"
TINY = {"l": 16, "d": 8, "l_sel": 16, "n_sel": 4, "w": 32, "n_kv_heads": 2, "d_k": 16, "d_v": 16}  # conf/model/tiny.yaml
RAGGED = ["hardware=cpu", "decode.ragged=true", "decode.batch=3", "seq=64", "model=tiny"]
BUFFERS = ("k_cmp_raw", "v_cmp_raw", "k_sel", "v_sel", "k_win", "v_win")
PLAN = dict.fromkeys(("cmp", "sel", "win"), "reference")


# ------------------------------------------------------------------------------------------------
# Through the CLI
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """Every process at once (mostly interpreter start-up): a sweep over two seeds, a forced-branch run,
    and two bad values."""
    template = entrypoints.make_template(tmp_path_factory.mktemp("template") / "mlflow.db")
    tmp = {k: tmp_path_factory.mktemp(k) for k in ("sweep", "forced", "not_bool", "seq1")}
    procs = {
        # the sweep names a peer (skipped: a peer takes one length for the batch); the forced run names none
        "sweep": start(tmp["sweep"], "decode", *RAGGED, "decode.peers=[fla]", "-m", "seed=0,1", template=template),
        "forced": start(tmp["forced"], "decode", *RAGGED, "branch_force=sel", "seed=0", template=template),
        "not_bool": start(tmp["not_bool"], "decode", "hardware=cpu", "decode.ragged=maybe", name="nb"),
        "seq1": start(tmp["seq1"], "decode", "hardware=cpu", "decode.ragged=true", "seq=1", name="s1"),
    }
    return {k: (tmp[k], *wait(p)) for k, p in procs.items()}


def _rows(path: Path) -> dict[str, dict]:
    with open(path) as f:
        return {r["variant"]: r for r in csv.DictReader(f)}


def _literal(L: list[int]) -> dict[str, float]:
    """Mean over rows of each variant's key/value tokens per group for the tiny model at lengths L (seq 64):
    cmp = #{i: i*d + l - 1 <= L_b - 1}, win = min(w, L_b); ceil(L_b / l_sel) <= 4 = n_sel blocks, so the
    top-n takes every block and sel reads all L_b tokens; dense reads L_b."""
    def cmp(n):
        return sum(1 for i in range(n) if i * TINY["d"] + TINY["l"] - 1 <= n - 1)

    assert all(-(-n // TINY["l_sel"]) <= TINY["n_sel"] for n in L)
    per = {"cmp": [cmp(n) for n in L], "win": [min(TINY["w"], n) for n in L], "dense": L}
    per["sel"] = [c + n for c, n in zip(per["cmp"], L)]  # the sel row also reads the compressed tokens it scores
    per["nsa"] = per["layer"] = [c + n + w for c, n, w in zip(per["cmp"], L, per["win"])]
    return {v: sum(x) / len(x) for v, x in per.items()}


def _check_job(run, job_dir: Path, seed: int, variants: set[str], peers: bool) -> list[int]:
    m, t = run.data.metrics, run.data.tags
    L = json.loads(t["ragged_lengths"])
    assert L == decode.ragged_lengths(64, 3, seed).tolist()  # reproducible from the seed
    assert len(L) == 3 and all(32 <= n <= 64 for n in L), L
    assert (m["ragged_min_tokens"], m["ragged_max_tokens"]) == (min(L), max(L))
    assert m["ragged_mean_tokens"] == pytest.approx(sum(L) / 3)
    assert t.get("ragged_skipped") == ("peers" if peers else None) and "peer_fla" not in t
    rows = _rows(job_dir / "decode.csv")
    assert set(rows) == variants
    exp = _literal(L)
    for v, r in rows.items():
        assert (r["seq_tokens"], r["batch_seqs"], r["ragged"], r["step_path"]) == ("64", "3", "True", "module")
        assert float(r["ragged_mean_tokens"]) == pytest.approx(sum(L) / 3)
        what = "sel" if v in ("layer", "nsa") and r["branch_force"] == "sel" else v
        tok = float(r["kv_tokens_read_per_step_per_group"])
        assert tok == pytest.approx(exp[what]), (seed, v, tok, exp[what])
        # summed over rows and groups: tokens x groups x batch x (Dk + Dv) x 4 bytes (float32)
        assert int(r["kv_bytes_read_per_step"]) == round(exp[what] * 3) * TINY["n_kv_heads"] * 32 * 4
        # the paper's count per row, averaged: equal to the count here (seq <= n_sel * l_sel, whole blocks of
        # compressed tokens; the sel row's formula counts its scoring too)
        assert float(r["kv_tokens_formula_per_step_per_group"]) == pytest.approx(exp[what])
        assert 0 < float(r["p20_ms"]) <= float(r["p50_ms"]) <= float(r["p80_ms"])
    return L


def test_ragged_sweep_logs_lengths_and_counts_per_row(cli):
    tmp, rc, out, err = cli["sweep"]
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    c, rs = entrypoints.runs(tmp / "mlflow.db", "decode")
    kids = {int(r.data.params["seed"]): r for r in rs if "mlflow.parentRunId" in r.data.tags}
    assert sorted(kids) == [0, 1] and all(r.info.status == "FINISHED" for r in rs)
    all_rows = {"layer", "nsa", "cmp", "sel", "win", "dense"}
    lens = {s: _check_job(kids[s], tmp / "out" / "x" / f"{s}_seed={s}", s, all_rows, True) for s in kids}  # job s: seed s
    assert lens[0] != lens[1]  # another seed, other lengths
    assert kids[0].data.params["decode.ragged"] == "True"
    assert "ragged: peers ['fla'] skipped" in err and "ragged: context lengths" in err
    assert err.count("skipped (they take one length") == 2  # once per job


def test_ragged_forced_branch_has_layer_nsa_dense(cli):
    tmp, rc, out, err = cli["forced"]
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    _, (run,) = entrypoints.runs(tmp / "mlflow.db", "decode")
    assert run.info.status == "FINISHED"
    _check_job(run, tmp / "out" / "x", 0, {"layer", "nsa", "dense"}, False)
    assert "[peers]" not in err and "ragged: peers" not in err  # no peer named, none mentioned
    assert run.data.tags["backends_ran"] == "cmp=reference,sel=reference"  # win skipped when sel is forced


@pytest.mark.parametrize("case,needle", [("not_bool", "decode.ragged='maybe': must be true or false"),
                                         ("seq1", "decode.ragged=true: seq=1 must be >= 2")])
def test_bad_ragged_values_exit_2_with_one_line(cli, case, needle):
    tmp, rc, out, err = cli[case]
    lines = one_line(err)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("config error:") and needle in lines[0], err[-2000:]
    assert not (tmp / "out").exists()


# ------------------------------------------------------------------------------------------------
# In-process
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def _hydra():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


def test_lengths_are_uniform_integers_in_half_seq_to_seq():
    for seq in (2, 7, 64, 101):
        L = decode.ragged_lengths(seq, 500, 3)
        assert L.dtype == torch.int64 and L.shape == (500,)
        assert int(L.min()) == (seq + 1) // 2 and int(L.max()) == seq  # both ends drawn (500 draws)
        assert torch.equal(L, decode.ragged_lengths(seq, 500, 3))
    assert not torch.equal(decode.ragged_lengths(1000, 8, 0), decode.ragged_lengths(1000, 8, 1))
    state = torch.get_rng_state()
    decode.ragged_lengths(64, 4, 0)
    assert torch.equal(state, torch.get_rng_state())  # the global generator (the cache's fill) untouched


@pytest.mark.parametrize("over,needle", [
    (["decode.ragged=1"], "decode.ragged=1: must be true or false"),
    (["decode.ragged=yes"], "decode.ragged='yes': must be true or false"),
    (["decode.ragged=true", "seq=1"], "seq=1 must be >= 2"),
])
def test_bad_ragged_values_are_config_errors(_hydra, over, needle):
    with pytest.raises(config.ConfigError) as e:
        config.prepare(compose(config_name="decode", overrides=["hardware=cpu", *over]), "decode", check=decode.check_config)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert config.prepare(compose(config_name="decode", overrides=["hardware=cpu", "decode.ragged=true", "seq=2"]),
                          "decode", check=decode.check_config).cfg.decode.ragged is True


def test_memory_estimate_adds_only_the_mask_and_scores(_hydra, monkeypatch):
    """On the module path (CPU) and the GraphDecoder path (a faked H100): ragged differs from the uniform job
    only in the dense part (the key mask, its float form, the scores; nothing repeated), and no peer."""
    jobs = {}
    for r in ("false", "true"):
        jobs[r] = config.prepare(compose(config_name="decode", overrides=["hardware=cpu", "decode.batch=3", "seq=64",
                                                                          f"decode.ragged={r}"]), "decode")
    u, g = decode.memory_parts(jobs["false"]), decode.memory_parts(jobs["true"])
    B, S, HQ = 3, 64, 4
    assert {k: v for k, v in g.items() if k != "dense"} == {k: v for k, v in u.items() if k != "dense"}
    assert g["dense"] == B * S * (1 + 4) + 2 * B * HQ * S * 4 < u["cache"] / 4
    monkeypatch.setattr(hardware, "_DETECTED", hardware.Device("cuda", "NVIDIA H100 80GB HBM3", (9, 0), "570", 1))
    monkeypatch.setattr(config, "check_backends", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(tuning, "capability", lambda device=None: (9, 0))  # tuning's table for the device
    for r in ("false", "true"):
        jobs[r] = config.prepare(compose(config_name="decode", overrides=[
            "model=h200bench", "decode.batch=256", "seq=8192", f"decode.ragged={r}"]), "decode")
    assert decode.uses_decoder(jobs["true"])
    u, g = decode.memory_parts(jobs["false"]), decode.memory_parts(jobs["true"])
    assert {k: v for k, v in g.items() if k not in ("dense", "peers")} == \
        {k: v for k, v in u.items() if k not in ("dense", "peers")}
    assert g["peers"] == 0 and g["dense"] == 256 * 8192 * 5 + 2 * 256 * 64 * 8192 * 4  # about 1 GiB
    assert sum(g.values()) < 15 * 2**30


def _setup(S=160, B=4, seed=5):
    """A float64 layer with more selection blocks than n_sel at every length, its cache filled to S-1 as the
    experiment fills it, then row b at length L_b - 1; the step's input xs."""
    c = NSAConfig(dim=64, n_heads=4, n_kv_heads=2, d_k=16, d_v=16, l=16, d=8, l_sel=16, n_sel=4, w=32, n_init=1,
                  n_local=2, phi="mlp", gate_hidden=16, phi_hidden=32)
    torch.manual_seed(0)
    layer = NSAAttention(c).double().eval()
    cache = layer.new_cache(B, S)
    fill_cache(layer, cache, S - 1, 64)
    L = decode.ragged_lengths(S, B, seed)
    assert len(set(L.tolist())) == B  # really ragged
    cache.lengths = L - 1
    xs = torch.randn(B, 1, c.dim, dtype=torch.float64)
    return c, layer, cache, L, xs


def _alone(layer, cache, b: int, n: int):
    """Row b's first n tokens (and the compressed tokens they complete) in a new cache of one row."""
    c = layer.config
    one = layer.new_cache(1, cache.max_len)
    for name in BUFFERS:
        getattr(one, name)[:, :n] = getattr(cache, name)[b:b + 1, :n]
    nc = c.n_cmp(n)
    one.k_cmp[:, :nc], one.v_cmp[:, :nc] = cache.k_cmp[b:b + 1, :nc], cache.v_cmp[b:b + 1, :nc]
    one.length = n
    return one


@torch.no_grad()
def test_each_rows_step_equals_its_sequence_stepped_alone():
    """The module path's ragged step, row by row, against the same sequence in a cache of its own at
    length L_b - 1 (only its own tokens in it): the layer (the module's forward on the ragged cache), each
    forced branch (measure.branches.ForcedBranch), the attention core (measure.branches.ragged_core: nsa and each branch), the
    masked dense baseline, and the token counts (measure.tokens.ragged_parts vs nsa.decode.tokens_read of the
    reference top-n of each row alone, and the literal cmp and win counts)."""
    c, layer, cache, L, xs = _setup()
    B = cache.batch_size
    alone = [_alone(layer, cache, b, int(L[b]) - 1) for b in range(B)]
    for variant in ("none", "cmp", "sel", "win"):
        step = layer if variant == "none" else ForcedBranch(layer, variant)
        cache.lengths = L - 1
        y = step(xs, cache)
        assert torch.equal(cache.lengths, L) and cache.ragged
        for b, one in enumerate(alone):
            one.length = int(L[b]) - 1
            y1 = step(xs[b:b + 1], one)
            torch.testing.assert_close(y[b], y1[0], rtol=1e-12, atol=1e-12, msg=f"{variant} row {b}")
    rows = ragged_inputs(layer, cache, xs)
    assert [x.q_start for x in rows] == (L - 1).tolist()
    ones = [cache_inputs(layer, one, xs[b:b + 1]) for b, one in enumerate(alone)]
    for variant in ("none", "cmp", "sel", "win"):
        o = ragged_core(variant, rows, c, PLAN, None)
        for b, x1 in enumerate(ones):
            o1 = core(variant, x1, c, PLAN, None)
            torch.testing.assert_close(o[b], o1[0], rtol=1e-12, atol=1e-12, msg=f"core {variant} row {b}")
    q_all = torch.cat([x.q for x in rows])
    S = cache.max_len
    od = dense_attention_ragged(q_all, cache.k_win[:, :S], cache.v_win[:, :S], key_mask(L, S, "cpu"))
    for b, x1 in enumerate(ones):
        o1 = dense_attention(x1.q, x1.k_win, x1.v_win, causal=False)  # its own L_b keys, no mask
        assert x1.k_win.shape[1] == int(L[b])
        torch.testing.assert_close(od[b], o1[0], rtol=1e-12, atol=1e-12, msg=f"dense row {b}")
    parts = ragged_parts(rows, c, PLAN, None)
    per_row = []
    for b, (one, x1) in enumerate(zip(alone, ones)):
        n = int(L[b])
        nc = c.n_cmp(n)
        _, idx = reference.compressed_branch(x1.q, one.k_cmp[:, :nc], one.v_cmp[:, :nc], c, q_start=n - 1, n_keys=n)
        want = tokens_read(c, n, idx)  # [1,H] per branch
        for br in ("cmp", "sel", "win"):
            assert torch.equal(parts[br][b, 0], want[br][0]), (b, br, parts[br][b], want[br])
        assert parts["cmp"][b, 0].tolist() == [sum(1 for i in range(n) if i * c.d + c.l - 1 <= n - 1)] * 2
        assert parts["win"][b, 0].tolist() == [min(c.w, n)] * 2
        assert (parts["sel"][b, 0] < n).all()  # more blocks than n_sel: a real top-n
        per_row.append(float(want["read"].double().mean()))
    # the batch's figure as the CSV reports it: the mean over rows and groups of each row's own count
    assert float(variant_tokens("nsa", parts).double().mean()) == pytest.approx(sum(per_row) / B)
