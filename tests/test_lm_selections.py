"""What a trained NSA layer selects (experiments/lm/selections.py): the tile sharing on hand-built selections,
the layer's selections against its own top-n, and train.save_selections through the real CLI."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from experiments.lm import probes, selections
from nsa import NSAAttention, NSAConfig, functional

ROOT = Path(__file__).resolve().parent.parent


def test_tile_sharing_on_hand_built_selections():
    same = torch.tensor([[0, 3, 5]]).repeat(8, 1)[None, :, None, :]  # [1, 8 rows, 1 group, 3]
    assert selections.tile_sharing(same, 4) == 1.0  # every query of a tile reads the tile's 3 blocks
    disjoint = torch.arange(24).view(1, 8, 1, 3)
    assert selections.tile_sharing(disjoint, 4) == pytest.approx(1 / 4)  # no two queries share a block
    half = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 4]])[None, :, None, :]  # block 0 read by all 4, 1-4 by one each
    assert selections.tile_sharing(half, 4) == pytest.approx(8 / (4 * 5))
    padded = torch.tensor([[0, -1], [0, -1]])[None, :, None, :]  # -1: no block
    assert selections.tile_sharing(padded, 2) == 1.0
    # picked: the forced first block (n_init = 1) and newest (n_local = 1) left out; rows at 32.. with l_sel 8
    rows = torch.tensor([[0, 2, 4], [0, 2, 4], [0, 3, 4], [0, 1, 4]])[None, :, None, :]  # positions 32-35: last = 4
    assert selections.tile_sharing(rows, 4, q_start=32, l_sel=8, n_init=1, n_local=1, picked=True) == \
        pytest.approx(4 / (4 * 3))  # picks 2, 2, 3, 1: three blocks, four reads
    assert selections.tile_sharing(rows, 4) == pytest.approx(12 / (4 * 5))
    with pytest.raises(ValueError, match="tile=5"):
        selections.tile_sharing(rows, 5)


def test_layer_selections_are_the_layer_s_own_top_n():
    torch.manual_seed(0)
    cfg = NSAConfig(dim=32, n_heads=4, n_kv_heads=2, d_k=8, d_v=8, l=8, d=4, l_sel=8, n_sel=3, w=16, n_init=1,
                    n_local=1, gate_hidden=8, phi_hidden=16)
    layer = NSAAttention(cfg)
    x = torch.randn(2, 50, 32)
    idx = selections.layer_selections(layer, x)
    q, kv, _ = layer.project(x, torch.arange(50))
    want = functional.select_blocks(probes.compressed_scores(layer, q, kv), cfg)
    assert idx.shape == (2, 50, 2, 3) and torch.equal(idx, want)
    assert 1 / 16 <= selections.tile_sharing(idx, 16) <= 1.0


def test_save_selections_through_the_cli(tmp_path):
    """train=needles_smoke shortened, with train.save_selections: the file on the run holds each length's
    selections ([T, H, n_sel], -1 padded, each row's blocks causal) and the sharing metrics are logged."""
    db = tmp_path / "m.db"
    p = subprocess.run([sys.executable, "-m", "experiments.train", "train=needles_smoke", "train.steps=2",
                        "train.log_every=1", "train.eval_every=2", "train.ckpt_every=2", "train.save_selections=true",
                        "train.selection_lengths=[256,512]", "train.selection_layer=0", f"tracking.uri=sqlite:///{db}",
                        f"hydra.run.dir={tmp_path}/run"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    c = MlflowClient(tracking_uri=f"sqlite:///{db}")
    run = c.search_runs([c.get_experiment_by_name("nsa-train").experiment_id])[0]
    assert [a.path for a in c.list_artifacts(run.info.run_id, "selections")] == ["selections/layer0.pt"]
    saved = torch.load(c.download_artifacts(run.info.run_id, "selections/layer0.pt", str(tmp_path)), weights_only=True)
    assert "n_sel=8" in saved["config"]
    for T in (256, 512):
        idx = saved[f"T{T}"]
        assert idx.shape == (T, 2, 8) and idx.dtype == torch.int32
        t = torch.arange(T)[:, None, None]
        assert bool(((idx == -1) | ((idx >= 0) & (idx <= t // 16))).all())  # causal blocks or padding
        assert 0 < run.data.metrics[f"sel_share_T{T}"] <= 1 and f"sel_share_picked_T{T}" in run.data.metrics
    assert "sel_share" in run.data.metrics  # the evaluation's sharing over its probe rows


@pytest.mark.parametrize("override,msg", [
    ("train.selection_layer=2", "train.selection_layer=2: the model has 2 NSA layers"),
    ("train.selection_lengths=[256,8]", "train.selection_lengths: 8:"),
])
def test_bad_selection_settings_fail_before_the_run(tmp_path, override, msg):
    p = subprocess.run([sys.executable, "-m", "experiments.train", "train=needles_smoke", "train.save_selections=true",
                        override, f"tracking.uri=sqlite:///{tmp_path}/m.db", f"hydra.run.dir={tmp_path}/run"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and msg in lines[0], p.stderr
