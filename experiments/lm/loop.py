"""The training loop: explicit arguments in, metrics out through a callback, checkpoints on disk.

    summary = train(cfg, device=torch.device("cuda"), log=log, ckpt_dir=run_dir / "ckpt", run_id=run.info.run_id,
                    logged_through=last_step_in_the_tracking_store)

The callback contract (what an entry point must provide):

* ``log(metrics: dict[str, float], step: int)`` is called once per logged step, steps increasing,
  only for steps > ``logged_through``. It returns once the metrics are durable (MLflow's
  synchronous ``log_metrics``): the loop writes a checkpoint only after the step's metrics are logged.
* Resuming: if ``ckpt_dir`` holds a checkpoint, the loop continues from it; the checkpoint must
  carry the same ``run_id`` (the caller reads it first with ``checkpoint.peek(ckpt_dir)`` to reopen
  that run) and the same configuration (``time_limit_s`` may differ). Steps between the checkpoint
  and ``logged_through`` are recomputed and not logged again, so the curve has each step once and
  no gap. On the CPU the recomputed steps equal the lost ones bit for bit (tested); CUDA kernels
  with atomics make GPU steps reproducible only to rounding.
* A fresh run writes a step-0 checkpoint before its first step, so a run killed at any point after
  ``train`` starts resumes into the same ``run_id``.

Per logged step (``log_every`` steps, averaged over them): ``loss``, ``accuracy`` (argmax over the
target positions: the answers of the retrieval task, every next byte of the text), ``tokens_per_s``,
``model_tflop_per_s`` (``cost.step_flops`` over the wall time), ``grad_norm`` (before clipping),
``lr``, ``seq_len`` (of the curriculum stage), the memory high-water mark (``peak_mem_gib``: CUDA
``max_memory_allocated`` over the interval's training steps; on the CPU ``rss_peak_gib``, the
process's resident-set high-water mark since it started), and for NSA ``gate_{cmp,sel,win}`` (mean
over layers, and ``_l<i>`` per layer; on a retrieval task also ``gate_{cmp,sel,win}_answers``, over the
answer positions alone; 1.0 while ``gates_open_steps`` holds them open). Every ``eval_every`` steps:
``val_loss`` / ``val_accuracy`` over ``eval_batches`` held-out batches and, for NSA, ``sel_mass`` /
``sel_recall`` over the last ``sel_rows`` positions of the first held-out batch
(``probes.selection_quality``; ``_l<i>`` per layer; on a retrieval task also ``sel_mass_answers`` /
``sel_recall_answers`` over the answer positions among them).

Ablations (``train.ablation``, :mod:`experiments.lm.ablations`; NSA only): ``selection`` full / oracle feeds each
NSA layer's selected branch other blocks (the model computes them; oracle from the task's ``sources`` of the
batch), ``branches`` holds the other branches' gates at 0 (:class:`ablations.BranchGates`, a hook after
``gates_open_steps``' and before the gate means', so those log 0); both in training and in evaluation.

Speed: ``train.compile`` runs the training steps through ``torch.compile`` (static shapes, one graph per
stage; the hooks above trace into it, holding their state in device tensors); evaluation stays eager.
``train.profile`` runs step ``log_every + 1`` under torch.profiler and returns its tables.
"""
from __future__ import annotations

import contextlib
import math
import resource
import sys
import time
from dataclasses import fields
from typing import Callable

import torch
import torch.nn.functional as F

from nsa import NSAConfig, dispatch
from nsa import context_parallel as cpar
from nsa.numerics import DTYPES

from .. import progress
from ..measure.timing import profiled
from ..nested import flatten
from . import ablations, checkpoint, cost, data, distributed, grow, passkey, probes, recipe
from .config import RunConfig, TrainConfig, check_int
from .data import IGNORE
from .model import LM, count_parameters

# config keys a resumed run may change (grad_accum: the same global batch in other micro-batches)
# and the processes: a checkpoint resumes on another dp x cp (resharded)
RESUMABLE_CHANGES = {"train.time_limit_s", "train.profile", "train.compile", "train.grad_accum", "dp", "cp"}


def build_model(cfg: RunConfig, device=None) -> LM:
    vocab = {task.vocab_size for _, task, _ in cfg.stages()}
    if len(vocab) > 1:
        raise ValueError(f"train.curriculum: its stages' vocabularies {sorted(vocab)} differ from the main stage's")
    make = LM
    if cfg.lm.hf is not None:  # lm=hf: a transformers model
        from .hf import HFLM as make
    return make(cfg.lm, vocab.pop(), cfg.attention, backend=cfg.backend, fallback=cfg.fallback,
                streams=cfg.streams, selection=cfg.train.ablation.selection).to(device)


def parameter_counts(cfg: RunConfig) -> dict[str, int]:
    """``model.count_parameters`` of the configured model, built on the meta device (no memory)."""
    with torch.device("meta"):
        return count_parameters(build_model(cfg))


def _loss(model, tokens, targets, task, sel_rows=None, detach_q=True, cp_group=None, reduction="mean"):
    """The language-model loss (``reduction``: its mean, or its sum over the targets), the correct answers and
    their count; with ``sel_rows`` (experiments.lm.recipe) also the NSA layers' mean selection loss (else None).
    ``cp_group``: tokens and targets are this rank's part of each sequence (context parallel)."""
    # the oracle selection (experiments.lm.ablations) reads where each answer's source sits
    sources = task.sources(tokens, targets) if model.selection == "oracle" else None
    cp = {} if cp_group is None else {"cp_group": cp_group}
    out = model(tokens, sources, **cp) if sel_rows is None else model(tokens, sources, sel_rows, detach_q, **cp)
    logits, aux = (out, None) if sel_rows is None else out
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction=reduction)
    mask = targets != IGNORE
    correct = ((logits.argmax(-1) == targets) & mask).sum()
    return loss, correct, mask.sum(), aux


def recipe_weight(cfg: RunConfig, step: int, seq_len: int) -> float:
    """The selection loss's weight at update ``step`` (1-based) on sequences of ``seq_len`` tokens: 0 for dense
    and window attention, and where no row chooses blocks (seq_len <= n_sel * l_sel: the top-n takes them all)."""
    if cfg.attention != "nsa" or seq_len <= recipe.first_row(cfg.lm.attention_config()):
        return 0.0
    return cfg.train.recipe.sel_loss_at(step)


def _memory_metrics(device, world=None) -> dict[str, float]:
    """The memory high-water mark: on CUDA since ``_Window.reset`` (training steps only), on the CPU
    since the process started. Over several processes: the largest rank's, and each rank's (``_rank<r>``)."""
    if device.type == "cuda":
        name, gib = "peak_mem_gib", torch.cuda.max_memory_allocated(device) / 2**30
    else:
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        name, gib = "rss_peak_gib", kib / (2**30 if sys.platform == "darwin" else 2**20)
    if world is None:
        return {name: gib}
    each = world.each(gib, device)
    return {name: max(each), **{f"{name}_rank{r}": v for r, v in enumerate(each)}}


@torch.no_grad()
def evaluate(model: LM, task, cfg: RunConfig, device, autocast, world=None) -> dict[str, float]:
    """Held-out loss and accuracy, and the NSA layers' selection quality on the first batch. Over several
    processes (``world``) each rank evaluates its part of every batch (its rows, its part of each sequence) and
    the figures are reduced over the ranks; the selection quality reads each rank's first rows whole (the layer
    inputs gathered over the cp ranks, the layer's parameters unsharded)."""
    if world is not None:
        return _evaluate_sharded(model, task, cfg, device, autocast, world)
    model.eval()
    tot = {"loss": 0.0, "correct": 0, "n": 0}
    sel = {}
    layers = model.nsa_layers()
    buckets = position_buckets(task.seq_len, cfg.train.eval_positions)
    by_pos = torch.zeros(2, len(buckets), dtype=torch.float64)  # (loss sum, targets) per bucket
    for i in range(cfg.train.eval_batches):
        tokens, targets = (t.to(device) for t in task.batch("val", i, cfg.train.batch))
        with probes.layer_inputs(layers) as xs, autocast():
            per, correct, n, _ = _loss(model, tokens, targets, task, reduction="none")
        loss = per.sum() / n.clamp(min=1)
        tot["loss"] += float(loss) / cfg.train.eval_batches
        tot["correct"] += int(correct)
        tot["n"] += int(n)
        if buckets:
            by_pos += _by_position(per.view(targets.shape), targets != IGNORE, buckets)
        if i == 0:
            sel = _selection_quality(layers, xs, targets, task, cfg.train.sel_rows)
    model.train()
    return {**_eval_out(tot["loss"], tot["correct"], tot["n"], sel, len(layers)), **_position_metrics(by_pos, buckets)}


def position_buckets(T: int, base: int) -> list[tuple[int, int]]:
    """``[0, base), [base, 2 base), [2 base, 4 base), ...`` up to ``T`` (the last ends at T); [] for base 0."""
    if not base:
        return []
    edges = [0, base]
    while edges[-1] < T:
        edges.append(2 * edges[-1])
    edges = [e for e in edges if e < T] + [T]
    return list(zip(edges[:-1], edges[1:]))


def _by_position(per: torch.Tensor, mask: torch.Tensor, buckets) -> torch.Tensor:
    """(loss sum, targets) in each bucket of positions, float64 on the CPU: ``per`` [B,T] the loss of each target
    (0 where ``mask`` is false)."""
    return torch.tensor([[float(per[:, a:b].sum()), float(mask[:, a:b].sum())] for a, b in buckets],
                        dtype=torch.float64).T


def _position_metrics(by_pos: torch.Tensor, buckets) -> dict[str, float]:
    return {f"val_loss_pos_{a}_{b}": float(by_pos[0, i] / by_pos[1, i]) for i, (a, b) in enumerate(buckets)
            if by_pos[1, i] > 0}


def _selection_quality(layers, xs, targets, task, rows: int) -> dict[str, float]:
    answers = (targets != IGNORE)[:, -rows:] if task.answers_only else None
    sel = {}
    for j, (layer, x) in enumerate(zip(layers, xs)):
        for key, v in probes.selection_quality(layer, x, rows, answers).items():
            sel[f"sel_{key}_l{j}"] = v
    return sel


def _eval_out(loss: float, correct: int, n: int, sel: dict, n_layers: int) -> dict[str, float]:
    out = {"val_loss": loss, "val_accuracy": correct / max(1, n)}
    if n_layers:
        for key in ("mass", "recall", "share", "mass_answers", "recall_answers"):
            if f"sel_{key}_l0" in sel:
                out[f"sel_{key}"] = sum(sel[f"sel_{key}_l{j}"] for j in range(n_layers)) / n_layers
        out.update(sel)
    return out


def _evaluate_sharded(model, task, cfg: RunConfig, device, autocast, world) -> dict[str, float]:
    tc = cfg.train
    micro = tc.batch // (tc.grad_accum * world.dp)
    model.eval()
    loss, counts, sel = torch.zeros((), dtype=torch.float64, device=device), torch.zeros(2, device=device), {}
    layers = model.nsa_layers()
    buckets = position_buckets(task.seq_len, tc.eval_positions)  # whole rows on each rank: cp == 1 (train checks)
    by_pos = torch.zeros(2, len(buckets), dtype=torch.float64)
    for i in range(tc.eval_batches):
        tokens, targets = task.batch("val", i, tc.batch)
        N = max(1, int((targets != IGNORE).sum()))
        for m in range(tc.grad_accum):
            tok, tgt = (world.part(t, m, micro).to(device) for t in (tokens, targets))
            with probes.layer_inputs(layers) as xs, autocast():
                per, c, k, _ = _loss(model, tok, tgt, task, cp_group=world.group, reduction="none")
            ce = per.sum()
            if buckets:
                by_pos += _by_position(per.view(tgt.shape), tgt != IGNORE, buckets)
            loss += ce.double() / N / tc.eval_batches
            counts += torch.stack([c, k]).float()
            if i == 0 and m == 0 and layers:
                whole = [x if world.group is None else cpar.gather_sequence(x, world.group) for x in xs]
                for block in distributed.blocks(model):
                    block.unshard()
                try:
                    sel = _selection_quality(layers, whole, targets[world.rows(0, micro)], task, tc.sel_rows)
                finally:
                    for block in distributed.blocks(model):
                        block.reshard()
    model.train()
    keys = sorted(sel)
    sums = world.all_sum(torch.cat([loss[None], counts.double(), torch.tensor([sel[k] for k in keys], dtype=torch.float64,
                                                                                device=device)]))
    sel = {k: float(v) / world.size for k, v in zip(keys, sums[3:])}
    by_pos = world.all_sum(by_pos.to(device)).cpu() if buckets else by_pos
    return {**_eval_out(float(sums[0]), int(sums[1]), int(sums[2]), sel, len(layers)), **_position_metrics(by_pos, buckets)}


def _added_at_default(key: str, value) -> bool:
    """An ``lm.nsa`` or ``train.ablation`` key that a checkpoint written before NSAConfig / TrainConfig gained
    the field lacks, here at that field's default (gate_bias, shared_kv, phi_init, ablation): the same
    run, no difference."""
    for prefix, cls in (("lm.nsa.", NSAConfig), ("train.ablation.", ablations.Ablation), ("train.recipe.", recipe.Recipe),
                        ("train.passkey.", passkey.Passkey), ("train.", TrainConfig), ("data.", data.Text)):
        defaults = {f.name: f.default for f in fields(cls)}
        name = key.removeprefix(prefix)
        if key.startswith(prefix) and name in defaults and _lists(defaults[name]) == value:
            return True
    return False


def _lists(v):
    """Tuples as lists, all the way down: a config as a sharded checkpoint's JSON holds it."""
    if isinstance(v, dict):
        return {k: _lists(x) for k, x in v.items()}
    return [_lists(x) for x in v] if isinstance(v, (list, tuple)) else v


def _check_config(state: dict, cfg: RunConfig) -> None:
    old, new = flatten(_lists(state["config"])), flatten(_lists(cfg.to_dict()))
    diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and k not in RESUMABLE_CHANGES
                  and not (k not in old and _added_at_default(k, new[k])))
    if diff:
        raise ValueError("config: differs from the checkpoint's in " + ", ".join(
            f"{k} ({old.get(k)!r} -> {new.get(k)!r})" for k in diff))


def resumable(cfg: RunConfig, ckpt_dir) -> dict | None:
    """``{"run_id", "step"}`` of the checkpoint in ``ckpt_dir`` (None: none; one process's ``last.pt`` or a
    sharded one, :func:`checkpoint.meta`), which ``train(cfg, ...)`` will resume on any world size; a ValueError
    names the config keys that differ from the checkpoint's (as ``train`` would, before an entry point reopens
    the run)."""
    m = checkpoint.meta(ckpt_dir)
    if m is None:
        return None
    _check_config(m, cfg)
    return {"run_id": m["run_id"], "step": m["step"]}


def _resume(ckpt_dir, cfg: RunConfig, run_id: str, model, opt, device, world) -> tuple[int, int] | None:
    """The checkpoint in ``ckpt_dir`` loaded into ``model`` and ``opt`` (sharded over ``world``, or one process),
    whichever kind wrote it: (its step, its data position), or None where there is none."""
    m = checkpoint.meta(ckpt_dir)
    if m is None:
        return None
    if m["run_id"] != run_id:
        raise ValueError(f"run_id={run_id!r}: the checkpoint belongs to run {m['run_id']!r} "
                         "(read it with experiments.lm.checkpoint.peek and resume that run)")
    _check_config(m, cfg)
    if m["kind"] == "sharded":  # the random state is not kept: nothing in a training step draws from it
        checkpoint.load_sharded(m["path"], model, opt)
        return m["step"], m["data_position"]
    state = checkpoint.load(ckpt_dir, map_location=device)
    if world is not None:
        checkpoint.load_file_into_sharded(state, model, opt)
        return state["step"], state["data_position"]
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    if device.type == "cuda" and state["rng"]["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state["step"], state["data_position"]


def _save(ckpt_dir, cfg, run_id, step, position, model, opt, device, world=None, val_loss=None):
    meta = {"run_id": run_id, "step": step, "data_position": position, "config": cfg.to_dict(), "val_loss": val_loss}
    if world is not None:
        checkpoint.save_sharded(ckpt_dir, {**meta, "world": {"dp": world.dp, "cp": world.cp}}, model, opt)
        return
    rng = {"torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state_all() if device.type == "cuda" else None}
    checkpoint.save(ckpt_dir, {**meta, "model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng})


class _Window:
    """Sums over the steps since the last logged one, kept on the device (no host sync per step)."""

    def __init__(self, device):
        self.device = device
        self.reset()

    def reset(self):
        z = torch.zeros((), device=self.device)
        self.loss, self.gnorm = z.clone(), z.clone()
        self.correct, self.n = z.long(), z.long()
        self.aux, self.aux_steps = z.clone(), 0  # the selection loss (train.recipe.sel_loss)
        self.steps, self.tokens, self.flops = 0, 0, 0.0
        self.untimed_s, self.untimed_tokens, self.untimed_flops = 0.0, 0, 0.0  # a profiled step
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.t0 = time.perf_counter()

    def add(self, loss, correct, n, gnorm, tokens: int, flops: float):
        self.loss += loss.detach().float()
        self.gnorm += gnorm.float()
        self.correct += correct
        self.n += n
        self.steps, self.tokens, self.flops = self.steps + 1, self.tokens + tokens, self.flops + flops

    def add_aux(self, aux):
        self.aux += aux.detach().float()
        self.aux_steps += 1

    def take(self, world=None) -> dict[str, float]:
        """The interval's means; over several processes each rank holds its part of the loss (a share of each
        step's mean), of the counts and of the selection loss, summed here over the ranks."""
        if world is not None:
            sums = world.all_sum(torch.stack([self.loss, self.correct.float(), self.n.float(), self.aux]).double())
            self.loss, self.correct, self.n = sums[0], sums[1].long(), sums[2].long()
            self.aux = sums[3] / world.size
        out = {"loss": float(self.loss) / self.steps, "accuracy": int(self.correct) / max(1, int(self.n)),
               "grad_norm": float(self.gnorm) / self.steps}  # these reads wait for the device
        if self.aux_steps:
            out["sel_loss"] = float(self.aux) / self.aux_steps
        dt = time.perf_counter() - self.t0 - self.untimed_s
        out.update(tokens_per_s=(self.tokens - self.untimed_tokens) / dt,
                   model_tflop_per_s=(self.flops - self.untimed_flops) / dt / 1e12)
        self.reset()
        return out


def optimizer(model, tc: TrainConfig):
    """AdamW; each group's ``lr_scale`` multiplies the schedule's learning rate (``train.recipe.gate_lr`` for
    the NSA gate MLPs, 1 for the rest)."""
    gate = {id(p) for p in recipe.gate_parameters(model)} if tc.recipe.gate_lr != 1 else set()
    groups = []
    for scale, mine in ((1.0, False), (tc.recipe.gate_lr, True)):
        ps = [p for p in model.parameters() if (id(p) in gate) == mine]
        if ps:  # matrices and embeddings decay; norms and biases do not
            groups += [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": tc.weight_decay, "lr_scale": scale},
                       {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0, "lr_scale": scale}]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2))


def _check_backends(cfg: RunConfig, device, dtype):
    """A backend that cannot run here fails now, naming the branch and why (the window model takes no fallback)."""
    if cfg.attention == "nsa":
        for b in dispatch.BRANCHES:
            dispatch.choose(b, cfg.backend[b], device, dtype, cfg.fallback)
    elif cfg.attention == "window":
        dispatch.choose("win", cfg.backend["win"], device, dtype, None)


def _shared_step(model, task, tokens, targets, sel_rows, sel_w, cfg: RunConfig, world, device, autocast, compiling,
                 gates):
    """One update's forward and backward over this process's share of the global batch (``tokens``, ``targets``:
    the whole of it), in ``train.grad_accum`` micro-batches: each backpropagates its summed cross-entropy scaled by
    :func:`distributed.loss_scale` (with the selection loss over the micro-batches), so that the gradients, summed
    over micro-batches and averaged over the ranks by FSDP, are the whole batch's mean loss's. Returns this
    process's part of the step's mean loss, its correct answers and targets, and its mean selection loss (or None)."""
    tc = cfg.train
    M = tc.grad_accum
    micro = tokens.shape[0] // (M * (world.dp if world is not None else 1))
    n_targets = int((targets != IGNORE).sum())  # the whole global batch's
    scale = distributed.loss_scale(world, n_targets)
    group = None if world is None else world.group
    loss_sum, correct, n, aux_sum = torch.zeros((), device=device), 0, 0, None
    for m in range(M):
        if world is None:
            rows = slice(m * micro, (m + 1) * micro)
            tok, tgt, sel = tokens[rows], targets[rows], None if sel_rows is None else sel_rows[rows]
        else:  # the rows of sel_rows are the batch's; their positions stay the whole sequence's
            tok, tgt = world.part(tokens, m, micro), world.part(targets, m, micro)
            sel = None if sel_rows is None else sel_rows[world.rows(m, micro)]
        tok, tgt = tok.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
        sel = None if sel is None else sel.to(device, non_blocking=True)
        gates.mask = tgt != IGNORE if task.answers_only else None
        with autocast(), compiling():
            ce, c, k, aux = _loss(model, tok, tgt, task, sel, tc.recipe.sel_loss_detach_q, group, reduction="sum")
        total = ce * scale
        if aux is not None:
            total = total + sel_w * aux / M
            aux_sum = aux.detach() / M if aux_sum is None else aux_sum + aux.detach() / M
        total.backward()
        loss_sum += ce.detach() / max(1, n_targets)
        correct, n = correct + c, n + k
    return loss_sum, correct, n, aux_sum


def train(cfg: RunConfig, *, device: torch.device, log: Callable[[dict, int], None], ckpt_dir, run_id: str,
          logged_through: int = 0, world=None, should_stop: Callable[[], None] = lambda: None) -> dict:
    """Train ``cfg`` on ``device`` to ``cfg.train.steps`` (or to ``time_limit_s``), resuming from
    ``ckpt_dir`` if it holds a checkpoint. See the module docstring for the callback contract.
    Returns ``{"step", "completed", "metrics" (the last logged), "params" (count_parameters), "profile" (with
    train.profile: the profiler's table of step log_every + 1, if this process ran it; else None), "model" (the
    trained model, on ``device``)}``. ``world`` (:class:`distributed.World`): this process is one rank of a
    training over several (every rank calls ``train`` alike; ``log`` is called on each, rank 0's stores); None:
    one process. ``should_stop()`` runs before every step and stops the run by raising (the entry point's: a
    signal's exception that Python dropped in a finalizer, raised again)."""
    device = torch.device(device)
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id={run_id!r}: must be a non-empty string")
    check_int("logged_through", logged_through, 0)
    tc, dtype = cfg.train, DTYPES[cfg.dtype]
    _check_backends(cfg, device, dtype)

    def autocast():
        return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    torch.manual_seed(cfg.seed)
    stages = cfg.stages()
    model = build_model(cfg, device)  # the same initial weights on every rank (the same seed)
    if tc.init_from is not None and checkpoint.meta(ckpt_dir) is None:  # a new run grown from a dense one
        grow.into(model, grow.source(cfg)["state"])
    flops = [cost.step_flops(model, task.seq_len, batch)["total"] for _, task, batch in stages]
    if world is not None:
        distributed.shard(model, world, device, dtype)
    opt = optimizer(model, tc)
    found = _resume(ckpt_dir, cfg, run_id, model, opt, device, world)
    val_loss = None  # the last held-out loss, recorded in each checkpoint (a grown run's target: grow.source)
    if found is not None:
        step, position = found
        val_loss = (checkpoint.meta(ckpt_dir) or {}).get("val_loss")
    else:
        step, position = 0, 0
        _save(ckpt_dir, cfg, run_id, step, position, model, opt, device, world)
    held = probes.HoldGatesOpen(model.nsa_layers())  # before GateMeans: its hook sees the gates the layer uses
    # after HoldGatesOpen (which replaces the gate MLP's whole output): the branches ablated out stay at 0
    branch_gates = ablations.BranchGates(model.nsa_layers(), tc.ablation.branches)
    gates = probes.GateMeans(model.nsa_layers())
    first_row = recipe.first_row(cfg.lm.attention_config())  # the selection loss's rows start there
    last_metrics, completed, t_start = {}, True, time.perf_counter()
    window = _Window(device)
    if tc.compile == "none":
        step_model, compiling = model, contextlib.nullcontext
    else:  # one graph per shape; past dynamo's recompile limit the run fails rather than running eager
        step_model = torch.compile(model, mode=tc.compile, dynamic=False)

        def compiling():
            return torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)
    # train.profile: the first step after the first logged window (compiled, warm) under torch.profiler; its
    # time and tokens are left out of that window's tokens_per_s (the profiler slows it)
    profile_at, profile = tc.log_every + 1 if tc.profile else None, None
    shared = world is not None or tc.grad_accum > 1  # the loss as a sum over its share of the global batch
    model.train()
    with progress.bar(tc.steps, "train", "step", initial=step, shown=world is None or world.rank == 0) as shown:
        while step < tc.steps:
            should_stop()
            lr = tc.lr_at(step + 1)
            for group in opt.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)  # a checkpoint from before the recipe has none
            stage = next(i for i, st in enumerate(stages) if step < st[0])  # the stage of update step + 1
            _, task, batch = stages[stage]
            profiling, t0 = step + 1 == profile_at, time.perf_counter()
            with profiled(device, rows=40) if profiling else contextlib.nullcontext() as table:
                tokens, targets = task.batch("train", position, batch)
                sel_w = recipe_weight(cfg, step + 1, task.seq_len)
                sel_rows = None if not sel_w else recipe.sample_rows(
                    targets != IGNORE, tc.recipe.sel_loss_rows, first_row,
                    torch.Generator().manual_seed(cfg.seed * 1_000_003 + step))
                held.active = step < tc.gates_open_steps  # update step + 1 <= gates_open_steps
                opt.zero_grad(set_to_none=True)
                if not shared:  # one process, one batch: the mean loss, as the model is trained in one process
                    tokens, targets = (t.to(device, non_blocking=True) for t in (tokens, targets))
                    sel_rows = None if sel_rows is None else sel_rows.to(device, non_blocking=True)
                    gates.mask = targets != IGNORE if task.answers_only else None
                    with autocast(), compiling():
                        loss, correct, n, aux = _loss(step_model, tokens, targets, task, sel_rows,
                                                      tc.recipe.sel_loss_detach_q)
                    (loss if aux is None else loss + sel_w * aux).backward()
                    loss = loss.detach()
                else:
                    loss, correct, n, aux = _shared_step(step_model, task, tokens, targets, sel_rows, sel_w, cfg, world,
                                                         device, autocast, compiling, gates)
                if aux is not None:
                    window.add_aux(aux)
                gnorm = distributed.full(torch.nn.utils.clip_grad_norm_(
                    model.parameters(), tc.grad_clip if tc.grad_clip > 0 else math.inf))
                opt.step()
            step, position = step + 1, position + 1
            shown.update(1)
            window.add(loss, correct, n, gnorm, tokens.numel(), flops[stage])
            if profiling:
                took = time.perf_counter() - t0
                profile = f"step {step} (seq_len {task.seq_len}, batch {batch}), its wall time {took:.4f} s under the " \
                          "profiler\n" + "\n".join(table)
                window.untimed_s += took
                window.untimed_tokens += tokens.numel()
                window.untimed_flops += flops[stage]
            if step % tc.log_every and step != tc.steps:
                continue
            metrics = {**_memory_metrics(device, world), **window.take(world), "lr": lr, "seq_len": task.seq_len,
                       **gates.take(None if world is None else world.all_sum)}
            if hasattr(task, "windows"):  # a text corpus: the passes over its training windows so far
                metrics["data_epochs"] = position * batch / task.windows("train")
            if world is not None:
                metrics["tokens_per_s_per_gpu"] = metrics["tokens_per_s"] / world.size
            if step > logged_through:
                if tc.eval_batches and (step % tc.eval_every == 0 or step == tc.steps):
                    gates.active = False
                    metrics.update(evaluate(model, stages[-1][1], cfg, device, autocast, world))
                    gates.active = True
                    val_loss = metrics["val_loss"]
                log(metrics, step)
                last_metrics = metrics
            out_of_time = tc.time_limit_s is not None and time.perf_counter() - t_start > tc.time_limit_s
            if world is not None and tc.time_limit_s is not None:
                out_of_time = world.same(out_of_time)  # every rank stops at the same step
            if step % tc.ckpt_every == 0 or step == tc.steps or out_of_time:
                _save(ckpt_dir, cfg, run_id, step, position, model, opt, device, world, val_loss)
            if out_of_time and step < tc.steps:
                completed = False
                break
            window.reset()  # evaluation and checkpoints count neither in tokens_per_s nor in peak_mem_gib
    gates.remove()
    branch_gates.remove()
    held.remove()
    return {"step": step, "completed": completed, "metrics": last_metrics, "params": count_parameters(model),
            "profile": profile, "model": model}
