"""The one place where this project reads environment variables.

* ``TRITON_INTERPRET`` (:func:`triton_interpret`): ``1`` runs Triton kernels on CPU tensors through
  Triton's interpreter. Set it before ``import triton``; CI does, for kernel tests at small shapes.
* ``NSA_TOOLCHAIN`` (:func:`toolchain_id`): id of the torch/triton pairing under test, set by the nox
  sessions (e.g. ``torch2.4+triton3.0``), logged as the run's ``toolchain`` tag.
* ``MLFLOW_TRACKING_URI`` is read by MLflow itself; the ``tracking`` config group sets the store
  explicitly instead.

Everything else reaches the library as explicit arguments, filled from Hydra configs.
"""
from __future__ import annotations

import os


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def toolchain_id() -> str:
    """The nox session's pairing id, or "" outside nox (callers then use nsa.toolchain.check_toolchain())."""
    return os.environ.get("NSA_TOOLCHAIN", "")
