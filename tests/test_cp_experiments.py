"""Context parallelism in the entry points (``parallel.cp``), through the real CLI: ``torchrun`` with 2 ranks
on this CPU (gloo) runs ``experiments.parity parallel.cp=2`` (context-parallel NSA against one device on the
same inputs, float64: ``cp_max_rel_err`` below 1e-10) and ``experiments.prefill parallel.cp=2`` (per-rank
times, the all-gather's share), each into one MLflow run that rank 0 logs and ends FINISHED. And the
misuse: ``parallel.cp=2`` without torchrun, in a sweep, against another WORLD_SIZE, on a length that does not
split into 2 x cp chunks: one line naming the field and the rule, exit 2, no run."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import entrypoints
import pytest
from entrypoints import documented_torchrun, one_line, runs, start, wait

from experiments import env
from experiments.framework import parallel
from experiments.framework.config import ConfigError



def documented(entry: str) -> list[str]:
    """The arguments of the docs' CPU command ``torchrun ... -m experiments.<entry> ... hardware=cpu ...`` (docs/cluster.md)
    (the tests run the documented commands as written, plus their store and output folder)."""
    lines = [ln for ln in documented_torchrun() if f" -m experiments.{entry} " in ln and "hardware=cpu" in ln]
    assert len(lines) == 1, lines
    assert lines[0].startswith("torchrun --standalone --nproc_per_node 2 "), lines[0]
    return lines[0].split(f" -m experiments.{entry} ", 1)[1].split()


TINY = ["hardware=cpu"]


def torchrun(tmp: Path, entry: str, *args: str) -> tuple[int, str, str]:
    """``torchrun --standalone --nproc_per_node 2 -m experiments.<entry> ...`` in tmp, into tmp/mlflow.db.
    torchrun is ``python -m torch.distributed.run`` (the same module its script runs); --standalone picks a
    free port, so a test beside another torchrun on this host does not collide on the default one."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", f"experiments.{entry}", *args, f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}",
           f"hydra.run.dir={tmp / 'out'}"]
    p = subprocess.run(cmd, cwd=tmp, env=entrypoints.env(), capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return entrypoints.make_template(tmp_path_factory.mktemp("template") / "mlflow.db")


def _store(tmp: Path, template: Path) -> None:
    (tmp / "mlflow.db").write_bytes(template.read_bytes())  # an initialized store: skips MLflow's table creation


def test_parity_under_torchrun_logs_cp_max_rel_err(tmp_path, template):
    _store(tmp_path, template)
    args = documented("parity")
    assert {"parallel.cp=2", "dtype=float64"} <= set(args), args
    rc, out, err = torchrun(tmp_path, "parity", *args)
    assert rc == 0, err[-3000:]
    _, found = runs(tmp_path / "mlflow.db", "parity")
    assert len(found) == 1, [r.info.run_name for r in found]  # rank 0's run only
    run = found[0]
    assert run.info.status == "FINISHED"
    m, tags = run.data.metrics, run.data.tags
    assert tags["cp_world"] == "2" and tags["cp_backend"] == "gloo"
    # the output and every gradient of the inputs (q, gates, each branch's raw keys/values) and of phi
    compared = {k for k in m if k.startswith("cp_") and k.endswith("_rel_l2_err")}
    assert compared == {f"cp_{n}_rel_l2_err" for n in ("out", "grad_q", "grad_k_cmp_raw", "grad_v_cmp_raw", "grad_k_sel",
                                                        "grad_v_sel", "grad_k_win", "grad_v_win", "grad_gates",
                                                        "grad_phi_k", "grad_phi_v")}
    assert m["cp_max_rel_err"] == max(m[k] for k in compared) == m["0_cp_max_rel_err"]
    assert m["cp_max_rel_err"] < 1e-10  # float64 through gloo: the same sums, another order (reduce-scatter)
    assert m["parity_failures"] == 0
    assert (tmp_path / "out" / "parity.log").is_file() and (tmp_path / "out" / "parity.rank1.log").is_file()


def test_prefill_under_torchrun_logs_per_rank_times(tmp_path, template):
    _store(tmp_path, template)
    args = documented("prefill")
    assert "parallel.cp=2" in args, args
    rc, out, err = torchrun(tmp_path, "prefill", *args)
    assert rc == 0, err[-3000:]
    _, found = runs(tmp_path / "mlflow.db", "prefill")
    assert len(found) == 1 and found[0].info.status == "FINISHED"
    m, tags = found[0].data.metrics, found[0].data.tags
    for k in ("fwd_p50_ms", "fwd_bwd_p50_ms", "allgather_p50_ms"):
        per_rank = [m[f"rank{r}_{k}"] for r in (0, 1)]
        assert all(v > 0 for v in per_rank), k
        assert m[f"0_{'cp_' if k != 'allgather_p50_ms' else ''}{k}"] == max(per_rank)  # a step waits for the slowest
    assert m["0_allgather_share_of_fwd"] == m["0_allgather_p50_ms"] / m["0_cp_fwd_p50_ms"] > 0
    assert "CUDA" in tags["cp_peak_memory"] and not any("peak_mem" in k for k in m)  # on CPU: said, not logged
    lines = (tmp_path / "out" / "prefill.csv").read_text().splitlines()
    assert len(lines) == 3 and lines[0].startswith("seq_tokens,batch_seqs,cp,rank,tokens_per_rank")


@pytest.mark.parametrize("args,says", [
    (["parallel.cp=2"], ["parallel.cp=2", "torchrun with WORLD_SIZE == parallel.cp", "not started by torchrun"]),
    (["-m", "parallel.cp=2", "seq=64,128"], ["parallel.cp=2", "a sweep (-m) does not run context parallel"]),
    (["parallel.cp=0"], ["parallel.cp=0", "an integer >= 1"]),
], ids=["without-torchrun", "sweep", "zero"])
def test_misuse_is_one_line_exit_2_and_no_run(tmp_path, args, says):
    rc, out, err = wait(start(tmp_path, "parity", *TINY, *args), timeout=120)
    lines = one_line(err)
    assert rc == 2 and len(lines) == 1, err
    assert all(s in lines[0] for s in says), lines[0]
    assert not (tmp_path / "mlflow.db").exists()  # refused before the store was opened: no run, none RUNNING


def test_a_config_error_under_torchrun_is_its_root_cause(tmp_path):
    """A rank's one-line error is what torchrun's failure summary names as the root cause (the error file it
    reads), not a link to its docs below its own traceback; refused before a store exists."""
    rc, out, err = torchrun(tmp_path, "train", "hardware=cpu")
    root = err.split("Root Cause (first observed failure):", 1)
    assert rc != 0 and len(root) == 2, err[-3000:]
    cause = re.search(r"^  traceback : (.*)$", root[1], re.M)
    assert cause and cause.group(1).startswith("config error: parallel.dp=1 parallel.cp=1: dp x cp = 1 must equal "
                                               "torchrun's WORLD_SIZE=2"), root[1]
    # the root cause only: torchrun may stop the other rank before it writes its own file (then "To enable
    # traceback" stands in the summary's other failures)
    assert "exitcode  : 2" in root[1] and "To enable traceback" not in root[1].split("=====", 1)[0]
    assert not (tmp_path / "mlflow.db").exists()


def test_the_rule(monkeypatch):
    """The rule against torchrun's environment (in-process: a torchrun of the wrong size only adds minutes)."""
    for k in env.TORCHRUN_ENV:
        monkeypatch.delenv(k, raising=False)
    parallel.check(1, "decode")  # the default, outside torchrun: as before
    with pytest.raises(ConfigError, match="experiments.decode has no context-parallel path"):
        parallel.check(2, "decode")
    monkeypatch.setenv("RANK", "1")
    assert parallel.rank() == 0 and parallel.rank_suffix() == ""  # RANK alone is not torchrun's
    for k, v in {"LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    assert parallel.rank() == 1 and parallel.rank_suffix() == ".rank1"
    parallel.check(4, "prefill")
    with pytest.raises(ConfigError, match=r"parallel.cp=2: must equal torchrun's WORLD_SIZE=4 .*--nproc_per_node 4"):
        parallel.check(2, "prefill")
    with pytest.raises(ConfigError, match="parallel.cp=1: must equal torchrun's WORLD_SIZE=4"):
        parallel.check(1, "parity")  # every rank would run the whole job and log its own run
    with pytest.raises(ConfigError,
                       match="experiments.decode runs in one process, not under torchrun or SLURM.s tasks with WORLD_SIZE=4"):
        parallel.check(1, "decode")
    with pytest.raises(ConfigError, match="a sweep"):
        parallel.check(1, "parity", sweep=True)
    parallel.check_job(2, 64, "none")
    with pytest.raises(ConfigError, match="seq=60: parallel.cp=4 cuts the sequence into 2 x 4 = 8 equal chunks"):
        parallel.check_job(4, 60, "none")
    with pytest.raises(ConfigError, match="branch_force=sel: parallel.cp > 1 runs the gated sum of all branches"):
        parallel.check_job(2, 64, "sel")


@pytest.mark.parametrize("line", documented_torchrun())
def test_documented_torchrun_lines_compose(line):
    """The GPU lines (hardware=h100, 4 ranks) cannot run here; their arguments compose through the real CLI
    (``--cfg job``: a typo'd key or group fails in one line), and --nproc_per_node equals parallel.dp x parallel.cp
    (parallel.cp alone outside experiments.train)."""
    launcher, rest = line.split(" -m experiments.", 1)
    entry, *args = rest.split()
    nproc = int(re.search(r"--nproc_per_node (\d+)", launcher).group(1))
    dp, cp = (int(next((a.split("=")[1] for a in args if a.startswith(f"parallel.{k}=")), 1)) for k in ("dp", "cp"))
    assert dp * cp == nproc and (entry == "train" or f"parallel.cp={nproc}" in args), line
    p = subprocess.run([sys.executable, "-m", f"experiments.{entry}", *args, "--cfg", "job"], cwd=entrypoints.REPO,
                       env=entrypoints.env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert re.search(rf"^parallel:\n  dp: {dp}\n  cp: {cp}$", p.stdout, re.M), p.stdout[-2000:]
