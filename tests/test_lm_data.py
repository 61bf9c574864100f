"""The training data (experiments/lm/data.py): the retrieval task's structure, the text corpus's
splits and epochs, and batches that are a function of their index (the resumable position)."""
from __future__ import annotations

import pytest
import torch

from experiments.lm.data import IGNORE, Needles, Retrieval, Text, corpus_bytes, make_task

RET = dict(task="retrieval", seq_len=200, n_pairs=12, n_queries=5, n_keys=40, n_values=8, n_filler=6, gap=30)


def test_retrieval_structure():
    t = make_task(RET, seed=3)
    B, T, Q = 16, RET["seq_len"], RET["n_queries"]
    tok, tgt = t.batch("train", 7, B)
    assert tok.shape == tgt.shape == (B, T) and tok.dtype == tgt.dtype == torch.int64
    assert int(tok.min()) >= 0 and int(tok.max()) < t.vocab_size == 8 + 40 + 6
    V, K = RET["n_values"], RET["n_keys"]
    is_key = (tok >= V) & (tok < V + K)
    qpos = T - 2 * Q + 2 * torch.arange(Q)
    for b in range(B):
        ctx = tok[b, : t.context]
        keys = ctx[is_key[b, : t.context]]
        assert len(keys) == RET["n_pairs"] and len(set(keys.tolist())) == RET["n_pairs"]  # distinct keys
        assert not is_key[b, t.context : T - 2 * Q].any()  # the gap holds filler only
        assert (tok[b, t.context : T - 2 * Q] >= V + K).all()
        at = is_key[b, : t.context].nonzero().flatten()
        assert (tok[b, at + 1] < V).all()  # every key is followed by a value
        # The loss is taken exactly at the queried keys, and the target is the value that followed the key.
        assert (tgt[b] != IGNORE).nonzero().flatten().tolist() == qpos.tolist()
        for p in qpos.tolist():
            k = int(tok[b, p])
            first = int((ctx == k).nonzero().flatten()[0])
            assert int(tgt[b, p]) == int(tok[b, first + 1]) == int(tok[b, p + 1])
        assert len(set(tok[b, qpos].tolist())) == Q  # each queried key once


NEEDLES = dict(task="needles", seq_len=120, n_slots=6, n_queries=4, n_values=5, n_filler=7, gap=20)


def test_needles_structure():
    t = make_task(NEEDLES, seed=2)
    B, T, S, Q, V = 16, 120, 6, 4, 5
    tok, tgt = t.batch("val", 3, B)
    assert tok.shape == tgt.shape == (B, T) and int(tok.min()) >= 0 and int(tok.max()) < t.vocab_size == 6 * 6 + 7
    qpos = T - 2 * Q + 2 * torch.arange(Q)
    for b in range(B):
        ctx = tok[b, : t.context]
        needles = ctx[ctx < S * V]
        assert sorted((needles // V).tolist()) == list(range(S))  # one needle per slot, in the slot's range
        assert (tok[b, t.context : T - 2 * Q] >= S * V + S).all()  # the gap holds filler only
        assert (tgt[b] != IGNORE).nonzero().flatten().tolist() == qpos.tolist()
        slots = (tok[b, qpos] - S * V).tolist()
        assert len(set(slots)) == Q and all(0 <= j < S for j in slots)  # each queried slot once
        for p, j in zip(qpos.tolist(), slots):
            assert int(tgt[b, p]) == int(needles[needles // V == j]) == int(tok[b, p + 1])


def test_stdlib_corpus_windows_lie_inside_one_held_out_or_trained_file():
    """data.corpus=stdlib: every window is a slice of one source file, the validation files are not trained on,
    and files long enough for 8k windows exist (the text8k preset's premise)."""
    from experiments.lm.data import corpus_documents

    t = Text(seq_len=1024, corpus="stdlib")
    docs = {split: corpus_documents("stdlib", split, 8) for split in ("train", "val")}
    assert len(docs["train"]) > 300 and len(docs["val"]) > 40 and sum(len(d) > 8193 for d in docs["train"]) > 100
    for split, (x, y) in (("train", t.batch("train", 7, 6)), ("val", t.batch("val", 1, 6))):
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row, last in zip(x, y[:, -1]):
            window = bytes(row.tolist()) + bytes([int(last)])
            assert any(window in d for d in docs[split]), split  # inside one file of its own split
    val = set(docs["val"])
    assert not val & set(docs["train"])
    with pytest.raises(ValueError, match=r"data.corpus='wiki': must be one of \('pydoc', 'stdlib', 'site'\)"):
        Text(seq_len=64, corpus="wiki")
    with pytest.raises(ValueError, match=r"data.seq_len=100000000: the train split of corpus 'stdlib' holds no window"):
        Text(seq_len=100_000_000, corpus="stdlib")


@pytest.mark.parametrize("change,match", [(dict(n_queries=7), "data.n_queries=7: must be <= n_slots=6"),
                                          (dict(seq_len=30), "data.seq_len=30: too short for 6 needles"),
                                          (dict(n_values=0), "data.n_values=0: must be an integer >= 1")])
def test_needles_config_errors(change, match):
    with pytest.raises(ValueError, match=match):
        Needles(**{k: v for k, v in {**NEEDLES, **change}.items() if k != "task"})


def test_batches_are_a_function_of_their_index():
    t = make_task(RET, seed=0)
    a1, b1 = t.batch("train", 5, 4)
    t2 = make_task(RET, seed=0)  # a new process rebuilds the same task from its config
    a2, b2 = t2.batch("train", 5, 4)
    assert torch.equal(a1, a2) and torch.equal(b1, b2)
    assert not torch.equal(a1, t.batch("train", 6, 4)[0])
    assert not torch.equal(a1, t.batch("val", 5, 4)[0])
    assert not torch.equal(a1, make_task(RET, seed=1).batch("train", 5, 4)[0])


def test_text_splits_epochs_and_targets():
    t = Text(seq_len=512)
    train, val = corpus_bytes("train", 8), corpus_bytes("val", 8)
    assert len(train) > 300_000 and len(val) > 20_000
    assert val[:2000].numpy().tobytes() not in train.numpy().tobytes()  # validation text is held out
    n = t.windows("train")
    B = 64
    seen = torch.cat([t.batch("train", i, B)[0] for i in range(-(-2 * n // B))])  # a little over two epochs
    starts = [bytes(r.tolist()) for r in seen]  # a window by its content
    assert len(set(starts[:n])) == n  # the first epoch visits every window once
    assert starts[:n] != starts[n:2 * n] and sorted(starts[:n]) == sorted(starts[n:2 * n])  # reshuffled
    x, y = t.batch("val", 0, 4)
    assert x.shape == y.shape == (4, 512) and torch.equal(x[:, 1:], y[:, :-1]) and int(y.max()) < t.vocab_size
    assert torch.equal(t.batch("train", 3, 4)[0], Text(seq_len=512).batch("train", 3, 4)[0])


@pytest.mark.parametrize("change,match", [
    (dict(task="copy"), r"data.task='copy'"),
    (dict(colour=1), r"data: unknown field\(s\) \['colour'\]"),
    (dict(n_pairs=41), r"data.n_pairs=41: must be <= n_keys=40"),
    (dict(n_queries=13), r"data.n_queries=13"),
    (dict(seq_len=50), r"data.seq_len=50: too short"),
    (dict(gap=-1), r"data.gap=-1"),
    (dict(n_values=0), r"data.n_values=0"),
])
def test_retrieval_config_errors(change, match):
    with pytest.raises(ValueError, match=match):
        make_task({**RET, **change}, seed=0)


def test_text_config_errors():
    with pytest.raises(ValueError, match=r"data.seq_len=100000: the val split of corpus .pydoc. holds no window of 100001 bytes"):
        Text(seq_len=100_000)
    with pytest.raises(ValueError, match=r"data.val_stride=1"):
        Text(seq_len=16, val_stride=1)
    with pytest.raises(ValueError, match=r"split='test'"):
        Retrieval(**{k: v for k, v in RET.items() if k != "task"}).batch("test", 0, 1)


@pytest.mark.parametrize("corpus", ["pydoc", "stdlib"])
def test_text_made_under_the_meta_device_holds_cpu_data(corpus):
    """experiments.train counts parameters on a model built under torch.device("meta"), which makes the tasks
    there too: their bytes and window starts must stay real CPU tensors."""
    with torch.device("meta"):
        t = Text(seq_len=512, corpus=corpus)
    x, y = t.batch("train", 0, 2)
    assert x.device.type == "cpu" and torch.equal(x, Text(seq_len=512, corpus=corpus).batch("train", 0, 2)[0])
