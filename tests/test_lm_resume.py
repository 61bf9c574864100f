"""A training run killed with SIGKILL resumes from its last checkpoint into the same run, and its
metric curve has every step once, equal bit for bit to an uninterrupted run's (CPU)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from lm_run import logged_steps

from experiments.lm import checkpoint

REPO = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "lm_run.py"
STEPS = 10
# NSA on the retrieval task, so that the gates and the selection quality are part of the comparison.
OVERRIDES = ["train=smoke", "attention=nsa", "data=retrieval", "data.seq_len=96", "data.n_pairs=8", "data.n_queries=4",
             f"train.steps={STEPS}", "train.batch=2", "train.log_every=1", "train.eval_every=2", "train.ckpt_every=4",
             "train.sel_rows=8"]
# Wall-clock measurements differ between runs; everything else must not.
TIMING = {"tokens_per_s", "model_tflop_per_s", "rss_peak_gib"}


def _cmd(run_dir, *extra):
    return [sys.executable, str(SCRIPT), "--dir", str(run_dir), *extra, *OVERRIDES]


def _env():
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _run(run_dir):
    subprocess.run(_cmd(run_dir), check=True, cwd=REPO, env=_env(), capture_output=True, timeout=300)


def test_kill_9_resumes_without_gaps_or_duplicates(tmp_path):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    _run(ref_dir)
    ref = logged_steps(ref_dir / "log.jsonl")
    assert [m["step"] for m in ref] == list(range(1, STEPS + 1))

    # Paused after logging step 6: checkpoints exist for steps 0 and 4, steps 5 and 6 are logged only.
    p = subprocess.Popen(_cmd(run_dir, "--pause-at", "6"), cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.strip() == "paused at 6", (line, p.stderr.read() if p.poll() is not None else "")
        os.kill(p.pid, signal.SIGKILL)
        assert p.wait(timeout=60) == -signal.SIGKILL
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    before = logged_steps(run_dir / "log.jsonl")
    assert [m["step"] for m in before] == [1, 2, 3, 4, 5, 6]
    assert checkpoint.peek(run_dir / "ckpt") == {"run_id": before[0]["run_id"], "step": 4}

    _run(run_dir)  # resumes from step 4, recomputes 5 and 6 without logging them, logs 7..10
    got = logged_steps(run_dir / "log.jsonl")
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    assert {m["run_id"] for m in got} == {before[0]["run_id"]}
    assert checkpoint.peek(run_dir / "ckpt")["step"] == STEPS
    for a, b in zip(ref, got):
        assert set(a) == set(b)
        same = {k: a[k] for k in a if k not in TIMING | {"run_id"}}
        assert same == {k: b[k] for k in same}, a["step"]  # exact: floats compared bit for bit
    assert {"sel_mass", "sel_recall", "gate_sel", "val_accuracy"} <= set(got[-1])
