"""Validate an NSA build on this device: the checks, one MLflow parent run with a child per check, a report.

    python -m experiments.validate hardware=h200
    python -m experiments.validate hardware=cpu
    python -m experiments.validate hardware=cpu validate.checks=[env,kernels] validate.inject_fault=sel

Checks (experiments/validation/): env, kernels (the kernel tests compiled on the device, in pytest; on a
CPU the interpreter's twin, said plainly), decode, prefill, thresholds (writes a hardware profile with
the window backend by length), train, determinism. ``report.md`` and ``report.html`` go to the run's
folder (``outputs/validate/<time>/``) and onto the parent run. Exit 0 only if every check ran and
passed; 1 otherwise; 2 for a config error. ``validate.inject_fault=<cmp|sel|win>`` is a test switch:
that branch's output is wrong in every backend but the reference, and the report must say FAIL.
"""
from __future__ import annotations

import hydra
from omegaconf import DictConfig

from .framework import launch


@hydra.main(config_path="../conf", config_name="validate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from .validation.run import run

    run(cfg)


if __name__ == "__main__":
    launch(main, "validate")
