"""A tracking server that goes away while a run is open: the run's end is reported with
what happened, a refused connection, and the command that closes the run later, not the full disk's words
("once the store has room"). Through the real CLI against a real ``mlflow server`` on 127.0.0.1 (its own
process group, killed by the test; a free port)."""
from __future__ import annotations

import os
import signal
import threading

from entrypoints import free_port, mlflow_server, server_up, start, until


def test_a_refused_connection_is_reported_as_one(tmp_path):
    port = free_port()
    server = mlflow_server(tmp_path, port)
    p = None
    try:
        until(lambda: server_up(port), 120, "the MLflow server answered")
        p = start(tmp_path, "decode", "seq=256", "decode.warmup=10000", "decode.repeats=10000", f"tracking.uri=http://127.0.0.1:{port}",
                  store=False, extra_env={"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"})
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(p.stderr), daemon=True)
        reader.start()
        # the process has its run (the server answered runs/create) and works: it logged its backends
        until(lambda: any("backends {" in ln for ln in lines) or p.poll() is not None, 180, "the decode run was working")
        assert p.poll() is None, "".join(lines)[-2000:]  # still working, not ended by its config or its store
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    assert not server_up(port)
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
