"""One job: the task body every entry point runs (``@hydra.main`` -> :func:`run_job`).

1. :func:`~experiments.framework.config.prepare` validates the config (after
   :func:`~experiments.framework.config.check_timed_device`: no GPU profile timed on a CPU). A
   ConfigError in a single run: one line, exit 2, no run and no output directory. (In a sweep every job was validated before any
   started; a job that still fails validation, e.g. on another host, ends as a FAILED child.)
2. A run is created in ``nsa-<entry>``: a child of ``tracking.parent_run_id`` when a sweep passed one,
   tagged with the environment, the owning process, the job's overrides (``sweep_job``) and in a
   sweep the launcher that ran it (``launcher``: basic, slurm, per_gpu), and ``work(job)`` runs inside
   ``nsa.dispatch.record()``; ``job.run`` (:class:`Run`) logs as the work goes (a training curve). An
   entry point that can continue an interrupted job (``resume``: e.g. a checkpoint in the job's output
   directory names its run) reopens that run instead of creating one.
3. Metrics (step = seq), the job's CSV, the resolved config and an environment JSON are logged; the
   run ends FINISHED, or FAILED with the error (``error`` tag, ``error.txt``, the traceback in the
   job's log), or KILLED on SIGINT/SIGTERM. A single run ends as a sweep does: its status line with the
   run id, then on stdout its outputs folder and the ``mlflow ui`` command of its run (:func:`closing`);
   one that failed exits 1. A store that fails once the run is open (a full disk:
   ``tracking.StoreError``) fails the job in one line naming the store, and the run ends FAILED with it
   where the store still takes that (else the line says what is left and the ``close_stale`` command).
"""
from __future__ import annotations

import json
import logging
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from nsa import dispatch

from .. import env
from ..nested import flatten

from . import cli, parallel, tracking
from .config import (BRANCHES, ConfigError, Job, ResourceLimit, check_timed_device, error_text, one_line,
                     option_meaning, prepare)
from .report import Charts, write_csv

log = logging.getLogger("experiments")
HEADLINE = "0_"  # prefix of a job's headline metrics: they sort first in MLflow's tables and charts
# Overrides a sweeper adds to each job (its store and parent); not part of what tells jobs apart.
SWEEPER_KEYS = ("tracking.uri", "tracking.parent_run_id")
# Entry points whose headline figures are times, and what such figures are when they ran on a CPU.
TIME_FIGURES = ("decode", "prefill", "kernels", "generate")
CPU_FIGURES = ("note:    these times are from a CPU (the reference backend, Triton's interpreter): they check that the "
               "pipeline runs and is correct; they do not measure NSA's speed, which needs a GPU")


@dataclass
class Result:
    rows: list[dict]                                     # the job's CSV, one dict per row
    metrics: dict[str, float]                            # logged at step = seq
    headline: dict[str, float] = field(default_factory=dict)  # logged as 0_<name>: the first columns to look at
    failure: str | None = None                           # set: logged, then the run ends FAILED
    charts: Charts | None = None                         # the sweep's charts over this entry's CSV rows
    tags: dict[str, str] = field(default_factory=dict)   # notes set as run tags (e.g. a baseline skipped, and why)
    texts: dict[str, str] = field(default_factory=dict)  # artifact path -> text (e.g. profiler tables), logged on the run


@dataclass
class Run:
    """The job's tracking run as ``work`` sees it (``job.run``)."""

    id: str
    client: Any                  # mlflow.MlflowClient
    resumed: bool = False        # reopened: an earlier process of this job left it (run_job's ``resume``)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Metrics at ``step``, stored before this returns (tracking.StoreError where the store fails)."""
        with tracking.writing(self.client):
            tracking.log_batch(self.client, self.id, metrics=metrics, step=step)

    def log_params(self, params: dict) -> None:
        with tracking.writing(self.client):
            tracking.log_batch(self.client, self.id, params=params)

    def log_artifact(self, path, artifact_path: str | None = None) -> None:
        """The file ``path`` on the run, under ``artifact_path`` (a folder of its artifacts; None: the top)."""
        with tracking.writing(self.client):
            self.client.log_artifact(self.id, str(path), artifact_path)

    def history(self, key: str) -> list[tuple[int, float]]:
        """``(step, value)`` of metric ``key`` as stored (an earlier process's points too), by step."""
        return sorted((m.step, m.value) for m in self.client.get_metric_history(self.id, key))


class JobFailure(RuntimeError):
    """The job's measurements are logged, and it failed a check (e.g. parity tolerances)."""


def job_key(overrides) -> list[str]:
    """A job's identity within its sweep: its overrides, less those the sweeper adds."""
    return [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in SWEEPER_KEYS]


def launcher_name(hc) -> str:
    """The ``hydra/launcher`` option a sweep runs its jobs with."""
    return str(hc.runtime.choices.get("hydra/launcher") or "basic")


def _hydra():
    try:
        return HydraConfig.get()
    except ValueError:  # called outside a Hydra app (tests)
        return None


# What the single run's output folder held before this process made it (RunDirWatch, Hydra's on_run_start, which
# runs before Hydra creates the folder): None where no run started here; else (the topmost folder this process
# creates, or None where the run dir was already there; the names the run dir held then).
_run_dir_before: tuple[Path | None, frozenset] | None = None


class RunDirWatch(Callback):
    """A Hydra callback (conf/common.yaml ``hydra.callbacks``): notes, before Hydra makes a single run's output
    folder, which of it already exists, so that :func:`remove_empty_output_dir` removes only what this process
    made (a user's ``hydra.run.dir=logs`` or ``hydra.run.dir=.`` keeps its files)."""

    def on_run_start(self, config, **kwargs) -> None:
        global _run_dir_before
        out = Path(str(OmegaConf.select(config, "hydra.run.dir"))).absolute()
        top = None
        for p in (out, *out.parents):
            if p.exists():
                break
            top = p
        _run_dir_before = (top, frozenset(q.name for q in out.iterdir()) if out.is_dir() else frozenset())


def remove_empty_output_dir(hc) -> None:
    """A single run stopped by a config error leaves no files: what this process made in Hydra's run dir (its
    .hydra/ and the log file) goes, then the folders it made, each only if now empty. Nothing is removed that was
    there before the run started (RunDirWatch), nor anything where that is unknown, nor anything under torchrun with
    several ranks (they share the folder)."""
    global _run_dir_before
    before, _run_dir_before = _run_dir_before, None
    if before is None or (parallel.torchrun_world() or 1) > 1:
        return  # several ranks share the folder: another may still be opening its log file there
    top, had = before
    out = Path(hc.runtime.output_dir).absolute()
    if not out.is_dir():
        return
    for p in out.iterdir():
        if p.name not in had and (p.name == ".hydra" or p.suffix == ".log"):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    if top is None:
        return
    for up in (out, *out.parents):  # the folders this process made, from the run dir up to the topmost
        try:
            up.rmdir()
        except OSError:
            break
        if up == top:
            break


def identity(job: Job) -> list[tuple[str, str | None]]:
    """What tells a run apart beside its length, for its name: the operation (experiments.kernels), the
    hardware profile, the model, the backend plan (one name, or cmp/sel/win); for a training its preset, model
    and attention (the config groups chosen: ``train``, ``lm``, ``attention``)."""
    plan = job.plan
    backend = plan["cmp"] if len(set(plan.values())) == 1 else "/".join(plan[b] for b in ("cmp", "sel", "win"))
    out = [("op", OmegaConf.select(job.cfg, "op.name", default=None)), ("hardware", job.profile.name),
           ("model", OmegaConf.select(job.cfg, "model.name", default=None)), ("backend", backend)]
    if job.entry == "train":
        out += [(g, f"{g}={job.choices[g]}" if job.choices.get(g) else None) for g in ("train", "lm", "attention")]
    return out


def describe(job: Job, choices: dict) -> tuple[dict, dict]:
    """(params, tags) of a job's run: the flattened resolved config and the config-group choices;
    the environment and what the validation decided."""
    flat = flatten(OmegaConf.to_container(job.cfg, resolve=True))
    params = {**{k: str(v) for k, v in flat.items()}, **choices}
    tags = {**tracking.environment(job.dev), "entry": job.entry, "hardware_profile": job.profile.name,
            "hardware_selected": job.profile_note, "branch_force": job.branch, "seq": str(job.seq),
            "dtype": str(job.dtype).replace("torch.", ""), "policy_overrides": "; ".join(job.policy_notes) or "none",
            **{f"backend_plan_{b}": job.plan[b] for b in BRANCHES}}
    if option_meaning(job.choices.get("backend")):  # backend=sdpa|fa2: what the option meant, branch by branch
        tags["backend_plan"] = f"backend={job.choices['backend']}: " + " ".join(f"{b}={job.plan[b]}" for b in BRANCHES)
    return params, tags


def run_job(cfg: DictConfig, entry: str, work: Callable[[Job], Result],
            resume: Callable[[Job], str | None] | None = None,
            fits: Callable[[Job], Any] | None = None, check: Callable[[Job], Any] | None = None) -> None:
    """``check(job)``: the entry's own config rules (``config.prepare``'s ``check``: a ValueError is a config
    error); the same function its ``launch`` is given, which a sweep validates every job with before any
    starts. ``resume(job)``: the id of the run an earlier process of this job left unfinished (e.g. named by
    a checkpoint in ``job.out_dir``), reopened instead of a new run (:func:`_earlier_run` says when
    it may be); None: a new run. A ConfigError it raises is a config error. ``fits(job)``: the entry's
    memory estimate against limits.max_memory_gib (``config.check_memory``), before the store is opened:
    a ResourceLimit it raises refuses a single run as a config error (one line, exit 2, no run). In a
    sweep ``work`` checks it first: the job fails alone (a FAILED child with its params and the reason)."""
    t0 = time.perf_counter()
    cli.install_signal_handlers()  # a job process started by another launcher
    hc = _hydra()
    launch_dir = Path(hc.runtime.cwd) if hc else Path.cwd()
    out_dir = Path(hc.runtime.output_dir) if hc else Path.cwd()
    key = job_key(hc.overrides.task) if hc else []
    choices = {k: v for k, v in (hc.runtime.choices if hc else {}).items() if not k.startswith("hydra/") and v}
    parent = cfg.tracking.get("parent_run_id")
    tags = {"sweep_job": json.dumps(key), **({"launcher": launcher_name(hc)} if parent and hc else {})}
    try:
        check_timed_device(cfg, entry)
        job = prepare(cfg, entry, choices=choices, check=check)
        job.out_dir = out_dir
        if fits is not None and parent is None:  # a sweep's job: work() checks it, and fails alone
            fits(job)
        if _cp(job) and parallel.rank() > 0:  # a context-parallel rank > 0: work only, rank 0 logs the run
            return _other_rank(job, entry, work)
        store = tracking.connect(job.cfg.tracking, entry, launch_dir)
        earlier = _earlier_run(store, resume(job), parent, out_dir) if resume else None
    except (ConfigError, ResourceLimit) as e:  # ResourceLimit: only a single run's (fits)
        if parent is None:  # a single run: one line, exit 2, nothing left behind
            if hc:
                remove_empty_output_dir(hc)
            cli.config_exit(str(e))
        return _failed_validation(cfg, entry, launch_dir, parent, key, tags, e)
    head = f"[{entry}] seq={job.seq}" + (f" job {hc.job.num}" if parent and hc else "")
    rid = _open_run(store, job, entry, parent, tags, earlier, hc, head)
    if rid is None:
        return None
    job.run = Run(rid, store.client, resumed=earlier is not None)
    if parent is None:
        log.info(f"[{entry}] tracking store {store.describe()}; run {rid}" + (" (resumed)" if earlier else ""))
    status, err, timing = _run_work(job, work, choices, earlier, key, head, out_dir, t0)
    overhead = time.perf_counter() - t0 - timing["work_s"]
    status, err = _end_run(store.client, rid, job, status, err, overhead, head)
    log.info(f"{head}: {status} in {time.perf_counter() - t0:.2f} s (measured work {timing['work_s']:.2f} s, "
             f"Hydra+MLflow overhead {overhead:.2f} s) run {rid}")
    if parent is None:  # a sweep ends so too, from the sweeper (sweep._finish)
        print(closing(store, rid, out_dir, launch_dir, entry in TIME_FIGURES and job.device.type == "cpu"))
        if status != "FINISHED":
            env.record_elastic_error(f"{head}: {status}: {err}")
            raise SystemExit(1)


def _open_run(store, job: Job, entry: str, parent: str | None, tags: dict, earlier, hc, head: str) -> str | None:
    """The job's run: a new one named by its entry, identity and seq (a child of ``parent`` where a sweep
    passed one), or ``earlier`` reopened. A store that fails here leaves no run to record it on: a single
    run exits 2 in one line, a sweep's job logs the error.

    Returns:
        The run id; None where a sweep's job could not create its run.
    """
    name = " ".join([entry, *(str(v) for _, v in identity(job) if v), f"seq={job.seq}"]) + (
        f" {job.branch}" if job.branch != "none" else "")
    try:
        with tracking.writing(store.client):
            if earlier is None:
                return tracking.start_run(store, name, parent, tags)
            tracking.reopen(store.client, earlier.info.run_id)
            return earlier.info.run_id
    except tracking.StoreError as e:  # no run to record it on: a single run stops as before any run
        if parent is None:
            if hc:
                remove_empty_output_dir(hc)
            cli.config_exit(f"{e}; no run was started")
        log.error(f"{head}: FAILED: {e}; no run was created")
        return None


def _run_work(job: Job, work: Callable[[Job], Result], choices: dict, earlier, key: list, head: str,
              out_dir: Path, t0: float) -> tuple[str, str | None, dict]:
    """Log the job's params and tags on its run, run ``work`` inside ``dispatch.record()`` (the backends that
    ran and the fallbacks taken: tags), then its result (:func:`_log_result`). Any failure fails this job
    only: its error on the run (``error.txt``). What propagates (KeyboardInterrupt: the run ends KILLED; a
    SystemExit: FAILED) ends the run here first (``t0``: the job's start, for its overhead).

    Returns:
        (status: FINISHED, FAILED or KILLED; the error, or None; {"work_s": seconds in ``work``}).
    """
    client, rid = job.run.client, job.run.id
    status, err, timing = "FAILED", None, {"work_s": 0.0}
    leaving = True  # an exception propagates: the run ends in the finally clause
    try:
        cli.raise_if_interrupted()
        if _cp(job):
            job.cp = parallel.init(job.device)
            log.info(f"{head}: {job.cp.world} processes ({job.cp.backend}); rank 0 logs this run")
        _log_start(job, choices, earlier, key)
        for n in job.policy_notes:
            log.info(f"{head}: backend policy {n}")
        log.info(f"{head}: {job.profile_note}; backends {job.plan}; branch_force={job.branch}; {job.device}/{job.cfg.dtype}")
        torch.manual_seed(int(job.cfg.seed))
        if job.device.type == "cpu" and job.profile.get("threads"):
            torch.set_num_threads(int(job.profile.threads))
        res = _recorded_work(job, work, timing)
        cli.raise_if_interrupted()
        _log_result(client, rid, job, res, timing["work_s"], out_dir)
        if res.failure:
            raise JobFailure(res.failure)
        status, leaving = "FINISHED", False
    except KeyboardInterrupt as e:
        status, err = "KILLED", cli.interrupt_reason(e)
        cli.note_closed(e, rid)
        raise
    except Exception as e:  # noqa: BLE001  (any failure fails this job only; recorded on its run)
        err = error_text(e)
        log.error(f"{head}: FAILED: {err}", exc_info=not isinstance(e, JobFailure))  # traceback: log file only
        try:
            if not isinstance(e, tracking.StoreError):  # the store just failed: its traceback is in the log file
                client.log_text(rid, traceback.format_exc(), "error.txt")
        except Exception as e2:  # noqa: BLE001  (the store itself failing: still end the run below)
            log.error(f"{head}: could not record the error on the run: {one_line(e2)}")
        leaving = False
    finally:
        if leaving:
            _end_run(client, rid, job, status, err, time.perf_counter() - t0 - timing["work_s"], head)
    return status, err, timing


def _log_start(job: Job, choices: dict, earlier, key: list) -> None:
    """The job's params and tags on its run. A reopened run keeps the params it has (they are fixed once
    logged): only new keys are logged, changed ones as the tag ``resumed_changes``."""
    params, tags = describe(job, choices)
    if job.cp is not None:
        tags.update(cp_world=str(job.cp.world), cp_backend=job.cp.backend)
    if earlier is not None:  # the job's overrides now (a resumed sweep matches its jobs by them; e.g. another
        # train.time_limit_s)
        old = earlier.data.params
        changed = [f"{k}: {old[k]} -> {v}" for k, v in params.items() if k in old and old[k] != str(v)[:6000]]
        params = {k: v for k, v in params.items() if k not in old}
        tags.update(resumed=str(int(earlier.data.tags.get("resumed", "0")) + 1), sweep_job=json.dumps(key),
                    **({"resumed_changes": "; ".join(changed)} if changed else {}))
    with tracking.writing(job.run.client):
        tracking.log_batch(job.run.client, job.run.id, params=params, tags=tags)


def _recorded_work(job: Job, work: Callable[[Job], Result], timing: dict) -> Result:
    """``work(job)`` inside ``dispatch.record()``; the backends that ran and the fallbacks taken are tagged
    on the run, and ``timing["work_s"]`` set, whether it returns or raises. A context-parallel job closes its
    group first (the other ranks leave now, not after this rank's logging)."""
    worked = False
    with dispatch.record() as rec:
        t_work = time.perf_counter()
        try:
            res = work(job)
            worked = True
        finally:
            timing["work_s"] = time.perf_counter() - t_work
            if job.cp is not None:
                parallel.close(worked)
            try:
                with tracking.writing(job.run.client):
                    tracking.log_batch(job.run.client, job.run.id, tags={
                        **{f"backend_ran_{b}": n for b, n in rec.ran.items()},
                        "backends_ran": ",".join(f"{b}={rec.ran[b]}" for b in BRANCHES if b in rec.ran) or "none",
                        "fallbacks": "; ".join(rec.fallbacks) or "none"})
            except tracking.StoreError as e:
                if worked:  # else the work's own error (a signal's, the store's) is what ends the job
                    raise
                log.error(f"run {job.run.id}: the backends that ran were not recorded: {e}")
    return res


def _end_run(client, rid: str, job: Job, status: str, err: str | None, overhead: float, head: str):
    """Log ``framework_overhead_s`` (not for a KILLED run) and end the run with ``status``. A store that fails
    on that metric fails a FINISHED job (it is not recorded whole).

    Returns:
        (the status the run ended with, its error).
    """
    try:
        if status != "KILLED":
            with tracking.writing(client):
                tracking.log_batch(client, rid, metrics={"framework_overhead_s": overhead}, step=job.seq)
    except tracking.StoreError as e:  # the job is not recorded whole: it did not finish
        if status == "FINISHED":
            status, err = "FAILED", str(e)
            log.error(f"{head}: FAILED: {err}")
    try:
        tracking.end_run(client, rid, status, err)
    except tracking.StoreError as e:
        log.error(f"{head}: {e}")
    return status, err


def closing(store, rid: str, out_dir: Path, launch_dir: Path, cpu_times: bool) -> str:
    """A single run's last lines on stdout, as a sweep's end: where its files are, and how to open its
    run in MLflow's UI (the command with the store, the run's page); ``cpu_times``: what its times are."""
    try:
        out_dir = out_dir.relative_to(launch_dir)
    except ValueError:
        pass
    page = f"#/experiments/{store.experiment_id}/runs/{rid}"
    return f"outputs: {out_dir}\nMLflow:  {store.ui_hint(page)}" + (f"\n{CPU_FIGURES}" if cpu_times else "")


def _cp(job: Job) -> bool:
    """The job runs over a process group (parallel.distributed: config.prepare checked the launch)."""
    return parallel.distributed(job.cfg, job.entry)


def _other_rank(job: Job, entry: str, work: Callable[[Job], Result]) -> None:
    """A context-parallel rank > 0: joins the group, runs ``work`` (its part of the collectives) and leaves;
    no store, no run, no CSV (rank 0 gathers what it logs). A failure: its traceback in this rank's log,
    exit 1 (torchrun then stops the other ranks, and rank 0's run ends KILLED)."""
    head = f"[{entry}] seq={job.seq} rank {parallel.rank()}"
    job.cp = parallel.init(job.device)
    torch.manual_seed(int(job.cfg.seed))
    if job.device.type == "cpu" and job.profile.get("threads"):
        torch.set_num_threads(int(job.profile.threads))
    ok = False
    try:
        work(job)
        ok = True
    except Exception as e:  # noqa: BLE001  (one line on the console, the traceback in the log file)
        log.error(f"{head}: FAILED: {error_text(e)}", exc_info=True)
        env.record_elastic_error(f"{head}: FAILED: {error_text(e)}")
    finally:
        parallel.close(ok)
    if not ok:
        raise SystemExit(1)
    log.info(f"{head}: done (rank 0 logs the run)")


def _earlier_run(store, rid: str | None, parent: str | None, out_dir: Path):
    """The run ``rid`` an earlier process of this job left (None: none), if this job may continue it:
    in this experiment, under the same sweep (or none), not FINISHED, its process gone."""
    if rid is None:
        return None
    from mlflow.exceptions import MlflowException

    try:
        run = store.client.get_run(rid)
    except MlflowException:
        run = None
    what = f"{out_dir} holds run {rid} to continue"
    if run is None or run.info.experiment_id != store.experiment_id:
        raise ConfigError(f"{what}, which is not in experiment {store.experiment} of {store.uri}; "
                          "a new run needs another output directory")
    owner = run.data.tags.get("mlflow.parentRunId")
    if owner != parent:
        raise ConfigError(f"{what}, " + (f"a job of sweep {owner} (resume it: hydra.sweeper.resume={owner})" if owner
                                         else "a single run, not a job of this sweep")
                          + "; a new run needs another output directory")
    if run.info.status == "FINISHED":
        raise ConfigError(f"{what}, which is FINISHED; a new run needs another output directory")
    if run.info.status == "RUNNING":
        gone, where = tracking.stale(run), f"process {run.data.tags.get('pid', '?')} on {run.data.tags.get('host', '?')}"
        if gone is False:
            raise ConfigError(f"{what}, which is RUNNING in {where}; stop that process first")
        if gone is None:
            raise ConfigError(f"{what}, which is RUNNING in {where}, which this host cannot check; if it is gone: "
                              + tracking.close_stale_command(store.uri, rid))
    return run


def _log_result(client, rid: str, job: Job, res: Result, work_s: float, out: Path) -> None:
    """Metrics (step = seq), tags, texts, the CSV (also written to the job's output dir), the resolved
    config and the environment, on the job's run."""
    metrics = {**res.metrics, **{HEADLINE + k: v for k, v in res.headline.items()},
               "seq": float(job.seq), "measured_work_s": work_s}
    tags = {**res.tags, **({"charts": res.charts.to_tag()} if res.charts else {})}
    with tracking.writing(client):
        tracking.log_batch(client, rid, metrics=metrics, step=job.seq, tags=tags)
        for path, text in res.texts.items():
            client.log_text(rid, text, path)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / f"{job.entry}.csv", res.rows)
    with tracking.writing(client):
        client.log_artifact(rid, str(out / f"{job.entry}.csv"))
        client.log_text(rid, OmegaConf.to_yaml(job.cfg, resolve=True), "config.yaml")
        client.log_dict(rid, {**tracking.environment(job.dev), "hardware_profile": OmegaConf.to_container(job.profile),
                              "backend_plan": job.plan, "fallback": job.fallback}, "environment.json")


def _failed_validation(cfg, entry, launch_dir, parent, key, tags, e: ConfigError) -> None:
    """A sweep's job whose config fails here although the sweep validated it (e.g. a profile that
    matched the launching host, not this one): a FAILED child run that says why."""
    log.error(f"[{entry}] config error: {e}")
    store = tracking.connect(cfg.tracking, entry, launch_dir)
    try:
        with tracking.writing(store.client):
            rid = tracking.start_run(store, f"{entry} {' '.join(key)}", parent, tags)
        tracking.end_run(store.client, rid, "FAILED", f"ConfigError: {e}")
    except tracking.StoreError as e2:
        log.error(f"[{entry}] {e2}")
