"""Names and messages a user reads, through the real CLI: ``backend=sdpa``'s meaning (its
--help, its run's record, its one-line refusal on a CPU, naming what the user typed), job folders named by
what differs between a sweep's jobs, and parent runs that tell ``hardware=cpu`` from ``hardware=auto``."""
from __future__ import annotations

import subprocess
import sys
from functools import partial

import entrypoints
import pytest
from entrypoints import one_line, run_bounded, start
from mlflow import MlflowClient

from experiments.framework import hardware

SDPA = "backend=sdpa runs cmp=triton sel=triton win=sdpa"  # conf/backend/sdpa.yaml, as --help and errors say it
QUICK = ["decode.per_branch=false", "model.timing.repeats=1"]
CASES = {
    # on this CPU without the interpreter: refused in one line naming backend=sdpa (what was typed)
    "sdpa_sweep": (["hardware=cpu", "seq=64", "-m", "backend=reference,sdpa"], {}),
    "sdpa_single": (["hardware=cpu", "seq=64", "backend=sdpa"], {}),
    # under the interpreter it runs; its run records what backend=sdpa meant
    "sdpa_record": (["hardware=cpu", "seq=64", "backend=sdpa", *QUICK], {"TRITON_INTERPRET": "1"}),
    "folders": (["hardware=cpu", "seq=64", *QUICK, "-m", "branch_force=cmp,sel", "backend.win=reference,sdpa"], {}),
    "parent_cpu": (["hardware=cpu", *QUICK, "-m", "seq=64"], {}),
    "parent_auto": (["hardware=auto", *QUICK, "-m", "seq=64"], {}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (tmp, rc, stdout, stderr); each command in its own folder and store, as many at once as cores."""
    template = entrypoints.make_template(tmp_path_factory.mktemp("template") / "mlflow.db")
    tmps = {k: tmp_path_factory.mktemp(k) for k in CASES}
    done = run_bounded({k: partial(start, tmps[k], "decode", *args, name=k, template=template, extra_env=env)
                        for k, (args, env) in CASES.items()})
    return {k: (tmps[k], rc, out, err) for k, (rc, out, err, _, _) in done.items()}


def _runs(tmp):
    c = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    return [r for e in c.search_experiments() for r in c.search_runs([e.experiment_id], run_view_type=3)]


@pytest.mark.skipif(hardware.detect().type == "cuda", reason="a CPU machine's message")
@pytest.mark.parametrize("case", ["sdpa_sweep", "sdpa_single"])
def test_backend_sdpa_on_a_cpu_names_what_was_typed_and_its_rule(runs, case):
    tmp, rc, out, err = runs[case]
    lines = one_line(err)
    assert rc == 2 and len(lines) == 1, err[-2000:]
    assert lines[0].startswith(f"config error: backend=sdpa: runs {SDPA.split(' runs ')[1]} (conf/backend/sdpa.yaml), "
                               "and backend 'triton' cannot run branch 'cmp' on cpu/float32: needs a CUDA device "
                               "(or CPU tensors with TRITON_INTERPRET=1)"), lines[0]
    assert "backend.cmp" not in lines[0]  # a key the user never typed
    assert not (tmp / "out").exists() and _runs(tmp) == []  # nothing started: no run, RUNNING or other


def test_the_help_says_what_backend_sdpa_runs():
    p = subprocess.run([sys.executable, "-m", "experiments.decode", "--help"], env=entrypoints.env(), cwd=entrypoints.REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    groups = p.stdout.split("== Config groups (group=option) ==\n")[1].split("\n\n")[0].splitlines()
    i = next(i for i, ln in enumerate(groups) if ln.startswith("backend: "))
    assert SDPA in groups[i + 1] and "backend=fa2 runs cmp=triton sel=triton win=fa2" in groups[i + 1], groups


def test_the_run_records_what_backend_sdpa_meant(runs):
    tmp, rc, out, err = runs["sdpa_record"]
    assert rc == 0, err[-3000:]
    (run,) = _runs(tmp)
    t = run.data.tags
    assert t["backend_plan"] == "backend=sdpa: cmp=triton sel=triton win=sdpa" and run.data.params["backend"] == "sdpa"
    assert t["backends_ran"] == "cmp=triton,sel=triton,win=sdpa"


def test_job_folders_say_what_differs_between_jobs(runs):
    tmp, rc, out, err = runs["folders"]
    assert rc == 0, err[-3000:]
    assert sorted(p.name for p in (tmp / "out" / "folders").iterdir() if p.is_dir()) == [
        "0_backend.win=reference,branch_force=cmp", "1_backend.win=sdpa,branch_force=cmp",
        "2_backend.win=reference,branch_force=sel", "3_backend.win=sdpa,branch_force=sel"]
    kids = [r for r in _runs(tmp) if "mlflow.parentRunId" in r.data.tags]
    assert sorted(r.info.status for r in kids) == ["FINISHED"] * 4


def test_parent_names_tell_hardware_cpu_from_hardware_auto(runs):
    names = {}
    for case in ("parent_cpu", "parent_auto"):
        tmp, rc, out, err = runs[case]
        assert rc == 0, err[-3000:]
        (parent,) = [r for r in _runs(tmp) if r.data.tags.get("sweep") == "parent"]  # not a line run
        names[case] = parent.info.run_name
    here = hardware.detect().type  # the profile hardware=auto resolves to on this machine
    if here == "cpu":
        assert names == {"parent_cpu": "decode sweep cpu tiny auto(reference)",
                         "parent_auto": "decode sweep auto(cpu) tiny auto(reference)"}, names
    assert names["parent_cpu"] != names["parent_auto"]
