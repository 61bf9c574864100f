"""prefill.indices: a trained layer's saved selections (train.save_selections' file format) replayed as the
selected branch's blocks, through the real command line on the CPU: the run says what it read and measures
their sharing; a file that cannot serve is one line naming prefill.indices, exit 2, no run; and the replayed
blocks are what the layer's attention reads (measure.branches.core against nsa_attention(block_indices=...))."""
from __future__ import annotations

import entrypoints
import pytest
import torch

from experiments.lm import selections
from experiments.measure import replay
from experiments.measure.branches import core
from experiments.measure.inputs import prefill_inputs
from nsa import NSAAttention, NSAConfig, functional

# model=tiny's blocks (l_sel=16, n_sel=4) on one key/value head: the prefill's tiny model has two
TRAINED = NSAConfig(dim=32, n_heads=2, n_kv_heads=1, d_k=16, d_v=16, l=16, d=8, l_sel=16, n_sel=4, w=32, n_init=1,
                    n_local=2, gate_hidden=8, phi_hidden=16)
TINY = ["hardware=cpu", "model=tiny", "prefill.backward=false", "prefill.per_branch=false", "model.timing.warmup=0",
        "model.timing.repeats=1"]


def save(path, cfg=TRAINED, lengths=(128, 256)):
    """A selections file as train.save_selections writes it: a layer's own top-n at each length."""
    torch.manual_seed(0)
    layer = NSAAttention(cfg)
    out = {"config": repr(cfg)}
    for T in lengths:
        out[f"T{T}"] = selections.layer_selections(layer, torch.randn(1, T, cfg.dim))[0].to(torch.int32)
    torch.save(out, path)
    return out


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return entrypoints.make_template(tmp_path_factory.mktemp("template") / "mlflow.db")


def test_a_saved_selection_replays_and_the_run_says_so(tmp_path, template):
    saved = save(tmp_path / "layer3.pt")
    rc, out, err = entrypoints.wait(entrypoints.start(tmp_path, "prefill", *TINY, "seq=128",
                                                      f"prefill.indices={tmp_path / 'layer3.pt'}", template=template))
    assert rc == 0, err[-3000:]
    _, runs = entrypoints.runs(tmp_path / "mlflow.db", "prefill")
    (run,) = runs
    assert run.info.status == "FINISHED"
    assert run.data.tags["indices"] == str(tmp_path / "layer3.pt")
    note = run.data.tags["indices_note"]
    assert note.startswith("layer3.pt at seq=128: 1 key/value head(s), 4 blocks a query, l_sel=16") and \
        "repeated x2 over the model's 2 key/value heads" in note
    want = selections.tile_sharing(saved["T128"][None].repeat(1, 1, 2, 1).long(), 64)
    assert run.data.metrics["sel_share_m64"] == pytest.approx(want, rel=1e-6)
    assert "the selected branch reads layer3.pt" in err


def test_the_default_is_the_jobs_own_top_n(tmp_path, template):
    rc, _, err = entrypoints.wait(entrypoints.start(tmp_path, "prefill", *TINY, "seq=128", template=template))
    assert rc == 0, err[-3000:]
    (run,) = entrypoints.runs(tmp_path / "mlflow.db", "prefill")[1]
    assert run.data.tags["indices"] == "random" and "indices_note" not in run.data.tags
    assert 0 < run.data.metrics["sel_share_m64"] <= 1


@pytest.mark.parametrize("arg,says", [
    ("prefill.indices={tmp}/none.pt", "prefill.indices='{tmp}/none.pt': no such file"),
    ("prefill.indices={tmp}/layer.pt seq=64", "prefill.indices='{tmp}/layer.pt': no selections at seq=64; the file "
                                              "holds 128, 256"),
    ("prefill.indices={tmp}/layer.pt model.nsa.n_sel=3 model.nsa.n_local=1", "4 blocks a query, more than the "
                                                                           "benchmark's n_sel=3"),
    ("prefill.indices={tmp}/l8.pt", "its blocks are l_sel=8 tokens, the benchmark's model.nsa.l_sel=16"),
    ("prefill.indices={tmp}/junk.pt", "not a selections file of train.save_selections"),
    ("prefill.indices={tmp}/layer.pt prefill.peers=[fla]", "the peers (fla) select their own blocks"),
])
def test_a_file_that_cannot_serve_is_one_line_exit_2_no_run(arg, says, tmp_path, template):
    save(tmp_path / "layer.pt")
    save(tmp_path / "l8.pt", NSAConfig(**{**TRAINED.to_dict(), "l_sel": 8, "l": 8, "d": 4}), (128,))
    (tmp_path / "junk.pt").write_text("not a tensor file")
    args = arg.format(tmp=tmp_path).split()
    rc, _, err = entrypoints.wait(entrypoints.start(tmp_path, "prefill", *TINY, "seq=128", *args, template=template))
    lines = entrypoints.one_line(err)
    assert rc == 2 and len(lines) == 1 and says.format(tmp=tmp_path) in lines[0], err[-2000:]
    if _has(tmp_path):  # a store the refused job may have opened holds no run
        assert entrypoints.runs(tmp_path / "mlflow.db", "prefill")[1] == []


def _has(tmp) -> bool:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}").get_experiment_by_name("nsa-prefill") is not None


def test_the_replayed_blocks_are_what_the_selected_branch_reads(tmp_path):
    saved = save(tmp_path / "layer.pt", lengths=(128,))
    cfg = NSAConfig(dim=64, n_heads=4, n_kv_heads=2, d_k=16, d_v=16, l=16, d=8, l_sel=16, n_sel=4, w=32, n_init=1,
                    n_local=2, gate_hidden=16, phi_hidden=32)
    idx, note = replay.load(str(tmp_path / "layer.pt"), 128, cfg)
    assert idx.shape == (128, 2, 4) and torch.equal(idx[:, 0], saved["T128"][:, 0]) and torch.equal(idx[:, 1], idx[:, 0])
    torch.manual_seed(1)
    layer = NSAAttention(cfg).double()
    with torch.no_grad():
        inp = prefill_inputs(layer, torch.randn(1, 128, 64, dtype=torch.float64))
        given = idx[None].long()
        got = core("none", inp, cfg, {"cmp": "reference", "sel": "reference", "win": "reference"}, None,
                   block_indices=given)
        want = functional.nsa_attention(inp.q, inp.k_cmp, inp.v_cmp, inp.k_sel, inp.v_sel, inp.k_win, inp.v_win,
                                        inp.gates, cfg, block_indices=given)
        own = core("none", inp, cfg, {"cmp": "reference", "sel": "reference", "win": "reference"}, None)
        sel = core("sel", inp, cfg, {"cmp": "reference", "sel": "reference", "win": "reference"}, None,
                   block_indices=given)
        want_sel = functional.selected_attention(inp.q, inp.k_sel, inp.v_sel, given, cfg)
    assert torch.equal(got, want) and torch.equal(sel, want_sel)
    assert (got - own).abs().max().item() > 1e-3  # the layer's own top-n reads other blocks


def test_kernels_op_selection_replays_and_checks_the_saved_blocks(tmp_path, template):
    """op=selection on a trained layer's blocks: the kernel is checked against the reference on them (the first
    check_seq queries) and timed at seq; another op refuses the option in one line."""
    saved = save(tmp_path / "layer.pt")
    args = ["hardware=cpu", "model=tiny", "op=selection", "seq=128", "kernels.check_seq=64", "kernels.cpu_repeats=1",
            "kernels.backward=false", f"kernels.indices={tmp_path / 'layer.pt'}"]
    rc, _, err = entrypoints.wait(entrypoints.start(tmp_path, "kernels", *args, template=template,
                                                    extra_env={"TRITON_INTERPRET": "1"}), timeout=600)
    assert rc == 0, err[-3000:]
    (run,) = entrypoints.runs(tmp_path / "mlflow.db", "kernels")[1]
    assert run.info.status == "FINISHED" and run.data.tags["indices"] == str(tmp_path / "layer.pt")
    assert "repeated x2" in run.data.tags["indices_note"]
    want = selections.tile_sharing(saved["T128"][None].repeat(1, 1, 2, 1).long(), 64)
    assert run.data.metrics["sel_share_m64"] == pytest.approx(want, rel=1e-6)
    rc, _, err = entrypoints.wait(entrypoints.start(tmp_path, "kernels", *args, "op=window", name="w",
                                                    template=template, extra_env={"TRITON_INTERPRET": "1"}))
    lines = entrypoints.one_line(err)
    assert rc == 2 and len(lines) == 1 and "only op=selection reads block indices (op=window)" in lines[0], err
    assert len(entrypoints.runs(tmp_path / "mlflow.db", "kernels")[1]) == 1
