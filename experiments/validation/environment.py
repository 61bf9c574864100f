"""Check ``env``: the GPU, its driver and CUDA, torch/triton/flash-attn/Python, the torch/triton pairing's
verdict (``nsa.toolchain``), and what each backend can run here (its own availability check).

Fails where the profile wants CUDA and this process has none, where bfloat16 is the dtype and the GPU
lacks it, or where a backend of the run's plan cannot run its branch (the framework refuses those
before a run starts; a forced profile, ``hardware.strict=false``, gets here).
"""
from __future__ import annotations

import torch

from nsa import dispatch, toolchain
from nsa.dispatch import BRANCHES

from ..framework import tracking
from .core import Check, Context
from .report import Table

BACKENDS = ("reference", "triton", "sdpa", "fa2")


def availability(device: torch.device, dtype: torch.dtype) -> dict[str, dict[str, str | None]]:
    """backend -> branch -> None (runs here) or the backend's reason."""
    out = {}
    for name in BACKENDS:
        try:
            be = dispatch.get(name)
            out[name] = {b: be.unavailable(b, device, dtype) for b in BRANCHES}
        except dispatch.BackendUnavailable as e:
            out[name] = dict.fromkeys(BRANCHES, str(e))
    return out


def run(ctx: Context) -> Check:
    job, c = ctx.job, Check("env")
    env = tracking.environment(job.dev)
    tid = toolchain.check_toolchain()  # a known-bad pairing stopped the run before (config error)
    supported = tid in toolchain.supported_ids()
    verdict = "supported (a nox session tests it)" if supported else \
        "not among the supported pairs (nor known to break): these checks are its test"
    c.require(job.profile.device != "cuda" or torch.cuda.is_available(),
              f"hardware={job.profile.name} wants CUDA and torch.cuda.is_available() is false")
    if job.device.type == "cuda" and job.dtype == torch.bfloat16:
        c.require(torch.cuda.is_bf16_supported(), f"{job.dev.name} does not support bfloat16")
    avail = availability(job.device, job.dtype)
    for b, name in job.plan.items():
        reason = avail[name][b]
        c.require(reason is None, f"backend.{b}={name} cannot run here: {reason}")
    fa2 = getattr(dispatch.get("fa2"), "impl", "?")
    rows = [["device", f"{job.dev.describe()}, {job.dev.count} visible"], ["driver", env["device_driver"]],
            ["CUDA (torch build)", env["cuda_version"]], ["torch", env["torch_version"]],
            ["triton", env["triton_version"]], ["flash-attn", env["flash_attn_version"]],
            ["fa2 backend runs", fa2], ["Python", env["python_version"]], ["toolchain", f"{tid}: {verdict}"],
            ["hardware profile", f"{job.profile.name} ({job.profile_note})"],
            ["dtype", str(job.dtype).replace("torch.", "")],
            ["backends (plan)", ", ".join(f"{b}={n}" for b, n in job.plan.items())],
            ["policy notes", "; ".join(job.policy_notes) or "none"],
            ["git commit", env.get("git_commit", "not a git checkout") + (" (dirty)" if env.get("git_dirty") == "true" else "")]]
    if job.device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        rows.insert(1, ["GPU memory", f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free"])
    c.blocks.append(Table(["what", "value"], rows))
    c.blocks.append(Table(["backend", *BRANCHES], [[n, *("runs" if avail[n][b] is None else f"no: {avail[n][b]}"
                                                         for b in BRANCHES)] for n in BACKENDS]))
    c.rows = [{"what": k, "value": v} for k, v in rows]
    c.figures = (f"{job.dev.describe()}, driver {env['device_driver']}, CUDA {env['cuda_version']}, torch "
                 f"{env['torch_version']}, triton {env['triton_version']}, flash-attn {env['flash_attn_version']}, "
                 f"Python {env['python_version']}; toolchain {tid} ({'supported' if supported else 'untested'})")
    return c
