"""scripts/cluster.sh's cluster with its real services: the README's sweeps through SLURM into the MLflow
server (tags, the same results as the basic launcher, a job cancelled mid-sweep then resumed, SIGTERM to
a sweep, one GPU per job on fake GPUs, a GPU sweep from a host without GPUs), the CPU cap, 16 processes
writing into the server on PostgreSQL at once (and, for the record, into SQLite), the server's login,
the secrets kept off command lines and from other users, and `down` stopping only what `up` started.

These tests use the cluster that ``scripts/cluster.sh up --fake-gpus 2`` started from this checkout
(``.ci/run`` does). Without one they skip; a cluster that is up by its state (``.cluster/cluster.env``,
which ``down`` removes) but whose services are not all running fails them. Every MLflow client here logs
in as the cluster's admin (MLFLOW_TRACKING_USERNAME/PASSWORD from ``.cluster/mlflow/credentials``).
"""
from __future__ import annotations

import base64
import configparser
import json
import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import entrypoints
import pytest

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_SH = ROOT / "scripts" / "cluster.sh"
STATE = ROOT / ".cluster"
CREDENTIALS = STATE / "mlflow" / "credentials"  # the MLflow admin's login, in MLflow's credentials-file format


def _cluster_sh(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER_SH), *args], capture_output=True, text=True, timeout=timeout)


def credentials() -> tuple[str, str]:
    """The MLflow server's admin login (user, password) from the state directory's credentials file."""
    cp = configparser.ConfigParser()
    assert cp.read(CREDENTIALS), f"no {CREDENTIALS}"
    return cp["mlflow"]["mlflow_tracking_username"], cp["mlflow"]["mlflow_tracking_password"]


@pytest.fixture(scope="module")
def cluster():
    """The running cluster's SLURM_CONF and MLFLOW_TRACKING_URI (from `scripts/cluster.sh status`); for the
    module, MLflow's clients here and in the processes started from here (sweeps, SLURM jobs) log in."""
    if not (STATE / "cluster.env").exists():
        pytest.skip("no cluster from this checkout (scripts/cluster.sh up --fake-gpus 2)")
    st = _cluster_sh("status")
    assert st.returncode == 0, f"the cluster in {STATE} was set up but is not running:\n{st.stdout}{st.stderr}"
    found = dict(ln.split("=", 1) for ln in st.stdout.splitlines() if ln.startswith(("SLURM_CONF=", "MLFLOW_TRACKING_URI=")))
    assert set(found) == {"SLURM_CONF", "MLFLOW_TRACKING_URI"}, st.stdout
    user, password = credentials()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_USERNAME", user)
        mp.setenv("MLFLOW_TRACKING_PASSWORD", password)
        yield found


# ------------------------------------------------------------------ cluster.sh's own checks


@pytest.mark.parametrize(
    "args, message",
    [
        (["up", "--port", "50x"], "--port must be a whole number, got '50x'"),
        (["up", "--bogus"], "unknown option '--bogus'"),
        (["sideways"], "unknown command 'sideways'"),
        (["up", "--port-offset", "1x"], "--port-offset must be a whole number, got '1x'"),
        (["unpack", "debs"], "usage: scripts/cluster.sh unpack DEBDIR PREFIX"),
        (["fetch"], "usage: scripts/cluster.sh fetch DEBDIR"),
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


# ------------------------------------------------------------------ the server's login, the secrets, `down`

SEARCH = "/api/2.0/mlflow/experiments/search?max_results=1"
ARTIFACTS = "/api/2.0/mlflow-artifacts/artifacts"  # the artifacts the server proxies: a listing of their root
SECRETS = ("mlflow-admin.password", "mlflow.pgpassword", "slurm/db.password", "mlflow/flask.secret")


def http_status(url: str, login: tuple[str, str] | None = None) -> int:
    """The HTTP status of a GET of ``url``, with HTTP basic authentication where ``login`` is given."""
    req = urllib.request.Request(url)
    if login:
        req.add_header("Authorization", "Basic " + base64.b64encode(":".join(login).encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_the_server_refuses_requests_without_the_admins_login(cluster):
    """MLflow's basic-auth app is on: a REST request without a login, with a wrong password or as an
    unknown user is refused (401), for the tracking API and the proxied artifacts alike; the admin's
    login from the credentials file is accepted."""
    uri = cluster["MLFLOW_TRACKING_URI"]
    user, password = credentials()
    assert password == (STATE / "mlflow-admin.password").read_text().strip()
    for path in (SEARCH, ARTIFACTS):
        assert http_status(uri + path) == 401, path
        assert http_status(uri + path, (user, password + "x")) == 401, path
        assert http_status(uri + path, ("nobody", password)) == 401, path
        assert http_status(uri + path, (user, password)) == 200, path


def test_secrets_and_artifacts_are_their_owners_alone(cluster):
    """Every file that holds a password is 0600; the artifacts folder (every run's files) is closed to
    other users."""
    for name in (*SECRETS, "mlflow/credentials", "mlflow/basic_auth.ini", "mlflow/pgpass", "slurm/slurmdbd.conf"):
        assert stat.S_IMODE((STATE / name).stat().st_mode) == 0o600, name
    assert stat.S_IMODE((STATE / "artifacts").stat().st_mode) & 0o077 == 0, oct((STATE / "artifacts").stat().st_mode)


def test_the_login_is_scoped_to_the_clusters_server(cluster, tmp_path):
    """No global credentials while the cluster is up: ~/.mlflow/credentials (which MLflow's client sends to
    every http tracking URI) is not the cluster's; its credentials file names the server it belongs to, and
    an entry point launched from this checkout (tracking=server reads .cluster/mlflow/credentials there)
    logs in without MLFLOW_TRACKING_USERNAME/PASSWORD; a plain MLflow client without them is refused (401)."""
    home_file = Path.home() / ".mlflow" / "credentials"
    assert not (home_file.is_symlink() and home_file.resolve() == CREDENTIALS.resolve()), home_file
    cp = configparser.ConfigParser()
    cp.read(CREDENTIALS)
    assert cp["mlflow"]["mlflow_tracking_uri"] == cluster["MLFLOW_TRACKING_URI"]
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")}
    env.update(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", HOME=str(tmp_path), PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "experiments.decode", "hardware=cpu", "seq=64", "tracking=server",
                          f"tracking.uri={cluster['MLFLOW_TRACKING_URI']}", f"hydra.run.dir={tmp_path / 'out'}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    client = "import sys, mlflow; mlflow.MlflowClient(sys.argv[1]).search_experiments(max_results=1)"
    refused = subprocess.run([sys.executable, "-c", client, cluster["MLFLOW_TRACKING_URI"]], env=env,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "401" in refused.stderr, refused.stderr[-2000:]


def _no_login_env() -> dict:
    """This environment without MLflow's login variables (which the module's fixture sets) or store."""
    return {k: v for k, v in entrypoints.env().items() if k not in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")}


def _cmdlines() -> dict[int, str]:
    out = {}
    for f in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            out[int(f.parent.name)] = f.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # a process that ended meanwhile
            pass
    return out


@pytest.mark.parametrize("launcher", [["hydra/launcher=local_gpus", "hydra.launcher.gpus=[0,1]"], ["hydra/launcher=slurm"]],
                         ids=["local_gpus", "slurm"])
def test_a_password_in_tracking_uri_leaves_ps_and_reaches_the_jobs(cluster, tmp_path, launcher):
    """tracking.uri=http://admin:<password>@host (no other login anywhere): the process re-executes itself at once
    with the password masked on its command line, none of the sweep's processes (local_gpus' workers, SLURM's
    jobs) ever shows it in ps while the sweep runs, and both jobs reach the server with the login."""
    user, password = credentials()
    uri = cluster["MLFLOW_TRACKING_URI"].replace("://", f"://{user}:{password}@")
    exp = f"pw-{uuid.uuid4().hex}"  # the server outlives this test's runs
    p = subprocess.Popen([sys.executable, "-m", "experiments.decode", "hardware=cpu", "-m", "seq=64,72",
                          "decode.per_branch=false", *launcher,
                          f"tracking.uri={uri}", f"tracking.experiment={exp}", f"hydra.sweep.dir={tmp_path / 'out'}"],
                         cwd=tmp_path, env=_no_login_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        # the interpreter's start, before its first import; an empty command line is a process inside exec (the
        # kernel has not set up its arguments yet), which also follows Popen's return
        while password in (cmd := _cmdlines().get(p.pid, "")) or not cmd.strip():
            assert p.poll() is None, f"the sweep ended before it could be watched: {p.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, "the password stayed on the command line"
            time.sleep(0.01)
        seen = set()
        while p.poll() is None:
            now = _cmdlines()
            seen |= {pid for pid, c in now.items() if any(w in c for w in ("experiments.decode", "multiprocessing", "submitit"))}
            shown = {pid: c.replace(password, "<password>") for pid, c in now.items() if password in c}
            assert not shown, f"the password on a command line (the sweep is pid {p.pid}): {shown}"
            time.sleep(0.05)
        out = p.stdout.read()
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
    assert p.returncode == 0, out[-3000:]
    assert len(seen) >= 3, seen  # the sweep and its jobs' processes were watched
    assert password not in out and f"{user}:***@" in out
    from mlflow import MlflowClient

    c = MlflowClient(tracking_uri=cluster["MLFLOW_TRACKING_URI"])  # the fixture's login
    rs = c.search_runs([c.get_experiment_by_name(exp).experiment_id])
    jobs = [r for r in rs if r.data.tags.get("sweep") != "parent"]
    assert len(jobs) == 2 and all(r.info.status == "FINISHED" for r in rs), [(r.info.status, r.data.tags) for r in rs]


def test_close_stale_logs_in_as_tracking_server_does(cluster, tmp_path):
    """`experiments.close_stale <id> --tracking-uri <server>` reads the login where tracking=server reads it (the
    launch directory's .cluster/mlflow/credentials, or --credentials), and ends a run whose process is gone;
    without a login it is one line and exit 2."""
    from mlflow import MlflowClient

    srv = cluster["MLFLOW_TRACKING_URI"]
    c = MlflowClient(tracking_uri=srv)
    eid = c.create_experiment(f"stale-{uuid.uuid4().hex}")
    dead = subprocess.Popen(["true"])
    dead.wait()
    tags = {"host": os.uname().nodename, "pid": str(dead.pid), "process": f"{dead.pid}:a start that is gone"}
    rids = [c.create_run(eid, tags=tags).info.run_id for _ in range(2)]
    cmd = [sys.executable, "-m", "experiments.close_stale"]
    bare = subprocess.run([*cmd, rids[0], "--tracking-uri", srv], cwd=tmp_path, env=_no_login_env(),
                          capture_output=True, text=True, timeout=120)
    assert bare.returncode == 2 and len(bare.stderr.strip().splitlines()) == 1, bare.stderr
    for rid, where, extra in [(rids[0], ROOT, []), (rids[1], tmp_path, ["--credentials", str(CREDENTIALS)])]:
        r = subprocess.run([*cmd, rid, "--tracking-uri", srv, *extra], cwd=where, env=_no_login_env(),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"run {rid}: " in r.stdout + r.stderr
        assert c.get_run(rid).info.status == "KILLED"


LOGGED = ("mariadb", "psql", "runuser", "curl")  # what cluster.sh gives SQL or a login


def test_no_password_on_any_command_line(cluster, tmp_path):
    """`up` again (it sets the database users' passwords again and checks the admin's login) with a PATH
    where the commands that get SQL or a login log their arguments first: none holds a password (every
    user sees every process's arguments in ps); nor does any process's command line while the cluster runs."""
    secrets = {name: (STATE / name).read_text().strip() for name in SECRETS}
    assert all(len(v) >= 20 for v in secrets.values()), secrets.keys()
    log, shims = tmp_path / "argv.log", tmp_path / "bin"
    shims.mkdir()
    for cmd in LOGGED:  # psql runs as postgres, which cannot enter tmp_path: runuser's arguments show its own
        (shims / cmd).write_text(f'#!/bin/sh\nprintf "%s\\n" "$0 $*" >> {log} 2>/dev/null\n'
                                 f'PATH={shlex.quote(os.environ["PATH"])} exec {cmd} "$@"\n')
        (shims / cmd).chmod(0o755)
    r = subprocess.run(["bash", str(CLUSTER_SH), "up"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PATH": f"{shims}:{os.environ['PATH']}"})
    assert r.returncode == 0, r.stdout + r.stderr
    argv = log.read_text().splitlines()
    assert any(ln.startswith(f"{shims}/mariadb ") for ln in argv), argv  # the SLURM user's password was set
    assert any(" -- psql " in ln for ln in argv if ln.startswith(f"{shims}/runuser ")), argv  # and mlflow's
    assert any(ln.startswith(f"{shims}/curl ") and SEARCH in ln for ln in argv), argv  # the login was checked

    def leaks(text: str) -> list[str]:
        return [name for name, pw in secrets.items() if pw in text]

    assert not [(ln.split()[0], leaks(ln)) for ln in argv if leaks(ln)]
    for f in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = f.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # a process that ended meanwhile
            continue
        assert not leaks(text), (f, text.split()[:1], leaks(text))


def start_time(pid: int) -> int:
    """Field 22 of /proc/PID/stat: the process's start, in clock ticks after boot."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def look_alike(argv0: str) -> subprocess.Popen:
    """`sleep` whose command line starts with ``argv0`` (one of the cluster's processes, to ps and pgrep -f)."""
    p = subprocess.Popen(["bash", "-c", f'exec -a "{argv0}" sleep 600'], start_new_session=True)
    deadline = time.monotonic() + 10
    while not Path(f"/proc/{p.pid}/cmdline").read_bytes().startswith(argv0.encode()):
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.05)
    return p


def test_down_stops_only_what_up_started(cluster, tmp_path):
    """`down` of a state directory whose daemons are gone while processes named like them (`slurmctld`,
    `python -m mlflow server`) have their pids, as after a crash and pid reuse: its pid files and its
    records name them, the records with another start time. Meanwhile this cluster runs a job step, which
    is another cluster's to that directory. The look-alikes and the job are left running; `down` succeeds."""
    if os.geteuid() != 0:
        pytest.skip("scripts/cluster.sh down needs root")
    state = tmp_path / "state"
    for d in ("slurm", "mlflow", "pids"):
        (state / d).mkdir(parents=True)
    (state / "cluster.env").write_text("HOST=127.0.0.1\nPORT=5000\n")  # up by its state: `down` has to look
    alike = {"slurmctld": look_alike("slurmctld"), "mlflow": look_alike(f"{sys.executable} -m mlflow server")}
    job = subprocess.run(["sbatch", "--parsable", "-c", "1", "-o", "/dev/null", "--wrap", "sleep 300"],
                         capture_output=True, text=True, check=True).stdout.strip()
    try:
        (state / "slurm" / "slurmctld.pid").write_text(f"{alike['slurmctld'].pid}\n")
        (state / "mlflow" / "server.pid").write_text(f"{alike['mlflow'].pid}\n")
        for name, p in alike.items():
            (state / "pids" / name).write_text(f"{p.pid} {start_time(p.pid) + 1}\n")
        deadline = time.monotonic() + 60
        while not subprocess.run(["pgrep", "-x", "slurmstepd"], capture_output=True).stdout:
            assert time.monotonic() < deadline, f"job {job} did not start"
            time.sleep(0.2)
        r = _cluster_sh("down", "--dir", str(state))
        assert r.returncode == 0 and "nothing left running" in r.stdout, r.stdout + r.stderr
        assert {name: p.poll() for name, p in alike.items()} == {"slurmctld": None, "mlflow": None}
        assert squeue(job) == [job]
    finally:
        for p in alike.values():
            p.kill()
            p.wait()
        subprocess.run(["scancel", job], check=False)


# ------------------------------------------------------------------ sweeps through SLURM into the server

README_URI = "http://127.0.0.1:5000"  # the store `scripts/cluster.sh up` prints by default, as the README writes it
# The README cluster block's commands, each run by one test below (test_readme_cluster_commands_are_all_run).
SLURM_CPU, PER_GPU_CPU, PER_GPU_H200 = "hydra/launcher=slurm", "experiments.decode -m hydra/launcher=per_gpu", "hardware=h200"
LONG = 4000  # decode repeats (seq=64..256, decode.per_branch=false): about 10-20 s of work on this CPU


def readme_commands() -> list[str]:
    """The command lines between `scripts/cluster.sh up` and `down` in the README's cluster block."""
    readme = entrypoints.doc_section("Sweeps on a SLURM cluster")
    (block,) = re.findall(r"```bash\n(.*?)```", readme, re.S)
    lines = [" ".join(ln.split("#")[0].split()) for ln in block.strip().splitlines()]
    assert lines[0].endswith("scripts/cluster.sh up") and lines[-1] == "scripts/cluster.sh down", lines
    return lines[1:-1]


def readme_command(marker: str) -> str:
    (cmd,) = [c for c in readme_commands() if marker in c]
    return cmd


def test_readme_cluster_commands_are_all_run():
    assert sorted(readme_commands()) == sorted(readme_command(m) for m in (SLURM_CPU, PER_GPU_CPU, PER_GPU_H200))
    assert all(f"tracking.uri={README_URI}" in c for c in readme_commands())


@dataclass
class Sweep:
    rc: int
    out: str
    err: str
    wall_s: float
    parent: str | None
    dir: Path | None


def start_sweep(cmd: str, tmp: Path, *extra: str) -> subprocess.Popen:
    """``cmd`` (a ``python -m experiments...`` line) in tmp, with this repository's code and ``extra`` overrides."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.Popen([sys.executable, *shlex.split(cmd)[1:], *extra], cwd=tmp, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish_sweep(p: subprocess.Popen, t0: float, timeout: float = 300) -> Sweep:
    out, err = p.communicate(timeout=timeout)
    wall = time.monotonic() - t0
    first = re.search(r"parent run (\w{32}); outputs (\S+)", err)
    return Sweep(p.returncode, out, err, wall, first.group(1) if first else None, Path(first.group(2)) if first else None)


def run_sweep(cmd: str, tmp: Path, *extra: str, timeout: float = 300) -> Sweep:
    t0 = time.monotonic()
    s = finish_sweep(start_sweep(cmd, tmp, *extra), t0, timeout)
    if s.dir is not None and not s.dir.is_absolute():
        s.dir = tmp / s.dir
    return s


def children(uri: str, parent: str) -> list:
    """The parent's child runs, oldest first."""
    import mlflow

    c = mlflow.MlflowClient(tracking_uri=uri)
    exp = c.get_run(parent).info.experiment_id
    runs = c.search_runs([exp], filter_string=f"tags.`mlflow.parentRunId` = '{parent}'", max_results=100)
    return sorted(runs, key=lambda r: r.info.start_time)


def running_child(uri: str, parent: str | None, **params: str):
    """The parent's RUNNING child whose params hold ``params``, or None."""
    for r in children(uri, parent) if parent else []:
        if r.info.status == "RUNNING" and all(r.data.params.get(k) == v for k, v in params.items()):
            return r
    return None


def parent_of(p: subprocess.Popen, seen: list[str], deadline: float) -> str:
    """The parent run id from the sweep's first line on stderr (read as it comes)."""
    while time.monotonic() < deadline:
        line = p.stderr.readline()
        seen.append(line)
        if m := re.search(r"parent run (\w{32});", line):
            return m.group(1)
        assert line or p.poll() is None, "".join(seen)
    raise AssertionError("".join(seen))


def wait_running(p: subprocess.Popen, uri: str, parent: str, deadline: float, **params: str):
    while time.monotonic() < deadline:
        if r := running_child(uri, parent, **params):
            return r
        assert p.poll() is None, p.communicate()
        time.sleep(0.3)
    raise AssertionError(f"no RUNNING child with {params} under {parent}")


def squeue(*job_ids: str) -> list[str]:
    r = subprocess.run(["squeue", "-h", "-o", "%i", *(["-j", ",".join(job_ids)] if job_ids else [])],
                       capture_output=True, text=True)
    return r.stdout.split()


@pytest.fixture(scope="module")
def slurm_and_basic(cluster, tmp_path_factory) -> dict[str, Sweep]:
    """The README's CPU sweep through SLURM as written, then the same sweep with the basic launcher."""
    cmd = readme_command(SLURM_CPU)
    assert README_URI == cluster["MLFLOW_TRACKING_URI"]
    found = {"slurm": run_sweep(cmd, tmp_path_factory.mktemp("slurm"))}
    found["basic"] = run_sweep(cmd.replace(f" {SLURM_CPU}", ""), tmp_path_factory.mktemp("basic"))
    return found


def test_slurm_cpu_sweep_lands_in_the_server(slurm_and_basic, capsys):
    """4 jobs, one parent, 4 FINISHED children tagged with the launcher and their SLURM job (one array,
    tasks 0-3); hardware=cpu jobs took no GPU (no CUDA_VISIBLE_DEVICES, no gres/gpu in SLURM's accounting)."""
    import mlflow

    s, b = slurm_and_basic["slurm"], slurm_and_basic["basic"]
    assert s.rc == 0 and "Traceback" not in s.err, s.err[-3000:]
    kids = children(README_URI, s.parent)
    assert [r.info.status for r in kids] == ["FINISHED"] * 4
    assert {r.data.tags["launcher"] for r in kids} == {"slurm"}
    assert mlflow.MlflowClient(README_URI).get_run(s.parent).data.tags["launcher"] == "slurm"
    ids = sorted(r.data.tags["slurm_job_id"] for r in kids)
    array = ids[0].split("_")[0]
    assert ids == [f"{array}_{i}" for i in range(4)]
    assert all("cuda_visible_devices" not in r.data.tags for r in kids)
    acct = subprocess.run(["sacct", "-j", array, "-X", "-n", "-P", "-o", "JobID,State,AllocTRES"],
                          capture_output=True, text=True, check=True).stdout.split()
    assert len(acct) == 4 and all("|COMPLETED|" in ln and "gres/gpu" not in ln for ln in acct), acct
    assert b.rc == 0 and {r.data.tags["launcher"] for r in children(README_URI, b.parent)} == {"basic"}
    with capsys.disabled():  # the measured SLURM overhead, in CI's output
        print(f"\n4-job CPU sweep (decode, seq=256..2048) into the server: basic launcher {b.wall_s:.1f} s, "
              f"slurm {s.wall_s:.1f} s: {(s.wall_s - b.wall_s) / 4:+.1f} s per job through SLURM "
              f"(2 cores: SLURM runs 2 jobs at once)")


TIMED = {"run_id", "p20_ms", "p50_ms", "p80_ms", "kv_gb_per_s", "kv_bw_roofline_pct", "speedup_vs_dense_x"}


def test_summary_csv_and_plots_are_the_same_whatever_the_launcher(slurm_and_basic):
    from experiments.framework import report

    s, b = slurm_and_basic["slurm"], slurm_and_basic["basic"]
    rows = {k: report.read_csv(v.dir / "decode_sweep.csv") for k, v in (("slurm", s), ("basic", b))}
    assert list(rows["slurm"][0]) == list(rows["basic"][0]) and len(rows["slurm"]) == len(rows["basic"]) >= 4 * 3
    differ = {c for rs, rb in zip(rows["slurm"], rows["basic"]) for c in rs if rs[c] != rb[c]}
    assert differ <= TIMED, differ - TIMED
    summaries = [(v.dir / "summary.txt").read_text().splitlines() for v in (s, b)]
    assert summaries[0][0] == summaries[1][0]  # the same columns
    assert [ln.split()[:3] for ln in summaries[0][1:]] == [ln.split()[:3] for ln in summaries[1][1:]]  # job, seq, status
    assert all((v.dir / "decode_vs_seq.png").stat().st_size > 0 for v in (s, b))
    import mlflow

    c = mlflow.MlflowClient(README_URI)
    charts = [{k for k in c.get_run(v.parent).data.metrics if "/" in k} for v in (s, b)]
    assert charts[0] == charts[1] and charts[0]  # the parent's curves (p50_ms/nsa, ...)


def one_at_a_time(uri: str, tmp: Path, sweep: str, **params: str):
    """A CPU decode sweep through SLURM, one job at a time (``sweep``: its lists), started in tmp; returns
    once a job whose params hold ``params`` runs: (process, start, stderr lines read, parent, that run)."""
    cmd = (f"python -m experiments.decode -m hardware=cpu hydra/launcher=slurm tracking=server tracking.uri={uri} "
           f"{sweep} decode.per_branch=false hydra.launcher.array_parallelism=1")
    t0, seen = time.monotonic(), []
    p = start_sweep(cmd, tmp)
    parent = parent_of(p, seen, t0 + 120)
    return p, t0, seen, parent, wait_running(p, uri, parent, t0 + 180, **params)


def test_scancelled_job_fails_with_slurm_state_and_resume_runs_it_alone(cluster, tmp_path):
    """Job 0 of 3 is cancelled (scancel) while it runs; the launcher stops at it, the sweep still waits for
    jobs 1 and 2 (one job at a time: they start after it). Job 0's run ends FAILED with SLURM's state,
    the parent FAILED with the counts, exit 1; the printed resume command runs job 0 alone."""
    uri = cluster["MLFLOW_TRACKING_URI"]
    p, t0, seen, parent, victim = one_at_a_time(uri, tmp_path, f"seq=64 model.timing.repeats={LONG},1,2",
                                                **{"model.timing.repeats": str(LONG)})
    subprocess.run(["scancel", victim.data.tags["slurm_job_id"]], check=True)
    s = finish_sweep(p, t0)
    assert s.rc == 1, "".join(seen) + s.err[-3000:]
    kids = {r.data.params["model.timing.repeats"]: r for r in children(uri, parent)}
    assert {k: r.info.status for k, r in kids.items()} == {str(LONG): "FAILED", "1": "FINISHED", "2": "FINISHED"}
    error = kids[str(LONG)].data.tags["error"]
    assert error.startswith(f"SLURM job {victim.data.tags['slurm_job_id']} CANCELLED") and "scancel" in error, error
    import mlflow

    c = mlflow.MlflowClient(uri)
    assert c.get_run(parent).data.tags["error"].startswith("1 of 3 jobs failed: ")
    assert c.get_run(parent).info.status == "FAILED"
    (resume,) = [ln.split("resume:", 1)[1].strip() for ln in s.out.splitlines() if ln.startswith("resume:")]
    r = run_sweep(resume, tmp_path)
    assert r.rc == 0 and "3 jobs validated, 1 to run" in r.err, r.err[-3000:]
    again = children(uri, parent)
    assert len(again) == 4 and again[-1].data.params["model.timing.repeats"] == str(LONG)
    assert again[-1].info.status == "FINISHED" and c.get_run(parent).info.status == "FINISHED"


def test_sigterm_to_a_slurm_sweep_cancels_its_jobs_and_leaves_nothing_running(cluster, tmp_path):
    """SIGTERM (what `timeout`, SLURM and CI send) to a sweep whose job runs on SLURM: the sweep cancels
    its SLURM jobs, the running job ends its run KILLED, the parent ends KILLED, exit 143; SLURM holds none
    of them afterwards, and no run is left RUNNING."""
    uri = cluster["MLFLOW_TRACKING_URI"]
    p, t0, seen, parent, first = one_at_a_time(uri, tmp_path, f"seq=64,128 model.timing.repeats={LONG}")
    job = first.data.tags["slurm_job_id"]
    p.send_signal(signal.SIGTERM)
    s = finish_sweep(p, t0, timeout=120)
    assert s.rc == 143, s.err[-3000:]
    array = job.split("_")[0]
    why = f"interrupted by SIGTERM; the sweep cancelled SLURM jobs {array}_0, {array}_1"
    assert f"[decode] {why}; waiting up to" in s.err, s.err[-3000:]
    assert not squeue(f"{array}_0", f"{array}_1")
    import mlflow

    c = mlflow.MlflowClient(uri)
    assert c.get_run(parent).info.status == "KILLED" and c.get_run(parent).data.tags["error"] == why
    (kid,) = children(uri, parent)  # job 1 never started
    assert kid.info.status == "KILLED" and kid.data.tags["error"] == "interrupted by SIGTERM", kid.data.tags  # its own


# 4 steps of the smoke model, an evaluation and a sharded checkpoint every 2 (tests/test_train_parallel.py's BASE)
TRAIN = ("train=smoke train.steps=4 train.log_every=1 train.eval_every=2 train.ckpt_every=2 train.eval_batches=1 "
         "data.seq_len=128 train.batch=8")
SLURM_TASKS = "-m hydra/launcher=slurm hydra.launcher.tasks_per_node=2 parallel.dp=2"
DOC_TASKS = f"python -m experiments.train {SLURM_TASKS} train=smoke"  # docs/cluster.md "Several hosts", as written
DOC_SRUN = "srun -n 2 -c 1 python -m experiments.train parallel.dp=2 train=smoke"


def test_the_documented_slurm_training_lines_are_the_tested_ones():
    assert DOC_TASKS in entrypoints.documented_commands()
    assert DOC_SRUN in entrypoints.doc_section("One model over several GPUs")


def train_curves(db: Path, run) -> dict:
    import mlflow

    c = mlflow.MlflowClient(f"sqlite:///{db}")
    return {k: [(m.step, round(m.value, 12)) for m in sorted(c.get_metric_history(run.info.run_id, k), key=lambda m: m.step)]
            for k in ("loss", "val_loss")}


def test_one_training_over_two_slurm_tasks_equals_one_process(cluster, tmp_path):
    """hydra/launcher=slurm with tasks_per_node=2 and parallel.dp=2: one SLURM job of two tasks, which find each
    other from SLURM's environment (torch.distributed over gloo), FSDP2 over both; the job's one run (rank 0's)
    has every step's loss and val_loss within 1e-4 of one process's, world_size 2, its SLURM job's tag, each
    rank's log, and a checkpoint sharded in two."""
    (tmp_path / "slurm").mkdir()
    (tmp_path / "one").mkdir()
    s = run_sweep(f"python -m experiments.train {SLURM_TASKS} {TRAIN}", tmp_path / "slurm",
                  f"tracking.uri=sqlite:///{tmp_path / 'slurm' / 'mlflow.db'}")
    assert s.rc == 0 and "Traceback" not in s.err, s.err[-3000:]
    o = run_sweep(f"python -m experiments.train {TRAIN}", tmp_path / "one",
                  f"tracking.uri=sqlite:///{tmp_path / 'one' / 'mlflow.db'}")
    assert o.rc == 0, o.err[-3000:]
    (kid,) = children(f"sqlite:///{tmp_path / 'slurm' / 'mlflow.db'}", s.parent)
    _, (ref,) = entrypoints.runs(tmp_path / "one" / "mlflow.db", "train")
    assert kid.info.status == "FINISHED" and kid.data.params["world_size"] == "2", kid.data.params
    assert (kid.data.params["parallel.dp"], kid.data.tags["launcher"]) == ("2", "slurm")
    job = kid.data.tags["slurm_job_id"]
    got, want = train_curves(tmp_path / "slurm" / "mlflow.db", kid), train_curves(tmp_path / "one" / "mlflow.db", ref)
    for k in want:
        assert [st for st, _ in got[k]] == [st for st, _ in want[k]] and len(want[k]) >= 2, (k, got[k], want[k])
        assert all(abs(a - b) <= 1e-4 * abs(b) for (_, a), (_, b) in zip(got[k], want[k])), (k, got[k], want[k])
    (out,) = [d for d in s.dir.iterdir() if (d / "train.log").exists()]
    assert "rank 1: done (rank 0 logs the run)" in (out / "train.rank1.log").read_text()
    assert sorted(f.name for f in (out / "ckpt" / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    acct = subprocess.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "JobID,State,NTasks,AllocCPUS"],
                          capture_output=True, text=True, check=True).stdout.split()
    assert len(acct) == 1 and "|COMPLETED|" in acct[0], acct


def test_srun_of_two_tasks_trains_one_model(cluster, tmp_path):
    """``srun -n 2 python -m experiments.train parallel.dp=2 ...`` (a step of two tasks, no submitit job): the
    tasks find each other from SLURM's variables as torchrun's ranks do; one run, world_size 2, rank 1's own log."""
    cmd = [*DOC_SRUN.replace("python", sys.executable).split(), *TRAIN.split(),
           f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    _, (run,) = entrypoints.runs(tmp_path / "mlflow.db", "train")
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == "2", run.data.params
    assert "rank 1: done (rank 0 logs the run)" in r.stderr + r.stdout


def _rank_pid(job: str, rank: int, deadline: float) -> int:
    """The process of SLURM job ``job``'s task ``rank`` (submitit's task runner), read from /proc."""
    while time.monotonic() < deadline:
        for d in Path("/proc").iterdir():
            try:
                env = dict(kv.split("=", 1) for kv in (d / "environ").read_text().split("\0") if "=" in kv)
                cmd = (d / "cmdline").read_text()
            except (OSError, ValueError):
                continue
            if (env.get("SLURM_JOB_ID"), env.get("SLURM_PROCID")) == (job, str(rank)) and "submitit.core._submit" in cmd:
                return int(d.name)
        time.sleep(0.5)
    raise AssertionError(f"no task {rank} of SLURM job {job}")


def test_a_killed_slurm_rank_ends_its_job_and_the_resume_finishes_it(cluster, tmp_path):
    """SIGKILL to rank 1 of a two-task training job mid-run: srun ends rank 0 (the launcher's
    SLURM_KILL_BAD_EXIT), the sweep ends within 90 s with exit 1, the run KILLED or FAILED (never RUNNING), and
    the printed resume command continues from the sharded checkpoint to the last step, FINISHED."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    steps = 40
    t0 = time.monotonic()
    p = start_sweep(f"python -m experiments.train {SLURM_TASKS} {TRAIN} train.steps={steps} train.ckpt_every=4",
                    tmp_path, f"tracking.uri={uri}")
    seen: list[str] = []
    parent = parent_of(p, seen, t0 + 120)
    kid = wait_running(p, uri, parent, t0 + 180)
    import mlflow

    c = mlflow.MlflowClient(uri)
    while not [m for m in c.get_metric_history(kid.info.run_id, "loss") if m.step >= 8]:  # a checkpoint exists
        assert p.poll() is None and time.monotonic() < t0 + 300, "".join(seen)
        time.sleep(0.5)
    os.kill(_rank_pid(kid.data.tags["slurm_job_id"], 1, t0 + 300), signal.SIGKILL)
    killed = time.monotonic()
    s = finish_sweep(p, t0, timeout=120)
    assert s.rc == 1 and time.monotonic() - killed < 90, s.err[-3000:]
    assert c.get_run(kid.info.run_id).info.status in ("KILLED", "FAILED")
    (resume,) = [ln.split("resume:", 1)[1].strip() for ln in s.out.splitlines() if ln.startswith("resume:")]
    r = run_sweep(resume, tmp_path, f"tracking.uri={uri}")
    assert r.rc == 0, r.err[-3000:]
    (log,) = [f for f in r.dir.glob("*/train.log")]
    assert re.search(r"resuming run \w+ from its checkpoint at step ([4-9]|[1-3]\d)\b", log.read_text()), log.read_text()
    runs = children(uri, parent)
    assert all(x.info.status != "RUNNING" for x in runs)
    last = c.get_run(runs[-1].info.run_id)
    assert last.info.status == "FINISHED" and max(m.step for m in c.get_metric_history(last.info.run_id, "loss")) == steps


def test_close_stale_asks_slurm_about_runs_of_other_hosts(cluster):
    """A RUNNING run of a SLURM job on another host (a compute node): its process cannot be checked from
    here, its job can. The run of an ended job is closed, the run of a job SLURM still runs is left."""
    import mlflow

    from experiments.framework import tracking

    def sbatch(cmd: str) -> str:
        return subprocess.run(["sbatch", "--parsable", "-c", "1", "-o", "/dev/null", "--wrap", cmd],
                              capture_output=True, text=True, check=True).stdout.strip()

    ended, live = sbatch("true"), sbatch("sleep 120")
    try:
        c = mlflow.MlflowClient(cluster["MLFLOW_TRACKING_URI"])
        exp = c.create_experiment(f"close-stale-{time.time_ns()}")
        node = {"host": "another-node", "pid": "1", "process": "1:boot:1"}
        parent = c.create_run(exp, tags=node).info.run_id
        runs = {j: c.create_run(exp, tags={**node, "mlflow.parentRunId": parent, "slurm_job_id": j}).info.run_id
                for j in (ended, live)}
        deadline = time.monotonic() + 60
        while squeue(ended) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert tracking.stale(c.get_run(parent)) is None  # no SLURM job: this host cannot tell
        done = dict(tracking.close_stale(c, parent))
        assert done[runs[ended]] == f"closed (KILLED): process 1 on another-node (SLURM job {ended}) is gone"
        assert done[runs[live]].startswith("left RUNNING") and done[parent].startswith("left RUNNING")
        assert [c.get_run(runs[j]).info.status for j in (ended, live)] == ["KILLED", "RUNNING"]
    finally:
        subprocess.run(["scancel", live], check=False)


# ------------------------------------------------------------------ the per-GPU launcher: pinning and caps


def _overlapping(spans: list[tuple[float, float, str]]) -> list[tuple[str, str]]:
    return [(a[2], b[2]) for i, a in enumerate(spans) for b in spans[i + 1:] if a[0] < b[1] and b[0] < a[1]]


def test_per_gpu_sweep_pins_each_job_to_its_own_gpu(cluster, tmp_path):
    """The README's per-GPU decode sweep on the cluster's 2 fake GPUs (character devices), through the nsa
    sweeper, its jobs made long enough (seconds of work) to overlap: each job's run is tagged with the GPU
    SLURM gave it (its CUDA_VISIBLE_DEVICES); from the runs' start and end times in the store, jobs that
    ran at once never shared a GPU, and two did run at once."""
    s = run_sweep(readme_command(PER_GPU_CPU), tmp_path, f"model.timing.repeats={LONG // 2}", "decode.per_branch=false")
    assert s.rc == 0, s.err[-3000:]
    kids = children(README_URI, s.parent)
    assert len(kids) == 4 and {r.info.status for r in kids} == {"FINISHED"}
    assert {r.data.tags["launcher"] for r in kids} == {"per_gpu"}
    spans = [(r.info.start_time, r.info.end_time, r.data.tags["cuda_visible_devices"]) for r in kids]
    assert all(g in ("0", "1") for _, _, g in spans), spans
    together = _overlapping(spans)
    assert together, "no two jobs ran at once: the launcher did not use both GPUs"
    assert all(a != b for a, b in together), f"jobs running at once shared a GPU: {together}"
    assert "never two at once on one GPU" in s.err and "at most 2 at once" in s.err, s.err[-2000:]


def test_gpu_sweep_from_a_host_without_gpus_matches_each_job_on_its_node(cluster, tmp_path):
    """A GPU sweep submitted from a host without GPUs (a login node; here this CPU machine) is not refused
    for this host's device: each job checks its profile where it runs. On the fake GPUs each job finds no
    H200 and ends FAILED with that reason; the parent FAILED, exit 1."""
    s = run_sweep(readme_command(PER_GPU_H200), tmp_path)
    assert s.rc == 1 and s.parent, s.err[-3000:]
    kids = children(README_URI, s.parent)
    assert len(kids) == 4 and {r.info.status for r in kids} == {"FAILED"}
    assert all("hardware=h200 does not match the detected device" in r.data.tags["error"] for r in kids)
    assert {r.data.tags["cuda_visible_devices"] for r in kids} <= {"0", "1"}


APP = '''
import json, os, time
from pathlib import Path

import hydra


@hydra.main(version_base=None, config_path=".", config_name="app")
def main(cfg):
    start = time.time()
    time.sleep(cfg.hold_s)
    Path(cfg.out, f"job{cfg.job}.json").write_text(json.dumps({"start": start, "end": time.time()}))


if __name__ == "__main__":
    main()
'''


def test_per_gpu_launcher_caps_cpu_jobs(cluster, tmp_path):
    """CPU jobs (no GPU) are capped by hydra.launcher.array_parallelism: with 1, none overlap on this
    2-core machine, where SLURM alone would run two at once. (A toy Hydra app: seconds per job.)"""
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "app.yaml").write_text(f"job: 0\nhold_s: 2.0\nout: {tmp_path}\nhardware: {{gpus: 0, cpus: 1}}\n"
                                       f"hydra:\n  searchpath: [file://{ROOT / 'conf'}]\n")
    cmd = [sys.executable, str(tmp_path / "app.py"), "-m", "job=range(3)", "hydra/launcher=per_gpu",
           f"hydra.sweep.dir={tmp_path / 'sweep'}", "hydra.launcher.timeout_min=5", "hydra.launcher.array_parallelism=1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    found = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("job*.json"))]
    assert len(found) == 3, r.stdout + r.stderr
    assert not _overlapping([(j["start"], j["end"], "") for j in found]), found


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
    tmp = workdir / f"{name}-{worker}.part"  # renamed whole: the reader waits for the name, then reads it
    tmp.write_text(json.dumps(report))
    tmp.rename(workdir / f"{name}-{worker}.json")
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
