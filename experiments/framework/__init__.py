"""The experiment framework shared by the entry points (decode, prefill, parity, kernels, ...), by concern:

* :mod:`.cli`       the command line: argument order, pre-checks, signals, exit codes (``launch``)
* :mod:`.config`    validation: ``prepare(cfg) -> Job`` or a one-line ``ConfigError``
* :mod:`.hardware`  device detection and hardware profiles
* :mod:`.job`       one job's run: ``run_job(cfg, entry, work)``, ``Result``
* :mod:`.sweep`     a sweep: expansion, validation, parent run, resume, summary from the store
* :mod:`.parallel`  context parallelism under torchrun (``parallel.cp``): the launch rule, the group
* :mod:`.launchers` what a sweep needs from its launcher: where jobs run, SLURM's jobs and how they ended
* :mod:`.tracking`  MLflow: the store (checked, created under a lock), runs, tags, stale runs
* :mod:`.report`    CSVs, charts, the summary table
* :mod:`.logs`      console and log-file output

An entry point is a ``work(job) -> Result`` function, a ``@hydra.main`` task that calls
:func:`run_job`, and ``launch(main, "<entry>")`` as its ``__main__``; its own config rules, if any, a
``check(job)`` it passes to both (``check=``). Its loops call :func:`should_stop` where they pass often (the
compute code takes it as an argument): it raises again a signal's exception that Python dropped.
"""
from . import help as _help
from . import parallel as _parallel
from . import sweep as _sweep
from .cli import launch
from .cli import raise_if_interrupted as should_stop
from .config import ConfigError, Job, ResourceLimit, check_memory
from .job import Result, run_job
from .report import Charts

_help.register()  # the resolvers of conf/common.yaml's help template
_parallel.register()  # nsa_rank_suffix: a torchrun rank's own output folder and log file
_sweep.register()  # nsa_dirname: a train job's folder named by its overrides, hashed beyond 255 bytes

__all__ = ["Charts", "ConfigError", "Job", "ResourceLimit", "Result", "check_memory", "launch", "run_job", "should_stop"]
