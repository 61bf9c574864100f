"""The command line of every entry point: argument order, checks before Hydra starts, signals, exit codes.

``__main__`` of an entry point calls :func:`launch`. Exit codes: 0 all jobs FINISHED; 1 a job
failed (its run FAILED, the sweep went on); 2 a configuration error (one line, nothing started);
130 / 143 interrupted by SIGINT / SIGTERM (the runs ended KILLED, one line).

Overrides may stand on both sides of ``-m``: Hydra's argument parser takes them in one place only,
so :func:`normalize` moves them in front of the flags. Flags that show instead of running (``--help``,
``--info``) drop ``-m`` and the sweep's lists; ``-m ... --cfg job`` prints each job's config through
the sweeper (``hydra.sweeper.show``).
"""
from __future__ import annotations

import itertools
import re
import shlex
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException


from .. import env as launch_env
from .config import CONF_DIR, groups
from .logs import say

MULTIRUN = ("-m", "--multirun")
MAX_JOBS = 10_000  # the jobs of one sweep: each is composed and validated before any starts (0.1-0.3 s a job)
SHOW_ONLY = ("-h", "--help", "--hydra-help", "-i", "--info", "-sc", "--shell-completion")
NO_RUN = (*SHOW_ONLY, "-c", "--cfg")  # flags that print instead of running: no output folder is made
OTHER_CONFIG = ("-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir", "--experimental-rerun")


def config_exit(msg: str):
    say(f"config error: {msg}")
    launch_env.record_elastic_error(f"config error: {msg}")  # torchrun's summary names it as the root cause
    raise SystemExit(2)


def hydra_message(e: BaseException) -> str:
    """Hydra's and OmegaConf's multi-line errors on one line, without their boilerplate."""
    skip = ("full_key:", "object_type=", "See https://hydra.cc", "reference_type=")
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.strip().startswith(skip)]
    return " ".join(" ".join(lines).split())


# ================================================================================================
# Signals: SIGINT and SIGTERM end the runs (KILLED, with the reason) instead of leaving them RUNNING
# ================================================================================================
class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised where the process is; ``closed`` collects the runs ended on the way out."""

    def __init__(self, signame: str, code: int):
        super().__init__(signame)
        self.signame, self.code, self.closed = signame, code, []


def interrupt_reason(e: BaseException) -> str:
    return f"interrupted by {getattr(e, 'signame', 'SIGINT')}"


def note_closed(e: BaseException, rid: str) -> None:
    if isinstance(e, Interrupted):
        e.closed.append(rid)


_pending: Interrupted | None = None  # the signal received, until launch() ends on it


def _on_signal(signum, _frame):
    global _pending
    # Closing the runs on the way out must not itself be interrupted by a second Ctrl-C.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _pending = Interrupted(signal.Signals(signum).name, 128 + signum)
    raise _pending


def raise_if_interrupted() -> None:
    """Raise again a signal's exception that Python dropped. A handler runs in whatever Python code the main
    thread is in: inside a finalizer or weakref callback (the garbage collector's, e.g. SQLAlchemy's) the
    exception is printed as "Exception ignored" and the process goes on, its handlers already ignoring
    signals. Jobs call this where they pass often (each timed call, each training step) and before a run
    ends FINISHED, so the signal still ends the runs KILLED."""
    if _pending is not None:
        raise _pending


def install_signal_handlers() -> None:
    """In the main thread, where SIGINT/SIGTERM still have Python's defaults (a launcher's own
    handlers are kept), and SIGTERM in a SLURM job: SLURM sends it before SIGKILL (scancel, the time
    limit, preemption), and submitit's handler there ignores it, which would leave the run RUNNING.
    (submitit's SIGUSR2 handler, its time-limit warning, is kept.)"""
    if threading.current_thread() is not threading.main_thread():
        return
    slurm = launch_env.slurm_job_id() is not None
    for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
        if signal.getsignal(sig) in (default, _on_signal) or (slurm and sig == signal.SIGTERM):
            signal.signal(sig, _on_signal)


# ================================================================================================
# Arguments
# ================================================================================================
def _is_override(tok: str) -> bool:
    return not tok.startswith("-") and ("=" in tok or tok.startswith("~"))


def _is_sweep(parser, tok: str) -> bool:
    try:
        return parser.parse_override(tok).is_sweep_override()
    except HydraException:
        return False  # reported by precheck


def normalize(argv: list[str]) -> list[str]:
    """Overrides first (wherever they stood), then Hydra's flags in their order."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = [t for t in argv if _is_override(t)]
    flags = [t for t in argv if not _is_override(t)]
    if not any(f in MULTIRUN for f in flags):
        return overrides + flags
    if any(f in SHOW_ONLY for f in flags):  # help and info describe the config, not a sweep
        parser = OverridesParser.create()
        return [o for o in overrides if not _is_sweep(parser, o)] + [f for f in flags if f not in MULTIRUN]
    for opt in ("-c", "--cfg"):  # -m --cfg job: each job's config, printed by the sweeper
        if opt in flags:
            i = flags.index(opt)
            what = flags[i + 1] if i + 1 < len(flags) else "job"
            del flags[i:i + 2]
            overrides.append(f"hydra.sweeper.show={what}")
    if "--resolve" in flags:
        flags.remove("--resolve")
        overrides.append("hydra.sweeper.show_resolve=true")
    return overrides + flags


def override(key: str, value: str) -> str:
    """``key=value`` as a shell word that Hydra reads back as this value: the value in Hydra's quotes where
    its grammar would read it otherwise (a comma makes a sweep, ``=`` and brackets do not parse), then
    quoted for the shell (a space, a quote), so a printed command pastes back as printed."""
    if not re.fullmatch(r"[\w./@%+~ -]*", value) or value != value.strip():
        # Hydra's quoted string: a backslash escapes only before a quote (or the closing one)
        value = "'" + re.sub(r"(\\*)('|$)", lambda m: m[1] * 2 + ("\\" + m[2] if m[2] else ""), value) + "'"
    return shlex.quote(f"{key}={value}")


def config_dirs(argv: list[str]) -> list[Path]:
    """The directories of ``-cd DIR`` / ``--config-dir DIR`` / ``--config-dir=DIR``."""
    out = []
    for i, a in enumerate(argv):
        if a in ("-cd", "--config-dir") and i + 1 < len(argv):
            out.append(Path(argv[i + 1]))
        elif a.startswith("--config-dir="):
            out.append(Path(a.split("=", 1)[1]))
    return out


def precheck(argv: list[str], entry: str) -> None:
    """Before Hydra: every override parses, group options exist, the config composes with the
    overrides that are not sweeps (the sweeper checks each job's), and a single run's folder
    (``hydra.run.dir``) can be written. One line and exit 2 otherwise."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    known = groups()
    for extra in config_dirs(argv):  # -cd DIR: its options too (e.g. a hardware profile experiments.validate wrote)
        for g, opts in groups(extra).items() if extra.is_dir() else ():
            known[g] = sorted(set(known.get(g, [])) | set(opts))
    parser = OverridesParser.create()
    plain, multirun = [], any(a in MULTIRUN for a in argv)
    for arg in (a for a in argv if _is_override(a)):
        try:
            ov = parser.parse_override(arg)
        except HydraException as e:
            config_exit(f"{arg}: {hydra_message(e)}")
        key = ov.get_key_element().lstrip("+~")
        if not ov.is_sweep_override():
            vals = [ov.get_value_element_as_str()]
        elif not ov.is_discrete_sweep() or key not in known and key != "hydra/launcher":
            vals = []  # the sweeper reports a sweep it cannot run and bounds the lists (sweep.expand)
        else:
            vals = list(itertools.islice(ov.sweep_string_iterator(), MAX_JOBS + 1))
        if key in known:
            for v in vals:
                if v not in known[key]:
                    what = "backend" if key == "backend" else f"{key} option"
                    extra = " (one branch: backend.sel=<name>)" if key == "backend" else ""
                    config_exit(f"{key}={v}: unknown {what}; choose one of {', '.join(known[key])}{extra}")
        if key == "hydra/launcher":
            for v in vals:
                _launcher_installed(v)
        if ov.is_sweep_override():
            if not multirun:
                config_exit(f"{arg}: a list of values is a sweep; add -m (python -m experiments.{entry} -m {arg})")
        else:
            plain.append(arg)
    if any(a in OTHER_CONFIG for a in argv):
        return  # another config than conf/<entry>.yaml: Hydra composes it
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name=entry):
            chosen = [a for a in plain if parser.parse_override(a).get_key_element().lstrip("+~") in known]
            base = compose(config_name=entry, overrides=chosen)
            for arg in (a for a in argv if _is_override(a)):
                _known_key(parser.parse_override(arg).get_key_element(), arg, base, known, entry)
            cfg = compose(config_name=entry, overrides=plain, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as e:
        config_exit(hydra_message(e))
    if not multirun and not any(a in NO_RUN for a in argv):  # a sweep checks hydra.sweep.dir itself
        try:
            run_dir = str(cfg.hydra.run.dir)
        except OmegaConfBaseException:  # resolved by Hydra alone (e.g. from the job's overrides)
            return
        check_writable("hydra.run.dir", run_dir)


# The launchers that come with an extra: option -> (the module Hydra loads, the extra)
EXTRA_LAUNCHERS = {"slurm": ("hydra_plugins.hydra_submitit_launcher", "cluster"),
                   "per_gpu": ("hydra_plugins.hydra_submitit_launcher", "cluster")}


def _launcher_installed(option: str) -> None:
    """``hydra/launcher=<option>`` whose plugin is not installed: one line naming the extra (Hydra would say only
    that it could not load the launcher's config)."""
    import importlib.util

    if option not in EXTRA_LAUNCHERS:
        return
    module, extra = EXTRA_LAUNCHERS[option]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        config_exit(f"hydra/launcher={option}: needs the {extra} extra (Hydra's submitit launcher, {module}): "
                    f"pip install -e '.[{extra}]'")


def check_writable(key: str, folder: str) -> None:
    """Files can be created in ``folder``, or where it does not exist yet, in the nearest folder above
    it (where it will be made). A real write, not a look at permission bits: a read-only filesystem
    refuses root too. One line and exit 2 otherwise, before anything is created."""
    at = Path(folder).absolute()
    while not at.exists() and at != at.parent:
        at = at.parent
    if not at.is_dir():
        config_exit(f"{key}={folder}: {at} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=at):
            pass
    except OSError as e:
        config_exit(f"{key}={folder}: cannot write in {at}: {e.strerror}")


def _keys(cfg, prefix: str = "") -> list[str]:
    """Every key of a config, dotted (sections and leaves)."""
    from omegaconf import DictConfig

    out = []
    for k in cfg.keys() if isinstance(cfg, DictConfig) else ():
        out.append(prefix + str(k))
        out += _keys(cfg._get_node(k), f"{prefix}{k}.")
    return out


def _known_key(key: str, arg: str, base, known: dict, entry: str) -> None:
    """An override of a key the entry's config does not have (with or without + or ++) is refused, with
    the nearest keys: Hydra would append it (``+key=v``), and the run would ignore it. A ``+`` below a
    known section stays allowed (``+hardware.policy.by_seq=...``: the section checks its own keys), and
    so does any key below a section without OmegaConf's struct flag (``tuning.<op>.<key>``, checked by
    its entry point)."""
    import difflib

    from omegaconf import DictConfig, OmegaConf

    name = key.lstrip("+~")
    top = name.split(".")[0].split("/")[0]  # hydra/launcher=..: Hydra's own groups
    if top == "hydra" or name in known:
        return
    if top in base:
        if key[0] in "+~" or OmegaConf.select(base, name, default=_MISSING) is not _MISSING:
            return
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):  # a section without the struct flag takes new keys (tuning.<op>.*)
            node = OmegaConf.select(base, ".".join(parts[:i]), default=None)
            if isinstance(node, DictConfig) and not OmegaConf.is_struct(node):
                return
    depth = name.count(".")  # keys at the same depth: a typo keeps its section
    keys = [k for k in dict.fromkeys(_keys(base) + list(known)) if k.count(".") == depth]
    near = difflib.get_close_matches(name, keys, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(near)}?" if near else f"; its keys: {', '.join(str(k) for k in base.keys())}"
    config_exit(f"{arg}: the {entry} config has no key {name!r}{hint}")


_MISSING = object()


def mask_passwords(argv: list[str]) -> list[str]:
    """``tracking.uri=http://user:PW@host`` as ``tracking.uri=http://user:***@host``: Hydra, and so the run's
    params, config.yaml, logs and ``.hydra/`` files, never see the password; this process keeps the URI
    itself for its client (``tracking.masked``). The command line itself lost it at the interpreter's start
    (``experiments.env.reexec_without_passwords``)."""
    from . import tracking

    out = []
    for a in argv:
        logins: dict[str, str] = {}
        out.append(launch_env.mask_override(a, logins) if _is_override(a) else a)
        for uri in logins.values():
            tracking.masked(uri)
    return out


# entry -> the config check its launch() was given, while that launch runs its main (launched_check).
_checks: dict[str, Callable[[Any], Any]] = {}


def launched_check(entry: str) -> Callable[[Any], Any] | None:
    """The config check ``launch`` was given for ``entry``, while it runs the entry's main: Hydra runs a sweep
    inside that main, and the sweep validates every job with it before any starts. None otherwise."""
    return _checks.get(entry)


def launch(main: Callable[[], Any], entry: str, check: Callable[[Any], Any] | None = None) -> None:
    """``__main__`` of an entry point: arguments in Hydra's order, pre-checks, signals, exit codes.
    ``check(job)``: the entry's own config rules, the function its main passes to ``run_job``; a sweep
    (``-m``) checks every job with it before any starts."""
    global _pending
    from . import parallel

    parallel.pin_device()  # a torchrun rank's own GPU before anything touches CUDA
    argv = mask_passwords(normalize(sys.argv[1:]))
    precheck(argv, entry)
    sys.argv[1:] = argv
    install_signal_handlers()
    if check is not None:
        _checks[entry] = check
    try:
        main()
        raise_if_interrupted()  # dropped where no job passed a check since (e.g. the sweep's summary)
    except KeyboardInterrupt as e:
        from .tracking import ENDED, close_open

        noted = getattr(e, "closed", []) + close_open("KILLED", interrupt_reason(e))
        closed, left = [r for r in noted if r in ENDED], [r for r in noted if r not in ENDED]
        ended = f"run(s) {', '.join(closed)} ended KILLED" if closed else ""
        if left:  # the store did not take the end (its line above says when and how to close them)
            ended += ("; " if ended else "") + f"run(s) {', '.join(left)} left RUNNING: the store did not end them"
        say(f"[{entry}] {interrupt_reason(e)}: {ended or 'no run was open'}")
        raise SystemExit(getattr(e, "code", 130)) from None
    finally:
        _checks.pop(entry, None)
        _pending = None
