"""The one place where this project reads environment variables.

* ``TRITON_INTERPRET`` (:func:`triton_interpret`): ``1`` runs Triton kernels on CPU tensors through
  Triton's interpreter. Set it before ``import triton``; CI does, for kernel tests at small shapes.
* ``NSA_TOOLCHAIN`` (:func:`toolchain_id`): id of the torch/triton pairing under test, set by the nox
  sessions (e.g. ``torch2.4+triton3.0``), logged as the run's ``toolchain`` tag.
* ``MLFLOW_TRACKING_URI`` (:func:`mlflow_tracking_uri`): the experiments' tracking store when the
  ``tracking.uri`` config key is null (as MLflow itself does); ``tracking.uri`` takes precedence.
* ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, ``MLFLOW_HTTP_REQUEST_TIMEOUT`` (read by MLflow on every
  request): :func:`limit_mlflow_http` bounds them for this process (a user's own values are kept), and
  :func:`mlflow_http_probe` sets them briefly for a first, fast check of a tracking server.
* ``MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT`` (:func:`suppress_mlflow_run_urls`): set where the tracking URI
  holds a password, which MLflow's "View run at" lines would print.
* ``SLURM_JOB_ID``, ``SLURM_ARRAY_JOB_ID``, ``SLURM_ARRAY_TASK_ID`` (:func:`slurm_job_id`): set by SLURM
  in a job's processes; a run started in one is tagged with its job id.
* ``CUDA_VISIBLE_DEVICES`` (:func:`cuda_visible_devices`): the GPUs this process may use (a scheduler
  sets it to the job's own); a run is tagged with it. :func:`pin_cuda_devices` sets it in the workers of
  ``hydra/launcher=local_gpus``, one GPU each.
* :func:`child_environment`: this process's environment for a subprocess (``experiments.validate``
  runs the kernel tests in pytest), with ``TRITON_INTERPRET`` set or removed and a ``PYTHONPATH`` first.

Everything else reaches the library as explicit arguments, filled from Hydra configs.
"""
from __future__ import annotations

import contextlib
import os


def triton_interpret() -> bool:
    """Returns: whether ``TRITON_INTERPRET`` is set (to anything but empty or 0): Triton kernels then run
    on the CPU through the interpreter.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def toolchain_id() -> str:
    """The nox session's pairing id, or "" outside nox (callers then use nsa.toolchain.check_toolchain())."""
    return os.environ.get("NSA_TOOLCHAIN", "")


def mlflow_tracking_uri() -> str | None:
    """MLflow's own variable, or None where it is unset or empty."""
    return os.environ.get("MLFLOW_TRACKING_URI") or None


def slurm_job_id() -> str | None:
    """This process's SLURM job as ``squeue``, ``sacct`` and ``scancel`` name it (``<array job>_<task>``
    for a task of a job array), or None outside SLURM."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return os.environ.get("SLURM_JOB_ID") or None


def cuda_visible_devices() -> str | None:
    """CUDA's device list for this process, or None where it is unset (every GPU visible)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def pin_cuda_devices(ids: str) -> None:
    """Set this process's CUDA device list (``hydra/launcher=local_gpus``'s workers, before CUDA starts)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ids


def limit_mlflow_http(max_retries: int, timeout_s: int) -> None:
    """Bound MLflow's HTTP retries for this process unless the user set them (MLflow's defaults retry
    for minutes against a server that is down)."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(max_retries))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(timeout_s))


def suppress_mlflow_run_urls() -> None:
    """``MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT``: MLflow's client prints no "View run at <URL>" lines for
    this process (they write the tracking URI as given, a password in it too; the experiments print
    their own link, the password masked)."""
    os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"


@contextlib.contextmanager
def mlflow_http_probe(timeout_s: int):
    """MLflow requests inside this block: no retries, ``timeout_s`` per request."""
    keys = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(timeout_s)}
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def child_environment(*, triton_interpret: bool, pythonpath: str) -> dict[str, str]:
    """A copy of this environment for a subprocess: ``TRITON_INTERPRET=1`` (Triton's interpreter) or
    no ``TRITON_INTERPRET`` at all (compiled kernels), and ``pythonpath`` before any ``PYTHONPATH``."""
    out = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if triton_interpret:
        out["TRITON_INTERPRET"] = "1"
    out["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, out.get("PYTHONPATH", "")) if p)
    return out
