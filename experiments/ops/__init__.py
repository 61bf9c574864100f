"""The operations ``python -m experiments.kernels op=<name>`` checks and times, one module per operation
(``op=decode``: :mod:`.decode_step`, the other ops the module of their name).

Each module has ``check(b)`` (its kernel against the reference at ``kernels.check_seq`` tokens; a
difference over ``kernels.tol`` is recorded in ``b.failures`` and fails the job), ``timed(b)`` (the rows
at ``seq`` tokens) and ``once(b)`` (one call of its kernels, for a profiler); ``b`` is a
:class:`~experiments.ops.bench.Bench`.
"""
from __future__ import annotations

import importlib
from types import ModuleType

NAMES = ("selection", "compressed", "topn", "window", "gate", "layer", "decode")
MODULES = {"decode": "decode_step"}  # op name -> module, where they differ

# Nsight Compute metrics that say what bounds a kernel (percent of peak, bytes): time, SM, L2, DRAM, L1,
# tensor pipes (mma.sync and wgmma), occupancy, issue. With ``kernels.once=true``:
#   ncu --clock-control none --metrics "$(python -c 'from experiments.ops import NCU_METRICS; print(NCU_METRICS)')" ...
NCU_METRICS = ",".join((
    "gpu__time_duration.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__t_bytes.sum",
    "lts__t_sector_hit_rate.pct",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__bytes_read.sum",
    "l1tex__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "smsp__issue_active.avg.pct_of_peak_sustained_elapsed",
))


def get(name: str) -> ModuleType:
    if name not in NAMES:
        raise ValueError(f"op={name!r}: one of {', '.join(NAMES)}")
    return importlib.import_module(f"{__name__}.{MODULES.get(name, name)}")
