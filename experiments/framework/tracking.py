"""MLflow: which store, opening it safely, the experiment, runs and the tags every run carries.

The store is ``tracking.uri`` if set, else ``$MLFLOW_TRACKING_URI`` (as MLflow itself does), else
``sqlite:///<launch dir>/mlflow.db``. :func:`connect` checks it once, up front, and fails in seconds
with one line (:class:`StoreUnavailable`, exit code 2) naming the URI and the cause. A SQLite store is
created or upgraded by one process at a time, under an exclusive ``flock`` on ``<db>.lock`` beside
it: MLflow's schema migration is not safe against a second process doing the same (two first sweeps
on a new store lost runs and left ``_alembic_tmp_*`` tables behind).

Every run records the process that owns it (tags ``host``, ``pid``, ``process``; in a SLURM job also
``slurm_job_id``), so a run left RUNNING by a process that was killed (SIGKILL, a lost node) can be
told apart from a live one: :func:`stale` and :func:`close_stale` (``python -m experiments.close_stale``).
"""
from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import importlib.metadata
import logging
import os
import platform
import re
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

import nsa
from nsa.toolchain import check_toolchain

from .. import env as launch_env

from . import launchers
from .config import REPO, ConfigError, one_line, out_of_space
from .hardware import Device
from .logs import say

SQLITE = "sqlite:///"
PROBE_TIMEOUT_S = 5  # no retry: the first request to a tracking server, every request once one went unanswered,
#                     and the runs closed on the way out (a signal, an exit)
# MLflow's own retries otherwise (its defaults: 7 retries of 120 s): a request to a server that stops answering
# gives up within about 40 s (3 tries of 10 s, 2 + 4 s of backoff), and the job fails in one line.
HTTP_RETRIES, HTTP_TIMEOUT_S = 2, 10
_UNANSWERED: set[int] = set()  # id() of the clients whose server refused or did not answer a request
# The UI opens an experiment in the runs (model training) view, not the GenAI traces view: the
# experiment tag MLflow 3's UI reads (mlflow/server/js: "mlflow.experimentKind"), and the URL parameter
# that wins over it in 3.17's UI.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
DESCRIPTION = "mlflow.note.content"  # an experiment's description in MLflow's UI
UI_VIEW = "runs?workflowType=machine_learning&compareRunsMode=CHART"  # the runs' chart view, not GenAI's


class StoreUnavailable(ConfigError):
    """The tracking store cannot be opened or written (one line, exit code 2, before any run)."""


class StoreError(RuntimeError):
    """A write to the tracking store failed once runs were open (e.g. its disk is full): the message
    names the store and the cause, in one line."""


@dataclass
class Store:
    uri: str
    origin: str                  # where the URI came from: tracking.uri, MLFLOW_TRACKING_URI, default
    client: Any                  # mlflow.MlflowClient
    experiment_id: str
    experiment: str
    artifact_root: str | None = None  # tracking.artifact_root: where a new experiment's artifacts go

    def describe(self) -> str:
        return f"{self.uri} ({self.origin}), experiment {self.experiment}"

    def ui_hint(self, page: str | None = None) -> str:
        """How to look at this experiment: the command to start the UI, then the page to open (``page``:
        one of its pages, e.g. a sweep's view; default the experiment's chart view)."""
        page = page or f"#/experiments/{self.experiment_id}/{UI_VIEW}"
        if self.uri.startswith(("http://", "https://")):
            return f"open {self.uri.rstrip('/')}/{page}"
        return f"mlflow ui --backend-store-uri {self.uri}  # then open http://127.0.0.1:5000/{page}"


MASK = launch_env.MASK
# A URI as printed (its password masked) -> the URI itself: this process's memory, and the environment of the
# processes it starts (experiments/env.py: NSA_TRACKING_LOGINS, readable by this user only).
_SECRETS: dict[str, str] = launch_env.tracking_logins()


def _remember(printed: str, uri: str) -> None:
    _SECRETS[printed] = uri
    launch_env.export_tracking_logins({printed: uri})
    _hide_in_logs()
    launch_env.suppress_mlflow_run_urls()


def masked(uri: str) -> str:
    """``uri`` with the password of its user info (``http://user:PW@host``) written ``***``: what the project
    prints, logs and records (Hydra's files, params, config.yaml, logs, stdout). The URI itself is kept in
    this process's memory and environment, for :func:`open_client` only; a URI without a password is returned
    as it is."""
    safe, password = launch_env.mask_uri(uri)
    if password is not None:
        _remember(safe, uri)
    return safe


def hide(text: str) -> str:
    """``text`` with every password :func:`masked` has seen written ``***`` (e.g. MLflow's errors, which
    quote the URI it requested)."""
    from urllib.parse import unquote, urlsplit

    for uri in _SECRETS.values():
        pw = urlsplit(uri).password  # as written in the URI (percent-encoded), and decoded
        for form in sorted({pw, unquote(pw)}, key=len, reverse=True):
            text = text.replace(form, MASK)
    return text


class _HideSecrets(logging.Filter):
    """On every log handler: a record's text with the passwords hidden (MLflow logs its run URLs)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _SECRETS:
            text = record.getMessage()
            safe = hide(text)
            if safe != text:
                record.msg, record.args = safe, ()
        return True


def _hide_in_logs() -> None:
    for lg in (logging.getLogger(), logging.getLogger("mlflow")):
        for h in lg.handlers:
            if not any(isinstance(f, _HideSecrets) for f in h.filters):
                h.addFilter(_HideSecrets())


def _server(uri: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of an http(s) URI: what a login is scoped to."""
    from urllib.parse import urlsplit

    p = urlsplit(uri)
    return p.scheme, (p.hostname or "").lower(), p.port or {"http": 80, "https": 443}.get(p.scheme)


def scoped_login(uri: str, credentials: str | None, launch_dir: Path) -> str:
    """``uri`` with the login of ``tracking.credentials`` where that file names this server
    (``mlflow_tracking_uri``: the same scheme, host and port): the URI the client uses, kept in this
    process's memory (:data:`_SECRETS`, under ``uri`` as printed). A file for another server, or none:
    ``uri`` unchanged, no login sent. MLflow's global credentials (its environment variables,
    ``~/.mlflow/credentials``) are the user's own choice and left as MLflow reads them."""
    import configparser
    from urllib.parse import quote, urlsplit, urlunsplit

    if not credentials or not uri.startswith(("http://", "https://")) or urlsplit(uri).username:
        return uri
    path = Path(credentials) if Path(credentials).is_absolute() else launch_dir / credentials
    if not path.is_file():
        return uri
    cp = configparser.ConfigParser(interpolation=None)
    try:
        cp.read(path)
        sec = cp["mlflow"]
        owner, user, pw = (sec.get(k) for k in ("mlflow_tracking_uri", "mlflow_tracking_username",
                                                "mlflow_tracking_password"))
    except (OSError, configparser.Error, KeyError) as e:
        raise ConfigError(f"tracking.credentials={credentials}: not MLflow's credentials format ({one_line(e)})") from e
    if not owner or not user or not pw:
        raise ConfigError(f"tracking.credentials={credentials}: needs mlflow_tracking_uri, mlflow_tracking_username "
                          "and mlflow_tracking_password in its [mlflow] section (the login is sent to that server only)")
    if _server(owner) != _server(uri):
        return uri
    p = urlsplit(uri)
    _remember(uri, urlunsplit(p._replace(netloc=f"{quote(user, safe='')}:{quote(pw, safe='')}@{p.netloc}")))
    return uri


def resolve_uri(t: DictConfig, launch_dir: Path) -> tuple[str, str]:
    """(uri, origin) for the ``tracking`` config; a password in the URI masked (:func:`masked`), the login of
    ``tracking.credentials`` added for its own server only (:func:`scoped_login`)."""
    if t.get("uri"):
        return scoped_login(masked(str(t.uri)), t.get("credentials"), launch_dir), "tracking.uri"
    if launch_env.mlflow_tracking_uri():
        return (scoped_login(masked(launch_env.mlflow_tracking_uri()), t.get("credentials"), launch_dir),
                "MLFLOW_TRACKING_URI")
    if t.get("name") == "server":
        raise ConfigError("tracking=server: set tracking.uri=http://host:port or MLFLOW_TRACKING_URI")
    return f"{SQLITE}{launch_dir / 'mlflow.db'}", "default: mlflow.db in the launch directory"


def close_stale_command(uri: str, rid: str) -> str:
    """The ``experiments.close_stale`` line for run ``rid`` of store ``uri`` (as printed), ``--force``: the store
    named where it is not the command's default (this directory's mlflow.db), a login left to its credentials
    file (``--credentials``, as tracking=server) and never written into the line."""
    from urllib.parse import urlsplit, urlunsplit

    where = ""
    if uri != f"{SQLITE}{Path.cwd() / 'mlflow.db'}" or launch_env.mlflow_tracking_uri():
        p = urlsplit(uri)
        bare = urlunsplit(p._replace(netloc=p.netloc.rsplit("@", 1)[-1])) if p.scheme.startswith("http") else uri
        where = f" --tracking-uri {shlex.quote(bare)}"
    return f"python -m experiments.close_stale {rid}{where} --force"


def _cause(e: BaseException) -> str:
    """The useful end of a store error: an OS error number and text where there is one (passwords hidden)."""
    text = hide(one_line(e)).split(" [SQL: ")[0]  # SQLAlchemy's message goes on with the statement and its values
    m = re.search(r"\[Errno -?\d+\][^'\")]*", text)
    return m.group(0).strip() if m else text


def store_error(uri: str, e: BaseException) -> str:
    """One line for a failed store request: the store, and the cause (a full disk named so)."""
    return hide(f"tracking store {uri}: {out_of_space(e) or _cause(e)}")


@contextlib.contextmanager
def writing(client):
    """Store requests in the block: an error of the store (MLflow's, or an OS error of its files) raises
    :class:`StoreError` in one line."""
    from mlflow.exceptions import MlflowException

    try:
        with launch_env.mlflow_http_probe(PROBE_TIMEOUT_S) if id(client) in _UNANSWERED else contextlib.nullcontext():
            yield
    except KeyboardInterrupt:  # a signal during a request: what is sent on the way out, one try each
        _UNANSWERED.add(id(client))
        raise
    except (MlflowException, OSError) as e:
        if _server_down(e):  # what this process still sends there: one try each, PROBE_TIMEOUT_S
            _UNANSWERED.add(id(client))
        raise StoreError(store_error(masked(str(getattr(client, "tracking_uri", "?"))), e)) from e


class _StoreErrorsOnce(logging.Filter):
    """MLflow's SQL store logs each database error with its traceback before raising it; the error is
    then reported once, in one line, by whoever made the request (a full disk: one line per write, not
    a traceback per write)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("SQLAlchemy database error")


@contextlib.contextmanager
def _store_lock(uri: str):
    """Exclusive flock on ``<db>.lock`` for a SQLite store (no lock elsewhere)."""
    if not uri.startswith(SQLITE):
        yield
        return
    db = Path(uri[len(SQLITE):])
    if not db.parent.is_dir():
        raise StoreUnavailable(f"tracking store {uri}: directory {db.parent} does not exist")
    try:
        fd = os.open(f"{db}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise StoreUnavailable(f"tracking store {uri}: cannot write in {db.parent}: {e.strerror}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if db.exists() and not os.access(db, os.W_OK):
            raise StoreUnavailable(f"tracking store {uri}: {db} is not writable")
        yield
    finally:
        os.close(fd)  # releases the lock


_CLIENTS: dict[str, Any] = {}
_STORES: dict[tuple[str, str], Store] = {}


def open_client(uri: str):
    """An MlflowClient on ``uri``, the store checked (and a SQLite one created) once per process."""
    if uri not in _CLIENTS:
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        db_log = logging.getLogger("mlflow.store.db.utils")
        if not any(isinstance(f, _StoreErrorsOnce) for f in db_log.filters):
            db_log.addFilter(_StoreErrorsOnce())

        launch_env.limit_mlflow_http(HTTP_RETRIES, HTTP_TIMEOUT_S)
        if uri in _SECRETS:  # a login inherited (NSA_TRACKING_LOGINS): hidden here too
            _hide_in_logs()
            launch_env.suppress_mlflow_run_urls()
        try:
            with _store_lock(uri), launch_env.mlflow_http_probe(PROBE_TIMEOUT_S):
                client = MlflowClient(tracking_uri=_SECRETS.get(uri, uri))  # the URI itself, password and all
                client.search_experiments(max_results=1)  # creates or checks the schema; reaches a server
        except (MlflowException, OSError) as e:
            raise StoreUnavailable(f"tracking store {uri}: {_cause(e)}") from e
        _CLIENTS[uri] = client
    return _CLIENTS[uri]


def connect(t: DictConfig, entry: str, launch_dir: Path) -> Store:
    """The store and experiment for the ``tracking`` config, checked and created once per process."""
    uri, origin = resolve_uri(t, launch_dir)
    name = t.get("experiment") or f"nsa-{entry}"
    if (uri, name) not in _STORES:
        from mlflow.exceptions import MlflowException

        client = open_client(uri)
        try:
            with _store_lock(uri):
                eid = _experiment(client, uri, name, t.get("artifact_root"))
        except (MlflowException, OSError) as e:
            raise StoreUnavailable(f"tracking store {uri}: {_cause(e)}") from e
        _STORES[(uri, name)] = Store(uri, origin, client, eid, name, t.get("artifact_root"))
    return _STORES[(uri, name)]


def sibling(store: Store, name: str) -> str:
    """The id of experiment ``name`` in ``store``'s store, created like ``store``'s own (kind tag, artifact
    root) if missing; MLflow's errors propagate (the caller reports them, e.g. through :func:`writing`)."""
    return _experiment(store.client, store.uri, name, store.artifact_root)  # the schema exists: no lock


def artifact_folder(name: str) -> str:
    """The folder of experiment ``name``'s artifacts under the artifact root: the name where it is one plain
    path component, else its letters, digits and ``._-`` (others as ``_``) and a hash of the whole name, so
    that no name (``x/../../y``, ``..``) leaves the root and different names keep different folders."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    if safe == name and name.strip(".") and not name.startswith("."):
        return name
    return f"{safe.lstrip('.') or 'experiment'}_{hashlib.sha1(name.encode()).hexdigest()[:12]}"


def describe_experiment(name: str) -> str:
    """An experiment's description: what its runs are (a sweep's line runs in ``<experiment>-lines``)."""
    if name.endswith("-lines"):
        return (f"The line runs of the sweeps in {name[:-len('-lines')]}: one run per line of a sweep's charts (tag "
                "sweep_parent: the sweep's parent run), which its chart view shows; the jobs' runs are there.")
    entry = name.removeprefix("nsa-")
    return (f"Runs of python -m experiments.{entry}: one run per job (its config as params, its figures as metrics, its "
            "table and charts as artifacts); a sweep's jobs are nested under its parent run.")


def _experiment(client, uri: str, name: str, root: str | None) -> str:
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        if root is None and uri.startswith(SQLITE):
            root = (Path(uri[len(SQLITE):]).parent / "mlruns").resolve().as_uri()
        try:
            return client.create_experiment(name, artifact_location=f"{root}/{artifact_folder(name)}" if root else None,
                                            tags={**EXPERIMENT_KIND, DESCRIPTION: describe_experiment(name)})
        except MlflowException:  # created meanwhile by another process (a server store: no lock)
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if "mlflow.experimentKind" not in exp.tags and exp.lifecycle_stage == "active":
        client.set_experiment_tag(exp.experiment_id, *next(iter(EXPERIMENT_KIND.items())))
    if DESCRIPTION not in exp.tags and exp.lifecycle_stage == "active":  # one made before descriptions, or by MLflow
        client.set_experiment_tag(exp.experiment_id, DESCRIPTION, describe_experiment(name))
    return exp.experiment_id


# ================================================================================================
# What ran, where: environment tags and the owning process
# ================================================================================================
def _git(*args) -> str:
    try:
        r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=False)
        return r.stdout.strip() if r.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def git_state() -> dict[str, str]:
    """This project's commit and dirty flag; empty where the project is not its own git repository
    (a copy inside another repository must not report that repository's commit)."""
    top = _git("rev-parse", "--show-toplevel")
    if not top or Path(top).resolve() != REPO:
        return {}
    commit = _git("rev-parse", "HEAD")
    if not commit:
        return {}
    dirty = "true" if _git("status", "--porcelain", "--untracked-files=no") else "false"
    return {"git_commit": commit, "git_dirty": dirty, "mlflow.source.git.commit": commit}


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _process_start(pid: int) -> str:
    """Boot id and start time (clock ticks since boot) of a process on this host: with the pid, an
    identity no later process has. "" where /proc is not there."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
        return f"{boot}:{stat.rsplit(')', 1)[1].split()[19]}"
    except (OSError, IndexError):
        return ""


def process_tags() -> dict[str, str]:
    """The process that owns a run, the SLURM job it belongs to and the GPUs it may use (the last two
    where set: ``slurm_job_id``, ``cuda_visible_devices``)."""
    pid = os.getpid()
    tags = {"host": platform.node(), "pid": str(pid), "process": f"{pid}:{_process_start(pid)}"}
    for key, value in (("slurm_job_id", launch_env.slurm_job_id()), ("cuda_visible_devices", launch_env.cuda_visible_devices())):
        if value is not None:
            tags[key] = value
    return tags


_ENV: dict = {}


def environment(dev: Device) -> dict:
    """Versions, device and source state of this process (cached)."""
    if not _ENV:
        _ENV.update({
            "python_version": platform.python_version(),
            "torch_version": torch.__version__,
            "triton_version": _version("triton"),
            "cuda_version": torch.version.cuda or "none",
            "flash_attn_version": _version("flash-attn"),
            "mlflow_version": _version("mlflow"),
            "hydra_version": _version("hydra-core"),
            "nsa_version": nsa.__version__,
            "toolchain": launch_env.toolchain_id() or check_toolchain(),
            **git_state(),
        })
    return {**_ENV, **process_tags(), "device_type": dev.type, "device_name": dev.name,
            "device_capability": f"{dev.capability[0]}.{dev.capability[1]}" if dev.capability else "none",
            "device_driver": dev.driver or "none", "device_count": str(dev.count)}


def log_batch(client, rid: str, metrics: dict[str, float] | None = None, step: int = 0,
              params: dict[str, str] | None = None, tags: dict[str, str] | None = None) -> None:
    """Metrics (at ``step``), params and tags in as few store calls as MLflow allows (1000 metrics, 100 params and
    100 tags a call). A step's metrics go in one call up to 1000 of them; past that, the first metric goes in the last
    call, so that a reader who takes a step as logged once its first metric is stored (a resumed training's
    ``loss``) never meets a step whose other metrics were lost to a failed call."""
    from mlflow.entities import Metric, Param, RunTag

    now = int(time.time() * 1000)
    ms = [Metric(k, float(v), now, step) for k, v in (metrics or {}).items()]
    ps = [Param(k, str(v)[:6000]) for k, v in (params or {}).items()]
    ts = [RunTag(k, str(v)[:5000]) for k, v in (tags or {}).items()]
    if len(ms) > 1000:
        ms = ms[1:] + ms[:1]
    calls = max(-(-len(ms) // 1000), -(-len(ps) // 100), -(-len(ts) // 100), 1)
    for i in range(calls):
        client.log_batch(rid, metrics=ms[i * 1000:(i + 1) * 1000], params=ps[i * 100:(i + 1) * 100],
                         tags=ts[i * 100:(i + 1) * 100])


def log_series(client, rid: str, points: list[tuple[str, float, int]]) -> None:
    """Metrics at their own steps: (key, value, step), e.g. a chart's line over seq."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    ms = [Metric(k, float(v), now, int(step)) for k, v, step in points]
    for i in range(0, len(ms), 1000):  # MLflow's limit: 1000 metrics per call
        client.log_batch(rid, metrics=ms[i:i + 1000])


def unlogged(client, rid: str, points: list[tuple[str, float, int]]) -> list[tuple[str, float, int]]:
    """The (key, value, step) points run ``rid`` does not hold yet (a resumed sweep logged the others)."""
    have = {(k, m.value, m.step) for k in {k for k, _, _ in points} for m in client.get_metric_history(rid, k)}
    return [p for p in points if p not in have]


# ================================================================================================
# Runs this process holds open, and closing them whatever happens
# ================================================================================================
_OPEN: dict[str, Any] = {}  # run id -> client


def start_run(store: Store, name: str, parent: str | None = None, tags: dict | None = None) -> str:
    t = {"mlflow.runName": name, **process_tags(), **(tags or {})}
    if parent:
        t["mlflow.parentRunId"] = parent
    rid = store.client.create_run(store.experiment_id, tags=t).info.run_id
    _OPEN[rid] = store.client
    return rid


ENDED: set[str] = set()  # the runs this process ended (set_terminated answered)


def end_run(client, rid: str, status: str, error: str | None = None) -> None:
    """End a run (FINISHED, FAILED, KILLED); ``error`` is recorded as its ``error`` tag first. Where the
    store fails (a full disk), the status is still tried, then :class:`StoreError` raised."""
    failed = None
    if error:
        try:
            with writing(client):
                client.set_tag(rid, "error", error[:5000])
        except StoreError as e:
            failed = e
    try:
        with writing(client):
            client.set_terminated(rid, status)
        ENDED.add(rid)
    except StoreError as e:
        raise StoreError(f"{e}; run {rid} could not be ended {status} ({when_back(e)}: "
                         f"python -m experiments.close_stale {rid})") from e
    finally:
        _OPEN.pop(rid, None)
    if failed:
        raise StoreError(f"{failed}; run {rid} ended {status} without its reason") from failed


UNREACHABLE = ("Connection refused", "Failed to establish a new connection", "Name or service not known",
               "No route to host", "Network is unreachable", "timed out")


def when_back(e: BaseException) -> str:
    """When a run the store failed to end can be closed, by what failed: a full disk, a server that refused
    or did not answer the connection, or another store error."""
    if out_of_space(e):
        return "once the store has room"
    if _server_down(e):
        return "the tracking server refused or did not answer the connection; once it answers again"
    return "once the store works again"


def _server_down(e: BaseException | None) -> bool:
    """Whether ``e`` (or an error it came from) is a tracking server that refused, dropped or did not answer
    the connection."""
    seen, text = set(), ""
    while e is not None and id(e) not in seen:  # the message and every error it came from
        seen.add(id(e))
        text += f" {e}"
        if isinstance(e, ConnectionError):
            return True
        e = e.__cause__ or e.__context__
    return any(s in text for s in UNREACHABLE)


def reopen(client, rid: str) -> None:
    """A run taken over (a resumed sweep's parent, a resumed job's run): RUNNING again, owned by this
    process, without the error its earlier end recorded."""
    client.update_run(rid, status="RUNNING")
    if "error" in client.get_run(rid).data.tags:
        client.delete_tag(rid, "error")
    log_batch(client, rid, tags=process_tags())
    _OPEN[rid] = client


def close_open(status: str, reason: str) -> list[str]:
    """End every run this process still holds (an interrupt, an exit): the ids closed."""
    closed = []
    for rid, client in list(_OPEN.items()):
        try:
            _UNANSWERED.add(id(client))  # on the way out: one try of PROBE_TIMEOUT_S a request
            end_run(client, rid, status, reason)
            closed.append(rid)
        except Exception as e:  # noqa: BLE001  (keep closing the others; the run stays for close_stale)
            _OPEN.pop(rid, None)
            hint = "" if "close_stale" in str(e) else f"; {when_back(e)}: python -m experiments.close_stale {rid}"
            say(f"could not close run {rid}: {one_line(e)}{hint}")
    return closed


atexit.register(close_open, "KILLED", "the process exited without ending this run")


# ================================================================================================
# Stale runs: RUNNING in the store, their process gone
# ================================================================================================
def stale(run) -> bool | None:
    """True: RUNNING and its process is gone; False: ended, or its process lives; None: it ran on
    another host (or recorded no process), so this host cannot tell. A run of a SLURM job is judged by
    SLURM's accounting, from any host that has it: stale once its job ended."""
    if run.info.status != "RUNNING":
        return False
    t = run.data.tags
    if t.get("slurm_job_id") and (ended := launchers.slurm_ended(t["slurm_job_id"])) is not None:
        return ended
    if t.get("host") != platform.node() or not t.get("process", "").split(":", 1)[-1]:
        return None
    pid = int(t["pid"])
    return t["process"] != f"{pid}:{_process_start(pid)}"


def children(client, experiment_id: str, parent: str) -> list:
    return client.search_runs([experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent}'",
                              max_results=50000)


def close_stale(client, rid: str, force: bool = False) -> list[tuple[str, str]]:
    """Close run ``rid`` and its children where they are stale (``force``: also those this host
    cannot judge). Returns (run id, what was done) for every run that was RUNNING."""
    run = client.get_run(rid)
    done = []
    for r in [run, *children(client, run.info.experiment_id, rid)]:
        if r.info.status != "RUNNING":
            continue
        s = stale(r)
        where = f"process {r.data.tags.get('pid', '?')} on {r.data.tags.get('host', '?')}" + (
            f" (SLURM job {r.data.tags['slurm_job_id']})" if "slurm_job_id" in r.data.tags else "")
        if s or (s is None and force):
            why = "is gone" if s else "could not be checked from this host (closed with --force)"
            end_run(client, r.info.run_id, "KILLED", f"stale: {where} {why}")
            done.append((r.info.run_id, f"closed (KILLED): {where} {why}"))
        else:
            done.append((r.info.run_id, f"left RUNNING: {where} " + (
                "is alive" if s is False else "cannot be checked from this host (--force closes it)")))
    return done
