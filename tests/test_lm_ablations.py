"""The selection and gate ablations (experiments/lm/ablations.py) and the layer hook they use (``block_indices`` of
nsa.functional.nsa_attention / NSAAttention.forward): explicit blocks equal to the layer's own top-n change
nothing, others change the output; the oracle forces each answer's needle block, the full selection is the
top-n of full attention's block mass (checked against a loop over rows), a branch subset is the gated sum of
those branches alone; bad values fail in one line; one tiny run through the real CLI."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import make_config, random_inputs
from entrypoints import make_template, one_line, runs, start, wait
from hydra import compose, initialize_config_dir

from experiments.lm import ablations, checkpoint
from experiments.lm.config import RunConfig
from experiments.lm.data import IGNORE, Needles, Retrieval
from experiments.lm.loop import _check_config, train
from nsa import NSAAttention, NSAConfig, dispatch, env
from nsa import functional as fn
from nsa.numerics import rel_l2

F64 = torch.float64
CONF = Path(__file__).resolve().parent.parent / "conf"


def layer64(seed=0, **over) -> NSAAttention:
    kw = dict(dim=16, n_heads=4, n_kv_heads=2, d_k=4, d_v=6, l=8, d=4, l_sel=8, n_sel=3, w=6, n_init=1,
              n_local=1, phi="mlp", gate_hidden=8)
    torch.manual_seed(seed)
    return NSAAttention(NSAConfig(**{**kw, **over})).double()


def layer_inputs(layer, x):
    """q, compressed and raw keys/values and gates of ``layer`` on ``x`` (a whole sequence)."""
    q, kv, g = layer.project(x, torch.arange(x.shape[1]))
    k_cmp, v_cmp = layer.compress(kv["k_cmp_raw"], kv["v_cmp_raw"])
    return q, (k_cmp, v_cmp, kv["k_sel"], kv["v_sel"], kv["k_win"], kv["v_win"]), g


# ------------------------------------------------------------------------------------------------
# The layer hook: block_indices
# ------------------------------------------------------------------------------------------------
def test_block_indices_equal_to_the_topn_change_nothing_and_others_change_the_output():
    cfg = make_config(HQ=4, H=2, Dk=4, Dv=6, l=8, d=4, l_sel=8, n_sel=3, w=6, n_init=1, n_local=1)
    inp = random_inputs(cfg, 2, 45, requires_grad=True)
    args = [inp[k] for k in ("q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win", "gates")]

    def run(block_indices=None):
        o, idx = fn.nsa_attention(*args, cfg, return_indices=True, block_indices=block_indices)
        grads = torch.autograd.grad((o * torch.linspace(-1, 1, o.numel(), dtype=F64).view_as(o)).sum(), args)
        return o, idx, grads

    o0, idx, g0 = run()
    o1, idx1, g1 = run(idx.clone())
    assert torch.equal(o0, o1) and torch.equal(idx1, idx)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    # other blocks: the rows of positions >= 24 have more candidate blocks than n_sel; read block 1 there
    other = idx.clone()
    other[:, 24:, :, 1] = torch.where(idx[:, 24:, :, 1] == 1, 2, 1)
    o2, idx2, g2 = run(other)
    assert torch.equal(idx2, other) and torch.equal(o2[:, :24], o0[:, :24])
    assert (o2[:, 24:] - o0[:, 24:]).abs().amax() > 1e-3
    assert torch.equal(g2[1], g0[1]) and torch.equal(g2[2], g0[2])  # the compressed branch: the same gradient
    assert not torch.equal(g2[3], g0[3])  # the selected branch's keys: another gradient


@pytest.mark.skipif(not env.triton_interpret(), reason="the triton backend on this CPU runs under TRITON_INTERPRET=1")
def test_the_triton_backend_reads_the_given_blocks():
    """backend=triton with block_indices (the ablations' path on a GPU): the same output and input gradients as
    the reference on the same blocks, float32 through the interpreter, with blocks unlike its own top-n."""
    cfg = make_config(HQ=4, H=2, Dk=16, Dv=16, l=8, d=4, l_sel=8, n_sel=3, w=6, n_init=1, n_local=1)
    inp = random_inputs(cfg, 2, 45, dtype=torch.float32, requires_grad=True)
    args = [inp[k] for k in ("q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win", "gates")]
    _, idx = fn.nsa_attention(*args, cfg, return_indices=True)
    other = idx.clone()
    other[:, 24:, :, 1] = torch.where(idx[:, 24:, :, 1] == 1, 2, 1)
    w = torch.linspace(-1, 1, 2 * 45 * 4 * 16).view(2, 45, 4, 16)
    out = {}
    for backend in ("reference", "triton"):
        with dispatch.record() as rec:
            o = fn.nsa_attention(*args, cfg, backend=backend, block_indices=other)
        assert rec.ran == {"cmp": backend, "sel": backend, "win": backend}, rec
        out[backend] = (o, *torch.autograd.grad((o * w).sum(), args))
    for name, a, b in zip(("o", "q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win", "gates"),
                          out["reference"], out["triton"]):
        assert rel_l2(b, a) < 1e-5, (name, rel_l2(b, a))
    o_own = fn.nsa_attention(*args, cfg, backend="triton")
    assert (o_own[:, 24:] - out["triton"][0][:, 24:]).abs().amax() > 1e-3  # the given blocks were read


def test_the_module_takes_block_indices():
    layer = layer64()
    x = torch.randn(2, 45, 16, dtype=F64)
    q, kvs, g = layer_inputs(layer, x)
    _, idx = fn.nsa_attention(q, *kvs, g, layer.config, return_indices=True)
    assert torch.equal(layer(x, block_indices=idx), layer(x))
    assert not torch.equal(layer(x, block_indices=idx.flip(-1)[..., :1]), layer(x))


@pytest.mark.parametrize("bad, msg", [
    (lambda i: i.float(), "block_indices: expected an int32/int64 tensor"),
    (lambda i: i[:, :-1], "block_indices: expected shape"),
    (lambda i: torch.cat([i, i], -1), "block_indices: expected shape"),
    (lambda i: i.clamp(max=3) + 3, "block_indices: block index 6 out of range"),
])
def test_bad_block_indices_fail_in_one_line(bad, msg):
    layer = layer64()
    x = torch.randn(1, 45, 16, dtype=F64)
    q, kvs, g = layer_inputs(layer, x)
    _, idx = fn.nsa_attention(q, *kvs, g, layer.config, return_indices=True)
    with pytest.raises(ValueError, match=msg) as e:
        fn.nsa_attention(q, *kvs, g, layer.config, block_indices=bad(idx))
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------------
# Selection ablations
# ------------------------------------------------------------------------------------------------
def test_sources_are_the_needles_and_the_values_after_the_keys():
    nd = Needles(seq_len=96, n_slots=3, n_queries=3, n_values=4, n_filler=8, gap=16)
    tok, tgt = nd.batch("train", 0, 4)
    src = nd.sources(tok, tgt)
    b, t = (tgt != IGNORE).nonzero(as_tuple=True)
    assert len(b) == 12 and (src[tgt == IGNORE] == -1).all()
    assert torch.equal(tok[b, src[b, t]], tgt[b, t]) and (src[b, t] < nd.context).all()
    mq = Retrieval(seq_len=96, n_pairs=6, n_queries=3, n_keys=8, n_values=4, n_filler=8, gap=16)
    tok, tgt = mq.batch("train", 0, 4)
    src = mq.sources(tok, tgt)
    b, t = (tgt != IGNORE).nonzero(as_tuple=True)
    assert torch.equal(tok[b, src[b, t] - 1], tok[b, t]) and torch.equal(tok[b, src[b, t]], tgt[b, t])
    assert (src[b, t] < mq.context).all()


def test_oracle_forces_the_needle_block_at_the_answers_and_nothing_else():
    layer = layer64(n_sel=3)  # 1 initial + 1 local forced, 1 picked
    nd = Needles(seq_len=64, n_slots=4, n_queries=4, n_values=4, n_filler=8, gap=16)
    tok, tgt = nd.batch("train", 1, 3)
    src = nd.sources(tok, tgt)
    x = torch.randn(3, 64, 16, dtype=F64)
    idx = ablations.block_indices(layer, x, "oracle", src)
    q, kvs, g = layer_inputs(layer, x)
    _, own = fn.nsa_attention(q, *kvs, g, layer.config, return_indices=True)  # the layer's own top-n
    ans = tgt != IGNORE
    assert torch.equal(idx[~ans], own[~ans])
    b, t = ans.nonzero(as_tuple=True)
    blk = src[b, t] // 8
    assert (idx[b, t] == blk[:, None, None]).any(-1).all()  # every group reads the needle's block
    last = t // 8
    assert (idx[b, t] == 0).any(-1).all() and (idx[b, t] == last[:, None, None]).any(-1).all()  # forced stay
    assert not torch.equal(idx[ans], own[ans])  # the oracle changed some answer's blocks
    with pytest.raises(ValueError, match="sources: the oracle selection needs"):
        ablations.block_indices(layer, x, "oracle")


def _full_topn_by_loop(q, k, cfg):
    """The full selection of one sequence, one row at a time in float64: [T, H] sets of blocks."""
    T, HQ, _ = q.shape
    H, G, L = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.l_sel
    out = []
    for t in range(T):
        last = t // L
        rows = []
        for h in range(H):
            mass = torch.zeros(last + 1, dtype=F64)
            for hq in range(h * G, (h + 1) * G):
                p = torch.softmax(q[t, hq].double() @ k[: t + 1, h].double().T / math.sqrt(q.shape[-1]), -1)
                for j in range(last + 1):
                    mass[j] += p[j * L: (j + 1) * L].sum()
            if last + 1 <= cfg.n_sel:
                rows.append(set(range(last + 1)))
                continue
            forced = {j for j in range(last + 1) if j < cfg.n_init or j > last - cfg.n_local}
            rest = sorted((j for j in range(last + 1) if j not in forced), key=lambda j: -float(mass[j]))
            rows.append(forced | set(rest[: cfg.n_sel - len(forced)]))
        out.append(rows)
    return out


def test_full_selection_is_the_topn_of_full_attentions_block_mass():
    layer = layer64(n_sel=4, n_init=1, n_local=1)
    x = torch.randn(2, 48, 16, dtype=F64)
    idx = ablations.block_indices(layer, x, "full")
    with torch.no_grad():
        q, kv, _ = layer.project(x, torch.arange(48))
    for b in range(2):
        want = _full_topn_by_loop(q[b], kv["k_sel"][b], layer.config)
        got = [[{int(j) for j in idx[b, t, h] if j >= 0} for h in range(2)] for t in range(48)]
        assert got == want
    # and it is not the compressed scores' top-n (else this test could not tell them apart)
    _, own = fn.nsa_attention(q, *layer_inputs(layer, x)[1], layer_inputs(layer, x)[2], layer.config,
                              return_indices=True)
    assert not torch.equal(idx, own)


@pytest.mark.parametrize("branches", [("cmp",), ("sel",), ("win",), ("cmp", "sel")])
def test_a_branch_subset_is_the_gated_sum_of_those_branches_alone(branches):
    layer = layer64()
    x = torch.randn(2, 45, 16, dtype=F64, requires_grad=True)
    q, kvs, g = layer_inputs(layer, x)
    keep = torch.tensor([b in branches for b in ("cmp", "sel", "win")], dtype=F64)
    ref = layer.o_proj(fn.nsa_attention(q, *kvs, g * keep, layer.config).flatten(2))
    hook = ablations.BranchGates([layer], branches)
    try:
        y = layer(x)
        y.sum().backward()
    finally:
        hook.remove()
    assert torch.allclose(y, ref, atol=1e-12, rtol=0)
    assert not torch.allclose(y, layer(x))  # without the hook: all three branches
    for b in ("cmp", "sel", "win"):  # the branches held at 0 get no gradient
        grad = layer.kv_proj[f"k_{b}"].weight.grad
        assert (b in branches) == bool(grad.abs().sum() > 0), b
    assert ablations.BranchGates([layer], ("win", "sel", "cmp"))._handles == []  # all branches: no hook


# ------------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------------
def run_config(*overrides, preset="needles_smoke") -> RunConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return RunConfig.from_conf(compose("train", [f"train={preset}", *overrides]))


def test_the_defaults_are_the_papers_method():
    run = run_config()
    assert run.train.ablation == ablations.Ablation() and run.train.ablation.is_default
    assert run.train.ablation.branches == ("cmp", "sel", "win")
    assert run_config("train.ablation.branches=[win,cmp]").train.ablation.branches == ("cmp", "win")
    assert run_config("attention=dense", "train.ablation.selection=oracle", preset="smoke",
                      ).train.ablation.selection == "oracle"  # dense ignores it (text has no sources): no task rule


@pytest.mark.parametrize("overrides, msg", [
    (["train.ablation.selection=best"], "train.ablation.selection='best': must be one of ('topn', 'full', 'oracle')"),
    (["train.ablation.branches=[]"], "train.ablation.branches=[]: must be a non-empty list of distinct branches"),
    (["train.ablation.branches=[cmp,cmp]"], "train.ablation.branches=['cmp', 'cmp']: must be a non-empty list"),
    (["train.ablation.branches=[dense]"], "train.ablation.branches=['dense']: must be a non-empty list"),
    (["train.ablation.branches=cmp"], "train.ablation.branches='cmp': must be a non-empty list"),
    (["+train.ablation.gates=0"], "train.ablation: unknown key(s) ['gates']"),
    (["train=smoke", "train.ablation.selection=oracle"],
     "train.ablation.selection=oracle: needs a lookup task whose answers have a source (data.task=needles|retrieval), "
     "got 'text'"),
    (["train.ablation.selection=oracle", "lm.nsa.n_sel=2"],
     "train.ablation.selection=oracle: needs lm.nsa.n_sel > n_init + n_local = 2"),
])
def test_bad_values_fail_in_one_line_naming_the_field(overrides, msg):
    with pytest.raises(ValueError) as e:
        run_config(*overrides)
    assert str(e.value).startswith(msg) and "\n" not in str(e.value)


def test_a_checkpoint_from_before_the_ablations_resumes_only_at_their_defaults():
    run = run_config()
    old = run.to_dict()
    del old["train"]["ablation"]
    _check_config({"config": old}, run)  # the keys it lacks are at their defaults: no difference
    with pytest.raises(ValueError, match=r"train.ablation.selection \(None -> 'full'\)"):
        _check_config({"config": old}, run_config("train.ablation.selection=full"))


def test_an_ablated_runs_checkpoint_resumes_it(tmp_path):
    """The ablation round-trips through a checkpoint's config (saved, loaded weights_only): same run, no diff."""
    run = run_config("train.ablation.selection=full", "train.ablation.branches=[sel,cmp]")
    checkpoint.save(tmp_path, {"config": run.to_dict()})
    _check_config(checkpoint.load(tmp_path), run)
    with pytest.raises(ValueError, match=r"train.ablation.branches \(\['cmp', 'sel'\] -> \['cmp', 'sel', 'win'\]\)"):
        _check_config(checkpoint.load(tmp_path), run_config("train.ablation.selection=full"))


# ------------------------------------------------------------------------------------------------
# The real CLI
# ------------------------------------------------------------------------------------------------
def test_a_tiny_ablated_run_through_the_cli(tmp_path):
    """4 steps of needles_smoke (batch 2) with the oracle selection and the window held at 0: FINISHED, the
    ablation among the run's params, the window's gate logged at 0; a bad value exits 2 with one line."""
    tmpl = make_template(tmp_path / "template.db")
    bad = start(tmp_path, "train", "train=needles_smoke", "train.ablation.selection=best", name="bad", template=tmpl)
    args = ("train=needles_smoke", "attention=nsa", "train.steps=4", "train.eval_every=2", "train.log_every=1",
            "train.ckpt_every=4", "train.batch=2", "train.ablation.selection=oracle", "train.ablation.branches=[cmp,sel]")
    p = start(tmp_path, "train", *args, name="run", template=tmpl)
    rc, _, err = wait(bad)
    assert rc == 2 and any("train.ablation.selection='best': must be one of" in ln for ln in one_line(err)), err[-2000:]
    rc, _, err = wait(p)
    assert rc == 0, err[-3000:]
    c, rs = runs(tmp_path / "mlflow.db", "train")
    (r,) = [r for r in rs if r.data.params.get("train.ablation.selection") == "oracle"]
    assert r.info.status == "FINISHED"
    assert r.data.params["train.ablation.branches"] == "['cmp', 'sel']"
    gate_win = [m.value for m in c.get_metric_history(r.info.run_id, "gate_win")]
    assert len(gate_win) == 4 and all(v == 0.0 for v in gate_win)
    assert "val_accuracy" in r.data.metrics and "sel_recall_answers" in r.data.metrics


@pytest.mark.parametrize("selection", ["full", "oracle"])
def test_each_selection_trains_in_process(tmp_path, selection):
    """Two steps of needles_smoke (batch 2) with the selection ablated: the loop runs it, evaluation too, and
    the model's loss differs from the paper's selection's from the first step (the blocks changed)."""
    losses = {}
    for sel in ("topn", selection):
        cfg = run_config(f"train.ablation.selection={sel}", "train.steps=2", "train.log_every=1", "train.eval_every=2",
                         "train.ckpt_every=2", "train.batch=2")
        logged = []
        out = train(cfg, device=torch.device("cpu"), log=lambda m, s, logged=logged: logged.append(m),
                    ckpt_dir=tmp_path / sel, run_id="r")
        assert out["completed"] and "val_accuracy" in logged[-1] and math.isfinite(logged[-1]["val_loss"])
        losses[sel] = [m["loss"] for m in logged]
    assert losses[selection][0] != losses["topn"][0]
