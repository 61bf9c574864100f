"""Nothing lost, nothing left RUNNING: first sweeps racing on a new store, SIGINT and
SIGTERM mid-job, SIGKILL then ``experiments.close_stale`` (the README's command), SIGKILL then a
resumed sweep. Real subprocesses; all sweeps of a fixture start at once."""
from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import entrypoints
import pytest
from entrypoints import REPO, one_line, start, wait
from mlflow import MlflowClient

# killed in its first job (the longest timing the config allows: minutes on a CPU)
LONG = ["-m", "seq=64,128", "model.timing.warmup=10000", "model.timing.repeats=10000", "decode.per_branch=false"]
# Job 0 is quick, job 1 long: killed in job 1, a resumed sweep runs job 1 alone.
RESUMABLE = ["-m", "seq=64", "model.timing.repeats=1,3000", "decode.per_branch=false"]


def _client(tmp: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")


def _running(tmp: Path, finished: int = 0) -> tuple[str, str] | None:
    """(parent, child) once the sweep in tmp has a RUNNING child after ``finished`` FINISHED ones, its
    params logged (a child is created RUNNING, then logs its params: a signal between the two, which a
    loaded machine's poll can hit, would leave a child the tests cannot tell by its params)."""
    c = _client(tmp)
    exp = c.get_experiment_by_name("nsa-decode")
    kids = [r for r in (c.search_runs([exp.experiment_id]) if exp else []) if "mlflow.parentRunId" in r.data.tags]
    running = [r for r in kids if r.info.status == "RUNNING" and r.data.params]
    if running and sum(r.info.status == "FINISHED" for r in kids) >= finished:
        return running[0].data.tags["mlflow.parentRunId"], running[0].info.run_id
    return None


def documented(name: str) -> list[str]:
    """The command lines that run ``python -m experiments.<name>`` in the README, docs/ and its docstring."""
    text = entrypoints.doc_text() + (REPO / "experiments" / f"{name}.py").read_text()
    return sorted({m.split("#")[0].strip() for m in re.findall(rf"^\s*(python -m experiments\.{name} .*)$", text, re.M)})


def _run(cmd: str, tmp: Path, **subs: str) -> subprocess.CompletedProcess:
    for k, v in subs.items():
        cmd = cmd.replace(f"<{k}>", v)
    return subprocess.run([sys.executable, *cmd.split()[1:]], cwd=tmp, env=entrypoints.env(), capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Four long sweeps: SIGINT, SIGTERM, SIGKILL (then close_stale), SIGKILL (then resume)."""
    template = entrypoints.make_template(tmp_path_factory.mktemp("template") / "mlflow.db")
    cases = {"sigkill_resume": (signal.SIGKILL, RESUMABLE),  # first: its long job must still be running
             "sigint": (signal.SIGINT, LONG), "sigterm": (signal.SIGTERM, LONG), "sigkill_close": (signal.SIGKILL, LONG)}
    procs = {}
    for k, (_, args) in cases.items():
        tmp = tmp_path_factory.mktemp(k)
        procs[k] = (tmp, start(tmp, "decode", *args, name=None, template=template))
    ids, t0 = {}, time.time()
    while len(ids) < len(procs) and time.time() - t0 < 300:  # each signalled as soon as its job runs
        for k, (tmp, p) in procs.items():
            if k not in ids and (got := _running(tmp, finished=1 if k == "sigkill_resume" else 0)):
                p.send_signal(cases[k][0])
                ids[k] = got
            elif k not in ids and p.poll() is not None:
                pytest.fail(f"the {k} sweep ended before its job ran: {wait(p)[2][-2000:]}")
        time.sleep(0.2)
    assert len(ids) == len(procs), f"sweeps with no job running after 300 s: {sorted(set(procs) - set(ids))}"
    return {k: (tmp, *ids[k], *wait(p)) for k, (tmp, p) in procs.items()}


@pytest.mark.parametrize("case,code", [("sigint", 130), ("sigterm", 143)])
def test_interrupt_ends_the_runs_killed_in_one_line(killed, case, code):
    tmp, parent, child, rc, out, err = killed[case]
    name = case.upper()
    assert rc == code and "Traceback" not in err, err[-3000:]
    assert [ln for ln in one_line(err) if "interrupted" in ln] == \
        [f"[decode] interrupted by {name}: run(s) {child}, {parent} ended KILLED"] == one_line(err)[-1:]
    c = _client(tmp)
    for rid in (parent, child):
        r = c.get_run(rid)
        assert r.info.status == "KILLED" and r.data.tags["error"] == f"interrupted by {name}"
    assert len(entrypoints.runs(tmp / "mlflow.db", "decode")[1]) == 2  # the second job never started


def test_close_stale_after_sigkill(killed):
    tmp, parent, child, rc, out, err = killed["sigkill_close"]
    assert rc == -signal.SIGKILL
    c = _client(tmp)
    assert {c.get_run(r).info.status for r in (parent, child)} == {"RUNNING"}  # what SIGKILL leaves
    readme, plain, forced = documented("close_stale")  # each as written, in the store's directory
    assert readme == "python -m experiments.close_stale <parent run id>", documented("close_stale")
    r = _run(readme, tmp, **{"parent run id": parent})
    assert r.returncode == 0 and len(one_line(r.stderr)) == 2, r.stderr
    for rid in (parent, child):
        run = c.get_run(rid)
        assert run.info.status == "KILLED" and run.data.tags["error"].startswith("stale: process ")
        assert f"{rid}: closed (KILLED)" in r.stderr
    for cmd in (plain, forced):
        again = _run(cmd, tmp, **{"run id": child})
        assert again.returncode == 0 and "none RUNNING" in again.stderr, (cmd, again.stderr)


def test_resume_closes_stale_runs_and_runs_only_the_unfinished_jobs(killed, tmp_path_factory):
    tmp, parent, child, rc, out, err = killed["sigkill_resume"]
    assert rc == -signal.SIGKILL
    p = start(tmp, "decode", *RESUMABLE, f"hydra.sweeper.resume={parent}", name="resumed")
    rc, out, err = wait(p)
    assert rc == 0, err[-3000:]
    assert f"[resume] run {child}: closed (KILLED)" in err and "2 jobs validated, 1 to run" in err
    assert "Launching 1 jobs" in out and "model.timing.repeats=3000" in out.split("Launching 1 jobs")[1]
    c, rs = entrypoints.runs(tmp / "mlflow.db", "decode")
    assert all(r.info.status != "RUNNING" for r in rs)
    assert c.get_run(parent).info.status == "FINISHED" and len(rs) == 4  # parent, job 0, job 1 killed, job 1 again
    kids = sorted((r.data.params["model.timing.repeats"], r.info.status) for r in rs if r.info.run_id != parent)
    assert kids == [("1", "FINISHED"), ("3000", "FINISHED"), ("3000", "KILLED")]
    assert c.get_run(child).data.tags["error"].startswith("stale: process ")
    assert re.search(r"^1  3000 +FINISHED", out, re.M) and re.search(r"^0  1 +FINISHED", out, re.M)  # both jobs summarized


TRIALS = [(n, t) for n in (2, 4) for t in range(3)]


@pytest.fixture(scope="module")
def races(tmp_path_factory):
    """n first sweeps at once on a store that does not exist yet (one job each: the race is in
    opening the store), 3 trials for n = 2 and n = 4."""
    procs = {}
    for n, t in TRIALS:
        tmp = tmp_path_factory.mktemp(f"race{n}_{t}")
        procs[(n, t)] = (tmp, [start(tmp, "decode", "-m", "seq=32", "decode.per_branch=false", name=f"s{i}")
                               for i in range(n)])
    return {k: (tmp, [wait(p) for p in ps]) for k, (tmp, ps) in procs.items()}


@pytest.mark.parametrize("n,trial", TRIALS)
def test_first_sweeps_at_once_lose_nothing(races, n, trial):
    tmp, results = races[(n, trial)]
    assert [rc for rc, _, _ in results] == [0] * n, [e[-1500:] for _, _, e in results]
    _, rs = entrypoints.runs(tmp / "mlflow.db", "decode")
    parents = {r.info.run_id for r in rs if "mlflow.parentRunId" not in r.data.tags}
    kids = [r for r in rs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == n and len(kids) == n
    assert {r.data.tags["mlflow.parentRunId"] for r in kids} == parents
    assert {r.info.status for r in rs} == {"FINISHED"}


def test_a_signal_python_drops_still_ends_the_sweep_killed(tmp_path):
    """The signal's exception dropped in a finalizer in job 0 still stops the sweep: that job and the parent
    end KILLED, job 1 never starts, the exit code is 143."""
    entrypoints.make_template(tmp_path / "mlflow.db")
    rc, out, err = wait(entrypoints.start_dropping_sigterm(
        tmp_path, "decode", "experiments.measure.timing:time_ms", 1,
        "hardware=cpu", "-m", "seq=64,128", "model.timing.repeats=2", "decode.per_branch=false", name=None))
    assert "Exception ignored" in err and "Interrupted: SIGTERM" in err, err[-3000:]  # it was dropped
    assert rc == 143, err[-3000:]
    c, rs = entrypoints.runs(tmp_path / "mlflow.db", "decode")
    (parent,) = [r.info.run_id for r in rs if "mlflow.parentRunId" not in r.data.tags]
    (child,) = [r for r in rs if "mlflow.parentRunId" in r.data.tags]
    assert one_line(err)[-1] == f"[decode] interrupted by SIGTERM: run(s) {child.info.run_id}, {parent} ended KILLED"
    assert {r.info.status for r in rs} == {"KILLED"} and child.data.params["seq"] == "64"


def test_sigterm_prints_the_command_that_runs_the_rest(tmp_path):
    """A decode sweep stopped by SIGTERM in its first job prints one command; run as printed, it reruns
    that job and runs the next into the same parent, which then ends FINISHED."""
    args = ["hardware=cpu", "-m", "seq=64,128", "model.timing.repeats=2000", "decode.per_branch=false"]
    entrypoints.make_template(tmp_path / "mlflow.db")
    _running(tmp_path)  # this process's client opened first: a poll then sees the job as it is
    p = start(tmp_path, "decode", *args, name=None)
    t0, got = time.time(), None
    while got is None and time.time() - t0 < 240:
        assert p.poll() is None, p.communicate()
        got = _running(tmp_path)
        time.sleep(0.2)
    assert got is not None and p.poll() is None, "the sweep's first job never started"
    p.send_signal(signal.SIGTERM)
    rc, out, err = wait(p)
    parent, child = got
    assert rc == 143 and one_line(err)[-1] == f"[decode] interrupted by SIGTERM: run(s) {child}, {parent} ended KILLED", err
    (cmd,) = [ln.removeprefix("resume:  ") for ln in out.splitlines() if ln.startswith("resume:")]
    assert cmd == (f"python -m experiments.decode hardware=cpu seq=64,128 model.timing.repeats=2000 "
                   f"decode.per_branch=false tracking.uri=sqlite:///{tmp_path / 'mlflow.db'} -m "
                   f"hydra.sweeper.resume={parent}")
    c, rs = entrypoints.runs(tmp_path / "mlflow.db", "decode")
    assert {r.info.status for r in rs} == {"KILLED"} and len(rs) == 2

    done = subprocess.run([sys.executable, *shlex.split(cmd)[1:]], cwd=tmp_path, env=entrypoints.env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    c, rs = entrypoints.runs(tmp_path / "mlflow.db", "decode")
    assert c.get_run(parent).info.status == "FINISHED" and all(r.info.status != "RUNNING" for r in rs)
    kids = sorted((r.data.params["seq"], r.info.status) for r in rs if r.info.run_id != parent)
    assert kids == [("128", "FINISHED"), ("64", "FINISHED"), ("64", "KILLED")]
