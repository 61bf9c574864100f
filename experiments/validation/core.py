"""What every check shares: its context (the validated config, the size, the output folder) and its
result (:class:`Check`: a verdict, the figures of its table row, the reasons it did not pass, its rows,
metrics, report blocks and files).

Verdicts: ``PASS`` (ran, every condition held), ``FAIL`` (a condition did not hold, or the check
raised), ``SKIP`` (could not run here; the reason is named) and ``NOT RUN`` (left out of
``validate.checks``). Only PASS counts as passed.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from ..framework.config import Job, prepare

PASS, FAIL, SKIP, NOT_RUN = "PASS", "FAIL", "SKIP", "NOT RUN"


@dataclass
class Check:
    name: str
    verdict: str = PASS
    figures: str = ""                                   # the report table's cell: this check's figures
    reasons: list[str] = field(default_factory=list)    # why it is not PASS, one line each
    notes: list[str] = field(default_factory=list)      # what a reader must know (what ran, what did not)
    not_passed: list[str] = field(default_factory=list)  # parts that did not pass without failing it (named)
    metrics: dict[str, float] = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)      # the check's CSV
    blocks: list = field(default_factory=list)          # its section of the report (report.Table, Text, ...)
    files: list[Path] = field(default_factory=list)     # artifacts of its run
    seconds: float = 0.0

    def fail(self, reason: str) -> None:
        self.verdict = FAIL
        self.reasons.append(reason)

    def require(self, ok: bool, reason: str) -> bool:
        if not ok:
            self.fail(reason)
        return ok


@dataclass
class Context:
    job: Job                # the validate run's job: resolved config, profile, plan, device, dtype
    size: DictConfig        # validate.sizes.<size_name>
    size_name: str          # cpu | gpu
    out: Path               # the run's folder (hydra.run.dir)
    fault: str | None       # validate.inject_fault

    @property
    def cfg(self) -> DictConfig:
        return self.job.cfg

    @property
    def device(self) -> torch.device:
        return self.job.device

    def entry_job(self, entry: str, seq: int, check: Callable[[Job], Any] | None = None, **values) -> Job:
        """A job of ``experiments.<entry>`` from this run's config: ``seq`` and ``values`` (dotted keys,
        e.g. ``{"decode.batch": 64}``) set, validated by the framework as that entry's own would be (``check``:
        the entry's own rules, the function it gives ``run_job``)."""
        c = OmegaConf.create(OmegaConf.to_container(self.cfg, resolve=True))
        c.seq = seq
        for k, v in values.items():
            OmegaConf.update(c, k, v, merge=False)
        return prepare(c, entry, check=check)

    def path(self, name: str) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        return self.out / name


def fmt_ms(ms: float) -> str:
    return f"{ms * 1e3:.1f} us" if abs(ms) < 0.1 else f"{ms:.3g} ms"


def fmt_tokens(n: float) -> str:
    return f"{int(round(n))}" if abs(n - round(n)) < 1e-9 else f"{n:.1f}"


def seq_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)
