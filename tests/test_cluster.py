"""scripts/cluster.sh's cluster with its real services: the per-GPU launcher's pinning, the CPU cap, and
16 processes writing into the MLflow server on PostgreSQL at once (and, for the record, into SQLite).

These tests use the cluster that ``scripts/cluster.sh up --fake-gpus 2`` started from this checkout
(``.ci/run`` does). Without one they skip; a cluster that is up by its state (``.cluster/cluster.env``,
which ``down`` removes) but whose services are not all running fails them.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_SH = ROOT / "scripts" / "cluster.sh"
STATE = ROOT / ".cluster"


def _cluster_sh(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER_SH), *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def cluster() -> dict[str, str]:
    """The running cluster's SLURM_CONF and MLFLOW_TRACKING_URI (from `scripts/cluster.sh status`)."""
    if not (STATE / "cluster.env").exists():
        pytest.skip("no cluster from this checkout (scripts/cluster.sh up --fake-gpus 2)")
    st = _cluster_sh("status")
    assert st.returncode == 0, f"the cluster in {STATE} was set up but is not running:\n{st.stdout}{st.stderr}"
    found = dict(ln.split("=", 1) for ln in st.stdout.splitlines() if ln.startswith(("SLURM_CONF=", "MLFLOW_TRACKING_URI=")))
    assert set(found) == {"SLURM_CONF", "MLFLOW_TRACKING_URI"}, st.stdout
    return found


# ------------------------------------------------------------------ cluster.sh's own checks


@pytest.mark.parametrize(
    "args, message",
    [
        (["up", "--port", "50x"], "--port must be a whole number, got '50x'"),
        (["up", "--bogus"], "unknown option '--bogus'"),
        (["sideways"], "unknown command 'sideways'"),
    ],
)
def test_cluster_sh_rejects_bad_arguments_in_one_line(args, message, tmp_path):
    r = _cluster_sh(*args, "--dir", str(tmp_path / "state"))
    assert r.returncode == 2
    assert r.stderr.strip() == f"cluster: {message}" or r.stderr.strip().startswith(f"cluster: {message}")
    assert len(r.stderr.strip().splitlines()) == 1


def test_cluster_is_up_again_at_once_and_bound_to_loopback(cluster):
    """`up` on a running cluster starts nothing and prints the same URI last; every listening socket of its
    processes is on 127.0.0.1 (the MLflow server's --host is 127.0.0.1 unless asked)."""
    r = _cluster_sh("up", timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == f"MLFLOW_TRACKING_URI={cluster['MLFLOW_TRACKING_URI']}"
    pids = {ln.split("pid ")[1].rstrip(")") for ln in _cluster_sh("status").stdout.splitlines() if "running (pid" in ln}
    assert len(pids) == 7
    mlflow_port = cluster["MLFLOW_TRACKING_URI"].rsplit(":", 1)[1]
    ss = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    # The daemons listen themselves; the MLflow server's port is held by its uvicorn workers.
    ours = [ln.split()[3] for ln in ss.splitlines()
            if any(f"pid={p}," in ln for p in pids) or ln.split()[3].endswith(f":{mlflow_port}")]
    assert len({addr.rsplit(":", 1)[1] for addr in ours}) == 6, ours  # MariaDB, slurm{dbd,ctld,d}, PostgreSQL, MLflow
    assert all(addr.startswith("127.0.0.1:") for addr in ours), ours


def test_readme_cluster_commands_run_as_written(cluster, tmp_path):
    """The README's cluster block: its run lands FINISHED in the server that `up` printed (its install and
    up/down lines are .ci/run's and scripts/check_install.py's)."""
    import mlflow

    readme = (ROOT / "README.md").read_text().split("## Sweeps on a SLURM cluster", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", readme, re.S)
    first, run, last = block.strip().splitlines()
    assert first.endswith("scripts/cluster.sh up") and last == "scripts/cluster.sh down"
    assert f"tracking.uri={cluster['MLFLOW_TRACKING_URI']}" in run
    t0_ms = int(time.time() * 1000)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(shlex.split(run), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    client = mlflow.MlflowClient(tracking_uri=cluster["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("nsa-decode").experiment_id],
                              filter_string=f"attributes.start_time >= {t0_ms}")
    assert [x.info.status for x in runs] == ["FINISHED"]


# ------------------------------------------------------------------ the per-GPU launcher: pinning and caps

APP = '''
import json, os, time
from pathlib import Path

import hydra


@hydra.main(version_base=None, config_path=".", config_name="app")
def main(cfg):
    start = time.time()
    time.sleep(cfg.hold_s)
    Path(cfg.out, f"job{cfg.job}.json").write_text(json.dumps({
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "start": start, "end": time.time()}))


if __name__ == "__main__":
    main()
'''


def _sweep(tmp_path: Path, jobs: int, hold_s: float, *overrides: str) -> list[dict]:
    """A toy Hydra app swept over `jobs` jobs with hydra/launcher=per_gpu from the repo's conf/; each job
    records its CUDA_VISIBLE_DEVICES and when it held its device."""
    (tmp_path / "app.py").write_text(APP)
    conf = f"job: 0\nhold_s: {hold_s}\nout: {tmp_path}\nhydra:\n  searchpath: [file://{ROOT / 'conf'}]\n"
    (tmp_path / "app.yaml").write_text(conf)
    cmd = [sys.executable, str(tmp_path / "app.py"), "-m", f"job=range({jobs})", "hydra/launcher=per_gpu",
           f"hydra.sweep.dir={tmp_path / 'sweep'}", "hydra.launcher.timeout_min=5", *overrides]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    found = sorted(tmp_path.glob("job*.json"))
    assert len(found) == jobs, (found, r.stdout + r.stderr)
    return [json.loads(p.read_text()) for p in found]


def _overlapping(records: list[dict]) -> list[tuple[dict, dict]]:
    return [(a, b) for i, a in enumerate(records) for b in records[i + 1:] if a["start"] < b["end"] and b["start"] < a["end"]]


def test_per_gpu_launcher_pins_each_job_to_its_own_gpu(cluster, tmp_path):
    """Fake device list: the cluster declares 2 fake GPUs (character devices). 4 jobs, each asking for one:
    each sees exactly one device, jobs that run at the same time never share one, and they do run side by side."""
    records = _sweep(tmp_path, 4, 4.0)
    devices = [r["cuda_visible_devices"] for r in records]
    assert all(d in ("0", "1") for d in devices), devices
    assert all(r["slurm_job_id"] for r in records)
    overlapping = _overlapping(records)
    assert overlapping, "no two jobs ran at once: the launcher did not use both GPUs"
    shared = [(a["cuda_visible_devices"], b["cuda_visible_devices"]) for a, b in overlapping
              if a["cuda_visible_devices"] == b["cuda_visible_devices"]]
    assert not shared, f"jobs running at once shared a GPU: {shared}"


def test_per_gpu_launcher_caps_cpu_jobs(cluster, tmp_path):
    """CPU jobs (no GPU) are capped by hydra.launcher.array_parallelism: with 1, none overlap on this
    2-core machine, where SLURM alone would run two at once."""
    records = _sweep(tmp_path, 3, 2.0, "hydra.launcher.gpus_per_node=0", "hydra.launcher.array_parallelism=1")
    assert not _overlapping(records), [(r["start"], r["end"]) for r in records]


# ------------------------------------------------------------------ 16 concurrent writers

WRITERS, RUNS, STEPS, KEYS, PARAMS = 16, 2, 10, ("loss", "p50_ms"), 5

WRITER = '''
import json, sys, time
from pathlib import Path

import mlflow
from mlflow.entities import Param

worker, runs, steps, params, keys, workdir = sys.argv[1:7]
stores = [s.split("|") for s in sys.argv[7:]]  # "name|uri|experiment_id", written one after the other
worker, runs, steps, params, keys, workdir = int(worker), int(runs), int(steps), int(params), keys.split(","), Path(workdir)


def wait_for(path):
    while not path.exists():
        time.sleep(0.01)


def write(client, experiment_id, report):
    def attempt(what, call):
        try:
            call()
            return True
        except Exception as e:
            report["errors"].append(f"{what}: {type(e).__name__}: {e}"[:200])
            return False

    for r in range(runs):
        made = []
        if not attempt("create_run", lambda: made.append(client.create_run(experiment_id, run_name=f"w{worker}-r{r}"))):
            continue
        rid = made[0].info.run_id
        acked = {"run_id": rid, "params": 0, "points": 0, "finished": False}
        if attempt("log_batch", lambda: client.log_batch(rid, params=[Param(f"p{k}", str(k)) for k in range(params)])):
            acked["params"] = params
        for step in range(steps):
            for key in keys:
                acked["points"] += attempt("log_metric", lambda: client.log_metric(rid, key, worker + step, step=step))
        acked["finished"] = attempt("set_terminated", lambda: client.set_terminated(rid, "FINISHED"))
        report["runs"].append(acked)


(workdir / f"ready-{worker}").touch()
for name, uri, experiment_id in stores:
    report = {"runs": [], "errors": []}
    wait_for(workdir / f"go-{name}")  # every writer starts this store at once
    write(mlflow.MlflowClient(tracking_uri=uri), experiment_id, report)
    (workdir / f"{name}-{worker}.json").write_text(json.dumps(report))
'''


def _wait_files(pattern: str, workdir: Path, n: int, procs: list[subprocess.Popen]) -> None:
    while len(list(workdir.glob(pattern))) < n:
        failed = [p for p in procs if p.poll() not in (None, 0)]
        assert not failed, [p.stdout.read()[-500:] for p in failed]
        time.sleep(0.05)


def _concurrent_writes(stores: dict[str, str], workdir: Path) -> dict[str, dict]:
    # 16 processes; for each store in turn, all of them at once: 2 runs each x (5 params in one batch,
    # 10 steps x 2 metrics one call each, set FINISHED). Returns, per store, what the writers saw
    # acknowledged and what the store holds afterwards.
    import mlflow

    clients = {name: mlflow.MlflowClient(tracking_uri=uri) for name, uri in stores.items()}
    experiments = {name: c.create_experiment(f"concurrent-{os.getpid()}-{time.time_ns()}") for name, c in clients.items()}
    args = [f"{name}|{uri}|{experiments[name]}" for name, uri in stores.items()]
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(w), str(RUNS), str(STEPS), str(PARAMS), ",".join(KEYS),
                               str(workdir), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for w in range(WRITERS)]
    results = {}
    try:
        _wait_files("ready-*", workdir, WRITERS, procs)  # mlflow imported everywhere
        for name in stores:
            t0 = time.monotonic()
            (workdir / f"go-{name}").touch()
            _wait_files(f"{name}-*.json", workdir, WRITERS, procs)
            results[name] = _tally(clients[name], experiments[name], workdir, name, time.monotonic() - t0)
    finally:
        for p in procs:
            p.kill() if p.poll() is None else None
            p.communicate()
    return results


def _tally(client, experiment_id: str, workdir: Path, name: str, wall_s: float) -> dict:
    reports = [json.loads((workdir / f"{name}-{w}.json").read_text()) for w in range(WRITERS)]
    acked_runs = [r for rep in reports for r in rep["runs"]]
    errors = [e for rep in reports for e in rep["errors"]]
    stored = {r.info.run_id: r for r in client.search_runs([experiment_id], max_results=1000)}
    points = {rid: sum(len(client.get_metric_history(rid, k)) for k in KEYS) for rid in stored}
    silent = []  # acknowledged writes the store lacks
    for a in acked_runs:
        run = stored.get(a["run_id"])
        if run is None or points[a["run_id"]] < a["points"] or len(run.data.params) < a["params"] \
                or (a["finished"] and run.info.status != "FINISHED"):
            silent.append(a["run_id"])
    return {
        "write_s": round(wall_s, 1),
        "runs_wanted": WRITERS * RUNS,
        "runs_stored": len(stored),
        "runs_finished": sum(r.info.status == "FINISHED" for r in stored.values()),
        "metric_points_wanted": WRITERS * RUNS * STEPS * len(KEYS),
        "metric_points_stored": sum(points.values()),
        "write_errors": len(errors),
        "error_kinds": sorted({": ".join(e.split(": ")[:2]) for e in errors}),
        "first_error": errors[0] if errors else None,
        "acknowledged_but_missing": len(silent),
    }


def test_sixteen_concurrent_writers(cluster, tmp_path, capsys):
    """16 processes writing runs and metrics at once: the server on PostgreSQL loses nothing. The same
    writers against a SQLite store (created beforehand, so MLflow's schema migration is not part of it)
    are reported as they come out; the one thing asserted there is that a write SQLite acknowledged is
    stored (losses must be errors the writer saw, not silent)."""
    found = _concurrent_writes({"server": cluster["MLFLOW_TRACKING_URI"], "sqlite": f"sqlite:///{tmp_path / 'mlflow.db'}"},
                               tmp_path)
    server, sqlite = found["server"], found["sqlite"]
    with capsys.disabled():  # reported in CI's output whatever the outcome
        print(f"\n16 concurrent writers, {RUNS} runs each, {STEPS * len(KEYS)} metric points per run:")
        for name, res in (("server+PostgreSQL", server), ("SQLite", sqlite)):
            print(f"  {name}: {json.dumps(res)}")
    assert server["runs_stored"] == server["runs_finished"] == server["runs_wanted"], server
    assert server["metric_points_stored"] == server["metric_points_wanted"], server
    assert server["write_errors"] == server["acknowledged_but_missing"] == 0, server
    assert sqlite["acknowledged_but_missing"] == 0, sqlite
