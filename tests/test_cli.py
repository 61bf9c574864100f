"""The command line through the real CLI: overrides on both sides of -m, the design card's command,
--cfg / --help with -m, one-line config errors (exit 2, nothing started), store failures in seconds,
MLFLOW_TRACKING_URI, this project's git commit only, a sweep whose parent cannot be created."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from functools import partial
from importlib.util import find_spec
from pathlib import Path

import entrypoints
import pytest
from entrypoints import ENTRIES, REPO, argv, cores, documented_commands, one_line, run_bounded, start, wait
from mlflow import MlflowClient

from experiments.framework import cli, hardware, sweep

CPU_NOTE = sweep.CPU_FIGURES  # what times from a CPU are, under a sweep's and a single run's last lines
CARD = ["hardware=h100", "-m", "seq=512,1024,2048,4096"]  # the design card's command
# A command that needs a GPU (or the Triton interpreter): on this CPU machine, the one-line refusal.
NEEDS_GPU = re.compile(r"hardware=(h200|h100|a100|rtx4090)\b|backend=(triton|fa2|sdpa)\b")
# Commands against the team server run where the server runs: tests/test_cluster.py runs the README's
# cluster block as written against `scripts/cluster.sh up` (CI starts it).
NEEDS_CLUSTER = re.compile(r"tracking=server\b|hydra/launcher=(slurm|per_gpu)\b")
# experiments.validate on the CPU takes minutes: tests/test_validate.py runs its documented commands.
RUN_BY_TEST_VALIDATE = re.compile(r"experiments\.validate hardware=cpu\b")


def local_commands() -> list[str]:
    """The documented commands this test module runs (the cluster's run in tests/test_cluster.py, the
    training's in tests/test_train.py, which checks what they log)."""
    return [c for c in documented_commands()
            if not NEEDS_CLUSTER.search(c) and not RUN_BY_TEST_VALIDATE.search(c) and argv(c)[0][1] != "experiments.train"]


def test_overrides_move_in_front_of_the_flags():
    assert cli.normalize(["hardware=cpu", "-m", "seq=1,2"]) == ["hardware=cpu", "seq=1,2", "-m"]
    assert cli.normalize(["-m", "seq=1,2", "hydra.verbose=true"]) == ["seq=1,2", "hydra.verbose=true", "-m"]
    assert cli.normalize(["--cfg", "job", "seq=4"]) == ["seq=4", "--cfg", "job"]
    # -m with --cfg: each job's config, printed by the sweeper; with --help: the sweep's lists dropped
    assert cli.normalize(["seq=1,2", "-m", "--cfg", "hydra", "--resolve"]) == \
        ["seq=1,2", "hydra.sweeper.show=hydra", "hydra.sweeper.show_resolve=true", "-m"]
    assert cli.normalize(["--help", "-m", "seq=1,2", "model=tiny"]) == ["model=tiny", "--help"]


def test_precheck_rejects_unknown_group_options(capsys):
    with pytest.raises(SystemExit) as e:
        cli.precheck(["seq=64", "backend=reference,nope"], "decode")
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "backend=nope" in err[0]
    cli.precheck(["backend=triton", "-m", "seq=1,2"], "decode")  # known options pass


# name: (entry, arguments, texts the one stderr line holds). Each exits 2 before any run or output: a
# Hydra composition or parse error, a list without -m, a value prepare() refuses (the rest of
# prepare's rules: test_conf.py, in-process).
ONE_LINE = {
    "typo_key": ("decode", ["sqe=512"], ["sqe=512: the decode config has no key 'sqe'; did you mean seq"]),
    "typo_key_in_sweep": ("decode", ["-m", "sqe=1,2"], ["'sqe'", "did you mean seq"]),
    # Hydra's own hint for a typo was "+sqe=512", which appended the key and ran seq's default
    "typo_key_appended": ("decode", ["+sequence=512"], ["the decode config has no key 'sequence'; did you mean seq"]),
    "typo_key_forced": ("decode", ["++sequence=512"], ["no key 'sequence'"]),
    "typo_nested_key": ("decode", ["decode.per_brnch=false"], ["no key 'decode.per_brnch'", "decode.per_branch"]),
    "bad_syntax": ("decode", ["seq=[1,2"], ["seq=[1,2"]),
    "list_without_m": ("decode", ["seq=64,128"], ["add -m"]),
    "negative_memory_limit": ("decode", ["limits.max_memory_gib=-1"], ["limits.max_memory_gib=-1", "> 0"]),
    # decode.batch is ${model.batch}: the error names the key typed
    "interpolated_key": ("decode", ["hardware=cpu", "seq=64", "model.batch=-1"], ["config error: model.batch=-1: must be"]),
    # a sweep's size is bounded before any list or product is built
    "sweep_too_long": ("decode", ["hardware=cpu", "-m", "seq=range(1,1000000000)"],
                       ["seq=range(1,1000000000): more than 10000 values; a sweep runs at most 10000 jobs"]),
    "sweep_product_too_large": ("decode", ["hardware=cpu", "-m", "seq=range(64,264)", "seed=range(0,100)"],
                                ["200 seq x 100 seed = 20000 jobs; a sweep runs at most 10000 jobs"]),
    # two jobs of one value shared a run's row and an output folder; a glob of nothing crashed in the sweeper
    "sweep_value_twice": ("decode", ["hardware=cpu", "-m", "seq=64,128,64"],
                          ["seq=64,128,64: seq=64 is listed twice; a sweep runs each value once"]),
    "sweep_no_value": ("decode", ["hardware=cpu", "-m", "seq=glob(*)"], ["seq=glob(*): sweeps no value"]),
    "train_seed_past_int64": ("train", ["train=smoke", "seed=99999999999999999999"],
                              ["seed=99999999999999999999: must be an integer >= 0 (at most 2**63 - 1, torch's int64)"]),
    "bad_decode_preference": ("decode", ["hardware=cpu", "++hardware.policy.by_entry={decode: {win: nope}}"],
                              ["hardware.policy.by_entry.decode.win='nope'", "unknown backend"]),
}
# Store failures: one line naming the store and the cause, in seconds (MLflow alone retried for 107-252 s).
STORE_DOWN = {
    "server_down": (["tracking.uri=http://127.0.0.1:9"], ["http://127.0.0.1:9", "Connection refused"]),
    "server_down_sweep": (["-m", "seq=64,128", "tracking.uri=http://127.0.0.1:9"], ["http://127.0.0.1:9", "refused"]),
    "sqlite_unwritable": (["tracking.uri=sqlite:////proc/nsa-bench.db"], ["sqlite:////proc/nsa-bench.db", "/proc"]),
    # MLflow's whole message, its fix included (not cut at 300 characters, before the fix)
    "file_store": (["tracking.uri=file:///tmp/nsa-bench-mlruns"], ["file:///tmp/nsa-bench-mlruns", "migrate-filestore",
                                                                    "MLFLOW_ALLOW_FILE_STORE=true"]),
}


def _git_copy(tmp: Path) -> Path:
    """The project's files (no .git of their own) inside another git repository."""
    subprocess.run(["git", "init", "-q", str(tmp)], check=True)
    subprocess.run(["git", "-C", str(tmp), "-c", "user.email=x@y", "-c", "user.name=x", "commit", "-q",
                    "--allow-empty", "-m", "enclosing"], check=True)
    for d in ("nsa", "experiments", "conf", "hydra_plugins"):
        shutil.copytree(REPO / d, tmp / "copy" / d, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp / "copy"


def _doc_command(tmp: Path, cmd: str) -> subprocess.Popen:
    args, extra = argv(cmd)
    return subprocess.Popen([sys.executable, *args], cwd=tmp, env=entrypoints.env(**extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """Every command, as many at once as this machine has cores (each is mostly interpreter start-up);
    (tmp, rc, stdout, stderr, seconds)."""
    template = entrypoints.make_template(tmp_path_factory.mktemp("template") / "mlflow.db")
    procs = {}  # name -> (tmp, a function that starts the process)
    for k, (entry, args, _) in ONE_LINE.items():
        tmp = tmp_path_factory.mktemp(k)
        procs[k] = (tmp, partial(start, tmp, entry, *args, name=k))
    for cmd in local_commands():  # as written, each in a directory of its own (the default store)
        tmp = tmp_path_factory.mktemp("doc")
        shutil.copy(template, tmp / "mlflow.db")
        procs[cmd] = (tmp, partial(_doc_command, tmp, cmd))
    tmp = tmp_path_factory.mktemp("help")
    procs["help_sweep"] = (tmp, partial(start, tmp, "decode", "--help", "-m", "seq=1,2", "hydra.verbose=false", name=None,
                                        store=False))
    # MLFLOW_TRACKING_URI is the store unless tracking.uri is given; hydra.* overrides on both sides of -m.
    tmp = tmp_path_factory.mktemp("env_uri")
    shutil.copy(template, tmp / "env.db")
    shutil.copy(template, tmp / "cli.db")
    env_uri = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'env.db'}"}
    procs["env_uri"] = (tmp, partial(start, tmp, "decode", "hydra.job.chdir=false", "-m", "seq=64", "decode.per_branch=false",
                                     f"hydra.sweep.dir={tmp / 'env'}", name=None, store=False, extra_env=env_uri))
    procs["cli_uri"] = (tmp, partial(start, tmp, "decode", "seq=64", "decode.per_branch=false",
                                     f"tracking.uri=sqlite:///{tmp / 'cli.db'}", name="cli", store=False, extra_env=env_uri))
    tmp = tmp_path_factory.mktemp("git_copy")
    procs["git_copy"] = (tmp, partial(start, tmp, "decode", "seq=64", "decode.per_branch=false", name="x", template=template,
                                      repo=_git_copy(tmp)))
    # The sweep's parent cannot be created (its experiment is deleted): the sweep must not start.
    tmp = tmp_path_factory.mktemp("parent_fails")
    shutil.copy(template, tmp / "mlflow.db")
    c = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    c.delete_experiment(c.create_experiment("nsa-decode"))
    procs["parent_fails"] = (tmp, partial(start, tmp, "decode", "-m", "seq=64,128", name="x"))
    return _finish(procs)


def _finish(procs: dict) -> dict:
    """name -> (tmp, rc, stdout, stderr, seconds from this process's start to its exit)."""
    done = run_bounded({k: launch for k, (_, launch) in procs.items()})
    return {k: (procs[k][0], rc, o, e, end - t0) for k, (rc, o, e, t0, end) in done.items()}


@pytest.fixture(scope="module")
def store_down_runs(tmp_path_factory):
    """The store failures alone (after the big batch): their time is the claim under test."""
    procs = {}
    for k, (args, _) in STORE_DOWN.items():
        tmp = tmp_path_factory.mktemp(k)
        procs[k] = (tmp, partial(start, tmp, "decode", *args, name=k, store=False))
    return _finish(procs)


def test_processes_run_at_most_as_many_at_once_as_there_are_cores():
    n = cores() + 2
    done = run_bounded({i: partial(subprocess.Popen, [sys.executable, "-c", "import time; time.sleep(1.5)"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)})
    assert sorted(done) == list(range(n)) and all(rc == 0 for rc, *_ in done.values())
    spans = [(t0, end) for _, _, _, t0, end in done.values()]
    at_once = max(sum(a <= t < b for a, b in spans) for t, _ in spans)  # alive at each process's start
    assert at_once == min(n, cores())


@pytest.mark.parametrize("case", ONE_LINE)
def test_config_errors_are_one_line_and_exit_2(cli_runs, case):
    tmp, rc, out, err, _ = cli_runs[case]
    lines = one_line(err)
    assert rc == 2, (case, err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("config error:"), (case, err)
    assert all(s in lines[0] for s in ONE_LINE[case][2]), (case, lines[0])
    assert not (tmp / "out").exists() and not (tmp / "outputs").exists()  # nothing started, nothing written
    if (tmp / "mlflow.db").exists():
        c = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
        assert all(not c.search_runs([e.experiment_id]) for e in c.search_experiments())


@pytest.mark.parametrize("case", STORE_DOWN)
def test_store_failures_are_one_line_in_seconds(store_down_runs, case):
    tmp, rc, out, err, seconds = store_down_runs[case]
    lines = one_line(err)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("config error: tracking store"), (case, err[-2000:])
    assert all(s in lines[0] for s in STORE_DOWN[case][1]), lines[0]
    assert seconds < 45  # ~5-10 s on a shared 2-core machine; MLflow alone retried for 107-252 s
    assert not (tmp / "out").exists() and "Launching" not in out


@pytest.mark.parametrize("cmd", local_commands())
def test_documented_commands_run_as_written(cli_runs, cmd):
    if argv(cmd)[0][1] == "experiments.generate" and not NEEDS_GPU.search(cmd) and find_spec("transformers") is None:
        pytest.skip("experiments.generate needs the hf extra: pip install -e '.[hf]'")
    tmp, rc, out, err, _ = cli_runs[cmd]
    if NEEDS_GPU.search(cmd):  # here: refused before anything starts, in one line
        assert rc == 2 and len(one_line(err)) == 1 and one_line(err)[0].startswith("config error:"), err[-2000:]
    else:
        assert rc == 0 and "Traceback" not in err, err[-3000:]


def test_documented_commands_cover_the_card_and_every_entry():
    cmds = documented_commands()
    assert "python -m experiments.decode " + " ".join(CARD) in cmds  # the design card's
    assert "python -m experiments.decode hardware=cpu -m seq=256,512" in cmds  # its form, on a CPU
    assert {argv(c)[0][1] for c in cmds} == {f"experiments.{e}" for e in ENTRIES}
    assert any(not NEEDS_GPU.search(c) and argv(c)[0][1] == f"experiments.{e}" for e in ENTRIES for c in cmds)
    # every cluster command is a run line of the README's cluster block or of the block for a training over
    # SLURM's tasks, which tests/test_cluster.py runs, or of the block for a host without apt, which
    # tests/test_cluster_prefix.py runs
    sections = "".join(entrypoints.doc_section(h) for h in (
        "Sweeps on a SLURM cluster", "Several hosts: SLURM's tasks", "SLURM on a host without apt"))
    block = " ".join(re.findall(r"```bash\n(.*?)```", sections, re.S)).split("\n")
    runs = [" ".join(seg.split()) for ln in block for seg in ln.split("&&")]
    assert all(c in runs for c in cmds if NEEDS_CLUSTER.search(c))


def test_card_command_elsewhere_stops_with_the_profile_mismatch(cli_runs):
    tmp, rc, out, err, _ = cli_runs["python -m experiments.decode " + " ".join(CARD)]
    assert rc == 2 and one_line(err) == [
        "config error: hardware=h100 does not match the detected device " + err.split("detected device ")[1].strip()]
    # on this CPU: the profiles that run here, not strict=false (a GPU profile is never timed on a CPU)
    assert "; use hardware=cpu or hardware=auto on this machine [job: " in err and "strict" not in err
    assert not (tmp / "outputs").exists()


# A GPU profile forced onto this CPU (hardware.strict=false): the timed entry points refuse it in one line,
# single runs and sweeps alike, before the GPU backends' availability is looked at.
GPU_PROFILE_ON_CPU = {
    "decode": ("decode", ["hardware=rtx4090", "hardware.strict=false"]),
    "kernels_sweep": ("kernels", ["hardware=h100", "hardware.strict=false", "model=tiny", "-m", "seq=64,128"]),
    "train": ("train", ["hardware=h200", "hardware.strict=false"]),
}


@pytest.mark.skipif(hardware.detect().type == "cuda", reason="the rule is about a machine without the GPU")
def test_a_gpu_profile_is_never_timed_on_a_cpu(tmp_path):
    template = entrypoints.make_template(tmp_path / "template.db")
    procs = {}
    for k, (entry, args) in GPU_PROFILE_ON_CPU.items():
        (tmp_path / k).mkdir()
        procs[k] = (tmp_path / k, partial(start, tmp_path / k, entry, *args, name=k, template=template))
    for k, (tmp, rc, _out, err, _) in _finish(procs).items():
        lines, name = one_line(err), GPU_PROFILE_ON_CPU[k][1][0]
        assert rc == 2 and len(lines) == 1, (k, err[-2000:])
        assert lines[0].startswith(f"config error: {name}: a GPU profile is timed on its GPU only"), (k, lines[0])
        assert "use hardware=cpu (or hardware=auto)" in lines[0], lines[0]
        assert not (tmp / "out").exists() and not (tmp / "outputs").exists()
        c = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
        assert all(not c.search_runs([e.experiment_id]) for e in c.search_experiments())  # none RUNNING, none at all


@pytest.mark.skipif(hardware.detect().type == "cuda", reason="a CPU machine's message")
def test_bare_kernels_on_a_cpu_says_how_to_run_them_here(tmp_path):
    """Bare ``python -m experiments.kernels`` (no TRITON_INTERPRET): the one line gives the interpreter's
    command, not the backends' "choose another backend, or allow a fallback" (kernels times triton
    whatever backend says). The command it gives is the documented CPU one's, for the op asked."""
    rc, out, err = wait(start(tmp_path, "kernels", name=None, store=False), timeout=120)
    lines = one_line(err)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("config error: TRITON_INTERPRET is not set"), err[-2000:]
    assert "fallback" not in lines[0] and "another backend" not in lines[0]
    hint = lines[0].split("here: ", 1)[1].split(" (")[0]
    assert hint == "TRITON_INTERPRET=1 python -m experiments.kernels op=selection model=tiny seq=64"
    tested = next(c for c in local_commands() if c.startswith("TRITON_INTERPRET=1 python -m experiments.kernels"))
    assert set(hint.replace("op=selection", "op=gate").split()) <= set(tested.split()), tested  # run as written above
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no output folder, no store


# Single runs, cheap: kernels' gate op under the interpreter, three training steps.
SINGLE = {"kernels": (["op=gate", "model=tiny", "seq=64", "kernels.cpu_repeats=1", "kernels.peers=false"],
                      {"TRITON_INTERPRET": "1"}),
          "train": (["train=smoke", "train.steps=2"], {})}


@pytest.mark.parametrize("entry", SINGLE)
def test_single_runs_end_like_sweeps(entry, tmp_path):
    """A single run's last lines, as a sweep's: its outputs folder, the ``mlflow ui`` command with the store
    and its run's page, and on a CPU what its times are (kernels; train's figures are not times)."""
    args, extra = SINGLE[entry]
    rc, out, err = wait(start(tmp_path, entry, *args, name=None, template=entrypoints.make_template(
        tmp_path / "template.db"), extra_env=extra), timeout=120)
    assert rc == 0, err[-3000:]
    (run,) = entrypoints.runs(tmp_path / "mlflow.db", entry)[1]
    rid, eid = run.info.run_id, run.info.experiment_id
    assert "FINISHED in " in err and err.rstrip().endswith(f"run {rid}"), err[-2000:]
    cpu = [CPU_NOTE] if entry == "kernels" else []
    (out_dir,) = (tmp_path / "outputs" / entry).iterdir()
    assert out.rstrip().splitlines()[-2 - len(cpu):] == [
        f"outputs: {out_dir.relative_to(tmp_path)}",
        f"MLflow:  mlflow ui --backend-store-uri sqlite:///{tmp_path / 'mlflow.db'}  # then open "
        f"http://127.0.0.1:5000/#/experiments/{eid}/runs/{rid}", *cpu], out[-2000:]


def test_card_command_runs_here_as_written(cli_runs):
    """``hardware=cpu -m seq=256,512``: overrides before -m, and the end-of-sweep summary."""
    tmp, rc, out, err, _ = cli_runs["python -m experiments.decode hardware=cpu -m seq=256,512"]
    assert rc == 0, err[-3000:]
    c, rs = entrypoints.runs(tmp / "mlflow.db", "decode")
    parent = next(r for r in rs if "mlflow.parentRunId" not in r.data.tags)
    kids = {int(r.data.params["seq"]): r for r in rs if "mlflow.parentRunId" in r.data.tags}
    assert sorted(kids) == [256, 512] and all(r.info.status == "FINISHED" for r in rs)
    lines = out.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("#  "))
    table = lines[first:lines.index(next(ln for ln in lines if ln.startswith("outputs:")))]
    assert table[0].split()[:3] == ["#", "seq", "status"] and table[0].endswith("run id")
    assert "nsa_p50_ms" in table[0] and "nsa_speedup_vs_dense_x" in table[0]
    for line, seq in zip(table[1:], (256, 512)):
        assert line.split()[1:3] == [str(seq), "FINISHED"] and line.split()[-1] == kids[seq].info.run_id
    (sweep_dir,) = (tmp / "outputs" / "decode").glob("multirun_*")
    assert f"outputs: {sweep_dir.relative_to(tmp)}" in out
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp / 'mlflow.db'}" in out
    assert sweep.CPU_FIGURES in out  # times from a CPU are said to be what they are
    # the sweep's own view: a run per row of the job's table (experiments/framework/views.py), in nsa-decode-lines
    lines = c.get_experiment_by_name("nsa-decode-lines")
    view = f"#/experiments/{lines.experiment_id}/runs?viewStateShareKey={parent.info.run_id}"
    assert view + "&workflowType=machine_learning&compareRunsMode=CHART" in out
    state = json.loads(lines.tags[f"mlflow.sharedViewState.{parent.info.run_id}"])
    assert state["compareRunCharts"][0]["metricKey"] == "p50_ms"
    shown = c.search_runs([lines.experiment_id], filter_string=state["searchFilter"], order_by=["attributes.start_time DESC"])
    assert [r.info.run_name for r in shown][:2] == ["nsa", "dense"] and {r.info.run_name for r in shown} == {
        k.split("/", 1)[1] for k in parent.data.metrics if k.startswith("p50_ms/")}  # the parent keeps its lines


def test_cfg_and_help_with_a_sweep(cli_runs):
    tmp, rc, out, err, _ = cli_runs["python -m experiments.decode -m seq=256,512 --cfg job"]
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    jobs = re.findall(r"^# job (\d): (.*)$", out, re.M)
    assert jobs == [("0", "seq=256"), ("1", "seq=512")] and out.count("\nseq: 256\n") == 1
    c = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    assert not (tmp / "outputs").exists() and c.get_experiment_by_name("nsa-decode") is None  # shown, not run
    tmp, rc, out, err, _ = cli_runs["help_sweep"]
    assert rc == 0 and "Examples" in out and "python -m experiments.decode hardware=cpu -m seq=256,512" in out


def test_mlflow_tracking_uri_is_the_store_unless_tracking_uri_is_given(cli_runs):
    tmp, rc, out, err, _ = cli_runs["env_uri"]
    assert rc == 0, err[-3000:]
    assert f"store sqlite:///{tmp / 'env.db'} (MLFLOW_TRACKING_URI)" in err  # the start line names it
    _, rs = entrypoints.runs(tmp / "env.db", "decode")
    assert len(rs) == 2 and not (tmp / "mlflow.db").exists()
    tmp, rc, out, err, _ = cli_runs["cli_uri"]
    assert rc == 0, err[-3000:]
    _, rs = entrypoints.runs(tmp / "cli.db", "decode")
    assert len(rs) == 1 and f"store sqlite:///{tmp / 'cli.db'} (tracking.uri)" in err
    _, env_runs = entrypoints.runs(tmp / "env.db", "decode")
    assert len(env_runs) == 2  # only the sweep's


def test_the_default_backend_is_auto_the_reference_on_a_cpu(cli_runs):
    """No backend= on the command line: backend=auto, which the cpu profile resolves to the reference."""
    tmp, rc, out, err, _ = cli_runs["cli_uri"]
    assert rc == 0, err[-3000:]
    _, (run,) = entrypoints.runs(tmp / "cli.db", "decode")
    p, t = run.data.params, run.data.tags
    assert p["backend"] == "auto" and t["hardware_profile"] == "cpu" and t["policy_overrides"] == "none"
    assert [t[f"backend_{k}_{b}"] for k in ("plan", "ran") for b in ("cmp", "sel", "win")] == ["reference"] * 6


def test_git_commit_is_this_projects_only(cli_runs):
    tmp, rc, out, err, _ = cli_runs["git_copy"]
    assert rc == 0, err[-3000:]
    _, (run,) = entrypoints.runs(tmp / "mlflow.db", "decode")
    assert "git_commit" not in run.data.tags and "mlflow.source.git.commit" not in run.data.tags
    assert run.data.tags["torch_version"]  # the other environment tags are there


def test_sweep_without_a_parent_does_not_start(cli_runs):
    tmp, rc, out, err, _ = cli_runs["parent_fails"]
    lines = one_line(err)
    assert rc == 2 and len(lines) == 1, err[-3000:]
    assert "cannot create the sweep's parent run" in lines[0] and str(tmp / "mlflow.db") in lines[0]
    c = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    exp = c.get_experiment_by_name("nsa-decode")
    assert not c.search_runs([exp.experiment_id], run_view_type=3)  # no run at all, deleted or not
    assert not (tmp / "out").exists() and "Launching" not in out


# Each entry point's groups (what its --help lists) and a group it must not list.
OWN_GROUPS = {"decode": ({"backend", "hardware", "model", "seq_len"}, "attention"),
              "prefill": ({"backend", "hardware", "model", "seq_len"}, "data"),
              "parity": ({"backend", "hardware", "model", "seq_len"}, "train"),
              "kernels": ({"op", "hardware", "model"}, "attention"),
              "validate": ({"hardware", "tracking"}, "op"),
              "train": ({"attention", "data", "lm", "train", "hardware"}, "op"),
              "generate": ({"attention", "backend", "hardware", "model"}, "data")}


@pytest.mark.parametrize("entry", ENTRIES)
def test_each_entry_points_help_is_its_own(entry, tmp_path):
    """``--help``: the entry point's examples, its own config groups with their options, its own settings,
    one screenful (Hydra's default listed every entry point's groups and the whole config)."""
    p = subprocess.run([sys.executable, "-m", f"experiments.{entry}", "--help"], cwd=tmp_path, env=entrypoints.env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and not p.stderr.strip(), p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert len(lines) <= 60, len(lines)
    examples = [ln for ln in lines if re.match(rf"\s+(TRITON_INTERPRET=1 )?python -m experiments\.{entry}\b", ln)]
    assert 2 <= len(examples) <= 3
    groups = lines[lines.index("== Config groups (group=option) ==") + 1:]
    groups = {ln.split(":")[0] for ln in groups[:groups.index("")]}
    own, foreign = OWN_GROUPS[entry]
    assert own <= groups and foreign not in groups, groups
    options = next(ln for ln in lines if ln.startswith("hardware: "))
    assert options.startswith("hardware: a100, auto, cpu, h100, h200, rtx4090 (now: ")
    assert f"\n{entry}:\n" in p.stdout  # its own section
