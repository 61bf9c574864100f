"""A sweep (``-m``): expand, validate every job, open the parent run, launch, summarize from the store.

Run by the Hydra sweeper plugin ``hydra_plugins/nsa_sweeper`` (``hydra/sweeper: nsa`` in conf/).
Nothing starts unless every job's config is valid, the sweep's folder (``hydra.sweep.dir``) can be
written and the store and the parent run could be created (one line, exit 2). The contract with launchers and jobs:

* each job gets its overrides plus ``++tracking.uri=<store>`` and ``++tracking.parent_run_id=<parent>``;
  a job logs one child run under that parent, tagged ``sweep_job`` (its overrides, JSON), in
  whatever process or host the launcher (``hydra/launcher``) runs it;
* after the launcher returns, the summary, the sweep's CSV, its charts and the parent's status come
  from the store's children of the parent, so they are the same whatever the launcher;
* ``hydra.sweeper.resume=<parent run id>`` runs only the jobs with no FINISHED child (matched by
  their overrides) into the same parent, after closing its stale RUNNING runs;
* on SLURM (:mod:`.launchers`) each job's device is checked where it runs, the sweep waits for every
  job SLURM holds even where the launcher stopped at one SLURM ended, a child whose job SLURM ended
  ends FAILED with SLURM's state, and an interrupted sweep cancels its jobs.
"""
from __future__ import annotations

import contextlib
import collections
import itertools
import json
import math
import re
import shlex
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .. import progress
from . import cli, launchers, parallel, report, tracking, views
from .config import ConfigError, Job, check_timed_device, error_text, one_line, out_of_space, prepare
from .job import CPU_FIGURES, HEADLINE, TIME_FIGURES, describe, identity, job_key, launcher_name
from .logs import say

_SAFE = re.compile(r"[\w./:@%+-]+")
CANCEL_WAIT_S = 60  # an interrupted sweep waits this long for the SLURM jobs it cancelled to end


MAX_JOBS = cli.MAX_JOBS


def expand(parser, params: dict, arguments: list[str]) -> list[list[str]]:
    """The cartesian product of the sweep's values (``hydra.sweeper.params``, then the command
    line; a key given twice takes the later values), one override list per job; more than
    :data:`MAX_JOBS` is a ConfigError, found before any list or product is built whole."""
    lists: dict[str, list[str]] = {}
    for o in parser.parse_overrides([f"{k}={v}" for k, v in (params or {}).items()] + list(arguments)):
        key = o.get_key_element()
        if o.is_sweep_override():
            if not o.is_discrete_sweep():
                raise ConfigError(f"{o.input_line}: only lists of values sweep (a,b,c, range(), choice(), glob())")
            values = list(itertools.islice(o.sweep_string_iterator(), MAX_JOBS + 1))
            if len(values) > MAX_JOBS:
                raise ConfigError(f"{o.input_line}: more than {MAX_JOBS} values; a sweep runs at most {MAX_JOBS} jobs")
            if not values:
                raise ConfigError(f"{o.input_line}: sweeps no value (glob() matched none of the options)")
            twice = [v for v, n in collections.Counter(values).items() if n > 1]
            if twice:
                raise ConfigError(f"{o.input_line}: {key}={twice[0]} is listed twice; a sweep runs each value once "
                                  "(two jobs would share one run's row and one output folder)")
            lists[key] = [f"{key}={v}" for v in values]
        else:
            lists[key] = [f"{key}={o.get_value_element_as_str()}"]
    n = math.prod(len(v) for v in lists.values())
    if n > MAX_JOBS:
        sizes = " x ".join(f"{len(v)} {k}" for k, v in lists.items() if len(v) > 1)
        raise ConfigError(f"{sizes} = {n} jobs; a sweep runs at most {MAX_JOBS} jobs (sweep fewer values, or split it)")
    return [list(x) for x in itertools.product(*lists.values())]


def varied(jobs: list[list[str]]) -> list[str]:
    """The keys whose value differs between jobs, in command-line order."""
    seen: dict[str, set] = {}
    for ov in jobs:
        for o in ov:
            k, _, v = o.partition("=")
            seen.setdefault(k, set()).add(v)
    return [k for k, vs in seen.items() if len(vs) > 1]


def label(ov: list[str], keys: list[str]) -> str:
    """A job's values of ``keys`` (all its overrides where no key varies)."""
    return " ".join(o for o in ov if o.partition("=")[0] in keys) if keys else " ".join(job_key(ov))


def _check_values(parser, jobs: list[list[str]]) -> None:
    """Each distinct ``key=value`` of the sweep whose key has a type rule (``config.RULES``: seq, the
    sections' counts and switches) checked once, before any job is composed (a composition takes about
    0.1-0.3 s a job): a bad value among a thousand is reported in the first seconds, not after the
    others' compositions. The full validation (:func:`_validate`) follows."""
    from .config import RULES, valid

    seen = set()
    for ov in jobs:
        for o in ov:
            if o in seen:
                continue
            seen.add(o)
            key = o.partition("=")[0]
            if key not in RULES:
                continue
            try:
                v = parser.parse_override(o).value()
            except HydraException:
                continue  # the composition reports it
            if isinstance(v, str) and v.startswith("${"):
                continue  # an interpolation: checked resolved, by the full validation
            if not valid(OmegaConf.create({"v": v}).v if isinstance(v, list) else v, RULES[key]):
                cli.config_exit(f"{key}={v!r}: must be {RULES[key]} [job: {' '.join(ov)}]")


def _validate(sweeper, jobs: list[list[str]], entry: str) -> list[Job]:
    """Every job's config, composed as its launcher will and validated, before anything starts (the
    device match and the backends' availability where the jobs run here; the entry's own check where its
    ``launch`` was given one)."""
    loader, out, here = sweeper.hydra_context.config_loader, [], launchers.runs_jobs_here(sweeper.launcher)
    check = cli.launched_check(entry)  # the entry's own rules, as its launch() passed them
    tasks = launchers.tasks_per_job(sweeper.launcher)
    if len(jobs) > 20:  # about 0.1-0.3 s a job: say what the wait is
        say(f"[{entry}] validating {len(jobs)} jobs' configs before any starts")
    for ov in jobs:
        try:
            cfg = loader.load_sweep_config(sweeper.config, list(ov))
            cp = OmegaConf.select(cfg, "parallel.cp", default=1)
            dp = OmegaConf.select(cfg, "parallel.dp", default=1)
            if (isinstance(cp, int) and cp > 1 or isinstance(dp, int) and dp > 1 or tasks > 1
                    or parallel.torchrun_world() is not None and (entry in parallel.TRAINS or parallel.torchrun_world() > 1)):
                parallel.check(cp, entry, sweep=True, dp=dp, tasks=tasks)  # over processes: SLURM's tasks only
            if here:
                check_timed_device(cfg, entry)
            out.append(prepare(cfg, entry, here=here, check=check))
        except ConfigError as e:
            cli.config_exit(f"{e} [job: {' '.join(ov)}]")
        except (HydraException, OmegaConfBaseException) as e:
            cli.config_exit(f"{cli.hydra_message(e)} [job: {' '.join(ov)}]")
    return out


def _show(sweeper, jobs: list[list[str]]) -> None:
    """``-m ... --cfg job|hydra|all [--resolve]``: each job's config, as Hydra's --cfg prints one."""
    for i, ov in enumerate(jobs):
        c = sweeper.hydra_context.config_loader.load_sweep_config(sweeper.config, list(ov))
        OmegaConf.set_struct(c, False)
        if sweeper.show == "job":
            del c["hydra"]
        elif sweeper.show == "hydra":
            c = OmegaConf.create({"hydra": c.hydra})
        print(f"# job {i}: {' '.join(ov)}\n{OmegaConf.to_yaml(c, resolve=bool(sweeper.show_resolve))}")


def _quote(v: str) -> str:
    if _SAFE.fullmatch(v):
        return v
    if "'" in v or "\\" in v:
        cli.config_exit(f"tracking.uri={v!r}: a sweep passes it to each job; it may not hold quotes or backslashes")
    return f"'{v}'"


def run_sweep(sweeper, arguments: list[str]) -> list:
    t0 = time.perf_counter()
    from hydra.core.override_parser.overrides_parser import OverridesParser

    cfg = sweeper.config
    entry = cfg.hydra.job.name
    try:
        jobs = expand(OverridesParser.create(config_loader=sweeper.hydra_context.config_loader), sweeper.params,
                      arguments)
    except ConfigError as e:
        cli.config_exit(str(e))
    except HydraException as e:
        cli.config_exit(cli.hydra_message(e))
    if sweeper.show:
        return _show(sweeper, jobs)
    _check_values(OverridesParser.create(), jobs)
    prepared = _validate(sweeper, jobs, entry)
    cli.check_writable("hydra.sweep.dir", str(cfg.hydra.sweep.dir))  # before the store and the parent run
    try:
        store = tracking.connect(prepared[0].cfg.tracking, entry, Path(cfg.hydra.runtime.cwd))
    except ConfigError as e:
        cli.config_exit(str(e))
    keys = varied(jobs)
    if sweeper.resume:
        parent, todo = _resume(store, str(sweeper.resume), jobs)
    else:
        parent, todo = _new_parent(store, entry, prepared[0], jobs, keys, launcher_name(cfg.hydra)), jobs
    sweep_dir = Path(cfg.hydra.sweep.dir)
    resume = resume_command(entry, parent, sweep_dir, cfg.hydra.sweep)
    returns, failure, ends, slurm = [], None, {}, launchers.SlurmLaunch.of(sweeper.launcher)
    try:
        say(f"[{entry}] sweep of {len(jobs)} jobs validated" + (f", {len(todo)} to run" if sweeper.resume else "")
            + f"; store {store.describe()}; parent run {parent}; outputs {sweep_dir}")
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, sweep_dir / "multirun.yaml")
        extra = [f"++tracking.uri={_quote(store.uri)}", f"++tracking.parent_run_id={parent}",
                 *dirname_overrides(cfg, jobs, keys, sweeper.job_dirname)]
        try:
            with progress.bar(len(todo), f"[{entry}] sweep", "job") as shown, _follow(shown, store, parent):
                returns = sweeper.launcher.launch([ov + extra for ov in todo], initial_job_idx=0) if todo else []
        except Exception as e:  # noqa: BLE001  (a launcher's failure, e.g. a job the scheduler killed: summarized below)
            if slurm is not None and launchers.left_no_result(e):
                say(f"[{entry}] a SLURM job left no result ({one_line(e)[:160]}...); waiting for the others")
            elif out_of_space(e):  # e.g. a job's folder or config: one line, not the traceback
                failure = f"the launcher failed: {error_text(e)} (it writes the jobs' folders in {sweep_dir})"
                say(f"[{entry}] {failure}")
            else:
                failure = f"the launcher failed: {type(e).__name__}: {one_line(e)}"
                say(traceback.format_exc().rstrip())
        if slurm is not None:  # every job SLURM still holds, and how SLURM ended each
            ends = {frozenset(job_key(ov)): end for ov, end in zip(todo, slurm.wait())}
        _finish(store, parent, entry, jobs, keys, sweep_dir, t0, failure, ends, resume)
    except KeyboardInterrupt as e:
        _interrupted(store, parent, entry, slurm, e)
        print(f"resume:  {resume}", flush=True)
        raise
    return returns


FOLLOW_S = 2.0  # how often a sweep's progress bar reads its children's states from the store


@contextlib.contextmanager
def _follow(shown, store, parent: str) -> Iterator[None]:
    """While the launcher runs, the sweep's bar (``shown``, not disabled) counts its jobs whose runs have
    ended, read from the store every FOLLOW_S seconds: the same for jobs in this process, in others (local_gpus)
    or on other hosts (SLURM). A read that fails (the store busy) is tried again at the next tick."""
    if shown.disable:
        yield
        return

    def ended() -> int:
        return sum(r.info.status != "RUNNING" for r in tracking.children(store.client, store.experiment_id, parent))

    before, stop = ended(), threading.Event()  # before: a resumed sweep's jobs that ended earlier

    def poll() -> None:
        while not stop.wait(FOLLOW_S):
            try:
                shown.update(max(0, min(shown.total, ended() - before) - shown.n))
            except Exception:  # noqa: BLE001  (the bar only: the sweep's summary reads the store again)
                continue

    t = threading.Thread(target=poll, name="sweep-progress", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def _bare(key: str) -> str:
    """An override's key as Hydra's override_dirname compares it: no +, ++ or ~, no @package."""
    return key.lstrip("+~").split("@")[0]


def dirname_overrides(cfg, jobs: list[list[str]], keys: list[str], mode: str) -> list[str]:
    """``hydra.sweeper.job_dirname=swept``: each job's ``hydra.job.override_dirname``, which names its folder
    (``hydra.sweep.subdir``), leaves out the overrides every job shares (``hardware=cpu``), so a folder says
    what differs (``0_backend.win=sdpa,branch_force=cmp``); ``all``, or no key that varies: unchanged."""
    if mode == "all" or not keys:
        return []
    if mode != "swept":
        cli.config_exit(f"hydra.sweeper.job_dirname={mode!r}: must be swept or all")
    shared = sorted({_bare(o.partition("=")[0]) for ov in jobs for o in ov} - {_bare(k) for k in keys})
    exclude = [*cfg.hydra.job.config.override_dirname.exclude_keys, *shared]
    return ["hydra.job.config.override_dirname.exclude_keys=[" + ",".join(f"'{k}'" for k in exclude) + "]"]


NAME_MAX = 255  # bytes of one path component on Linux and macOS file systems


def job_dirname(name: str, limit: int = NAME_MAX) -> str:
    """``name`` (a job folder named by its overrides, ``hydra.job.override_dirname``) if it fits one path
    component, else its first bytes and a hash of the whole: the same overrides give the same folder (a
    resumed sweep finds its checkpoints), different ones different folders. Resolver ``nsa_dirname``.
    A value's "/" is written %2F (and "%" %25): one path component, so a value with ".." in it
    (``tracking.experiment=x/../../y``) names a folder inside the sweep's, not one above it."""
    return report.shortened(name.replace("%", "%25").replace("/", "%2F"), limit)


def register() -> None:
    if not OmegaConf.has_resolver("nsa_dirname"):
        OmegaConf.register_new_resolver("nsa_dirname", job_dirname)


def resume_command(entry: str, parent: str, sweep_dir: Path, sweep_cfg=None) -> str:
    """The command that runs the sweep's unfinished jobs into the same parent: this one's arguments with
    ``hydra.sweeper.resume=<parent>``, and ``hydra.sweep.dir=<this sweep's folder>`` where each job's
    folder is named by its overrides (a train job continues from the checkpoint in it). Where job folders
    are numbered (``hydra.job.num``) a new folder is used: a resumed sweep numbers its jobs anew, and a
    job would write into another's folder."""
    subdir = OmegaConf.to_container(sweep_cfg, resolve=False).get("subdir") if sweep_cfg else "hydra.job.num"
    args = [a for a in sys.argv[1:] if "sweeper.resume" not in a]
    if "hydra.job.num" not in str(subdir):
        args = [a for a in args if a.partition("=")[0].lstrip("+~") != "hydra.sweep.dir"] + [f"hydra.sweep.dir={sweep_dir}"]
    return shlex.join(["python", "-m", f"experiments.{entry}", *args, f"hydra.sweeper.resume={parent}"])


def _interrupted(store, parent: str, entry: str, slurm, e: KeyboardInterrupt) -> None:
    """SIGINT/SIGTERM while the sweep runs: SLURM's jobs of the sweep cancelled (waited for a while),
    the runs still RUNNING and the parent ended KILLED. The caller prints the command that resumes it."""
    why = cli.interrupt_reason(e)
    cancelled = slurm.cancel() if slurm is not None else []
    if cancelled:
        why += f"; the sweep cancelled SLURM jobs {', '.join(j.job_id for j in cancelled)}"
        say(f"[{entry}] {why}; waiting up to {CANCEL_WAIT_S} s for them to end")
        slurm.wait_ended(cancelled, CANCEL_WAIT_S)
    running = [*tracking.children(store.client, store.experiment_id, parent), store.client.get_run(parent)]
    for rid in [r.info.run_id for r in running if r.info.status == "RUNNING"]:  # the parent last
        try:
            tracking.end_run(store.client, rid, "KILLED", why)
            cli.note_closed(e, rid)
        except tracking.StoreError as err:
            say(f"[{entry}] {err}")


def _new_parent(store, entry: str, first: Job, jobs: list[list[str]], keys: list[str], launcher: str) -> str:
    values = {k: [] for k in keys}
    for ov in jobs:
        for o in ov:
            k, _, v = o.partition("=")
            if k in values and v not in values[k]:
                values[k].append(v)
    params, tags = describe(first, {})
    params = {k: v for k, v in params.items() if k not in values and k.split(".")[0] not in values}
    params.update({f"sweep.{k}": ",".join(v) for k, v in values.items()})
    if any(_bare(k).split(".")[0] in ("backend", "hardware") for k in values):  # the first job's plan only
        tags.pop("backend_plan", None)  # each child has its own
    tags.update({"sweep": "parent", "sweep_jobs": str(len(jobs)), "launcher": launcher,
                 "seq": ",".join(values.get("seq", [str(first.seq)])),
                 "sweep_overrides": " | ".join(" ".join(ov) for ov in jobs),
                 "sweep_command": " ".join(["python", "-m", f"experiments.{entry}", *sys.argv[1:]])})
    name = f"{entry} sweep " + " ".join([*_fixed(first, values), *(f"{k}={','.join(v)}" for k, v in values.items())])
    from mlflow.exceptions import MlflowException

    try:
        rid = tracking.start_run(store, name, None, {"sweep": "parent"})
    except (MlflowException, OSError) as e:  # no parent: the sweep must not start
        cli.config_exit(f"tracking store {store.uri}: cannot create the sweep's parent run: {tracking.hide(one_line(e))}")
    try:
        tracking.log_batch(store.client, rid, params=params, tags=tags)
    except (MlflowException, OSError) as e:
        tracking.end_run(store.client, rid, "FAILED", f"could not log the sweep's parameters: {one_line(e)}")
        cli.config_exit(f"tracking store {store.uri}: cannot write the sweep's parent run: {tracking.hide(one_line(e))}")
    return rid


def _fixed(first: Job, swept: dict) -> list[str]:
    """What the sweep's jobs share and a parent's name should say (two sweeps of the same lists on other
    hardware, models or backends are told apart): :func:`job.identity`, each part unless swept. A hardware
    or backend option that resolved to another name says both (``auto(cpu)`` beside ``cpu``)."""
    def said(k, v):
        chosen = first.choices.get(k) if k in ("hardware", "backend") else None
        return f"{chosen}({v})" if chosen and chosen != v else str(v)

    return [said(k, v) for k, v in identity(first) if v and k not in swept]


def _resume(store, rid: str, jobs: list[list[str]]) -> tuple[str, list[list[str]]]:
    """Take over the sweep ``rid``: close its stale runs, and return the jobs with no FINISHED child."""
    from mlflow.exceptions import MlflowException

    try:
        run = store.client.get_run(rid)
    except MlflowException:
        cli.config_exit(f"hydra.sweeper.resume={rid}: no such run in {store.uri}")
    if run.info.experiment_id != store.experiment_id or run.data.tags.get("sweep") != "parent":
        cli.config_exit(f"hydra.sweeper.resume={rid}: not a sweep's parent run in experiment {store.experiment}")
    if run.info.status == "RUNNING" and not tracking.stale(run):
        where = f"process {run.data.tags.get('pid', '?')} on {run.data.tags.get('host', '?')}"
        cli.config_exit(f"hydra.sweeper.resume={rid}: the sweep is still RUNNING ({where}); stop it, or close it "
                        f"with: {tracking.close_stale_command(store.uri, rid)}")
    for r, what in tracking.close_stale(store.client, rid):
        say(f"[resume] run {r}: {what}")
    done = {frozenset(json.loads(r.data.tags.get("sweep_job", "[]")))
            for r in tracking.children(store.client, store.experiment_id, rid) if r.info.status == "FINISHED"}
    tracking.reopen(store.client, rid)
    return rid, [ov for ov in jobs if frozenset(job_key(ov)) not in done]


def _latest(store, parent: str, jobs: list[list[str]]) -> list:
    """Per job, its latest child run of ``parent`` in the store (None: it never started)."""
    latest: dict[frozenset, object] = {}
    for r in sorted(tracking.children(store.client, store.experiment_id, parent), key=lambda r: r.info.start_time):
        latest[frozenset(json.loads(r.data.tags.get("sweep_job", "[]")))] = r
    return [latest.get(frozenset(job_key(ov))) for ov in jobs]


def _rows(store, entry: str, jobs: list[list[str]], runs: list, keys: list[str], stored) -> tuple[list[dict], object]:
    """The jobs' CSV rows from their runs' artifacts (with job_overrides, job_status, run_id, and the
    ``_series`` the charts tell lines apart by), and the charts the jobs named. Each child is renamed
    after the values that vary in the sweep (through ``stored``, which reports a store that fails)."""
    from mlflow.exceptions import MlflowException

    rows, charts = [], None
    with tempfile.TemporaryDirectory() as tmp, _quiet_downloads():
        for ov, r in zip(jobs, runs):
            if r is None:
                continue
            stored(store.client.set_tag, r.info.run_id, "mlflow.runName", f"{entry} {label(ov, keys)}")
            try:
                got = report.read_csv(Path(store.client.download_artifacts(r.info.run_id, f"{entry}.csv", tmp)))
            except (MlflowException, OSError):  # a job that failed before writing its CSV
                got = []
            series = " ".join(o for o in ov if o.partition("=")[0] in keys and o.partition("=")[0] != "seq")
            rows += [{"job_overrides": " ".join(ov), "job_status": r.info.status, "run_id": r.info.run_id, **row,
                      "_series": series} for row in got]
            if charts is None and "charts" in r.data.tags:
                charts = report.Charts.from_tag(r.data.tags["charts"])
    return rows, charts


@contextlib.contextmanager
def _quiet_downloads() -> Iterator[None]:
    """MLflow's bar for each artifact it downloads (tqdm, drawn even where stderr is no terminal): off while
    the summary reads the jobs' CSVs (a few KB each), through MLflow's own switch."""
    from mlflow.environment_variables import MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR as bars

    was = bars.get_raw()
    bars.set("false")
    try:
        yield
    finally:
        bars.unset() if was is None else bars.set(was)


def _curves(store, jobs: list[list[str]], runs: list, keys: list[str], ys) -> dict:
    """``by_step`` charts: y -> line label -> the (step, value) history of metric y on the job's run.
    A label is the job's values of the keys that vary (one key: its value alone, e.g. ``nsa``)."""
    out: dict[str, dict] = {y: {} for y in ys}
    for ov, r in zip(jobs, runs):
        if r is None:
            continue
        lab = label(ov, keys).partition("=")[2] if len(keys) == 1 else label(ov, keys)
        for y in ys:
            pts = sorted((m.step, m.value) for m in store.client.get_metric_history(r.info.run_id, y))
            if pts:
                out[y][lab] = pts
    return out


def _table(jobs: list[list[str]], runs: list, keys: list[str]) -> str:
    """The summary: per job the values that vary, status, headline metrics, run id."""
    heads = sorted({k for r in runs if r for k in r.data.metrics if k.startswith(HEADLINE)})
    return report.table(["#", *(keys or ["job"]), "status", *(h[len(HEADLINE):] for h in heads), "run id"], [
        [str(i), *([o.partition("=")[2] for o in ov if o.partition("=")[0] in keys] if keys else [label(ov, keys)]),
         r.info.status if r else "not run", *(report.fmt(r.data.metrics.get(h, "")) if r else "" for h in heads),
         r.info.run_id if r else ""] for i, (ov, r) in enumerate(zip(jobs, runs))])


def _not_run(ends: dict, ov: list[str]) -> str:
    end = ends.get(frozenset(job_key(ov)))
    return "not run" + (f" ({launchers.reason(*end)})" if end else "")


def _finish(store, parent: str, entry: str, jobs: list[list[str]], keys: list[str], sweep_dir: Path,
            t0: float, failure: str | None = None, ends: dict | None = None, resume: str | None = None) -> None:
    """The sweep's results, from the store: its CSV, charts (an image, and metrics stepped by x on the
    parent), the summary; the parent ends FINISHED, or FAILED with the counts (exit 1). The launcher
    has returned, so a child still RUNNING lost its process: it ends FAILED, and so does one that ended
    itself KILLED on the SIGTERM of a scheduler that ended its job; the reason is the scheduler's
    (``ends``: per job key, its SLURM job id and state) where there is one. A file of the sweep that
    cannot be written (a full disk) is said in one line and fails the parent; the summary is printed
    all the same."""
    cli.raise_if_interrupted()  # not FINISHED on a signal Python dropped
    ends, unstored = ends or {}, []

    def stored(write, *args) -> None:  # a store that fails (a full disk): said once; the summary goes on
        try:
            with tracking.writing(store.client):
                write(*args)
        except tracking.StoreError as e:
            if not unstored:
                say(f"[{entry}] the sweep's results are not all in the store: {e}")
            unstored.append(str(e))

    runs = _latest(store, parent, jobs)
    for ov, r in zip(jobs, runs):
        end = ends.get(frozenset(job_key(ov)))
        by_slurm = end is not None and end[1].split(" ")[0] in launchers.ENDS
        if r is None or not (r.info.status == "RUNNING" or (by_slurm and r.info.status == "KILLED")):
            continue
        why = launchers.reason(*end) if end else failure or "the job ended without ending its run (its process was killed?)"
        if r.info.status == "KILLED":
            why += f" (the job: {r.data.tags.get('error', 'KILLED')})"
        stored(tracking.end_run, store.client, r.info.run_id, "FAILED", why)
    runs = _latest(store, parent, jobs)
    rows, charts = _rows(store, entry, jobs, runs, keys, stored)
    by_step = bool(charts) and charts.kind == "by_step"
    data = _curves(store, jobs, runs, keys, charts.ys) if by_step else report.lines(rows, charts) if charts and rows else {}
    series = [(report.metric_name(y, lab), v, x) for y, ls in data.items() for lab, pts in ls.items() for x, v in pts]
    text = _table(jobs, runs, keys)
    artifacts, problems, view = [], [failure] if failure else [], []
    try:  # a full disk: said in one line; the summary is still printed and the store still updated
        if rows:
            report.write_csv(sweep_dir / f"{entry}_sweep.csv", [{k: v for k, v in r.items() if k != "_series"} for r in rows])
            artifacts.append(sweep_dir / f"{entry}_sweep.csv")
        if len({x for _, _, x in series}) > 1:  # a curve needs two x values
            png = sweep_dir / f"{entry}_{'by_step' if by_step else 'vs_seq'}.png"
            report.plot(data, "step" if by_step else charts.x, png, entry, log=not by_step)
            artifacts.append(png)
        report.write_text(sweep_dir / "summary.txt", text + "\n")
        artifacts.append(sweep_dir / "summary.txt")
    except OSError as e:
        problems.append(f"the sweep's files could not be written: {error_text(e)}")
        say(f"[{entry}] {problems[-1]}")
    bad = [(ov, r) for ov, r in zip(jobs, runs) if r is None or r.info.status != "FINISHED"]
    status = "FAILED" if bad else "FINISHED"
    overheads = [r.data.metrics["framework_overhead_s"] for r in runs if r and "framework_overhead_s" in r.data.metrics]
    mean_ov, max_ov = sum(overheads) / max(1, len(overheads)), max(overheads, default=0.0)
    wall = time.perf_counter() - t0  # the figure the console reports, too
    where, placed = launchers.placement(runs, int((time.time() - wall) * 1000))
    try:
        stored(tracking.log_batch, store.client, parent, {
            "jobs": len(jobs), "jobs_failed": len(bad), "sweep_wall_s": wall,
            "framework_overhead_mean_s": mean_ov, "framework_overhead_max_s": max_ov, **placed})
        stored(lambda: tracking.log_series(store.client, parent, tracking.unlogged(store.client, parent, series)))
        if series:  # the view that draws every row of a column on one chart, a run (colour, name) per line
            stored(lambda: view.append(views.publish(store, parent, data, "step" if by_step else charts.x)))
        for a in artifacts:
            stored(store.client.log_artifact, parent, str(a))
    finally:
        error = f"{len(bad)} of {len(jobs)} jobs failed: " + "; ".join(
            f"{' '.join(ov)}: " + (r.data.tags.get("error", r.info.status) if r else _not_run(ends, ov)) for ov, r in bad)
        problems += unstored[:1]
        if problems:
            status, error = "FAILED", "; ".join([*problems, error])
        try:
            tracking.end_run(store.client, parent, status, error if status == "FAILED" else None)
        except tracking.StoreError as e:
            say(f"[{entry}] {e}")
    say(f"[{entry}] sweep {status}: {len(jobs)} jobs, {len(bad)} failed, {wall:.1f} s; Hydra+MLflow overhead per "
        f"job mean {mean_ov:.2f} s, max {max_ov:.2f} s; parent run {parent}")
    say(f"[{entry}] {where}")
    page = next((p for p in view if p), None)
    print(f"{text}\noutputs: {sweep_dir}\nMLflow:  {store.ui_hint(page)}")
    if entry in TIME_FIGURES and any(r is not None and r.data.tags.get("device_type") == "cpu" for r in runs):
        print(CPU_FIGURES)
    if status == "FAILED":
        print(f"resume:  {resume or resume_command(entry, parent, sweep_dir)}")
        raise SystemExit(1)
