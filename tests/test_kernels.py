"""``python -m experiments.kernels`` through the real CLI (tiny shapes, Triton's interpreter, a temporary
MLflow store): every op checked and timed in one sweep, the tuning table it used, bad tuning keys refused
in one line, a failed check failing its job. In-process: a tuning override reaches the kernel's launch.
The peers of prefill and decode: each reason a row is skipped, recorded on the run."""
from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import entrypoints
import pytest
from entrypoints import one_line, start, wait
from hydra import compose, initialize_config_dir

import experiments.kernels as kernels
from experiments import peers
from experiments.framework import config
from nsa import NSAConfig
from nsa.backends.triton import topn, tuning

OPS = ("selection", "compressed", "topn", "window", "gate", "layer", "decode")
TINY = ("hardware=cpu", "model=tiny", "seq=64", "kernels.cpu_repeats=1")
INTERPRET = {"TRITON_INTERPRET": "1"}
ROWS = {  # the rows each op times here (its peers that need CUDA are skipped, tag skipped_<row>)
    "selection": ["triton", "gather_floor"], "compressed": ["triton"], "topn": ["triton"], "window": ["triton", "sdpa"],
    "gate": ["triton", "torch"],
    "layer": ["default", "separate_gate", "window_first", "separate_gate_window_first", "one_stream",
              "separate_gate_one_stream"],
    "decode": ["nsa", "cmp", "cmp_no_topk", "sel", "win", "combine", "layer", "dense", "module_eager"],
}
SKIPPED = {"selection": {"skipped_flash_nsa": "flash_nsa"},  # not importable, or (where it is) CUDA only
           "compressed": {"skipped_flex": "CUDA", "skipped_cudnn": "needs a CUDA device (cuDNN attention)"},
           "window": {"skipped_fa2": "runs on CUDA devices only"}}
# name: (arguments, environment, texts of the one stderr line)
BAD = {
    "unknown_key": (["op=topn", "tuning.compressed.bogus=1"], INTERPRET, ["tuning.compressed: unknown key 'bogus'"]),
    "unknown_op": (["tuning.nope.rows=1"], INTERPRET, ["tuning: unknown op 'nope'"]),
    "bad_value_in_sweep": (["op=topn", "-m", "tuning.topn.warps=1,0"], INTERPRET,
                           ["tuning.topn.warps=0: must be a positive integer"]),
    "unknown_op_option": (["op=nope"], INTERPRET, ["op=nope: unknown op option"]),
    "no_interpreter": (["op=gate"], {}, ["TRITON_INTERPRET is not set",
                                         "here: TRITON_INTERPRET=1 python -m experiments.kernels op=gate model=tiny seq=64"]),
}
# prefill/decode runs whose fla row cannot run here: (entry, arguments, the reason in tag peer_fla)
G16 = ["model.nsa.n_heads=16", "model.nsa.n_kv_heads=1"]
FLA_AT = ("fla's kernels run on CUDA only" if importlib.util.find_spec("fla") else
          'fla-core is not installed (pip install -e ".[peers]")')
PEER_SKIPS = {
    "decode_small_group": ("decode", ["seq=64", "decode.per_branch=false", "decode.peers=[fla]"],
                           "fla needs G = n_heads / n_kv_heads >= 16"),
    "prefill_l_ne_d": ("prefill", [*G16, "seq=64", "prefill.per_branch=false", "prefill.peers=[fla]"],
                       "fla compresses blocks of l = d = l_sel"),
    "prefill_fla_shape": ("prefill", [*G16, "model.nsa.l=16", "model.nsa.d=16", "seq=64", "prefill.per_branch=false",
                                      "prefill.peers=[fla]"], FLA_AT),
}


def _rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    template = entrypoints.make_template(tmp_path_factory.mktemp("template") / "mlflow.db")
    procs = {}
    tmp = tmp_path_factory.mktemp("ops")
    procs["ops"] = (tmp, start(tmp, "kernels", *TINY, "tuning.selection.mode=block", "tuning.topn.elems=256", "-m",
                               "op=" + ",".join(OPS), template=template, extra_env=INTERPRET))
    tmp = tmp_path_factory.mktemp("check_fails")  # no float32 kernel equals the float64 reference exactly
    procs["check_fails"] = (tmp, start(tmp, "kernels", *TINY, "op=gate", "kernels.tol.float32.rel_l2=0",
                                       template=template, extra_env=INTERPRET))
    for k, (args, env, _) in BAD.items():
        tmp = tmp_path_factory.mktemp(k)
        procs[k] = (tmp, start(tmp, "kernels", *TINY, *args, name=k, extra_env=env))
    tmp = tmp_path_factory.mktemp("prefill_tuning")  # prefill takes the same launch overrides
    procs["prefill_tuning"] = (tmp, start(tmp, "prefill", "hardware=cpu", "model=tiny", "seq=64", "prefill.per_branch=false",
                                          "prefill.backward=false", "tuning.selection.warps=2", "tuning.topn.elems=256",
                                          template=template))
    tmp = tmp_path_factory.mktemp("prefill_bad_tuning")
    procs["prefill_bad_tuning"] = (tmp, start(tmp, "prefill", "hardware=cpu", "model=tiny", "seq=64",
                                              "tuning.selection.wraps=2", name="prefill_bad_tuning"))
    for k, (entry, args, _) in PEER_SKIPS.items():
        tmp = tmp_path_factory.mktemp(k)
        procs[k] = (tmp, start(tmp, entry, "hardware=cpu", "model=tiny", *args, template=template))
    return {k: (tmp, *wait(p, timeout=1200)) for k, (tmp, p) in procs.items()}


def test_every_op_is_checked_then_timed(runs):
    tmp, rc, out, err = runs["ops"]
    assert rc == 0, err[-3000:]
    c, rs = entrypoints.runs(tmp / "mlflow.db", "kernels")
    (parent,) = [r for r in rs if "mlflow.parentRunId" not in r.data.tags]
    kids = {r.data.params["op.name"]: r for r in rs if "mlflow.parentRunId" in r.data.tags}
    assert parent.info.status == "FINISHED" and sorted(kids) == sorted(OPS)
    for op, r in kids.items():
        assert r.info.status == "FINISHED", (op, r.data.tags.get("error"))
        checks = {k: v for k, v in r.data.metrics.items() if k.startswith("check_")}
        assert checks, op  # the check ran and logged its figures, all within float32's tolerance
        assert all(0 <= v <= 1e-4 for v in checks.values()), (op, checks)
        rows = _rows(Path(c.download_artifacts(r.info.run_id, "kernels.csv", str(tmp))))
        assert [x["variant"] for x in rows] == ROWS[op] and all(float(x["fwd_p50_ms"]) > 0 for x in rows)
        assert r.data.metrics["0_fwd_p50_ms"] == float(rows[0]["fwd_p50_ms"])
        for tag, text in SKIPPED.get(op, {}).items():
            assert text in r.data.tags[tag], (op, r.data.tags)
        # the launch parameters it ran with: the interpreter's table and the command line's overrides
        used = json.loads(Path(c.download_artifacts(r.info.run_id, "tuning_table.json", str(tmp))).read_text())
        assert r.data.tags["tuning_table"] == "interpret"
        assert used["selection"]["mode"] == "block" and used["topn"]["elems"] == 256
        assert used["compressed"] == tuning.TABLES["interpret"]["compressed"]
    # decode: the kernels' own token counts for the query at 63 (tiny: l=16, d=8, 4 blocks of 16, w=32)
    rows = {x["variant"]: x for x in _rows(tmp / "out" / "x" / f"{OPS.index('decode')}_op=decode" / "kernels.csv")}
    cmp_, sel, win = (64 - 16) // 8 + 1, 4 * 16, 32
    assert [float(rows[v]["kv_tokens_read_per_step_per_group"]) for v in ("cmp", "sel", "win", "nsa", "dense")] == \
        [cmp_, sel, win, cmp_ + sel + win, 64]


def test_a_failed_check_fails_the_job_before_timing(runs):
    tmp, rc, out, err = runs["check_fails"]
    assert rc == 1, err[-3000:]
    c, (r,) = entrypoints.runs(tmp / "mlflow.db", "kernels")
    assert r.info.status == "FAILED" and "check: o rel-L2" in r.data.tags["error"]
    assert r.data.metrics["check_o_rel_l2"] > 0 and "0_fwd_p50_ms" not in r.data.metrics  # not timed
    assert r.info.run_name == "kernels gate cpu tiny triton seq=64"  # a single run's name says which op


@pytest.mark.parametrize("case", BAD)
def test_bad_kernel_configs_are_one_line_and_exit_2(runs, case):
    tmp, rc, out, err = runs[case]
    lines = one_line(err)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("config error:"), (case, err[-2000:])
    assert all(t in lines[0] for t in BAD[case][2]), lines[0]
    assert not (tmp / "out").exists()


def test_a_tuning_override_reaches_the_launch(monkeypatch):
    """The overrides are in force while the op runs (the top-n launch sees them), and gone after."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen, real = [], topn.topn_rows
    monkeypatch.setattr(topn, "topn_rows", lambda width, n_sel, tune: seen.append(dict(tune)) or real(width, n_sel, tune))
    with initialize_config_dir(config_dir=str(config.CONF_DIR), version_base="1.3"):
        cfg = compose("kernels", overrides=[*TINY, "op=topn", "tuning.topn.elems=256", "tuning.topn.warps=2"])
    res = kernels.work(config.prepare(cfg, "kernels"))
    assert res.failure is None and [r["variant"] for r in res.rows] == ["triton"]
    assert seen and all((t["elems"], t["warps"]) == (256, 2) for t in seen)  # the interpreter's table: 2048, 4
    assert json.loads(res.texts["tuning_table.json"])["topn"] == {"elems": 256, "warps": 2}
    assert tuning.params("topn", "interpret") == tuning.TABLES["interpret"]["topn"]


def test_prefill_takes_tuning_overrides(runs):
    """A layer-level A/B of a launch parameter: prefill applies tuning.<op>.<key> and records it; a key the
    table lacks is refused in one line, exit 2, before anything runs."""
    tmp, rc, out, err = runs["prefill_tuning"]
    assert rc == 0, err[-3000:]
    _, (r,) = entrypoints.runs(tmp / "mlflow.db", "prefill")
    assert r.info.status == "FINISHED"
    assert json.loads(r.data.tags["tuning_overrides"]) == {"selection": {"warps": 2}, "topn": {"elems": 256}}
    tmp, rc, out, err = runs["prefill_bad_tuning"]
    lines = one_line(err)
    assert rc == 2 and len(lines) == 1 and "tuning.selection: unknown key 'wraps'" in lines[0], err[-2000:]
    assert not (tmp / "out").exists()


def test_prefill_applies_the_overrides_while_it_runs(monkeypatch):
    """In-process: the top-n launches inside a prefill job see the override; the table is back after."""
    import experiments.prefill as prefill

    seen, real = [], topn.topn_rows
    monkeypatch.setattr(topn, "topn_rows", lambda width, n_sel, tune: seen.append(dict(tune)) or real(width, n_sel, tune))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with initialize_config_dir(config_dir=str(config.CONF_DIR), version_base="1.3"):
        cfg = compose("prefill", overrides=["hardware=cpu", "model=tiny", "seq=64", "backend=triton",
                                            "prefill.per_branch=false", "prefill.backward=false", "prefill.peers=[]",
                                            "prefill.repeats=1", "prefill.warmup=0", "tuning.topn.elems=256"])
    res = prefill.work(config.prepare(cfg, "prefill"))
    assert res.failure is None and json.loads(res.tags["tuning_overrides"]) == {"topn": {"elems": 256}}
    assert seen and all(t["elems"] == 256 for t in seen)
    assert tuning.params("topn", "interpret") == tuning.TABLES["interpret"]["topn"]


@pytest.mark.parametrize("case", PEER_SKIPS)
def test_a_peer_that_cannot_run_is_skipped_with_its_reason(runs, case):
    tmp, rc, out, err = runs[case]
    entry, _, reason = PEER_SKIPS[case]
    assert rc == 0, err[-3000:]
    c, (r,) = entrypoints.runs(tmp / "mlflow.db", entry)
    assert r.data.tags["peer_fla"].startswith("skipped: ") and reason in r.data.tags["peer_fla"]
    assert reason in err  # and in the log
    rows = _rows(Path(c.download_artifacts(r.info.run_id, f"{entry}.csv", str(tmp))))
    assert "fla" not in {x["variant"] for x in rows}


def test_fla_reasons_in_order():
    """Shape rules first (they hold on any machine), then the installation, then the device."""
    import torch

    base = dict(dim=64, n_heads=16, n_kv_heads=1, d_k=16, d_v=16, l=16, d=16, l_sel=16, n_sel=4, w=32)
    cpu = torch.device("cpu")
    assert "(G=4)" in peers.fla_unavailable(NSAConfig(**{**base, "n_heads": 4}), cpu)
    assert "(G=24)" in peers.fla_unavailable(NSAConfig(**{**base, "n_heads": 24}), cpu)  # not a power of two
    assert "l=32, d=16, l_sel=16" in peers.fla_unavailable(NSAConfig(**{**base, "l": 32}), cpu)
    assert "n_init=2" in peers.fla_unavailable(NSAConfig(**{**base, "n_init": 2}), cpu)
    assert FLA_AT in peers.fla_unavailable(NSAConfig(**base), cpu)
    assert set(peers.BUILD) == set(config.PREFILL_PEERS) and set(config.PEERS) <= set(peers.BUILD)


def test_a_run_that_names_no_peer_says_nothing_of_peers(runs):
    """prefill.peers defaults to none: no `[peers]` line and no peer tag where the user asked for no peer."""
    tmp, rc, out, err = runs["prefill_tuning"]
    assert rc == 0, err[-3000:]
    assert "[peers]" not in out + err
    _, (r,) = entrypoints.runs(tmp / "mlflow.db", "prefill")
    assert not [t for t in r.data.tags if t.startswith("peer_")]


def test_the_correctness_figures_are_on_the_screen_and_in_the_summary(runs):
    """Each op's check against the reference is printed beside its timings, and its worst rel-L2 is a headline."""
    tmp, rc, out, err = runs["ops"]
    assert rc == 0, err[-3000:]
    for op in OPS:
        line = next((ln for ln in (out + err).splitlines()
                     if f"[kernels] op={op} " in ln and "check against the reference" in ln), "")
        assert "rel_l2" in line or "index_mismatch" in line, (op, err[-3000:])
    c, rs = entrypoints.runs(tmp / "mlflow.db", "kernels")
    children = [r for r in rs if "mlflow.parentRunId" in r.data.tags]
    assert children and all(0 <= r.data.metrics["0_check_worst_rel_l2"] < 1e-3 for r in children
                            if any(k.endswith("_rel_l2") for k in r.data.metrics))
