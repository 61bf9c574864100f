"""The validation run: the config checked, one MLflow parent run (experiment ``nsa-validate``) with one
child run per check, the report, the exit code.

Each check is a function ``run(ctx) -> Check`` (this package's modules). A check that raises ends
FAIL with the error (its traceback in the log and on its run). A child ends FINISHED when its check
passed and FAILED otherwise (its ``verdict`` tag says PASS, FAIL or SKIP, its ``error`` tag why); a
check left out of ``validate.checks`` gets no run and is reported NOT RUN. The parent carries the
report (report.md, report.html), its images, the recommended hardware profile, and ends FINISHED only
when the headline is PASS; the process exits 0 then, 1 otherwise (2 for a config error, before any run).
"""
from __future__ import annotations

import contextlib
import logging
import time
import traceback
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from nsa import dispatch

from ..framework import cli, hardware, tracking
from ..framework.config import CONF_DIR, ConfigError, one_line, prepare
from ..framework.job import remove_empty_output_dir
from ..framework.job import describe
from ..framework.report import write_csv
from . import decode_breakdown, determinism, environment, faults, kernels, prefill, report, thresholds, train
from .core import FAIL, NOT_RUN, PASS, Check, Context
from .report import Table, Text

log = logging.getLogger("experiments.validate")
CHECKS = {"env": environment.run, "kernels": kernels.run, "decode": decode_breakdown.run, "prefill": prefill.run,
          "thresholds": thresholds.run, "train": train.run, "determinism": determinism.run}
SIZES = ("auto", "cpu", "gpu")


def _config(cfg: DictConfig) -> tuple[DictConfig, str]:
    """The checks' names and the fault checked, the size chosen (by the profile's device for auto) and
    the model filled in from it where none was picked. Raises ConfigError (one line)."""
    v = cfg.validate
    unknown = [c for c in v.checks if c not in CHECKS]
    if unknown:
        raise ConfigError(f"validate.checks: unknown check(s) {unknown}; choose from {', '.join(CHECKS)}")
    if v.inject_fault is not None and v.inject_fault not in faults.BRANCHES:
        raise ConfigError(f"validate.inject_fault={v.inject_fault!r}: one of {', '.join(faults.BRANCHES)}, or null")
    if v.size not in SIZES:
        raise ConfigError(f"validate.size={v.size!r}: one of {', '.join(SIZES)}")
    size = v.size
    if size == "auto":
        try:
            profile, _ = hardware.resolve_profile(cfg.hardware)
        except hardware.HardwareMismatch as e:
            raise ConfigError(str(e)) from e
        size = "gpu" if profile.device == "cuda" else "cpu"
    OmegaConf.set_struct(cfg, False)
    if cfg.get("model") is None:
        cfg.model = OmegaConf.load(CONF_DIR / "model" / f"{v.sizes[size].model}.yaml")
    for b, name in (v.sizes[size].get("backend") or {}).items():
        if cfg.backend.get(b) is None:  # backend=auto leaves the branch to the size, then to the profile
            cfg.backend[b] = name
    return cfg, size


def _run_check(store, parent: str, ctx: Context, name: str) -> Check:
    rid = tracking.start_run(store, f"validate {name}", parent, {"check": name})
    t0 = time.perf_counter()
    log.info(f"[validate] {name} ...")
    try:
        with dispatch.record() as rec:
            res = CHECKS[name](ctx)
    except KeyboardInterrupt as e:
        tracking.end_run(store.client, rid, "KILLED", cli.interrupt_reason(e))
        cli.note_closed(e, rid)
        raise
    except Exception as e:  # noqa: BLE001  (a check that raises fails; the others still run)
        log.error(f"[validate] {name}: {type(e).__name__}: {one_line(e)}", exc_info=True)
        res = Check(name, verdict=FAIL, reasons=[f"error: {type(e).__name__}: {one_line(e)}"[:800]])
        store.client.log_text(rid, traceback.format_exc(), "error.txt")
        rec = None
    res.seconds = time.perf_counter() - t0
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    try:
        ran = ",".join(f"{b}={n}" for b, n in sorted(rec.ran.items())) if rec else "unknown"
        tracking.log_batch(store.client, rid, metrics={**res.metrics, "check_seconds": res.seconds},
                           tags={"mlflow.runName": f"validate {name} {res.verdict}",  # PASS and FAIL told apart
                                 "verdict": res.verdict, "figures": res.figures, "notes": "; ".join(res.notes) or "none",
                                 "not_passed": "; ".join(res.not_passed) or "none", "backends_ran": ran})
        if res.rows:
            path = ctx.path("checks") / f"{name}.csv"
            path.parent.mkdir(exist_ok=True)
            write_csv(path, res.rows)
            store.client.log_artifact(rid, str(path))
        for f in res.files:
            if f.is_file():
                store.client.log_artifact(rid, str(f))
    finally:
        tracking.end_run(store.client, rid, "FINISHED" if res.verdict == PASS else "FAILED",
                         None if res.verdict == PASS else f"{res.verdict}: " + "; ".join(res.reasons))
    level = logging.INFO if res.verdict == PASS else logging.ERROR
    log.log(level, f"[validate] {name}: {res.verdict} in {res.seconds:.1f} s: {res.figures}"
                   + (f" -- {'; '.join(res.reasons)}" if res.reasons else ""))
    return res


def run(cfg: DictConfig) -> None:
    t0 = time.perf_counter()
    hc = HydraConfig.get()
    launch_dir, out = Path(hc.runtime.cwd), Path(hc.runtime.output_dir)
    choices = {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra/") and v}
    try:
        cfg, size = _config(cfg)
        job = prepare(cfg, "validate")
        store = tracking.connect(job.cfg.tracking, "validate", launch_dir)
    except ConfigError as e:
        remove_empty_output_dir(hc)  # one line, exit 2, nothing left behind
        cli.config_exit(str(e))
    v = job.cfg.validate
    ctx = Context(job, v.sizes[size], size, out, v.inject_fault)
    torch.manual_seed(int(job.cfg.seed))
    if job.device.type == "cpu" and job.profile.get("threads"):
        torch.set_num_threads(int(job.profile.threads))  # as every job of the framework (experiments.framework.job)
    parent = tracking.start_run(store, f"validate {job.profile.name}", None, {"validate": "parent"})
    log.info(f"[validate] tracking store {store.describe()}; parent run {parent}; {job.profile_note}; size {size}; "
             f"backends {job.plan}; {job.device}/{job.cfg.dtype}" + (f"; FAULT INJECTED: {ctx.fault}" if ctx.fault else ""))
    params, tags = describe(job, {**choices, "model": job.cfg.model.name})
    tracking.log_batch(store.client, parent, params=params, tags={**tags, "validate_size": size,
                                                                  "inject_fault": ctx.fault or "none"})
    results = []
    fault = faults.inject(ctx.fault) if ctx.fault else contextlib.nullcontext()
    with fault:
        for name in CHECKS:
            if name in v.checks:
                results.append(_run_check(store, parent, ctx, name))
            else:
                results.append(Check(name, verdict=NOT_RUN, reasons=["left out of validate.checks"]))
    word, line = report.headline(results)
    wall = time.perf_counter() - t0
    md, html = report.write(out, "NSA validation", _intro(ctx, parent, store, wall), results)
    try:
        tracking.log_batch(store.client, parent, metrics={"checks_passed": float(sum(r.verdict == PASS for r in results)),
                                                          "checks": float(len(results)), "validate_wall_s": wall},
                           tags={"mlflow.runName": f"validate {job.profile.name} {word}", "headline": word,
                                 "summary": line})
        for f in [md, html, *(f for r in results for f in r.files if f.suffix in (".png", ".yaml"))]:
            store.client.log_artifact(parent, str(f))
    finally:
        tracking.end_run(store.client, parent, "FINISHED" if word == PASS else "FAILED", None if word == PASS else line)
    print(f"NSA validation: {word}\n{line}\n")
    print(report.table_text(results))
    print(f"\nreport: {html}\n        {md}\nMLflow: {store.ui_hint()}")
    if word != PASS:
        raise SystemExit(1)


def _intro(ctx: Context, parent: str, store, wall: float) -> list:
    job = ctx.job
    lines = [f"{job.dev.describe()}; hardware={job.profile.name} ({job.profile_note}); size {ctx.size_name}; "
             f"model={job.cfg.model.name}; {str(job.dtype).replace('torch.', '')}; backends "
             + ", ".join(f"{b}={n}" for b, n in job.plan.items()) + f"; {time.strftime('%Y-%m-%d %H:%M %Z')}; "
             f"{wall:.0f} s in all; MLflow run {parent} ({store.uri})."]
    if ctx.fault:
        lines.append(f"FAULT INJECTED (validate.inject_fault={ctx.fault}): the {ctx.fault} branch's output is wrong in "
                     "every backend but the reference; this report must say FAIL.")
    lines.append("PASS means every check below ran and passed; a check that did not run, or was skipped, is not "
                 "passed. Timings are measured and reported, never judged.")
    return [Text(x) for x in lines] + [Table(["check", "what it does"], [[n, _what(n)] for n in CHECKS])]


def _what(name: str) -> str:
    return {"env": "GPU, driver, CUDA, versions, the torch/triton pairing's verdict, what each backend runs here",
            "kernels": "the kernel tests in pytest: each branch and the layer, forward and every gradient, vs the reference",
            "decode": "per-branch time and share of the decode step, tokens and bytes read, output vs the reference",
            "prefill": "NSA forward and forward+backward against dense attention (FA-2 and PyTorch's default)",
            "thresholds": "window backends over lengths: crossovers, and the policy written as a hardware profile",
            "train": "a small NSA model trains: loss falls, gradients finite, the curve matches the reference backend's",
            "determinism": "the same path twice gives bit-identical outputs (forwards, decode); backwards stated"}[name]
