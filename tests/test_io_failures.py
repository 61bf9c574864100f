"""Files that cannot be read or written, through the real CLI (issue 31): a corrupt checkpoint on resume,
output folders that cannot be written, a full disk under a checkpoint, a sweep's outputs or the tracking
store. Each ends in one line naming the path and the cause, with nothing left RUNNING and no temporary
file behind.

Read-only folders and full disks are small tmpfs mounts (root only: skipped where mount is refused); as
root, a folder's permission bits stop nothing, so a read-only mount is the way to refuse writes.
"""
from __future__ import annotations

import subprocess
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
# Item 3: a corrupt checkpoint on resume
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
# Item 4: output folders that cannot be written
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
