"""A tracking server that goes away while a run is open (issue 45, item 7): the run's end is reported with
what happened, a refused connection, and the command that closes the run later, not the full disk's words
("once the store has room"). Through the real CLI against a real ``mlflow server`` on 127.0.0.1 (its own
process group, killed by the test; a free port)."""
from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from entrypoints import start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _until(check, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout} s")


def _up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _running(db: Path) -> bool:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
            return c.execute("select count(*) from runs where status = 'RUNNING'").fetchone()[0] > 0
    except sqlite3.Error:
        return False


def test_a_refused_connection_is_reported_as_one(tmp_path):
    port, db = _free_port(), tmp_path / "server.db"
    server = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri",
                               f"sqlite:///{db}", "--default-artifact-root", str(tmp_path / "art"), "--host",
                               "127.0.0.1", "--port", str(port), "--workers", "1"],
                              cwd=tmp_path, start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    p = None
    try:
        _until(lambda: _up(port), 120, "the MLflow server answered")
        p = start(tmp_path, "decode", "seq=256", "decode.repeats=1000000", f"tracking.uri=http://127.0.0.1:{port}",
                  store=False, extra_env={"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"})
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(p.stderr), daemon=True)
        reader.start()
        # the process has its run (the server answered runs/create) and works: it logged its backends
        _until(lambda: any("backends {" in ln for ln in lines), 180, "the decode run was working")
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    assert not _up(port)
    # Its next store request fails (the job then ends FAILED), or SIGTERM ends it KILLED: either way the
    # request that ends the run is refused.
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout=120)
    reader.join(timeout=10)
    err = "".join(lines)
    assert rc in (1, 143), err[-3000:]
    said = [ln for ln in err.splitlines() if "could not be ended" in ln]
    assert said, err[-3000:]
    for ln in said:
        assert "has room" not in ln, ln
        assert "Connection refused" in ln and "the tracking server refused" in ln, ln
        assert "python -m experiments.close_stale " in ln, ln
