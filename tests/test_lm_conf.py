"""conf/train.yaml and its groups (lm, attention, data, train) compose into a valid RunConfig, and the
presets are what their comments say."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments.lm.cost import step_flops
from experiments.lm.loop import RunConfig, build_model

CONF = Path(__file__).resolve().parent.parent / "conf"
GROUPS = {g: sorted(f.stem for f in (CONF / g).glob("*.yaml")) for g in ("lm", "attention", "data", "train")}


def compose_train(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", list(overrides))


def test_groups():
    assert GROUPS == {"lm": ["small", "smoke"], "attention": ["dense", "nsa", "window"], "data": ["retrieval", "text"],
                      "train": ["retrieval32k", "smoke"]}


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
    assert RunConfig.from_conf(cfg, backend="reference").backend == dict.fromkeys(("cmp", "sel", "win"), "reference")


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
