"""conf/train.yaml and its groups (lm, attention, data, train) compose into a valid RunConfig, and the
presets are what their comments say."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments.lm.cost import step_flops
from experiments.lm.config import RunConfig
from experiments.lm.loop import build_model

CONF = Path(__file__).resolve().parent.parent / "conf"
GROUPS = {g: sorted(f.stem for f in (CONF / g).glob("*.yaml")) for g in ("lm", "attention", "data", "train")}


def compose_train(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", list(overrides))


def test_groups():
    assert GROUPS == {"lm": ["hf", "small", "smoke"], "attention": ["dense", "nsa", "window"],
                      "data": ["needles", "retrieval", "text"],
                      "train": ["needles32k", "needles32k_g16", "needles_smoke", "passkey_smoke", "retrieval32k",
                                "retrieval32k_short", "site_smoke", "smoke", "text32k", "text8k", "text_smoke"]}


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_option_composes_and_validates(group, option):
    # lm=small's selection (16 blocks of 64 tokens) needs the long sequences of the preset sized for it.
    preset = ["train=retrieval32k"] if (group, option) == ("lm", "small") else []
    run = RunConfig.from_conf(compose_train(*preset, f"{group}={option}"))
    if group == "attention":
        assert run.attention == option
    if group == "lm":
        assert run.lm.name == option
    if group == "data":
        assert run.data["task"] == option


def test_retrieval_default_keeps_pairs_out_of_the_smoke_windows_reach():
    run = RunConfig.from_conf(compose_train("data=retrieval"))
    assert run.data["gap"] >= run.lm.n_layers * (run.lm.attention_config().w - 1)


def test_smoke_preset_is_the_cpu_default():
    cfg = compose_train()
    run = RunConfig.from_conf(cfg)
    assert cfg.hardware.name == "cpu" and run.backend == {"cmp": "reference", "sel": "reference", "win": "reference"}
    assert run.dtype == "float32" and run.attention == "nsa" and run.data["task"] == "text" and run.lm.name == "smoke"
    # A later command-line choice overrides the preset's.
    assert RunConfig.from_conf(compose_train("data=retrieval", "attention=dense")).attention == "dense"


def test_an_entry_point_passes_what_it_resolved():
    """The framework's hardware policy picks backends and the dtype; from_conf takes them over the config's."""
    cfg = compose_train("train=retrieval32k")
    run = RunConfig.from_conf(cfg, backend={"cmp": "triton", "sel": "triton", "win": "sdpa"}, fallback="reference",
                              dtype=torch.float32)
    assert run.backend == {"cmp": "triton", "sel": "triton", "win": "sdpa"} and run.fallback == "reference"
    assert run.dtype == "float32"
    assert RunConfig.from_conf(cfg, backend="reference", dtype="float32").backend == \
        dict.fromkeys(("cmp", "sel", "win"), "reference")


@pytest.mark.parametrize("attention", ["nsa", "dense", "window"])
def test_retrieval32k_preset(attention):
    cfg = compose_train("train=retrieval32k", f"attention={attention}")
    run = RunConfig.from_conf(cfg)
    assert cfg.hardware.name == "h200" and run.dtype == "bfloat16" and set(run.backend.values()) == {"triton"}
    (end1, short, b1), (end2, main, b2) = run.stages()
    assert (short.seq_len, b1, end1) == (2048, 16, 2000) and (main.seq_len, b2, end2) == (32768, 1, 6000)
    assert short.seq_len * b1 == main.seq_len * b2  # the same tokens per step in both stages
    # At 32k, where it is evaluated, no pair lies within reach of a stack of window layers.
    assert main.gap >= run.lm.n_layers * (run.lm.attention_config().w - 1)
    # The numbers the preset's comment quotes (TFLOP per step).
    with torch.device("meta"):
        model = build_model(run)
    got = {T: round(step_flops(model, T, B)["total"] / 1e12, 2) for T, B in ((32768, 1), (2048, 16))}
    assert got == {"nsa": {32768: 4.95, 2048: 3.77}, "dense": {32768: 17.67, 2048: 3.24},
                   "window": {32768: 2.76, 2048: 2.7}}[attention]


def test_retrieval32k_short_is_retrieval32k_with_half_the_32k_steps():
    full, short = (RunConfig.from_conf(compose_train(f"train={t}")) for t in ("retrieval32k", "retrieval32k_short"))
    assert short.train.steps == 4000 and short.train.time_limit_s == 240 and short.train.ckpt_every == 500
    assert [(end, task, b) for end, task, b in short.stages()][0] == full.stages()[0]  # the same 2k stage
    assert short.stages()[1][1:] == full.stages()[1][1:] and short.data == full.data and short.lm == full.lm
    assert {k: v for k, v in vars(short.train).items() if k not in ("steps", "time_limit_s", "ckpt_every")} == \
        {k: v for k, v in vars(full.train).items() if k not in ("steps", "time_limit_s", "ckpt_every")}


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_needles32k_preset(attention):
    run = RunConfig.from_conf(compose_train("train=needles32k", f"attention={attention}"))
    assert run.data["task"] == "needles" and run.lm.name == "small" and set(run.backend.values()) == {"triton"}
    assert [(t.seq_len, t.gap, b, end) for end, t, b in run.stages()] == \
        [(256, 32, 64, 300), (2048, 512, 16, 700), (8192, 2048, 4, 1100), (32768, 2048, 1, 2600)]
    assert len({t.vocab_size for _, t, _ in run.stages()}) == 1 and run.lm.attention_config().rope_base == 5e5
    main = run.stages()[-1][1]
    assert main.gap >= run.lm.n_layers * (run.lm.attention_config().w - 1)  # out of the window stack's reach
    # the paper's architecture (a projection per branch, Eq. 7's MLP, free gates) with the training recipe
    cfg = run.lm.attention_config()
    assert (cfg.shared_kv, cfg.phi, run.train.gates_open_steps) == (False, "mlp", 0)
    assert (cfg.l, cfg.d, cfg.l_sel, cfg.n_sel, cfg.w, cfg.G) == (32, 16, 64, 16, 512, 4)
    assert cfg.gate_bias == (3.0, 3.0, 3.0) and (run.train.recipe.gate_lr, run.train.recipe.sel_loss) == (0.1, 1.0)


def test_needles32k_g16_preset():
    """train=needles32k_g16: needles32k at the paper's group size (16 query heads on one key/value head)."""
    run, base = (RunConfig.from_conf(compose_train(f"train={p}")) for p in ("needles32k_g16", "needles32k"))
    cfg = run.lm.attention_config()
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.G) == (16, 1, 16)
    assert {k: v for k, v in vars(cfg).items() if k not in ("n_heads", "n_kv_heads")} == \
        {k: v for k, v in vars(base.lm.attention_config()).items() if k not in ("n_heads", "n_kv_heads")}
    assert run.train == base.train and run.data == base.data


def test_the_framework_validates_train_with_the_library():
    """experiments.train's jobs: prepare() runs RunConfig's checks, train's own ``check`` (a ValueError is a
    one-line config error before any run); the model is lm, not the benchmarks' model group."""
    from experiments import train
    from experiments.framework import ConfigError, config

    job = config.prepare(compose_train(), "train", check=train.run_config)
    assert job.nsa is None and job.branch == "none" and job.seq == 256 and "model" not in job.cfg
    long = compose_train("train=retrieval32k", "hardware.strict=false", "backend=reference", "dtype=float32")
    assert config.prepare(long, "train", check=train.run_config).seq == 32768  # seq: the main stage's context
    for overrides, msg in [(["dtype=float16"], "dtype='float16': training runs in one of ('float32', 'bfloat16')"),
                           (["model=tiny"], "model: not an option of experiments.train"),
                           (["train.steps=0"], "train.steps=0: must be an integer >= 1"),
                           (["lm.nsa.l=20"], "NSAConfig.l=20")]:
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            config.prepare(compose_train(*overrides), "train", check=train.run_config)


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_needles_smoke_preset(attention):
    """train=needles_smoke: the CPU needle task on the reference backend, NSA the paper's architecture with
    the training recipe, the needles out of the window stack's reach so only NSA's long-range branches can
    fetch them."""
    run = RunConfig.from_conf(compose_train("train=needles_smoke", f"attention={attention}"))
    assert run.attention == attention and run.lm.name == "smoke" and set(run.backend.values()) == {"reference"}
    task = run.stages()[-1][1]
    assert (task.task, task.seq_len, task.n_slots, task.n_queries, task.n_values) == ("needles", 256, 4, 4, 8)
    acfg = run.lm.attention_config()
    assert task.gap >= run.lm.n_layers * (acfg.w - 1)
    assert (acfg.shared_kv, acfg.phi, acfg.n_sel, acfg.gate_bias) == (False, "mlp", 8, (3.0, 3.0, 3.0))
    assert (acfg.l, acfg.d, acfg.l_sel) == (16, 8, 16)  # lm=smoke's blocks: l = 2d, as the paper's
    assert (run.train.steps, run.train.gates_open_steps) == (600, 0) and run.dtype == "float32"
    assert (run.train.recipe.gate_lr, run.train.recipe.sel_loss) == (0.1, 1.0)
