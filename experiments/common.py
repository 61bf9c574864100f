"""The experiment framework shared by the entry points: validation, MLflow runs, CSVs, exit codes.

An entry point is a thin ``@hydra.main`` task that calls :func:`run_job` with a ``work(job)``
function, and ``__main__`` calls :func:`launch`. Per job (one seq, one config):

1. :func:`prepare` validates and resolves the config (hardware profile, backends, NSAConfig,
   dtype) without side effects; a bad config exits non-zero with one line and no run.
2. A run is created in the experiment ``nsa-<entry>`` (a child of the sweep's parent run under
   ``-m``), tagged with the environment, and ``work`` runs inside ``nsa.dispatch.record()``.
3. Metrics (step = seq), the job's CSV, the resolved config and an environment JSON are logged;
   the run ends FINISHED, or FAILED with the error recorded. No run is left RUNNING.

Under ``-m`` :class:`TrackingCallback` validates every job's config before anything starts,
opens the parent run, and at the end logs the sweep CSV and a latency-vs-seq plot on it.
"""
from __future__ import annotations

import atexit
import csv
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
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

import nsa
from nsa import dispatch, env
from nsa.toolchain import check_toolchain

from . import hardware

REPO = Path(__file__).resolve().parent.parent
CONF_DIR = REPO / "conf"
BRANCHES = ("cmp", "sel", "win")
DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ConfigError(ValueError):
    """A configuration that cannot run; reported as one line, before any run starts."""


class ResourceLimit(RuntimeError):
    """A job needs more than limits.* allow (fails that job only)."""


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ================================================================================================
# Process state (Hydra's basic launcher runs the jobs of a sweep in this process, one after another)
# ================================================================================================
@dataclass
class _State:
    failed: int = 0
    config_error: bool = False
    parent_id: str | None = None
    open_runs: set = field(default_factory=set)
    jobs: list = field(default_factory=list)     # per job: dict(seq, status, work_s, overhead_s, rows, label)
    n_jobs: int = 1
    mark: float = 0.0                             # perf_counter when the current job's time began
    sweep_t0: float = 0.0
    setup_s: float = 0.0
    sweep_labels: list = field(default_factory=list)
    prepared: dict = field(default_factory=dict)  # job overrides -> Job validated at sweep start


STATE = _State()
_CLIENT: dict = {}


def _close_open_runs():
    """Last resort (interrupts, crashes): never leave a run RUNNING."""
    if not STATE.open_runs or "client" not in _CLIENT:
        return
    for rid in list(STATE.open_runs):
        try:
            _CLIENT["client"].set_terminated(rid, "KILLED")
        except Exception as e:  # noqa: BLE001  (at exit: report, keep closing the others)
            say(f"could not close run {rid}: {e}")
    STATE.open_runs.clear()


atexit.register(_close_open_runs)


# ================================================================================================
# Validation: everything that can be checked before a run starts
# ================================================================================================
@dataclass
class Job:
    entry: str
    cfg: DictConfig              # resolved, with the concrete hardware profile
    nsa: nsa.NSAConfig
    plan: dict                   # branch -> backend requested (after the hardware policy)
    fallback: str | None
    policy_notes: list
    profile: DictConfig
    profile_note: str
    device: torch.device
    dtype: torch.dtype
    dev: hardware.Device
    seq: int
    branch: str                  # branch_force: none | cmp | sel | win


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def prepare(cfg: DictConfig, entry: str) -> Job:
    """Validate ``cfg`` and resolve what it leaves open. Raises ConfigError with one line."""
    try:
        return _prepare(cfg, entry)
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError, dispatch.BackendUnavailable, Exception) as e:
        raise ConfigError(_one_line(e)) from e


def _prepare(cfg: DictConfig, entry: str) -> Job:
    check_toolchain()  # a known-bad torch/triton pairing stops here, with one line naming it
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))  # a copy without the hydra node
    if "hydra" in cfg:
        del cfg["hydra"]
    seq = cfg.seq
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise ConfigError(f"seq={seq!r}: must be an integer >= 1 (tokens)")
    # Hardware: auto -> detected profile; a strict profile must match the device.
    try:
        profile, note = hardware.resolve_profile(cfg.hardware)
    except hardware.HardwareMismatch as e:
        raise ConfigError(str(e)) from e
    strict = cfg.hardware.get("strict", True)
    cfg.hardware = profile
    cfg.hardware.strict = strict
    dev = hardware.detect()
    device = torch.device("cuda" if profile.device == "cuda" and dev.type == "cuda" else "cpu")
    dname = cfg.dtype if cfg.dtype is not None else profile.dtype
    if dname not in DTYPES:
        raise ConfigError(f"dtype={dname!r}: one of {', '.join(DTYPES)}")
    cfg.dtype = dname
    # Model
    try:
        ncfg = nsa.NSAConfig(**OmegaConf.to_container(cfg.model.nsa, resolve=True))
    except TypeError as e:
        raise ConfigError(f"model.nsa: {e}") from e
    except ValueError as e:
        raise ConfigError(f"model={cfg.model.name}: {e}") from e
    if ncfg.d_k % 2:
        raise ConfigError(f"model.nsa.d_k={ncfg.d_k}: must be even (RoPE rotates pairs of dims)")
    # Branch forcing
    branch = cfg.branch_force.name
    if branch not in ("none", *BRANCHES):
        raise ConfigError(f"branch_force={branch!r}: one of none, cmp, sel, win")
    # Backends: names per branch (auto -> the profile's preferred), then the profile's policy.
    plan, notes = {}, []
    pol = profile.get("policy", {}) or {}
    for b in BRANCHES:
        name = cfg.backend.get(b)
        if name is None:
            name = (pol.get("preferred") or {}).get(b, "reference")
        avoid = (pol.get("avoid") or {}).get(b)
        if avoid is not None and name == avoid.backend and not pol.get("force", False):
            notes.append(f"{b}: {name} -> {avoid.instead} (hardware={profile.name} policy: {avoid.reason}; "
                         f"hardware.policy.force=true runs it)")
            name = avoid.instead
        plan[b] = name
    try:
        plan = dispatch.resolve(plan)
    except ValueError as e:
        raise ConfigError(str(e).replace("backend[", "backend.").replace("]=", "=", 1)) from e
    fallback = cfg.backend.get("fallback")
    if fallback is not None and fallback not in dispatch.known_backends():
        raise ConfigError(f"backend.fallback={fallback!r}: unknown backend; known: {', '.join(dispatch.known_backends())}")
    for b in BRANCHES:
        cfg.backend[b] = plan[b]
    # Entry-specific knobs
    for sec in ("decode", "prefill"):
        if sec in cfg:
            for k in ("warmup", "repeats", "batch") + (("prefill_chunk",) if sec == "decode" else ()):
                v = cfg[sec][k]
                lo = 0 if k == "warmup" else 1
                if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                    raise ConfigError(f"{sec}.{k}={v!r}: must be an integer >= {lo}")
    if "parity" in cfg and dname not in cfg.parity.tol:
        raise ConfigError(f"parity.tol has no entry for dtype={dname}; add parity.tol.{dname}")
    OmegaConf.resolve(cfg)
    return Job(entry, cfg, ncfg, plan, fallback, notes, profile, note, device, DTYPES[dname], dev, seq, branch)


def check_memory(job: Job, est_bytes: float) -> None:
    lim = float(job.cfg.limits.max_memory_gib)
    if est_bytes > lim * 2**30:
        raise ResourceLimit(f"seq={job.seq}: estimated {est_bytes / 2**30:.3g} GiB of tensors exceeds "
                            f"limits.max_memory_gib={lim:g}")


# ================================================================================================
# Command-line pre-check: an unknown option of a config group, in one line (before Hydra)
# ================================================================================================
def groups() -> dict[str, list[str]]:
    return {p.name: sorted(f.stem for f in p.glob("*.yaml")) for p in sorted(CONF_DIR.iterdir()) if p.is_dir()}


def precheck_argv(argv: list[str]) -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    known = groups()
    parser = OverridesParser.create()
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key = arg.split("=", 1)[0].lstrip("+~")
        if key not in known:
            continue
        try:
            ov = parser.parse_override(arg)
        except Exception as e:  # noqa: BLE001  (Hydra's own parse error, on one line)
            _config_exit(f"{arg}: {_one_line(e)}")
        vals = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [ov.get_value_element_as_str()]
        for v in vals:
            if v not in known[key]:
                what = "backend" if key == "backend" else f"{key} option"
                extra = " (one branch: backend.sel=<name>)" if key == "backend" else ""
                _config_exit(f"{key}={v}: unknown {what}; choose one of {', '.join(known[key])}{extra}")


def _config_exit(msg: str):
    say(f"config error: {msg}")
    raise SystemExit(2)


# ================================================================================================
# Environment and tracking
# ================================================================================================
_ENV: dict = {}


def _git(*args) -> str:
    try:
        r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=False)
        return r.stdout.strip() if r.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment(dev: hardware.Device) -> dict:
    """Versions, device and source state of this process (cached)."""
    if not _ENV:
        commit = _git("rev-parse", "HEAD")
        _ENV.update({
            "python_version": platform.python_version(),
            "torch_version": torch.__version__,
            "triton_version": _version("triton"),
            "cuda_version": torch.version.cuda or "none",
            "flash_attn_version": _version("flash-attn"),
            "mlflow_version": _version("mlflow"),
            "hydra_version": _version("hydra-core"),
            "nsa_version": nsa.__version__,
            "git_commit": commit or "unknown",
            "git_dirty": ("true" if _git("status", "--porcelain", "--untracked-files=no") else "false")
            if commit else "unknown",
            "toolchain": env.toolchain_id() or check_toolchain(),
            "host": platform.node(),
        })
    return {**_ENV, "device_type": dev.type, "device_name": dev.name,
            "device_capability": f"{dev.capability[0]}.{dev.capability[1]}" if dev.capability else "none",
            "device_driver": dev.driver or "none", "device_count": str(dev.count)}


def _tracking(cfg: DictConfig, entry: str):
    """(client, experiment_id) for cfg.tracking; the sqlite default is resolved against the launch dir."""
    from mlflow import MlflowClient

    t = cfg.tracking
    uri = t.uri
    try:
        launch_dir = Path(HydraConfig.get().runtime.cwd)
    except ValueError:
        launch_dir = Path.cwd()
    if uri is None:
        uri = f"sqlite:///{launch_dir / 'mlflow.db'}"
    name = t.experiment or f"nsa-{entry}"
    key = (uri, name)
    if _CLIENT.get("key") != key:
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(name)
        if exp is None:
            root = t.artifact_root
            if root is None and uri.startswith("sqlite:///"):
                root = (Path(uri[len("sqlite:///"):]).parent / "mlruns").resolve().as_uri()
            eid = client.create_experiment(name, artifact_location=f"{root}/{name}" if root else None)
        else:
            eid = exp.experiment_id
        _CLIENT.update(key=key, client=client, eid=eid, uri=uri)
    return _CLIENT["client"], _CLIENT["eid"]


def flatten(d: Any, prefix: str = "") -> dict[str, str]:
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = str(d)
    return out


def _log_start(client, rid: str, job: Job, extra_tags: dict, sweep: dict | None = None) -> None:
    from mlflow.entities import Param, RunTag

    params = flatten(OmegaConf.to_container(job.cfg, resolve=True))
    if sweep:  # the parent of a sweep: swept keys as their value lists
        params = {k: v for k, v in params.items() if k not in sweep and k.split(".")[0] not in sweep}
        params.update({f"sweep.{k}": ",".join(v) for k, v in sweep.items()})
    e = environment(job.dev)
    tags = {**e, "entry": job.entry, "hardware_profile": job.profile.name, "hardware_selected": job.profile_note,
            "branch_force": job.branch, "seq": str(job.seq), "dtype": str(job.dtype).replace("torch.", ""),
            "policy_overrides": "; ".join(job.policy_notes) or "none",
            "mlflow.source.git.commit": e["git_commit"], **extra_tags}
    tags.update({f"backend_plan_{b}": job.plan[b] for b in BRANCHES})
    client.log_batch(rid, params=[Param(k, v[:6000]) for k, v in params.items()],
                     tags=[RunTag(k, str(v)) for k, v in tags.items()])


def write_csv(path: Path, rows: list[dict]) -> None:
    """Write rows atomically (temporary file, then rename): a CSV is complete or absent."""
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


@dataclass
class Result:
    rows: list[dict]                                   # the job's CSV, one dict per row
    metrics: dict[str, float]                          # logged at step = seq
    failure: str | None = None                         # set: logged, then the run ends FAILED
    plot: tuple[str, str, str] | None = None           # (x column, y column, series column) for the sweep plot
    tags: dict[str, str] = field(default_factory=dict)  # notes set as run tags (e.g. a baseline skipped, and why)
    texts: dict[str, str] = field(default_factory=dict)  # artifact path -> text (e.g. profiler tables), logged on the run


def _output_dir() -> Path:
    try:
        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:
        return Path.cwd()


def _task_overrides() -> tuple:
    try:
        return tuple(HydraConfig.get().overrides.task)
    except ValueError:
        return ()


def _job_label() -> str:
    """This job's overrides other than seq (tells sweep series apart)."""
    try:
        ov = [o for o in HydraConfig.get().overrides.task if not o.startswith("seq=")]
    except ValueError:
        ov = []
    return " ".join(o for o in ov if o.split("=")[0] not in ("hydra.run.dir", "hydra.sweep.dir"))


# ================================================================================================
# The task body every entry point runs
# ================================================================================================
def run_job(cfg: DictConfig, entry: str, work: Callable[[Job], Result]) -> None:
    t_job0 = time.perf_counter()
    if not STATE.mark:
        STATE.mark = t_job0
    try:
        job = STATE.prepared.pop(_task_overrides(), None) or prepare(cfg, entry)
    except ConfigError as e:
        STATE.config_error = True
        say(f"config error: {e}")
        _remove_empty_output_dir()
        return
    sweep = STATE.parent_id is not None
    idx = len(STATE.jobs) + 1
    head = f"[{entry}] job {idx}/{STATE.n_jobs} seq={job.seq}" if sweep else f"[{entry}] seq={job.seq}"
    t_setup = time.perf_counter()
    fresh = "client" not in _CLIENT
    client, eid = _tracking(job.cfg, entry)
    if fresh:  # importing mlflow and opening the store happen once per process, not per job
        setup = time.perf_counter() - t_setup
        STATE.mark += setup
        say(f"[{entry}] tracking store {_CLIENT['uri']} opened in {setup:.2f} s (once per process)")
    tags = {"mlflow.runName": f"{entry} seq={job.seq}" + (f" {job.branch}" if job.branch != "none" else "")}
    if sweep:
        tags["mlflow.parentRunId"] = STATE.parent_id
    run = client.create_run(eid, tags=tags)
    rid = run.info.run_id
    STATE.open_runs.add(rid)
    status, work_s, rows, plot, err = "FAILED", 0.0, [], None, None
    try:
        _log_start(client, rid, job, {})
        for n in job.policy_notes:
            say(f"{head}: backend policy {n}")
        say(f"{head}: {job.profile_note}; backends {job.plan}; branch_force={job.branch}; {job.device}/{job.cfg.dtype}")
        torch.manual_seed(int(job.cfg.seed))
        if job.device.type == "cpu" and job.profile.get("threads"):
            torch.set_num_threads(int(job.profile.threads))
        with dispatch.record() as rec:
            t0 = time.perf_counter()
            try:
                res = work(job)
            finally:
                work_s = time.perf_counter() - t0
                _log_record(client, rid, rec)
        rows, plot = res.rows, res.plot
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        ms = {**res.metrics, "seq": float(job.seq), "measured_work_s": work_s}
        client.log_batch(rid, metrics=[Metric(k, float(v), now, job.seq) for k, v in ms.items()])
        for k, v in res.tags.items():
            client.set_tag(rid, k, v)
        for path, text in res.texts.items():
            client.log_text(rid, text, path)
        out = _output_dir()
        out.mkdir(parents=True, exist_ok=True)
        csv_path = out / f"{entry}.csv"
        write_csv(csv_path, rows)
        client.log_artifact(rid, str(csv_path))
        client.log_text(rid, OmegaConf.to_yaml(job.cfg, resolve=True), "config.yaml")
        client.log_dict(rid, {**environment(job.dev), "hardware_profile": OmegaConf.to_container(job.profile),
                              "backend_plan": job.plan, "fallback": job.fallback}, "environment.json")
        if res.failure:
            raise JobFailure(res.failure)
        status = "FINISHED"
    except Exception as e:  # noqa: BLE001  (any failure fails this job only; recorded on its run)
        err = f"{type(e).__name__}: {_one_line(e)}"
        say(f"{head}: FAILED: {err}")
        try:
            client.set_tag(rid, "error", err[:5000])
            client.log_text(rid, traceback.format_exc(), "error.txt")
        except Exception as e2:  # noqa: BLE001  (the store itself failing: still end the run below)
            say(f"{head}: could not record the error on the run: {e2}")
    finally:
        if status != "FINISHED":
            STATE.failed += 1
        overhead = time.perf_counter() - STATE.mark - work_s
        try:
            from mlflow.entities import Metric

            client.log_batch(rid, metrics=[Metric("framework_overhead_s", overhead, int(time.time() * 1000), job.seq)])
        except Exception as e2:  # noqa: BLE001  (still end the run below)
            say(f"{head}: could not log framework_overhead_s: {e2}")
        client.set_terminated(rid, status)
        STATE.open_runs.discard(rid)
        STATE.jobs.append({"seq": job.seq, "status": status, "work_s": work_s, "overhead_s": overhead, "rows": rows,
                           "plot": plot, "label": _job_label(), "error": err})
        say(f"{head}: {status} in {time.perf_counter() - STATE.mark:.2f} s (measured work {work_s:.2f} s, "
            f"Hydra+MLflow overhead {overhead:.2f} s) run {rid}")
        STATE.mark = 0.0


class JobFailure(RuntimeError):
    """The job's measurements are logged, and it failed a check (e.g. parity tolerances)."""


def _log_record(client, rid, rec) -> None:
    from mlflow.entities import RunTag

    tags = [RunTag(f"backend_ran_{b}", n) for b, n in rec.ran.items()]
    tags.append(RunTag("backends_ran", ",".join(f"{b}={rec.ran[b]}" for b in BRANCHES if b in rec.ran) or "none"))
    tags.append(RunTag("fallbacks", "; ".join(rec.fallbacks) or "none"))
    client.log_batch(rid, tags=tags)


def _remove_empty_output_dir() -> None:
    """A job stopped by a config error leaves no files: drop Hydra's run dir if it holds only its
    own .hydra/ and log file."""
    try:
        hc = HydraConfig.get()
    except ValueError:
        return
    if hc.mode is not None and str(hc.mode) == "RunMode.MULTIRUN":
        return
    out = Path(hc.runtime.output_dir)
    if out.is_dir() and all(p.name == ".hydra" or p.suffix == ".log" for p in out.iterdir()):
        shutil.rmtree(out, ignore_errors=True)
        try:
            out.parent.rmdir()  # only if now empty
        except OSError:
            pass


# ================================================================================================
# Sweeps: the parent run and the job list, through Hydra's callback hooks
# ================================================================================================
def sweep_overrides(config: DictConfig) -> list[list[str]]:
    """The per-job override lists Hydra's basic sweeper will launch (config params + command line)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{k}={v}" for k, v in (OmegaConf.select(config, "hydra.sweeper.params") or {}).items()]
    params += list(config.hydra.overrides.task)
    parsed = OverridesParser.create().parse_overrides(params)
    return BasicSweeper.split_arguments(parsed, None)[0]


class TrackingCallback(Callback):
    def on_run_start(self, config: DictConfig, **kw) -> None:
        STATE.mark = time.perf_counter()

    def on_multirun_start(self, config: DictConfig, config_name: str | None = None, **kw) -> None:
        from hydra import compose

        t0 = time.perf_counter()
        entry = config.hydra.job.name
        jobs = sweep_overrides(config)
        first = None
        for ov in jobs:  # every job's config, validated before anything starts
            try:
                job_cfg = compose(config_name=config_name, overrides=list(ov))
                j = prepare(job_cfg, entry)
                STATE.prepared[tuple(ov)] = j
                first = first or j
            except Exception as e:  # noqa: BLE001  (any composition/validation error: one line, exit 2)
                _config_exit(f"{e if isinstance(e, ConfigError) else _one_line(e)} [job: {' '.join(ov)}]")
        STATE.n_jobs = len(jobs)
        STATE.sweep_labels = [" ".join(o) for o in jobs]
        client, eid = _tracking(first.cfg, entry)
        values: dict[str, list] = {}
        for ov in jobs:
            for o in ov:
                k, v = o.split("=", 1)
                values.setdefault(k, [])
                if v not in values[k]:
                    values[k].append(v)
        swept = {k: v for k, v in values.items() if len(v) > 1}
        run = client.create_run(eid, tags={"mlflow.runName": f"{entry} sweep " + " ".join(
            f"{k}={','.join(v)}" for k, v in swept.items())})
        STATE.parent_id = run.info.run_id
        STATE.open_runs.add(STATE.parent_id)
        try:
            _log_start(client, STATE.parent_id, first, {"sweep": "parent", "sweep_jobs": str(len(jobs)),
                                                       "seq": ",".join(values.get("seq", [str(first.seq)])),
                                                       "sweep_overrides": " | ".join(STATE.sweep_labels)[:5000]},
                       sweep=swept)
        except Exception as e:  # noqa: BLE001  (the sweep can run without them)
            say(f"[{entry}] could not log the sweep's parameters: {_one_line(e)}")
        STATE.setup_s = time.perf_counter() - t0
        say(f"[{entry}] sweep of {len(jobs)} jobs validated; parent run {STATE.parent_id} "
            f"(store {_CLIENT['uri']}); setup {STATE.setup_s:.2f} s")
        STATE.sweep_t0 = time.perf_counter()
        STATE.mark = STATE.sweep_t0

    def on_job_start(self, config: DictConfig, **kw) -> None:
        if not STATE.mark:
            STATE.mark = time.perf_counter()

    def on_multirun_end(self, config: DictConfig, **kw) -> None:
        if STATE.parent_id is None:
            return
        client = _CLIENT["client"]
        rid, entry = STATE.parent_id, config.hydra.job.name
        status = "FAILED"
        try:
            from mlflow.entities import Metric

            n_bad = sum(j["status"] != "FINISHED" for j in STATE.jobs)
            ov = [j["overhead_s"] for j in STATE.jobs]
            now = int(time.time() * 1000)
            client.log_batch(rid, metrics=[Metric(k, float(v), now, 0) for k, v in {
                "jobs": len(STATE.jobs), "jobs_failed": n_bad, "sweep_wall_s": time.perf_counter() - STATE.sweep_t0,
                "framework_overhead_mean_s": sum(ov) / max(1, len(ov)),
                "framework_overhead_max_s": max(ov, default=0.0)}.items()])
            rows = [{"job_overrides": j["label"], "job_status": j["status"], **r} for j in STATE.jobs for r in j["rows"]]
            shared = set.intersection(*(set(j["label"].split()) for j in STATE.jobs)) if STATE.jobs else set()
            for r in rows:  # the plot tells series apart by what differs between jobs (besides seq)
                r["_series"] = " ".join(o for o in r["job_overrides"].split() if o not in shared)
            out = Path(config.hydra.sweep.dir)
            out.mkdir(parents=True, exist_ok=True)
            if rows:
                write_csv(out / f"{entry}_sweep.csv", [{k: v for k, v in r.items() if k != "_series"} for r in rows])
                client.log_artifact(rid, str(out / f"{entry}_sweep.csv"))
            spec = next((j["plot"] for j in STATE.jobs if j["plot"]), None)
            if spec and rows:
                png = out / f"{entry}_vs_seq.png"
                _plot(rows, spec, png, entry)
                client.log_artifact(rid, str(png))
            if n_bad:
                client.set_tag(rid, "error", f"{n_bad} of {len(STATE.jobs)} jobs failed: " + "; ".join(
                    f"seq={j['seq']} {j['label']}: {j['error']}" for j in STATE.jobs if j["status"] != "FINISHED")[:5000])
            status = "FINISHED" if n_bad == 0 and len(STATE.jobs) == STATE.n_jobs else "FAILED"
            say(f"[{entry}] sweep {status}: {len(STATE.jobs)} jobs, {n_bad} failed, "
                f"{time.perf_counter() - STATE.sweep_t0:.1f} s; Hydra+MLflow overhead per job "
                f"mean {sum(ov) / max(1, len(ov)):.2f} s, max {max(ov, default=0):.2f} s; parent run {rid}")
        finally:
            client.set_terminated(rid, status)
            STATE.open_runs.discard(rid)
            if status != "FINISHED" and STATE.failed == 0:
                STATE.failed += 1


def _plot(rows: list[dict], spec: tuple[str, str, str], path: Path, entry: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    x, y, series = spec
    lines: dict[str, list] = {}
    for r in rows:
        if r.get(y) in (None, "") or r.get("job_status") != "FINISHED":
            continue
        key = str(r[series]) + (f" [{r['_series']}]" if r["_series"] else "")
        lines.setdefault(key, []).append((float(r[x]), float(r[y])))
    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for key, pts in sorted(lines.items()):
        pts.sort()
        dashed = key.startswith("dense")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "--" if dashed else "-", marker="o", label=key)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(f"{entry}: {y} vs {x}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


# ================================================================================================
def launch(main: Callable[[], Any]) -> None:
    """``__main__`` of an entry point: pre-check group options, run Hydra, exit non-zero if any
    job failed (Hydra itself returns normally: jobs catch their errors so a sweep goes on)."""
    precheck_argv(sys.argv[1:])
    main()
    if STATE.config_error:
        raise SystemExit(2)
    if STATE.failed:
        raise SystemExit(1)
