"""The operations ``python -m experiments.kernels op=<name>`` checks and times, one module per operation.

Each module has ``check(b)`` (its kernel against the reference at ``kernels.check_seq`` tokens; a
difference over ``kernels.tol`` is recorded in ``b.failures`` and fails the job), ``timed(b)`` (the rows
at ``seq`` tokens) and ``once(b)`` (one call of its kernels, for a profiler); ``b`` is a
:class:`~experiments.ops.bench.Bench`.
"""
from __future__ import annotations

import importlib
from types import ModuleType

NAMES = ("selection", "compressed", "topn", "window", "gate", "layer", "decode")


def get(name: str) -> ModuleType:
    if name not in NAMES:
        raise ValueError(f"op={name!r}: one of {', '.join(NAMES)}")
    return importlib.import_module(f"{__name__}.{name}")
