"""Files that cannot be read or written, through the real CLI: a corrupt checkpoint on resume,
output folders that cannot be written, a full disk under a checkpoint, a sweep's outputs or the tracking
store. Each ends in one line naming the path and the cause, with nothing left RUNNING and no temporary
file behind.

Read-only folders and full disks are small tmpfs mounts (root only: skipped where mount is refused); as
root, a folder's permission bits stop nothing, so a read-only mount is the way to refuse writes.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import entrypoints
import pytest
from entrypoints import one_line, start, wait
from mlflow import MlflowClient

# A train run of 3 steps stopped by its time limit after step 1: FAILED, with a checkpoint to resume.
TRAIN = ["train=smoke", "train.steps=3"]
DECODE = ["hardware=cpu", "decode.per_branch=false"]


@pytest.fixture
def tmpfs():
    """``mount(path, size, ro=False)``: a tmpfs at path, unmounted after the test."""
    mounted = []

    def mount(path: Path, size: str = "1m", ro: bool = False) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}" + (",ro" if ro else ""), "tmpfs", str(path)],
                           capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        if subprocess.run(["umount", str(path)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(path)], check=True)  # still busy: detach it


def _client(tmp: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")


def _all_runs(db: Path) -> list:
    c = MlflowClient(tracking_uri=f"sqlite:///{db}")
    return [r for e in c.search_experiments() for r in c.search_runs([e.experiment_id], max_results=1000)]


# ================================================================================================
# A corrupt checkpoint on resume
# ================================================================================================
def test_corrupt_checkpoint_is_refused_in_one_line_and_the_run_left_as_it_was(tmp_path):
    rc, _out, err = wait(start(tmp_path, "train", *TRAIN, "train.time_limit_s=1e-9", name="run"))
    assert rc == 1, err[-3000:]
    ckpt = tmp_path / "out" / "run" / "ckpt" / "last.pt"
    c = _client(tmp_path)
    (before,) = entrypoints.runs(tmp_path / "mlflow.db", "train")[1]
    assert before.info.status == "FAILED" and ckpt.stat().st_size > 1000
    good = ckpt.read_bytes()
    hint = "; to start afresh, delete it or choose another hydra.run.dir"
    for content, what in [(b"", "an empty file (0 bytes), not a checkpoint"),
                          (good[:len(good) // 2], f"truncated or not a checkpoint ({len(good) // 2} bytes, "
                                                  "no archive directory at its end)")]:
        ckpt.write_bytes(content)
        rc, _out, err = wait(start(tmp_path, "train", *TRAIN, name="run"))
        assert rc == 2 and one_line(err) == [f"config error: {ckpt}: {what}{hint}"], err[-3000:]
        assert ckpt.read_bytes() == content  # the file, and the run, as they were
        (after,) = entrypoints.runs(tmp_path / "mlflow.db", "train")[1]
        assert (after.info.status, after.info.end_time, after.data.tags) == \
            (before.info.status, before.info.end_time, before.data.tags)
    ckpt.unlink()  # the hint followed: a new run in the same directory
    rc, _out, err = wait(start(tmp_path, "train", *TRAIN, name="run"))
    assert rc == 0, err[-3000:]
    rs = entrypoints.runs(tmp_path / "mlflow.db", "train")[1]
    assert sorted(r.info.status for r in rs) == ["FAILED", "FINISHED"]
    assert c.get_run(before.info.run_id).info.status == "FAILED"


# ================================================================================================
# Output folders that cannot be written
# ================================================================================================
@pytest.mark.parametrize("key", ["hydra.run.dir", "hydra.sweep.dir"])
def test_unwritable_output_folder_is_refused_before_any_run(tmp_path, tmpfs, key):
    """A read-only mount and a path below a regular file: one line naming the key, the folder and why,
    exit 2, no run in the store (no parent left KILLED) and nothing written."""
    ro = tmpfs(tmp_path / "ro", ro=True)
    (tmp_path / "file").write_text("not a folder\n")
    sweep = ["-m", "seq=64,128"] if key == "hydra.sweep.dir" else ["seq=64"]
    for target, why in [(ro / "out", f"cannot write in {ro}: Read-only file system"),
                        (tmp_path / "file" / "out", f"{tmp_path / 'file'} is a file, not a folder")]:
        rc, out, err = wait(start(tmp_path, "decode", *DECODE, *sweep, f"{key}={target}", name=None))
        assert rc == 2 and one_line(err) == [f"config error: {key}={target}: {why}"], err[-3000:]
        assert out == "" and not target.exists()
        assert not (tmp_path / "mlflow.db").exists() or _all_runs(tmp_path / "mlflow.db") == []
        assert not (tmp_path / "outputs").exists()


# ================================================================================================
# A full disk
# ================================================================================================
def _fill(folder: Path) -> None:
    """Fill folder's filesystem to the last byte."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        with contextlib.suppress(OSError):
            while os.write(fd, b"\0" * 4096):
                pass
    finally:
        os.close(fd)
    assert shutil.disk_usage(folder).free == 0


def _running_child(db: Path, entry: str) -> str | None:
    """A RUNNING child run with its params logged (its job is at work), or None."""
    c = MlflowClient(tracking_uri=f"sqlite:///{db}")
    exp = c.get_experiment_by_name(f"nsa-{entry}")
    for r in c.search_runs([exp.experiment_id]) if exp else []:
        if "mlflow.parentRunId" in r.data.tags and r.info.status == "RUNNING" and r.data.params:
            return r.info.run_id
    return None


def _no_leftovers(err: str, folder: Path, db: Path) -> list:
    """No traceback, no logging error, no temporary file under folder, no run RUNNING: the runs."""
    assert "Traceback" not in err and "Logging error" not in err and "unexpected pos" not in err, err[-5000:]
    assert [p for p in folder.rglob("*") if ".tmp" in p.name] == []
    rs = _all_runs(db)
    assert rs and all(r.info.status != "RUNNING" for r in rs), [(r.info.run_id, r.info.status) for r in rs]
    return rs


def test_checkpoint_on_a_full_disk_fails_the_run_in_one_line(tmp_path, tmpfs):
    """1 MiB holds the step-0 checkpoint of train=smoke (0.7 MiB), not a second one beside it."""
    disk = tmpfs(tmp_path / "disk", size="1m")
    rc, out, err = wait(start(tmp_path, "train", *TRAIN, f"hydra.run.dir={disk / 'run'}", name=None))
    ckpt = disk / "run" / "ckpt" / "last.pt"
    (r,) = _no_leftovers(err, disk, tmp_path / "mlflow.db")
    why = (f"{ckpt}: cannot write the checkpoint: no space left on device "
           f"({r.data.tags.get('error', '').split('(')[-1]}")
    assert rc == 1 and why.endswith("MiB free there); the previous checkpoint is kept"), err[-3000:]
    assert r.info.status == "FAILED" and r.data.tags["error"] == why
    assert [ln for ln in one_line(err) if "FAILED:" in ln] == [f"[train] seq=256: FAILED: {why}"]
    assert ckpt.exists()  # the step-0 checkpoint: the run resumes from it once there is room


def test_sweep_on_a_full_disk_fails_its_jobs_in_one_line_each_and_prints_its_summary(tmp_path, tmpfs):
    """The sweep's folder fills up while its first job runs: that job's log and CSV, the next job's
    folder and the sweep's own files cannot be written."""
    disk = tmpfs(tmp_path / "disk", size="1m")
    entrypoints.make_template(tmp_path / "mlflow.db")  # the poll below then never creates tables beside the sweep
    p = start(tmp_path, "decode", *DECODE, "-m", "seq=64,128", "model.timing.repeats=1000",
              f"hydra.sweep.dir={disk / 'sw'}", name=None)
    t0 = time.time()
    while _running_child(tmp_path / "mlflow.db", "decode") is None and time.time() - t0 < 240:
        assert p.poll() is None, p.communicate()
        time.sleep(0.1)
    log = disk / "sw" / "0_seq=64" / "decode.log"
    with open(log, "ab") as f:  # its last page filled too: the job's next line cannot be written
        f.write(b"-" * (-log.stat().st_size % 4096))
    _fill(disk)
    rc, out, err = wait(p)
    rs = _no_leftovers(err, disk, tmp_path / "mlflow.db")
    assert f"log file {log}: no space left on device; its later lines are on the console only" in one_line(err)
    assert rc == 1, err[-3000:]
    parent = next(r for r in rs if r.data.tags.get("sweep") == "parent")  # not a line run (views.py)
    (child,) = [r for r in rs if "mlflow.parentRunId" in r.data.tags]
    csv = disk / "sw" / "0_seq=64" / "decode.csv"
    assert child.info.status == "FAILED" and child.data.tags["error"] == f"{csv}: no space left on device"
    assert f"[decode] seq=64 job 0: FAILED: {csv}: no space left on device" in one_line(err)
    assert parent.info.status == "FAILED" and "no space left on device" in parent.data.tags["error"]
    assert any(ln.startswith("#  seq  status") for ln in out.splitlines()), out  # the summary, printed
    assert any(ln.startswith("1  128  not run") for ln in out.splitlines()), out
    assert "resume:  python -m experiments.decode" in out
    assert len(one_line(err)) < 25, err


def test_store_on_a_full_disk_fails_the_job_in_one_line_and_prints_the_summary(tmp_path, tmpfs):
    """The SQLite store's disk fills up while the sweep's first job runs, to 40 KiB short of full (room
    for a run's small writes, not for a job's results): what could not be stored is said in one line,
    the runs end FAILED with that reason, and what the console says is what the store holds."""
    disk = tmpfs(tmp_path / "store", size="2m")
    db = disk / "mlflow.db"
    entrypoints.make_template(db)
    p = start(tmp_path, "decode", *DECODE, "-m", "seq=64,128", "model.timing.repeats=1000",
              f"tracking.uri=sqlite:///{db}", name="sw", store=False)
    t0 = time.time()
    while _running_child(db, "decode") is None and time.time() - t0 < 240:
        assert p.poll() is None, p.communicate()
        time.sleep(0.1)
    _fill(disk)
    os.truncate(disk / "filler", (disk / "filler").stat().st_size - 40 * 1024)
    rc, out, err = wait(p)
    (disk / "filler").unlink()
    rs = _no_leftovers(err, tmp_path / "out", db)
    assert rc == 1 and len(one_line(err)) < 20, err[-5000:]
    reason = f"tracking store sqlite:///{db}: no space left on device (SQLite: database or disk is full)"
    parent = next(r for r in rs if r.data.tags.get("sweep") == "parent")  # not a line run (views.py)
    kids = [r for r in rs if "mlflow.parentRunId" in r.data.tags]
    assert parent.info.status == "FAILED" and parent.data.tags["error"].startswith(reason)
    assert [r.data.tags.get("error") for r in kids if r.info.status == "FAILED"][:1] == [reason], kids
    for r in kids:  # the console reports each run as the store has it (a job once ended FINISHED unreported)
        assert re.search(rf"job \d: {r.info.status} in .* run {r.info.run_id}$", err, re.M), (r.info.status, err)
        if r.info.status == "FAILED":
            assert re.search(rf"job \d: FAILED: {re.escape(reason)}$", err, re.M), err
    assert any(ln.startswith("#  seq  status") for ln in out.splitlines()), out  # the summary, printed
