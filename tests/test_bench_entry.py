"""scripts/bench.sh, the one entry to BENCHMARKS.md's GPU figures, checked on the CPU: its step list, its
argument errors (one line, exit 2, nothing run), every step's commands (``--print``) accepted by the entry
points' own argument check, every step that BENCHMARKS.md and docs/ cite; BENCHMARKS.md's first page
(each current figure with its command, card and date); and no file that points outside the repository."""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess

import pytest
from entrypoints import REPO

from experiments.framework import cli

BENCH = ["bash", "scripts/bench.sh"]
SLURM_PLUGIN = "hydra_plugins.hydra_submitit_launcher"


def bench(*args: str, out=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out)} if out else None
    return subprocess.run([*BENCH, *args], cwd=REPO, capture_output=True, text=True, timeout=60, env=env)


def steps() -> list[str]:
    r = bench("--list")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    return [ln.split()[0] for ln in r.stdout.splitlines()]


def test_list_names_each_step_once_with_a_description():
    r = bench("--list")
    names = steps()
    assert len(names) == len(set(names)) >= 30
    assert {"decode-card", "prefill-layer", "sel-layer", "cmp-layer", "train-shapes", "validate", "cp-prefill"} <= set(names)
    assert all(len(ln.split()) > 3 for ln in r.stdout.splitlines())  # a name and what it runs
    h = bench("--help")
    assert h.returncode == 0 and "bash scripts/bench.sh --list" in h.stdout and "set -u" not in h.stdout


@pytest.mark.parametrize("args,says", [
    (["decode-crad"], "unknown step 'decode-crad'"),
    (["prefill", "nope"], "unknown step 'nope'"),  # checked before the first step runs
    (["decode.card"], "unknown step 'decode.card'"),  # a name, not a pattern
    ([], "no step given"),
    (["--print", "nope"], "unknown step 'nope'"),
])
def test_a_bad_step_is_one_line_and_exit_2_before_anything_runs(args, says, tmp_path):
    r = bench(*args, out=tmp_path / "out")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and says in lines[0], r.stderr
    assert r.stdout == "" and not (tmp_path / "out").exists()  # no wheelhouse install, no output folder
    if "unknown" in says:
        assert "decode-card" in lines[0] and "--list" in lines[0]  # the steps there are


def _entry_commands(text: str) -> list[tuple[str, list[str]]]:
    """(entry, arguments) of every ``... -m experiments.<entry> ...`` line (python3 or torchrun)."""
    cmds = []
    for line in text.splitlines():
        words = shlex.split(line)
        for i, w in enumerate(words[:-1]):
            if w == "-m" and words[i + 1].startswith("experiments."):
                cmds.append((words[i + 1].split(".", 1)[1], words[i + 2:]))
                break
    return cmds


@pytest.mark.parametrize("step", steps())
def test_every_step_prints_commands_the_entry_points_accept(step, tmp_path, monkeypatch):
    env_out = tmp_path / "out"
    r = bench("--print", step, out=env_out)
    assert r.returncode == 0 and "unbound variable" not in r.stderr, r.stderr
    printed = [ln for ln in r.stdout.splitlines() if not ln.startswith("== step")]
    assert printed, r.stdout
    monkeypatch.chdir(tmp_path)
    unchecked = []
    for entry, args in _entry_commands(r.stdout):
        if any(a.startswith("hydra/launcher=") for a in args) and importlib.util.find_spec(SLURM_PLUGIN) is None:
            unchecked.append(" ".join(args))  # its launcher's configs come with the cluster extra
            continue
        try:
            cli.precheck(args, entry)
        except SystemExit as e:
            pytest.fail(f"{step}: experiments.{entry} {' '.join(args)}: exit {e.code}")
    if unchecked:
        pytest.skip(f"the cluster extra (pip install -e '.[cluster]') checks: {unchecked}")


def _cited_steps(text: str) -> list[list[str]]:
    """The steps of every ``bash scripts/bench.sh <step>...`` a text cites (a citation may wrap a line)."""
    found = re.findall(r"bash scripts/bench\.sh((?:\s+[a-z][a-z0-9-]*)+)", text)
    return [c.split() for c in found]


def test_every_cited_step_exists():
    known = set(steps())
    texts = {p: p.read_text() for p in [REPO / "BENCHMARKS.md", REPO / "README.md", *(REPO / "docs").glob("*.md")]}
    cited = {p.name: _cited_steps(t) for p, t in texts.items()}
    assert sum(map(len, cited.values())) >= 30  # BENCHMARKS.md cites its steps
    for name, citations in cited.items():
        for c in citations:
            assert set(c) <= known, (name, c)


def test_benchmarks_opens_with_current_figures_each_with_command_card_and_date():
    text = (REPO / "BENCHMARKS.md").read_text()
    front, journal = text.split("\n# Journal\n", 1)
    assert len(front.splitlines()) <= 80 and "## Current figures" in front  # one page, then the journal
    figures = front.split("## Current figures", 1)[1]
    blocks = re.split(r"\n\n(?=\*\*)", figures.strip())
    assert len(blocks) >= 6
    for b in blocks:
        head = b.split("\n|", 1)[0]  # the paragraph before a block's table
        assert "bash scripts/bench.sh" in head, head
        assert re.search(r"\bH[12]00", head) and re.search(r"\b2026-\d\d-\d\d\b", head), head
    assert journal.count("\n## ") >= 20  # the dated sessions, below


def _tracked(*patterns: str) -> list:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / p for p in out.split()]


def test_no_file_points_outside_the_repository():
    outside = re.compile("|".join([re.escape(".." + "/shared"), re.escape("/" + "work/")]))
    texts = [p for p in _tracked() if p.is_file() and p.suffix in (".md", ".py", ".sh", ".yaml", ".toml", "")]
    hits = [f"{p.relative_to(REPO)}:{i}" for p in texts
            for i, ln in enumerate(p.read_text(errors="replace").splitlines(), 1) if outside.search(ln)]
    assert hits == []
    for md in _tracked("*.md"):  # relative links resolve to a file of the repository
        for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", md.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            path = (md.parent / target).resolve()
            assert path.is_relative_to(REPO) and path.exists(), (md.name, target)


def test_every_script_the_docs_name_exists():
    """The README and docs/ name only scripts that exist; BENCHMARKS.md's shell commands too (its journal
    also keeps the Python scripts that earlier sessions ran, each beside the command that replaced it)."""
    for md in _tracked("*.md"):
        kinds = "sh" if md.name == "BENCHMARKS.md" else "sh|py"
        for name in set(re.findall(rf"\bscripts/([\w.-]+\.(?:{kinds}))\b", md.read_text())):
            assert (REPO / "scripts" / name).is_file(), (md.name, name)
