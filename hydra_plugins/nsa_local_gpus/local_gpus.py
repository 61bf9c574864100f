"""``hydra/launcher=local_gpus``: a sweep over this host's GPUs without a scheduler.

One worker process per GPU (``concurrent.futures.ProcessPoolExecutor``, spawned: no CUDA state is
inherited), each pinned to its GPU for its life by ``CUDA_VISIBLE_DEVICES`` before anything in it can
touch CUDA; the pool hands the sweep's jobs to whichever worker is free, so as many jobs run at once as
there are GPUs, the rest wait, and no two jobs ever share a GPU. Each job runs as Hydra's launchers run
one (``hydra.core.utils.run_job`` in the worker: its own output folder, logs and config), so its MLflow
run carries the tag ``cuda_visible_devices`` like any other (the sweep's end line says where jobs ran).

``gpus``: a count (the first N visible GPUs) or a list of device ids; null: every visible GPU (the
ids of this process's ``CUDA_VISIBLE_DEVICES`` where it is set). Ids are not checked against the
devices present, so CPU jobs (``hardware=cpu``) can be spread over ids that need not exist.
``jobs_per_gpu`` (default 1): workers per GPU, for jobs too small to fill one (the training presets' small
models): that many share each GPU at once, and the sweep's end line names the GPUs they shared. Timings of
jobs that shared a GPU are not those of a job alone.

SIGINT/SIGTERM while the sweep runs: the workers get SIGTERM and exit at once, queued jobs are dropped, and
the sweep ends the runs they left RUNNING, and its parent, KILLED.
"""
from __future__ import annotations

import logging
import os
import signal
from collections.abc import Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)
STOP_WAIT_S = 30.0  # how long an interrupted sweep waits for its workers to end their runs


def _exit_now(signum, _frame) -> None:
    os._exit(128 + signum)


def _pin(slots) -> None:
    """Worker initializer: take a GPU id for this process's life. The sweep's process owns the signals:
    a worker ignores SIGINT (a terminal's Ctrl-C reaches the whole process group) and exits at once on
    the SIGTERM the sweep sends it, taking no further job; the sweep ends the runs left RUNNING."""
    from experiments import env

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_now)
    env.pin_cuda_devices(str(slots.get()))


def _run(payload: bytes, overrides: list[str], job_num: int) -> JobReturn:
    """One Hydra job in a worker (as Hydra's submitit launcher runs one on a node). ``payload``: Hydra's
    context, the task function, the config and Hydra's singletons (OmegaConf's resolvers among them), by
    cloudpickle (the resolvers are closures)."""
    import cloudpickle

    hydra_context, task_function, config, singleton_state = cloudpickle.loads(payload)
    Singleton.set_state(singleton_state)
    setup_globals()
    sweep_config = hydra_context.config_loader.load_sweep_config(config, overrides)
    with open_dict(sweep_config.hydra.job) as job:
        job.id = f"local_gpus_{job_num}"
        job.num = job_num
    return run_job(hydra_context=hydra_context, task_function=task_function, config=sweep_config,
                   job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")


def gpu_ids(gpus, visible: str | None, count: int) -> list[str]:
    """The device ids a sweep runs on, from ``hydra.launcher.gpus`` (None, a count or a list of ids), this
    process's ``CUDA_VISIBLE_DEVICES`` (``visible``) and the number of GPUs torch sees (``count``)."""
    seen = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else [str(i) for i in range(count)]
    if gpus is None:
        if not seen:
            raise ValueError("hydra.launcher.gpus: no GPU is visible here; give a count or a list of device ids")
        return seen
    if isinstance(gpus, bool) or not isinstance(gpus, (int, Sequence)) or isinstance(gpus, str):
        raise ValueError(f"hydra.launcher.gpus={gpus!r}: a count, a list of device ids, or null (every visible GPU)")
    if isinstance(gpus, int):
        if gpus < 1 or gpus > len(seen):
            raise ValueError(f"hydra.launcher.gpus={gpus}: a count from 1 to the {len(seen)} GPUs visible here")
        return seen[:gpus]
    ids = [str(g) for g in gpus]
    if not ids or any(not i.isdigit() for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"hydra.launcher.gpus={list(gpus)}: a non-empty list of distinct device ids (integers >= 0)")
    return ids


class LocalGpusLauncher(Launcher):
    def __init__(self, gpus=None, jobs_per_gpu=1) -> None:
        super().__init__()
        self.gpus = gpus
        self.jobs_per_gpu = jobs_per_gpu
        self.ids: list[str] = []
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None
        self.config: DictConfig | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        import torch

        from experiments.framework import cli
        from experiments import env

        self.hydra_context, self.task_function, self.config = hydra_context, task_function, config
        try:
            self.ids = gpu_ids(self.gpus, env.cuda_visible_devices(), torch.cuda.device_count())
        except ValueError as e:
            cli.config_exit(str(e))
        k = self.jobs_per_gpu
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            cli.config_exit(f"hydra.launcher.jobs_per_gpu={k!r}: an integer >= 1 (jobs at once on each GPU)")

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        import cloudpickle

        assert self.config is not None and job_overrides
        ctx = mp.get_context("spawn")
        slots = ctx.Queue()
        for _ in range(self.jobs_per_gpu):
            for i in self.ids:
                slots.put(i)
        payload = cloudpickle.dumps((self.hydra_context, self.task_function, self.config, Singleton.get_state()))
        per = "one job per GPU" if self.jobs_per_gpu == 1 else f"{self.jobs_per_gpu} jobs per GPU"
        log.info(f"local_gpus: {len(job_overrides)} jobs on GPUs {','.join(self.ids)}, {per} at a time")
        pool = ProcessPoolExecutor(max_workers=len(self.ids) * self.jobs_per_gpu, mp_context=ctx, initializer=_pin,
                                   initargs=(slots,))
        try:
            futures = []
            for k, overrides in enumerate(job_overrides):
                idx = initial_job_idx + k
                log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
                futures.append(pool.submit(_run, payload, list(overrides), idx))
            results = [f.result() for f in futures]
        except KeyboardInterrupt:
            self._stop(pool)
            raise
        pool.shutdown(wait=True)
        return results

    @staticmethod
    def _stop(pool) -> None:
        """Queued jobs dropped, SIGTERM to every worker (it exits at once); wait for them."""
        import time

        procs = list(getattr(pool, "_processes", {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            if p.is_alive():
                p.terminate()
        end = time.monotonic() + STOP_WAIT_S
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
            if p.is_alive():
                p.kill()
