"""The training run's configuration: :class:`TrainConfig` (the ``train:`` node) and :class:`RunConfig`
(everything ``loop.train`` needs), each validated at construction (an error names the field), and the
helpers that build them from a composed Hydra config."""
from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Mapping

import torch

from nsa import dispatch

from .ablations import Ablation
from .data import make_task
from .model import ATTENTION, LMConfig
from .passkey import Passkey
from .recipe import Recipe

TRAIN_DTYPES = ("float32", "bfloat16")  # bfloat16: autocast over float32 weights
COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class TrainConfig:
    """The ``train:`` node of ``conf/train/*.yaml``."""

    steps: int
    batch: int
    lr: float
    warmup: int = 0
    min_lr_ratio: float = 0.1  # cosine decay from lr to min_lr_ratio * lr at the last step
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0: no clipping
    log_every: int = 1
    eval_every: int = 100
    eval_batches: int = 1  # 0: no evaluation
    ckpt_every: int = 100
    sel_rows: int = 64
    # NSA only: for the first this many steps every gate is held at 1 (the gate MLP's output replaced, so it
    # learns nothing then) and each branch gets its whole gradient, where free gates close on attention
    # that does not help yet (BENCHMARKS.md "Training at 32k"). 0: the gates are free from the start.
    gates_open_steps: int = 0
    time_limit_s: float | None = None  # stop (checkpointed, resumable) at the first log step past it
    # Step log_every + 1 (warm) under torch.profiler: its table of kernels and ops logged on the run as
    # profile/train_step.txt; that step is left out of its window's tokens_per_s.
    profile: bool = False
    # torch.compile of the model for the training steps (evaluation stays eager): none, or torch.compile's mode
    # (default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs); static shapes, one graph per stage;
    # a run that would pass dynamo's recompile limit fails instead of falling back to eager.
    compile: str = "none"
    # Stages before the main one, each {steps, batch, data: {overrides of the data node}}; the main stage
    # (data, batch) takes the remaining steps. Evaluation always runs on the main stage's task.
    curriculum: tuple = ()
    # NSA only (dense and window ignore it): the selection and gate ablations, experiments/lm/ablations.py; the defaults are
    # the paper's method. {selection: topn|full|oracle, branches: [a non-empty subset of cmp, sel, win]}
    ablation: Ablation = field(default_factory=Ablation)
    # NSA only: the training recipe, experiments/lm/recipe.py; the defaults are the plain method.
    # {gate_lr, sel_loss, sel_loss_rows, sel_loss_steps, sel_loss_detach_q}
    recipe: Recipe = field(default_factory=Recipe)
    # NSA only: at the end of a completed run, the selections of NSA layer selection_layer (an index into the
    # model's NSA layers) on a held-out sequence of each length, saved on the run (experiments/lm/selections.py)
    save_selections: bool = False
    selection_lengths: tuple = (8192, 16384, 32768, 65536)
    selection_layer: int = -1
    # micro-batches per update: each rank's share of the batch in this many forward/backward passes (the same
    # global batch, the gradients summed), where one pass would not fit in memory
    grad_accum: int = 1
    # held-out loss by position: buckets [0, b), [b, 2b), [2b, 4b), ... up to the context (b this; 0: none)
    eval_positions: int = 0
    # NSA only: start from a trained dense model of the same shape (a dense run's output folder, its ckpt folder or
    # last.pt; experiments/lm/grow.py); None: the model's own init
    init_from: str | None = None
    # the held-out loss a run is timed to: the first evaluation at or under it logs steps_to_loss_target (its step)
    # and tokens_to_loss_target; None: none, or for a run grown from a dense one (init_from) 1.01 x the dense
    # run's last held-out loss (within 1 % of it), which its checkpoint records
    loss_target: float | None = None
    # at the end of a run on text: passkey retrieval over lengths x depths (experiments/lm/passkey.py); lengths []:
    # none. {lengths, depths, samples}
    passkey: Passkey = field(default_factory=Passkey)

    def __post_init__(self):
        if isinstance(self.ablation, Mapping):
            object.__setattr__(self, "ablation", build(Ablation, self.ablation, "train.ablation"))
        elif not isinstance(self.ablation, Ablation):
            raise ValueError(f"train.ablation={self.ablation!r}: must be a mapping {{selection, branches}}")
        if isinstance(self.passkey, Mapping):
            object.__setattr__(self, "passkey", build(Passkey, self.passkey, "train.passkey"))
        elif not isinstance(self.passkey, Passkey):
            raise ValueError(f"train.passkey={self.passkey!r}: must be a mapping {{lengths, depths, samples}}")
        if isinstance(self.recipe, Mapping):
            object.__setattr__(self, "recipe", build(Recipe, self.recipe, "train.recipe"))
        elif not isinstance(self.recipe, Recipe):
            raise ValueError(f"train.recipe={self.recipe!r}: must be a mapping of experiments.lm.recipe.Recipe's fields")
        for f in ("steps", "batch", "log_every", "eval_every", "ckpt_every", "sel_rows", "grad_accum"):
            check_int(f"train.{f}", getattr(self, f), 1)
        for f in ("warmup", "eval_batches", "gates_open_steps", "eval_positions"):
            check_int(f"train.{f}", getattr(self, f), 0)
        for f in ("eval_every", "ckpt_every"):
            if getattr(self, f) % self.log_every:
                raise ValueError(f"train.{f}={getattr(self, f)}: must be a multiple of log_every={self.log_every}")
        for f in ("lr", "min_lr_ratio", "weight_decay", "beta1", "beta2", "grad_clip", "time_limit_s"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) and not (f == "time_limit_s" and v is None):
                raise ValueError(f"train.{f}={v!r}: must be a number")
            if v is not None and not math.isfinite(v):  # inf or nan: a run that trains to a NaN loss, or never stops
                raise ValueError(f"train.{f}={v!r}: must be a finite number"
                                 + (" (null: no time limit)" if f == "time_limit_s" else ""))
        v = self.loss_target
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf):
            raise ValueError(f"train.loss_target={v!r}: must be a finite number > 0 (a held-out loss), or null")
        if self.init_from is not None and (not isinstance(self.init_from, str) or not self.init_from):
            raise ValueError(f"train.init_from={self.init_from!r}: must be a path (a dense run's folder) or null")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"train.compile={self.compile!r}: must be one of {', '.join(COMPILE_MODES)}")
        if not isinstance(self.save_selections, bool):
            raise ValueError(f"train.save_selections={self.save_selections!r}: must be true or false")
        lengths = self.selection_lengths
        if isinstance(lengths, (str, bytes)) or not isinstance(lengths, (list, tuple)) or not lengths:
            raise ValueError(f"train.selection_lengths={lengths!r}: must be a non-empty list of lengths")
        for i, v in enumerate(lengths):
            check_int(f"train.selection_lengths[{i}]", v, 1)
        object.__setattr__(self, "selection_lengths", tuple(lengths))
        if isinstance(self.selection_layer, bool) or not isinstance(self.selection_layer, int):
            raise ValueError(f"train.selection_layer={self.selection_layer!r}: must be an integer (a layer index)")
        if not isinstance(self.profile, bool):
            raise ValueError(f"train.profile={self.profile!r}: must be true or false")
        if self.profile and self.log_every < 2:
            raise ValueError(f"train.profile=true: needs log_every >= 2 (the profiled step is left out of its "
                             f"window's tokens_per_s), got {self.log_every}")
        if not self.lr > 0:
            raise ValueError(f"train.lr={self.lr!r}: must be positive")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"train.min_lr_ratio={self.min_lr_ratio!r}: must be in [0, 1]")
        for f in ("weight_decay", "grad_clip"):
            if not getattr(self, f) >= 0:
                raise ValueError(f"train.{f}={getattr(self, f)!r}: must be >= 0")
        for f in ("beta1", "beta2"):
            if not 0 <= getattr(self, f) < 1:
                raise ValueError(f"train.{f}={getattr(self, f)!r}: must be in [0, 1)")
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise ValueError(f"train.time_limit_s={self.time_limit_s!r}: must be positive or null")
        object.__setattr__(self, "curriculum", tuple(dict(s) for s in self.curriculum))
        for i, st in enumerate(self.curriculum):
            if set(st) != {"steps", "batch", "data"}:
                raise ValueError(f"train.curriculum[{i}]: needs exactly the keys steps, batch, data; got {sorted(st)}")
            check_int(f"train.curriculum[{i}].steps", st["steps"], 1)
            check_int(f"train.curriculum[{i}].batch", st["batch"], 1)
        if sum(st["steps"] for st in self.curriculum) >= self.steps:
            raise ValueError(f"train.curriculum: its stages take all of train.steps={self.steps}; the main stage needs steps")

    def lr_at(self, step: int) -> float:
        """Learning rate of update ``step`` (1-based): linear warm-up, then cosine decay."""
        if step <= self.warmup:
            return self.lr * step / self.warmup
        frac = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


INT64_MAX = 2**63 - 1  # torch's integers (a seed, a size, a step count) are int64


def check_int(name: str, v, lo: int) -> None:
    """Raises a ValueError naming ``name`` unless ``v`` is an int (not a bool) from ``lo`` to what torch
    takes (int64)."""
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name}={v!r}: must be an integer >= {lo}")
    if v > INT64_MAX:
        raise ValueError(f"{name}={v!r}: must be an integer from {lo} to 2**63 - 1 (torch's int64)")


@dataclass(frozen=True)
class RunConfig:
    """Everything the loop needs, from the composed Hydra config (:meth:`from_conf`) or by hand.
    ``backend``: a backend name or ``{cmp, sel, win}`` (NSA's branches; the window model uses
    ``win``); ``dtype``: ``float32``, or ``bfloat16`` (autocast over float32 weights)."""

    lm: LMConfig
    attention: str
    data: Mapping
    train: TrainConfig
    backend: str | Mapping = "reference"
    fallback: str | None = None
    dtype: str = "float32"
    seed: int = 0
    streams: bool = True
    dp: int = 1  # parallel.dp x parallel.cp processes train the model (experiments/lm/distributed.py)
    cp: int = 1

    def __post_init__(self):
        if self.attention not in ATTENTION:
            raise ValueError(f"attention.kind={self.attention!r}: must be one of {ATTENTION}")
        if self.dtype not in TRAIN_DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: training runs in one of {TRAIN_DTYPES}")
        check_int("seed", self.seed, 0)
        object.__setattr__(self, "backend", dispatch.resolve(self.backend))
        ref = [b for b in dispatch.BRANCHES if self.backend[b] == "reference"]
        if self.attention == "nsa" and self.dtype == "bfloat16" and ref:
            # nsa/reference.py picks its own accumulation dtype; autocast turns its products to bfloat16,
            # and its masking fails there ("value cannot be converted to type c10::BFloat16")
            raise ValueError(f"backend.{ref[0]}=reference: NSA's reference backend does not run under bfloat16 "
                             "autocast; use dtype=float32, or backend=triton on a GPU")
        task = self.stages()[-1][1]  # checks the data node and every stage's
        acfg = self.lm.attention_config()  # checks the attention shape (NSAConfig's rules)
        if acfg.rope_rule():
            raise ValueError(f"lm.nsa.d_k={acfg.d_k}: {acfg.rope_rule()}")
        if self.attention == "nsa" and self.train.ablation.selection == "oracle":
            if acfg.n_sel <= acfg.n_init + acfg.n_local:
                raise ValueError(f"train.ablation.selection=oracle: needs lm.nsa.n_sel > n_init + n_local = "
                                 f"{acfg.n_init + acfg.n_local} (a free slot for the needle's block), got {acfg.n_sel}")
            for _, t, _ in self.stages():
                if not hasattr(t, "sources"):
                    raise ValueError(f"train.ablation.selection=oracle: needs a lookup task whose answers have a "
                                     f"source (data.task=needles|retrieval), got {t.task!r}")
        if self.attention == "nsa" and self.train.save_selections:
            L = self.lm.n_layers
            if not -L <= self.train.selection_layer < L:
                raise ValueError(f"train.selection_layer={self.train.selection_layer}: the model has {L} NSA layers "
                                 f"(an index in [{-L}, {L}))")
            for T in self.train.selection_lengths:
                try:
                    make_task({**self.data, "seq_len": T}, self.seed)
                except ValueError as e:
                    raise ValueError(f"train.selection_lengths: {T}: {e}") from e
        self._check_parallel()
        if self.attention == "nsa" and self.train.eval_batches:
            most = task.seq_len - acfg.n_sel * acfg.l_sel
            if self.train.sel_rows > most:
                raise ValueError(f"train.sel_rows={self.train.sel_rows}: must be <= data.seq_len - n_sel * l_sel = {most} "
                                 "(each sampled row needs more than n_sel candidate blocks)")

    def _check_parallel(self) -> None:
        """What dp x cp processes (and train.grad_accum) need of the batches, sequences and options."""
        check_int("parallel.dp", self.dp, 1)
        check_int("parallel.cp", self.cp, 1)
        share = self.dp * self.train.grad_accum
        for i, (_, task, batch) in enumerate(self.stages()):
            where = "train.batch" if i == len(self.train.curriculum) else f"train.curriculum[{i}].batch"
            if batch % share:
                raise ValueError(f"{where}={batch}: must be a multiple of parallel.dp x train.grad_accum = "
                                 f"{self.dp} x {self.train.grad_accum} = {share} (each rank's micro-batches of the "
                                 "global batch)")
            if self.cp > 1 and task.seq_len % (2 * self.cp):
                key = "data.seq_len" if i == len(self.train.curriculum) else f"train.curriculum[{i}].data.seq_len"
                raise ValueError(f"{key}={task.seq_len}: parallel.cp={self.cp} cuts each sequence into 2 x {self.cp} = "
                                 f"{2 * self.cp} equal chunks; it must be a multiple of {2 * self.cp}")
        if self.cp > 1:
            if self.attention == "window":
                raise ValueError("attention.kind=window: does not run context parallel (parallel.cp > 1)")
            if self.lm.hf is not None:
                raise ValueError("lm=hf: does not run context parallel yet (parallel.cp > 1); lm=smoke|small do")
            if self.attention == "nsa" and self.train.ablation.selection != "topn":
                raise ValueError(f"train.ablation.selection={self.train.ablation.selection}: not with parallel.cp > 1 "
                                 "(the ablations read whole sequences)")
        if self.dp * self.cp > 1 and self.attention == "nsa" and self.train.save_selections:
            raise ValueError("train.save_selections=true: runs in one process; resume the checkpoint in one process "
                             "to save them (parallel.dp=1 parallel.cp=1)")

    @classmethod
    def from_conf(cls, cfg, *, backend=None, fallback=None, dtype=None) -> RunConfig:
        """From the composed ``conf/train.yaml`` (an OmegaConf node or a dict): reads ``lm``,
        ``attention.kind``, ``data``, ``train``, ``backend`` (its ``cmp/sel/win`` and ``fallback``),
        ``dtype`` (null: ``hardware.dtype``, then float32), ``seed``, ``streams``. An entry point
        passes what its framework resolved (the hardware policy's backends, the profile's dtype) as
        ``backend`` / ``fallback`` / ``dtype`` (a name or a torch.dtype); those replace the config's."""
        from omegaconf import OmegaConf

        c = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True)
        be = c.get("backend", "reference") if backend is None else backend
        if backend is None and isinstance(be, Mapping):
            fallback = be.get("fallback") if fallback is None else fallback
        if isinstance(be, Mapping):
            be = {b: be[b] for b in dispatch.BRANCHES if be.get(b) is not None}
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        dtype = dtype or c.get("dtype") or (c.get("hardware") or {}).get("dtype") or "float32"
        return cls(lm=build(LMConfig, c["lm"], "lm"), attention=c["attention"]["kind"], data=dict(c["data"]),
                   train=build(TrainConfig, c["train"], "train"), backend=be, fallback=fallback, dtype=dtype,
                   seed=c.get("seed", 0), streams=c.get("streams", True), dp=(c.get("parallel") or {}).get("dp", 1),
                   cp=(c.get("parallel") or {}).get("cp", 1))

    def stages(self) -> list[tuple[int, object, int]]:
        """``(last step, task, batch)`` per stage, the main stage last."""
        out, end = [], 0
        for i, st in enumerate(self.train.curriculum):
            end += st["steps"]
            try:
                task = make_task({**self.data, **st["data"]}, self.seed)
            except ValueError as e:
                raise ValueError(f"train.curriculum[{i}]: {e}") from e
            out.append((end, task, st["batch"]))
        return out + [(self.train.steps, make_task(self.data, self.seed), self.train.batch)]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["data"], d["backend"] = dict(self.data), dict(self.backend)
        d["lm"]["nsa"] = dict(self.lm.nsa)
        return d


def build(cls, node: Mapping, prefix: str):
    """``cls(**node)`` for a dataclass ``cls``; an unknown or missing key raises a ValueError naming the
    node (``prefix``) and the keys."""
    names = {f.name for f in fields(cls)}
    extra = sorted(set(node) - names)
    if extra:
        raise ValueError(f"{prefix}: unknown key(s) {extra}; known: {sorted(names)}")
    missing = sorted(f.name for f in fields(cls) if f.name not in node and f.default is f.default_factory is MISSING)
    if missing:
        raise ValueError(f"{prefix}: missing key(s) {missing}")
    return cls(**node)


