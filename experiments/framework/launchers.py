"""What a sweep needs from its launcher (``hydra/launcher``) besides ``launch()``: where its jobs run,
and, on SLURM, every job it submitted and how SLURM ended it.

* Jobs of Hydra's basic launcher run here: the sweep checks each job's hardware profile against this
  host's device before anything starts. A SLURM launcher's jobs run on the nodes SLURM picks (a login
  node without GPUs submits GPU jobs): the sweep checks everything else, and each job matches its
  profile to its own device when it starts (a mismatch is that job's FAILED run, with the reason).
* After a sweep, :func:`placement` says from the runs where the jobs ran: which GPUs, how many at once,
  and whether two ever ran at once on one GPU (the tag ``cuda_visible_devices`` each run carries).
* Hydra's submitit launcher collects the jobs' results in order and raises at the first job that left
  none (one SLURM cancelled, timed out, preempted, or whose node failed), without waiting for the later
  ones. :class:`SlurmLaunch` finds the launch's jobs as submitit's job objects (``submitit.SlurmJob``,
  which reads SLURM's accounting, ``sacct``) from the launcher's ``submitit_folder``, one folder per task
  named ``<array job>_<task>``, task i running the launch's i-th job; the sweep waits for all of them,
  and records SLURM's state on a job whose run it ended (:func:`reason`).
"""
from __future__ import annotations

import glob
import re
import time
from dataclasses import dataclass, field

POLL_S = 2.0  # how often a sweep asks SLURM (one sacct call for the whole launch) while it waits
# SLURM job states (sacct's State, e.g. "CANCELLED by 0") that end a job before its process ended its run.
ENDS = {
    "CANCELLED": "cancelled (scancel, or the cluster's administrator)",
    "TIMEOUT": "reached its time limit (hydra.launcher.timeout_min)",
    "PREEMPTED": "preempted by a job of higher priority",
    "NODE_FAIL": "its node failed",
    "BOOT_FAIL": "its node failed to boot",
    "OUT_OF_MEMORY": "ran out of memory (hydra.launcher.mem_gb)",
    "DEADLINE": "reached its deadline",
    "FAILED": "its process exited with an error",
}


def _slurm_launcher_class():
    try:
        from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
    except ImportError:  # the cluster extra is not installed: no SLURM launcher can be configured
        return None
    return SlurmLauncher


def runs_jobs_here(launcher) -> bool:
    """False for a launcher whose jobs run where a scheduler puts them (SLURM)."""
    cls = _slurm_launcher_class()
    return cls is None or not isinstance(launcher, cls)


def tasks_per_job(launcher) -> int:
    """The processes each job of the sweep runs on: a SLURM launcher's nodes x tasks_per_node (one job over
    several ranks, experiments/framework/parallel.py), 1 for every other launcher."""
    if runs_jobs_here(launcher):
        return 1
    return int(launcher.params.get("nodes", 1)) * int(launcher.params.get("tasks_per_node", 1))


def left_no_result(e: Exception) -> bool:
    """submitit's error for a job that ended without a result (one SLURM ended)."""
    from submitit.core.utils import UncompletedJobError

    return isinstance(e, UncompletedJobError)


def slurm_ended(job_id: str) -> bool | None:
    """Whether SLURM's accounting says the job ended; None where it cannot tell (no SLURM here, or a
    job it does not know)."""
    try:
        from submitit import SlurmJob
    except ImportError:
        return None
    state = SlurmJob.watcher.get_state(job_id, mode="force").split(" ")[0]  # UNKNOWN where sacct fails
    return None if state == "UNKNOWN" else state in ("COMPLETED", *ENDS)


def reason(job_id: str, state: str) -> str:
    """One line: which SLURM job, its state and what the state means."""
    what = ENDS.get(state.split()[0], "")
    return f"SLURM job {job_id} {state}" + (f": {what}" if what else "")


@dataclass
class SlurmLaunch:
    """The SLURM jobs of one ``launch()`` of a submitit SLURM launcher."""
    folder: str                                    # submitit_folder, with %j for the job id
    before: set[str] = field(default_factory=set)  # task folders already there (an earlier launch)

    @classmethod
    def of(cls, launcher) -> SlurmLaunch | None:
        """For a SLURM launcher whose ``submitit_folder`` names one folder per job (%j); else None."""
        if runs_jobs_here(launcher) or "%j" not in str(launcher.params.get("submitit_folder", "")):
            return None
        launch = cls(str(launcher.params["submitit_folder"]))
        launch.before = set(launch._ids())
        return launch

    def _ids(self) -> list[str]:
        pattern = re.compile(re.escape(self.folder).replace("%j", r"(\d+_\d+)"))
        return [m.group(1) for p in glob.glob(self.folder.replace("%j", "*")) if (m := pattern.fullmatch(p))]

    def jobs(self) -> list:
        """submitit's job object of each task this launch submitted, in the launch's order."""
        import submitit

        ids = sorted(set(self._ids()) - self.before, key=lambda j: tuple(int(x) for x in j.split("_")))
        return [submitit.SlurmJob(folder=self.folder, job_id=j) for j in ids]

    @staticmethod
    def _done(job) -> bool:
        """SLURM is done with the job: it left its result, or sacct says it ended (submitit's own
        check waits on PREEMPTED, which is final where the cluster cancels preempted jobs)."""
        return job.paths.result_pickle.exists() or job.state.split(" ")[0] in ("COMPLETED", *ENDS)

    def _poll(self, jobs: list) -> list:
        """The jobs SLURM is not done with, after one sacct call for all of them."""
        if jobs:
            jobs[0].watcher.update()
        return [j for j in jobs if not self._done(j)]

    def wait(self) -> list[tuple[str, str]]:
        """Wait until SLURM is done with every job of the launch: (job id, SLURM state) per job, in
        the launch's order."""
        jobs = self.jobs()
        pending = self._poll(jobs)
        while pending:
            time.sleep(POLL_S)
            pending = self._poll(pending)
        return [(j.job_id, j.state) for j in jobs]

    def cancel(self) -> list:
        """scancel the jobs SLURM still holds (their processes get SIGTERM, and SIGKILL after the
        cluster's KillWait): the jobs cancelled."""
        live = self._poll(self.jobs())
        for j in live:
            j.cancel(check=False)
        return live

    def wait_ended(self, jobs: list, wait_s: float) -> None:
        """Wait up to ``wait_s`` for SLURM to be done with ``jobs``."""
        end = time.monotonic() + wait_s
        while jobs and time.monotonic() < end:
            time.sleep(POLL_S)
            jobs = self._poll(jobs)


def placement(runs: list, since_ms: int) -> tuple[str, dict]:
    """Where this launch's jobs ran, from their runs (started at or after ``since_ms``): the GPUs
    (host:CUDA_VISIBLE_DEVICES), how many ran at once, their summed run time against the sweep's wall
    time, and any two that ran at once on one GPU. A line, and the parent's metrics."""
    spans = [(r.info.start_time, r.info.end_time, r.data.tags.get("host", "?"), r.data.tags.get("cuda_visible_devices"))
             for r in runs if r is not None and r.info.end_time and r.info.start_time >= since_ms]
    if not spans:
        return "no job ran in this launch", {}
    at_once = max(sum(s2 <= s < e2 for s2, e2, _, _ in spans) for s, _, _, _ in spans)  # the most running at a start
    shared = sorted({f"{h}:{g}" for i, (s, e, h, g) in enumerate(spans) for s2, e2, h2, g2 in spans[i + 1:]
                     if g is not None and (h, g) == (h2, g2) and s2 < e and s < e2})
    gpus = sorted({f"{h}:{g}" for _, _, h, g in spans if g is not None})
    job_s = sum(e - s for s, e, _, _ in spans) / 1000
    line = (f"{len(spans)} jobs ran on " + (f"GPUs {', '.join(gpus)} (host:CUDA_VISIBLE_DEVICES)" if gpus else "no pinned GPU")
            + f", at most {at_once} at once, {job_s:.1f} s of run time in all")
    if gpus:
        line += f"; jobs ran at once on one GPU: {', '.join(shared)}" if shared else "; never two at once on one GPU"
    return line, {"jobs_at_once_max": at_once, "job_run_time_sum_s": job_s, "gpus_shared_at_once": len(shared)}
