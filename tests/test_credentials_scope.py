"""A login goes only to the server it belongs to, through the real CLI against a listener on
127.0.0.1 that records each request's Authorization header (a thread of this test, answering 503; stopped
at the end): ``tracking.credentials`` (MLflow's credentials-file format with ``mlflow_tracking_uri``, as
scripts/cluster.sh writes it) sends its login to that URI's server, and nothing to another
``tracking.uri``. Before, the cluster's login was MLflow's global ~/.mlflow/credentials, sent to every
http tracking URI (a listener not ours received ``admin:<password>``)."""
from __future__ import annotations

import base64
import http.server
import threading

import pytest
from entrypoints import start, wait

PASSWORD = "Cl-4x8Tq2w"


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list = []

    def _answer(self):
        self.seen.append((self.path, self.headers.get("Authorization")))
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST = _answer

    def log_message(self, *a):  # quiet
        pass


@pytest.fixture
def listener():
    _Recorder.seen = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    srv.timeout = 5
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    t.start()
    try:
        yield srv.server_address[1], _Recorder.seen
    finally:
        srv.shutdown()
        srv.server_close()


def _credentials(tmp, owner_port: int):
    f = tmp / "credentials"
    f.write_text(f"[mlflow]\nmlflow_tracking_uri = http://127.0.0.1:{owner_port}\n"
                 f"mlflow_tracking_username = admin\nmlflow_tracking_password = {PASSWORD}\n")
    f.chmod(0o600)
    return f


def _run(tmp, port: int, creds) -> tuple[int, str]:
    rc, out, err = wait(start(tmp, "decode", "seq=64", "tracking=server", f"tracking.uri=http://127.0.0.1:{port}",
                              f"tracking.credentials={creds}", store=False,
                              extra_env={"HOME": str(tmp), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}), timeout=120)
    return rc, out + err


@pytest.mark.parametrize("owner", ["this", "another"])
def test_the_login_reaches_only_its_own_server(tmp_path, listener, owner):
    port, seen = listener
    creds = _credentials(tmp_path, port if owner == "this" else port + 1)
    rc, text = _run(tmp_path, port, creds)
    assert rc == 2 and "503" in text, text[-2000:]  # the listener is no MLflow server: refused in one line
    assert PASSWORD not in text
    assert seen, "the listener received no request"
    auth = {a for _p, a in seen}
    if owner == "this":
        assert auth == {"Basic " + base64.b64encode(f"admin:{PASSWORD}".encode()).decode()}
    else:
        assert auth == {None}, auth
