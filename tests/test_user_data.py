"""Nothing of the user's is lost, through the real CLI: a config error removes only what its own process made
(never a folder or a file that was there before: ``hydra.run.dir=logs``, ``hydra.run.dir=.``), and a checkpoint
whose bytes changed is refused in one line before its run is reopened (the digest written with it), and a step
whose store calls fail midway is logged whole or not at all."""
from __future__ import annotations

import zipfile
from pathlib import Path

import entrypoints
import pytest
from entrypoints import one_line, start, wait

# a config error each entry point finds after Hydra made its run dir
BAD = {"decode": ["hardware=cpu", "seq=0"], "validate": ["hardware=cpu", "validate.size=tiny"]}
TRAIN = ["train=smoke", "train.steps=3"]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("entry", ["decode", "validate"])
def test_a_config_error_keeps_a_folder_that_was_there(tmp_path, entry):
    """The user's folder as run dir (with a log file of its own and one of an earlier run of this entry point, and
    the launch directory itself): every file that was there stays, byte for byte, and nothing the run made is left."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "app.log").write_text("the user's log\n")
    (logs / f"{entry}.log").write_text("an earlier run's log\n")
    (tmp_path / "notes.txt").write_text("the user's notes\n")
    args = BAD[entry]
    for run_dir, folder in (("logs", logs), (".", tmp_path)):
        before = _files(tmp_path)
        rc, _out, err = wait(start(tmp_path, entry, *args, f"hydra.run.dir={run_dir}", name=None, store=False))
        assert rc == 2 and len(one_line(err)) == 1 and one_line(err)[0].startswith("config error: "), err[-2000:]
        assert _files(tmp_path) == before, run_dir  # nothing removed, nothing changed, nothing left
        assert folder.is_dir()
    # a folder this process makes (and the empty ones above it) still goes
    rc, _out, err = wait(start(tmp_path, entry, *args, "hydra.run.dir=new/deep", name=None, store=False))
    assert rc == 2, err[-2000:]
    assert not (tmp_path / "new").exists()


def _flip_inside_a_weight(ckpt: Path, n: int = 64) -> None:
    """``n`` bytes inverted in the middle of the checkpoint's largest tensor (torch.save stores each tensor's
    bytes as one uncompressed member of its zip archive)."""
    with zipfile.ZipFile(ckpt) as z:
        member = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(ckpt.read_bytes())
    with ckpt.open("rb") as f:  # the member's data follows its local header (30 bytes, its name, its extra field)
        f.seek(member.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    at = member.header_offset + 30 + name_len + extra_len + member.file_size // 2
    raw[at:at + n] = bytes(b ^ 0xFF for b in raw[at:at + n])
    ckpt.write_bytes(bytes(raw))


def test_a_corrupted_checkpoint_is_refused_before_its_run_is_reopened(tmp_path):
    rc, _out, err = wait(start(tmp_path, "train", *TRAIN, "train.time_limit_s=1e-9", name="run"))
    assert rc == 1, err[-3000:]
    ckpt = tmp_path / "out" / "run" / "ckpt" / "last.pt"
    (before,) = entrypoints.runs(tmp_path / "mlflow.db", "train")[1]
    _flip_inside_a_weight(ckpt)
    bad = ckpt.read_bytes()
    rc, _out, err = wait(start(tmp_path, "train", *TRAIN, name="run"))
    want = (f"config error: {ckpt}: a corrupt checkpoint ({len(bad)} bytes; its contents differ from the digest "
            "written with them); to start afresh, delete it or choose another hydra.run.dir")
    assert rc == 2 and one_line(err) == [want], err[-3000:]
    assert ckpt.read_bytes() == bad
    (after,) = entrypoints.runs(tmp_path / "mlflow.db", "train")[1]
    assert (after.info.status, after.info.end_time, after.data.tags) == \
        (before.info.status, before.info.end_time, before.data.tags)  # not reopened


def test_a_malformed_checkpoint_is_one_line(tmp_path):
    """A checkpoint whose digest holds but whose fields do not (rewritten by hand, by another tool): each missing or
    mistyped field refused in one line naming it, exit 2, the run not reopened."""
    import torch

    from experiments.lm import checkpoint

    rc, _out, err = wait(start(tmp_path, "train", *TRAIN, "train.time_limit_s=1e-9", name="run"))
    assert rc == 1, err[-3000:]
    ckpt = tmp_path / "out" / "run" / "ckpt" / "last.pt"
    good = torch.load(ckpt, weights_only=True)
    (before,) = entrypoints.runs(tmp_path / "mlflow.db", "train")[1]
    cases = {"step": ("missing", "an integer in [0, 2**62] (missing)"), "data_position": (-1, "(int -1)"),
             "run_id": (7, "a non-empty string (int 7)"), "config": ("x", "a mapping (str 'x')")}
    for key, (value, says) in cases.items():
        state = {k: v for k, v in good.items() if k not in ("format", "digest")}
        if value == "missing":
            del state[key]
        else:
            state[key] = value
        checkpoint.save(ckpt.parent, state)
        rc, _out, err = wait(start(tmp_path, "train", *TRAIN, name="run"))
        lines = one_line(err)
        assert rc == 2 and len(lines) == 1, err[-3000:]
        assert f"{ckpt}: a malformed checkpoint: {key} must be" in lines[0] and says in lines[0], lines[0]
    (after,) = entrypoints.runs(tmp_path / "mlflow.db", "train")[1]
    assert (after.info.status, after.info.end_time) == (before.info.status, before.info.end_time)  # not reopened


class _FailingCall:
    """An MlflowClient (a real SQLite store) whose ``fail_at``-th ``log_batch`` call raises, as a server lost
    mid-step would."""

    def __init__(self, client, fail_at: int):
        self.client, self.fail_at, self.calls = client, fail_at, 0

    def log_batch(self, *args, **kw):
        self.calls += 1
        if self.calls == self.fail_at:
            raise ConnectionError("the store went away")
        return self.client.log_batch(*args, **kw)


@pytest.mark.parametrize("n", [150, 1000, 1500])
def test_a_step_is_whole_or_not_logged(tmp_path, n):
    """A step's metrics, the second store call failing: either every metric of the step is stored, or its first
    (the one a resumed training reads to count a step as logged: its loss) is not. Up to MLflow's 1000 metrics a call,
    the step is one call."""
    from mlflow import MlflowClient

    from experiments.framework import tracking

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    rid = client.create_run(client.create_experiment("x")).info.run_id
    metrics = {"loss": 1.0, **{f"m{i:04d}": float(i) for i in range(n - 1)}}
    failing = _FailingCall(client, fail_at=2)
    try:
        tracking.log_batch(failing, rid, metrics=metrics, step=7)
    except ConnectionError:
        pass
    stored = client.get_run(rid).data.metrics
    assert failing.calls == (1 if n <= 1000 else 2)
    assert ("loss" not in stored) if len(stored) < n else stored == metrics, (len(stored), "loss" in stored)
