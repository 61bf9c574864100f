"""The sweep's chart view in a real browser: MLflow's UI, rendered by headless Chromium, names NSA's and
dense's lines and draws them in two colours (experiments/framework/views.py).

The store is the README's decode sweep (``hardware=cpu -m seq=256,512``), run as written; the pages are
taken by scripts/ui_screenshots.py as a user runs it. Needs Debian's ``chromium`` (``apt-get install -y
chromium``; .ci/run installs it after SLURM's packages); skipped, saying so, where it is absent.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter

import entrypoints
import pytest
from entrypoints import REPO
from PIL import Image

CHROMIUM = shutil.which("chromium")
# MLflow 3.17's line chart card: a line's legend entry is its swatch (an SVG path stroked in the line's colour),
# then its name, "<run name> (<metric>)"; the line itself is Plotly's path of class js-line, stroked alike.
LEGEND = r'stroke: (rgb\(\d+, \d+, \d+\))[^<]*</path></svg><span[^>]*>([^<]+)</span>'
LINE = r'class="js-line"[^>]*stroke: (rgb\(\d+, \d+, \d+\))'


def _pixels(png, rgb: str, tol: int = 2) -> int:
    """Pixels of ``png`` within ``tol`` of colour ``rgb`` ("rgb(r, g, b)") right of its first third (the
    runs list, where each run's colour dot is)."""
    want = [int(v) for v in rgb[4:-1].split(",")]
    im = Image.open(png).convert("RGB")
    data = im.crop((im.width // 3, 0, im.width, im.height)).tobytes()
    seen = Counter(zip(data[0::3], data[1::3], data[2::3]))
    return sum(n for c, n in seen.items() if max(abs(a - b) for a, b in zip(c, want)) <= tol)


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install -y chromium)")
def test_the_sweeps_view_names_nsa_and_dense_in_two_colours(tmp_path):
    sweep = subprocess.run([sys.executable, "-m", "experiments.decode", "hardware=cpu", "-m", "seq=256,512"],
                           cwd=tmp_path, env=entrypoints.env(), capture_output=True, text=True, timeout=600)
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    shots = subprocess.run([sys.executable, str(REPO / "scripts" / "ui_screenshots.py"), "--store",
                            f"sqlite:///{tmp_path / 'mlflow.db'}", "--out", str(tmp_path / "shots"), "--pages", "sweep_view"],
                           cwd=tmp_path, env=entrypoints.env(), capture_output=True, text=True, timeout=600)
    assert shots.returncode == 0, shots.stdout[-2000:] + shots.stderr[-2000:]
    png = tmp_path / "shots" / "sweep_view.png"
    dom = png.with_suffix(".html").read_text()
    legend = re.findall(LEGEND, dom)
    p50 = {name.removesuffix(" (p50_ms)"): rgb for rgb, name in legend if name.endswith(" (p50_ms)")}
    assert {"nsa", "dense"} <= set(p50) and p50["nsa"] != p50["dense"], legend[:12]  # named, told apart
    assert {p50["nsa"], p50["dense"]} <= set(re.findall(LINE, dom))  # the lines drawn in their legend's colours
    on_screen = {k: _pixels(png, p50[k]) for k in ("nsa", "dense")}  # lines and legend swatches, as painted
    assert min(on_screen.values()) >= 100, on_screen
