"""The sweep's parts in-process: expansion, what tells jobs apart, and its end read from the store
(a child a launcher left RUNNING ends FAILED; the parent FAILED with the counts)."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from experiments.framework import launchers, report, sweep, tracking
from experiments.framework.job import job_key


def test_expand_is_the_cartesian_product_later_values_win():
    jobs = sweep.expand(OverridesParser.create(), {"seq": "64,128,256"}, ["seq=1,2", "backend=reference,triton", "x=3"])
    assert jobs == [["seq=1", "backend=reference", "x=3"], ["seq=1", "backend=triton", "x=3"],
                    ["seq=2", "backend=reference", "x=3"], ["seq=2", "backend=triton", "x=3"]]
    assert sweep.varied(jobs) == ["seq", "backend"]
    assert sweep.label(jobs[1], ["seq", "backend"]) == "seq=1 backend=triton"
    assert sweep.label(["seq=1", "x=3"], []) == "seq=1 x=3"  # nothing varies: all of it
    with pytest.raises(sweep.ConfigError, match="only lists of values sweep"):
        sweep.expand(OverridesParser.create(), {}, ["seq=interval(1,2)"])


def test_job_key_leaves_out_what_the_sweeper_adds():
    ov = ["seq=64", "tracking.uri=x", "++tracking.uri=sqlite:///a.db", "++tracking.parent_run_id=abc"]
    assert job_key(ov) == ["seq=64"]


def test_chart_metric_names_are_valid_mlflow_keys():
    assert report.metric_name("p50_ms", "nsa backend=triton") == "p50_ms/nsa backend:triton"
    assert report.metric_name("rel_l2_err", "grad_q [x]") == "rel_l2_err/grad_q _x_"


def test_a_label_past_mlflows_limit_ends_in_a_hash_and_is_stored(tmp_path):
    # a one-job sweep's chart label is all its overrides: MLflow refuses a key of more than 250 characters
    long = " ".join(f"train.option_{i}=value_{i}" for i in range(20))
    names = [report.metric_name("tokens_per_s", long + end) for end in ("", " seed=1")]
    assert len(long) > 300 and all(len(n) <= report.MLFLOW_KEY_MAX for n in names)
    assert names[0] != names[1] and names[0] == report.metric_name("tokens_per_s", long)
    store = tracking.connect(OmegaConf.create({"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}), "train", tmp_path)
    rid = tracking.start_run(store, "train sweep", None, {"sweep": "parent"})
    tracking.log_series(store.client, rid, [(names[0], 1.5, 10)])
    assert [m.value for m in store.client.get_metric_history(rid, names[0])] == [1.5]


def test_sweep_end_closes_what_the_launcher_left_running(tmp_path, capsys):
    store = tracking.connect(OmegaConf.create({"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}), "decode", tmp_path)
    jobs = [["seq=64"], ["seq=128"]]
    parent = tracking.start_run(store, "decode sweep", None, {"sweep": "parent"})
    done = tracking.start_run(store, "decode seq=64", parent, {"sweep_job": json.dumps(jobs[0])})
    tracking.end_run(store.client, done, "FINISHED")
    lost = tracking.start_run(store, "decode seq=128", parent, {"sweep_job": json.dumps(jobs[1])})  # killed elsewhere
    with pytest.raises(SystemExit) as e:
        sweep._finish(store, parent, "decode", jobs, ["seq"], tmp_path, time.perf_counter())
    assert e.value.code == 1
    c = store.client
    assert c.get_run(lost).info.status == "FAILED" and "without ending its run" in c.get_run(lost).data.tags["error"]
    assert c.get_run(done).info.status == "FINISHED"
    p = c.get_run(parent)
    assert p.info.status == "FAILED" and p.data.tags["error"].startswith("1 of 2 jobs failed: seq=128")
    out = capsys.readouterr().out
    assert "resume:  python -m experiments.decode" in out and f"hydra.sweeper.resume={parent}" in out
    assert (tmp_path / "summary.txt").read_text().splitlines()[2].split()[:3] == ["1", "128", "FAILED"]


def test_sweep_end_records_how_slurm_ended_a_job(tmp_path, capsys):
    """``ends`` (per job: SLURM job id and state, from the launch): a run its job ended KILLED on SLURM's
    SIGTERM, or left RUNNING, ends FAILED with SLURM's state; a job SLURM ended before it started is
    named in the parent's error."""
    store = tracking.connect(OmegaConf.create({"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}), "decode", tmp_path)
    jobs = [["seq=64"], ["seq=128"], ["seq=256"], ["seq=512"]]
    parent = tracking.start_run(store, "decode sweep", None, {"sweep": "parent"})
    kids = [tracking.start_run(store, f"decode {ov[0]}", parent, {"sweep_job": json.dumps(ov)}) for ov in jobs[:3]]
    tracking.end_run(store.client, kids[0], "FINISHED")
    tracking.end_run(store.client, kids[1], "KILLED", "interrupted by SIGTERM")  # its own handler, on scancel
    ends = {frozenset(ov): (f"7_{i}", s) for i, (ov, s) in enumerate(zip(jobs, (
        "COMPLETED", "CANCELLED by 0", "TIMEOUT", "CANCELLED by 0")))}
    with pytest.raises(SystemExit):
        sweep._finish(store, parent, "decode", jobs, ["seq"], tmp_path, time.perf_counter(), ends=ends)
    c = store.client
    assert c.get_run(kids[0]).info.status == "FINISHED"
    assert [c.get_run(k).info.status for k in kids[1:]] == ["FAILED", "FAILED"]
    assert c.get_run(kids[1]).data.tags["error"] == \
        "SLURM job 7_1 CANCELLED by 0: cancelled (scancel, or the cluster's administrator) (the job: interrupted by SIGTERM)"
    assert c.get_run(kids[2]).data.tags["error"].startswith("SLURM job 7_2 TIMEOUT: reached its time limit")
    error = c.get_run(parent).data.tags["error"]
    assert error.startswith("3 of 4 jobs failed: ") and "seq=512: not run (SLURM job 7_3 CANCELLED by 0" in error


def _run(start: int, end: int, host: str = "a", gpu: str | None = None):
    info = SimpleNamespace(start_time=start, end_time=end)
    tags = {"host": host, **({"cuda_visible_devices": gpu} if gpu is not None else {})}
    return SimpleNamespace(info=info, data=SimpleNamespace(tags=tags))


def test_placement_tells_jobs_that_shared_a_gpu_at_once():
    apart = [_run(0, 10, gpu="0"), _run(5, 15, gpu="1"), _run(10, 20, gpu="0"), _run(12, 30, host="b", gpu="1")]
    line, m = launchers.placement(apart, since_ms=0)
    assert m == {"jobs_at_once_max": 3, "job_run_time_sum_s": 0.048, "gpus_shared_at_once": 0}
    assert "GPUs a:0, a:1, b:1" in line and line.endswith("never two at once on one GPU")
    line, m = launchers.placement([*apart, _run(8, 9, gpu="1")], since_ms=0)
    assert m["gpus_shared_at_once"] == 1 and line.endswith("jobs ran at once on one GPU: a:1")
    line, m = launchers.placement([_run(0, 5), _run(5, 9), None], since_ms=0)  # one after another, no GPU
    assert m["jobs_at_once_max"] == 1 and "no pinned GPU" in line
    assert launchers.placement([_run(0, 5)], since_ms=6) == ("no job ran in this launch", {})  # an earlier launch's


def test_the_sweeps_view_is_one_run_per_line_named_and_coloured_by_it(tmp_path):
    """views.publish: each line (nsa, dense, layer, ...) a FINISHED run of <experiment>-lines named by its label,
    in colours that differ (MLflow's chart view colours and names lines by run), holding the line as metric <y>
    at step x; the view: one line chart per column over the search that finds exactly this sweep's line runs. A
    resumed sweep's second publish reuses the runs and logs only the points they lack."""
    from experiments.framework import views

    store = tracking.connect(OmegaConf.create({"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}), "decode", tmp_path)
    parent = tracking.start_run(store, "decode sweep", None, {"sweep": "parent"})
    other = tracking.start_run(store, "decode sweep", None, {"sweep": "parent"})
    data = {"p50_ms": {"cmp": [(256, 0.4)], "dense": [(256, 0.02), (512, 0.03)], "nsa": [(256, 1.0), (512, 1.1)],
                       "layer": [(256, 1.5)]},
            "speedup_vs_dense_x": {"nsa": [(256, 0.02)]}, "absent": {}}
    views.publish(store, other, {"p50_ms": {"nsa": [(256, 9.0)]}}, "seq_tokens")  # another sweep's line
    page = views.publish(store, parent, data, "seq_tokens")
    lines = store.client.get_experiment_by_name("nsa-decode-lines")
    assert page == views.link(lines.experiment_id, parent)
    assert lines.tags["mlflow.experimentKind"] == "custom_model_development"
    jobs = store.client.get_experiment_by_name("nsa-decode")
    assert lines.tags["mlflow.note.content"].startswith("The line runs of the sweeps in nsa-decode: one run per line")
    assert jobs.tags["mlflow.note.content"].startswith("Runs of python -m experiments.decode: one run per job")
    state = json.loads(lines.tags[f"mlflow.sharedViewState.{parent}"])
    runs = store.client.search_runs([lines.experiment_id], filter_string=state["searchFilter"],
                                    order_by=["attributes.start_time DESC"])
    assert [r.info.run_name for r in runs] == ["nsa", "dense", "layer", "cmp"]  # the table's order: newest first
    assert all(r.info.status == "FINISHED" and r.data.tags["sweep_parent"] == parent for r in runs)
    colours = [r.data.tags["mlflow.runColor"] for r in runs]
    assert colours[:2] == ["#1f77b4", "#ff7f0e"] and len(set(colours)) == 4  # nsa blue, dense orange, all differ
    nsa = runs[0].info.run_id
    assert [(m.step, m.value) for m in store.client.get_metric_history(nsa, "p50_ms")] == [(256, 1.0), (512, 1.1)]
    assert [c["metricKey"] for c in state["compareRunCharts"]] == ["p50_ms", "speedup_vs_dense_x"]
    assert all(c["type"] == "LINE" and c["selectedMetricKeys"] == [c["metricKey"]] and c["xAxisKey"] == "step"
               for c in state["compareRunCharts"])
    (section,) = state["compareRunSections"]
    assert all(c["metricSectionId"] == section["uuid"] for c in state["compareRunCharts"])
    assert state["runsHiddenMode"] == "SHOW_ALL"
    data["p50_ms"]["nsa"].append((1024, 1.3))  # resumed: one more point
    views.publish(store, parent, data, "seq_tokens")
    again = store.client.search_runs([lines.experiment_id], filter_string=state["searchFilter"])
    assert sorted(r.info.run_id for r in again) == sorted(r.info.run_id for r in runs)
    assert [m.step for m in store.client.get_metric_history(nsa, "p50_ms")] == [256, 512, 1024]
    assert views.publish(store, parent, {"p50_ms": {}}, "seq_tokens") is None  # no line: no view
    assert views.link("3", "k") == "#/experiments/3/runs?viewStateShareKey=k&workflowType=machine_learning&compareRunsMode=CHART"
