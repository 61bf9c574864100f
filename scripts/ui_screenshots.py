"""Screenshots of what a user first sees in the MLflow UI for a sweep: the runs table, the experiment's
chart view, the sweep's own chart view (the link the sweep's summary prints) and the parent run's plot.

    python scripts/ui_screenshots.py --store sqlite:///$PWD/mlflow.db --experiment nsa-decode --out shots/

Starts ``mlflow ui`` on 127.0.0.1 (a free port) over the store, renders each page in headless
Chromium (Debian's ``chromium``: ``apt-get install chromium``) and stops the server. The parent is the
newest run of the experiment that has children. Beside ``sweep_view.png``, ``sweep_view.html`` is the
page's DOM as rendered (the charts' legends: each line's name and colour). ``--pages`` picks some of
the pages. Look at the PNGs: docs/experiments.md ("MLflow") says which view to open.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from mlflow import MlflowClient

from experiments.framework import views

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--run-all-compositor-stages-before-draw"]
BUDGET_MS = 60000  # the page's virtual time: the charts load their data and draw (25 s left spinners)
PAGES = ("runs_table", "runs_charts", "sweep_view", "parent_plot")


def parent_png(client: MlflowClient, run_id: str) -> str | None:
    """The sweep's plot on its parent run: its first PNG artifact (``<experiment>_vs_seq.png`` for the
    benchmarks, ``train_by_step.png`` for training); None where the run's artifacts cannot be listed here."""
    try:
        pngs = sorted(f.path for f in client.list_artifacts(run_id) if f.path.endswith(".png"))
    except Exception as e:  # noqa: BLE001 - an artifact store this machine cannot read: say so, shoot the rest
        print(f"artifacts of {run_id} not listed: {e}")
        return None
    return pngs[0] if pngs else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, seconds: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"mlflow ui did not answer at {url} within {seconds:.0f} s")


def shoot(chromium: str, url: str, png: Path, profile: Path, size: str = "1600,1000", dom: bool = False) -> None:
    """``url`` as ``png``; ``dom``: also its DOM as rendered, beside it (``.html``)."""
    base = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={size}",
            f"--virtual-time-budget={BUDGET_MS}"]
    subprocess.run([*base, f"--screenshot={png}", url], capture_output=True, timeout=180, check=False)
    if not png.is_file():
        raise SystemExit(f"chromium wrote no screenshot for {url}")
    print(f"{png}  <- {url}")
    if dom:
        got = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=180, check=False)
        if not got.stdout.strip():
            raise SystemExit(f"chromium gave no DOM for {url}: {got.stderr[-500:]}")
        png.with_suffix(".html").write_text(got.stdout)
        print(f"{png.with_suffix('.html')}  <- {url}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True, help="tracking URI, e.g. sqlite:///$PWD/mlflow.db")
    ap.add_argument("--experiment", default="nsa-decode")
    ap.add_argument("--out", type=Path, default=Path("shots"))
    ap.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    ap.add_argument("--pages", nargs="+", choices=PAGES, default=list(PAGES), help="the pages to take (default: all)")
    a = ap.parse_args()

    client = MlflowClient(tracking_uri=a.store)
    exp = client.get_experiment_by_name(a.experiment)
    if exp is None:
        sys.exit(f"no experiment {a.experiment} in {a.store}")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=500)
    parents = {r.data.tags.get("mlflow.parentRunId") for r in runs} - {None}
    parent = next((r for r in runs if r.info.run_id in parents), None)
    if parent is None:
        sys.exit(f"no sweep (a run with children) in {a.experiment}")

    lines = client.get_experiment_by_name(a.experiment + views.LINES)  # the sweep's view (views.py)
    view = lines.experiment_id if lines and views.SHARE_TAG + parent.info.run_id in lines.tags else None
    if "sweep_view" in a.pages and view is None:
        sys.exit(f"the sweep {parent.info.run_id} has no view in experiment {a.experiment + views.LINES}")

    a.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", a.store,
                               "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_http(base + "/", 120)
        eid, rid = exp.experiment_id, parent.info.run_id
        png = parent_png(client, rid) if "parent_plot" in a.pages else None
        png = png or a.experiment.removeprefix("nsa-") + "_vs_seq.png"
        urls = {"runs_table": (f"#/experiments/{eid}/runs?workflowType=machine_learning", "1600,1000"),
                "runs_charts": (f"#/experiments/{eid}/runs?workflowType=machine_learning&compareRunsMode=CHART",
                                "1600,1400"),
                "sweep_view": (views.link(view, rid) if view else "", "1600,1400"),
                "parent_plot": (f"#/experiments/{eid}/runs/{rid}/artifacts/{png}?workflowType=machine_learning",
                                "1600,1000")}
        with tempfile.TemporaryDirectory() as profile:
            for page in a.pages:
                url, size = urls[page]
                shoot(a.chromium, f"{base}/{url}", a.out / f"{page}.png", Path(profile), size, dom=page == "sweep_view")
    finally:  # the server and its workers: one process group
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
