"""The training loop (experiments/lm/loop.py): the loss falls, every metric is there, a time limit
stops and resumes cleanly, a curriculum switches stages, bad configs and resumes fail with one line."""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments.lm import checkpoint
from experiments.lm.config import RunConfig
from experiments.lm.loop import train
from nsa.dispatch import BackendUnavailable

CONF = Path(__file__).resolve().parent.parent / "conf"
CPU = torch.device("cpu")
TINY_RETRIEVAL = ["data=retrieval", "data.seq_len=96", "data.n_pairs=8", "data.n_queries=4", "train.batch=2",
                  "train.sel_rows=8"]


def run_config(*overrides) -> RunConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return RunConfig.from_conf(compose("train", ["train=smoke", *overrides]))


def run(cfg, ckpt_dir, run_id="r", logged_through=0):
    logged = []
    out = train(cfg, device=CPU, log=lambda m, s: logged.append((s, m)), ckpt_dir=ckpt_dir, run_id=run_id,
                logged_through=logged_through)
    return out, logged


def test_loss_falls_on_text(tmp_path):
    """30 steps of the smoke preset's model on text: the byte-level loss starts near ln 256 and falls."""
    out, logged = run(run_config("train.steps=30", "train.eval_every=30", "train.ckpt_every=30"), tmp_path)
    losses = [m["loss"] for _, m in logged]
    assert [s for s, _ in logged] == list(range(1, 31)) and out["completed"] and out["step"] == 30
    assert abs(losses[0] - torch.log(torch.tensor(256.0)).item()) < 0.3
    # Measured: 5.5 -> ~3.0 over these steps; a model that does not learn stays within noise of 5.5.
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 1.5, losses
    assert logged[-1][1]["val_loss"] < losses[0] - 1.5
    assert not [k for _, m in logged for k in m if "_answers" in k]  # text: every position is an answer


@pytest.mark.parametrize("attention", ["nsa", "dense", "window"])
def test_metrics_per_variant(tmp_path, attention):
    cfg = run_config(f"attention={attention}", "train.steps=4", "train.log_every=2", "train.eval_every=4",
                     "train.ckpt_every=4", *TINY_RETRIEVAL)
    _, logged = run(cfg, tmp_path)
    assert [s for s, _ in logged] == [2, 4]
    base = {"loss", "accuracy", "grad_norm", "lr", "seq_len", "tokens_per_s", "model_tflop_per_s", "rss_peak_gib"}
    # a retrieval task: NSA's gates and selection also over its answer positions alone
    nsa = {f"gate_{b}{at}{suffix}" for b in ("cmp", "sel", "win") for at in ("", "_answers") for suffix in ("", "_l0", "_l1")}
    evaluation = {"val_loss", "val_accuracy"}
    selection = {f"{k}{at}{suffix}" for k in ("sel_mass", "sel_recall") for at in ("", "_answers")
                 for suffix in ("", "_l0", "_l1")} | {f"sel_share{suffix}" for suffix in ("", "_l0", "_l1")}
    want = base | (nsa if attention == "nsa" else set())
    assert set(logged[0][1]) == want
    assert set(logged[1][1]) == want | evaluation | (selection if attention == "nsa" else set())
    m = logged[1][1]
    assert 0 <= m["accuracy"] <= 1 and m["seq_len"] == 96 and m["tokens_per_s"] > 0 and m["rss_peak_gib"] > 0
    if attention == "nsa":
        assert all(0 < m[k] < 1 for k in nsa | selection)


def test_gates_open_steps_hold_the_gates_at_one_then_free_them(tmp_path):
    cfg = run_config("train.steps=4", "train.log_every=1", "train.eval_every=4", "train.ckpt_every=4",
                     "train.gates_open_steps=2", *TINY_RETRIEVAL)
    _, logged = run(cfg, tmp_path)
    gate_keys = [k for k in logged[0][1] if k.startswith("gate_")]
    assert len(gate_keys) == 18  # 3 branches x (all, answers) x (mean, 2 layers)
    for step, m in logged[:2]:
        assert all(m[k] == 1.0 for k in gate_keys), (step, m)
    for step, m in logged[2:]:
        assert all(0 < m[k] < 1 for k in gate_keys), (step, m)


@pytest.mark.parametrize("attention", ["dense", "window"])
def test_gates_open_steps_is_a_no_op_without_gates(tmp_path, attention):
    out, logged = run(run_config(f"attention={attention}", "train.steps=2", "train.eval_every=2", "train.ckpt_every=2",
                                 "train.gates_open_steps=2", *TINY_RETRIEVAL), tmp_path)
    assert out["completed"] and not [k for _, m in logged for k in m if k.startswith("gate_")]


def test_time_limit_stops_at_a_checkpoint_and_resumes(tmp_path):
    cfg = run_config("train.steps=6", "train.time_limit_s=1e-9", *TINY_RETRIEVAL)
    out, first = run(cfg, tmp_path)
    assert not out["completed"] and out["step"] == 1 and [s for s, _ in first] == [1]
    assert checkpoint.peek(tmp_path) == {"run_id": "r", "step": 1}
    cfg = run_config("train.steps=6", *TINY_RETRIEVAL)  # time_limit_s may change on resume
    out, rest = run(cfg, tmp_path, logged_through=1)
    assert out["completed"] and [s for s, _ in rest] == [2, 3, 4, 5, 6]


def test_resume_refuses_another_run_or_config(tmp_path):
    cfg = run_config("train.steps=2", *TINY_RETRIEVAL)
    run(cfg, tmp_path)
    with pytest.raises(ValueError, match=r"run_id='other': the checkpoint belongs to run 'r'"):
        run(cfg, tmp_path, run_id="other")
    with pytest.raises(ValueError, match=r"config: differs from the checkpoint's in train.lr \(0.003 -> 0.001\)"):
        run(run_config("train.steps=2", "train.lr=1e-3", *TINY_RETRIEVAL), tmp_path)
    out, logged = run(cfg, tmp_path, logged_through=2)  # finished: nothing to do, nothing logged again
    assert out["completed"] and logged == []


def test_curriculum_switches_stages(tmp_path):
    stage = "train.curriculum=[{steps: 2, batch: 4, data: {seq_len: 64, n_pairs: 4, n_queries: 4, gap: 16}}]"
    _, logged = run(run_config("train.steps=4", stage, *TINY_RETRIEVAL), tmp_path)
    assert [m["seq_len"] for _, m in logged] == [64, 64, 96, 96]
    assert logged[-1][1]["val_accuracy"] >= 0  # evaluation runs on the main stage


@pytest.mark.parametrize("overrides,match", [
    (["train.eval_every=3", "train.log_every=2"], r"train.eval_every=3: must be a multiple of log_every=2"),
    (["train.sel_rows=90"], r"train.sel_rows=90: must be <= data.seq_len - n_sel \* l_sel = 32"),
    (["train.curriculum=[{steps: 9, batch: 1, data: {}}]", "train.steps=9"], r"train.curriculum: its stages take all"),
    (["train.curriculum=[{steps: 1, batch: 1, data: {seq_len: 8}}]"], r"train.curriculum\[0\]: data.seq_len=8: too short"),
    (["+train.colour=red"], r"train: unknown key\(s\) \['colour'\]"),
    (["train.lr=fast"], r"train.lr='fast': must be a number"),
    (["train.gates_open_steps=-1"], r"train.gates_open_steps=-1: must be an integer >= 0"),
    (["attention.kind=sparse"], r"attention.kind='sparse'"),
    (["dtype=float16"], r"dtype='float16': training runs in one of"),
    (["dtype=bfloat16"], r"backend.cmp=reference: NSA's reference backend does not run under bfloat16 autocast"),
    (["lm.nsa.d_k=7"], r"NSAConfig.d_k|lm.nsa.d_k=7"),
])
def test_config_errors_name_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        run_config(*TINY_RETRIEVAL, *overrides)


def test_unavailable_backend_fails_before_anything_is_written(tmp_path):
    cfg = run_config("attention=window", "backend.win=fa2", *TINY_RETRIEVAL)
    with pytest.raises(BackendUnavailable, match=r"backend 'fa2' cannot run branch 'win' on cpu"):
        run(cfg, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    """A save that dies half-way leaves the previous checkpoint whole."""
    whole = {"data_position": 1, "config": {}}  # a checkpoint's fields besides the run and step (checkpoint.meta)
    checkpoint.save(tmp_path, {"run_id": "r", "step": 1, **whole})

    def dies(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dies)
    with pytest.raises(OSError):
        checkpoint.save(tmp_path, {"run_id": "r", "step": 2, **whole})
    assert checkpoint.peek(tmp_path) == {"run_id": "r", "step": 1}


def test_resume_accepts_a_checkpoint_written_before_the_new_lm_nsa_fields(tmp_path):
    """A checkpoint whose config predates lm.nsa.gate_bias / shared_kv / phi_init resumes when they
    are at their defaults (the same model); one of them set otherwise is still a difference, named."""
    cfg = run_config("train.steps=2", *TINY_RETRIEVAL)
    run(cfg, tmp_path)
    state = checkpoint.load(tmp_path)
    for key in ("gate_bias", "shared_kv", "phi_init"):
        del state["config"]["lm"]["nsa"][key]
    checkpoint.save(tmp_path, {k: v for k, v in state.items() if k != "format"})
    out, logged = run(cfg, tmp_path, logged_through=2)
    assert out["completed"] and logged == []
    with pytest.raises(ValueError, match=r"differs from the checkpoint's in lm.nsa.shared_kv \(None -> True\)"):
        run(run_config("train.steps=2", "lm.nsa.shared_kv=true", *TINY_RETRIEVAL), tmp_path)


def test_profile_takes_one_warm_step_and_leaves_it_out_of_tokens_per_s(tmp_path, monkeypatch):
    """train.profile: step log_every + 1 runs under torch.profiler (its table returned, naming the step and
    the ops that ran), and that window's tokens_per_s counts only its other steps."""
    short = ["attention=dense", "train.steps=6", "train.log_every=3", "train.eval_every=6", "train.ckpt_every=6",
             *TINY_RETRIEVAL]
    out, logged = run(run_config(*short, "train.profile=true"), tmp_path / "a")
    assert out["profile"].startswith("step 4 (seq_len 96, batch 2)") and "aten::mm" in out["profile"], out["profile"]
    assert [s for s, _ in logged] == [3, 6] and all(m["tokens_per_s"] > 0 for _, m in logged)
    assert run(run_config(*short), tmp_path / "b")[0]["profile"] is None
    # A clock that moves 1 s a reading and 1000 s inside the profiler: the profiled window's rate stays
    # near the other's (about 10 readings a window) instead of its 2 timed steps' tokens over 1000 s.
    clock = [0.0]

    def tick():
        clock[0] += 1.0
        return clock[0]

    @contextlib.contextmanager
    def slow_profiler(device, rows=30):
        clock[0] += 1000.0
        yield ["(table)"]

    monkeypatch.setattr(time, "perf_counter", tick)
    monkeypatch.setattr("experiments.lm.loop.profiled", slow_profiler)
    out, logged = run(run_config(*short, "train.profile=true"), tmp_path / "c")
    plain, profiled = logged[0][1]["tokens_per_s"], logged[1][1]["tokens_per_s"]
    assert out["profile"].endswith("(table)") and profiled > plain / 5 and profiled > 2 * 192 / 100, (plain, profiled)


def test_profile_needs_two_steps_a_window():
    with pytest.raises(ValueError, match=r"^train.profile=true: needs log_every >= 2"):
        run_config("train.profile=true", "train.log_every=1")
    with pytest.raises(ValueError, match=r"^train.profile='yes': must be true or false"):
        run_config("train.profile=yes")


def test_compile_wraps_the_training_steps_only(tmp_path, monkeypatch):
    """train.compile: the model is compiled once (the mode given, static shapes) and every training step runs
    the compiled model with dynamo set to fail at its recompile limit (not to fall back to eager);
    evaluation runs the model itself. (A real compile: the GPU runs of BENCHMARKS.md.)"""
    calls, made = [], []

    def fake_compile(model, mode, dynamic):
        made.append((mode, dynamic))

        def compiled(*args):
            calls.append(torch._dynamo.config.fail_on_recompile_limit_hit)
            return model(*args)
        compiled.selection = model.selection
        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    cfg = run_config("attention=dense", "train.steps=4", "train.log_every=2", "train.eval_every=4", "train.ckpt_every=4",
                     "train.compile=reduce-overhead", *TINY_RETRIEVAL)
    out, logged = run(cfg, tmp_path)
    assert made == [("reduce-overhead", False)] and calls == [True] * 4 and out["completed"]
    assert "val_loss" in logged[-1][1] and not torch._dynamo.config.fail_on_recompile_limit_hit
    run(run_config("attention=dense", "train.steps=2", "train.log_every=2", "train.eval_every=2", "train.ckpt_every=2",
                   *TINY_RETRIEVAL), tmp_path / "eager")
    assert made == [("reduce-overhead", False)]  # train.compile=none: not compiled


def test_compile_mode_is_checked():
    with pytest.raises(ValueError, match=r"^train.compile='fast': must be one of none, default, reduce-overhead, "
                                         r"max-autotune, max-autotune-no-cudagraphs$"):
        run_config("train.compile=fast")
