"""What every kernel benchmark shares: seeded inputs, the check against the reference, the timer, the rows.

Timing: ``triton.testing.do_bench`` on CUDA (``kernels.warmup_ms`` / ``rep_ms``; it clears the L2
cache before every call; p20/p50/p80 of its samples); on a CPU (Triton's interpreter, tiny shapes) the
plain timer of ``experiments.measure`` (median of ``kernels.cpu_repeats`` calls after one warm-up).
Throughput columns use the hardware profile's ceilings: ``fwd_tflop_per_s`` against
``peak_bf16_tflops``, ``fwd_gb_per_s`` against ``peak_hbm_gbps``.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from nsa.numerics import rel_l2

from ..framework import Charts, Job, Result, should_stop
from ..measure.timing import quantiles, time_ms

log = logging.getLogger("experiments.kernels")


@dataclass
class Bench:
    job: Job
    rows: list[dict] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def __post_init__(self):
        j = self.job
        self.k, self.op, self.c = j.cfg.kernels, j.cfg.op, j.nsa
        self.dev, self.dt, self.B, self.T = j.device, j.dtype, int(j.cfg.kernels.batch), j.seq
        self.ref_dtype = torch.float64 if self.dev.type == "cpu" else torch.float32
        self.tol = self.k.tol[str(self.dt).replace("torch.", "")]
        self.gen = torch.Generator(device=self.dev).manual_seed(int(j.cfg.seed))

    @property
    def check_seq(self) -> int:
        return min(self.T, int(self.k.check_seq))

    # -- inputs ------------------------------------------------------------------------------------
    def randn(self, *shape: int, std: float = 1.0, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (torch.randn(*shape, device=self.dev, generator=self.gen) * std).to(dtype or self.dt)

    def rand(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.rand(*shape, device=self.dev, generator=self.gen).to(dtype or self.dt)

    def upcast(self, *xs: torch.Tensor, grad: bool = False) -> list[torch.Tensor]:
        """The reference's copies of ``xs`` (float64 on a CPU, float32 on a GPU)."""
        return [x.detach().to(self.ref_dtype).requires_grad_(grad) for x in xs]

    # -- the check ---------------------------------------------------------------------------------
    def compare(self, name: str, got: torch.Tensor, ref: torch.Tensor, hold: bool = True) -> None:
        """Logs ``check_<name>_rel_l2``; over ``tol.rel_l2`` (or NaN) fails the job where ``hold`` (a
        peer's kernel is recorded, not held)."""
        err = rel_l2(got, ref)
        self.metrics[f"check_{name}_rel_l2"] = err
        if hold and not err <= float(self.tol.rel_l2):
            self.failures.append(f"check: {name} rel-L2 {err:.3g} > {float(self.tol.rel_l2):g}")

    def compare_indices(self, name: str, got: torch.Tensor, ref: torch.Tensor, exact: bool = False) -> None:
        """Logs ``check_<name>_index_mismatch`` (fraction of differing indices); over ``tol.index_mismatch``
        (0 where ``exact``: the same scores in, the same indices out) fails the job."""
        mis = float((got.long() != ref.long()).double().mean()) if got.numel() else 0.0
        self.metrics[f"check_{name}_index_mismatch"] = mis
        limit = 0.0 if exact else float(self.tol.index_mismatch)
        if mis > limit:
            self.failures.append(f"check: {name} index mismatch {mis:.3g} > {limit:g}")

    def compare_grads(self, prefix: str, names: Sequence[str], got: Sequence[torch.Tensor],
                      ref: Sequence[torch.Tensor], hold: bool = True) -> None:
        for n, a, r in zip(names, got, ref):
            self.compare(f"{prefix}{n}", a.grad, r.grad, hold)

    # -- timing ------------------------------------------------------------------------------------
    def time(self, fn: Callable[[], object]) -> dict[str, float]:
        """``{"p20_ms", "p50_ms", "p80_ms"}`` of ``fn``."""
        if self.dev.type == "cuda":
            import triton.testing

            qs = triton.testing.do_bench(fn, warmup=float(self.k.warmup_ms), rep=float(self.k.rep_ms),
                                         quantiles=[0.2, 0.5, 0.8])
            return dict(zip(("p20_ms", "p50_ms", "p80_ms"), map(float, qs)))
        return quantiles(time_ms(fn, self.dev, 1, int(self.k.cpu_repeats), should_stop))

    def row(self, variant: str, fwd: Callable[[], object], fwd_bwd: Callable[[], object] | None = None, *,
            flop: float | None = None, nbytes: float | None = None, **cols) -> dict:
        """Time ``fwd`` (without gradients) and, where given and ``kernels.backward``, ``fwd_bwd``; one CSV
        row with throughputs: ``flop`` (forward matrix-product FLOPs; forward+backward counts 3.5x, the
        FlashAttention convention) and ``nbytes`` (bytes the forward must move)."""
        with torch.no_grad():
            t = {f"fwd_{k}": v for k, v in self.time(fwd).items()}
        if fwd_bwd is not None and self.k.backward:
            t.update({f"fwd_bwd_{k}": v for k, v in self.time(fwd_bwd).items()})
        prof = self.job.profile
        out = {"op": self.op.name, "variant": variant, "seq_tokens": self.T, "batch_seqs": self.B,
               "dtype": str(self.dt).replace("torch.", ""), **t, **cols}
        s = t["fwd_p50_ms"] * 1e-3
        if flop is not None:
            out.update(attn_fwd_flop=flop, fwd_tflop_per_s=flop / s / 1e12,
                       fwd_tflop_roofline_pct=100 * flop / s / 1e12 / float(prof.peak_bf16_tflops))
            if "fwd_bwd_p50_ms" in t:
                out["fwd_bwd_tflop_per_s"] = 3.5 * flop / (t["fwd_bwd_p50_ms"] * 1e-3) / 1e12
        if nbytes is not None:
            out.update(fwd_bytes=nbytes, fwd_gb_per_s=nbytes / s / 1e9,
                       fwd_hbm_roofline_pct=100 * nbytes / s / 1e9 / float(prof.peak_hbm_gbps))
        self.rows.append(out)
        log.info(f"[kernels] op={self.op.name} seq={self.T} {variant}: fwd p50 {t['fwd_p50_ms']:.4f} ms"
                 + (f", fwd+bwd p50 {t['fwd_bwd_p50_ms']:.4f} ms" if "fwd_bwd_p50_ms" in t else ""))
        return out

    def skip(self, variant: str, reason: str) -> None:
        """A row that cannot run here: its reason on the run (tag ``skipped_<variant>``) and in the log."""
        self.tags[f"skipped_{variant}"] = reason
        log.info(f"[kernels] op={self.op.name} seq={self.T} {variant}: skipped: {reason}")

    def result(self) -> Result:
        first = self.rows[0] if self.rows else {}  # the op's own kernel
        headline = {k: first[k] for k in ("fwd_p50_ms", "fwd_bwd_p50_ms") if k in first}
        checks = {k.removeprefix("check_"): v for k, v in self.metrics.items() if k.startswith("check_")}
        if checks:  # the correctness figures on the screen and in the summary, beside the timings
            errs = [v for k, v in checks.items() if k.endswith("_rel_l2")]
            if errs:
                headline["check_worst_rel_l2"] = max(errs)
            log.info(f"[kernels] op={self.op.name} seq={self.check_seq} check against the reference (tolerance rel-L2 "
                     f"{float(self.tol.rel_l2):g}): " + ", ".join(f"{k} {v:.3g}" for k, v in checks.items()))
        ys = ("fwd_p50_ms", "fwd_bwd_p50_ms") if any("fwd_bwd_p50_ms" in r for r in self.rows) else ("fwd_p50_ms",)
        return Result(self.rows, self.metrics, headline=headline, failure="; ".join(self.failures) or None,
                      charts=Charts("seq_tokens", "variant", ys), tags=self.tags, texts=self.texts)


def backward_of(fn: Callable[[], object], leaves: Sequence[torch.Tensor], dout: torch.Tensor) -> Callable[[], None]:
    """A forward+backward call of ``fn`` (its output, or its first output) into ``leaves``' gradients."""

    def step():
        for t in leaves:
            t.grad = None
        out = fn()
        (out[0] if isinstance(out, tuple) else out).backward(dout)

    return step


def leaves(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [x.detach().requires_grad_(True) for x in xs]
