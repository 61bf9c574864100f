"""A sweep's own page in MLflow's chart view: NSA against dense on one chart per column, each line its
own colour and name.

MLflow's chart view (3.17) colours a chart's lines by run (the run's tag ``mlflow.runColor``, the tag
its colour picker writes, else a hash of the run id) and names them by run; one run's metrics on one
chart share its colour and differ by dash only. So a sweep writes each line of its charts as a run of
its own, a *line run*: named by the line's label (``nsa``, ``dense``, ``layer``, ...; where more than seq
varies, ``nsa <the other values>``), coloured from the PNG's palette (:func:`report.colors`), holding
the line as metric ``<y>`` at step x (seq, or the training step), tagged ``sweep_parent`` (the parent
run's id). Line runs live in the experiment ``<experiment>-lines`` (``nsa-decode-lines``), not beside
the jobs: a sweep's children stay its jobs, one per job, for the sweep, its resume and every reader of
the store. The parent keeps the same lines as its metrics ``<y>/<label>``.

The view: the UI keeps a view (charts, sections, search) as JSON in the experiment tag
``mlflow.sharedViewState.<key>`` and opens it from ``...?viewStateShareKey=<key>``. A sweep writes one
(key: its parent run id) in the lines experiment: one line chart per column of the job's table (metric
``<y>`` of every run shown), the search ``tags.sweep_parent = '<parent>'`` (its line runs only; 3.17
keeps a shared view's search, not its per-run visibility fields), every matching run shown. The summary
prints its link. The JSON carries the fields of MLflow 3.17's view that matter; the UI fills in the rest.
"""
from __future__ import annotations

import contextlib
import json
import time

from . import report, tracking

SHARE_TAG = "mlflow.sharedViewState."
COLOR_TAG = "mlflow.runColor"  # the run's colour in MLflow's UI (its colour picker writes the same tag)
PARENT_TAG = "sweep_parent"    # a line run's sweep: the parent run's id
LINES = "-lines"               # the line runs' experiment: the jobs' experiment's name and this


def sweep_view(parent: str, ys: list[str], x: str) -> dict:
    """The view's state: the parent's line runs, a section of one line chart per y of ``ys``."""
    section = f"section-{parent}"
    return {"searchFilter": f"tags.{PARENT_TAG} = '{parent}'", "runsHiddenMode": "SHOW_ALL",
            "compareRunCharts": [{"uuid": f"chart-{parent}-{i}", "type": "LINE", "metricSectionId": section,
                                  "deleted": False, "isGenerated": False, "displayName": f"{y} vs {x}",
                                  "metricKey": y, "selectedMetricKeys": [y], "xAxisKey": "step",
                                  "useGlobalXaxisKey": False, "scaleType": "log" if x != "step" else "linear",
                                  "lineSmoothness": 0, "useGlobalLineSmoothing": False, "displayPoints": True,
                                  "range": {}} for i, y in enumerate(ys)],
            "compareRunSections": [{"uuid": section, "name": f"this sweep against {x}", "display": True,
                                    "isReordered": False, "deleted": False, "isGenerated": False}],
            "isAccordionReordered": True, "hideEmptyCharts": True}


def write_lines(client, experiment_id: str, parent: str, data: dict[str, dict[str, list]]) -> dict[str, str]:
    """One FINISHED run per line of ``data`` (y -> label -> (x, value) points) in ``experiment_id``: label ->
    run id. The runs a resumed sweep wrote before are reused, with the points they lack."""
    labels = report.line_order(lab for ls in data.values() for lab in ls)
    have = {r.data.tags.get("mlflow.runName"): r.info.run_id for r in client.search_runs(
        [experiment_id], filter_string=f"tags.{PARENT_TAG} = '{parent}'", max_results=1000)}
    palette, now, out = report.colors(labels), int(time.time() * 1000), {}
    for rank, lab in enumerate(labels):
        points = [(y, v, x) for y, ls in data.items() for x, v in ls.get(lab, [])]
        rid = have.get(lab)
        if rid is None:  # the newest first in MLflow's table: nsa's run starts last
            rid = client.create_run(experiment_id, start_time=now + len(labels) - rank, run_name=lab, tags={
                PARENT_TAG: parent, COLOR_TAG: palette[lab],
                "mlflow.note.content": f"The line {lab} of the sweep whose parent run is {parent}."}).info.run_id
        try:
            tracking.log_series(client, rid, tracking.unlogged(client, rid, points))
        except BaseException:  # e.g. a full disk: no run left RUNNING where the store still takes a write
            with contextlib.suppress(Exception):
                client.set_terminated(rid, "FAILED")
            raise
        client.set_terminated(rid, "FINISHED")
        out[lab] = rid
    return out


def publish(store, parent: str, data: dict[str, dict[str, list]], x: str) -> str | None:
    """The sweep's line runs and view in ``<store's experiment>-lines``; the view's page (:func:`link`), or
    None where no line has a point. MLflow's errors propagate (the caller reports them)."""
    ys = [y for y, ls in data.items() if any(ls.values())]
    if not ys:
        return None
    eid = tracking.sibling(store, store.experiment + LINES)
    write_lines(store.client, eid, parent, {y: data[y] for y in ys})
    store.client.set_experiment_tag(eid, SHARE_TAG + parent, json.dumps(sweep_view(parent, ys, x), separators=(",", ":")))
    return link(eid, parent)


def link(experiment_id: str, key: str) -> str:
    """The page of the view ``key`` (to append to the UI's address)."""
    return (f"#/experiments/{experiment_id}/runs?viewStateShareKey={key}&workflowType=machine_learning"
            "&compareRunsMode=CHART")
