"""One row per training run of a folder of MLflow stores (`bash scripts/bench.sh train-jobs` writes one SQLite store per
run, <name>.db): the run's name, status, attention, seed, its held-out accuracy curve and final figures.

    python scripts/train_summary.py <folder> [--csv out.csv]
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

FINAL = ("val_accuracy", "val_loss", "sel_recall_answers", "sel_recall", "gate_cmp_answers", "gate_sel_answers",
         "gate_win_answers", "gate_cmp", "gate_sel", "gate_win", "sel_loss")


def rows(folder: Path) -> list[dict]:
    from mlflow.tracking import MlflowClient

    out = []
    for db in sorted(folder.glob("*.db")):
        client = MlflowClient(tracking_uri=f"sqlite:///{db}")
        for exp in client.search_experiments():
            for run in client.search_runs([exp.experiment_id]):
                if run.data.tags.get("mlflow.parentRunId") is None and run.data.params.get("attention.kind") is None:
                    continue  # a sweep's parent
                curve = sorted(client.get_metric_history(run.info.run_id, "val_accuracy"), key=lambda m: m.step)
                r = {"name": db.stem, "status": run.info.status,
                     "attention": run.data.params.get("attention.kind", ""), "seed": run.data.params.get("seed", ""),
                     "seconds": round(((run.info.end_time or run.info.start_time) - run.info.start_time) / 1000),
                     "val_accuracy_curve": " ".join(f"{m.value:.2f}" for m in curve)}
                for k in FINAL:
                    v = run.data.metrics.get(k)
                    r[k] = "" if v is None else round(v, 4)
                out.append(r)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--csv", type=Path)
    a = ap.parse_args(argv)
    if not a.folder.is_dir():
        print(f"folder: {a.folder} is not a directory", file=sys.stderr)
        return 2
    rs = rows(a.folder)
    cols = ["name", "status", "attention", "seed", "seconds", "val_accuracy", "sel_recall_answers",
            "gate_cmp_answers", "gate_sel_answers", "gate_win_answers", "val_accuracy_curve"]
    print(" | ".join(cols))
    for r in rs:
        print(" | ".join(str(r[c]) for c in cols))
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rs[0]) if rs else cols)
            w.writeheader()
            w.writerows(rs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
