"""Progress of long work (tqdm): on a terminal, a bar with the count, the time taken and the time left; where
stderr is not a terminal (a pipe, a file, a batch job) a log line at most every ``every_s`` seconds, none for work
shorter than that (tqdm's ``mininterval`` and ``delay``, its output sent to the log). While a bar is shown,
console log lines are written above it (tqdm's logging redirect), not through it.

A bar is drawn where its process runs: a sweep's own bar follows its jobs through the store (any launcher);
a job in another process (local_gpus, SLURM) draws its own bar, if any, on its own stderr."""
from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm


class _ToLog:
    """A file for tqdm off a terminal: each line it draws becomes one log record (the carriage returns dropped)."""

    def __init__(self, logger: logging.Logger):
        self.logger = logger

    def write(self, text: str) -> None:
        text = text.strip("\r\n ")
        if text:
            self.logger.info(text)

    def flush(self) -> None:
        pass


@contextlib.contextmanager
def bar(total: int, desc: str, unit: str, initial: int = 0, shown: bool = True, every_s: float = 30.0) -> Iterator[tqdm]:
    """A bar of ``total`` ``unit``s (``initial`` already done, e.g. a resumed run's steps); ``update(n)``
    moves it. Removed when done (``leave=False``): the log's last lines stay the run's summary. ``shown=False``:
    never drawn (the ranks of a training but rank 0: one bar for the job). Off a terminal: a log line
    ``<desc>: <done>/<total> <unit>s, <elapsed> so far, <left> left`` at most every ``every_s`` seconds."""
    if shown and not sys.stderr.isatty():
        with tqdm(total=total, initial=initial, desc=desc, unit=unit, leave=False, file=_ToLog(logging.getLogger(
                "experiments.progress")), mininterval=every_s, maxinterval=every_s, delay=every_s, ascii=True,
                  bar_format="{desc}: {n_fmt}/{total_fmt} {unit}s, {elapsed} so far, {remaining} left") as b:
            yield b
        return
    with tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=None if shown else True, leave=False,
              dynamic_ncols=True) as b:
        if b.disable:
            yield b
        else:
            with logging_redirect_tqdm():
                yield b
