"""Run the training loop as an entry point would, with a file-backed log (for tests/test_lm_resume.py).

    python tests/lm_run.py --dir DIR [--pause-at STEP] [hydra overrides of conf/train.yaml ...]

Metrics go to DIR/log.jsonl, one JSON line per logged step, flushed to disk before the loop goes on
(the loop's callback contract). A checkpoint in DIR/ckpt is resumed into its own run id, with
``logged_through`` = the last step in the log. ``--pause-at STEP`` sleeps after logging STEP, so that
a test can kill the process at a known point.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from experiments.lm import checkpoint
from experiments.lm.config import RunConfig
from experiments.lm.loop import train

CONF = Path(__file__).resolve().parent.parent / "conf"


def logged_steps(path: Path) -> list[dict]:
    """The complete lines of a log (a process killed mid-write leaves at most one partial line)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--pause-at", type=int, default=None)
    args, overrides = ap.parse_known_args(argv)
    torch.set_num_threads(1)  # the same arithmetic in every process
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = RunConfig.from_conf(compose("train", overrides))
    args.dir.mkdir(parents=True, exist_ok=True)
    ckpt, log_path = args.dir / "ckpt", args.dir / "log.jsonl"
    found = checkpoint.peek(ckpt)
    run_id = found["run_id"] if found else f"run-{os.getpid()}"
    lines = logged_steps(log_path)
    with open(log_path, "a") as f:
        def log(metrics, step):
            f.write(json.dumps({"step": step, "run_id": run_id, **metrics}) + "\n")
            f.flush()
            os.fsync(f.fileno())
            if step == args.pause_at:
                print(f"paused at {step}", flush=True)
                time.sleep(600)

        out = train(cfg, device=torch.device("cpu"), log=log, ckpt_dir=ckpt, run_id=run_id,
                    logged_through=lines[-1]["step"] if lines else 0)
    print(json.dumps({"step": out["step"], "completed": out["completed"]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
