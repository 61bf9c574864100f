"""NSA grown from a trained dense model (train.init_from, experiments/lm/grow.py): the dense weights land where
the module docstring says, the grown model starts at the dense model's held-out loss rather than a fresh NSA's,
it trains on and resumes from its own checkpoint; what cannot grow is refused in one line, through the real CLI
before any run exists."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import entrypoints
from entrypoints import one_line, start, wait
from experiments.lm import checkpoint, grow
from experiments.lm.config import RunConfig
from experiments.lm.loop import build_model, train

CONF = Path(__file__).resolve().parent.parent / "conf"
# train=smoke, short: 40 dense steps take the held-out loss from ln 256 = 5.55 to about 3
BASE = ["train=smoke", "train.eval_batches=2", "train.log_every=10"]


def cfg_of(*overrides) -> RunConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return RunConfig.from_conf(compose("train", [*BASE, *overrides]))


def run(cfg, ckpt, run_id):
    logged = []
    train(cfg, device=torch.device("cpu"), log=lambda m, s: logged.append((s, m)), ckpt_dir=ckpt, run_id=run_id)
    return logged


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    d = tmp_path_factory.mktemp("dense")
    logged = run(cfg_of("attention=dense", "train.steps=40", "train.eval_every=40", "train.ckpt_every=40"), d / "ckpt",
                 "dense-run")
    return d, logged[-1][1]["val_loss"]


def test_the_dense_weights_land_in_every_branch(dense):
    d, _ = dense
    cfg = cfg_of("attention=nsa", f"train.init_from={d}", "train.steps=10")
    state = grow.source(cfg)["state"]
    model = build_model(cfg, torch.device("cpu"))
    kept = grow.into(model, state)
    got = model.state_dict()
    for i in range(cfg.lm.n_layers):
        a = f"blocks.{i}.attn."
        assert torch.equal(got[a + "q_proj.weight"], state[a + "q_proj.weight"])
        assert torch.equal(got[a + "o_proj.weight"], state[a + "o_proj.weight"])
        for kind in ("k", "v"):
            for branch in grow.BRANCHES:
                assert torch.equal(got[f"{a}kv_proj.{kind}_{branch}.weight"], state[f"{a}{kind}_proj.weight"])
    assert all(torch.equal(got[k], v) for k, v in state.items() if ".attn." not in k)  # embedding, norms, MLPs
    assert kept and all(".phi_" in k or ".gate." in k for k in kept)  # NSA's own: phi and the gates


def test_a_grown_model_starts_at_the_dense_loss_and_resumes_its_own_checkpoint(dense, tmp_path):
    d, dense_loss = dense
    steps = ["train.steps=10", "train.eval_every=10", "train.ckpt_every=10", "lm.nsa.phi_init=mean"]
    fresh = run(cfg_of("attention=nsa", *steps), tmp_path / "fresh", "fresh")[-1][1]["val_loss"]
    grown_cfg = cfg_of("attention=nsa", f"train.init_from={d / 'ckpt' / 'last.pt'}", *steps)
    grown = run(grown_cfg, tmp_path / "grown", "grown")
    assert grown[-1][1]["val_loss"] < dense_loss + 0.5 < fresh - 0.5, (grown[-1][1]["val_loss"], dense_loss, fresh)
    # the run's own checkpoint, not the dense one, on resume: the weights as saved at step 10
    saved = checkpoint.load(tmp_path / "grown")["model"]
    out = train(grown_cfg, device=torch.device("cpu"), log=lambda m, s: None, ckpt_dir=tmp_path / "grown", run_id="grown")
    assert out["step"] == 10 and all(torch.equal(out["model"].state_dict()[k], v) for k, v in saved.items())
    assert math.isfinite(grown[-1][1]["loss"])


def test_what_cannot_grow_is_refused_in_one_line_before_any_run(dense, tmp_path):
    d, _ = dense
    nsa_dir = tmp_path / "nsa"
    run(cfg_of("attention=nsa", "train.steps=1", "train.eval_batches=0", "train.log_every=1", "train.ckpt_every=1"),
        nsa_dir, "nsa-run")
    bad = tmp_path / "bad"  # a whole checkpoint (its digest matches) whose val_loss is no loss
    state = checkpoint.load(d / "ckpt")
    checkpoint.save(bad, {k: v for k, v in state.items() if k not in ("format", "digest")} | {"val_loss": "abc"})
    w = "config error: train.init_from="
    cases = [
        ([f"train.init_from={bad}"], f"{w}{bad}: the checkpoint's val_loss='abc' is not a held-out loss (a finite number > 0)"),
        ([f"train.init_from={d}", "attention=dense"],
         f"{w}{d}: grows an NSA model from a dense one; attention=dense starts from its own init (set attention=nsa)"),
        ([f"train.init_from={tmp_path / 'nope'}"],
         f"{w}{tmp_path / 'nope'}: no such file or folder (a dense run's output folder, its ckpt folder or last.pt)"),
        ([f"train.init_from={nsa_dir}"],
         f"{w}{nsa_dir}: the checkpoint's attention is 'nsa'; NSA grows from a dense model (attention=dense)"),
        ([f"train.init_from={d}", "lm.mlp_hidden=128", "lm.nsa.n_kv_heads=1"],
         f"{w}{d}: the dense model's shape differs in lm.mlp_hidden=128 (it has 256); lm.nsa.n_kv_heads=1 (it has 2)"),
    ]
    for args, line in cases:
        rc, out, err = wait(start(tmp_path, "train", *BASE, "train.steps=2", *args, name="g"))
        assert rc == 2 and one_line(err) == [line], err[-2000:]
    assert not (tmp_path / "mlflow.db").exists() or not entrypoints.runs(tmp_path / "mlflow.db", "train")[1]


def test_a_grown_run_is_timed_to_within_one_percent_of_the_dense_loss(dense, tmp_path):
    """Through the CLI: the dense checkpoint records its last held-out loss; a grown run's target is 1.01 x it
    (``loss_target_used``), and its first evaluation at or under it logs steps_to_loss_target and the tokens trained
    so far; a fresh NSA run given the same target (``train.loss_target``) and not reaching it in as many steps logs
    neither."""
    d, dense_loss = dense
    assert checkpoint.load(d / "ckpt")["val_loss"] == pytest.approx(dense_loss)
    steps = ["train.steps=10", "train.eval_every=5", "train.log_every=5", "train.ckpt_every=10", "lm.nsa.phi_init=mean"]
    (tmp_path / "g").mkdir()
    (tmp_path / "f").mkdir()
    target = 1.01 * dense_loss
    procs = [start(tmp_path / "g", "train", *BASE, *steps, f"train.init_from={d}", name="g"),
             start(tmp_path / "f", "train", *BASE, *steps, f"train.loss_target={target}", name="f")]
    for p in procs:
        rc, _, err = wait(p)
        assert rc == 0, err[-2000:]
    c, (grown,) = entrypoints.runs(tmp_path / "g" / "mlflow.db", "train")
    assert float(grown.data.params["init_from_val_loss"]) == pytest.approx(dense_loss)
    assert float(grown.data.params["loss_target_used"]) == pytest.approx(target)
    reached = c.get_metric_history(grown.info.run_id, "steps_to_loss_target")
    assert len(reached) == 1 and reached[0].value in (5, 10), reached
    val = {m.step: m.value for m in c.get_metric_history(grown.info.run_id, "val_loss")}
    assert val[reached[0].value] <= target and all(v > target for s, v in val.items() if s < reached[0].value)
    tokens = c.get_metric_history(grown.info.run_id, "tokens_to_loss_target")[0].value
    assert tokens == reached[0].value * 8 * 256  # train=smoke: batch 8 x 256 tokens a step
    c, (fresh,) = entrypoints.runs(tmp_path / "f" / "mlflow.db", "train")
    assert float(fresh.data.params["loss_target_used"]) == pytest.approx(target)
    assert min(m.value for m in c.get_metric_history(fresh.info.run_id, "val_loss")) > target
    assert not c.get_metric_history(fresh.info.run_id, "steps_to_loss_target")
