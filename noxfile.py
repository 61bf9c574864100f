"""nox sessions: the test suite on each supported torch/triton pairing, on the local toolchain, and lint.

    nox -s "tests(torch2.4+triton3.0)"   # one pairing, in its own virtualenv under .nox/
    nox -s tests                         # every pairing (downloads several GB for the CUDA wheels)
    nox -s local                         # the interpreter's own torch/triton; installs nothing
    nox -s alone                         # each test file in a pytest process of its own
    nox -s lint                          # ruff check

Each ``tests`` session pins torch and triton exactly, installs them first, then the project with a
constraints file that holds both pins (so the resolver can never swap the pinned torch for another),
checks the installed versions against the pins, and runs pytest with ``NSA_TOOLCHAIN=<id>`` (runs get
the ``toolchain`` tag) and ``TRITON_INTERPRET=1`` (Triton kernels run on the CPU, as in CI).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "venv"
# Keep each session's virtualenv between runs (the CUDA wheels of the old pairings are GBs); `nox -R`
# also skips the install steps.
nox.options.reuse_venv = "yes"

ROOT = Path(__file__).parent

# id -> exact pins. Keep in step with nsa/toolchain.py SUPPORTED_PAIRS (tests/test_toolchain.py checks).
PAIRINGS: dict[str, dict[str, object]] = {
    # The two oldest pairings also pin numpy<2: triton 3.0's interpreter silently writes nothing back
    # to CPU tensors under NumPy 2 (a copy kernel gave zeros with numpy 2.4.6, the right values with
    # 1.26.4), and triton 2.3's predates NumPy 2 too.
    "torch2.3+triton2.3": {"torch": "2.3.1", "triton": "2.3.1", "extra": ["numpy<2"]},
    "torch2.4+triton3.0": {"torch": "2.4.1", "triton": "3.0.0", "extra": ["numpy<2"]},
    # The H200 box's toolchain (torch 2.11.0+cu130, triton 3.6.0).
    "torch2.11+triton3.6": {"torch": "2.11.0", "triton": "3.6.0", "extra": []},
    # The newest pairing, the README Quickstart's: torch 2.13.0 (the CPU machine's local +cpu wheel) with
    # the triton that torch 2.13.0's CUDA wheels pin (3.7.1). (triton 3.8.0's interpreter also runs the
    # kernels; 3.9.0's rejects the selection kernel's masks: "mask has unsupported dtype".)
    "torch2.13+triton3.7": {"torch": "2.13.0", "triton": "3.7.1", "extra": []},
}

TEST_DEPS = ["pytest>=8"]


def _pytest(session: nox.Session, toolchain: str, python: str = "python") -> None:
    env = {"NSA_TOOLCHAIN": toolchain, "TRITON_INTERPRET": "1"}
    t0 = time.monotonic()
    # pytest's exit code 5 (no tests collected) fails the session, as in CI.
    session.run(python, "-m", "pytest", "-q", *session.posargs, env=env)
    session.log(f"[timing] {session.name}: tests {time.monotonic() - t0:.0f}s")


_CHECK_VERSIONS = """
import sys
import torch
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = None
want_torch, want_triton = sys.argv[1], sys.argv[2]
got_torch = torch.__version__.split("+")[0]
got_triton = triton_version.split("+")[0] if triton_version else None
bad = []
if got_torch != want_torch:
    bad.append(f"torch {torch.__version__} (pinned {want_torch})")
if got_triton != want_triton:
    bad.append(f"triton {triton_version} (pinned {want_triton})")
if bad:
    sys.exit("installed versions differ from the pins: " + ", ".join(bad))
from nsa.toolchain import check_toolchain
print(f"torch {torch.__version__}, triton {triton_version}: toolchain {check_toolchain()}")
"""


@nox.session
@nox.parametrize("toolchain", list(PAIRINGS), ids=list(PAIRINGS))
def tests(session: nox.Session, toolchain: str) -> None:
    """The test suite on one pinned torch/triton pairing."""
    pins = PAIRINGS[toolchain]
    torch_pin, triton_pin = f"torch=={pins['torch']}", f"triton=={pins['triton']}"
    extra = list(pins["extra"])  # type: ignore[arg-type]
    constraints = Path(session.create_tmp()) / "constraints.txt"
    constraints.write_text("\n".join([torch_pin, triton_pin, *extra]) + "\n")

    t0 = time.monotonic()
    # 1. torch and triton together, first, by exact pin (and whatever pins the pairing needs beside).
    session.install(torch_pin, triton_pin, *extra)
    # 2. The project and the test tools, held to the same pins: the resolver cannot replace torch.
    session.install("-c", str(constraints), "-e", ".", *TEST_DEPS)
    session.log(f"[timing] {session.name}: install {time.monotonic() - t0:.0f}s")
    # 3. What is installed is what was pinned, or the session stops here.
    check = Path(session.create_tmp()) / "check_versions.py"
    check.write_text(_CHECK_VERSIONS)
    session.run("python", str(check), str(pins["torch"]), str(pins["triton"]))
    _pytest(session, toolchain)


@nox.session(venv_backend="none")
def local(session: nox.Session) -> None:
    """The suite on the interpreter nox runs under, with its own torch/triton; installs nothing.

    For GPU hosts with no network: there, ``nsa`` is found through the working tree (PYTHONPATH) and
    hydra/omegaconf/mlflow through a carried wheelhouse (scripts/wheelhouse.py).
    """
    python = sys.executable
    out = session.run(
        python, "-c", "from nsa.toolchain import check_toolchain; print(check_toolchain())",
        silent=True, env={"PYTHONPATH": _pythonpath()},
    )
    toolchain = str(out).strip().splitlines()[-1]
    session.log(f"local toolchain: {toolchain} ({python})")
    session.env["PYTHONPATH"] = _pythonpath()
    _pytest(session, toolchain, python=python)


@nox.session(venv_backend="none")
def alone(session: nox.Session) -> None:
    """Each test file in a pytest process of its own, on this interpreter (as ``local``), as many at once as the
    machine has cores: a file that passes only after another file imported or configured something fails here.
    ``nox -s alone -- FILE ...`` runs those files; none: every ``tests/test_*.py``. A file whose every test is
    deselected on this machine (the GPU tests on a CPU) is listed as such, not as passed."""
    files = session.posargs or sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").glob("test_*.py"))
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "TRITON_INTERPRET": "1"}

    def run(f: str) -> tuple[str, int, float, str]:
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f], cwd=ROOT, env=env,
                           capture_output=True, text=True)
        last = (p.stdout.strip().splitlines() or [""])[-1]
        return f, p.returncode, time.monotonic() - t0, last if p.returncode in (0, 1, 5) else (p.stdout + p.stderr)[-2000:]

    t0, failed, empty = time.monotonic(), [], []
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for f, rc, s, last in pool.map(run, files):
            session.log(f"[alone] {f}: exit {rc} in {s:.0f}s: {last}")
            (empty if rc == 5 else failed if rc else []).append(f)
    session.log(f"[alone] {len(files)} files in {time.monotonic() - t0:.0f}s: {len(files) - len(failed) - len(empty)} "
                f"passed, {len(failed)} failed, {len(empty)} ran no test here")
    if failed:
        session.error(f"fails alone: {' '.join(failed)}")


def _pythonpath() -> str:
    return os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check over the whole tree (ruff pinned: its default rule set changes between releases)."""
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
