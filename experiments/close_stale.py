"""Close the runs of a sweep (or one run) left RUNNING by a process that no longer exists.

    python -m experiments.close_stale <run id>                              # the store: as the experiments pick it
    python -m experiments.close_stale <run id> --tracking-uri sqlite:///mlflow.db --force

A process killed outright (SIGKILL, out of memory, a lost node) cannot end its runs. Every run records
its process (tags ``host``, ``pid``, ``process``: pid, boot id and start time); a RUNNING run whose
process is gone from this host is ended KILLED, with the reason in its ``error`` tag; so is a run
of a SLURM job (tag ``slurm_job_id``) whose job SLURM's accounting says ended, from any host that has
``sacct``. Another host's run cannot be checked from here otherwise: ``--force`` ends it too. A server's login is
read as ``tracking=server`` reads it (``--credentials``, default its ``tracking.credentials``), sent to that
server only. A resumed sweep
(``hydra.sweeper.resume=<parent run id>``) does the same first. Exit code 2: no such run or store.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from omegaconf import OmegaConf

from .framework import tracking
from .framework.cli import config_exit
from .framework.config import CONF_DIR, ConfigError
from .framework.logs import say

SERVER = OmegaConf.load(CONF_DIR / "tracking" / "server.yaml")  # tracking=server: its credentials file


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.close_stale", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_id", help="a sweep's parent run (its children are checked too), or any run")
    ap.add_argument("--tracking-uri", help="the store (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here)")
    ap.add_argument("--credentials", default=SERVER.credentials,
                    help="MLflow's credentials file, for the server it names only (default, as tracking=server: "
                         f"{SERVER.credentials}, from this directory)")
    ap.add_argument("--force", action="store_true", help="also end RUNNING runs of other hosts (make sure they are dead)")
    a = ap.parse_args(argv)
    from mlflow.exceptions import MlflowException

    t = OmegaConf.create({"uri": a.tracking_uri, "credentials": a.credentials})
    try:
        uri, _ = tracking.resolve_uri(t, Path.cwd())
        client = tracking.open_client(uri)
        run = client.get_run(a.run_id)
    except ConfigError as e:
        config_exit(str(e))
    except MlflowException:
        config_exit(f"run {a.run_id}: not found in {uri}")
    done = tracking.close_stale(client, run.info.run_id, force=a.force)
    for rid, what in done:
        say(f"run {rid}: {what}")
    if not done:
        say(f"run {a.run_id} and its children: none RUNNING")


if __name__ == "__main__":
    main()
