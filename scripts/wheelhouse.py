#!/usr/bin/env python3
"""Build a wheelhouse for a GPU host with no network: the wheels it lacks to run nsa-bench's experiments.

A GPU host that already has torch, triton, numpy, pandas, pyarrow, matplotlib, scipy, scikit-learn,
pytest (...) but no network needs hydra-core, omegaconf, antlr4-python3-runtime and MLflow with the
dependencies it lacks. Build them here, where pip reaches the index, carry the folder along, and install
there with no index::

    python scripts/wheelhouse.py --dest .whl --python-version 3.12     # --peers: also fla-core; --hf: transformers
    python scripts/wheelhouse.py --hf --list      # the requirements it resolves (no network, nothing written)
    # on the GPU host, from the repository root:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site

How: pip resolves MLflow's dependency closure for the target Python and platform (``--dry-run
--report``, binary wheels only), drops what the host already has (``--host-has``: a built-in list for
the H200 box, or a ``pip freeze``/``pip list`` file taken on the host) and what tracking to a local
store does not use (the tracking server, its UI's web stack, Databricks/Docker clients), then
downloads each remaining wheel with ``--no-deps`` at the resolved version. antlr4-python3-runtime 4.9.3
(what omegaconf 2.3 needs) is published as a source archive only, so it is built here into a pure-Python
wheel. The folder must stay under ``--max-mb`` (default 40, 64 with ``--hf``) so the tree that travels stays small.
``--hf`` adds pyproject.toml's ``hf`` extra (transformers 5, safetensors: ``experiments.generate``,
``lm=hf``): its closure is carried even where the host lists a package (the image's transformers, tokenizers,
huggingface-hub predate transformers 5's minimum versions), except the long-stable packages of HF_HOST_KEEPS.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# The H200 box's image ('cuda'): the Python packages it holds, as listed on 2026-11-17.
H200_BOX_HAS = [
    "absl-py", "accelerate", "aiofiles", "aiohappyeyeballs", "aiohttp", "aiosignal", "annotated-doc",
    "anyio", "attrs", "botorch", "build", "certifi", "charset-normalizer", "chex", "click",
    "cloudpickle", "cmake", "colorama", "contourpy", "coverage", "cuda-bindings", "cuda-core",
    "cuda-pathfinder", "cuda-toolkit", "cupy-cuda13x", "cycler", "cython", "diffrax", "e3nn", "einops",
    "equinox", "etils", "execnet", "filelock", "flatbuffers", "flax", "fonttools", "formulaic",
    "frozenlist", "fsspec", "gpytorch", "grpcio", "h11", "h5py", "hf-xet", "httpcore", "httpx",
    "huggingface-hub", "humanize", "hypothesis", "idna", "imageio", "iniconfig", "interface-meta",
    "jax", "jax-cuda13-pjrt", "jax-cuda13-plugin", "jaxlib", "jaxtyping", "jinja2", "joblib",
    "kiwisolver", "lazy-loader", "lightning", "lightning-utilities", "linear-operator", "lineax",
    "llvmlite", "lxml", "markdown", "markdown-it-py", "markupsafe", "matplotlib", "mdurl", "meson",
    "ml-dtypes", "mpi4py", "mpmath", "msgpack", "multidict", "multipledispatch", "mypy-extensions",
    "nanobind", "narwhals", "networkx", "ninja", "numba", "numba-cuda", "numpy", "numpyro",
    "nvidia-cublas", "nvidia-cuda-cupti", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime",
    "nvidia-cudnn-cu13", "nvidia-cufft", "nvidia-cufile", "nvidia-curand", "nvidia-cusolver",
    "nvidia-cusparse", "nvidia-cusparselt-cu13", "nvidia-ml-py", "nvidia-nccl-cu13", "nvidia-nvjitlink",
    "nvidia-nvshmem-cu13", "nvidia-nvtx", "onnx", "onnx-ir", "onnxruntime", "onnxscript",
    "opencv-python-headless", "optax", "opt-einsum", "opt-einsum-fx", "optimistix", "orbax-checkpoint",
    "packaging", "pandas", "pathspec", "patsy", "peft", "pillow", "pip", "pluggy", "portalocker",
    "prometheus-client", "propcache", "protobuf", "psutil", "pyarrow", "pybind11", "py-cpuinfo",
    "pygments", "pyparsing", "pyproject-hooks", "pyre-extensions", "pytest", "pytest-benchmark",
    "pytest-cov", "pytest-mock", "pytest-timeout", "pytest-xdist", "python-dateutil",
    "pytorch-lightning", "pyyaml", "regex", "requests", "rich", "sacrebleu", "safetensors",
    "scikit-build-core", "scikit-image", "scikit-learn", "scipy", "seaborn", "sentencepiece",
    "sentence-transformers", "setuptools", "shellingham", "simplejson", "six", "sortedcontainers",
    "statsmodels", "sympy", "tabulate", "tensorboard", "tensorboard-data-server", "tensorstore",
    "threadpoolctl", "tifffile", "tiktoken", "timm", "tokenizers", "toolz", "torch", "torchaudio",
    "torchdiffeq", "torch-geometric", "torchmetrics", "torchvision", "tqdm", "transformers",
    "treescope", "triton", "typer", "typing-extensions", "typing-inspect", "urllib3", "uvloop",
    "wadler-lindig", "werkzeug", "wheel", "wrapt", "xarray", "xxhash", "yarl", "zipp",
]

# Direct requirements: what nsa-bench's experiments import (pyproject: hydra-core>=1.3, omegaconf>=2.3,
# mlflow>=2.14), and nox for `nox -s local` (its venv_backend="none" needs no virtualenv).
ROOTS = ["hydra-core==1.3.2", "omegaconf==2.3.0", "mlflow", "nox"]
# Source-only on the index: built into a wheel here.
BUILD_FROM_SOURCE = ["antlr4-python3-runtime==4.9.3"]
# In MLflow's closure but not used when experiments log to a local sqlite store: the tracking server
# (flask, gunicorn, uvicorn, graphene), its job queue, the Docker client, Google auth, model-serialization
# extras. Kept out to keep the house small; --full keeps them. (Tried: `import mlflow` needs cachetools,
# fastapi/starlette and databricks-sdk; the sqlite store needs cryptography; gitpython gives the git tags.)
NOT_NEEDED = [
    "flask", "flask-cors", "gunicorn", "huey", "itsdangerous", "blinker", "graphene", "graphql-core",
    "graphql-relay", "docker", "google-auth", "pyasn1", "pyasn1-modules", "skops", "prettytable", "wcwidth",
    "uvicorn", "python-dotenv",
    "virtualenv", "distlib",  # nox creates no virtualenv in its `local` session
]

# In the hf extra's closure, served by the host's own versions (--hf carries the rest of that closure).
HF_HOST_KEEPS = [
    "numpy", "packaging", "pyyaml", "tqdm", "typing-extensions", "filelock", "fsspec", "certifi", "typer", "rich",
    "pygments", "markdown-it-py", "mdurl", "shellingham", "annotated-doc", "pydantic", "pydantic-core",
    "typing-inspection", "annotated-types", "colorama",
    # accelerate's and peft's torch, and torch's own closure (nvidia-* and cuda-* too: HF_HOST_PREFIXES)
    "torch", "triton", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "setuptools",
]
HF_HOST_PREFIXES = ("nvidia-", "cuda-")  # the host's CUDA libraries (its torch's), never carried

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def host_has(spec: str) -> set[str]:
    if spec == "h200":
        return {norm(n) for n in H200_BOX_HAS}
    names = set()
    for line in Path(spec).read_text().splitlines():  # `pip freeze` (name==ver) or `pip list` (name ver)
        m = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line)
        if m and not line.startswith(("Package", "---")):
            names.add(norm(m.group(1)))
    return names


def platform_args(python_version: str) -> list[str]:
    abi = "cp" + python_version.replace(".", "")
    args = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp", "--abi", abi,
            "--abi", "abi3", "--abi", "none"]
    for p in PLATFORMS:
        args += ["--platform", p]
    return args + ["--platform", "any"]


def pip(*args: str, quiet: bool = True) -> None:
    cmd = [sys.executable, "-m", "pip", *args] + (["-q"] if quiet else [])
    subprocess.run(cmd, check=True)


def resolve(python_version: str, roots: list[str]) -> dict[str, str]:
    """name -> version of the closure of ``roots`` for the target platform (binary wheels only)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        pip("install", "--dry-run", "--ignore-installed", "--report", str(report), "--target", str(Path(tmp) / "t"),
            *platform_args(python_version), *roots)
        data = json.loads(report.read_text())
    return {norm(i["metadata"]["name"]): i["metadata"]["version"] for i in data["install"]}


def extra(name: str) -> list[str]:
    """The requirements of pyproject.toml's extra ``name`` (``peers``, ``hf``)."""
    import tomllib  # Python >= 3.11 (where this script runs: the machine that builds the house)

    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    return tomllib.loads(text)["project"]["optional-dependencies"][name]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", default=".whl", help="folder for the wheels (git-ignored; default .whl)")
    ap.add_argument("--python-version", default="3.12", help="the GPU host's Python (default 3.12)")
    ap.add_argument("--host-has", default="h200",
                    help="'h200' (built-in list of the H200 box) or a file of `pip freeze`/`pip list` from the host")
    ap.add_argument("--full", action="store_true", help="keep MLflow's server-side dependencies too")
    ap.add_argument("--max-mb", type=float, default=None, help="fail if the house is larger (default 40 MB, 64 with --hf)")
    ap.add_argument("--peers", action="store_true",
                    help="also the `peers` extra of pyproject.toml (fla-core: the fla row of prefill and decode)")
    ap.add_argument("--hf", action="store_true",
                    help="also the `hf` extra of pyproject.toml (transformers, safetensors: experiments.generate, lm=hf)")
    ap.add_argument("--list", action="store_true", help="print the requirements to resolve and exit (no network)")
    args = ap.parse_args(argv)
    hf_roots = extra("hf") if args.hf else []
    roots = ROOTS + (extra("peers") if args.peers else []) + hf_roots
    if args.list:
        print("\n".join(roots + BUILD_FROM_SOURCE))
        return 0
    max_mb = args.max_mb if args.max_mb is not None else (64.0 if args.hf else 40.0)

    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    have = host_has(args.host_has)
    skip = have | (set() if args.full else {norm(n) for n in NOT_NEEDED})

    # hydra-core/omegaconf need antlr4 4.9.*, which has no wheel: take them pinned with no deps and resolve
    # the rest with its closure, so the binary-only resolver never backtracks to hydra-core 0.11.
    print(f"resolving {', '.join(roots)} for CPython {args.python_version} manylinux x86-64 ...", flush=True)
    closure = resolve(args.python_version, [r for r in roots if "==" not in r])
    for r in roots:
        if "==" in r:
            n, v = r.split("==")
            closure[norm(n)] = v
    if hf_roots:  # transformers 5 needs newer versions than a host's: carry its closure (less HF_HOST_KEEPS)
        keeps = {norm(n) for n in HF_HOST_KEEPS}
        skip -= {n for n in resolve(args.python_version, hf_roots) if n not in keeps and not n.startswith(HF_HOST_PREFIXES)}
    wanted = {n: v for n, v in sorted(closure.items()) if n not in skip and not n.startswith(HF_HOST_PREFIXES)}

    # Drop wheels from an earlier build that are not wanted now (one version of each package only).
    keep_prefixes = {n.replace("-", "_") for n in wanted} | {norm(s.split("==")[0]).replace("-", "_")
                                                            for s in BUILD_FROM_SOURCE}
    for old in dest.glob("*.whl"):
        stem = norm(old.name.split("-")[0]).replace("-", "_")
        version = old.name.split("-")[1]
        want_v = wanted.get(stem.replace("_", "-")) or next(
            (s.split("==")[1] for s in BUILD_FROM_SOURCE if norm(s.split("==")[0]).replace("-", "_") == stem), None)
        if stem not in keep_prefixes or version != want_v:
            old.unlink()

    specs = [f"{n}=={v}" for n, v in wanted.items()]
    print(f"downloading {len(specs)} wheels into {dest}/ ...", flush=True)
    pip("download", "--no-deps", "-d", str(dest), *platform_args(args.python_version), *specs)
    for s in BUILD_FROM_SOURCE:
        print(f"building {s} (source only on the index) into a wheel ...", flush=True)
        pip("wheel", "--no-deps", "--no-binary", ":all:", "-w", str(dest), s)

    wheels = sorted(dest.glob("*.whl"))
    names = [norm(w.name.split("-")[0]) for w in wheels]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        print(f"error: more than one version of {', '.join(dupes)} in {dest}/", file=sys.stderr)
        return 1
    total = sum(w.stat().st_size for w in wheels)
    print(f"\n{len(wheels)} wheels, {total / 1e6:.1f} MB in {dest}/:")
    for w in wheels:
        print(f"  {w.stat().st_size / 1e6:7.2f} MB  {w.name}")
    skipped_here = sorted(n for n in closure if n in skip and n not in have)
    if skipped_here:
        print(f"left out (not used for tracking to a local store; --full keeps them): {', '.join(skipped_here)}")
    if total > max_mb * 1e6:
        print(f"error: {total / 1e6:.1f} MB is over --max-mb {max_mb}", file=sys.stderr)
        return 1
    print("\nOn the GPU host, from the repository root:")
    print(f"python3 -m pip install -q --no-index --no-deps --target /tmp/site {dest}/*.whl && export PYTHONPATH=/tmp/site")
    return 0


if __name__ == "__main__":
    sys.exit(main())
