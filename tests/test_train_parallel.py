"""Training one model over several processes (``parallel.dp``, ``parallel.cp``) through the real CLI: ``torchrun``
on this CPU (gloo) runs ``experiments.train`` with FSDP2 over dp and context parallelism over cp, and every step's
loss (and evaluation) equals one process's on the same global batch within 1e-4 relative (float32): NSA and dense,
dp=2, cp=2, and dp=2 x cp=2 on four processes with micro-batches. The sharded checkpoint (DCP) resumes on another
world size both ways, the remaining steps equal to the uninterrupted run's; a rank killed with SIGKILL ends the
job promptly, its run not left RUNNING; and the bad launches are one line, exit 2, no run, on every rank."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import entrypoints
import pytest
from entrypoints import documented_torchrun, one_line, start, wait
from mlflow import MlflowClient

from experiments.lm import checkpoint

# 4 steps of the smoke model on 128-byte text windows, an evaluation and a checkpoint every 2 steps.
BASE = ["train=smoke", "train.steps=4", "train.log_every=1", "train.eval_every=2", "train.ckpt_every=2",
        "train.eval_batches=1", "data.seq_len=128", "train.batch=8"]
REL = 1e-4  # float32: the same sums over other ranks and in another order


def torchrun(tmp: Path, n: int, *args: str, name: str = "out") -> subprocess.Popen:
    """``torchrun --standalone --nproc_per_node n -m experiments.train ...`` in tmp, into tmp/mlflow.db."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
           "-m", "experiments.train", *args, f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}",
           f"hydra.run.dir={tmp / name}"]
    return subprocess.Popen(cmd, cwd=tmp, env=entrypoints.env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=entrypoints.default_signals)


def one(tmp: Path, *args: str, name: str = "out") -> subprocess.Popen:
    """``python -m experiments.train ...``: one process, into tmp/mlflow.db."""
    return start(tmp, "train", *args, f"hydra.run.dir={tmp / name}", name=None,
                 extra_env={"OMP_NUM_THREADS": "1"})


def curves(tmp: Path, keys=("loss", "val_loss")) -> tuple[object, dict]:
    """(the one run of tmp/mlflow.db, {key: [(step, value)]})."""
    c, (run,) = entrypoints.runs(tmp / "mlflow.db", "train")
    return run, {k: sorted((m.step, m.value) for m in c.get_metric_history(run.info.run_id, k)) for k in keys}


def close(a: list, b: list, rel: float = REL) -> bool:
    return [s for s, _ in a] == [s for s, _ in b] and all(abs(x - y) <= rel * abs(y) for (_, x), (_, y) in zip(a, b))


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return entrypoints.make_template(tmp_path_factory.mktemp("template") / "mlflow.db")


def _store(tmp: Path, template: Path) -> Path:
    (tmp / "mlflow.db").write_bytes(template.read_bytes())
    return tmp


@pytest.fixture(scope="module")
def single(tmp_path_factory, template):
    """One process's uninterrupted run of ``BASE`` plus the given overrides, each made once: (run, curves)."""
    made = {}

    def get(*args: str):
        if args not in made:
            tmp = _store(tmp_path_factory.mktemp("single"), template)
            rc, _, err = wait(one(tmp, *BASE, *args), timeout=600)
            assert rc == 0, err[-3000:]
            made[args] = curves(tmp)
        return made[args]
    return get


@pytest.mark.parametrize("model,n,split", [
    (["attention=nsa"], 2, ["parallel.dp=2"]),
    (["attention=nsa"], 2, ["parallel.cp=2"]),
    (["attention=dense"], 2, ["parallel.dp=2"]),
    (["attention=dense"], 2, ["parallel.cp=2"]),
    (["attention=nsa"], 4, ["parallel.dp=2", "parallel.cp=2", "train.grad_accum=2"]),
    (["lm=hf", "attention=nsa"], 2, ["parallel.dp=2"]),
    (["lm=hf", "attention=dense"], 2, ["parallel.dp=2"]),
], ids=["nsa-dp2", "nsa-cp2", "dense-dp2", "dense-cp2", "nsa-dp2xcp2-accum2", "hf-nsa-dp2", "hf-dense-dp2"])
def test_every_step_equals_one_process(tmp_path, template, single, model, n, split):
    if "lm=hf" in model:
        pytest.importorskip("transformers", reason="lm=hf needs the hf extra (pip install -e '.[hf]')")
    _store(tmp_path, template)
    rc, out, err = wait(torchrun(tmp_path, n, *BASE, *model, *split), timeout=900)
    assert rc == 0, err[-3000:]
    run, got = curves(tmp_path, ("loss", "val_loss", "accuracy", "tokens_per_s", "tokens_per_s_per_gpu"))
    ref_run, ref = single(*model)
    assert run.info.status == "FINISHED"
    for key in ("loss", "val_loss"):
        assert len(got[key]) == len(ref[key]) > 0 and close(got[key], ref[key]), (key, got[key], ref[key])
    assert len(got["accuracy"]) == 4
    p = run.data.params
    dp, cp = (int(next((s.split("=")[1] for s in split if s.startswith(f"parallel.{k}=")), 1)) for k in ("dp", "cp"))
    assert (p["world_size"], p["parallel.dp"], p["parallel.cp"]) == (str(n), str(dp), str(cp))
    # tokens/s of the whole job, and per GPU (rank)
    assert all(abs(a / b - n) < 1e-6 for (_, a), (_, b) in zip(got["tokens_per_s"], got["tokens_per_s_per_gpu"]))
    m = run.data.metrics  # each rank's memory high-water, and the largest
    assert m["rss_peak_gib"] == max(m[f"rss_peak_gib_rank{r}"] for r in range(n)) > 0, sorted(m)
    assert not (tmp_path / "out" / "ckpt" / "last.pt").exists() and (tmp_path / "out" / "ckpt" / "dcp").is_dir()


@pytest.mark.parametrize("line", [ln for ln in documented_torchrun()
                                  if " -m experiments.train " in ln and "hardware=" not in ln])
def test_documented_cpu_line_runs(tmp_path, template, line):
    """docs/cluster.md's CPU launches as written, the schedule shortened to 4 steps: one FINISHED run, rank 0's."""
    _store(tmp_path, template)
    n = int(line.split("--nproc_per_node ")[1].split()[0])
    args = line.split(" -m experiments.train ", 1)[1].split()
    rc, _, err = wait(torchrun(tmp_path, n, *args, *BASE[1:]), timeout=900)
    assert rc == 0, err[-3000:]
    run, got = curves(tmp_path, ("loss",))
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == str(n)
    assert [s for s, _ in got["loss"]] == [1, 2, 3, 4]


def _stop_after_one_step(tmp: Path, launch) -> None:
    rc, _, err = wait(launch(tmp, "train.time_limit_s=1e-9"), timeout=900)
    assert rc != 0 and "stopped by train.time_limit_s=1e-09 after step 1 of 4" in err, err[-3000:]


@pytest.mark.parametrize("first,then", [(2, 1), (1, 2)], ids=["dp2-then-one", "one-then-dp2"])
def test_checkpoint_resumes_on_another_world_size(tmp_path, template, single, first, then):
    """Stopped by its time limit after step 1 on ``first`` processes, resumed on ``then``: the same run, each step
    once, the remaining steps equal to the uninterrupted one-process run's."""
    _store(tmp_path, template)

    def launch(n):
        return lambda tmp, *a: (torchrun(tmp, n, *BASE, f"parallel.dp={n}", *a) if n > 1 else one(tmp, *BASE, *a))

    _stop_after_one_step(tmp_path, launch(first))
    found = checkpoint.meta(tmp_path / "out" / "ckpt")
    assert found["step"] == 1 and found["kind"] == ("sharded" if first > 1 else "file"), found
    rc, _, err = wait(launch(then)(tmp_path, "train.time_limit_s=null"), timeout=900)
    assert rc == 0, err[-3000:]
    assert f"resuming run {found['run_id']} from its checkpoint at step 1" in err
    run, got = curves(tmp_path)
    assert run.info.run_id == found["run_id"] and run.info.status == "FINISHED"
    _, ref = single("attention=nsa")
    assert close(got["loss"], ref["loss"]) and close(got["val_loss"], ref["val_loss"]), (got, ref)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (torchrun's workers)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def test_a_killed_rank_ends_the_job_and_its_run(tmp_path, template):
    _store(tmp_path, template)
    p = torchrun(tmp_path, 2, "train=smoke", "data.seq_len=128", "train.steps=100000", "train.log_every=1",
                 "parallel.dp=2")
    c = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    t0 = time.monotonic()
    while True:  # until rank 0 has logged step 3
        assert p.poll() is None and time.monotonic() - t0 < 300, p.communicate()[1][-3000:]
        exp = c.get_experiment_by_name("nsa-train")
        rs = c.search_runs([exp.experiment_id]) if exp else []
        if rs and max((m.step for m in c.get_metric_history(rs[0].info.run_id, "loss")), default=0) >= 3:
            break
        time.sleep(0.5)
    workers = _children(p.pid)
    assert len(workers) == 2, workers
    rank1 = next(w for w in workers if "RANK=1\0" in Path(f"/proc/{w}/environ").read_text())
    os.kill(rank1, signal.SIGKILL)
    t1 = time.monotonic()
    rc, _, err = wait(p, timeout=120)
    assert rc != 0 and time.monotonic() - t1 < 90  # promptly: no rank left waiting in a collective
    (run,) = c.search_runs([exp.experiment_id])
    assert run.info.status in ("KILLED", "FAILED"), run.info.status
    assert f"hydra.run.dir={tmp_path / 'out'}" in err, err[-3000:]  # the command that resumes it


def _ranks(tmp: Path, n: int, *args: str) -> list[tuple[int, str]]:
    """``python -m experiments.train ...`` as each of torchrun's n ranks (its environment, no rendezvous): the
    launch checks come before the process group, so each rank's exit code and stderr are its own."""
    port = str(entrypoints.free_port())
    procs = [start(tmp, "train", *args, name="bad", extra_env={
        "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
        "LOCAL_WORLD_SIZE": str(n)}) for r in range(n)]
    return [(rc, err) for rc, _, err in (wait(q, timeout=300) for q in procs)]


@pytest.mark.parametrize("n,args,says", [
    (2, ["parallel.dp=4"], ["parallel.dp=4 parallel.cp=1", "dp x cp = 4 must equal torchrun's WORLD_SIZE=2"]),
    (2, ["parallel.cp=2", "data.seq_len=102"], ["seq=102: parallel.cp=2", "multiple of 4"]),
    (2, ["parallel.dp=2", "train.batch=3"], ["train.batch=3", "multiple of parallel.dp x train.grad_accum = 2 x 1"]),
    (2, ["parallel.dp=2", "train.batch=4", "train.grad_accum=4"], ["train.batch=4", "= 2 x 4 = 8"]),
    (2, ["parallel.cp=2", "lm=hf"], ["lm=hf: does not run context parallel yet"]),
], ids=["dp-x-cp-not-world", "seq-not-split", "batch-not-divided", "batch-not-accumulated", "hf-cp"])
def test_bad_launch_is_one_line_exit_2_on_every_rank(tmp_path, n, args, says):
    for rc, err in _ranks(tmp_path, n, "train=smoke", *args):
        lines = one_line(err)
        assert rc == 2 and len(lines) == 1, err[-3000:]
        assert all(s in lines[0] for s in says), lines[0]
    assert not (tmp_path / "mlflow.db").exists()  # no run, none RUNNING


def test_dp_without_torchrun_is_refused(tmp_path):
    rc, _, err = wait(start(tmp_path, "train", "train=smoke", "parallel.dp=2"), timeout=300)
    lines = one_line(err)
    assert rc == 2 and len(lines) == 1, err
    assert "parallel.dp=2 parallel.cp=1" in lines[0] and "this process was not started by torchrun" in lines[0]
    assert "torchrun --nproc_per_node 2" in lines[0]
    assert not (tmp_path / "mlflow.db").exists()


def test_bad_launch_under_torchrun_stops_every_rank(tmp_path):
    """The same refusal through torchrun itself: it returns promptly (no rank waits in a collective), the one line
    printed (by the rank that exits first at least: torchrun then stops the other) and no traceback."""
    t0 = time.monotonic()
    rc, _, err = wait(torchrun(tmp_path, 2, "train=smoke", "parallel.dp=4"), timeout=300)
    assert rc != 0 and time.monotonic() - t0 < 240
    assert err.count("dp x cp = 4 must equal torchrun's WORLD_SIZE=2") >= 1, err[-3000:]
    assert "FileNotFoundError" not in err and "Unable to configure handler" not in err, err[-3000:]
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("args,says", [
    (["-m", "train=smoke", "parallel.dp=2"],
     ["parallel.dp=2 parallel.cp=1: a sweep (-m) does not run over several processes",
      "hydra/launcher=slurm hydra.launcher.tasks_per_node=2 parallel.dp=2 parallel.cp=1"]),
    (["-m", "train=smoke", "hydra/launcher=slurm", "hydra.launcher.tasks_per_node=2"],
     ["parallel.dp=1 parallel.cp=1: dp x cp = 1 must equal the SLURM tasks of each job, "
      "hydra.launcher.nodes x hydra.launcher.tasks_per_node = 2"]),
    (["-m", "train=smoke", "hydra/launcher=slurm", "hydra.launcher.nodes=2", "hydra.launcher.tasks_per_node=2",
      "parallel.dp=2"], ["dp x cp = 2 must equal the SLURM tasks of each job", "= 4"]),
], ids=["basic-launcher", "slurm-tasks-without-dp", "slurm-nodes-times-tasks"])
def test_a_sweep_over_processes_runs_on_slurm_tasks_only(tmp_path, args, says):
    """A sweep's jobs over several processes: SLURM's tasks (each job its own nodes x tasks_per_node ranks, as
    tests/test_cluster.py runs them), else one line naming the rule, exit 2, before any job or store exists."""
    if "hydra/launcher=slurm" in args:
        pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the cluster extra: pip install -e '.[cluster]'")
    rc, _, err = wait(start(tmp_path, "train", *args), timeout=300)
    lines = one_line(err)
    assert rc == 2 and len(lines) == 1, err[-3000:]
    assert all(s in lines[0] for s in says), lines[0]
    assert not (tmp_path / "mlflow.db").exists() and not list(tmp_path.glob("outputs/train/*/.submitit"))


def test_a_decode_sweep_is_not_split_over_slurm_tasks(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the cluster extra: pip install -e '.[cluster]'")
    rc, _, err = wait(start(tmp_path, "decode", "-m", "hardware=cpu", "hydra/launcher=slurm",
                            "hydra.launcher.tasks_per_node=2"), timeout=300)
    lines = one_line(err)
    assert rc == 2 and len(lines) == 1, err[-3000:]
    assert "hydra.launcher.nodes x hydra.launcher.tasks_per_node = 2: experiments.decode runs in one process" in lines[0]
    assert not (tmp_path / "mlflow.db").exists()


def test_the_documented_slurm_gpu_launch_passes_the_launch_rule():
    """docs/cluster.md's two-host line (not runnable here): dp x cp equals its nodes x tasks_per_node (the GPUs a
    host it asks for: tests/test_conf.py's launcher test)."""
    from experiments.framework import parallel

    (line,) = [c for c in entrypoints.documented_commands()
               if "hydra/launcher=slurm" in c.split() and "hydra.launcher.nodes=2" in c.split()]
    kv = dict(a.split("=", 1) for a in line.split() if "=" in a and not a.startswith("hydra/"))
    per_node = int(kv["hydra.launcher.tasks_per_node"])
    parallel.check(int(kv["parallel.cp"]), "train", sweep=True, dp=int(kv["parallel.dp"]),
                   tasks=int(kv["hydra.launcher.nodes"]) * per_node)
    with pytest.raises(parallel.ConfigError, match="must equal the SLURM tasks of each job"):
        parallel.check(int(kv["parallel.cp"]), "train", sweep=True, dp=int(kv["parallel.dp"]), tasks=per_node)
