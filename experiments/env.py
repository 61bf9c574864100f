"""The experiments' own environment variables, and the command line a password must not stay on.

Standard library only: :func:`reexec_without_passwords` runs from ``experiments/__init__.py``, before torch
or anything else is imported, so a password typed in ``tracking.uri=http://user:PW@host`` leaves the
process's command line (which every user of the host reads in ``ps``) within the interpreter's start.

* ``NSA_TRACKING_LOGINS`` (:func:`tracking_logins`): JSON ``{URI as printed (password ***): URI itself}``,
  the tracking logins this launch was given. A process's environment is readable by its own user only
  (``/proc/<pid>/environ`` is 0400), and is inherited by what the launch starts: the process re-executed
  without the password, ``hydra/launcher=local_gpus``' spawned workers, torchrun's ranks, SLURM's jobs
  (sbatch exports the environment), which so reach the server with the login while their configs hold
  only the masked URI.
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
* ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (:func:`launch_ranks`): set by
  torchrun in each rank (or from SLURM's task variables by submitit, :func:`slurm_step`); ``SLURM_STEP_ID``,
  ``SLURM_PROCID``, ``SLURM_NTASKS`` (:func:`slurm_step`): a task of an ``srun`` step; ``SUBMITIT_EXECUTOR``
  (:func:`mark_submitit_slurm`).
* ``TORCHELASTIC_ERROR_FILE`` (:func:`record_elastic_error`): where torchrun reads a failed rank's error, which
  it prints as the launch's root cause (else a link to its docs, below 30 lines of its own traceback).
* :func:`child_environment`: this process's environment for a subprocess (``experiments.validate``
  runs the kernel tests in pytest), with ``TRITON_INTERPRET`` set or removed and a ``PYTHONPATH`` first.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from urllib.parse import urlsplit, urlunsplit

LOGINS = "NSA_TRACKING_LOGINS"
MASK = "***"


def tracking_logins() -> dict[str, str]:
    """The logins this process inherited (``NSA_TRACKING_LOGINS``), {} where there are none."""
    try:
        got = json.loads(os.environ.get(LOGINS) or "{}")
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in got.items()} if isinstance(got, dict) else {}


def export_tracking_logins(logins: dict[str, str]) -> None:
    """``logins`` (with those inherited) into this process's environment, for the processes it starts."""
    os.environ[LOGINS] = json.dumps({**tracking_logins(), **logins})


def mask_uri(uri: str) -> tuple[str, str | None]:
    """(``uri`` with the password of its user info written ``***``, the password or None where it has none)."""
    try:
        parts = urlsplit(uri)
        password = parts.password
    except ValueError:
        return uri, None
    if not password or password == MASK:
        return uri, None
    return urlunsplit(parts._replace(netloc=f"{parts.username}:{MASK}@{parts.netloc.rsplit('@', 1)[1]}")), password


def mask_override(arg: str, logins: dict[str, str]) -> str:
    """A ``tracking.uri=<uri>`` override (``+``/``++``, quoted or not) with its password masked, the URI itself
    added to ``logins`` under the masked one; any other argument as it is."""
    key, eq, value = arg.partition("=")
    if not eq or arg.startswith("-") or key.lstrip("+~") != "tracking.uri":
        return arg
    quoted = len(value) > 1 and value[0] == value[-1] and value[0] in "'\""
    inner = value[1:-1] if quoted else value
    safe, password = mask_uri(inner)
    if password is None:
        return arg
    logins[safe] = inner
    return f"{key}={value[0] + safe + value[0] if quoted else safe}"


def reexec_without_passwords() -> None:
    """Where this process's arguments hold a ``tracking.uri`` with a password: the same command again in this
    process (``exec``, the pid kept: torchrun, SLURM and a terminal see no change), the password masked on its
    command line and the URI itself in ``NSA_TRACKING_LOGINS``. Nothing to do otherwise."""
    n = len(sys.argv) - 1
    head, args = sys.orig_argv[:len(sys.orig_argv) - n], sys.orig_argv[len(sys.orig_argv) - n:]
    if n <= 0 or args != sys.argv[1:]:  # arguments not as the interpreter got them: leave them
        return
    logins: dict[str, str] = {}
    masked = [mask_override(a, logins) for a in args]
    if not logins:
        return
    sys.stdout.flush()
    os.execve(sys.executable, [*head, *masked], {**os.environ, LOGINS: json.dumps({**tracking_logins(), **logins})})


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


TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what torchrun sets


def launch_ranks() -> tuple[int, int, int] | None:
    """(rank, local rank, world size) where torchrun (or submitit from SLURM's tasks) set every variable of
    env:// rendezvous, else None."""
    if not all(k in os.environ for k in TORCHRUN_ENV):
        return None
    return int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])


def slurm_step() -> int:
    """The task count of the SLURM job step this process is a task of (SLURM_NTASKS, as submitit reads it), 0
    outside a step."""
    if "SLURM_STEP_ID" not in os.environ or "SLURM_PROCID" not in os.environ:
        return 0
    return int(os.environ.get("SLURM_NTASKS", "1"))


def mark_submitit_slurm() -> None:
    """submitit's jobs carry SUBMITIT_EXECUTOR=slurm; a plain srun's tasks do not, and its
    TorchDistributedEnvironment needs it."""
    os.environ.setdefault("SUBMITIT_EXECUTOR", "slurm")


def record_elastic_error(message: str) -> None:
    """Under torchrun, write this rank's one-line error where torchrun reads it (its error-file format,
    ``{"message": ...}``), so that its failure summary names the error as the root cause."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    with contextlib.suppress(OSError):
        with open(path, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)


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
