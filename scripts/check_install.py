"""The README's pip install lines resolve on a stock machine: pip with no config file and no local wheels.

    python scripts/check_install.py [--cpu-wheels DIR]

Every ``pip install`` in the README's bash blocks is resolved with ``pip install --dry-run --report``
(nothing is installed), except the wheelhouse install (``--no-index``, offline by design):

* a line that pins torch starts from nothing (``--ignore-installed``), as in a fresh virtualenv; the
  torch/triton pair it resolves must be one of ``nsa.toolchain.SUPPORTED_PAIRS``; a line that takes
  PyTorch's CPU wheel index must resolve torch's CPU build and no ``nvidia-*`` package;
* any other line (an extra) is resolved on top of the running environment, where the Quickstart's
  install is, and must leave torch and triton as they are.

The resolution runs under an empty pip configuration (``PIP_CONFIG_FILE`` = os.devnull) and without the
variables that add indexes, wheel folders or constraints, so a machine's own wheel folder cannot make a
line resolve that would not resolve for users. Where PyTorch's CPU index cannot be reached (a machine
that reaches PyPI only), ``--cpu-wheels DIR`` stands in for it: a folder with the same torch ``+cpu``
wheel the index serves, given to pip as ``--find-links``; the script says so when it does.
Exit 0 when every line resolves as required, 1 otherwise (with pip's last lines).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from nsa.toolchain import supported_ids, toolchain_id

ROOT = Path(__file__).resolve().parents[1]

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Variables through which a machine's pip config adds indexes, wheel folders or constraints.
LOCAL_PIP_VARS = ("PIP_CONFIG_FILE", "PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX",
                  "PIP_CONSTRAINT", "PIP_REQUIREMENT", "PIP_PRE", "PIP_ONLY_BINARY", "PIP_NO_BINARY")


@dataclass(frozen=True)
class InstallLine:
    line: str        # the README's command line, as written
    args: list[str]  # what follows `pip install` in it

    @property
    def fresh(self) -> bool:
        """A line that pins torch sets up a new environment; others add to the Quickstart's."""
        return any(a.startswith("torch==") for a in self.args)

    @property
    def cpu_index(self) -> bool:
        return CPU_INDEX in self.args


def documented_text() -> str:
    """The README, then every page of docs/ (sorted): where a user copies install lines from."""
    return "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def readme_install_lines(readme: str) -> list[InstallLine]:
    """Every `pip install` of the README's bash blocks (one per `&&`-separated command), but --no-index."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", readme, re.S):
        for line in block.splitlines():
            line = line.split(" #", 1)[0].strip()
            for command in line.split("&&"):
                if "pip install" not in command:
                    continue
                words = shlex.split(command)
                if "pip" in words and words[words.index("pip") + 1: words.index("pip") + 2] == ["install"]:
                    args = words[words.index("pip") + 2:]
                    if "--no-index" not in args:
                        found.append(InstallLine(line, args))
    return found


def check_report(report: dict, line: InstallLine) -> list[str]:
    """What is wrong with a dry-run's resolution of `line` (an empty list: nothing)."""
    versions = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}
    problems = []
    if line.fresh:
        torch, triton = versions.get("torch"), versions.get("triton")
        if torch is None:
            return ["torch is not in the resolution"]
        ident = toolchain_id(torch, triton)
        if ident not in supported_ids():
            problems.append(f"torch {torch} with triton {triton} ({ident}) is not a supported pair: {', '.join(supported_ids())}")
        if line.cpu_index:
            cuda = sorted(n for n in versions if n.startswith("nvidia-"))
            if not torch.endswith("+cpu"):
                problems.append(f"torch {torch} is not the CPU build")
            if cuda:
                problems.append(f"CUDA wheels in a CPU-only install: {', '.join(cuda)}")
    else:
        moved = [f"{n} {versions[n]}" for n in ("torch", "triton") if n in versions]
        if moved:
            problems.append(f"would replace the Quickstart's {' and '.join(moved)}")
    return problems


def stock_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LOCAL_PIP_VARS}
    env["PIP_CONFIG_FILE"] = os.devnull  # pip reads no config file at all
    return env


def reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=10):
            return True
    except OSError:
        return False


def dry_run(line: InstallLine, cpu_wheels: str | None) -> tuple[list[str], str]:
    """(problems, a one-line summary) of resolving `line` with pip's dry run under a stock configuration."""
    args, note = list(line.args), ""
    if line.cpu_index and not reachable(CPU_INDEX):
        if not cpu_wheels or not list(Path(cpu_wheels).glob("torch-*+cpu-*.whl")):
            return [f"{CPU_INDEX} is unreachable and --cpu-wheels gives no torch +cpu wheel to stand in for it"], ""
        i = args.index(CPU_INDEX)
        args[i - 1: i + 1] = ["--find-links", cpu_wheels]
        note = f" [{CPU_INDEX} unreachable here: its torch +cpu wheel from {cpu_wheels}]"
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report_path), *args]
        if line.fresh:
            cmd.insert(5, "--ignore-installed")
        r = subprocess.run(cmd, cwd=ROOT, env=stock_env(), capture_output=True, text=True)
        if r.returncode != 0:
            tail = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()][-8:]
            return ["pip could not resolve it:", *tail], note
        report = json.loads(report_path.read_text())
    versions = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}
    cuda = sum(n.startswith("nvidia-") for n in versions)
    pair = f"torch {versions.get('torch', '(kept)')}, triton {versions.get('triton', '(kept)')}"
    return check_report(report, line), f"{pair}; {len(versions)} packages, {cuda} nvidia-*{note}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-wheels", help=f"a folder with torch's +cpu wheel, for where {CPU_INDEX} is unreachable")
    ap.add_argument("--readme", help="one Markdown file to read instead of the README and docs/*.md")
    args = ap.parse_args(argv)
    lines = readme_install_lines(Path(args.readme).read_text() if args.readme else documented_text())
    if not lines:
        print("check_install: no pip install line in the README or docs/", file=sys.stderr)
        return 1
    failed = 0
    # The dry runs wait mostly on the index: all at once, reported in the documents' order.
    with ThreadPoolExecutor(len(lines)) as pool:
        results = list(pool.map(lambda ln: dry_run(ln, args.cpu_wheels), lines))
    for line, (problems, summary) in zip(lines, results):
        where = "fresh venv" if line.fresh else "on top of the Quickstart"
        if problems:
            failed += 1
            print(f"check_install: FAIL ({where}) {line.line}", file=sys.stderr)
            for p in problems:
                print(f"    {p}", file=sys.stderr)
        else:
            print(f"check_install: ok ({where}) {line.line}\n    -> {summary}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
