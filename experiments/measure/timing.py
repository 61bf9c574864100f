"""Timers: milliseconds per call (CUDA events on a GPU, perf_counter on a CPU), CUDA-graph capture and
replay of decode steps, their quantiles, and a torch.profiler table of one call."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch



def graph_step(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """CUDA-graph hook for decode steps: capture ``fn`` once (static inputs) and replay it."""
    if device.type != "cuda":
        raise ValueError("decode.cuda_graph=true needs a CUDA device")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def repeated(fn: Callable[[], object], n: int) -> Callable[[], object]:
    """``fn`` called ``n`` times in a row (returns the last result): the body of a graph of n steps."""
    def run():
        out = None
        for _ in range(n):
            out = fn()
        return out
    return run


def graph_ms(capture: Callable, fn: Callable[[], object], device: torch.device, warmup: int, repeats: int,
             reps: int, should_stop: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Quantiles of the time of one call of ``fn`` on the GPU: ``capture`` (``graph_step``, or a
    ``GraphDecoder``'s ``graph(...).replay``) takes ``reps`` calls of fn into ONE CUDA graph, each
    replay is timed with CUDA events and divided by reps. A replay costs the host a fixed launch
    (at B=1 on an H200 a graph of one decode kernel replayed in 9.3 or 14.5 us, at random): one call
    per graph measures that launch, reps calls per graph spread it over the calls and leave the GPU's
    own time. ``single_replay_p50_ms``: the median of graphs of one call (host launch included); ``should_stop``:
    as :func:`time_ms`'s."""
    many = quantiles([t / reps for t in time_ms(capture(repeated(fn, reps)), device, warmup, repeats, should_stop)])
    one = quantiles(time_ms(capture(fn), device, warmup, repeats, should_stop))
    return {**many, "single_replay_p50_ms": one["p50_ms"]}


def decode_launch_tags(decoder) -> dict[str, str]:
    """A ``nsa.decode.GraphDecoder``'s launch modes as run tags: ``decode_pdl`` (programmatic dependent
    launch between the step's kernels), ``decode_mode`` (launches per step: ``tuning.decode.mode``) and
    ``decode_prologue`` (the layer step's RoPE, cache writes, phi and gates: ``tuning.decode.prologue``)."""
    p = decoder.kernel_params()
    return {f"decode_{k}": str(p[k]) for k in ("pdl", "mode", "prologue")}


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int,
            should_stop: Callable[[], None] = lambda: None) -> list[float]:
    """Milliseconds per call of fn, one sample per call: CUDA events on GPU, perf_counter on CPU.
    ``should_stop()`` runs between calls, outside the timed span, and stops the timing by raising (the entry
    point's: a signal's exception that Python dropped, raised again)."""
    for _ in range(warmup):
        fn()
        should_stop()
    out = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for a, b in ev:
            a.record()
            fn()
            b.record()
            should_stop()
        torch.cuda.synchronize(device)
        return [a.elapsed_time(b) for a, b in ev]
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
        should_stop()
    return out


@contextlib.contextmanager
def profiled(device: torch.device, rows: int = 30):
    """The work in the block under ``torch.profiler``, the device synchronised before and after; yields a
    list that holds, once the block ends, the table of the ops and kernels by their own time on the device
    (CPU time on a CPU) and, on a GPU, a second table by their own time on the host (where a step that waits
    on its launches spends it)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out: list[str] = []
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=acts) as prof:
        yield out
        if cuda:
            torch.cuda.synchronize(device)
    events = prof.key_averages()
    # torch >= 2.4 names the device columns "device"; 2.3 named them "cuda"
    key = "self_cpu_time_total"
    if cuda:
        key = "self_device_time_total" if all(hasattr(e, "self_device_time_total") for e in events) \
            else "self_cuda_time_total"
    out.append(events.table(sort_by=key, row_limit=rows))
    if cuda:
        out.append(events.table(sort_by="self_cpu_time_total", row_limit=rows))


def profile_table(fn: Callable[[], object], device: torch.device, rows: int = 30) -> str:
    """One call of ``fn`` (after one untimed call) under ``torch.profiler``: a table of the ops and
    kernels by their own time on the device (CPU time on a CPU), so a user sees where the time goes."""
    fn()
    with profiled(device, rows) as table:
        fn()
    return table[0]


def quantiles(ms: list[float]) -> dict[str, float]:
    t = torch.tensor(ms, dtype=torch.float64)
    return {f"p{p}_ms": float(torch.quantile(t, p / 100)) for p in (20, 50, 80)}
