"""``python -m experiments.train`` through the real CLI: the documented commands as written (the CPU
smoke run and sweep: a falling loss, per-step curves, the parent's curves by step), a run killed with
SIGKILL and resumed into the same MLflow run (each step once, bit for bit the uninterrupted run's), a
sweep stopped by its time limit and resumed from its jobs' checkpoints, and the refusals to continue a
run. The rules for continuing a run, in-process at the end; config errors: tests/test_lm_conf.py."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import entrypoints
import pytest
from entrypoints import argv, documented_commands, one_line, start, wait
from mlflow import MlflowClient
from omegaconf import OmegaConf

from experiments.framework import ConfigError, tracking
from experiments.framework.job import _earlier_run
from experiments.lm import checkpoint

SMOKE = "python -m experiments.train train=smoke"
SWEEP = "python -m experiments.train -m attention=nsa,dense train=smoke"
STEPS, CKPT_EVERY = 60, 20  # conf/train/smoke.yaml
KILL_AFTER = 25             # logged steps before the kill: past the checkpoint at step 20
SHORT = ["-m", "attention=nsa,dense", "train=smoke", "train.steps=3"]
# Documented commands that train for minutes (needles_smoke, text_smoke: up to 10 on 2 cores) run as written with a
# shortened schedule appended: the same preset, groups, sweep and store, 4 steps with one evaluation.
SHORTENED = {"train=needles_smoke": ("train.steps=4", "train.eval_every=2", "train.log_every=1", "train.ckpt_every=4"),
             "train=text_smoke": ("train.steps=4", "train.eval_every=2", "train.log_every=1", "train.ckpt_every=4",
                                  "train.eval_batches=1")}


def _shortened(cmd: str) -> tuple[str, ...]:
    return next((extra for key, extra in SHORTENED.items() if key in cmd.split()), ())


def train_commands() -> list[str]:
    # lm=hf needs the [hf] extra: tests/test_hf.py runs those commands; the SLURM ones run in tests/test_cluster.py
    return [c for c in documented_commands() if argv(c)[0][1] == "experiments.train" and "lm=hf" not in c.split()
            and "hydra/launcher=slurm" not in c.split()]


def _runs(tmp: Path):
    return entrypoints.runs(tmp / "mlflow.db", "train")


def _curve(c, rid: str, key: str = "loss") -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in c.get_metric_history(rid, key))


def _wait_for_steps(db: Path, n: int, p: subprocess.Popen, timeout: float = 240) -> int:
    """Poll the store until the (single) running run has logged step n; the last step seen."""
    c, t0 = MlflowClient(tracking_uri=f"sqlite:///{db}"), time.monotonic()
    while time.monotonic() - t0 < timeout:
        assert p.poll() is None, p.communicate()[1][-3000:]
        exp = c.get_experiment_by_name("nsa-train")
        for r in c.search_runs([exp.experiment_id]) if exp else []:
            last = max((m.step for m in c.get_metric_history(r.info.run_id, "loss")), default=0)
            if last >= n:
                return last
        time.sleep(0.2)
    raise AssertionError(f"no run logged step {n} in {timeout} s")


def _as_written(tmp: Path, cmd: str, *extra: str) -> subprocess.Popen:
    """A documented command as written (plus ``extra``), in tmp: the default store and outputs there."""
    args, extra_env = argv(cmd)
    return subprocess.Popen([sys.executable, *args, *extra], cwd=tmp, env=entrypoints.env(**extra_env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill_and_resume(tmp: Path) -> dict:
    """The documented smoke run, killed with SIGKILL once step KILL_AFTER is logged, then resumed as the
    README says: the same command with hydra.run.dir=<its output directory>. Once finished, the same
    again (refused), and with a config its checkpoint does not match (refused)."""
    entrypoints.make_template(tmp / "mlflow.db")  # the poll then never creates tables beside the run
    p = _as_written(tmp, SMOKE)
    seen = _wait_for_steps(tmp / "mlflow.db", KILL_AFTER, p)
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait(timeout=60) == -signal.SIGKILL
    (out_dir,) = (tmp / "outputs" / "train").iterdir()
    c, (killed,) = _runs(tmp)
    out = {"killed": (tmp, seen, killed, _curve(c, killed.info.run_id), checkpoint.peek(out_dir / "ckpt"), out_dir),
           SMOKE: (tmp, *wait(_as_written(tmp, SMOKE, f"hydra.run.dir={out_dir}")))}
    again = {"again": _as_written(tmp, SMOKE, f"hydra.run.dir={out_dir}"),
             "other_lr": _as_written(tmp, SMOKE, "train.lr=1e-3", f"hydra.run.dir={out_dir}")}
    return out | {k: (tmp, *wait(p)) for k, p in again.items()}


def _time_limit(tmp: Path, template: Path) -> dict:
    """A sweep stopped by its time limit after one step, then resumed from its jobs' checkpoints with
    the limit lifted."""
    stopped = (tmp, *wait(start(tmp, "train", *SHORT, "train.time_limit_s=1e-9", name="sw", template=template)))
    rs = _runs(tmp)[1]
    parent = next(r for r in rs if "mlflow.parentRunId" not in r.data.tags).info.run_id
    return {"stopped": (*stopped, parent, rs),
            "continued": (tmp, *wait(start(tmp, "train", *SHORT, "train.time_limit_s=null",
                                           f"hydra.sweeper.resume={parent}", name="sw")))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Everything at once (on 2 cores, mostly interpreter start-up and seconds of training each): the
    documented commands as written, the kill/resume and the time-limit sequences (each in a thread,
    waiting on its own steps). name -> (tmp, rc, stdout, stderr, ...)."""
    template = entrypoints.make_template(tmp_path_factory.mktemp("template") / "mlflow.db")
    dirs = {cmd: tmp_path_factory.mktemp("doc") for cmd in train_commands()}
    for tmp in dirs.values():
        shutil.copy(template, tmp / "mlflow.db")
    # As written, each in a directory of its own (default store and outputs); the smoke run is the one killed.
    procs = {cmd: (tmp, _as_written(tmp, cmd, *_shortened(cmd))) for cmd, tmp in dirs.items() if cmd != SMOKE}
    with ThreadPoolExecutor(2) as pool:
        seqs = [pool.submit(_kill_and_resume, dirs[SMOKE]),
                pool.submit(_time_limit, tmp_path_factory.mktemp("time_limit"), template)]
        out = {k: (tmp, *wait(p)) for k, (tmp, p) in procs.items()}
        for f in seqs:
            out |= f.result()
    return out


def test_documented(runs):
    cmds = train_commands()
    assert SMOKE in cmds and SWEEP in cmds and any("hardware=h200" in c for c in cmds), cmds
    assert all(any(k in c.split() for c in cmds) for k in SHORTENED), cmds  # no stale entry
    for cmd in cmds:
        tmp, rc, _out, err = runs[cmd]
        if "hardware=h200" in cmd:  # here: refused before anything starts, in one line
            assert rc == 2 and one_line(err) == [
                "config error: hardware=h200 does not match the detected device " + err.split("detected device ")[1].strip()]
            assert not (tmp / "outputs").exists()
        else:
            assert rc == 0 and "Traceback" not in err, err[-3000:]


def test_smoke_run_learns_and_logs_every_step(runs):
    tmp, rc, _out, err = runs[SMOKE]  # the documented run, killed and resumed (next tests): its whole curve
    assert rc == 0, err[-3000:]
    c, (r,) = _runs(tmp)
    assert r.info.status == "FINISHED" and "mlflow.parentRunId" not in r.data.tags
    loss = _curve(c, r.info.run_id)
    assert [s for s, _ in loss] == list(range(1, STEPS + 1))
    # Byte-level text: ln 256 = 5.5 at the start; measured 2.9 at step 60. A model that does not learn stays near 5.5.
    first, last = sum(v for _, v in loss[:5]) / 5, sum(v for _, v in loss[-5:]) / 5
    assert first > 5.0 and last < first - 2.0, (first, last)
    m, params = r.data.metrics, r.data.params
    assert m["0_final_loss"] == loss[-1][1] and m["0_val_accuracy"] == _curve(c, r.info.run_id, "val_accuracy")[-1][1]
    assert {"0_tokens_per_s", "0_val_loss", "0_sel_recall", "0_sel_mass"} <= set(m) and m["0_tokens_per_s"] > 0
    assert [s for s, _ in _curve(c, r.info.run_id, "val_accuracy")] == [20, 40, 60]
    assert [s for s, _ in _curve(c, r.info.run_id, "sel_recall")] == [20, 40, 60]
    for key in ("accuracy", "tokens_per_s", "rss_peak_gib", "gate_cmp", "gate_sel", "gate_win", "grad_norm", "lr"):
        assert len(_curve(c, r.info.run_id, key)) == STEPS, key
    counts = {k.split(".", 1)[1]: int(v) for k, v in params.items() if k.startswith("n_params.")}
    assert counts["total"] == sum(v for k, v in counts.items() if k != "total") and counts["attn_extra"] > 0
    assert params["attention"] == "nsa" and params["lm"] == "smoke" and params["seq"] == "256" and "model" not in params
    # the run's name tells a preset, a model and an attention from another
    assert r.info.run_name == "train cpu reference train=smoke lm=smoke attention=nsa seq=256", r.info.run_name
    (out_dir,) = (tmp / "outputs" / "train").iterdir()
    assert {"train.csv", "train.log", "ckpt"} <= {p.name for p in out_dir.iterdir()}
    assert checkpoint.peek(out_dir / "ckpt") == {"run_id": r.info.run_id, "step": STEPS}


def test_smoke_sweep_parent_shows_both_curves(runs):
    tmp, rc, out, err = runs[SWEEP]
    assert rc == 0, err[-3000:]
    c, rs = _runs(tmp)
    (parent,) = [r for r in rs if "mlflow.parentRunId" not in r.data.tags]
    kids = {r.data.params["attention"]: r for r in rs if "mlflow.parentRunId" in r.data.tags}
    assert set(kids) == {"nsa", "dense"} and all(r.info.status == "FINISHED" for r in rs)
    assert parent.info.run_name == "train sweep cpu reference train=smoke lm=smoke attention=nsa,dense", parent.info.run_name
    for kind, r in kids.items():
        for key in ("loss", "accuracy", "val_loss", "val_accuracy", "tokens_per_s"):
            assert _curve(c, parent.info.run_id, f"{key}/{kind}") == _curve(c, r.info.run_id, key), (kind, key)
        loss = [v for _, v in _curve(c, r.info.run_id)]
        assert len(loss) == STEPS and sum(loss[-5:]) < sum(loss[:5]) - 10, kind
    assert "gate_sel" in kids["nsa"].data.metrics and "gate_sel" not in kids["dense"].data.metrics
    lines = c.get_experiment_by_name("nsa-train-lines")  # the sweep's view: a run per variant (views.py)
    shown = {r.info.run_name: r.info.run_id for r in c.search_runs(
        [lines.experiment_id], filter_string=f"tags.sweep_parent = '{parent.info.run_id}'")}
    assert set(shown) == {"nsa", "dense"} and all(_curve(c, shown[k], "val_accuracy") == _curve(
        c, r.info.run_id, "val_accuracy") for k, r in kids.items())
    assert {"train_by_step.png", "train_sweep.csv", "summary.txt"} <= {a.path for a in c.list_artifacts(parent.info.run_id)}
    header = next(ln for ln in out.splitlines() if ln.startswith("#  "))
    assert header.split()[:3] == ["#", "attention", "status"] and "final_loss" in header and "tokens_per_s" in header
    (sweep_dir,) = (tmp / "outputs" / "train").iterdir()
    assert {"attention=nsa,train=smoke", "attention=dense,train=smoke"} <= {p.name for p in sweep_dir.iterdir()}


def test_killed_run_resumes_into_the_same_run(runs):
    tmp, seen, killed, before, ckpt, _ = runs["killed"]
    assert killed.info.status == "RUNNING"  # SIGKILL: nothing could end it
    assert [s for s, _ in before] == list(range(1, len(before) + 1)) and len(before) >= seen >= KILL_AFTER
    # the last checkpoint: at the last multiple of CKPT_EVERY logged (or the one before, killed between the two)
    assert ckpt["run_id"] == killed.info.run_id and ckpt["step"] % CKPT_EVERY == 0
    assert len(before) - CKPT_EVERY <= ckpt["step"] <= len(before)
    _, rc, _out, err = runs[SMOKE]
    assert rc == 0, err[-3000:]
    assert f"resuming run {killed.info.run_id} from its checkpoint at step {ckpt['step']}" in err
    c, (r,) = _runs(tmp)  # one run: the same one, now FINISHED
    assert r.info.run_id == killed.info.run_id and r.info.status == "FINISHED"
    assert r.data.tags["resumed"] == "1" and r.data.tags["resumed_from_step"] == str(ckpt["step"])
    got = _curve(c, r.info.run_id)
    assert [s for s, _ in got] == list(range(1, STEPS + 1))  # each step once, no gap
    assert got[:len(before)] == before  # the steps logged before the kill stay as they were
    # Equal to an uninterrupted run of the same config (the sweep's NSA job), bit for bit (CPU, one
    # thread): the loss, evaluation, selection, gates.
    c1, rs = _runs(runs[SWEEP][0])
    (ref,) = [r for r in rs if r.data.params.get("attention") == "nsa" and "mlflow.parentRunId" in r.data.tags]
    for key in ("loss", "accuracy", "val_loss", "val_accuracy", "sel_recall", "gate_sel", "grad_norm"):
        assert _curve(c, r.info.run_id, key) == _curve(c1, ref.info.run_id, key), key
    assert r.data.metrics["0_final_loss"] == ref.data.metrics["0_final_loss"]


def test_finished_or_changed_run_is_not_continued(runs):
    tmp, _, killed, _, _, out_dir = runs["killed"]
    rid = killed.info.run_id
    _, rc, _out, err = runs["again"]
    assert rc == 2 and one_line(err) == [
        f"config error: {out_dir} holds run {rid} to continue, which is FINISHED; a new run needs another output directory"]
    _, rc, _out, err = runs["other_lr"]
    assert rc == 2 and one_line(err) == [
        f"config error: {out_dir / 'ckpt'}: config: differs from the checkpoint's in train.lr (0.003 -> 0.001)"]
    c, rs = _runs(tmp)
    assert len(rs) == 1 and rs[0].info.status == "FINISHED" and len(_curve(c, rid)) == STEPS


def test_time_limited_sweep_resumes_from_its_checkpoints(runs):
    tl, rc, out, err, parent, rs = runs["stopped"]
    assert rc == 1 and "Traceback" not in err
    assert f"hydra.sweeper.resume={parent}" in out
    kids = [r for r in rs if "mlflow.parentRunId" in r.data.tags]
    assert len(kids) == 2 and all(r.info.status == "FAILED" for r in kids)
    for r in kids:
        assert r.data.tags["error"] == (
            f"JobFailure: stopped by train.time_limit_s=1e-09 after step 1 of 3; the checkpoint in "
            f"{tl / 'out' / 'sw' / ('attention=' + r.data.params['attention'] + ',train.steps=3,train=smoke') / 'ckpt'} "
            f"resumes it: the same command with hydra.sweep.dir={tl / 'out' / 'sw'} hydra.sweeper.resume={parent}")
    tl, rc, out, err = runs["continued"]
    assert rc == 0, err[-3000:]
    c, rs = _runs(tl)
    assert {r.info.run_id for r in rs} == {parent, *(r.info.run_id for r in kids)}  # no new run
    for r in rs:
        assert r.info.status == "FINISHED" and "error" not in r.data.tags
    for r in (c.get_run(k.info.run_id) for k in kids):
        assert [s for s, _ in _curve(c, r.info.run_id)] == [1, 2, 3] and r.data.tags["resumed"] == "1"
        assert json.loads(r.data.tags["sweep_job"])[-1] == "train.time_limit_s=null"  # the job as resumed
        assert [s for s, _ in _curve(c, parent, f"loss/{r.data.params['attention']}")] == [1, 2, 3]
    assert "train.time_limit_s: 1e-09 -> None" in c.get_run(kids[0].info.run_id).data.tags["resumed_changes"]


# ================================================================================================
# In-process: which earlier run a job may continue (experiments.framework.job._earlier_run)
# ================================================================================================
def test_earlier_run_rules(tmp_path):
    store = tracking.connect(OmegaConf.create({"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}), "train", tmp_path)
    other = tracking.connect(OmegaConf.create({"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "x"}),
                             "train", tmp_path)
    assert _earlier_run(store, None, None, tmp_path) is None
    sweep = tracking.start_run(store, "sweep", None, {"sweep": "parent"})
    ended = {}
    for status in ("FAILED", "KILLED", "FINISHED"):
        ended[status] = tracking.start_run(store, status, None)
        tracking.end_run(store.client, ended[status], status)
    assert _earlier_run(store, ended["FAILED"], None, tmp_path).info.run_id == ended["FAILED"]
    assert _earlier_run(store, ended["KILLED"], None, tmp_path).info.run_id == ended["KILLED"]
    live = tracking.start_run(store, "this process", None)  # RUNNING, owned by a process that lives
    dead = tracking.start_run(store, "gone", None)
    store.client.set_tag(dead, "process", f"{os.getpid()}:0")  # a process of this pid that is not this one
    assert _earlier_run(store, dead, None, tmp_path).info.run_id == dead
    away = tracking.start_run(store, "elsewhere", None)
    store.client.set_tag(away, "host", "another-host")
    job = tracking.start_run(store, "a job", sweep)
    foreign = tracking.start_run(other, "another experiment", None)
    for rid, parent, msg in [(ended["FINISHED"], None, "which is FINISHED"),
                             (live, None, f"which is RUNNING in process {os.getpid()}"),
                             # the store named: this process's cwd is not tmp_path, where the command's default is
                             (away, None, f"close_stale {away} --tracking-uri sqlite:///{tmp_path / 'mlflow.db'} --force"),
                             (job, None, f"a job of sweep {sweep} (resume it: hydra.sweeper.resume={sweep})"),
                             (ended["FAILED"], sweep, "a single run, not a job of this sweep"),
                             (foreign, None, "which is not in experiment nsa-train"),
                             ("0" * 32, None, "which is not in experiment nsa-train")]:
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            _earlier_run(store, rid, parent, tmp_path)
    tracking.end_run(store.client, job, "KILLED")  # e.g. by a resumed sweep's close_stale
    assert _earlier_run(store, job, sweep, tmp_path).info.run_id == job
    for rid in (live, dead, away, foreign, sweep):
        tracking.end_run(store.client, rid, "KILLED")


def test_job_folder_names_fit_one_path_component():
    """conf/train.yaml names a sweep job's folder by its overrides (a resumed sweep finds its checkpoint
    there); past 255 bytes Linux refused the folder (an ablation sweep with 13 overrides, 2026-11-27): the
    resolver keeps such names under the limit, the same for the same overrides, distinct for others."""
    from experiments.framework.sweep import NAME_MAX, job_dirname

    short = "attention=nsa,train=smoke"
    assert job_dirname(short) == short
    long_a, long_b = ("attention=nsa," + "lm.nsa.phi=mlp," * 20 + x for x in ("seed=1", "seed=2"))
    a, b = job_dirname(long_a), job_dirname(long_b)
    assert len(a.encode()) <= NAME_MAX and len(b.encode()) <= NAME_MAX
    assert a == job_dirname(long_a) and a != b and a.startswith("attention=nsa,lm.nsa.phi=mlp")
    assert len(job_dirname("é" * 200).encode()) <= NAME_MAX  # cut on a character, not inside one
    assert "subdir: ${nsa_dirname:${hydra.job.override_dirname}}" in (entrypoints.REPO / "conf" / "train.yaml").read_text()


def test_a_signal_python_drops_still_stops_training_killed(tmp_path):
    """The signal's exception dropped in a finalizer during step 3 stops the run at the next step: exit 143,
    the run KILLED at step 3 of 40, not FINISHED."""
    entrypoints.make_template(tmp_path / "mlflow.db")
    # recipe_weight is called once a step, its third call in update step 3
    rc, out, err = wait(entrypoints.start_dropping_sigterm(
        tmp_path, "train", "experiments.lm.loop:recipe_weight", 3,
        "train=smoke", "train.steps=40", "train.log_every=1", "train.eval_every=1000", "train.ckpt_every=1000"))
    assert "Exception ignored" in err and "Interrupted: SIGTERM" in err, err[-3000:]  # it was dropped
    assert rc == 143, err[-3000:]
    (run,) = entrypoints.runs(tmp_path / "mlflow.db", "train")[1]
    assert run.info.status == "KILLED", run.info.status
    assert one_line(err)[-1] == f"[train] interrupted by SIGTERM: run(s) {run.info.run_id} ended KILLED"
    c = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    steps = [m.step for m in c.get_metric_history(run.info.run_id, "loss")]
    assert steps and max(steps) == 3, steps  # step 3 ran to its end, step 4 never started


def test_a_training_that_cannot_fit_is_refused_before_a_run_exists(tmp_path):
    """train.batch=1e8 (about 2e5 GiB at least): one line naming the batch and the lower bound's parts, exit 2, no
    store, no output folder; in a sweep that job fails alone with the same reason and the other trains."""
    rc, out, err = wait(start(tmp_path, "train", "train=smoke", "train.batch=100000000", name="big"))
    assert rc == 2, err[-2000:]
    (line,) = one_line(err)
    assert line.startswith("config error: seq=256: estimated ") and "GiB of tensors exceeds" in line, line
    assert "(train.batch=100000000 x 256 tokens, at least: states " in line and " activations " in line, line
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "out" / "big").exists()
    rc, out, err = wait(start(tmp_path, "train", "train=smoke", "train.steps=2", "train.eval_every=2", "train.ckpt_every=2",
                              "-m", "train.batch=8,100000000", name="sweep"))
    assert rc == 1, err[-2000:]
    _, rs = entrypoints.runs(tmp_path / "mlflow.db", "train")
    jobs = {r.data.params["train.batch"]: r for r in rs if r.data.tags.get("sweep") != "parent"}
    assert jobs["8"].info.status == "FINISHED" and jobs["100000000"].info.status == "FAILED"
    assert "GiB of tensors exceeds" in jobs["100000000"].data.tags["error"]
