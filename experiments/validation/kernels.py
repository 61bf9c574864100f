"""Check ``kernels``: the kernel tests, in pytest, in a subprocess of their own.

On a GPU: ``pytest -m gpu tests/test_*_gpu.py`` without ``TRITON_INTERPRET``: the kernels compiled on
this device (tests/test_kernels_gpu.py: each branch and the whole layer, every backend that runs
here, against the reference; tests/test_varlen_gpu.py: packed documents; tests/test_decode_gpu.py: the decode
step's kernels from CUDA graphs, with and without programmatic dependent launch). On a CPU: the interpreter's
twin (tests/test_kernels_interpret.py) under ``TRITON_INTERPRET=1``, which the report says plainly is
not the compiled check. ``validate.inject_fault`` is passed on as ``--inject-fault``.

pytest writes junit XML (``-o junit_family=xunit1``, so that each test carries its properties) and
the plugin ``experiments.validation.pytest_plugin`` the deselected tests. Counted per kernel (the
tests' ``kernel`` marker): passed, failed (failures and errors), skipped, unavailable (a skip whose
reason is the backend's own unavailability on this device, ``tests/conftest.py:skip_unavailable``),
deselected. The check passes when at least one test passed and none failed or was skipped; tests
unavailable here are named and counted as not passed, without failing the check.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from .. import env as launch_env

from .. import progress
from ..framework.config import REPO
from .core import Check, Context
from .report import Code, Items, Table

UNAVAILABLE = "unavailable here: "  # tests/conftest.py:UNAVAILABLE
OUTCOMES = ("passed", "failed", "skipped", "unavailable")


def command(ctx: Context, files: list[str], xml: Path, meta: Path) -> list[str]:
    k = ctx.size.kernels
    return [sys.executable, "-m", "pytest", "-q", "-p", "experiments.validation.pytest_plugin", "-p", "no:cacheprovider",
            f"--junitxml={xml}", "-o", "junit_family=xunit1", f"--validate-json={meta}",
            f"--validate-progress={meta.with_name('progress.txt')}",
            *(["-m", k.marker] if k.marker else []), *(["-k", k.select] if k.get("select") else []),
            *([f"--inject-fault={ctx.fault}"] if ctx.fault else []), *xdist(workers(ctx)), *files]


def workers(ctx: Context) -> int:
    """pytest processes: ``validate.sizes.<size>.kernels.workers`` where pytest-xdist is installed (the
    ``dev`` extra), else 1."""
    n = int(ctx.size.kernels.get("workers") or 1)
    return n if n > 1 and importlib.util.find_spec("xdist") is not None else 1


def xdist(n: int) -> list[str]:
    """pytest-xdist's options for ``n`` processes (compiling the kernels is most of a GPU run's time, one
    CPU core per compile; the tests that hold the most GPU memory share one worker: tests/kernel_cases.py
    BIG); none for 1."""
    return ["-n", str(n), "--dist", "loadgroup"] if n > 1 else []


def follow(p: subprocess.Popen, done: Path, timeout_s: float) -> int | None:
    """Wait for pytest (killed past ``timeout_s``: None), its tests' progress on a bar (the plugin's
    ``--validate-progress`` file: the count, then a line a test; quiet where stderr is no terminal)."""
    t0 = time.monotonic()
    with progress.bar(0, "[validate] kernel tests", "test") as shown:
        while True:
            try:
                rc = p.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                rc = None
            lines = done.read_text().splitlines() if done.exists() else []
            total = next((int(ln.split()[1]) for ln in lines if ln.startswith("total ")), 0)
            if total and shown.total != total:
                shown.reset(total)
            shown.update(sum(ln == "done" for ln in lines) - shown.n)
            if rc is not None:
                return rc
            if time.monotonic() - t0 > timeout_s:
                p.kill()
                p.wait()
                return None


def parse(xml: Path) -> list[dict]:
    """One dict per test case of a junit XML (xunit1): nodeid, kernel, outcome, message, seconds."""
    out = []
    for tc in ET.parse(xml).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in tc.iter("property")}
        nodeid = props.get("nodeid") or f"{tc.get('classname')}::{tc.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                message = (el.get("message") or el.text or "").strip()  # a skip's message: its reason
                outcome = "failed" if tag != "skipped" else "skipped"
                if tag == "skipped" and message.startswith(UNAVAILABLE):
                    outcome, message = "unavailable", message[len(UNAVAILABLE):]
                break
        out.append({"test": nodeid, "kernel": props.get("kernel", "?"), "outcome": outcome,
                    "message": " ".join(message.split())[:600], "seconds": float(tc.get("time") or 0.0),
                    "peak_gib": float(props["peak_gib"]) if props.get("peak_gib") else None})
    return out


def run(ctx: Context) -> Check:
    c, k = Check("kernels"), ctx.size.kernels
    files = sorted({str(p.relative_to(REPO)) for pat in k.tests for p in REPO.glob(pat)})
    where = ("Triton's interpreter on the CPU (float32, tiny shapes): NOT the kernels compiled on a device; "
             "run experiments.validate on a GPU for that" if k.interpreter else
             "compiled on this device, bfloat16 against the float32 reference")
    c.notes.append(f"pytest {' '.join(files)}: {where}")
    if int(k.get("workers") or 1) > 1 and workers(ctx) == 1:
        c.notes.append(f"pytest-xdist is not installed (pip install -e '.[dev]'): one pytest process, not "
                       f"validate.sizes.{ctx.size_name}.kernels.workers={k.workers}")
    if not files:
        c.fail(f"no test module matches {list(k.tests)}")
        return c
    out = ctx.path("kernels")
    out.mkdir(exist_ok=True)
    xml, meta, log = out / "junit.xml", out / "deselected.json", out / "pytest.log"
    for p in (xml, meta):
        p.unlink(missing_ok=True)
    cmd = command(ctx, files, xml, meta)
    c.blocks.append(Code(" ".join(cmd[1:]).replace(str(out) + "/", "<run>/kernels/")))
    done = out / "progress.txt"
    done.unlink(missing_ok=True)
    with open(log, "w") as f:
        child = launch_env.child_environment(triton_interpret=bool(k.interpreter), pythonpath=str(REPO))
        p = subprocess.Popen(cmd, cwd=REPO, env=child, stdout=f, stderr=subprocess.STDOUT)
        rc = follow(p, done, float(k.timeout_s))
    c.files += [p for p in (xml, meta, log) if p.exists()]
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
    if rc is None:
        c.fail(f"pytest did not finish in validate.sizes.{ctx.size_name}.kernels.timeout_s={k.timeout_s} s")
    if not xml.exists():
        c.fail(f"pytest wrote no results (exit code {rc})")
        c.blocks.append(Code(tail))
        return c
    cases = parse(xml)
    deselected = json.loads(meta.read_text())["deselected"] if meta.exists() else []
    c.rows = cases
    by = {}
    for t in cases:
        by.setdefault(t["kernel"], Counter())[t["outcome"]] += 1
    n = Counter(t["outcome"] for t in cases)
    c.metrics = {f"tests_{o}": float(n[o]) for o in OUTCOMES} | {"tests_deselected": float(len(deselected))}
    peaks = [t["peak_gib"] for t in cases if t["peak_gib"] is not None]
    if peaks:
        c.metrics["peak_gib_max"] = max(peaks)
    c.figures = (f"{n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped, {n['unavailable']} unavailable "
                 f"here, {len(deselected)} deselected" + (" (interpreter, CPU)" if k.interpreter else " (compiled)")
                 + (f"; the largest test held {max(peaks):.1f} GiB of GPU memory" if peaks else ""))
    for kernel, cnt in sorted(by.items()):
        if cnt["failed"]:
            c.fail(f"{kernel}: {cnt['failed']} of {sum(cnt.values())} tests failed")
        if cnt["skipped"]:
            c.fail(f"{kernel}: {cnt['skipped']} of {sum(cnt.values())} tests skipped")
    c.require(n["passed"] > 0, "no test passed")
    if rc not in (0, 1, None) and not n["failed"]:
        c.fail(f"pytest exited with code {rc}")
    c.not_passed += [f"{t['test']} unavailable here: {t['message']}" for t in cases if t["outcome"] == "unavailable"]
    c.blocks.append(Table(["kernel", *OUTCOMES], [[kn, *(str(cnt[o]) for o in OUTCOMES)] for kn, cnt in sorted(by.items())]))
    c.blocks.append(Items("Failed:", [f"{t['test']}: {t['message']}" for t in cases if t["outcome"] == "failed"]))
    c.blocks.append(Items("Skipped (not passed):", [f"{t['test']}: {t['message']}" for t in cases if t["outcome"] == "skipped"]))
    c.blocks.append(Items("Unavailable on this device (not passed):",
                          [f"{t['test']}: {t['message']}" for t in cases if t["outcome"] == "unavailable"]))
    c.blocks.append(Items(f"Deselected ({len(deselected)}):", deselected, collapsed=True))
    c.blocks.append(Table(["test", "kernel", "outcome", "seconds", "peak GPU GiB"],
                          [[t["test"], t["kernel"], t["outcome"], f"{t['seconds']:.2f}",
                            "" if t["peak_gib"] is None else f"{t['peak_gib']:.2f}"] for t in cases],
                          collapsed=f"Every test ({len(cases)}):"))
    if c.reasons:
        c.blocks.append(Code(tail))
    return c
