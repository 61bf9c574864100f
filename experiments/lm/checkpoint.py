"""One checkpoint file per run directory, replaced atomically.

``save`` writes ``<dir>/.last.pt.tmp``, flushes it to disk and renames it over ``<dir>/last.pt``
(``os.replace`` is atomic on POSIX): a process killed at any moment leaves either the previous
checkpoint or the new one, never a torn file. Every checkpoint carries ``digest``, a BLAKE2b hash of each
tensor's bytes (with its dtype and shape) and of every other value, in order; :func:`load` recomputes it
and raises :class:`Unreadable` where a byte changed (a checkpoint written before digests has none, and is
read as it is). A write that fails (a full disk) removes the temporary
file, keeps the previous checkpoint and raises :class:`CheckpointWriteError` naming the file and the
cause. ``peek`` reads only what an entry point needs to reopen the run (its ``run_id`` and ``step``)
without loading the tensors into memory. A ``last.pt`` that is not a whole checkpoint (empty,
truncated, corrupt) raises :class:`Unreadable`, saying which.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import torch

NAME = "last.pt"
FORMAT = 1


class Unreadable(ValueError):
    """``last.pt`` is there but is not a checkpoint (empty, truncated, corrupt): the message names it."""


class CheckpointWriteError(OSError):
    """The checkpoint could not be written (e.g. no space left): its temporary file is removed, the
    previous checkpoint kept."""


def path(ckpt_dir) -> Path:
    return Path(ckpt_dir) / NAME


def _os_error(e: BaseException | None) -> OSError | None:
    """The OS error (with an errno) ``e`` is or came from: torch's writer reports a failed write as
    ``unexpected pos ...``, the file's own ENOSPC being its context."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError) and e.errno is not None:
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _leaves(obj, where: str = ""):
    """``(path, value)`` of every tensor and plain value of a checkpoint's state, in its order."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if where or k != "digest":
                yield from _leaves(v, f"{where}/{k!r}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{where}[{i}]")
    else:
        yield where, obj


def digest(state: dict) -> str:
    """The hash of a checkpoint's state (the module docstring): hex BLAKE2b of its tensors' bytes and its values."""
    h = hashlib.blake2b(digest_size=32)
    for where, v in _leaves(state):
        h.update(where.encode())
        if isinstance(v, torch.Tensor):
            t = v.detach().to("cpu").contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")
        else:
            h.update(repr(v).encode())
    return h.hexdigest()


def _sync_dir(d: Path) -> None:
    """Make the renames inside folder ``d`` themselves durable (an fsync of the folder)."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(ckpt_dir, state: dict) -> Path:
    d = Path(ckpt_dir)
    d.mkdir(parents=True, exist_ok=True)
    final, tmp = d / NAME, d / f".{NAME}.tmp"
    try:
        with open(tmp, "wb") as f:
            whole = {"format": FORMAT, **state}
            torch.save({**whole, "digest": digest(whole)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        shutil.rmtree(d / SHARDED, ignore_errors=True)  # a sharded one it replaces (a run resumed in one process)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        cause = _os_error(e) if isinstance(e, Exception) else None
        if cause is None:
            raise
        kept = "the previous checkpoint is kept" if final.exists() else "no checkpoint was written"
        raise CheckpointWriteError(f"{final}: cannot write the checkpoint: {os.strerror(cause.errno).lower()} "
                                   f"({shutil.disk_usage(d).free / 2**20:.1f} MiB free there); {kept}") from e
    _sync_dir(d)
    return final


def _unreadable(p: Path, e: Exception) -> Unreadable:
    size = p.stat().st_size
    if size == 0:
        what = "an empty file (0 bytes), not a checkpoint"
    elif not zipfile.is_zipfile(p):  # torch.save writes a zip archive; its directory is at the end
        what = f"truncated or not a checkpoint ({size} bytes, no archive directory at its end)"
    else:
        what = f"a corrupt checkpoint ({size} bytes; torch.load: {str(e).splitlines()[0][:200]})"
    return Unreadable(f"{p}: {what}")


def load(ckpt_dir, map_location="cpu", mmap: bool = False) -> dict | None:
    """The checkpoint in ``ckpt_dir``, or None if there is none; :class:`Unreadable` if ``last.pt`` is
    not a whole checkpoint."""
    p = path(ckpt_dir)
    if not p.exists():
        return None
    try:
        state = torch.load(p, map_location=map_location, weights_only=True, mmap=mmap)
    except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
        raise _unreadable(p, e) from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{p}: checkpoint format {found!r}, this code reads {FORMAT}")
    if "digest" in state and digest(state) != state["digest"]:
        raise Unreadable(f"{p}: a corrupt checkpoint ({p.stat().st_size} bytes; its contents differ from the digest "
                         "written with them)")
    return state


def peek(ckpt_dir) -> dict | None:
    """``{"run_id", "step"}`` of the checkpoint in ``ckpt_dir`` (None if none; either kind, :func:`meta`): an entry
    point reopens that tracking run before it calls the training loop."""
    m = meta(ckpt_dir)
    return None if m is None else {"run_id": m["run_id"], "step": m["step"]}


# ================================================================================================
# Sharded checkpoints (training over several processes): torch.distributed.checkpoint (DCP)
# ================================================================================================
SHARDED = "dcp"       # <ckpt dir>/dcp/: DCP's files (one per rank, and .metadata) and META
META = "meta.json"    # run_id, step, data_position, config, world: what an entry point reads to reopen the run


def _swap_in(d: Path, tmp: Path) -> None:
    """``tmp`` becomes ``d/dcp``: the old one moved aside, the new one renamed in, the old one removed; a process
    killed between the renames leaves ``.dcp.old``, which :func:`_sharded_dir` takes back."""
    final, old = d / SHARDED, d / f".{SHARDED}.old"
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        (d / NAME).unlink()  # the newest checkpoint is the only one
    _sync_dir(d)


def save_sharded(ckpt_dir, meta: dict, model, opt) -> Path:
    """Every rank's shard of ``model`` and ``opt`` (FSDP2) into ``<ckpt_dir>/dcp`` through DCP, and ``meta`` (plain
    values) beside them, written by rank 0; called on every rank. Replaces the previous checkpoint (a sharded one
    or ``last.pt``) only once the whole new one is on disk."""
    import json

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    d = Path(ckpt_dir)
    tmp = d / f".{SHARDED}.tmp"
    if dist.get_rank() == 0:
        d.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    fresh = not opt.state
    msd, osd = get_state_dict(model, opt)
    if fresh:
        _uncount(opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp))
    if dist.get_rank() == 0:
        with open(tmp / META, "w") as f:
            json.dump({"format": FORMAT, **meta}, f)
            f.flush()
            os.fsync(f.fileno())
        _swap_in(d, tmp)
    dist.barrier()
    return d / SHARDED


def _uncount(opt) -> None:
    """DCP's ``get_state_dict`` / ``set_state_dict`` fill an empty optimizer state by a step with zero gradients at
    learning rate 0; its moments stay 0, but the step counts 1 (AdamW's bias correction would then differ from a
    fresh optimizer's). Set back to 0, the state is a fresh optimizer's."""
    for st in opt.state.values():
        if isinstance(st.get("step"), torch.Tensor):
            st["step"].zero_()
        elif "step" in st:
            st["step"] = 0


def _sharded_dir(d: Path) -> Path | None:
    final, old = d / SHARDED, d / f".{SHARDED}.old"
    if not final.exists() and (old / META).exists():  # killed between the renames of _swap_in
        os.replace(old, final)
    return final if (final / META).exists() else None


def meta(ckpt_dir) -> dict | None:
    """The checkpoint in ``ckpt_dir`` that a run resumes, without its tensors in memory: ``{"kind": "file" |
    "sharded", "run_id", "step", "data_position", "config", ...}``, or None where there is none. ``file``:
    ``last.pt`` (one process); ``sharded``: ``dcp/`` (several). Where both are there (a process killed while it
    replaced one by the other), the later step's."""
    import json

    d = Path(ckpt_dir)
    found = []
    s = _sharded_dir(d) if d.is_dir() else None
    if s is not None:
        try:
            m = json.loads((s / META).read_text())
        except ValueError as e:
            raise Unreadable(f"{s / META}: not a checkpoint's metadata ({' '.join(str(e).split())})") from e
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise ValueError(f"{s / META}: checkpoint format {m.get('format') if isinstance(m, dict) else m!r}, "
                             f"this code reads {FORMAT}")
        found.append({**m, "kind": "sharded", "path": s})
    state = load(d, mmap=True)
    if state is not None:
        found.append({**{k: v for k, v in state.items() if k not in ("model", "optimizer", "rng")}, "kind": "file",
                      "path": path(d)})
    for m in found:
        _check_fields(m)
    return max(found, key=lambda m: m["step"]) if found else None


# What a checkpoint's plain fields must be before a run is reopened from them: (type, rule, test)
_FIELDS = {"run_id": (str, "a non-empty string", lambda v: bool(v)),
           "step": (int, "an integer in [0, 2**62]", lambda v: 0 <= v <= 2**62),
           "data_position": (int, "an integer in [0, 2**62]", lambda v: 0 <= v <= 2**62),
           "config": (dict, "a mapping", lambda v: True)}


def _check_fields(m: dict) -> None:
    """A checkpoint whose ``run_id``, ``step``, ``data_position`` or ``config`` is missing or of another kind is
    :class:`Unreadable`, naming the field and its rule (not a KeyError or TypeError later)."""
    for key, (kind, rule, ok) in _FIELDS.items():
        v = m.get(key)
        if key not in m or not isinstance(v, kind) or isinstance(v, bool) or not ok(v):
            got = "missing" if key not in m else f"{type(v).__name__} {v!r}"[:80]
            raise Unreadable(f"{m['path']}: a malformed checkpoint: {key} must be {rule} ({got})")


def load_sharded(where: Path, model, opt) -> None:
    """A sharded checkpoint into ``model`` and ``opt``: FSDP2-sharded ones (on any world size: DCP reshards) or a
    plain model in one process (DCP without a process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    _uncount(opt)  # the counts a checkpoint written before the first step holds (save_sharded)
    state = {"model": msd, "optimizer": osd}
    dcp.load(state, checkpoint_id=str(where))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_file_into_sharded(state: dict, model, opt) -> None:
    """A one-process checkpoint's state (``last.pt``) into an FSDP2-sharded ``model`` and ``opt``: the optimizer's
    parameter numbers named by the parameters they number (the same groups, in the same order)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    o = state["optimizer"]
    osd = {"state": {order[i]: v for i, v in o["state"].items()},
           "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in o["param_groups"]]}
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=osd,
                   options=StateDictOptions(full_state_dict=True))
    if not o["state"]:  # a checkpoint written before the first step
        _uncount(opt)
