"""Progress of long work (tqdm): on a terminal, a bar with the count, the time taken and the time left; where
stderr is not a terminal (a pipe, a file, a batch job) nothing at all (tqdm's ``disable=None``). While a bar
is shown, console log lines are written above it (tqdm's logging redirect), not through it.

A bar is drawn where its process runs: a sweep's own bar follows its jobs through the store (any launcher);
a job in another process (local_gpus, SLURM) draws its own bar, if any, on its own stderr."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm


@contextlib.contextmanager
def bar(total: int, desc: str, unit: str, initial: int = 0, shown: bool = True) -> Iterator[tqdm]:
    """A bar of ``total`` ``unit``s (``initial`` already done, e.g. a resumed run's steps); ``update(n)``
    moves it. Removed when done (``leave=False``): the log's last lines stay the run's summary. ``shown=False``:
    never drawn (the ranks of a training but rank 0: one bar for the job)."""
    with tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=None if shown else True, leave=False,
              dynamic_ncols=True) as b:
        if b.disable:
            yield b
        else:
            with logging_redirect_tqdm():
                yield b
