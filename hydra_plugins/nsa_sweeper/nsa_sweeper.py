"""The ``nsa`` sweeper: Hydra's public Sweeper plugin interface over :mod:`experiments.framework.sweep`.

Hydra finds it in the ``hydra_plugins`` namespace package at the repository root (installed with the
project, or on ``sys.path`` as the working directory or ``PYTHONPATH=$PWD``). Hydra imports every
plugin module at start-up, so this one imports nothing heavy until a sweep runs.
"""
from __future__ import annotations

from typing import Any

from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class NSASweeper(Sweeper):
    """Cartesian product of the sweep's lists, every job validated first, one MLflow parent run, the
    jobs launched through ``hydra/launcher``, a summary from the store (see conf/hydra/sweeper/nsa.yaml)."""

    def __init__(self, params: dict | None = None, resume: str | None = None, show: str | None = None,
                 show_resolve: bool = False, job_dirname: str = "swept") -> None:
        super().__init__()
        self.params, self.resume, self.show, self.show_resolve = params or {}, resume, show, show_resolve
        self.job_dirname = job_dirname
        self.hydra_context: HydraContext | None = None
        self.config: DictConfig | None = None
        self.launcher = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        from experiments.framework.sweep import run_sweep

        return run_sweep(self, arguments)
