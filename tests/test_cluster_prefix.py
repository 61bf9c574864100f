"""scripts/cluster.sh on a host without apt or network, as on the GPU box: the lines of docs/cluster.md's
"SLURM on a host without apt or network" as written but for their folders (the test's own) and `up`'s
``--fake-gpus 2 --port-offset 100``: `fetch` the .deb files, `unpack` them under a prefix,
`up --prefix P --no-tracking` from it, a per-GPU sweep through SLURM into an SQLite file, then `down`.

The cluster here is a second one beside the one CI starts for tests/test_cluster.py (``--port-offset``),
and every library of the prefix is used as if this host lacked them all (``ldconfig -p`` answers nothing
to `up`): each daemon, the job steps (slurmstepd) and the clients run from the prefix. Needs root, dpkg
and apt-get (CI: ``scripts/cluster.sh install`` ran first); `fetch` copies the packages from apt's cache
where it holds them and else downloads them, so without a network and without that cache this test skips.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import entrypoints
import pytest

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_SH = ROOT / "scripts" / "cluster.sh"
OFFSET = "100"  # its daemons on 3407 and 6917-6919, beside CI's cluster on 3307 and 6817-6819
DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd")
BUDGET_MIB = 25  # what the .deb files may take in the 64 MiB that travel to the GPU box

pytestmark = [
    pytest.mark.daemons,  # skipped unless pytest --daemons (tests/conftest.py; .ci/run asks)
    pytest.mark.skipif(os.geteuid() != 0, reason="scripts/cluster.sh up needs root"),
    pytest.mark.skipif(not (shutil.which("dpkg") and shutil.which("apt-get")), reason="fetch and unpack need apt-get and dpkg"),
]


def documented() -> list[str]:
    """The lines of the docs' block for a host without apt: fetch, unpack, up, the sweep, down."""
    (block,) = re.findall(r"```bash\n(.*?)```", entrypoints.doc_section("SLURM on a host without apt or network"), re.S)
    lines = [" ".join(ln.split()) for ln in block.strip().splitlines()]
    assert [ln.split()[:2] for ln in lines] == [["scripts/cluster.sh", "fetch"], ["scripts/cluster.sh", "unpack"],
                                                ["scripts/cluster.sh", "up"], [".", "/tmp/cl/slurm.env"],
                                                ["scripts/cluster.sh", "down"]], lines
    return lines


def _cluster_sh(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER_SH), *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def work():
    """A folder other users may enter (MariaDB runs as mysql), which pytest's tmp_path is not."""
    d = Path(tempfile.mkdtemp(prefix="nsa-prefix-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def debs(work) -> Path:
    (fetch,) = [ln for ln in documented() if ln.startswith("scripts/cluster.sh fetch ")]
    assert fetch == "scripts/cluster.sh fetch .debs"
    r = _cluster_sh("fetch", str(work / "debs"), timeout=600)
    if r.returncode != 0 and re.search(r"apt-get (download .* failed|update failed)", r.stderr):
        pytest.skip(f"fetch could not download the packages (no network, none in apt's cache): {r.stderr.strip()}")
    assert r.returncode == 0, r.stdout + r.stderr
    return work / "debs"


def test_fetch_stays_within_the_budget_and_leaves_postgresql_out(debs, capsys):
    names = sorted(p.name for p in debs.glob("*.deb"))
    size = sum(p.stat().st_size for p in debs.glob("*.deb"))
    with capsys.disabled():
        print(f"\nscripts/cluster.sh fetch: {len(names)} packages, {size / 2**20:.1f} MiB")
    assert size < BUDGET_MIB * 2**20, size
    for needed in ("munge_", "slurmctld_", "slurmd_", "slurm-client_", "slurmdbd_", "slurm-wlm-mysql-plugin_",
                   "mariadb-server-core_", "mariadb-client-core_", "libaio1_"):
        assert any(n.startswith(needed) for n in names), (needed, names)
    assert not [n for n in names if n.startswith(("postgresql", "libc6_", "libstdc++"))], names


def daemon_pids(state: Path) -> dict[str, int]:
    return {name: int((state / "pids" / name).read_text().split()[0]) for name in DAEMONS}


def sourced(env_file: Path, base: dict) -> dict:
    """The environment after `. env_file` in a shell started with ``base``."""
    out = subprocess.run(["bash", "-c", f". {env_file} && env -0"], env=base, capture_output=True, check=True).stdout
    return dict(item.split("=", 1) for item in out.decode().split("\0") if "=" in item)


def test_unpack_up_prefix_per_gpu_sweep_down(debs, work, tmp_path):
    """unpack, then `up --prefix P --no-tracking --fake-gpus 2` with a PATH whose system sbin comes last:
    every daemon's executable and SLURM's and munge's libraries are P's, a job's step runs P's slurmstepd,
    /etc/slurm is left alone; the documented per-GPU sweep (2 jobs, from a shell that sourced
    DIR/slurm.env) lands in the SQLite file `up` named, each job on its own fake GPU, with SLURM's
    accounting (P's sacct, slurmdbd, MariaDB); `down` stops all of it."""
    prefix, state = work / "prefix", work / "state"
    _, unpack, up, sweep_line, down_line = [
        ln.replace(".debs", str(debs)).replace("/tmp/slurm", str(prefix)).replace("/tmp/cl", str(state))
        for ln in documented()]
    r = _cluster_sh(*shlex.split(unpack)[1:])
    assert r.returncode == 0, r.stdout + r.stderr
    assert os.readlink(prefix / "usr/sbin/slurmstepd") == "slurmstepd-wlm"

    shims = tmp_path / "shims"  # `ldconfig -p` lists nothing: every library of P is linked into DIR/lib
    shims.mkdir()
    (shims / "ldconfig").write_text('#!/bin/sh\necho "0 libs found in cache"\n')
    (shims / "ldconfig").chmod(0o755)
    base = {**os.environ, "PATH": f"{shims}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"}
    base.pop("LD_LIBRARY_PATH", None)
    base.pop("SLURM_CONF", None)
    pids: dict[str, int] = {}
    etc_before = os.path.realpath("/etc/slurm/slurm.conf") if os.path.lexists("/etc/slurm/slurm.conf") else None
    try:
        r = _cluster_sh(*shlex.split(up)[1:], "--fake-gpus", "2", "--port-offset", OFFSET, env=base)
        assert r.returncode == 0, r.stdout + r.stderr
        uri = f"sqlite:///{state}/mlflow.db"
        assert r.stdout.strip().splitlines()[-1] == f"MLFLOW_TRACKING_URI={uri}", r.stdout
        assert "no PostgreSQL, no MLflow server" in r.stdout
        assert (os.path.realpath("/etc/slurm/slurm.conf") if os.path.lexists("/etc/slurm/slurm.conf") else None) == etc_before

        pids = daemon_pids(state)
        for name, pid in pids.items():
            assert os.readlink(f"/proc/{pid}/exe").startswith(f"{prefix}/"), (name, os.readlink(f"/proc/{pid}/exe"))
        maps = {name: Path(f"/proc/{pid}/maps").read_text() for name, pid in pids.items()}
        for name in ("slurmdbd", "slurmctld", "slurmd"):
            assert f"{prefix}/usr/lib/x86_64-linux-gnu/slurm-wlm/libslurmfull.so" in maps[name], name
            assert f"{prefix}/usr/lib/x86_64-linux-gnu/libmunge.so" in maps[name], name
        assert f"{prefix}/usr/lib/x86_64-linux-gnu/libmariadb.so.3" in maps["slurmdbd"]
        assert f"{prefix}/usr/lib/x86_64-linux-gnu/libaio.so" in maps["mariadbd"]

        source, cmd = sweep_line.split(" && ")
        assert source == f". {state}/slurm.env"
        env = sourced(state / "slurm.env", {**base, "PATH": "/usr/local/bin:/usr/bin:/bin"})
        assert shutil.which("sbatch", path=env["PATH"]) == f"{prefix}/usr/bin/sbatch"
        job = subprocess.run(["sbatch", "--parsable", "--wait", "-c", "1", "-o", str(tmp_path / "job.out"),
                              "--wrap", 'readlink /proc/$PPID/exe; srun -n1 sh -c "readlink /proc/\\$PPID/exe"'],
                             env=env, capture_output=True, text=True, timeout=120)
        assert job.returncode == 0, job.stderr
        steps = (tmp_path / "job.out").read_text().split()
        assert steps == [f"{prefix}/usr/sbin/slurmstepd-wlm"] * 2, steps  # the batch step's and srun's

        assert f"tracking.uri={uri} " in cmd
        sweep = subprocess.run(
            [sys.executable, *shlex.split(cmd)[1:]], cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)},
            capture_output=True, text=True, timeout=300)
        assert sweep.returncode == 0, sweep.stderr[-3000:]
        last = sweep.stderr.strip().splitlines()[-1]
        assert "jobs ran on GPUs" in last and "never two at once on one GPU" in last, last
        import mlflow

        c = mlflow.MlflowClient(uri)
        (exp,) = [e.experiment_id for e in c.search_experiments() if e.name == "nsa-decode"]
        kids = [r for r in c.search_runs([exp]) if "mlflow.parentRunId" in r.data.tags]
        assert sorted(r.data.params["seq"] for r in kids) == ["128", "64"]
        assert {r.info.status for r in kids} == {"FINISHED"} and {r.data.tags["launcher"] for r in kids} == {"per_gpu"}
        assert {r.data.tags["cuda_visible_devices"] for r in kids} <= {"0", "1"}
        array = kids[0].data.tags["slurm_job_id"].split("_")[0]
        acct = subprocess.run(["sacct", "-j", array, "-X", "-n", "-P", "-o", "JobID,State,AllocTRES"], env=env,
                              capture_output=True, text=True, check=True).stdout.split()
        assert len(acct) == 2 and all("|COMPLETED|" in ln and "gres/gpu=1" in ln for ln in acct), acct
    finally:
        down = _cluster_sh(*shlex.split(down_line)[1:], env=base)
    assert down.returncode == 0 and "nothing left running" in down.stdout, down.stdout + down.stderr
    for name, pid in pids.items():
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:  # gone (or a zombie: no executable left)
            continue
        assert not exe.startswith(f"{prefix}/"), (name, pid, exe)
