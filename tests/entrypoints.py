"""Running the entry points for real in tests: ``python -m experiments.<name>`` subprocesses (the
repository first on PYTHONPATH) into a temporary SQLite store, read back through MlflowClient."""
from __future__ import annotations

import ast
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from mlflow import MlflowClient
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parent.parent
ENTRIES = ("decode", "prefill", "parity", "kernels", "validate", "train", "generate")
INTERPRET = "TRITON_INTERPRET=1 "  # a documented command may start so: the triton kernels on this CPU


DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]  # what a user reads and copies from


def doc_text() -> str:
    """The README and every page of docs/, one text."""
    return "\n".join(p.read_text() for p in DOCS)


def doc_section(heading: str) -> str:
    """The text under the ``## <heading>...`` of the README or a docs page, to the next ``## ``."""
    return doc_text().split("## " + heading, 1)[1].split("\n## ", 1)[0].split("\n# ", 1)[0]


def documented_commands() -> list[str]:
    """Every ``python -m experiments.<entry> ...`` line of the shell blocks of the README and docs/, the
    entry points' --help (conf/<entry>.yaml hydra.help.header) and their docstrings; placeholders
    (``<run id>``) are run by the tests that have one."""
    texts = re.findall(r"```bash\n(.*?)```", doc_text(), re.S)
    for e in ENTRIES:
        texts.append(OmegaConf.load(REPO / "conf" / f"{e}.yaml").hydra.help.header)
        texts.append(ast.get_docstring(ast.parse((REPO / "experiments" / f"{e}.py").read_text())))
    cmds = set()
    for seg in (seg for t in texts for line in t.splitlines() for seg in line.split("&&")):
        seg = " ".join(seg.split("#")[0].split())
        env, seg = (INTERPRET, seg[len(INTERPRET):]) if seg.startswith(INTERPRET) else ("", seg)
        if re.match(r"python3? -m experiments\.\w+(\s|$)", seg) and "<" not in seg:
            cmds.add(env + "python " + seg.split(" ", 1)[1])
    return sorted(cmds)


def documented_torchrun() -> list[str]:
    """Every ``torchrun ... -m experiments.<entry> ...`` line of the README's and docs/' shell blocks."""
    blocks = re.findall(r"```bash\n(.*?)```", doc_text(), re.S)
    return sorted({ln.strip() for b in blocks for ln in b.splitlines() if ln.strip().startswith("torchrun ")})


def argv(cmd: str) -> tuple[list[str], dict]:
    """A documented command's arguments after ``python``, and the environment it names."""
    env = {"TRITON_INTERPRET": "1"} if cmd.startswith(INTERPRET) else {}
    return cmd.removeprefix(INTERPRET).split()[1:], env


def env(**extra: str) -> dict:
    """This environment without MLflow's store variable and the Triton interpreter, plus ``extra``."""
    e = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "TRITON_INTERPRET")}
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    return {**e, **extra}


def start(tmp: Path, entry: str, *args: str, name: str | None = "x", template: Path | None = None,
          store: bool = True, extra_env: dict | None = None, repo: Path = REPO,
          driver: str | None = None) -> subprocess.Popen:
    """Run an entry point in tmp (its cwd) into tmp/mlflow.db (``store=False``: the store the
    arguments or the environment choose); Hydra's dirs: tmp/out/<name>, or the configured default
    (tmp/outputs/...) when name is None. ``driver``: Python code run with ``-c`` instead of ``-m``, which
    runs the entry point itself (:func:`start_dropping_sigterm`)."""
    if template is not None and not (tmp / "mlflow.db").exists():
        shutil.copy(template, tmp / "mlflow.db")  # an initialized store: skips MLflow's table creation
    cmd = [sys.executable, *(["-c", driver] if driver else ["-m", f"experiments.{entry}"]), *args]
    if store:
        cmd.append(f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}")
    if name is not None:
        cmd += [f"hydra.run.dir={tmp / 'out' / name}", f"hydra.sweep.dir={tmp / 'out' / name}"]
    e = env(**(extra_env or {}))
    e["PYTHONPATH"] = str(repo) + os.pathsep + e["PYTHONPATH"]
    return subprocess.Popen(cmd, cwd=tmp, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_signals)


# The entry point, with ``target`` (``module:function``) wrapped: its ``call``-th call first drops a SIGTERM. The
# process signals itself from inside a finalizer, so the handler's exception is raised there, where Python
# prints it ("Exception ignored") and goes on: what a real signal meets when it lands while the garbage
# collector runs a weakref callback (SQLAlchemy's). experiments/framework/cli.py raises it again.
DROP_SIGTERM = """
import importlib, os, runpy, signal, sys, weakref

module = importlib.import_module({module!r})
real, calls = getattr(module, {function!r}), 0


def dropped():
    os.kill(os.getpid(), signal.SIGTERM)


def wrapped(*args, **kw):
    global calls
    calls += 1
    if calls == {call}:
        class Held:
            pass
        held = Held()
        weakref.finalize(held, dropped)
        del held
    return real(*args, **kw)


setattr(module, {function!r}, wrapped)
sys.argv[0] = {entry!r}
runpy.run_module({entry!r}, run_name="__main__", alter_sys=True)
"""


def start_dropping_sigterm(tmp: Path, entry: str, target: str, call: int, *args: str, **kw) -> subprocess.Popen:
    """:func:`start`, the SIGTERM dropped at ``target``'s ``call``-th call (:data:`DROP_SIGTERM`)."""
    module, function = target.split(":")
    code = DROP_SIGTERM.format(module=module, function=function, call=call, entry=f"experiments.{entry}")
    return start(tmp, entry, *args, driver=code, **kw)


def default_signals() -> None:
    """In a started entry point, SIGINT and SIGTERM as in a user's terminal. A process inherits ignored
    signals, and a script's background job (``pytest ... &``) starts with SIGINT ignored; an entry point
    keeps a signal ignored at its start (experiments/framework/cli.py), so the interrupt tests would then
    see a sweep that cannot be interrupted."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def wait(p: subprocess.Popen, timeout: float = 300):
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def cores() -> int:
    """The CPU cores this process may run on (its affinity mask, where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run_bounded(launches: dict, workers: int | None = None) -> dict:
    """``launches``: name -> a function that starts one process (a Popen). At most ``workers`` (default:
    :func:`cores`) run at once, the next starting as one exits; each is mostly interpreter start-up, and
    dozens at once on a loaded 2-core machine ran past their timeouts. name -> (rc, stdout, stderr,
    start, end), the times from ``time.perf_counter`` around the process's start and exit."""

    def one(item):
        name, launch = item
        t0 = time.perf_counter()
        rc, out, err = wait(launch())
        return name, (rc, out, err, t0, time.perf_counter())

    with ThreadPoolExecutor(workers or cores()) as pool:
        return dict(pool.map(one, launches.items()))


def runs(db: Path, entry: str):
    """(client, every run of nsa-<entry>) in the SQLite store db."""
    c = MlflowClient(tracking_uri=f"sqlite:///{db}")
    exp = c.get_experiment_by_name(f"nsa-{entry}")
    assert exp is not None, f"no experiment nsa-{entry}"
    return c, c.search_runs([exp.experiment_id], max_results=1000)


def make_template(path: Path) -> Path:
    """An initialized, empty SQLite store to copy (creating the tables costs seconds per store)."""
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


def one_line(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.strip()]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def until(check, timeout: float, what: str) -> None:
    import time

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout} s")


def server_up(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def mlflow_server(tmp: Path, port: int, *extra: str) -> subprocess.Popen:
    """``mlflow server`` on 127.0.0.1:port (a SQLite store and artifacts in tmp), in its own process group
    (``os.killpg(p.pid, SIGKILL)`` stops it and its workers); wait for it with ``until(server_up)``."""
    return subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri",
                             f"sqlite:///{tmp / 'server.db'}", "--default-artifact-root", str(tmp / "art"),
                             "--host", "127.0.0.1", "--port", str(port), "--workers", "1", *extra],
                            cwd=tmp, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@contextmanager
def served(tmp: Path, *extra: str):
    """A running :func:`mlflow_server` in tmp on a free port: (port, its Popen); afterwards its process group is
    killed (continued first, in case the test stopped it with SIGSTOP)."""
    port = free_port()
    p = mlflow_server(tmp, port, *extra)
    try:
        until(lambda: server_up(port), 120, "the MLflow server answered")
        yield port, p
    finally:
        os.killpg(p.pid, signal.SIGCONT)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
