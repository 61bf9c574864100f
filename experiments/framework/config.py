"""Validation: everything about a job's config that can be checked before a run starts.

:func:`prepare` turns a composed config into a :class:`Job` (hardware profile resolved, backends
after the profile's policy and checked available here, NSAConfig built, dtype chosen) or raises
:class:`ConfigError` with one line naming the field and the rule. Only configuration errors are
ConfigErrors: anything else raised here is a bug and keeps its traceback.
"""
from __future__ import annotations

import errno
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import nsa
from nsa import dispatch, env
from nsa.dispatch import BRANCHES
from nsa.numerics import DTYPES
from nsa.toolchain import ToolchainError, check_toolchain

from . import hardware
from .errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
CONF_DIR = REPO / "conf"
ENTRIES = ("decode", "prefill", "parity", "kernels", "validate", "train", "generate")  # experiments.<entry>
# Entry points whose figures are timings: a GPU profile's settings (dtype, threads, policy, peaks) time
# nothing meaningful on a CPU, so these refuse one there (check_timed_device).
TIMED = ("decode", "prefill", "kernels", "train", "generate")


class ResourceLimit(RuntimeError):
    """A job needs more than limits.* allow (fails that job only)."""


@dataclass
class Job:
    entry: str
    cfg: DictConfig              # resolved, with the concrete hardware profile
    nsa: nsa.NSAConfig | None    # model.nsa; None where the config has no model (train: its lm)
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
    out_dir: Path | None = None  # the job's output directory (set by run_job)
    run: Any = None              # the job's tracking run, job.Run (set by run_job before work runs)
    cp: Any = None               # parallel.cp > 1: this rank's parallel.Group (set by run_job before work runs)
    choices: dict = field(default_factory=dict)  # the config groups' options it composed (backend=sdpa), if known


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def out_of_space(e: BaseException | None) -> str | None:
    """"no space left on device" (or the quota's words) where ``e``, or an error it came from, says the
    disk is full; SQLite's "database or disk is full" too. None otherwise."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return os.strerror(e.errno).lower()
        if "database or disk is full" in str(e):
            return "no space left on device (SQLite: database or disk is full)"
        e = e.__cause__ or e.__context__
    return None


def error_text(e: BaseException) -> str:
    """A failure in one line: ``<type>: <message>``; a full disk as ``<file>: no space left on device``
    (the message alone where it already says so, e.g. a checkpoint's)."""
    full = out_of_space(e)
    if full and isinstance(e, OSError) and e.errno:  # the OS's own error
        return f"{e.filename}: {full}" if e.filename else full
    if full and full.split(" (")[0] in str(e).lower():
        return one_line(e)
    return f"{type(e).__name__}: {one_line(e)}"


# Typed keys of each section (checked where the section exists: decode.* only for the decode entry).
PEERS = ("fla",)  # public NSA kernels with a row in decode (experiments/peers.py)
PREFILL_PEERS = ("fla", "flash_nsa")  # and in prefill
_INT0, _INT1 = "an integer >= 0 (at most 2**63 - 1, torch's int64)", "an integer >= 1 (at most 2**63 - 1, torch's int64)"
_BOOL, _POSITIVE = "true or false", "a number > 0"
_POSITIVE_OR_NULL = "a number > 0, or null (what the device has free)"
# Timing repeats and times: bounded, so that no value typed makes a job run for days.
MAX_REPEATS, MAX_MS = 10_000, 60_000
_REPEATS0, _REPEATS1 = f"an integer from 0 to {MAX_REPEATS}", f"an integer from 1 to {MAX_REPEATS}"
_MS = f"a number > 0 and at most {MAX_MS} (ms)"
_PEERS = f"a list of peer names from: {', '.join(PEERS)}"
_PREFILL_PEERS = f"a list of peer names from: {', '.join(PREFILL_PEERS)}"
_PEER_NAMES = {_PEERS: PEERS, _PREFILL_PEERS: PREFILL_PEERS}  # rule -> the names it allows
RULES = {
    "seq": _INT1, "seed": _INT0, "streams": _BOOL, "limits.max_memory_gib": _POSITIVE_OR_NULL, "parallel.cp": _INT1,
    "parallel.dp": _INT1,
    "decode.batch": _INT1, "decode.warmup": _REPEATS0, "decode.repeats": _REPEATS1, "decode.fill_tokens": _INT1,
    "decode.per_branch": _BOOL, "decode.cuda_graph": _BOOL, "decode.ragged": _BOOL, "decode.graph_reps": _REPEATS1,
    "decode.peers": _PEERS,
    "prefill.peers": _PREFILL_PEERS,
    "prefill.batch": _INT1, "prefill.warmup": _REPEATS0, "prefill.repeats": _REPEATS1, "prefill.per_branch": _BOOL,
    "prefill.backward": _BOOL, "prefill.dense_flash": _BOOL, "prefill.profile": _BOOL,
    "parity.batch": _INT1, "parity.max_tie_rows": _INT0,
    "kernels.batch": _INT1, "kernels.warmup_ms": _MS, "kernels.rep_ms": _MS, "kernels.cpu_repeats": _REPEATS1,
    "kernels.check_seq": _INT1, "kernels.backward": _BOOL, "kernels.once": _BOOL, "kernels.peers": _BOOL,
}
TOLERANCES = ("max_abs", "rel_l2", "index_mismatch", "near_tie_rel")  # parity.tol.<dtype>.<name>: numbers >= 0


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def valid(v, rule: str) -> bool:
    if rule == _BOOL:
        return isinstance(v, bool)
    if rule in _PEER_NAMES:
        return isinstance(v, ListConfig) and all(x in _PEER_NAMES[rule] for x in v)
    if rule == _POSITIVE_OR_NULL and v is None:
        return True
    if rule in (_POSITIVE, _POSITIVE_OR_NULL, _MS):
        return (_is_int(v) or isinstance(v, float)) and 0 < v <= (MAX_MS if rule == _MS else math.inf)
    if rule in (_REPEATS0, _REPEATS1):
        return _is_int(v) and (1 if rule == _REPEATS1 else 0) <= v <= MAX_REPEATS
    return _is_int(v) and (1 if rule == _INT1 else 0) <= v <= 2**63 - 1


def typed_key(cfg: DictConfig, key: str) -> str:
    """The key a user types for ``key``: the source of its interpolation where its value is one (``decode.batch``
    is ``${model.batch}``), else ``key``."""
    parent, _, last = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if isinstance(node, DictConfig) and OmegaConf.is_interpolation(node, last):
        m = re.fullmatch(r"\$\{([\w.]+)\}", str(OmegaConf.to_container(node, resolve=False)[last]))
        if m:
            return m.group(1)
    return key


def check_types(cfg: DictConfig, raw: DictConfig | None = None) -> None:
    """Every key of RULES (and the parity tolerances) has a value of its type and range in the resolved ``cfg``;
    an error names the key the user types (``typed_key`` of ``raw``, the config before resolution)."""
    missing = object()
    for key, rule in RULES.items():
        if "." in key and key.split(".")[0] not in cfg:
            continue
        v = OmegaConf.select(cfg, key, default=missing)
        if v is missing:
            raise ConfigError(f"{key}: missing; must be {rule}")
        if not valid(v, rule):
            raise ConfigError(f"{typed_key(cfg if raw is None else raw, key)}={v!r}: must be {rule}")
    if "parity" not in cfg:
        return
    ref = cfg.parity.get("ref_dtype")
    if ref is not None and ref not in DTYPES:
        raise ConfigError(f"parity.ref_dtype={ref!r}: one of {', '.join(DTYPES)}, or null (float64 on CPU, float32 on GPU)")
    for dname, tol in cfg.parity.tol.items():
        for k in TOLERANCES:
            v = tol.get(k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ConfigError(f"parity.tol.{dname}.{k}={v!r}: must be a finite number >= 0")


def tuning_overrides(cfg: DictConfig) -> dict:
    """The job's ``tuning`` node as a plain dict ({} where the entry point has none)."""
    return OmegaConf.to_container(cfg.tuning, resolve=True) if "tuning" in cfg else {}


def check_tuning(node: DictConfig) -> None:
    """``tuning`` ({op: {key: value}}, applied with ``nsa.backends.triton.tuning.overrides``): every op,
    key and value known to ``tuning.validate``."""
    from nsa.backends.triton import tuning

    try:
        tuning.validate(OmegaConf.to_container(node, resolve=True))
    except ValueError as e:
        raise ConfigError(one_line(e)) from e


def branches_used(entry: str, branch: str) -> tuple[str, ...]:
    """The branches whose backend a job runs. decode and prefill always run the compressed branch's
    scoring (the selected blocks count the tokens read); parity runs only the forced branch (and
    for sel the compressed one that picks its blocks)."""
    if branch == "none":
        return BRANCHES
    used = {"cmp": ("cmp",), "sel": ("cmp", "sel"), "win": ("win",)}[branch]
    return used if entry == "parity" or "cmp" in used else ("cmp", *used)


def kernels_on_cpu(cfg: DictConfig) -> str:
    """experiments.kernels on a CPU without Triton's interpreter: what to run instead. It times triton
    kernels whatever ``backend`` says, so another backend or a fallback is no answer; on a CPU they run
    only under the interpreter, one program at a time, so at tiny shapes."""
    op = OmegaConf.select(cfg, "op.name", default="selection")
    return ("TRITON_INTERPRET is not set: experiments.kernels times triton kernels, which run on a CPU only under "
            f"Triton's interpreter, at tiny shapes; here: TRITON_INTERPRET=1 python -m experiments.kernels op={op} "
            "model=tiny seq=64 (or run it on a GPU)")


def option_backends(option: str | None) -> dict[str, str | None]:
    """``backend=<option>``'s backend per branch, as conf/backend/<option>.yaml gives them (null: the hardware
    profile's policy); {} for no option or an unknown one."""
    path = CONF_DIR / "backend" / f"{option}.yaml"
    if option is None or not path.is_file():
        return {}
    node = OmegaConf.load(path)
    return {b: node.get(b) for b in BRANCHES}


def option_meaning(option: str | None) -> str | None:
    """What ``backend=<option>`` runs where that is not <option> for every branch (``sdpa``: "cmp=triton
    sel=triton win=sdpa"); None where it is one backend everywhere, or the policy's (``auto``)."""
    per = option_backends(option)
    if not per or all(v is None for v in per.values()) or all(v == option for v in per.values()):
        return None
    return " ".join(f"{b}={v if v is not None else 'policy'}" for b, v in per.items())


def check_backends(plan: dict, fallback: str | None, device: torch.device, dtype: torch.dtype,
                   branches: tuple[str, ...], option: str | None = None) -> None:
    """Each backend's own availability check (``nsa.dispatch.choose``) for this device and dtype. A
    branch whose backend is ``backend=<option>``'s (not one the user or the policy set) is named by
    what the user typed, ``backend=<option>``, with what that option runs per branch."""
    per = option_backends(option)
    for b in branches:
        try:
            dispatch.choose(b, plan[b], device, dtype, fallback)
        except dispatch.BackendUnavailable as e:
            if per.get(b) != plan[b]:
                raise ConfigError(f"backend.{b}={plan[b]}: {one_line(e)}") from e
            meaning = option_meaning(option)
            runs = f" runs {meaning} (conf/backend/{option}.yaml), and" if meaning else ""
            raise ConfigError(f"backend={option}:{runs} {one_line(e)}") from e


def backend_by_seq(policy, branch: str, seq: int, profile: str) -> tuple[str, str] | None:
    """``policy.by_seq.<branch>``: ``[{min_seq, backend}, ...]`` with min_seq ascending (a hardware profile
    written by ``experiments.validate``'s window thresholds). Where a branch's backend is not named
    (``backend=auto``), the entry with the largest min_seq <= seq picks it: (backend, the note recorded
    on the run), or None where the profile has no such list or no entry applies."""
    entries = (policy.get("by_seq") or {}).get(branch)
    if not entries:
        return None
    where = f"hardware.policy.by_seq.{branch}"
    last, chosen = -1, None
    for i, e in enumerate(entries):
        lo, name = e.get("min_seq"), e.get("backend")
        if not _is_int(lo) or lo <= last:
            raise ConfigError(f"{where}[{i}].min_seq={lo!r}: must be an integer >= 0, ascending")
        if name not in dispatch.known_backends():
            raise ConfigError(f"{where}[{i}].backend={name!r}: unknown backend; known: {', '.join(dispatch.known_backends())}")
        last = lo
        if lo <= seq:
            chosen = (name, f"{branch}: {name} at seq={seq} (hardware={profile} policy.by_seq: from {lo} tokens)")
    return chosen


def backends_by_entry(policy, entry: str) -> dict[str, str]:
    """``policy.by_entry``: ``{entry: {branch: backend}}``, a profile's preference measured on one entry
    point's own path (decode: the fused GraphDecoder step needs triton for every branch). The whole node
    is checked (entry, branch and backend names); returns ``entry``'s branches with a backend ({} if none)."""
    node = policy.get("by_entry")
    where = "hardware.policy.by_entry"
    if node is None:
        return {}
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{where}={node!r}: must be a mapping entry -> {{branch: backend}}")
    known = dispatch.known_backends()
    for e, prefs in node.items():
        if e not in ENTRIES:
            raise ConfigError(f"{where}.{e}: unknown entry point; one of {', '.join(ENTRIES)}")
        if prefs is None:
            continue
        if not isinstance(prefs, DictConfig):
            raise ConfigError(f"{where}.{e}={prefs!r}: must be a mapping branch -> backend")
        for b, name in prefs.items():
            if b not in BRANCHES:
                raise ConfigError(f"{where}.{e}.{b}: unknown branch; one of {', '.join(BRANCHES)}")
            if name is not None and name not in known:
                raise ConfigError(f"{where}.{e}.{b}={name!r}: unknown backend; known: {', '.join(known)}")
    return {b: n for b, n in (node.get(entry) or {}).items() if n is not None}


def prepare(cfg: DictConfig, entry: str, here: bool = True, choices: dict | None = None,
            check: Callable[[Job], Any] | None = None) -> Job:
    """Validate ``cfg`` and resolve what it leaves open. Raises ConfigError with one line.

    ``here=False``: the job will run on another host (a SLURM launcher's): a named hardware profile is
    not matched to this host's device, nor the backends' availability checked; the job does both
    where it runs. ``choices``: the config groups' options the job composed (Hydra's
    ``hydra.runtime.choices``; read from ``cfg.hydra`` where it has that node), for the keys errors name.
    ``check(job)``: the entry point's own rules beyond those here, given by the entry (``run_job``'s and
    ``launch``'s ``check``; train: its library's RunConfig), called with the prepared Job; a ValueError it
    raises is a config error."""
    if choices is None and OmegaConf.select(cfg, "hydra.runtime.choices", default=None) is not None:
        choices = OmegaConf.to_container(cfg.hydra.runtime.choices)
    choices = {k: v for k, v in (choices or {}).items() if not k.startswith("hydra/") and v}
    option = choices.get("backend")
    try:
        check_toolchain()  # a known-bad torch/triton pairing stops here, with one line naming it
    except ToolchainError as e:
        raise ConfigError(one_line(e)) from e
    cfg = _resolved(cfg, entry, here)
    seq = cfg.seq
    profile, note, dev, device, dname = _hardware(cfg, here)
    ncfg = _model(cfg, entry)
    # Branch forcing
    branch = cfg.branch_force.name if "branch_force" in cfg else "none"
    if branch not in ("none", *BRANCHES):
        raise ConfigError(f"branch_force={branch!r}: one of none, cmp, sel, win")
    plan, fallback, notes = _backends(cfg, profile, entry)
    if "parity" in cfg and dname not in cfg.parity.tol:
        raise ConfigError(f"parity.tol has no entry for dtype={dname}; add parity.tol.{dname}")
    if "parallel" in cfg:
        from . import parallel

        parallel.check_job(cfg.parallel.cp, seq, branch, device, dp=cfg.parallel.get("dp", 1))
    if here:
        if entry == "kernels" and device.type == "cpu" and not env.triton_interpret():
            raise ConfigError(kernels_on_cpu(cfg))  # the backends' hint (another backend, a fallback) does not apply
        check_backends(plan, fallback, device, DTYPES[dname], branches_used(entry, branch), option)
    job = Job(entry, cfg, ncfg, plan, fallback, notes, profile, note, device, DTYPES[dname], dev, seq, branch,
              choices=choices)
    if check is not None:
        try:
            check(job)
        except ValueError as e:
            raise ConfigError(one_line(e)) from e
    return job


def _resolved(cfg: DictConfig, entry: str, here: bool = True) -> DictConfig:
    """A resolved copy of ``cfg`` without the hydra node, its types checked (an error names the key the user
    typed, read from the interpolations before resolving) and its ``parallel`` and ``tuning`` sections valid."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))  # a copy without the hydra node
    if "hydra" in cfg:
        del cfg["hydra"]
    raw = cfg.copy()  # its interpolations, for the keys errors name
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(one_line(e)) from e
    check_types(cfg, raw)
    if "parallel" in cfg and here:  # parallel.cp > 1 only under torchrun or SLURM's tasks (framework/parallel.py);
        from . import parallel       # a SLURM sweep's jobs are checked by the sweep (their tasks) and where they run

        parallel.check(cfg.parallel.cp, entry, dp=cfg.parallel.get("dp", 1))
    if "tuning" in cfg:
        check_tuning(cfg.tuning)
    return cfg


def _hardware(cfg: DictConfig, here: bool):
    """The hardware profile (auto: the detected one; a strict one must match the device where ``here``),
    written into ``cfg.hardware`` with its ``strict`` flag, and the dtype into ``cfg.dtype``.

    Returns:
        (profile, its note, the detected hardware.Device, the torch device the job runs on, the dtype's name).
    """
    try:
        profile, note = hardware.resolve_profile(cfg.hardware, check=here)
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
    return profile, note, dev, device, dname


def _model(cfg: DictConfig, entry: str) -> nsa.NSAConfig | None:
    """The layer's config from ``model.nsa``, or from a transformers model's folder where ``model.hf_path`` names
    one (experiments/framework/hf_model.py); None for an entry point without one (train names its model
    elsewhere)."""
    if "model" not in cfg:
        return None
    if cfg.model.get("hf_path") is not None:
        from . import hf_model

        return hf_model.nsa_config(cfg, entry)
    try:
        ncfg = nsa.NSAConfig(**OmegaConf.to_container(cfg.model.nsa, resolve=True))
    except TypeError as e:
        raise ConfigError(f"model.nsa: {e}") from e
    except ValueError as e:
        raise ConfigError(f"model={cfg.model.name}: {e}") from e
    if ncfg.rope_rule():
        raise ConfigError(f"model.nsa.d_k={ncfg.d_k}: {ncfg.rope_rule()}")
    return ncfg


def _backends(cfg: DictConfig, profile: DictConfig, entry: str) -> tuple[dict, str | None, list]:
    """Each branch's backend, written into ``cfg.backend``. A branch named on the command line keeps its
    name; one left null (backend=auto) takes the profile's policy.by_entry.<entry>, else policy.by_seq's
    backend for seq, else policy.preferred. Then policy.avoid replaces a backend, named or not, unless
    policy.force.

    Returns:
        (branch -> backend, as ``dispatch.resolve`` names it; backend.fallback; the policy's notes).
    """
    plan, notes = {}, []
    pol = profile.get("policy", {}) or {}
    for_entry, from_entry = backends_by_entry(pol, entry), []
    for b in BRANCHES:
        name = cfg.backend.get(b)
        if name is None and b in for_entry:
            name = for_entry[b]
            from_entry.append(b)
        elif name is None:
            name = (pol.get("preferred") or {}).get(b, "reference")
            by_seq = backend_by_seq(pol, b, cfg.seq, profile.name)
            if by_seq is not None:
                name, note = by_seq
                notes.append(note)
        avoid = (pol.get("avoid") or {}).get(b)
        if avoid is not None and name == avoid.backend and not pol.get("force", False):
            notes.append(f"{b}: {name} -> {avoid.instead} (hardware={profile.name} policy: {avoid.reason}; "
                         f"hardware.policy.force=true runs it)")
            name = avoid.instead
        plan[b] = name
    if from_entry:
        pref = pol.get("preferred") or {}
        notes.insert(0, f"{entry} preference " + " ".join(f"{b}={for_entry[b]}" for b in from_entry)
                     + f" (hardware={profile.name} policy.by_entry.{entry}; policy.preferred: "
                     + " ".join(f"{b}={pref.get(b, 'reference')}" for b in from_entry) + ")")
    try:
        plan = dispatch.resolve(plan)
    except ValueError as e:
        raise ConfigError(str(e).replace("backend[", "backend.").replace("]=", "=", 1)) from e
    fallback = cfg.backend.get("fallback")
    if fallback is not None and fallback not in dispatch.known_backends():
        raise ConfigError(f"backend.fallback={fallback!r}: unknown backend; known: {', '.join(dispatch.known_backends())}")
    for b in BRANCHES:
        cfg.backend[b] = plan[b]
    return plan, fallback, notes


def check_timed_device(cfg: DictConfig, entry: str) -> None:
    """ConfigError (one line) where a timed entry point would run a GPU profile on this host's CPU. A
    profile forced with ``hardware.strict=false`` composes and validates anywhere (parity and validate
    run with it; :func:`prepare` stays free of this rule, so tests compose GPU profiles on a CPU), but
    timings there would be the CPU's under the GPU's settings (dtype, threads, policy, peaks). Called
    on the composed config where the job runs, before :func:`prepare`, so this is the line a user
    sees rather than a GPU backend's unavailability."""
    if entry not in TIMED:
        return
    try:
        profile, _ = hardware.resolve_profile(cfg.hardware)
    except hardware.HardwareMismatch:
        return  # a strict profile that does not match: prepare() says so
    dev = hardware.detect()
    if profile.get("device") == "cuda" and dev.type != "cuda":
        raise ConfigError(
            f"hardware={profile.name}: a GPU profile is timed on its GPU only, and this machine has none "
            f"({dev.describe()}), whatever hardware.strict says; use hardware=cpu (or hardware=auto) here")


def memory_limit(job: Job) -> tuple[float, str]:
    """(bytes, what they are) a job's tensors may take: limits.max_memory_gib, or where it is null what the
    job's device has free now (the host's available memory on a CPU)."""
    lim = job.cfg.limits.max_memory_gib
    if lim is not None:
        return float(lim) * 2**30, f"limits.max_memory_gib={float(lim):g}"
    free = hardware.free_memory_bytes(job.device)
    where = "the GPU" if job.device.type == "cuda" else "this host"
    return float(free), f"the {free / 2**30:.3g} GiB free on {where} (limits.max_memory_gib=null; set it to allow more)"


def check_memory(job: Job, est_bytes: float, detail: str = "") -> None:
    """ResourceLimit (one line; ``detail``, e.g. the estimate's parts, in brackets) where the estimate
    exceeds :func:`memory_limit`."""
    lim, what = memory_limit(job)
    if est_bytes > lim:
        raise ResourceLimit(f"seq={job.seq}: estimated {est_bytes / 2**30:.3g} GiB of tensors exceeds "
                            f"{what}" + (f" ({detail})" if detail else ""))


def groups(conf_dir: Path = CONF_DIR) -> dict[str, list[str]]:
    """The config groups a user picks on the command line (conf/<group>/<option>.yaml; conf/hydra/
    holds Hydra's own settings) and their options."""
    return {p.name: sorted(f.stem for f in p.glob("*.yaml"))
            for p in sorted(conf_dir.iterdir()) if p.is_dir() and p.name != "hydra"}
