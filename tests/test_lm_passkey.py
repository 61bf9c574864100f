"""Passkey retrieval in text (experiments/lm/passkey.py): where the needle, the question and the answer go, the
training rows that carry one, the grid's scoring (a model that reads the answer scores 1, one that cannot 0), the
config's rules, and a run through the real CLI that logs the grid and its heat map."""
from __future__ import annotations

import pytest
import torch

import entrypoints
from entrypoints import one_line, start, wait
from experiments.lm import passkey
from experiments.lm.data import Text

KEY = b"73015"


def test_insert_places_the_needle_at_its_depth_and_the_answer_last():
    n_needle = len(passkey.NEEDLE.replace(b"{key}", KEY))
    for depth, where in ((0.0, 0), (1.0, 400 - passkey.span())):
        tok = torch.full((400,), ord("x"), dtype=torch.long)
        at = passkey.insert(tok, depth, KEY)
        text = bytes(tok.tolist())
        assert text.find(b"The pass key is 73015") == where + 1 and text.endswith(passkey.QUESTION + KEY)
        assert at.tolist() == list(range(395, 400)) and bytes(tok[at].tolist()) == KEY
        assert text.count(b"x") == 400 - n_needle - len(passkey.QUESTION) - passkey.DIGITS
    with pytest.raises(ValueError, match=r"^passkey: 50 tokens hold no needle"):
        passkey.insert(torch.zeros(50, dtype=torch.long), 0.5, KEY)


def test_training_rows_carry_passkeys_at_the_share_asked_and_validation_none():
    t = Text(seq_len=256, corpus="pydoc", passkey_share=1.0)
    x, y = t.batch("train", 3, 8)
    for r, last in zip(x, y[:, -1]):  # each row's window (tokens and its last target) ends in the question and a key
        window = bytes(r.tolist()) + bytes([int(last)])
        key = window[-passkey.DIGITS:]
        assert window[:-passkey.DIGITS].endswith(passkey.QUESTION) and key.isdigit()
        assert passkey.NEEDLE.replace(b"{key}", key) in window
    assert not any(passkey.QUESTION in bytes(r.tolist()) for r in t.batch("val", 0, 8)[0])
    assert torch.equal(t.batch("train", 3, 8)[0], x)  # a function of the batch's index, as every batch
    none = Text(seq_len=256, corpus="pydoc")
    assert not any(passkey.QUESTION in bytes(r.tolist()) for r in none.batch("train", 3, 8)[0])
    with pytest.raises(ValueError, match=r"^data\.passkey_share=1\.5: must be a number in \[0, 1\]$"):
        Text(seq_len=256, passkey_share=1.5)
    with pytest.raises(ValueError, match=r"^data\.passkey_share=0\.2: data\.seq_len=64 holds no passkey"):
        Text(seq_len=64, passkey_share=0.2)


class Reads(torch.nn.Module):
    """A model whose logits at t put the next token first when it may see it (``cheat``), else a constant."""

    def __init__(self, cheat: bool):
        super().__init__()
        self.cheat = cheat

    def forward(self, idx):
        logits = torch.zeros(*idx.shape, 256)
        if self.cheat:
            logits[0, torch.arange(idx.shape[1] - 1), idx[0, 1:]] = 1.0
        else:
            logits[..., ord("0")] = 1.0
        return logits


def test_the_grid_scores_a_reader_one_and_a_guesser_zero():
    task = Text(seq_len=256, corpus="pydoc")
    pk = passkey.Passkey(lengths=[256, 512], depths=[0.0, 0.5], samples=3)
    for cheat, want in ((True, 1.0), (False, 0.0)):
        acc = passkey.grid(Reads(cheat), task, pk, 0, torch.device("cpu"), torch.no_grad)
        assert set(acc) == {"passkey_acc_256_0", "passkey_acc_256_50", "passkey_acc_512_0", "passkey_acc_512_50",
                            "passkey_acc"} and set(acc.values()) == {want}


@pytest.mark.parametrize("node, message", [
    (dict(lengths=[10]), "train.passkey.lengths: 10 must be an integer >= "),
    (dict(depths=[1.5]), "train.passkey.depths: 1.5 must be a number in [0, 1]"),
    (dict(samples=0), "train.passkey.samples=0: must be an integer >= 1"),
    (dict(lengths="512"), "train.passkey.lengths='512': must be a list")])
def test_passkey_config_errors(node, message):
    with pytest.raises(ValueError) as e:
        passkey.Passkey(**node)
    assert str(e.value).startswith(message)


def test_a_run_logs_the_grid_and_its_heat_map_and_a_wrong_task_is_refused(tmp_path):
    args = ["train=smoke", "data.passkey_share=0.5", "train.steps=2", "train.eval_every=2", "train.log_every=1",
            "train.ckpt_every=2", "train.passkey.lengths=[256,512]", "train.passkey.depths=[0.5]", "train.passkey.samples=2"]
    rc, out, err = wait(start(tmp_path, "train", *args, name="pk"))
    assert rc == 0, err[-3000:]
    c, (r,) = entrypoints.runs(tmp_path / "mlflow.db", "train")
    assert {k for k in r.data.metrics if k.startswith("passkey_acc")} == {"passkey_acc_256_50", "passkey_acc_512_50",
                                                                           "passkey_acc"}
    assert [a.path for a in c.list_artifacts(r.info.run_id, "passkey")] == ["passkey/heatmap.png"]
    assert "[train] passkey retrieval: " in err
    (tmp_path / "x").mkdir()
    rc, out, err = wait(start(tmp_path / "x", "train", "train=smoke", "data=needles", "train.passkey.lengths=[256]",
                              name="pk2"))
    assert rc == 2 and one_line(err) == ["config error: train.passkey.lengths=[256]: passkey retrieval runs on a text task "
                                         "(data=text) in one process, not under torchrun"], err[-2000:]
