"""The resume line a stopped training run prints pastes back into a shell as printed: its
``hydra.run.dir=...`` is quoted for the shell and, where Hydra's grammar needs it (a comma would make a
sweep), for Hydra. Before, ``hydra.run.dir=<d>/sp ace`` was printed bare: pasted, the shell split it in two
and Hydra's parser failed. Through the real CLI and a real shell (bash -c)."""
from __future__ import annotations

import shlex
import subprocess
import sys

from entrypoints import env, runs, start, wait

BASE = ["train=smoke", "train.steps=3"]
SAID = "the same command with "


def test_the_printed_resume_line_pastes_back_as_printed(tmp_path):
    out = tmp_path / "sp ace" / "r,1"
    store = f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"
    rc, _o, err = wait(start(tmp_path, "train", *BASE, "train.time_limit_s=1e-9",
                             "hydra.run.dir=" + "'" + str(out) + "'", name=None))
    assert rc == 1, err[-3000:]  # stopped by its time limit after step 1, its checkpoint written
    line = next(ln for ln in err.splitlines() if "FAILED: JobFailure: stopped by train.time_limit_s" in ln)
    pasted = line.split(SAID, 1)[1]
    cmd = shlex.join([sys.executable, "-m", "experiments.train", *BASE, "train.time_limit_s=null", store])
    r = subprocess.run(["bash", "-c", f"{cmd} {pasted}"], cwd=tmp_path, env=env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, (pasted, r.stderr[-3000:])
    _c, rs = runs(tmp_path / "mlflow.db", "train")
    (run,) = rs  # the stopped run, continued: one run
    assert run.info.status == "FINISHED" and run.data.tags.get("resumed") == "1"
