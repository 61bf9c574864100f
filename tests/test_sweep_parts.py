"""The sweep's parts in-process: expansion, what tells jobs apart, and its end read from the store
(a child a launcher left RUNNING ends FAILED; the parent FAILED with the counts)."""
from __future__ import annotations

import json
import time

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from experiments.framework import report, sweep, tracking
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
