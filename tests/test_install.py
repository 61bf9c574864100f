"""scripts/check_install.py: which README lines it resolves, how, and what it refuses (no network here;
CI runs the script itself against the index)."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("check_install", ROOT / "scripts" / "check_install.py")
check_install = sys.modules["check_install"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(check_install)


def _report(**versions: str) -> dict:
    return {"install": [{"metadata": {"name": n.replace("_", "-"), "version": v}} for n, v in versions.items()]}


def test_finds_the_readme_install_lines():
    lines = check_install.readme_install_lines(check_install.documented_text())
    fresh = [ln for ln in lines if ln.fresh]
    assert [ln.cpu_index for ln in fresh] == [False, True], "the Quickstart's line, then the CPU-only line"
    assert fresh[0].line.startswith("python -m venv .venv") and "experiments.decode" in fresh[0].line
    assert fresh[0].args == fresh[1].args[:len(fresh[0].args)], "the CPU line is the Quickstart's install plus the index"
    extras = [ln for ln in lines if not ln.fresh]
    assert sorted(ln.args for ln in extras) == [["-e", ".[cluster]"], ["-e", ".[hf]"], ["-e", ".[peers]"]]
    assert not any("--no-index" in ln.args for ln in lines), "the offline wheelhouse line is not resolved"


def test_parses_commands_joined_by_and_and_skips_offline_installs():
    readme = "```bash\npython -m venv v && . v/bin/activate && pip install torch==2.4.1 x  # comment\n" \
             "python3 -m pip install --no-index --target /tmp/site .whl/*.whl\n```\n"
    (line,) = check_install.readme_install_lines(readme)
    assert line.args == ["torch==2.4.1", "x"] and line.fresh and not line.cpu_index


def test_a_supported_pair_passes():
    line = check_install.InstallLine("pip install torch==2.13.0 triton==3.7.1", ["torch==2.13.0", "triton==3.7.1"])
    assert check_install.check_report(_report(torch="2.13.0", triton="3.7.1", nvidia_cublas="13.1"), line) == []


def test_an_unsupported_pair_fails():
    line = check_install.InstallLine("pip install torch==2.13.0 triton==3.6.0", ["torch==2.13.0", "triton==3.6.0"])
    (problem,) = check_install.check_report(_report(torch="2.13.0+cpu", triton="3.6.0"), line)
    assert "torch2.13+triton3.6" in problem and "not a supported pair" in problem


@pytest.mark.parametrize("versions, expected", [
    ({"torch": "2.13.0", "triton": "3.7.1"}, "torch 2.13.0 is not the CPU build"),
    ({"torch": "2.13.0+cpu", "triton": "3.7.1", "nvidia_nccl_cu13": "2.29"},
     "CUDA wheels in a CPU-only install: nvidia-nccl-cu13"),
])
def test_the_cpu_line_takes_no_cuda_build(versions, expected):
    args = ["torch==2.13.0", "triton==3.7.1", "--extra-index-url", check_install.CPU_INDEX]
    line = check_install.InstallLine("pip install " + " ".join(args), args)
    assert check_install.check_report(_report(**versions), line) == [expected]


def test_an_extra_must_not_move_torch():
    line = check_install.InstallLine('pip install -e ".[cluster]"', ["-e", ".[cluster]"])
    assert check_install.check_report(_report(submitit="1.5.4", psycopg="3.3.9"), line) == []
    assert check_install.check_report(_report(torch="2.15.0"), line) == ["would replace the Quickstart's torch 2.15.0"]


def test_the_stock_environment_has_no_local_pip_settings(monkeypatch):
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///opt/pypi/simple")
    monkeypatch.setenv("PIP_CERT", "/etc/ssl/certs/ca-certificates.crt")
    env = check_install.stock_env()
    assert env["PIP_CONFIG_FILE"] == os.devnull
    assert "PIP_FIND_LINKS" not in env and "PIP_EXTRA_INDEX_URL" not in env
    assert env["PIP_CERT"] == "/etc/ssl/certs/ca-certificates.crt"  # how to reach the index is not what it serves
