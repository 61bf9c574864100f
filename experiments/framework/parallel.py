"""Several processes of one job in the entry points (``parallel.cp``; ``parallel.dp`` for training): the launch
rule, the process group, the ranks.

``torchrun --nproc_per_node N -m experiments.<entry> parallel.cp=N ...`` starts N processes; each runs the
entry point's job on its part of one sequence (:mod:`nsa.context_parallel`). SLURM starts them too: the tasks of
one job step (``hydra/launcher=slurm hydra.launcher.nodes=M hydra.launcher.tasks_per_node=G``, each job of the
sweep M x G tasks over M hosts, or ``srun``), whose torch.distributed variables come from SLURM's
(:func:`from_slurm`). Rank 0 opens, logs and ends
the job's one MLflow run; the other ranks run ``work`` only and never touch the store
(:func:`experiments.framework.job.run_job`). The group is NCCL on CUDA (each rank on GPU ``LOCAL_RANK``),
gloo on the CPU, initialized from torchrun's environment (``env://``).

The rule (:func:`check`, a ConfigError otherwise: one line, exit 2, no run): ``parallel.cp`` N > 1 only
under torchrun with ``WORLD_SIZE`` == N and only for the entry points that run context parallel; under
torchrun with more than one process, ``parallel.cp`` must be that count (else every rank would run the
whole job and log a run of its own). ``experiments.train`` takes ``parallel.dp`` too (D x C == WORLD_SIZE) and runs
its distributed path under torchrun at any world size, one process included (:func:`distributed`).
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from .. import env
from .errors import ConfigError

ENTRIES = ("parity", "prefill", "train")  # the entry points with a context-parallel path
TRAINS = ("train",)  # and with a data-parallel one (parallel.dp), which runs under torchrun at any world size


def torchrun_world() -> int | None:
    """WORLD_SIZE where this process is one rank of a launch: started by torchrun (every variable it sets is
    there), or one task of a SLURM step of several (:func:`from_slurm` sets them); else None."""
    from_slurm()
    ranks = env.launch_ranks()
    return None if ranks is None else ranks[2]


def from_slurm() -> None:
    """In one task of a SLURM step of several tasks, where torchrun did not set them: torch.distributed's env://
    variables from SLURM's, by submitit (``TorchDistributedEnvironment``): RANK = SLURM_PROCID, WORLD_SIZE =
    SLURM_NTASKS, LOCAL_RANK = SLURM_LOCALID, MASTER_ADDR the step's first host, MASTER_PORT from the job id (the
    same on every task). CUDA_VISIBLE_DEVICES is kept: each rank takes GPU LOCAL_RANK of its host's list."""
    tasks = env.slurm_step()  # srun's step; submitit runs each job of hydra/launcher=slurm as one
    if tasks < 2 or env.launch_ranks() is not None:
        return
    try:
        from submitit.helpers import TorchDistributedEnvironment
    except ImportError as e:  # srun of several tasks without the cluster extra
        raise ConfigError(f"SLURM_NTASKS={tasks}: the tasks of a SLURM step find each other "
                          f"through submitit, of the cluster extra: pip install -e \".[cluster]\"") from e
    env.mark_submitit_slurm()
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)


def distributed(cfg, entry: str) -> bool:
    """The job runs over a process group: context parallel (parallel.cp > 1), or a training under torchrun
    (FSDP2 and DCP checkpoints even on one process: the path several processes take). ``check`` passed."""
    from omegaconf import OmegaConf

    if entry in TRAINS:
        return torchrun_world() is not None
    return int(OmegaConf.select(cfg, "parallel.cp", default=1)) > 1


def rank() -> int:
    """This process's rank under torchrun or SLURM's tasks (0 outside them)."""
    torchrun_world()  # SLURM's tasks exported first
    ranks = env.launch_ranks()
    return 0 if ranks is None else ranks[0]


def check(cp, entry: str, sweep: bool = False, dp=1, tasks: int = 1) -> None:
    """``parallel.dp`` x ``parallel.cp`` against how this process was launched (module docstring: the rule).
    ``tasks``: for a sweep, the SLURM tasks each of its jobs runs on (``hydra/launcher=slurm``'s nodes x
    tasks_per_node; 1 for every other launcher)."""
    world = torchrun_world()
    n = cp * dp if dp * cp != 1 else world
    keys = f"parallel.dp={dp} parallel.cp={cp}" if entry in TRAINS else f"parallel.cp={cp}"
    if dp * cp != 1:
        split = keys
    else:
        split = f"parallel.dp={n} parallel.cp=1" if entry in TRAINS else f"parallel.cp={n}"
    cmd = f"torchrun --nproc_per_node {n} -m experiments.{entry} {split} ..."
    train = entry in TRAINS
    if sweep and tasks > 1:  # a SLURM sweep whose every job runs over `tasks` processes
        slurm = f"hydra.launcher.nodes x hydra.launcher.tasks_per_node = {tasks}"
        if entry not in ENTRIES:
            raise ConfigError(f"{slurm}: experiments.{entry} runs in one process; only "
                              f"{', '.join(f'experiments.{e}' for e in ENTRIES)} run one job over several SLURM tasks")
        if dp != 1 and not train:
            raise ConfigError(f"parallel.dp={dp}: experiments.{entry} has no data-parallel path; only "
                              f"{', '.join(f'experiments.{e}' for e in TRAINS)} runs with parallel.dp > 1")
        if dp * cp != tasks:
            rule = "dp x cp" if train else "parallel.cp"
            raise ConfigError(f"{keys}: {rule} = {dp * cp} must equal the SLURM tasks of each job, {slurm} "
                              f"(one task per rank)")
        return
    if sweep and (dp * cp != 1 or (world or 1) > 1):
        what = "over several processes" if train else "context parallel"
        raise ConfigError(f"{keys}: a sweep (-m) does not run {what} (its jobs run one after "
                          f"another in one process, and under torchrun every rank would run the whole sweep); "
                          f"launch one job per torchrun ({cmd}), or sweep on SLURM with each job over its own "
                          f"tasks (-m hydra/launcher=slurm hydra.launcher.tasks_per_node={n or 1} {split} ...)")
    if dp != 1 and not train:
        raise ConfigError(f"parallel.dp={dp}: experiments.{entry} has no data-parallel path; only "
                          f"{', '.join(f'experiments.{e}' for e in TRAINS)} runs with parallel.dp > 1")
    if cp != 1 and entry not in ENTRIES:
        raise ConfigError(f"parallel.cp={cp}: experiments.{entry} has no context-parallel path; "
                          f"only {', '.join(f'experiments.{e}' for e in ENTRIES)} run with parallel.cp > 1")
    if entry not in ENTRIES and (world or 1) > 1:
        raise ConfigError(f"parallel.cp={cp}: experiments.{entry} runs in one process, not under torchrun or SLURM's "
                          f"tasks with WORLD_SIZE={world} (every rank would run the whole job and log a run of its own)")
    if dp * cp != 1 and world is None:
        rule = ("parallel.dp x parallel.cp > 1 runs one process per rank under torchrun with WORLD_SIZE == dp x cp"
                if train else "parallel.cp > 1 runs one process per rank under torchrun with WORLD_SIZE == parallel.cp")
        raise ConfigError(f"{keys}: {rule} ({cmd}); this process was not started by torchrun")
    if world is not None and world != dp * cp:
        rule = f"dp x cp = {dp * cp} must equal" if train else "must equal"
        again = f"parallel.dp={world} parallel.cp=1" if train else f"parallel.cp={world}"
        raise ConfigError(f"{keys}: {rule} torchrun's WORLD_SIZE={world} (one process per rank: "
                          f"torchrun --nproc_per_node {world} -m experiments.{entry} {again} ...)")


def check_job(cp: int, seq: int, branch: str, device: torch.device | None = None, dp: int = 1) -> None:
    """What a context-parallel job needs: the sequence cut into 2 x cp equal chunks (each rank holds one
    early and one late chunk, nsa.context_parallel.shard), every branch (the context-parallel path runs the
    gated sum of all three; branch_force times one alone on one device), and on CUDA a GPU of its own per
    rank of this host."""
    if dp * cp > 1 and device is not None and device.type == "cuda":
        ranks = env.launch_ranks()
        local, n = (0 if ranks is None else ranks[1]), torch.cuda.device_count()
        if local >= n:
            raise ConfigError(f"parallel.cp={cp}: local rank {local} has no GPU of its own ({n} visible here); "
                              f"torchrun --nproc_per_node at most {n} on this host, one GPU per rank")
    if cp > 1 and seq % (2 * cp):
        raise ConfigError(f"seq={seq}: parallel.cp={cp} cuts the sequence into 2 x {cp} = {2 * cp} equal chunks; "
                          f"seq must be a multiple of {2 * cp}")
    if cp > 1 and branch != "none":
        raise ConfigError(f"branch_force={branch}: parallel.cp > 1 runs the gated sum of all branches "
                          "(nsa.context_parallel.nsa_attention); use branch_force=none")


def rank_suffix() -> str:
    """``.rank<r>`` in a torchrun process of rank r > 0, else "": resolver ``nsa_rank_suffix`` of the
    output folder (conf/common.yaml) and the log file (conf/hydra/job_logging/nsa.yaml), so that the ranks
    of one launch do not write one log file (rank 0's keeps its usual name)."""
    r = rank()
    return f".rank{r}" if r > 0 else ""


def register() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("nsa_rank_suffix"):
        OmegaConf.register_new_resolver("nsa_rank_suffix", rank_suffix)


@dataclass
class Group:
    """A job's context-parallel group (``job.cp``): this process's rank of ``world``."""

    group: object       # torch.distributed ProcessGroup (the world)
    rank: int
    world: int
    backend: str        # nccl | gloo


def pin_device() -> None:
    """Under torchrun on a CUDA host, GPU ``LOCAL_RANK`` is this process's current device from the start,
    before the config's checks touch CUDA (a backend's availability check on GPU 0 from every rank would
    put a CUDA context of each rank on GPU 0)."""
    if torchrun_world() is not None and torch.cuda.is_available():
        local = env.launch_ranks()[1]
        if local < torch.cuda.device_count():  # else a CUDA job is refused by check_job (one GPU per rank)
            torch.cuda.set_device(local)


def init(device: torch.device) -> Group:
    """The world group from torchrun's environment: NCCL on CUDA (this rank on GPU LOCAL_RANK, set as the
    current device, so ``device`` "cuda" tensors land there), gloo on the CPU."""
    import torch.distributed as dist

    if device.type == "cuda":
        local = env.launch_ranks()[1]
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")
    return Group(dist.group.WORLD, dist.get_rank(), dist.get_world_size(), dist.get_backend())


def close(ok: bool) -> None:
    """Leave the group. After a job that ran to its end (``ok``), the ranks first meet at a barrier (none
    closes its connections while another still exchanges with it). Every tensor and autograd node of the
    job must be gone before the group is destroyed (an all_gather's autograd node holds the group): a gloo
    group left to die during interpreter finalization can abort the process (SIGABRT, seen in CI:
    tests/test_context_parallel.py). After a failure, no barrier: the other ranks may be gone, and torchrun
    stops them when one exits non-zero."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if ok:
        dist.barrier()
    gc.collect()
    dist.destroy_process_group()
