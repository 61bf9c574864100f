"""The training recipe (experiments/lm/recipe.py): the selection loss against a computation through the
layer's own compressed branch and the probes' full attention, where its gradient goes, the gates' learning rate,
the rows it reads, its config errors through the real CLI, and a run that logs it."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments.lm import ablations, checkpoint, loop, probes, recipe
from experiments.lm.config import RunConfig
from nsa import NSAAttention, NSAConfig

ROOT = Path(__file__).resolve().parent.parent
CFG = NSAConfig(dim=32, n_heads=4, n_kv_heads=2, d_k=8, d_v=8, l=8, d=4, l_sel=8, n_sel=3, w=16, n_init=1, n_local=1,
                gate_hidden=8, phi_hidden=16)


def layer(seed=0, **kw):
    torch.manual_seed(seed)
    m = NSAAttention(NSAConfig(**{**vars(CFG), **kw}))
    with torch.no_grad():
        for p in m.parameters():  # larger than the module's init: the scores are far from uniform
            p.mul_(4.0)
    return m


def expected_kl(m: NSAAttention, x, rows):
    """The loss for B = 1 from the library's own pieces: the compressed branch's probabilities (probes'
    compressed_scores, Eqs. 8-10) and full attention's group block mass (ablations.full_attention_scores), each
    row as a query at its position, both renormalised over the unforced candidates, then KL in float64."""
    c = m.config
    T = x.shape[1]
    q, kv, _ = m.project(x, torch.arange(T))
    out = []
    for t in rows[0].tolist():
        pred = probes.compressed_scores(m, q[:, t:t + 1], kv, q_start=t)[0, 0]  # [H, nb(t + 1)]
        target = ablations.full_attention_scores(q[:, t:t + 1], kv["k_sel"][:, :t + 1], c, q_start=t)[0, 0]
        last = t // c.l_sel
        cand = [j for j in range(last + 1) if c.n_init <= j <= last - c.n_local]
        p, tg = pred[:, cand].double(), target[:, cand].double()
        p, tg = p / p.sum(-1, keepdim=True), tg / tg.sum(-1, keepdim=True)
        out.append((tg * (tg.log() - p.log())).sum(-1))
    return torch.stack(out).mean()


def test_selection_kl_equals_the_layer_s_own_scores_and_full_attention():
    m = layer()
    x = torch.randn(1, 40, CFG.dim)
    rows = torch.tensor([[24, 31, 39, 30]])
    got = recipe.selection_kl(m, x, rows).detach()
    want = expected_kl(m, x, rows)
    assert want > 0.05  # a loss to match, not a vanishing one
    assert abs(float(got) - float(want)) < 1e-5 * float(want) + 1e-6, (float(got), float(want))


@pytest.mark.parametrize("detach_q", [True, False])
def test_the_gradient_reaches_the_compression_keys_and_not_the_target(detach_q):
    m = layer()
    x = torch.randn(2, 40, CFG.dim, requires_grad=True)
    recipe.selection_kl(m, x, torch.tensor([[24, 39], [33, 30]]), detach_q).backward()
    grads = {n: p.grad is not None and bool(p.grad.abs().sum() > 0) for n, p in m.named_parameters()}
    assert grads["kv_proj.k_cmp.weight"] and all(v for n, v in grads.items() if n.startswith("phi_k."))
    assert grads["q_proj.weight"] == (not detach_q)
    # the target (full attention over the selection keys) and everything else get nothing
    assert not any(v for n, v in grads.items() if n.startswith(("kv_proj.k_sel", "kv_proj.v_", "kv_proj.k_win",
                                                                   "phi_v.", "gate.", "o_proj.")))


def test_training_on_the_loss_alone_teaches_the_compressed_scores():
    """Adam on the compression keys alone drives the KL down (it can fail: a loss with the wrong sign or no
    gradient would not fall)."""
    m = layer()
    x = torch.randn(2, 40, CFG.dim)
    rows = torch.tensor([[24, 39, 31], [33, 30, 26]])
    params = [m.kv_proj["k_cmp"].weight, *m.phi_k.parameters()]
    opt = torch.optim.Adam(params, lr=1e-2)
    first = float(recipe.selection_kl(m, x, rows))
    for _ in range(60):
        opt.zero_grad()
        recipe.selection_kl(m, x, rows).backward()
        opt.step()
    assert float(recipe.selection_kl(m, x, rows)) < 0.5 * first


def test_sample_rows_draws_scored_positions_where_the_top_n_chooses():
    scored = torch.zeros(3, 20, dtype=torch.bool)
    scored[0, [3, 12, 15]] = True  # 3 lies before `first`
    scored[1, 5:] = True
    g = torch.Generator().manual_seed(0)
    rows = recipe.sample_rows(scored, 64, 10, g)
    assert rows.shape == (3, 64) and set(rows[0].tolist()) == {12, 15}
    assert set(rows[1].tolist()) <= set(range(10, 20)) and len(set(rows[1].tolist())) > 5
    assert set(rows[2].tolist()) <= set(range(10, 20))  # none scored: any position from `first`
    again = recipe.sample_rows(scored, 64, 10, torch.Generator().manual_seed(0))
    assert torch.equal(rows, again)
    with pytest.raises(ValueError, match="first=20"):
        recipe.sample_rows(scored, 4, 20, g)


def run_config(*overrides) -> RunConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return RunConfig.from_conf(compose("train", ["train=smoke", *overrides]))


def test_gate_lr_puts_the_gates_in_their_own_groups():
    cfg = run_config("train.recipe.gate_lr=0.25")
    model = loop.build_model(cfg)
    opt = loop.optimizer(model, cfg.train)
    gate = {id(p) for p in recipe.gate_parameters(model)}
    assert gate and len(gate) == 2 * 2 * cfg.lm.n_layers  # two Linear layers (weight, bias) a layer
    seen = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())  # every parameter once
    for g in opt.param_groups:
        assert g["lr_scale"] == (0.25 if {id(p) for p in g["params"]} <= gate else 1.0)
        assert not ({id(p) for p in g["params"]} & gate) or {id(p) for p in g["params"]} <= gate
    plain = loop.optimizer(loop.build_model(run_config()), run_config().train)
    assert [g["lr_scale"] for g in plain.param_groups] == [1.0, 1.0]  # the plain method: AdamW as before


def test_a_run_logs_the_selection_loss_and_the_gates_learn_slower(tmp_path):
    """Two runs of the smoke model on text, with and without the recipe: the recipe's logs sel_loss on the
    steps it is on, and its gate MLPs move a tenth as far from their common start (Adam's steps scale with
    the learning rate)."""
    steps = ["train.steps=6", "train.log_every=3", "train.eval_every=6", "train.ckpt_every=6"]
    logs, moved = {}, {}
    for name, extra in (("plain", []), ("recipe", ["train.recipe.sel_loss=1", "train.recipe.gate_lr=0.1",
                                                   "train.recipe.sel_loss_steps=3"])):
        cfg, logged = run_config(*steps, *extra), []
        torch.manual_seed(cfg.seed)
        start = loop.build_model(cfg).state_dict()  # the loop's init: the same seed, the same order
        loop.train(cfg, device=torch.device("cpu"), log=lambda m, s, out=logged: out.append((s, m)),
                   ckpt_dir=tmp_path / name, run_id="r")
        end = checkpoint.load(tmp_path / name)["model"]
        assert not torch.equal(end["emb.weight"], start["emb.weight"])  # it trained
        moved[name] = sum(float((end[k] - start[k]).norm()) for k in start if ".gate." in k)
        logs[name] = dict(logged)
    assert "sel_loss" not in logs["plain"][3]
    assert logs["recipe"][3]["sel_loss"] > 0 and "sel_loss" not in logs["recipe"][6]  # off after 3 steps
    assert 0 < moved["recipe"] < 0.2 * moved["plain"], moved


def test_recipe_weight_is_off_for_dense_and_where_the_top_n_takes_every_block():
    cfg = run_config("train.recipe.sel_loss=2")  # lm=smoke: n_sel 4 of l_sel 16 -> chooses past 64 tokens
    assert loop.recipe_weight(cfg, 1, 256) == 2.0 and loop.recipe_weight(cfg, 1, 64) == 0.0
    assert loop.recipe_weight(run_config("train.recipe.sel_loss=2", "attention=dense"), 1, 256) == 0.0


@pytest.mark.parametrize("override,msg", [
    ("train.recipe.gate_lr=0", "train.recipe.gate_lr=0: must be positive"),
    ("train.recipe.sel_loss=-1", "train.recipe.sel_loss=-1: must be a finite number >= 0"),
    ("train.recipe.sel_loss_rows=0", "train.recipe.sel_loss_rows=0: must be an integer >= 1"),
    ("+train.recipe.warmup=3", "train.recipe: unknown key(s) ['warmup']"),
    ("lm.nsa.kv_init=shared", "kv_init"),
])
def test_config_errors_through_the_cli(tmp_path, override, msg):
    p = subprocess.run([sys.executable, "-m", "experiments.train", "train=smoke", override,
                        f"tracking.uri=sqlite:///{tmp_path}/m.db", f"hydra.run.dir={tmp_path}/run"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and msg in lines[0], p.stderr


def test_selection_kl_matches_for_a_layer_with_shared_kv_and_mean_pooling():
    m = layer(shared_kv=True, phi="avg")
    x = torch.randn(1, 40, CFG.dim)
    rows = torch.tensor([[25, 38]])
    assert math.isclose(float(recipe.selection_kl(m, x, rows)), float(expected_kl(m, x, rows)), rel_tol=1e-5, abs_tol=1e-6)


def test_lm_hf_refuses_the_selection_loss_in_one_line(tmp_path):
    pytest.importorskip("transformers")
    p = subprocess.run([sys.executable, "-m", "experiments.train", "train=smoke", "lm=hf", "train.recipe.sel_loss=1",
                        f"tracking.uri=sqlite:///{tmp_path}/m.db", f"hydra.run.dir={tmp_path}/run"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "train.recipe.sel_loss=1: lm=hf does not take" in lines[0], p.stderr


@pytest.mark.parametrize("jobs", sorted((ROOT / "scripts" / "train_jobs").glob("*.txt")), ids=lambda p: p.name)
def test_the_committed_job_files_compose(jobs):
    """Every job of the files `bash scripts/bench.sh train-jobs` runs (BENCHMARKS.md's recipe figures) is a valid
    training config, and the ingredient ablation's names say what it switches."""
    lines = [ln.split() for ln in jobs.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines
    for name, *overrides in lines:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            # as bench.sh runs them on a GPU box (hardware=auto finds an H100/H200 profile, bfloat16 by default)
            RunConfig.from_conf(compose("train", [*overrides, "hardware=h200"]))
            cfg = RunConfig.from_conf(compose("train", overrides))
        r, gb = cfg.train.recipe, cfg.lm.attention_config().gate_bias
        if name.startswith("s_plain_"):
            assert (r.gate_lr, r.sel_loss, gb) == (1.0, 0.0, None), name
        if name.startswith(("L_gblr_sl", "s_gblr_sl_")) and "mean" not in name and "slq" not in name:
            assert (r.gate_lr, r.sel_loss, gb) == (0.1, 1.0, (3.0, 3.0, 3.0)), name
        if name.startswith("L_sl"):
            assert (r.gate_lr, r.sel_loss, gb) == (1.0, 1.0, None), name


def test_kv_init_tied_starts_the_branches_equal_and_lets_them_part():
    """lm.nsa.kv_init=tied: in the LM (whose init replaces the module's, then apply_init), the compressed and
    window branches' key/value projections start as copies of the selected branch's, as separate parameters
    that differ after one optimizer step; the default leaves them independent."""
    from experiments.lm.model import LM

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = RunConfig.from_conf(compose("train", ["train=smoke", "lm.nsa.kv_init=tied"]))
        plain = RunConfig.from_conf(compose("train", ["train=smoke"]))
    torch.manual_seed(0)
    model = loop.build_model(cfg, torch.device("cpu"))
    att = model.nsa_layers()[0]
    kv = att.kv_proj
    for kind in ("k", "v"):
        for branch in ("cmp", "win"):
            assert torch.equal(kv[f"{kind}_{branch}"].weight, kv[f"{kind}_sel"].weight)
            assert kv[f"{kind}_{branch}"].weight is not kv[f"{kind}_sel"].weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.randint(0, 64, (2, 64))
    out = model(idx)
    (out[0] if isinstance(out, tuple) else out).float().square().mean().backward()
    opt.step()
    assert not torch.equal(kv["k_cmp"].weight, kv["k_sel"].weight)
    torch.manual_seed(0)
    other = loop.build_model(plain, torch.device("cpu")).nsa_layers()[0].kv_proj
    assert not torch.equal(other["k_cmp"].weight, other["k_sel"].weight)
    assert isinstance(model, LM)
