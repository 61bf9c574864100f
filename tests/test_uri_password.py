"""A password in the tracking URI is used, and written nowhere: through the real CLI, a
decode run and a two-job sweep into a real ``mlflow server`` on 127.0.0.1 (no auth: it takes the login and
ignores it) with ``tracking.uri=http://admin:<password>@127.0.0.1:<port>``. The password appears in no
output line, no file the run or Hydra wrote (the job's log, ``.hydra/*.yaml``), none of the server's
artifacts (config.yaml, the CSV, environment.json) and no param or tag; the URI is shown as
``http://admin:***@...``. Before, it was in the params, config.yaml, stdout (4 times), decode.log and
``.hydra/``."""
from __future__ import annotations


import pytest
from entrypoints import served, start, wait
from mlflow import MlflowClient

PASSWORD = "Pw-9f3kQz7"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    with served(tmp) as (port, _):
        yield tmp, port


def _everything_under(folder) -> str:
    return "".join(p.read_text(errors="replace") for p in folder.rglob("*") if p.is_file() and p.suffix != ".db")


@pytest.mark.parametrize("sweep", [False, True])
def test_the_password_is_used_and_written_nowhere(server, tmp_path, sweep):
    srv, port = server
    uri = f"http://admin:{PASSWORD}@127.0.0.1:{port}"
    args = ["-m", "seq=64,72"] if sweep else ["seq=64"]
    rc, out, err = wait(start(tmp_path, "decode", *args, "decode.per_branch=false", f"tracking.uri={uri}",
                              store=False, name="run"))
    assert rc == 0, err[-3000:]
    assert PASSWORD not in out + err
    assert f"http://admin:***@127.0.0.1:{port}" in out + err
    written = _everything_under(tmp_path)
    assert "decode.log" in str(list(tmp_path.rglob("decode.log"))) and PASSWORD not in written
    assert "tracking.uri" in _everything_under(tmp_path / "out")  # Hydra's files hold the (masked) override
    c = MlflowClient(tracking_uri=f"http://127.0.0.1:{port}")
    exp = c.get_experiment_by_name("nsa-decode")
    rs = c.search_runs([exp.experiment_id], filter_string=f"attributes.start_time > {0}")
    mine = [r for r in rs if r.data.params.get("tracking.uri", "").startswith("http://admin:***@")
            or "mlflow.parentRunId" not in r.data.tags]
    assert mine
    for r in rs:
        assert PASSWORD not in str(r.data.params) + str(r.data.tags)
    assert PASSWORD not in _everything_under(srv / "art")
