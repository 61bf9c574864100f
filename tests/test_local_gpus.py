"""``hydra/launcher=local_gpus`` (hydra_plugins/nsa_local_gpus): sweeps over one host's GPUs without a
scheduler, through the real CLI on this CPU machine. CPU jobs (``hardware=cpu``) over device ids that need
not exist: each job runs in a worker pinned to one id (its run's tag ``cuda_visible_devices``), as many at
once as there are ids, never two at once on one id; bad ``gpus`` values are one-line config errors (exit 2,
no run); SIGTERM mid-sweep ends every run KILLED and leaves no worker behind."""
from __future__ import annotations

import signal
import time
from pathlib import Path

import entrypoints
import pytest
from entrypoints import one_line, start, wait
from mlflow import MlflowClient

from hydra_plugins.nsa_local_gpus.local_gpus import gpu_ids

QUICK = ["decode.per_branch=false", "model.timing.repeats=3", "decode.peers=[]"]
LONG = ["decode.per_branch=false", "model.timing.warmup=10000", "model.timing.repeats=10000", "decode.peers=[]"]


def test_gpu_ids():
    assert gpu_ids(None, None, 3) == ["0", "1", "2"]
    assert gpu_ids(None, "4,6", 2) == ["4", "6"]  # this process's CUDA_VISIBLE_DEVICES names them
    assert gpu_ids(2, "4,6,7", 3) == ["4", "6"]
    assert gpu_ids([0, 5], None, 0) == ["0", "5"]  # ids need not exist (CPU jobs)
    for bad, rule in ((0, "a count from 1"), (3, "a count from 1 to the 2 GPUs"), ([1, 1], "distinct"),
                      ([], "non-empty"), (["a"], "integers"), ("0,1", "a count, a list"), (True, "a count, a list")):
        with pytest.raises(ValueError, match=rule):
            gpu_ids(bad, None, 2)
    with pytest.raises(ValueError, match="no GPU is visible here"):
        gpu_ids(None, None, 0)


def _running_process(pid: int) -> bool:
    """pid exists and is not a zombie (one that exited, left for its new parent to reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _spans(runs, parent):
    kids = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent]
    return kids, [(r.info.start_time, r.info.end_time, r.data.tags.get("cuda_visible_devices")) for r in kids]


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    """Three sweeps at once: 3 jobs over ids [0, 1], 2 jobs over the one id [7], and 2 jobs over [7] with two
    workers on it (``jobs_per_gpu=2``)."""
    template = entrypoints.make_template(tmp_path_factory.mktemp("template") / "mlflow.db")
    cases = {"two": ("[0,1]", "seq=256,512,1024"), "one": ("[7]", "seq=256,512"),
             "shared": ("[7]", "seq=256,512", "hydra.launcher.jobs_per_gpu=2")}
    procs = {}
    for k, (ids, seqs, *more) in cases.items():
        tmp = tmp_path_factory.mktemp(k)
        procs[k] = (tmp, start(tmp, "decode", "-m", "hydra/launcher=local_gpus", f"hydra.launcher.gpus={ids}",
                               "hardware=cpu", seqs, *more, *QUICK, name=None, template=template))
    return {k: (tmp, *wait(p)) for k, (tmp, p) in procs.items()}


@pytest.mark.parametrize("case,ids,n,cap", [("two", {"0", "1"}, 3, 2), ("one", {"7"}, 2, 1)])
def test_jobs_run_one_per_gpu_at_a_time(sweeps, case, ids, n, cap):
    tmp, rc, out, err = sweeps[case]
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    c, runs = entrypoints.runs(tmp / "mlflow.db", "decode")
    parents = [r for r in runs if r.data.tags.get("sweep") == "parent"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert parents[0].data.tags["launcher"] == "local_gpus"
    kids, spans = _spans(runs, parents[0].info.run_id)
    assert len(kids) == n and {r.info.status for r in kids} == {"FINISHED"}
    assert {g for _, _, g in spans} <= ids and None not in {g for _, _, g in spans}
    for i, (s, e, g) in enumerate(spans):  # never two jobs at once on one id
        for s2, e2, g2 in spans[i + 1:]:
            assert g != g2 or e <= s2 or e2 <= s, f"jobs overlapped on GPU {g}"
    at_once = max(sum(s2 <= s < e2 for s2, e2, _ in spans) for s, _, _ in spans)
    assert at_once <= cap
    line = [ln for ln in one_line(err) if " jobs ran on GPUs " in ln]
    assert line and line[0].endswith("never two at once on one GPU") and f"at most {at_once} at once" in line[0], line


def test_jobs_per_gpu_shares_one_gpu(sweeps):
    """jobs_per_gpu=2: two workers pinned to the one id, both jobs run there, and where they ran at once the
    end line says they shared it (never the one-job-a-GPU wording)."""
    tmp, rc, out, err = sweeps["shared"]
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    c, runs = entrypoints.runs(tmp / "mlflow.db", "decode")
    parent = [r for r in runs if r.data.tags.get("sweep") == "parent"][0]
    kids, spans = _spans(runs, parent.info.run_id)
    assert len(kids) == 2 and {r.info.status for r in kids} == {"FINISHED"} and {g for *_, g in spans} == {"7"}
    (s1, e1, _), (s2, e2, _) = spans
    line = [ln for ln in one_line(err) if " jobs ran on GPUs " in ln][0]
    overlapped = not (e1 <= s2 or e2 <= s1)
    assert line.endswith("never two at once on one GPU") != overlapped, line
    assert ("jobs ran at once on one GPU" in line) == overlapped, line


@pytest.mark.parametrize("gpus,rule", [("0", "a count from 1 to the 0 GPUs visible here"),
                                       ("[1,1]", "a non-empty list of distinct device ids")])
def test_bad_gpus_is_one_line_and_no_run(tmp_path, gpus, rule):
    p = start(tmp_path, "decode", "-m", "hydra/launcher=local_gpus", f"hydra.launcher.gpus={gpus}", "hardware=cpu",
              "seq=256", *QUICK, name=None)
    rc, out, err = wait(p, 120)
    assert rc == 2, err[-2000:]
    assert one_line(err)[-1].startswith("config error: hydra.launcher.gpus=") and rule in one_line(err)[-1], err
    assert "Traceback" not in err
    assert not (tmp_path / "mlflow.db").exists() or not entrypoints.runs(tmp_path / "mlflow.db", "decode")[1]


@pytest.mark.parametrize("value", ["0", "true", "1.5"])
def test_bad_jobs_per_gpu_is_one_line_and_no_run(tmp_path, value):
    p = start(tmp_path, "decode", "-m", "hydra/launcher=local_gpus", "hydra.launcher.gpus=[0]",
              f"hydra.launcher.jobs_per_gpu={value}", "hardware=cpu", "seq=256", *QUICK, name=None)
    rc, out, err = wait(p, 120)
    assert rc == 2, err[-2000:]
    last = one_line(err)[-1]
    assert last.startswith("config error: hydra.launcher.jobs_per_gpu=") and "an integer >= 1" in last, err
    assert "Traceback" not in err
    assert not (tmp_path / "mlflow.db").exists() or not entrypoints.runs(tmp_path / "mlflow.db", "decode")[1]


def test_sigterm_ends_every_run_killed_and_every_worker(tmp_path):
    template = entrypoints.make_template(tmp_path / "template.db")
    (tmp_path / "s").mkdir()
    tmp = tmp_path / "s"
    p = start(tmp, "decode", "-m", "hydra/launcher=local_gpus", "hydra.launcher.gpus=[0,1]", "hardware=cpu",
              "seq=256,512,1024", *LONG, name=None, template=template)
    t0 = time.time()
    c = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    while time.time() - t0 < 240:  # both workers in a job (each job's params logged)
        exp = c.get_experiment_by_name("nsa-decode")
        runs = c.search_runs([exp.experiment_id]) if exp else []
        if sum(r.info.status == "RUNNING" and bool(r.data.params) and "mlflow.parentRunId" in r.data.tags
               for r in runs) == 2:
            break
        if p.poll() is not None:
            pytest.fail(f"the sweep ended before two jobs ran at once: {wait(p)[2][-2000:]}")
        time.sleep(0.3)
    else:
        p.kill()
        pytest.fail("two jobs never ran at once")
    children = [int(x) for x in Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()]
    assert len(children) >= 2  # the workers (and multiprocessing's resource tracker)
    p.send_signal(signal.SIGTERM)
    rc, out, err = wait(p, 120)
    time.sleep(1)
    alive = [c for c in children if _running_process(c)]
    assert not alive, f"processes of the sweep still alive: {alive}"
    assert rc == 143 and "Traceback" not in err, err[-3000:]
    _, runs = entrypoints.runs(tmp / "mlflow.db", "decode")
    assert len(runs) == 3  # the parent and the two jobs that ran; the third never started
    assert {r.info.status for r in runs} == {"KILLED"}
    assert {r.data.tags.get("error") for r in runs} == {"interrupted by SIGTERM"}
    # the last line of the sweep's own (multiprocessing's resource tracker may warn after it, of the workers' queue)
    said = [ln for ln in one_line(err) if "resource_tracker" not in ln and "warnings.warn(" not in ln]
    assert said[-1].startswith("[decode] interrupted by SIGTERM: run(s) "), err[-2000:]
