"""Hydra + MLflow entry points: ``python -m experiments.decode | prefill | parity`` (configs in conf/)."""
import sys as _sys

if _sys.argv[:1] == ["-m"]:  # `python -m experiments.<entry> ...`, before the entry's imports: no password stays in ps
    from .env import reexec_without_passwords

    reexec_without_passwords()
