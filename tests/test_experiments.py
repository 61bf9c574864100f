"""The entry points for real: subprocesses of ``python -m experiments.<name>`` into a temporary
SQLite tracking store, checked through mlflow.MlflowClient and the CSVs they write."""
from __future__ import annotations

import csv
from pathlib import Path

import entrypoints
import pytest
from entrypoints import start as _start
from entrypoints import wait as _wait
from mlflow import MlflowClient

TINY = {"l": 16, "d": 8, "l_sel": 16, "n_sel": 4, "w": 32, "n_kv_heads": 2, "d_k": 16, "d_v": 16}  # conf/model/tiny.yaml


def _runs(tmp: Path, entry: str):
    return entrypoints.runs(tmp / "mlflow.db", entry)


def _rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def _artifacts(c, rid):
    return {a.path for a in c.list_artifacts(rid)}


@pytest.fixture(scope="module")
def template_db(tmp_path_factory):
    return entrypoints.make_template(tmp_path_factory.mktemp("template") / "mlflow.db")


# Each path a bad config can take: the command-line pre-check (group options), a single run's
# validation, a sweep's validation of every job before anything starts. More cases: test_conf.py.
BAD = {
    "l_not_multiple_of_d": (["model.nsa.l=20"], "NSAConfig.l=20"),
    "seq_below_1_in_sweep": (["-m", "seq=64,0"], "seq=0"),
    "unknown_backend": (["backend=nope"], "backend=nope"),
    "mismatched_hardware": (["hardware=h100", "backend.win=reference"], "hardware=h100 does not match"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, template_db):
    """Start every subprocess at once (the runs are mostly interpreter start-up)."""
    tmp = {k: tmp_path_factory.mktemp(k) for k in ("sweep", "failing", "prefill", "parity", "bad")}
    procs = {f"bad_{k}": _start(tmp["bad"], "decode", *a, name=k) for k, (a, _) in BAD.items()}
    procs |= {
        # seq 72: the newest selection block is partial (72 = 4*16 + 8); 128: blocks are complete.
        "sweep": _start(tmp["sweep"], "decode", "-m", "seq=72,128", name=None, template=template_db),
        # A real per-job failure: the 256-token job's tensors exceed the memory guard, the 64 one fits.
        "failing": _start(tmp["failing"], "decode", "-m", "seq=64,256", "limits.max_memory_gib=0.0005",
                          "decode.per_branch=false", template=template_db),
        "prefill": _start(tmp["prefill"], "prefill", "seq=48", "branch_force=sel", "prefill.profile=true",
                          template=template_db),
        # Two parity jobs: default tolerances (passes), and one no float32 result can meet (fails).
        "parity": _start(tmp["parity"], "parity", "-m", "seq=64", "parity.tol.float32.max_abs=1e-5,1e-12",
                         template=template_db),
    }
    return {k: (tmp[k.split("_")[0]], *_wait(p)) for k, p in procs.items()}


def test_sweep_gives_one_parent_and_finished_children(runs):
    tmp, rc, _out, err = runs["sweep"]
    assert rc == 0, err[-3000:]
    c, rs = _runs(tmp, "decode")
    parents = [r for r in rs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in rs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 2
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    # the parent's name says what its jobs share (hardware, model, backend; auto: what it chose) and what they sweep
    assert parent.info.run_name == "decode sweep auto(cpu) tiny auto(reference) seq=72,128", parent.info.run_name
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    assert sorted(int(r.data.params["seq"]) for r in children) == [72, 128]
    for r in children:
        assert r.info.status == "FINISHED"
        m, t = r.data.metrics, r.data.tags
        # Headline metrics (sorted first); every variant's columns are in the CSV (next test).
        for k in ("nsa_p50_ms", "dense_p50_ms", "nsa_speedup_vs_dense_x", "layer_p50_ms", "nsa_kv_gb_per_s"):
            assert f"0_{k}" in m, k
        assert m["seq"] == int(r.data.params["seq"]) and "framework_overhead_s" in m
        assert t["hardware_profile"] == "cpu" and t["device_type"] == "cpu"
        assert t["backends_ran"] == "cmp=reference,sel=reference,win=reference" and t["fallbacks"] == "none"
        for k in ("torch_version", "triton_version", "cuda_version", "flash_attn_version", "python_version",
                  "git_commit", "git_dirty", "toolchain", "device_name", "device_capability", "device_driver"):
            assert t.get(k), k
        assert r.data.params["model.nsa.l_sel"] == "16" and r.data.params["backend.sel"] == "reference"
        assert {"decode.csv", "config.yaml", "environment.json"} <= _artifacts(c, r.info.run_id)
    assert {"decode_sweep.csv", "decode_vs_seq.png"} <= _artifacts(c, parent.info.run_id)
    assert "overhead per job" in err


def _expected_tokens(S: int) -> dict:
    """Independent count for the decode step at t = S-1 of the tiny model (spec steps 1-6)."""
    t = S - 1
    cmp = (S - TINY["l"]) // TINY["d"] + 1 if S >= TINY["l"] else 0
    n_cand = t // TINY["l_sel"] + 1
    assert n_cand > TINY["n_sel"]  # so the newest (possibly partial) block is always among the selected
    newest = S - (n_cand - 1) * TINY["l_sel"]
    sel = (TINY["n_sel"] - 1) * TINY["l_sel"] + newest
    return {"cmp": cmp, "sel": cmp + sel, "win": min(TINY["w"], S), "nsa": cmp + sel + min(TINY["w"], S),
            "dense": S}


def test_decode_csv_columns_mean_what_they_say(runs):
    tmp = runs["sweep"][0]
    (sweep_dir,) = (tmp / "outputs" / "decode").glob("multirun_*")  # the configured default location
    job_dirs = sorted(p for p in sweep_dir.glob("*_seq*") if p.is_dir())
    assert [p.name for p in job_dirs] == ["0_seq=72", "1_seq=128"]
    assert {"decode_sweep.csv", "decode_vs_seq.png", "multirun.yaml"} <= {p.name for p in sweep_dir.iterdir()}
    for job_dir in job_dirs:
        rows = {r["variant"]: r for r in _rows(job_dir / "decode.csv")}
        S = int(rows["nsa"]["seq_tokens"])
        exp = _expected_tokens(S)
        exp["layer"] = exp["nsa"]
        for v, r in rows.items():
            tok = float(r["kv_tokens_read_per_step_per_group"])
            assert tok == exp[v], (S, v, tok, exp[v])
            # bytes: tokens x groups x batch x (Dk + Dv) x 4 bytes (float32)
            assert int(r["kv_bytes_read_per_step"]) == exp[v] * TINY["n_kv_heads"] * int(r["batch_seqs"]) * \
                (TINY["d_k"] + TINY["d_v"]) * 4
            p20, p50, p80 = (float(r[k]) for k in ("p20_ms", "p50_ms", "p80_ms"))
            assert 0 < p20 <= p50 <= p80
            assert float(r["kv_gb_per_s"]) == pytest.approx(int(r["kv_bytes_read_per_step"]) / (p50 * 1e-3) / 1e9)
            assert float(r["kv_bw_roofline_pct"]) == pytest.approx(100 * float(r["kv_gb_per_s"]) / 20.0)
            if v != "dense":  # dense vs itself would be 1 by definition: no column value
                assert float(r["speedup_vs_dense_x"]) == pytest.approx(float(rows["dense"]["p50_ms"]) / p50)
        # The paper's formula beside the count: equal with complete blocks, larger with a partial one.
        assert {r["step_path"] for r in rows.values()} == {"module"}  # a CPU: the module's forward, no graphs
        f = int(rows["nsa"]["kv_tokens_formula_per_step_per_group"])
        assert f == (S - 16) // 8 + 1 + min(64, S) + min(32, S)
        assert (f == exp["nsa"]) == (S % TINY["l_sel"] == 0)
        assert all(c.endswith(("_ms", "_tokens", "_seqs", "_per_group", "_per_step", "_per_s", "_pct", "_x"))
                   or c in ("variant", "branch_force", "backend_cmp", "backend_sel", "backend_win", "dtype", "step_path")
                   for c in rows["nsa"])


def test_failing_job_fails_alone(runs):
    tmp, rc, _out, err = runs["failing"]
    assert rc != 0
    c, rs = _runs(tmp, "decode")
    parent = [r for r in rs if "mlflow.parentRunId" not in r.data.tags]
    children = {int(r.data.params["seq"]): r for r in rs if "mlflow.parentRunId" in r.data.tags}
    assert len(parent) == 1 and parent[0].info.status == "FAILED" and "1 of 2 jobs failed" in parent[0].data.tags["error"]
    assert children[64].info.status == "FINISHED"
    assert children[256].info.status == "FAILED"
    assert "limits.max_memory_gib" in children[256].data.tags["error"]
    assert "error.txt" in _artifacts(c, children[256].info.run_id)
    assert all(r.info.status != "RUNNING" for r in rs)
    assert "Traceback" not in err


def test_parity_passes_and_fails_on_its_tolerances(runs):
    tmp, rc, _out, err = runs["parity"]
    assert rc != 0 and "Traceback" not in err
    c, rs = _runs(tmp, "parity")
    kids = {r.data.params["parity.tol.float32.max_abs"]: r for r in rs if "mlflow.parentRunId" in r.data.tags}
    ok, bad = kids["1e-05"], kids["1e-12"]
    assert ok.info.status == "FINISHED" and ok.data.metrics["parity_failures"] == 0
    for k in ("out", "out_no_grad", "grad_q", "grad_k_cmp", "grad_v_cmp", "grad_k_sel", "grad_v_sel", "grad_k_win",
              "grad_v_win", "grad_gates"):
        assert ok.data.metrics[f"{k}_rel_l2_err"] < 1e-5, k
        assert ok.data.metrics[f"{k}_max_abs_err"] == bad.data.metrics[f"{k}_max_abs_err"]  # same inputs
    assert ok.data.metrics["index_mismatch_frac"] == 0
    # Over tolerance: everything logged first, then the run fails.
    assert bad.info.status == "FAILED" and "over tolerance" in bad.data.tags["error"]
    assert bad.data.metrics["parity_failures"] > 0 and "parity.csv" in _artifacts(c, bad.info.run_id)
    assert all(r.info.status != "RUNNING" for r in rs)


def test_prefill_forced_branch(runs):
    tmp, rc, _out, err = runs["prefill"]
    assert rc == 0, err[-3000:]
    rows = {r["variant"]: r for r in _rows(tmp / "out" / "x" / "prefill.csv")}
    assert set(rows) == {"nsa", "dense"} and rows["nsa"]["branch_force"] == "sel"
    S, HQ = 48, 4
    dense_flop = 2 * (TINY["d_k"] + TINY["d_v"]) * HQ * S * (S + 1) / 2
    assert float(rows["dense"]["attn_fwd_flop"]) == dense_flop
    for r in rows.values():
        assert float(r["fwd_tflop_per_s"]) == pytest.approx(float(r["attn_fwd_flop"]) / (float(r["fwd_p50_ms"]) * 1e-3) / 1e12)
    c, rs = _runs(tmp, "prefill")
    assert len(rs) == 1 and "mlflow.parentRunId" not in rs[0].data.tags  # a single run has no parent
    assert rs[0].info.status == "FINISHED"
    assert rs[0].data.tags["backends_ran"] == "cmp=reference,sel=reference"  # win skipped when sel is forced
    assert {"prefill.csv", "config.yaml", "environment.json"} <= _artifacts(c, rs[0].info.run_id)
    # prefill.profile=true: one profiled forward and forward+backward of the NSA row, logged as tables
    prof = {a.path for a in c.list_artifacts(rs[0].info.run_id, "profile")}
    assert prof == {"profile/nsa_fwd.txt", "profile/nsa_fwd_bwd.txt"}
    assert "profile/nsa_fwd_bwd.txt:" in _out + err and "Self CPU" in _out + err  # printed too


def test_bad_configs_exit_with_one_line(runs):
    for k in BAD:
        tmp, rc, _out, err = runs[f"bad_{k}"]
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc != 0, k
        assert len(lines) == 1 and lines[0].startswith("config error:") and BAD[k][1] in lines[0], (k, err)
        # a GPU profile on this CPU: the profiles that run here (strict=false would be refused: never timed)
        assert "use hardware=cpu or hardware=auto on this machine" in lines[0] or k != "mismatched_hardware"
        assert not (tmp / "out" / k).exists(), k  # no half-written output
    db = tmp / "mlflow.db"
    if db.exists():  # no run at all (in particular none RUNNING)
        c = MlflowClient(tracking_uri=f"sqlite:///{db}")
        assert all(not c.search_runs([e.experiment_id]) for e in c.search_experiments())


def test_prefill_dense_variants():
    """dense_flash (SDPA forced to FlashAttention-2) is timed on CUDA only, and a shape it cannot run
    (Dk != Dv) is skipped with a note that becomes a run tag, not a failed job."""
    from experiments.prefill import dense_variants
    from nsa import NSAConfig

    same = NSAConfig(dim=64, n_heads=4, n_kv_heads=2, d_k=16, d_v=16)
    paper = NSAConfig(dim=64, n_heads=4, n_kv_heads=2, d_k=24, d_v=16)
    assert dense_variants(True, same, "cuda") == (["dense", "dense_flash"], {})
    assert dense_variants(True, same, "cpu") == (["dense"], {})
    assert dense_variants(False, same, "cuda") == (["dense"], {})
    names, tags = dense_variants(True, paper, "cuda")
    assert names == ["dense"] and "d_k == d_v (got 24/16)" in tags["dense_flash"]


def test_sweep_first_look_in_mlflow(runs):
    """What the MLflow UI shows first , and the job logs and timings."""
    import re

    tmp, rc, out, err = runs["sweep"]
    assert rc == 0, err[-3000:]
    c, rs = _runs(tmp, "decode")
    parent = next(r for r in rs if "mlflow.parentRunId" not in r.data.tags)
    kids = [r for r in rs if "mlflow.parentRunId" in r.data.tags]
    exp = c.get_experiment(parent.info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # the runs view, not GenAI traces
    for r in kids:
        # headline first, no 57 charts: 7 headlines (latency, speedup, what NSA reads and its HBM floor) and a few more
        assert min(r.data.metrics).startswith("0_") and len(r.data.metrics) <= 12
        assert (r.data.params["backend"], r.data.params["model"]) == ("auto", "tiny")  # the group choices
        assert int(r.data.params["decode.repeats"]) > 5  # the tiny model's p50 from more than 5 samples
        assert "config.yaml" in _artifacts(c, r.info.run_id)
    # The parent's own charts are the sweep's lines: one metric per (column, variant), stepped by seq.
    for key in ("p50_ms/nsa", "p50_ms/dense", "speedup_vs_dense_x/nsa", "speedup_vs_dense_x/sel",
                "kv_tokens_read_per_step_per_group/nsa", "kv_tokens_read_per_step_per_group/dense",
                "kv_bytes_read_per_step/sel", "hbm_floor_ms/nsa", "kv_bw_roofline_pct/win"):
        assert sorted(m.step for m in c.get_metric_history(parent.info.run_id, key)) == [72, 128], key
    assert "speedup_vs_dense_x/dense" not in parent.data.metrics  # dense vs itself means nothing
    # sweep_wall_s is the time the console reports
    said = float(re.search(r"sweep FINISHED: 2 jobs, 0 failed, ([\d.]+) s", err).group(1))
    assert round(parent.data.metrics["sweep_wall_s"], 1) == said
    # Per-job logs through logging: Hydra's <entry>.log of each job holds its lines.
    (sweep_dir,) = (tmp / "outputs" / "decode").glob("multirun_*")
    for job_dir in (d for d in sweep_dir.glob("*_seq*") if d.is_dir()):
        text = (job_dir / "decode.log").read_text()
        assert "[decode] seq=" in text and "FINISHED in" in text
