"""The experiments' own environment variable, and the command line a password must not stay on.

Standard library only: :func:`reexec_without_passwords` runs from ``experiments/__init__.py``, before torch
or anything else is imported, so a password typed in ``tracking.uri=http://user:PW@host`` leaves the
process's command line (which every user of the host reads in ``ps``) within the interpreter's start.

* ``NSA_TRACKING_LOGINS`` (:func:`tracking_logins`): JSON ``{URI as printed (password ***): URI itself}``,
  the tracking logins this launch was given. A process's environment is readable by its own user only
  (``/proc/<pid>/environ`` is 0400), and is inherited by what the launch starts: the process re-executed
  without the password, ``hydra/launcher=local_gpus``' spawned workers, torchrun's ranks, SLURM's jobs
  (sbatch exports the environment), which so reach the server with the login while their configs hold
  only the masked URI.
"""
from __future__ import annotations

import json
import os
import sys
from urllib.parse import urlsplit, urlunsplit

LOGINS = "NSA_TRACKING_LOGINS"
MASK = "***"


def tracking_logins() -> dict[str, str]:
    """The logins this process inherited (``NSA_TRACKING_LOGINS``), {} where there are none."""
    try:
        got = json.loads(os.environ.get(LOGINS) or "{}")
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in got.items()} if isinstance(got, dict) else {}


def export_tracking_logins(logins: dict[str, str]) -> None:
    """``logins`` (with those inherited) into this process's environment, for the processes it starts."""
    os.environ[LOGINS] = json.dumps({**tracking_logins(), **logins})


def mask_uri(uri: str) -> tuple[str, str | None]:
    """(``uri`` with the password of its user info written ``***``, the password or None where it has none)."""
    try:
        parts = urlsplit(uri)
        password = parts.password
    except ValueError:
        return uri, None
    if not password or password == MASK:
        return uri, None
    return urlunsplit(parts._replace(netloc=f"{parts.username}:{MASK}@{parts.netloc.rsplit('@', 1)[1]}")), password


def mask_override(arg: str, logins: dict[str, str]) -> str:
    """A ``tracking.uri=<uri>`` override (``+``/``++``, quoted or not) with its password masked, the URI itself
    added to ``logins`` under the masked one; any other argument as it is."""
    key, eq, value = arg.partition("=")
    if not eq or arg.startswith("-") or key.lstrip("+~") != "tracking.uri":
        return arg
    quoted = len(value) > 1 and value[0] == value[-1] and value[0] in "'\""
    inner = value[1:-1] if quoted else value
    safe, password = mask_uri(inner)
    if password is None:
        return arg
    logins[safe] = inner
    return f"{key}={value[0] + safe + value[0] if quoted else safe}"


def reexec_without_passwords() -> None:
    """Where this process's arguments hold a ``tracking.uri`` with a password: the same command again in this
    process (``exec``, the pid kept: torchrun, SLURM and a terminal see no change), the password masked on its
    command line and the URI itself in ``NSA_TRACKING_LOGINS``. Nothing to do otherwise."""
    n = len(sys.argv) - 1
    head, args = sys.orig_argv[:len(sys.orig_argv) - n], sys.orig_argv[len(sys.orig_argv) - n:]
    if n <= 0 or args != sys.argv[1:]:  # arguments not as the interpreter got them: leave them
        return
    logins: dict[str, str] = {}
    masked = [mask_override(a, logins) for a in args]
    if not logins:
        return
    sys.stdout.flush()
    os.execve(sys.executable, [*head, *masked], {**os.environ, LOGINS: json.dumps({**tracking_logins(), **logins})})
