"""Kernel benchmarks: one triton operation, checked against the reference, then timed.

    python -m experiments.kernels hardware=h200 op=selection -m seq_len=paper
    python -m experiments.kernels hardware=h200 op=compressed seq=65536 -m tuning.compressed.rows=64,128
    python -m experiments.kernels hardware=h200 op=layer seq=65536 kernels.once=true

``op`` (config group ``conf/op/``): ``selection``, ``compressed`` (with the Eq. 9 scores and the top-n),
``topn``, ``window``, ``gate`` (Eq. 5), ``layer`` (the whole forward without gradient, its stream and
gate variants), ``decode`` (the decode step's kernels, each alone). Shapes: the model's heads and dims
(``model=h200bench`` unless given), ``seq`` tokens, ``kernels.batch`` sequences; dtype from the hardware
profile. Before timing, each op runs its kernel at ``min(seq, kernels.check_seq)`` tokens against the
reference (float64 on a CPU, float32 on a GPU; outputs NaN-poisoned): a difference over ``kernels.tol``
fails the job (its figures logged). What each op times: ``experiments/ops/<op>.py``
(``op=decode``: ``experiments/ops/decode_step.py``).

Launch parameters: ``tuning.<op>.<key>=<value>`` (the keys of ``nsa.backends.triton.tuning.KEYS``;
validated before anything starts, one line and exit 2 otherwise), applied with ``tuning.overrides``
around the job; ``-m`` sweeps them. The run logs the table it used (``tuning_table.json``, tag
``tuning_table``). ``kernels.once=true`` makes one call of the op's kernels at ``seq`` (no check, no
timing) for a profiler, e.g. ``ncu --launch-count 1 -k regex:fwd_kernel python -m experiments.kernels
op=compressed kernels.once=true``. On a CPU the ops run under ``TRITON_INTERPRET=1`` at tiny shapes
(``model=tiny seq=64``), timed with a plain timer.
"""
from __future__ import annotations

import json

import hydra
from omegaconf import DictConfig

from nsa.backends.triton import tuning

from . import ops
from .framework import Job, Result, launch, run_job
from .framework.config import tuning_overrides
from .measure import replay
from .ops.bench import Bench


def check_config(job: Job) -> None:
    """kernels' rules beyond ``config.RULES``: ``kernels.indices`` is ``random`` or, for op=selection, a selections
    file that holds this seq at the model's blocks (``measure.replay.load``)."""
    src = job.cfg.kernels.indices
    if not isinstance(src, str) or not src:
        raise ValueError(f"kernels.indices={src!r}: 'random' or the path of a selections file (train.save_selections)")
    if src != replay.RANDOM:
        if job.cfg.op.name != "selection":
            raise ValueError(f"kernels.indices={src!r}: only op=selection reads block indices (op={job.cfg.op.name})")
        replay.load(src, job.seq, job.nsa, "kernels.indices")


def work(job: Job) -> Result:
    b = Bench(job)
    op = ops.get(job.cfg.op.name)
    with tuning.overrides(tuning_overrides(job.cfg)):
        b.tags["tuning_table"] = tuning.key(job.device)
        b.texts["tuning_table.json"] = json.dumps(tuning.table(job.device), indent=1)
        if job.cfg.kernels.once:
            op.once(b)
            b.tags["once"] = "one call of the op's kernels: no check, no timing"
            b.rows.append({"op": job.cfg.op.name, "variant": "once", "seq_tokens": job.seq, "calls": 1})
            return b.result()
        op.check(b)
        if not b.failures:
            op.timed(b)
    return b.result()


@hydra.main(config_path="../conf", config_name="kernels", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_job(cfg, "kernels", work, check=check_config)


if __name__ == "__main__":
    launch(main, "kernels", check=check_config)
