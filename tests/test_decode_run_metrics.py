"""A single experiments.decode run (not a sweep) logs what each variant's step reads and its HBM floor as
metrics on its own run, the values of its CSV rows (not only on the sweep's parent charts)."""
from __future__ import annotations

import csv

from entrypoints import runs, start, wait

from experiments.decode import READ_METRICS

ARGS = ("hardware=cpu", "seq=256", "model.timing.warmup=1", "model.timing.repeats=2")


def test_a_single_decode_run_logs_tokens_read_and_the_hbm_floor(tmp_path):
    rc, out, err = wait(start(tmp_path, "decode", *ARGS), timeout=600)
    assert rc == 0, err[-3000:]
    c, (run,) = runs(tmp_path / "mlflow.db", "decode")
    m = run.data.metrics
    with open(tmp_path / "out" / "x" / "decode.csv") as f:
        rows = list(csv.DictReader(f))
    variants = [r["variant"] for r in rows]
    assert {"layer", "nsa", "cmp", "sel", "win", "dense"} <= set(variants)
    for r in rows:
        for k in READ_METRICS:
            assert m[f"{k}/{r['variant']}"] == float(r[k]), (k, r["variant"])
    bw = float(run.data.params["hardware.peak_hbm_gbps"])
    for v in variants:  # the floor is the bytes at the profile's bandwidth, and dense reads every key
        assert m[f"hbm_floor_ms/{v}"] == m[f"kv_bytes_read_per_step/{v}"] / (bw * 1e9) * 1e3 > 0
    assert m["kv_tokens_read_per_step_per_group/dense"] == 256
    assert 0 < m["kv_tokens_read_per_step_per_group/nsa"] < 256
    assert m["0_nsa_hbm_floor_ms"] == m["hbm_floor_ms/nsa"]
    assert m["0_nsa_kv_tokens_read_per_step_per_group"] == m["kv_tokens_read_per_step_per_group/nsa"]
