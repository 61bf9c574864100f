"""A sweep's own page in MLflow's chart view: NSA against dense on one chart per column.

MLflow's chart view draws one chart per metric key, so the parent's ``p50_ms/nsa`` and ``p50_ms/dense``
never meet on one chart by default. Its "share view" does what is needed: the UI keeps a view (charts,
sections, which runs are shown) as JSON in the experiment tag ``mlflow.sharedViewState.<key>`` and opens
it from ``...?viewStateShareKey=<key>``. A sweep writes such a view (key: its parent run id) with one line
chart per column holding every row's line (``selectedMetricKeys``: ``nsa`` first, then ``dense``), x the
metric step (seq, or the training step), the parent the only run shown; the summary prints its link.

The JSON carries the fields of MLflow 3.17's line chart card that matter; the UI fills in the rest from
its defaults. An MLflow without shared views opens the experiment's default view from the same link.
"""
from __future__ import annotations

import json

SHARE_TAG = "mlflow.sharedViewState."
FIRST = ("nsa", "dense", "layer")  # the lines a reader compares first
HIDE_MAX = 200  # other top-level runs hidden by name (the tag holds at most 20,000 characters)


def _order(name: str) -> tuple[int, str]:
    label = name.split("/", 1)[1].split(" ", 1)[0]
    return (FIRST.index(label) if label in FIRST else len(FIRST), name)


def sweep_view(parent: str, metrics: list[str], ys: tuple[str, ...], x: str, hide: list[str]) -> dict:
    """The view's state: a section with one line chart per y of ``ys`` over the parent's metrics
    ``<y>/<label>``; ``hide``: the experiment's other top-level runs (only the parent is drawn)."""
    section = f"section-{parent}"
    charts = []
    for i, y in enumerate(ys):
        keys = sorted((m for m in metrics if m.startswith(y + "/")), key=_order)
        if not keys:
            continue
        charts.append({"uuid": f"chart-{parent}-{i}", "type": "LINE", "metricSectionId": section, "deleted": False,
                       "isGenerated": False, "displayName": f"{y} vs {x}", "metricKey": keys[0],
                       "selectedMetricKeys": keys, "xAxisKey": "step", "useGlobalXaxisKey": False,
                       "scaleType": "log" if x != "step" else "linear", "lineSmoothness": 0,
                       "useGlobalLineSmoothing": False, "displayPoints": True, "range": {}})
    return {"compareRunCharts": charts,
            "compareRunSections": [{"uuid": section, "name": f"this sweep against {x}",
                                    "display": True, "isReordered": False, "deleted": False,
                                    "isGenerated": False}],
            "isAccordionReordered": True, "runsHidden": [r for r in hide if r != parent], "runsExpanded": {}}


def share(client, experiment_id: str, parent: str, metrics: list[str], ys: tuple[str, ...], x: str) -> str | None:
    """Write the sweep's view as the experiment tag MLflow's share links read; its key, or None where the
    parent has no charted metric."""
    runs = client.search_runs([experiment_id], max_results=1000, order_by=["attributes.start_time DESC"])
    top = [r.info.run_id for r in runs if "mlflow.parentRunId" not in r.data.tags][:HIDE_MAX]
    state = sweep_view(parent, metrics, ys, x, top)
    if not state["compareRunCharts"]:
        return None
    client.set_experiment_tag(experiment_id, SHARE_TAG + parent, json.dumps(state, separators=(",", ":")))
    return parent


def link(experiment_id: str, key: str) -> str:
    """The page of the view ``key`` (to append to the UI's address)."""
    return (f"#/experiments/{experiment_id}/runs?viewStateShareKey={key}&workflowType=machine_learning"
            "&compareRunsMode=CHART")
