"""nsa.toolchain: supported pairings pass, known-bad ones raise one line naming the pair and the supported ones."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from nsa import toolchain
from nsa.toolchain import SUPPORTED_PAIRS, ToolchainError, check_toolchain, parse_version, toolchain_id

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "version, expected",
    [
        ("2.13.0+cpu", (2, 13)),
        ("2.11.0+cu130", (2, 11)),
        ("2.4.0a0+git1234abc", (2, 4)),
        ("3.0.0.post1", (3, 0)),
        ("3.6", (3, 6)),
        ("2", (2, 0)),
    ],
)
def test_parse_version(version, expected):
    assert parse_version(version) == expected


def test_parse_version_rejects_garbage():
    with pytest.raises(ValueError, match="cannot parse"):
        parse_version("nightly")


@pytest.mark.parametrize(
    "torch_v, triton_v, expected",
    [
        ("2.3.1", "2.3.1", "torch2.3+triton2.3"),
        ("2.4.1+cu121", "3.0.0", "torch2.4+triton3.0"),
        ("2.11.0+cu130", "3.6.0", "torch2.11+triton3.6"),
        ("2.13.0+cpu", "3.7.1", "torch2.13+triton3.7"),
        ("2.13.0+cpu", "3.6.0", "torch2.13+triton3.6"),  # the CPU machine's venv: not listed, not bad
    ],
)
def test_supported_pairs_pass(torch_v, triton_v, expected):
    assert check_toolchain(torch_v, triton_v) == expected


def test_every_supported_pair_passes():
    for t, tr in SUPPORTED_PAIRS:
        assert check_toolchain(f"{t}.0", f"{tr}.0") == f"torch{t}+triton{tr}"


def test_each_torchs_own_triton_passes():
    # The triton each torch wheel pins on PyPI is never flagged.
    for t, tr in toolchain.TRITON_PINNED_BY_TORCH.items():
        assert check_toolchain(f"{t}.0", f"{tr}.0") == f"torch{t}+triton{tr}"


def test_no_triton_is_fine():
    assert check_toolchain("2.13.0+cpu", None) == "torch2.13+notriton"
    assert toolchain_id("2.13.0+cpu", None) == "torch2.13+notriton"


def test_unknown_but_not_bad_pair_passes():
    # Neither supported nor known to break (torch 2.13's wheels pin triton 3.7): passes with its id.
    assert check_toolchain("2.13.0", "3.9.0") == "torch2.13+triton3.9"
    assert check_toolchain("2.6.0", "3.1.0") == "torch2.6+triton3.1"
    assert check_toolchain("2.8.0", "3.6.0") == "torch2.8+triton3.6"


@pytest.mark.parametrize(
    "torch_v, triton_v",
    [
        ("2.4.1", "2.3.1"),    # torch >= 2.4 with triton 2.x (triton_key)
        ("2.11.0", "2.2.0"),
        ("2.3.1", "3.0.0"),    # torch <= 2.3 with triton 3.x (triton.common)
        ("2.5.1+cu124", "3.2.0"),  # torch < 2.6 with triton >= 3.2
        ("2.6.0", "3.3.1"),    # AttrsDescriptor removed in triton 3.3
        ("2.7.1", "3.4.0"),    # launch_enter_hook moved to triton.knobs
    ],
)
def test_known_bad_pair_raises_one_line(torch_v, triton_v):
    with pytest.raises(ToolchainError) as info:
        check_toolchain(torch_v, triton_v)
    msg = str(info.value)
    assert "\n" not in msg
    assert f"torch {torch_v} with triton {triton_v} is a known-bad pairing" in msg
    assert "supported: " in msg
    for t, tr in SUPPORTED_PAIRS:
        assert f"torch{t}+triton{tr}" in msg


def test_installed_toolchain_is_not_known_bad():
    # Whatever this test session runs on must itself be a pairing the library accepts.
    ident = check_toolchain()
    assert ident.startswith("torch")
    torch_v, triton_v = toolchain.installed_versions()
    assert ident == toolchain_id(torch_v, triton_v)


def test_nox_pairings_match_supported_pairs():
    noxfile = ROOT / "noxfile.py"
    if not noxfile.exists() or importlib.util.find_spec("nox") is None:
        pytest.skip("noxfile.py or nox not available")
    spec = importlib.util.spec_from_file_location("_noxfile", noxfile)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert list(module.PAIRINGS) == [f"torch{t}+triton{tr}" for t, tr in SUPPORTED_PAIRS]
    for ident, pins in module.PAIRINGS.items():
        assert toolchain_id(pins["torch"], pins["triton"]) == ident


@pytest.mark.slow  # processes: not the quick tier's
def test_nox_alone_fails_a_file_that_passes_only_after_another(tmp_path):
    """``nox -s alone`` (docs/toolchains.md) through nox's CLI: b passes after a (which imports what b checks)
    in one pytest process, and fails in a process of its own; a file with no test is listed, not passed."""
    import subprocess
    import sys

    (tmp_path / "test_a.py").write_text("import colorsys  # noqa: F401\n\n\ndef test_a():\n    assert True\n")
    (tmp_path / "test_b.py").write_text("import sys\n\n\ndef test_b():\n    assert 'colorsys' in sys.modules\n")
    (tmp_path / "test_c.py").write_text("X = 1\n")
    files = [str(tmp_path / f"test_{x}.py") for x in "abc"]
    together = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files[:2]],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert together.returncode == 0, together.stdout[-2000:]
    p = subprocess.run([sys.executable, "-m", "nox", "-f", str(ROOT / "noxfile.py"), "-s", "alone", "--", *files],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr[-3000:]
    assert f"[alone] {files[0]}: exit 0" in p.stderr and f"[alone] {files[1]}: exit 1" in p.stderr, p.stderr[-3000:]
    assert f"[alone] {files[2]}: exit 5" in p.stderr, p.stderr[-3000:]
    assert "3 files in" in p.stderr and "1 passed, 1 failed, 1 ran no test here" in p.stderr, p.stderr[-3000:]
    assert re.search(rf"fails alone: {re.escape(files[1])} \(|fails alone: {re.escape(files[1])}$", p.stderr, re.M), p.stderr


def test_dispatch_refuses_the_triton_backend_on_a_known_bad_pair(monkeypatch):
    """Loading the triton backend checks the installed pairing and refuses a known-bad one."""
    import nsa.toolchain
    from nsa import dispatch

    monkeypatch.setattr(nsa.toolchain, "installed_versions", lambda: ("2.4.1", "2.3.1"))
    monkeypatch.delitem(dispatch._REGISTRY, "triton", raising=False)
    with pytest.raises(ToolchainError, match=r"torch 2\.4\.1 with triton 2\.3\.1 is a known-bad pairing"):
        dispatch.get("triton")
    assert "triton" not in dispatch._REGISTRY


def test_triton_backend_is_unavailable_below_triton_3(monkeypatch):
    """triton 2.x lacks what the kernels use: the backend says so instead of failing to compile."""
    import torch

    import nsa.compat
    from nsa.backends.triton import BACKEND

    monkeypatch.setattr(nsa.compat, "triton_version", lambda: (2, 3))
    reason = BACKEND.unavailable("sel", torch.device("cuda"), torch.bfloat16)
    assert reason == "triton 2.3 cannot run these kernels (they need triton >= 3.0)"
    monkeypatch.setattr(nsa.compat, "triton_version", lambda: (3, 0))
    assert BACKEND.unavailable("sel", torch.device("cuda"), torch.bfloat16) is None


def test_kernel_modules_keep_annotations_as_objects():
    """Triton 2.3/3.0's JIT reads ``tl.constexpr`` annotations as objects: a kernel module with
    ``from __future__ import annotations`` turns them into strings and its constexpr parameters into
    runtime arguments, which breaks those toolchains only (the nox sessions), not the default one."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "nsa"
    kernel_modules = [p for p in root.rglob("*.py") if "@triton.jit" in p.read_text()]
    assert kernel_modules, "no Triton kernel modules found"
    bad = [str(p.relative_to(root)) for p in kernel_modules
           if any(line.startswith("from __future__ import annotations") for line in p.read_text().splitlines())]
    assert not bad, f"kernel modules with postponed annotations: {bad}"
