"""Console and log-file output.

A job logs through ``logging`` (Hydra writes each job's ``<entry>.log`` from it, see
``conf/hydra/job_logging/nsa.yaml``): the console shows one line per message, the log file the same
with times and, for a failed job, the traceback. The sweep's own lines (start, summary, interrupts)
come from the launching process, outside any job's log: :func:`say`.
"""
from __future__ import annotations

import logging
import sys

from tqdm import tqdm


def say(msg: str) -> None:
    """A line on stderr, above a progress bar shown there (:mod:`experiments.progress`), not through it."""
    tqdm.write(msg, file=sys.stderr)
    sys.stderr.flush()


class Console(logging.StreamHandler):
    """The console's lines, written above a progress bar shown on the same stream (a sweep's jobs run in
    its process by the basic launcher), not through it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:  # noqa: BLE001  (logging's own rule: a failing handler reports, never raises)
            self.handleError(record)


class OneLine(logging.Formatter):
    """The message alone, without the traceback a record may carry (that goes to the log file)."""

    def format(self, record: logging.LogRecord) -> str:
        return record.getMessage()


class FileHandler(logging.FileHandler):
    """A job's log file. A write that fails (a full disk) is said once, in one line, and the file gets
    no more records; the console keeps them all (logging's default prints a traceback per record)."""

    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        e = sys.exc_info()[1]
        if self.failed or not isinstance(e, OSError) or not e.strerror:
            return super().handleError(record)
        self.failed = True
        say(f"log file {self.baseFilename}: {e.strerror.lower()}; its later lines are on the console only")
