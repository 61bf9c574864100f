"""Long-context evidence on text: the ``site`` corpus (the installed packages' source files, split by a hash of
each path, its fingerprint on the run), the passes over it a run has made (``data_epochs``) and the held-out loss
by position (``train.eval_positions``)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments.lm import data
from experiments.lm.config import RunConfig
from experiments.lm.loop import position_buckets, train

CONF = Path(__file__).resolve().parent.parent / "conf"


def test_site_corpus_is_the_installed_packages_source_split_by_a_hash_of_each_path():
    docs = data.site_documents()
    names = [n for n, _ in docs]
    assert names == sorted(names) and "torch/__init__.py" in names and len(docs) > 1000
    split = {s: data.corpus_files("site", s, 8) for s in data.SPLITS}
    assert sorted(n for s in split.values() for n, _ in s) == names  # every file in exactly one split
    assert all(data.held_out(n, 8) for n, _ in split["val"]) and not any(data.held_out(n, 8) for n, _ in split["train"])
    assert 0.08 < len(split["val"]) / len(docs) < 0.17  # about one in 8
    # the split of a file is its path's alone: a file added or removed moves no other
    assert data.held_out("torch/__init__.py", 8) == data.held_out("torch/__init__.py", 8)
    t = data.Text(seq_len=512, corpus="site")
    fp = t.fingerprint()
    assert fp["data_files_val"] == str(len(split["val"]))
    assert fp["data_bytes_train"] == str(sum(len(b) for _, b in split["train"]))
    assert len(fp["data_names_train"]) == 16 and fp["data_names_train"] != fp["data_names_val"]
    x, y = t.batch("val", 0, 4)
    val = [b for _, b in split["val"]]
    for row, last in zip(x, y[:, -1]):
        assert any(bytes(row.tolist()) + bytes([int(last)]) in d for d in val)  # inside one held-out file


@pytest.mark.parametrize("T, base, want", [
    (8192, 1024, [(0, 1024), (1024, 2048), (2048, 4096), (4096, 8192)]),
    (300, 32, [(0, 32), (32, 64), (64, 128), (128, 256), (256, 300)]),
    (100, 256, [(0, 100)]),
    (100, 0, [])])
def test_position_buckets_double_up_to_the_context(T, base, want):
    assert position_buckets(T, base) == want


def test_the_loss_by_position_averages_to_the_held_out_loss_and_data_epochs_counts_the_windows(tmp_path):
    """Text makes every position a target: with one held-out batch, the buckets' losses weighted by their
    lengths are the held-out loss; data_epochs is the training windows read over those there are."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = RunConfig.from_conf(compose("train", ["train=smoke", "train.steps=4", "train.eval_every=4", "train.log_every=2",
                                                    "train.ckpt_every=4", "train.eval_batches=1", "train.eval_positions=16"]))
    logged = []
    train(cfg, device=torch.device("cpu"), log=lambda m, s: logged.append((s, m)), ckpt_dir=tmp_path, run_id="r")
    task = cfg.stages()[-1][1]
    (step, m), = [(s, m) for s, m in logged if "val_loss" in m]
    buckets = position_buckets(task.seq_len, 16)
    assert {k for k in m if k.startswith("val_loss_pos_")} == {f"val_loss_pos_{a}_{b}" for a, b in buckets}
    mean = sum((b - a) * m[f"val_loss_pos_{a}_{b}"] for a, b in buckets) / task.seq_len
    assert abs(mean - m["val_loss"]) < 1e-6 * m["val_loss"]
    assert [(s, mm["data_epochs"]) for s, mm in logged] == [(s, s * cfg.train.batch / task.windows("train"))
                                                           for s, _ in logged]


def test_the_loss_by_position_is_refused_with_context_parallelism():
    """parallel.cp > 1 holds part of each sequence on a rank: refused in one line (train's own check)."""
    from experiments import train as entry
    from experiments.framework.config import prepare

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", ["train=smoke", "train.eval_positions=16"])
    job = prepare(OmegaConf.create(OmegaConf.to_container(cfg)), "train")
    job.cfg.parallel.cp = 2
    with pytest.raises(ValueError, match=r"^train\.eval_positions=16: the loss by position is taken on whole rows; "
                                         r"not with parallel\.cp > 1"):
        entry.run_config(job)
