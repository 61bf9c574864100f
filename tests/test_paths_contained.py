"""A config value that becomes part of a path cannot leave the run's or the sweep's folder,
through the real CLI: ``tracking.experiment=x/../../../../ESCAPED`` names a train sweep's job folders (they
are named by their overrides) and the experiment's artifact folder. Before, the jobs wrote into
``<sweep dir>/../../../ESCAPED,...`` (one folder for both, one job failed) and the artifacts into
``<store dir>/mlruns/../../../ESCAPED/<run>``. Each command runs four folders deep in tmp, so that what
escapes lands in tmp, where the test looks for it."""
from __future__ import annotations

from pathlib import Path

import pytest
from entrypoints import start, wait
from mlflow import MlflowClient

ESCAPE = "tracking.experiment=x/../../../../ESCAPED"
DEEP = ("a", "b", "c", "d")


def _deep(tmp: Path) -> Path:
    d = tmp.joinpath(*DEEP)
    d.mkdir(parents=True)
    return d


def _outside(tmp: Path, inside: Path) -> list[str]:
    """Everything under tmp that is neither inside ``inside`` nor one of the folders above it."""
    above = {inside, *inside.parents}
    return sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*")
                  if p not in above and inside not in p.parents)


@pytest.fixture(scope="module")
def escaped(tmp_path_factory):
    tmp = {k: tmp_path_factory.mktemp(k) for k in ("train", "decode")}
    deep = {k: _deep(t) for k, t in tmp.items()}
    procs = {
        "train": start(deep["train"], "train", "-m", "attention=nsa,dense", "train=smoke", "train.steps=3",
                       "train.ckpt_every=2", ESCAPE, f"hydra.sweep.dir={deep['train'] / 's'}", name=None),
        "decode": start(deep["decode"], "decode", "seq=64", "decode.per_branch=false", ESCAPE,
                        f"hydra.run.dir={deep['decode'] / 'out'}", name=None),
    }
    return {k: (tmp[k], deep[k], *wait(p)) for k, p in procs.items()}


def test_a_sweeps_job_folders_stay_in_the_sweep_folder(escaped):
    tmp, deep, rc, _out, err = escaped["train"]
    assert rc == 0, err[-3000:]
    assert _outside(tmp, deep) == []
    jobs = sorted(p.name for p in (deep / "s").iterdir() if p.is_dir())
    assert len(jobs) == 2 and all("x%2F..%2F..%2F..%2F..%2FESCAPED" in j for j in jobs), jobs
    c = MlflowClient(tracking_uri=f"sqlite:///{deep / 'mlflow.db'}")
    exp = c.get_experiment_by_name("x/../../../../ESCAPED")
    kids = [r for r in c.search_runs([exp.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
    assert sorted(r.info.status for r in kids) == ["FINISHED", "FINISHED"]


def test_an_experiments_artifacts_stay_under_the_artifact_root(escaped):
    tmp, deep, rc, _out, err = escaped["decode"]
    assert rc == 0, err[-3000:]
    assert _outside(tmp, deep) == []
    c = MlflowClient(tracking_uri=f"sqlite:///{deep / 'mlflow.db'}")
    exp = c.get_experiment_by_name("x/../../../../ESCAPED")
    (run,) = c.search_runs([exp.experiment_id])
    where = Path(run.info.artifact_uri.removeprefix("file://")).resolve()
    assert (deep / "mlruns") in where.parents and (where / "decode.csv").is_file()
