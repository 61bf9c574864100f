"""An entry point's own config rules (decode's, generate's, train's ``check``, passed to ``run_job`` and to
``launch``) through the real CLI: a bad value is one line naming the key, exit 2, no run and no output, in
a single run (``run_job``'s check) and in a sweep, where every job is checked before any starts
(``launch``'s: a job refused later would leave a parent run and a FAILED child, exit 1)."""
from __future__ import annotations

from functools import partial
from importlib.util import find_spec

import pytest
from entrypoints import make_template, one_line, run_bounded, start, wait
from mlflow import MlflowClient

TINY_GENERATE = ["model=tiny", "seq=64", "generate.lm.n_layers=2", "generate.lm.mlp_hidden=128", "generate.lm.vocab=256"]
# name: (entry, arguments, what the one line says)
CASES = {
    "decode_sweep": ("decode", ["hardware=cpu", "decode.ragged=true", "-m", "seq=2,1"],
                     "decode.ragged=true: seq=1 must be >= 2"),
    "generate_sweep": ("generate", ["hardware=cpu", *TINY_GENERATE, "-m", "generate.new_tokens=1,0"],
                       "generate.new_tokens=0: must be an integer >= 1"),
    "train": ("train", ["train.steps=0"], "train.steps=0: must be an integer >= 1"),
    "train_sweep": ("train", ["-m", "train.steps=1,0"], "train.steps=0: must be an integer >= 1"),
}


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    template = make_template(tmp_path_factory.mktemp("template") / "mlflow.db")
    tmp = {k: tmp_path_factory.mktemp(k) for k in CASES}
    done = run_bounded({k: partial(start, tmp[k], entry, *args, template=template) for k, (entry, args, _) in CASES.items()})
    return {k: (tmp[k], rc, err) for k, (rc, _out, err, _t0, _end) in done.items()}


@pytest.mark.parametrize("case", CASES)
def test_an_entrys_own_rule_refuses_before_any_run(refused, case):
    if CASES[case][0] == "generate" and find_spec("transformers") is None:  # it refuses the missing extra first
        pytest.skip("experiments.generate needs the hf extra: pip install -e '.[hf]'")
    tmp, rc, err = refused[case]
    lines = one_line(err)
    assert rc == 2 and len(lines) == 1, (case, err[-2000:])
    assert lines[0].startswith(f"config error: {CASES[case][2]}"), lines[0]  # the rule itself, nothing before it
    if case.endswith("_sweep"):  # the sweep's validation, before its parent run: the job named
        assert "[job: " in lines[0], lines[0]
    assert not (tmp / "out").exists()
    c = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    assert all(not c.search_runs([e.experiment_id]) for e in c.search_experiments())


@pytest.mark.parametrize("launcher", ["slurm", "per_gpu"])
def test_a_launcher_without_its_extra_names_the_extra(tmp_path, launcher):
    """Hydra's submitit launcher hidden (as on the Quickstart's install, without the cluster extra): one line
    naming the extra, exit 2, nothing made."""
    driver = ("import runpy, sys\nsys.modules['hydra_plugins.hydra_submitit_launcher'] = None\n"
              "sys.argv[0] = 'experiments.decode'\n"
              "runpy.run_module('experiments.decode', run_name='__main__', alter_sys=True)\n")
    rc, _, err = wait(start(tmp_path, "decode", "-m", f"hydra/launcher={launcher}", "hardware=cpu", "seq=64,128",
                            driver=driver), timeout=300)
    assert rc == 2 and one_line(err) == [
        f"config error: hydra/launcher={launcher}: needs the cluster extra (Hydra's submitit launcher, "
        f"hydra_plugins.hydra_submitit_launcher): pip install -e '.[cluster]'"], err[-3000:]
    assert not (tmp_path / "mlflow.db").exists()


def test_the_hf_integration_without_its_extra_names_the_extra():
    """``import nsa.integrations.hf`` where transformers is not installed (hidden here): an ImportError whose one
    message line names the extra and its install line."""
    import subprocess
    import sys

    import entrypoints

    code = "import sys\nsys.modules['transformers'] = None\nimport nsa.integrations.hf\n"
    p = subprocess.run([sys.executable, "-c", code], env=entrypoints.env(), capture_output=True, text=True, timeout=120)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and last.startswith("ImportError: nsa.integrations.hf needs transformers, the hf extra: "
                                                  "pip install -e '.[hf]'"), p.stderr[-2000:]


@pytest.mark.parametrize("arg,says", [
    ("train.lr=inf", "train.lr=inf: must be a finite number"),
    ("train.weight_decay=inf", "train.weight_decay=inf: must be a finite number"),
    ("train.grad_clip=inf", "train.grad_clip=inf: must be a finite number"),
    ("train.time_limit_s=inf", "train.time_limit_s=inf: must be a finite number (null: no time limit)"),
    ("train.min_lr_ratio=nan", "train.min_lr_ratio=nan: must be a finite number"),
])
def test_a_non_finite_training_number_is_one_line(tmp_path, arg, says):
    """A training hyper-parameter that is inf or nan (one that passed the range checks ran to a NaN loss, or to no
    end): one line, exit 2, no store made."""
    rc, _, err = wait(start(tmp_path, "train", "train=smoke", arg), timeout=300)
    assert rc == 2 and one_line(err) == [f"config error: {says}"], err[-3000:]
    assert not (tmp_path / "mlflow.db").exists()
