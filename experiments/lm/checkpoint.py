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
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        cause = _os_error(e) if isinstance(e, Exception) else None
        if cause is None:
            raise
        kept = "the previous checkpoint is kept" if final.exists() else "no checkpoint was written"
        raise CheckpointWriteError(f"{final}: cannot write the checkpoint: {os.strerror(cause.errno).lower()} "
                                   f"({shutil.disk_usage(d).free / 2**20:.1f} MiB free there); {kept}") from e
    fd = os.open(d, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
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
    """``{"run_id", "step"}`` of the checkpoint in ``ckpt_dir`` (None if none): an entry point
    reopens that tracking run before it calls the training loop."""
    state = load(ckpt_dir, mmap=True)
    return None if state is None else {"run_id": state["run_id"], "step": state["step"]}
