"""Training: a small decoder language model with NSA, dense or sliding-window attention (experiments/lm).

    python -m experiments.train train=smoke                                  # CPU: text, 60 steps
    python -m experiments.train -m attention=nsa,dense train=smoke           # one parent run, both curves
    python -m experiments.train hardware=h200 train=needles32k -m attention=nsa,dense

One MLflow run per job (experiment ``nsa-train``). As the loop logs a step, the run gets its metrics
(``experiments.lm.loop``: ``loss``, ``accuracy``, ``tokens_per_s``, peak memory, ``gate_<branch>``
for NSA; every ``train.eval_every`` steps ``val_loss``, ``val_accuracy`` and NSA's ``sel_mass`` /
``sel_recall``), stepped by training step. Params: the config and the parameter counts by kind
(``n_params.<kind>``). At the end, the headline metrics from the whole stored curve: ``0_final_loss``
and ``0_val_loss`` / ``0_val_accuracy`` (the last logged), ``0_tokens_per_s`` (median over the main
stage's logged steps), ``0_sel_recall`` / ``0_sel_mass`` (NSA; on a retrieval task also their
``_answers`` forms, at the answer positions), ``0_peak_mem_gib`` (CUDA). With ``train.profile=true``,
step ``log_every + 1`` runs under torch.profiler: its tables (kernels and ops by their own device time,
and on a GPU by their own host time) are printed and logged on the run as ``profile/train_step.txt``.
``train.compile=<mode>`` runs the training steps through ``torch.compile`` (``reduce-overhead``: CUDA
graphs; docs/training.md "Speed"). A sweep's
parent carries every job's curves as its own metrics (``loss/nsa``, ``val_accuracy/dense``, ...) and
``train_by_step.png``.

Checkpoints go to ``<output dir>/ckpt/last.pt`` (every ``train.ckpt_every`` steps, at the end, and at
the ``train.time_limit_s`` stop). Resume a killed or time-limited run by running the same command with
the same output directory: ``hydra.run.dir=<its output dir>`` (a sweep: ``hydra.sweep.dir=<its dir>
hydra.sweeper.resume=<parent run id>``). The checkpoint names the run, which is reopened: its curve
goes on from the last logged step, each step once. A run stopped by its time limit ends FAILED (exit 1)
with the command that resumes it.
"""
from __future__ import annotations

import logging
import math
import statistics
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from nsa.numerics import DTYPES

from .framework import Charts, ConfigError, Job, Result, check_memory, launch, run_job, should_stop
from .framework.cli import override
from .framework.config import one_line
from .framework import parallel
from .lm import checkpoint, cost, distributed, grow, passkey, selections
from .lm.config import RunConfig
from .lm.data import make_task
from .lm.loop import parameter_counts, resumable, train

log = logging.getLogger("experiments.train")
# The parent run's curves (one line per job) and its chart's panels.
CURVES = ("loss", "accuracy", "val_loss", "val_accuracy", "tokens_per_s")


def run_config(job: Job) -> RunConfig:
    """The training library's config of a job: the composed config with what the framework resolved
    (the hardware policy's backends, fallback, the profile's dtype). A ValueError names the field
    (train's own ``check``, given to ``run_job`` and ``launch``: a config error, exit 2, before any run)."""
    for key in ("model", "branch_force"):
        if key in job.cfg:
            raise ValueError(f"{key}: not an option of experiments.train (its model: lm=..., attention=...)")
    cfg = RunConfig.from_conf(job.cfg, backend=job.plan, fallback=job.fallback, dtype=job.dtype)
    if parallel.torchrun_world() is not None and cfg.attention == "nsa" and cfg.train.save_selections:
        raise ValueError("train.save_selections=true: runs in one process, not under torchrun; resume the checkpoint "
                         "in one process (python -m experiments.train ...) to save them")
    if cfg.train.passkey.lengths and (cfg.data["task"] != "text" or parallel.torchrun_world() is not None):
        raise ValueError(f"train.passkey.lengths={list(cfg.train.passkey.lengths)}: passkey retrieval runs on a text task "
                         "(data=text) in one process, not under torchrun")
    if cfg.train.eval_positions and int(OmegaConf.select(job.cfg, "parallel.cp", default=1)) > 1:
        raise ValueError(f"train.eval_positions={cfg.train.eval_positions}: the loss by position is taken on whole rows; "
                         "not with parallel.cp > 1 (a rank holds part of each sequence)")
    if cfg.train.init_from is not None:  # the dense checkpoint read and checked before any run exists
        if cfg.lm.hf is not None:
            raise ValueError(f"train.init_from={cfg.train.init_from}: grows experiments.lm's own model; lm=hf starts from "
                             "lm.hf.path (a dense folder there is converted)")
        grow.source(cfg)
    if cfg.lm.hf is not None:  # lm=hf (experiments/lm/hf.py): what it cannot run stops here, exit 2
        from .lm.hf import check
        check(cfg.lm, cfg.attention, cfg.train.ablation.selection, cfg.stages()[-1][1].vocab_size)
        if cfg.attention == "nsa" and cfg.train.recipe.sel_loss:
            raise ValueError(f"train.recipe.sel_loss={cfg.train.recipe.sel_loss:g}: lm=hf does not take the selection loss "
                             "(it reads each block of experiments.lm.model.LM); 0 trains without it")
    return cfg


def check_fits(job: Job) -> dict[str, float]:
    """The training's memory at least (``cost.memory_lower_bound``) against limits.max_memory_gib, or what the
    device has free: a ResourceLimit in one line, with its parts, where it cannot fit (``run_job`` calls this
    before a single run exists; ``work`` again first, where a sweep's job fails alone)."""
    cfg = run_config(job)
    parts = cost.memory_lower_bound(cfg, parameter_counts(cfg)["total"])
    _, task, batch = max(cfg.stages(), key=lambda s: s[2] * s[1].seq_len)
    check_memory(job, sum(parts.values()), f"train.batch={batch} x {task.seq_len} tokens, at least: "
                 + ", ".join(f"{k} {v / 2**30:.3g}" for k, v in parts.items()) + " GiB")
    return parts


def earlier_run(job: Job) -> str | None:
    """The run a checkpoint in the job's output directory belongs to (it is continued), or None."""
    try:
        found = resumable(run_config(job), job.out_dir / "ckpt")
    except checkpoint.Unreadable as e:  # the run it belongs to stays as it was
        where = "hydra.sweep.dir" if job.cfg.tracking.get("parent_run_id") else "hydra.run.dir"
        raise ConfigError(f"{e}; to start afresh, delete it or choose another {where}") from e
    except ValueError as e:
        raise ConfigError(f"{job.out_dir / 'ckpt'}: {one_line(e)}") from e
    return found["run_id"] if found else None


def resume_args(job: Job) -> str:
    """What continues this job from its checkpoint, added to the command that started it."""
    parent = job.cfg.tracking.get("parent_run_id")
    if parent:  # shell words Hydra reads back as these values (framework.cli.override): they paste as printed
        return f"{override('hydra.sweep.dir', str(job.out_dir.parent))} hydra.sweeper.resume={parent}"
    return override("hydra.run.dir", str(job.out_dir))


def headline(job: Job, cfg: RunConfig) -> dict[str, float]:
    """From the run's stored curve, whichever processes logged it."""
    out = {}
    for name, key in (("final_loss", "loss"), ("val_loss", "val_loss"), ("val_accuracy", "val_accuracy"),
                      ("sel_recall", "sel_recall"), ("sel_mass", "sel_mass"),
                      ("sel_recall_answers", "sel_recall_answers"), ("sel_mass_answers", "sel_mass_answers")):
        h = job.run.history(key)
        if h:
            out[name] = h[-1][1]
    stages = cfg.stages()
    main_from = stages[-2][0] if len(stages) > 1 else 0  # the main stage's steps are those after it
    tps = job.run.history("tokens_per_s")
    main = [v for s, v in tps if s > main_from] or [v for _, v in tps]
    if main:
        out["tokens_per_s"] = statistics.median(main)
    mem = job.run.history("peak_mem_gib")
    if mem:
        out["peak_mem_gib"] = max(v for _, v in mem)
    return out


def passkey_grid(job: Job, cfg: RunConfig, model) -> None:
    """train.passkey: passkey retrieval over lengths x depths at the end of the run (experiments/lm/passkey.py),
    logged as metrics at the last step and as the heat map ``passkey/heatmap.png``."""
    tc, dtype = cfg.train, DTYPES[cfg.dtype]

    def autocast():
        return torch.autocast(job.device.type, dtype=dtype, enabled=dtype != torch.float32)

    acc = passkey.grid(model, cfg.stages()[-1][1], tc.passkey, cfg.seed, job.device, autocast)
    job.run.log_metrics(acc, tc.steps)
    path = job.out_dir / "passkey" / "heatmap.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    passkey.heatmap(acc, tc.passkey, f"passkey retrieval, {cfg.attention} ({cfg.lm.name}, trained at {job.seq})", path)
    job.run.log_artifact(path, "passkey")
    log.info(f"[train] passkey retrieval: {acc['passkey_acc']:.3f} over {len(acc) - 1} cells (passkey/heatmap.png)")


def trained_tokens(cfg: RunConfig, step: int) -> int:
    """The tokens of the batches of updates 1..``step``, over the curriculum's stages (``RunConfig.stages``: each
    stage's last step, task and batch)."""
    out, start = 0, 0
    for end, task, batch in cfg.stages():
        out += max(0, min(step, end) - start) * batch * task.seq_len
        start = end
    return out


def save_selections(job: Job, cfg: RunConfig, model) -> None:
    """train.save_selections: the trained layer's selections on held-out sequences of train.selection_lengths,
    on the run as ``selections/layer<i>.pt`` with their tile sharing as metrics (``sel_share_T<T>``,
    ``sel_share_picked_T<T>``; experiments/lm/selections.py)."""
    tc, dtype = cfg.train, DTYPES[cfg.dtype]
    layer = tc.selection_layer % len(model.nsa_layers())  # RunConfig checked it names a layer
    path = job.out_dir / "selections" / f"layer{layer}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)

    def autocast():
        return torch.autocast(job.device.type, dtype=dtype, enabled=dtype != torch.float32)

    stats = selections.save(model, lambda T: make_task({**cfg.data, "seq_len": T}, cfg.seed), tc.selection_lengths,
                            layer, path, job.device, autocast)
    job.run.log_artifact(path, "selections")
    job.run.log_metrics({f"sel_{k}": v for k, v in stats.items()}, tc.steps)
    log.info(f"[train] selections of NSA layer {layer} at {', '.join(map(str, tc.selection_lengths))} tokens saved on the "
             f"run (selections/{path.name}); tile sharing: " + ", ".join(f"{k} {v:.3f}" for k, v in stats.items()))


def work(job: Job) -> Result:
    """The job's training. Under torchrun every rank runs it (:mod:`experiments.lm.distributed`): rank 0 holds the
    run (``job.run``) and the others none; they share rank 0's checkpoint folder, run id and logged step."""
    check_fits(job)
    cfg = run_config(job)
    tc, run, ckpt = cfg.train, job.run, job.out_dir / "ckpt"
    world = None
    if job.cp is not None:  # torchrun: the process group is up (framework.job), here its dp x cp mesh
        world = distributed.World.create(cfg.dp, cfg.cp, job.device)
        ckpt = Path(world.same(str(ckpt)))
    if run is not None:
        run.log_params({f"n_params.{k}": v for k, v in parameter_counts(cfg).items()})
        main = cfg.stages()[-1][1]
        if hasattr(main, "fingerprint"):  # a text corpus: which files, how many bytes (they differ between hosts)
            run.log_params(main.fingerprint())
    target = tc.loss_target
    if run is not None:
        if tc.init_from is not None:  # the dense run it grew from: within 1 % of its held-out loss is the target
            src = grow.source(cfg)
            target = grow.loss_target(cfg, src["val_loss"])
            run.log_params({"init_from_run": src["run_id"], "init_from_step": src["step"], "init_from_file": str(src["path"]),
                            "init_from_val_loss": src["val_loss"]})
        if target is not None:
            run.log_params({"loss_target_used": target})
        if world is not None:
            run.log_params({"world_size": world.size})
    reached = bool(run is not None and run.history("steps_to_loss_target"))  # a resumed run logged it already
    done = max((s for s, _ in run.history("loss")), default=0) if run is not None else 0
    run_id = run.id if run is not None else None
    if world is not None:
        done, run_id = world.same(done), world.same(run_id)
    found = resumable(cfg, ckpt)
    if run is not None:
        if found:
            log.info(f"[train] resuming run {run.id} from its checkpoint at step {found['step']} "
                     f"(steps logged: {done}; those after the checkpoint are recomputed, not logged again)")
        over = f" over {world.size} processes (dp={world.dp} x cp={world.cp})" if world is not None else ""
        log.info(f"[train] {cfg.attention} on {cfg.data['task']} (seq {job.seq}), {tc.steps} steps{over}; output "
                 f"{job.out_dir}; resume after a crash: the same command with {resume_args(job)}")

    def log_step(metrics: dict, step: int) -> None:
        if run is None:  # a rank > 0: rank 0 logs the reduced figures
            return
        # loss first: tracking.log_batch stores it last where a step takes several calls, and a resumed run counts a
        # step as logged by its loss
        nonlocal reached
        if target is not None and not reached and metrics.get("val_loss", math.inf) <= target:
            reached = True  # the first evaluation at or under the target: its step and the tokens trained on so far
            metrics = {**metrics, "steps_to_loss_target": step, "tokens_to_loss_target": trained_tokens(cfg, step)}
            log.info(f"[train] step {step}: val_loss {metrics['val_loss']:.4f} <= train.loss_target {target:.4f}")
        run.log_metrics({"loss": metrics["loss"], **metrics}, step)
        if "val_loss" in metrics or step == tc.steps:
            log.info(f"[train] step {step}/{tc.steps}: loss {metrics['loss']:.4f} accuracy {metrics['accuracy']:.4f}"
                     + (f" val_loss {metrics['val_loss']:.4f} val_accuracy {metrics['val_accuracy']:.4f}"
                        if "val_loss" in metrics else "") + f", {metrics['tokens_per_s']:.0f} tokens/s")

    out = train(cfg, device=job.device, log=log_step, ckpt_dir=ckpt, run_id=run_id, logged_through=done, world=world,
                should_stop=should_stop)
    if run is None:
        return Result([], {})
    if tc.save_selections and cfg.attention == "nsa" and out["completed"]:
        save_selections(job, cfg, out["model"])
    if tc.passkey.lengths and out["completed"]:
        passkey_grid(job, cfg, out["model"])
    texts = {}
    if out["profile"]:
        texts["profile/train_step.txt"] = out["profile"]
        log.info(f"[train] train.profile: {out['profile']}")
    elif tc.profile:
        log.info(f"[train] train.profile: no step profiled (this process did not run step {tc.log_every + 1})")
    head = headline(job, cfg)
    row = {"attention": cfg.attention, "lm": cfg.lm.name, "task": cfg.data["task"], "seq_len_tokens": job.seq,
           "steps": out["step"], "steps_planned": tc.steps, **head,
           **{f"n_params_{k}": v for k, v in out["params"].items()}}
    if world is not None:
        row.update(world_size=world.size, dp=world.dp, cp=world.cp)
    failure = None
    if not out["completed"]:
        failure = (f"stopped by train.time_limit_s={tc.time_limit_s:g} after step {out['step']} of {tc.steps}; "
                   f"the checkpoint in {ckpt} resumes it: the same command with {resume_args(job)}")
    tags = {"resumed_from_step": str(found["step"])} if found else {}
    return Result([row], {}, headline=head, failure=failure, charts=Charts("step", "", CURVES, kind="by_step"), tags=tags,
                  texts=texts)


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_job(cfg, "train", work, resume=earlier_run, fits=check_fits, check=run_config)


if __name__ == "__main__":
    launch(main, "train", check=run_config)
