"""Prefill benchmark: the attention core's forward and forward+backward vs dense causal SDPA.

    python -m experiments.prefill -m seq=64,128
    python -m experiments.prefill hardware=h200 model=h200bench backend=triton -m seq_len=paper

Queries, keys, values and gates come from an NSAAttention layer on random input (the compression
phi included), then detached: the timed work is attention only (``measure.branches.core``), like the
dense baseline (SDPA, is_causal=True, grouped heads). Rows: ``nsa`` (all branches, or the forced one),
``cmp``/``sel``/``win`` alone (branch_force=none and prefill.per_branch), ``dense`` (SDPA picks its
kernel), on CUDA with prefill.dense_flash ``dense_flash`` (SDPA forced to FlashAttention-2), and the
public NSA kernels of ``prefill.peers`` (``experiments.peers``: ``fla``, where it can run the shape; else a
tag ``peer_fla`` says why).
With prefill.profile, one forward and one forward+backward of each NSA row run under torch.profiler:
the tables (kernels by device time) are printed and logged on the run as ``profile/<row>_*.txt``.

FLOPs count the matrix products over the keys each query really attends to (visible compressed
tokens, selected tokens u <= t, window): 2 * (Dk + Dv) per query head and key. Forward+backward
counts 3.5x the forward (backward = 2.5x: the FlashAttention benchmark convention).
With ``parallel.cp=N`` under ``torchrun --nproc_per_node N`` (docs/cluster.md), each rank times the
context-parallel path on its part of the sequence instead (:func:`cp_work`: per-rank times, the all-gather's share).
Launch parameters of the triton kernels: ``tuning.<op>.<key>=<value>``, as in ``experiments.kernels`` (validated
first, applied around the job, tag ``tuning_overrides``), so a layer-level A/B of a tile is one sweep.
"""
from __future__ import annotations

import json
import logging

import hydra
import torch
from omegaconf import DictConfig

from nsa import NSAAttention, functional
from nsa.backends.triton import tuning

from . import peers
from .framework import Charts, Job, Result, check_memory, launch, run_job, should_stop
from .framework.config import tuning_overrides
from .lm.selections import tile_sharing
from .measure import replay
from .measure.branches import core, selection_indices
from .measure.dense import dense_attention, math_path
from .measure.inputs import layer_bytes, prefill_inputs
from .measure.timing import profile_table, quantiles, time_ms
from .measure.tokens import block_union_fraction, branch_tokens, selected_tokens, variant_tokens

BWD_FACTOR = 3.5
log = logging.getLogger("experiments.prefill")


def check_config(job: Job) -> None:
    """prefill's rules beyond ``config.RULES``: ``prefill.indices`` is ``random`` or a selections file that holds
    this seq at the model's blocks (``measure.replay.load``); the peers select their own blocks, so a replay
    times none."""
    p = job.cfg.prefill
    if not isinstance(p.indices, str) or not p.indices:
        raise ValueError(f"prefill.indices={p.indices!r}: 'random' or the path of a selections file "
                         "(train.save_selections)")
    if p.indices != replay.RANDOM:
        if job.cp is not None or int(job.cfg.parallel.cp) > 1:
            raise ValueError(f"prefill.indices={p.indices!r}: not with parallel.cp > 1 (each rank selects its own)")
        if len(p.peers):
            raise ValueError(f"prefill.indices={p.indices!r}: the peers ({', '.join(p.peers)}) select their own "
                             "blocks; time them with prefill.indices=random (prefill.peers=[] here)")
        replay.load(p.indices, job.seq, job.nsa)


def estimate_bytes(job: Job) -> float:
    """The layer's activations per token (queries, outputs and their gradients, the branches' keys/values,
    the input), the top-n's int64 indices (n_sel bounded by the blocks, ``NSAConfig.bounded``), the
    layer's parameters, and on SDPA's math path the dense baseline's repeated keys/values and S x S scores."""
    c, B, S = job.nsa, job.cfg.prefill.batch, job.seq
    per_token = c.n_heads * (c.d_k + c.d_v) * 4 + c.n_kv_heads * (c.d_k + c.d_v) * 12 + 4 * c.dim
    idx = B * S * c.n_kv_heads * c.bounded(S).n_sel * 8
    dense = 0  # the dense baseline's own tensors where SDPA runs its math kernel (measure.dense.math_path)
    if math_path(job.device, c.d_k, c.d_v):
        dense = B * S * c.n_heads * (2 * c.d_k + c.d_v) * job.dtype.itemsize + 3 * B * c.n_heads * S * S * 4
    return float(B * S * per_token * job.dtype.itemsize + idx + dense) + layer_bytes(c, job.dtype.itemsize)


def dense_variants(dense_flash: bool, c, device_type: str) -> tuple[list[str], dict[str, str]]:
    """The dense baselines to time, and a note (run tag) for one that cannot run here: PyTorch's
    FlashAttention-2 runs on CUDA only and needs one head dim for q, k and v."""
    if not dense_flash or device_type != "cuda":
        return ["dense"], {}
    if c.d_k != c.d_v:
        return ["dense"], {"dense_flash": f"dense_flash skipped: FlashAttention-2 needs d_k == d_v (got {c.d_k}/{c.d_v})"}
    return ["dense", "dense_flash"], {}


def cp_estimate_bytes(job: Job) -> float:
    """One rank's tensors: its 2C = S/cp tokens' share of :func:`estimate_bytes`, and the whole sequence's
    raw keys/values of the three branches (all-gathered) with their gradients."""
    c, B, S, R = job.nsa, job.cfg.prefill.batch, job.seq, int(job.cfg.parallel.cp)
    gathered = B * S * c.n_kv_heads * (c.d_k + c.d_v) * 3 * 2 * job.dtype.itemsize
    return estimate_bytes(job) / R + float(gathered)


def check_fits(job: Job) -> None:
    """ResourceLimit where the job's estimate (one rank's under parallel.cp) exceeds the limit (``run_job``
    calls this before the run is created)."""
    check_memory(job, cp_estimate_bytes(job) if int(job.cfg.parallel.cp) > 1 else estimate_bytes(job))


def cp_work(job: Job) -> Result:
    """parallel.cp > 1 (under torchrun): each rank times ``nsa.context_parallel.nsa_attention`` on its part of
    one sequence (two mirrored chunks of S / 2cp tokens): the all-gather of the raw keys/values, phi over the
    whole sequence and the three branches at the rank's positions; forward and forward+backward (whose
    backward reduce-scatters the key/value gradients), and the all-gather alone, as often. Inputs: this
    rank's queries, keys, values and gates from the layer (the same weights on every rank, from the seed)
    at its own positions, then detached. A step takes the slowest rank's time: the headline is the max over
    ranks; per rank (``rank<r>_*``) the times and, on CUDA, the peak memory."""
    import torch.distributed as dist

    from nsa import context_parallel as cp

    p, c, S, g = job.cfg.prefill, job.nsa, job.seq, job.cp
    B, dev, dt = p.batch, job.device, job.dtype
    torch.manual_seed(int(job.cfg.seed))
    layer = NSAAttention(c, backend=job.plan, fallback=job.fallback).to(dev, dt)
    torch.manual_seed(int(job.cfg.seed) + 1 + g.rank)  # this rank's tokens: its own draw
    with torch.no_grad():
        x = torch.randn(B, S // g.world, c.dim, device=dev, dtype=dt)
        q, kv, gates = layer.project(x, cp.positions(S, g.rank, g.world, dev))
    names = ("k_cmp_raw", "v_cmp_raw", "k_sel", "v_sel", "k_win", "v_win")
    leaves = [t.detach().requires_grad_(True) for t in (q, *(kv[n] for n in names), gates)]
    del x, q, kv, gates

    def run():
        return cp.nsa_attention(*leaves, c, phi_k=layer.phi_k, phi_v=layer.phi_v, group=g.group, backend=job.plan,
                                fallback=job.fallback)

    def gather():  # the forward's communication alone: the six raw key/value tensors, as run() gathers them
        for t in leaves[1:7]:
            cp.gather_sequence(t, g.group)

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    dist.barrier(group=g.group)
    with torch.no_grad():
        tq = {f"fwd_{k}": v for k, v in quantiles(time_ms(run, dev, p.warmup, p.repeats, should_stop)).items()}
        tq.update({f"allgather_{k}": v for k, v in
                   quantiles(time_ms(gather, dev, p.warmup, p.repeats, should_stop)).items()})
    if p.backward:
        dout = torch.randn_like(run().detach())
        params = list(layer.parameters())

        def fwd_bwd():
            for t in leaves + params:
                t.grad = None
            run().backward(dout)

        tq.update({f"fwd_bwd_{k}": v for k, v in
                   quantiles(time_ms(fwd_bwd, dev, p.warmup, p.repeats, should_stop)).items()})
    if dev.type == "cuda":
        tq["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    log.info(f"[prefill] seq={S} rank {g.rank}/{g.world}: fwd p50 {tq['fwd_p50_ms']:.3f} ms, all-gather p50 "
             f"{tq['allgather_p50_ms']:.3f} ms" + (f", fwd+bwd p50 {tq['fwd_bwd_p50_ms']:.3f} ms" if p.backward else ""))
    per_rank = [None] * g.world
    dist.all_gather_object(per_rank, tq, group=g.group)
    if g.rank != 0:
        return Result([], {})
    timings = ("fwd", "fwd_bwd") if p.backward else ("fwd",)
    rows = [{"seq_tokens": S, "batch_seqs": B, "cp": g.world, "rank": r, "tokens_per_rank": S // g.world,
             "variant": "nsa_cp", "backend_cmp": job.plan["cmp"], "backend_sel": job.plan["sel"],
             "backend_win": job.plan["win"], "dtype": str(dt).replace("torch.", ""), **t}
            for r, t in enumerate(per_rank)]
    metrics = {f"rank{r}_{k}": v for r, t in enumerate(per_rank) for k, v in t.items()
               if k.endswith("p50_ms") or k == "peak_mem_gib"}
    worst = {k: max(t[k] for t in per_rank) for k in per_rank[0]}  # a step waits for the slowest rank
    headline = {**{f"cp_{t}_p50_ms": worst[f"{t}_p50_ms"] for t in timings},
                "allgather_p50_ms": worst["allgather_p50_ms"],
                "allgather_share_of_fwd": worst["allgather_p50_ms"] / worst["fwd_p50_ms"]}
    if "peak_mem_gib" in worst:
        headline["peak_mem_gib_max"] = worst["peak_mem_gib"]
    tags = {"cp_timed": "nsa.context_parallel.nsa_attention per rank (all-gather, phi, three branches); headline: "
                        "max over ranks; allgather_share_of_fwd: the all-gather alone, timed as often, over the forward",
            **({} if dev.type == "cuda" else {"cp_peak_memory": "not measured: per-rank peak memory is CUDA's allocator's"})}
    return Result(rows, metrics, headline=headline, tags=tags)


SHARING_TILES = (2, 4, 8)  # query rows per tile of the block-sharing metrics


def work(job: Job) -> Result:
    over = tuning_overrides(job.cfg)
    with tuning.overrides(over):
        res = _work(job)
    if over:
        res.tags["tuning_overrides"] = json.dumps(over, sort_keys=True)
    return res


def _work(job: Job) -> Result:
    check_fits(job)
    if job.cp is not None:  # parallel.cp > 1: the context-parallel path, timed per rank
        return cp_work(job)
    p, c, S = job.cfg.prefill, job.nsa, job.seq
    B, dev, dt, branch = p.batch, job.device, job.dtype, job.branch
    layer = NSAAttention(c, backend=job.plan, fallback=job.fallback).to(dev, dt)
    with torch.no_grad():
        inp = prefill_inputs(layer, torch.randn(B, S, c.dim, device=dev, dtype=dt))
    for name, t in inp.tensors().items():
        setattr(inp, name, t.detach().requires_grad_(True))
    given, tags = None, {"indices": str(p.indices)}
    if p.indices == replay.RANDOM:
        with torch.no_grad():
            idx = selection_indices(inp, c, job.plan, job.fallback)
    else:  # a trained model's selections: the selected branch reads those blocks (the top-n is not run)
        trained, tags["indices_note"] = replay.load(str(p.indices), S, c)
        idx = given = trained.to(dev, torch.int64)[None].expand(B, -1, -1, -1).contiguous()
        functional.check_block_indices(given, c, S, name="prefill.indices")  # once: the timed calls do not sync
        log.info(f"[prefill] seq={S}: the selected branch reads {tags['indices_note']}")
    t_pos = torch.arange(S, device=dev)[None, :, None]
    parts = branch_tokens(c, t_pos, selected_tokens(idx, c, 0))
    dense, dense_tags = dense_variants(p.dense_flash, c, dev.type)
    tags.update(dense_tags)
    for note in dense_tags.values():
        log.info(f"[prefill] seq={S}: {note}")
    peer = peers.rows(p.peers, inp, c, dev, tags)
    timed = ["nsa"] + (["cmp", "sel", "win"] if branch == "none" and p.per_branch else []) + dense + list(peer)
    leaves = list(inp.tensors().values())

    def run(v):
        if v in ("dense", "dense_flash"):
            return dense_attention(inp.q, inp.k_win, inp.v_win, causal=True,
                                           kernel="flash" if v == "dense_flash" else "auto")
        if v in peer:
            return peer[v].fn()
        return core(branch if v == "nsa" else v, inp, c, job.plan, job.fallback, job.cfg.streams,
                    block_indices=given, check_indices=False)

    times, rows, texts = {}, [], {}
    for i, v in enumerate(timed, 1):
        with torch.no_grad():
            fwd = quantiles(time_ms(lambda v=v: run(v), dev, p.warmup, p.repeats, should_stop))
        tq = {f"fwd_{k}": x for k, x in fwd.items()}
        if p.backward:
            dout = torch.randn_like(run(v).detach())

            def fwd_bwd(v=v, dout=dout):
                for t in leaves:
                    t.grad = None
                run(v).backward(dout)

            tq.update({f"fwd_bwd_{k}": x for k, x in
                       quantiles(time_ms(fwd_bwd, dev, p.warmup, p.repeats, should_stop)).items()})
        times[v] = tq
        if p.profile and v not in dense:
            with torch.no_grad():
                texts[f"profile/{v}_fwd.txt"] = profile_table(lambda v=v: run(v), dev)
            if p.backward:
                texts[f"profile/{v}_fwd_bwd.txt"] = profile_table(fwd_bwd, dev)
        log.info(f"[prefill] seq={S} [{i}/{len(timed)}] {v}: fwd p50 {tq['fwd_p50_ms']:.3f} ms"
                   + (f", fwd+bwd p50 {tq['fwd_bwd_p50_ms']:.3f} ms" if p.backward else ""))

    peak = float(job.profile.peak_bf16_tflops)
    for v in timed:
        if v in dense:
            tok = (t_pos + 1).expand(B, S, c.n_kv_heads)
        elif v in peer:
            tok = sum(parts[b] for b in peer[v].branches)
        else:
            tok = variant_tokens(branch if v == "nsa" else v, parts)
        flop = 2.0 * (c.d_k + c.d_v) * c.G * float(tok.sum())
        q = times[v]
        row = {"seq_tokens": S, "batch_seqs": B, "variant": v, "branch_force": branch, "query_heads_per_group_G": c.G,
               "backend_cmp": job.plan["cmp"], "backend_sel": job.plan["sel"], "backend_win": job.plan["win"],
               "dtype": str(dt).replace("torch.", ""), **q,
               "kv_tokens_per_query_per_group": float(tok.double().mean()),
               "attn_fwd_flop": flop,
               "fwd_tflop_per_s": flop / (q["fwd_p50_ms"] * 1e-3) / 1e12,
               "fwd_tflop_roofline_pct": 100.0 * flop / (q["fwd_p50_ms"] * 1e-3) / 1e12 / peak,
               **{f"fwd_speedup_vs_{d}_x": times[d]["fwd_p50_ms"] / q["fwd_p50_ms"] for d in dense + list(peer) if d != v}}
        if p.backward:
            row.update({"attn_fwd_bwd_flop": BWD_FACTOR * flop,
                        "fwd_bwd_tflop_per_s": BWD_FACTOR * flop / (q["fwd_bwd_p50_ms"] * 1e-3) / 1e12,
                        **{f"fwd_bwd_speedup_vs_{d}_x": times[d]["fwd_bwd_p50_ms"] / q["fwd_bwd_p50_ms"]
                           for d in dense + list(peer) if d != v}})
        rows.append(row)
    for path, text in texts.items():
        log.info(f"[prefill] seq={S} {path}:\n{text}")
    nsa, base = rows[0], rows[timed.index("dense")]
    timings = ("fwd", "fwd_bwd") if p.backward else ("fwd",)
    headline = {**{f"nsa_{t}_p50_ms": nsa[f"{t}_p50_ms"] for t in timings},
                **{f"dense_{t}_p50_ms": base[f"{t}_p50_ms"] for t in timings},
                **{f"nsa_{t}_speedup_vs_{d}_x": nsa[f"{t}_speedup_vs_{d}_x"] for t in timings for d in ["dense", *peer]},
                "nsa_fwd_tflop_per_s": nsa["fwd_tflop_per_s"]}
    charts = Charts("seq_tokens", "variant", tuple(f"{t}_{y}" for y in ("p50_ms", "speedup_vs_dense_x") for t in timings))
    # block sharing among neighbouring queries of this layer's own top-n (what a tile of m query rows that
    # loads each block once would save: docs/experiments.md)
    metrics = {f"sel_block_union_frac_m{m}": block_union_fraction(idx, m) for m in SHARING_TILES}
    metrics["sel_share_m64"] = tile_sharing(idx, min(64, S))  # as train.save_selections' sel_share_T<T>
    return Result(rows, metrics, headline=headline, charts=charts, tags=tags, texts=texts)


@hydra.main(config_path="../conf", config_name="prefill", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_job(cfg, "prefill", work, fits=check_fits, check=check_config)


if __name__ == "__main__":
    launch(main, "prefill", check=check_config)
