"""Tables and charts: a job's CSV, the sweep's CSV, its charts (images and stepped metrics), the summary.

An entry point names its charts (:class:`Charts`: the x column, the column that tells lines apart,
one panel per y column; or, ``kind="by_step"``, curves of metrics its runs logged step by step). Each
job records them on its run (tag ``charts``), so the sweep draws them from the store's child runs
whichever launcher ran the jobs.
"""
from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Charts:
    x: str                  # CSV column on the x axis (log2), e.g. seq_tokens; its values are the metrics' steps
    series: str             # CSV column that tells lines apart, e.g. variant
    ys: tuple[str, ...]     # one panel (and one metric per line) per column, e.g. ("p50_ms", "speedup_vs_dense_x")
    # "rows": points from the jobs' CSV rows (log-log); "by_step": each job's metric history of each y,
    # x being the step (linear axes), one line per job (x and series unused)
    kind: str = "rows"

    def to_tag(self) -> str:
        return json.dumps({"x": self.x, "series": self.series, "ys": list(self.ys), "kind": self.kind})

    @staticmethod
    def from_tag(text: str) -> Charts:
        d = json.loads(text)
        return Charts(d["x"], d["series"], tuple(d["ys"]), d.get("kind", "rows"))


@contextlib.contextmanager
def replacing(path: Path, tmp: Path):
    """Write ``tmp`` in the block, then rename it over ``path``: the file is complete or as it was. A
    failure (a full disk) removes ``tmp``; an OS error that names no file names ``path``."""
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError) and e.errno and not e.filename:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def write_csv(path: Path, rows: list[dict]) -> None:
    """Write rows atomically (temporary file, then rename): a CSV is complete or absent."""
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    with replacing(path, path.with_suffix(path.suffix + ".tmp")) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)


def write_text(path: Path, text: str) -> None:
    """Write text atomically, as :func:`write_csv`."""
    with replacing(path, path.with_suffix(path.suffix + ".tmp")) as tmp:
        tmp.write_text(text)


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _number(v) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def lines(rows: list[dict], charts: Charts) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """y column -> line label -> sorted (x, y) points. A row's label is its series value, plus its
    ``_series`` entry (what else differs between the sweep's jobs) where there is one."""
    out: dict[str, dict[str, list]] = {y: {} for y in charts.ys}
    for r in rows:
        x = _number(r.get(charts.x))
        label = " ".join(s for s in (str(r.get(charts.series, "")), r.get("_series", "")) if s)
        for y in charts.ys:
            v = _number(r.get(y))
            if x is not None and v is not None:
                out[y].setdefault(label, []).append((int(x), v))
    return {y: {k: sorted(p) for k, p in ls.items()} for y, ls in out.items()}


MLFLOW_KEY_MAX = 250  # characters of a metric's name in MLflow's store


def shortened(name: str, limit: int) -> str:
    """``name`` if it fits in ``limit`` bytes, else its first bytes and a hash of the whole: the same
    name gives the same result, different names different ones."""
    if len(name.encode()) <= limit:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:12]
    return name.encode()[: limit - 64].decode(errors="ignore") + "_" + digest


def metric_name(y: str, label: str) -> str:
    """MLflow metric key for one line of a chart: ``<y>/<label>`` (a section per y in MLflow's charts); a
    label past MLflow's length limit (a one-job sweep's label is all its overrides) ends in a hash."""
    return shortened(f"{y}/" + re.sub(r"[^/\w.\- :]", "_", label.replace("=", ":")), MLFLOW_KEY_MAX)


MARKERS = "os^Dv<>PX*"
# matplotlib's default colours C0-C9: a sweep over seq alone colours a variant alike in its PNG and its MLflow view
TAB10 = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def _natural(label: str) -> list:
    """Sort key: digit runs as numbers ("n_kv_heads=4" before "n_kv_heads=16")."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", label)]


FIRST = ("nsa", "dense", "layer")  # the lines a reader compares first: listed first, the first colours


def line_order(labels) -> list[str]:
    """Lines' labels, those whose first word is nsa, dense, layer first, then the others in natural order."""
    def key(label: str) -> tuple:
        head = label.split(" ", 1)[0]
        return (FIRST.index(head) if head in FIRST else len(FIRST), _natural(label))

    return sorted(set(labels), key=key)


def colors(names) -> dict[str, str]:
    """A colour per name (a line's label or variant), TAB10's in :func:`line_order` (nsa blue, dense orange)."""
    return {n: TAB10[i % len(TAB10)] for i, n in enumerate(line_order(names))}


def plot(data: dict[str, dict[str, list[tuple[int, float]]]], x: str, path: Path, title: str, log: bool = True) -> None:
    """One panel per y (three per row), one line per label, log-log or (``log=False``: curves over
    steps) linear, marked where a line has few points; dense baselines dashed; written atomically."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    many = max((len(ls) for ls in data.values()), default=0) > 12  # legend beside the panel, not on it
    cols = min(3, len(data))
    rows = -(-len(data) // cols)
    fig = Figure(figsize=((9.5 if many else 6.5) * cols, (6 if many else 4.5) * rows))
    FigureCanvasAgg(fig)
    # A label is "<series> <what else varies>" (lines()): one colour per series (e.g. variant), one marker
    # per value of the rest (e.g. model.nsa.n_kv_heads=4), in natural order (4 before 16).
    labels = sorted({lab for ls in data.values() for lab in ls}, key=_natural)
    series = list(dict.fromkeys(lab.split(" ", 1)[0] for lab in labels))
    rest = list(dict.fromkeys(lab.partition(" ")[2] for lab in labels))
    palette = colors(series)
    for i, (y, ls) in enumerate(data.items(), 1):
        ax = fig.add_subplot(rows, cols, i)
        for label in sorted(ls, key=_natural):
            pts, (first, _, other) = ls[label], label.partition(" ")
            marker = MARKERS[rest.index(other) % len(MARKERS)] if log or len(pts) <= 20 else None
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "--" if label.startswith("dense") else "-",
                    color=palette[first], marker=marker, label=label)
        if log:
            ax.set_xscale("log", base=2)
        if log and all(p[1] > 0 for pts in ls.values() for p in pts):
            ax.set_yscale("log")
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.set_title(f"{title}: {y} vs {x}")
        ax.grid(True, which="both", alpha=0.3)
        if ls:
            ax.legend(fontsize=7, **({"loc": "upper left", "bbox_to_anchor": (1.01, 1.0)} if many else {}))
    fig.tight_layout()
    with replacing(path, path.with_name(path.stem + ".tmp.png")) as tmp:
        fig.savefig(tmp, dpi=110)


def table(header: list[str], rows: list[list[str]]) -> str:
    """A plain fixed-width text table."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows])


def fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
