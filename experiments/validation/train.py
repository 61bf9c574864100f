"""Check ``train``: a small language model with NSA layers (``experiments.lm``, ``validate.sizes.<size>.train``:
the ``lm`` shape, byte-level ``text``) trains for N steps on this device twice, from the same seed on the
same batches: once with the run's backends in the run's dtype, once with the reference backend (in float32
where the run's dtype is bfloat16: the reference does not run under bfloat16 autocast). Passes
when every gradient norm is finite, the loss falls (the mean of the last ``validate.train.last`` steps at
most ``falls_to`` x the first step's) and the two loss curves agree: at every step within ``step_rel`` of
the reference's loss, and the means of the last steps within ``last_rel`` (the two runs differ by the
kernels' rounding, which the optimizer carries forward and grows over the steps).
"""
from __future__ import annotations

import math
import tempfile

import torch
from omegaconf import OmegaConf

from ..framework import should_stop
from ..framework.config import CONF_DIR
from ..lm.config import RunConfig, TrainConfig
from ..lm.loop import train
from ..lm.model import LMConfig
from . import report
from .core import Check, Context
from .report import Image, Table, Text


def run_config(ctx: Context, backend) -> RunConfig:
    t = ctx.size.train
    lm = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "lm" / f"{t.lm}.yaml"))
    data = {**OmegaConf.to_container(OmegaConf.load(CONF_DIR / "data" / f"{t.data}.yaml")), "seq_len": int(t.seq_len)}
    tc = TrainConfig(steps=int(t.steps), batch=int(t.batch), lr=float(t.lr), warmup=int(t.warmup), log_every=1,
                     eval_every=int(t.steps), eval_batches=0, ckpt_every=int(t.steps))
    # The reference backend does not run under bfloat16 autocast (RunConfig refuses it): its curve, the
    # exact side of the comparison, is then trained in float32.
    dtype = "bfloat16" if ctx.job.dtype == torch.bfloat16 and backend != "reference" else "float32"
    return RunConfig(lm=LMConfig(**lm), attention="nsa", data=data, train=tc, backend=backend,
                     fallback=ctx.job.fallback if backend != "reference" else None, dtype=dtype,
                     seed=int(ctx.cfg.seed), streams=bool(ctx.cfg.streams))


def curve(cfg: RunConfig, device) -> list[dict]:
    """The logged metrics of every step (checkpoints into a temporary folder)."""
    logged = []
    with tempfile.TemporaryDirectory() as tmp:
        train(cfg, device=device, log=lambda m, step: logged.append({"step": step, **m}), ckpt_dir=tmp,
              run_id="validate-train", should_stop=should_stop)
    return logged


def run(ctx: Context) -> Check:
    c, v = Check("train"), ctx.cfg.validate.train
    plan = dict(ctx.job.plan)
    test, ref = run_config(ctx, plan), run_config(ctx, "reference")
    got, want = curve(test, ctx.device), curve(ref, ctx.device)
    loss, loss_ref = [m["loss"] for m in got], [m["loss"] for m in want]
    n = int(v.last)
    c.require(all(math.isfinite(m["grad_norm"]) for m in got + want), "a gradient norm is not finite")
    c.require(all(math.isfinite(x) for x in loss + loss_ref), "a loss is not finite")
    if not c.reasons:
        last, last_ref = sum(loss[-n:]) / n, sum(loss_ref[-n:]) / n
        worst = max(abs(a - b) / b for a, b in zip(loss, loss_ref))
        c.require(last <= float(v.falls_to) * loss[0], f"the loss did not fall: last {n} steps' mean {last:.3f} > "
                                                       f"{float(v.falls_to)} x the first step's {loss[0]:.3f}")
        c.require(worst <= float(v.step_rel),
                  f"the loss left the reference's curve: {worst:.2%} at worst > {float(v.step_rel):.0%}")
        c.require(abs(last - last_ref) / last_ref <= float(v.last_rel),
                  f"the last {n} steps' mean loss {last:.4f} vs the reference's {last_ref:.4f}: "
                  f"{abs(last - last_ref) / last_ref:.2%} > {float(v.last_rel):.0%}")
        c.metrics = {"first_loss": loss[0], "last_loss_mean": last, "ref_last_loss_mean": last_ref, "max_step_rel_diff": worst,
                     "grad_norm_max": max(m["grad_norm"] for m in got)}
        c.figures = (f"{test.train.steps} steps ({test.dtype}): loss {loss[0]:.3f} -> {last:.3f} (reference {last_ref:.3f}); "
                     f"worst step {worst:.2%} from the reference's curve (tolerance {float(v.step_rel):.0%}), "
                     f"last {n} steps {abs(last - last_ref) / last_ref:.2%} ({float(v.last_rel):.0%})")
    if test.dtype != ref.dtype:
        c.notes.append(f"the run's backends train in {test.dtype}, the reference backend in {ref.dtype} (it does not "
                       "run under bfloat16 autocast): the tolerances cover the difference of the dtypes too")
    if all(b == "reference" for b in plan.values()):
        c.notes.append("the run's backends are the reference: the curve is compared with itself (no other backend of "
                       "every branch runs here; on a CPU, TRITON_INTERPRET=1 and backend=triton compare the kernels)")
    c.rows = [{"step": a["step"], "loss": a["loss"], "loss_ref": b["loss"], "grad_norm": a["grad_norm"],
               "grad_norm_ref": b["grad_norm"]} for a, b in zip(got, want)]
    lm = test.lm
    c.blocks.append(Text(f"lm={ctx.size.train.lm} (dim {lm.dim}, {lm.n_layers} NSA layers, {dict(lm.nsa)}) on "
                         f"data={ctx.size.train.data} ({test.data['seq_len']} tokens, batch {test.train.batch}), "
                         f"{test.train.steps} steps, lr {test.train.lr}, {test.dtype}, seed {test.seed}: backends "
                         + ", ".join(f"{b}={n}" for b, n in plan.items()) + " against backend=reference."))
    every = max(1, len(c.rows) // 10)
    shown = c.rows[::every] + ([c.rows[-1]] if (len(c.rows) - 1) % every else [])
    c.blocks.append(Table(["step", "loss", "reference", "grad norm", "reference"],
                          [[str(r["step"]), f"{r['loss']:.4f}", f"{r['loss_ref']:.4f}", f"{r['grad_norm']:.3g}",
                            f"{r['grad_norm_ref']:.3g}"] for r in shown]))
    img = report.lines({"backends of the run": [(r["step"], r["loss"]) for r in c.rows],
                        "reference": [(r["step"], r["loss_ref"]) for r in c.rows]}, ctx.path("train_loss.png"),
                       "training smoke: loss per step", "step", "loss", logx=False, logy=False)
    c.blocks.append(Image(img, "training smoke: the loss curve against the reference backend's"))
    c.files.append(img)
    return c
