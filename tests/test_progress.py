"""Long work shows its progress with the time left on a terminal, and elsewhere a log line at most every 30 s,
none for shorter work, through the real CLI: a training run's steps, a sweep's jobs, validate's kernel tests
(experiments/progress.py, tqdm). A
pseudo-terminal (120 columns) stands for the user's terminal."""
from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import entrypoints
import pytest
from entrypoints import run_bounded, start

# tqdm's bar: "<desc>: 40%|####      | 2/5 [00:03<00:04, 1.50step/s]": done/total [elapsed<time left, rate]
TIME_LEFT = r"{n}/{total} \[\d\d:\d\d<\d\d:\d\d, "
TRAIN = ["train=smoke", "train.steps=6", "train.eval_every=6", "train.ckpt_every=6"]
# jobs of a few seconds each: the sweep's bar reads the store every 2 s
SWEEP = ["hardware=cpu", "decode.per_branch=false", "model.timing.repeats=1000", "-m", "seq=64,96,128"]
# the kernel check alone, on five of its interpreter tests (the report then says FAIL: checks left out, exit 1)
VALIDATE = ["hardware=cpu", "validate.checks=[env,kernels]", "validate.sizes.cpu.kernels.select=G1-"]
RC = {"train": 0, "sweep": 0, "validate": 1}


def in_terminal(tmp: Path, entry: str, *args: str, timeout: float = 300) -> tuple[int, str]:
    """``python -m experiments.<entry> args`` with stdin, stdout and stderr on a pseudo-terminal of 120
    columns (a terminal of 0 columns, as ``script`` makes without one, draws an empty bar); its rc and all
    it wrote, carriage returns included."""
    main, side = pty.openpty()
    fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    cmd = [sys.executable, "-m", f"experiments.{entry}", *args, f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}",
           f"hydra.run.dir={tmp / 'out'}", f"hydra.sweep.dir={tmp / 'out'}"]
    p = subprocess.Popen(cmd, cwd=tmp, env=entrypoints.env(), stdin=side, stdout=side, stderr=side, close_fds=True,
                         preexec_fn=entrypoints.default_signals)
    os.close(side)
    chunks, t0 = [], time.monotonic()
    try:
        while True:
            try:
                data = os.read(main, 65536)
            except OSError:  # EIO: the terminal's other side closed (the process exited)
                break
            if not data:
                break
            chunks.append(data)
            assert time.monotonic() - t0 < timeout, b"".join(chunks)[-2000:]
    finally:
        os.close(main)
    return p.wait(timeout=60), b"".join(chunks).decode(errors="replace")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (rc, everything written): each command on a terminal and with pipes."""
    template = entrypoints.make_template(tmp_path_factory.mktemp("template") / "mlflow.db")
    cases = {"train": ("train", TRAIN), "sweep": ("decode", SWEEP), "validate": ("validate", VALIDATE)}
    tmps = {f"{k}_{how}": tmp_path_factory.mktemp(f"{k}_{how}") for k in cases for how in ("tty", "pipe")}
    for t in tmps.values():
        (t / "mlflow.db").write_bytes(template.read_bytes())

    def tty(k):
        return lambda: _Done(*in_terminal(tmps[f"{k}_tty"], cases[k][0], *cases[k][1]))

    launches = {f"{k}_tty": tty(k) for k in cases}
    launches |= {f"{k}_pipe": (lambda k=k: start(tmps[f"{k}_pipe"], cases[k][0], *cases[k][1], name="x")) for k in cases}
    done = run_bounded(launches)
    return {k: (rc, out + err) for k, (rc, out, err, _, _) in done.items()}


class _Done:
    """A finished process, as ``run_bounded`` waits on one (``communicate``)."""

    def __init__(self, rc: int, text: str):
        self.returncode, self.text = rc, text

    def communicate(self, timeout=None):
        return self.text, ""


def test_training_shows_its_steps_and_the_time_left_on_a_terminal(runs):
    rc, text = runs["train_tty"]
    assert rc == 0, text[-3000:]
    assert re.search(r"train: +\d+%\|[^|]*\| " + TIME_LEFT.format(n=3, total=6), text), text[-3000:]
    assert "FINISHED" in text


def test_a_sweep_shows_its_jobs_and_the_time_left_on_a_terminal(runs):
    rc, text = runs["sweep_tty"]
    assert rc == 0, text[-3000:]
    # the bar follows the jobs' runs in the store (read every 2 s): a frame with one or two of three ended, the time left
    assert re.search(r"\[decode\] sweep: +\d+%\|[^|]*\| " + TIME_LEFT.format(n="[12]", total=3), text), text[-3000:]
    # log lines are written above the bar, each on a line of its own
    assert all(ln.lstrip("\r").startswith("[decode] seq=") for ln in text.splitlines() if "] seq=64: FINISHED" in ln)


def test_validates_kernel_tests_show_their_count_and_the_time_left_on_a_terminal(runs):
    rc, text = runs["validate_tty"]
    assert rc == 1 and "Traceback" not in text, text[-3000:]
    # a frame before the last, with the time left (tqdm skips frames drawn within 0.1 s of the one before)
    assert re.search(r"\[validate\] kernel tests: +\d+%\|[^|]*\| " + TIME_LEFT.format(n="[1-4]", total=5), text), \
        text[-3000:]


@pytest.mark.parametrize("case", ["train_pipe", "sweep_pipe", "validate_pipe"])
def test_without_a_terminal_no_bar_is_printed(runs, case):
    rc, text = runs[case]
    assert rc == RC[case.split("_")[0]] and "Traceback" not in text, text[-3000:]
    assert not re.search(r"\d+%\|", text) and "step/s" not in text and "job/s" not in text, text[-3000:]


def test_off_a_terminal_long_work_logs_a_line_at_most_every_interval(caplog, monkeypatch):
    """stderr not a terminal (a pipe, ``| tee``, a batch job's file): long work logs its count and the time left at
    most every ``every_s`` seconds (here 0.2 s), and work shorter than that logs nothing."""
    import logging

    from experiments import progress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    with caplog.at_level(logging.INFO, logger="experiments.progress"):
        with progress.bar(3, "train", "step") as b:  # the default interval: 30 s, never reached here
            b.update(3)
        assert not caplog.records
        t0 = time.monotonic()
        with progress.bar(8, "train", "step", every_s=0.2) as b:
            for _ in range(8):
                time.sleep(0.1)
                b.update(1)
        took = time.monotonic() - t0
    lines = [r.getMessage() for r in caplog.records]
    assert 1 <= len(lines) <= took / 0.2 + 1, lines
    assert all(re.fullmatch(r"train: [1-8]/8 steps, \d\d:\d\d so far, \d\d:\d\d left", ln) for ln in lines), lines
