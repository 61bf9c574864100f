"""The sdpa backend's FlexAttention masks (nsa/backends/sdpa.py ``band_block_mask``), built from block
indices, equal the masks ``create_block_mask`` derives by evaluating every (query, key) pair: the same
partial and full key blocks for every query block, with and without documents (varlen), for windows
shorter and longer than a block, query offsets (decode, chunked prefill) and lengths off the block size.
On the CPU: the block structure is plain tensors; FlexAttention itself runs in the GPU tests."""
from __future__ import annotations

import pytest
import torch

flex = pytest.importorskip("torch.nn.attention.flex_attention", reason="FlexAttention needs torch >= 2.5")

from nsa.backends.sdpa import band_block_mask  # noqa: E402


def _blocks(bm, which: str) -> torch.Tensor:
    """[n_q_blocks, n_k_blocks] 0/1: the key blocks each query block lists as partial or full."""
    n, idx = (bm.kv_num_blocks, bm.kv_indices) if which == "partial" else (bm.full_kv_num_blocks, bm.full_kv_indices)
    out = torch.zeros(idx.shape[-2], idx.shape[-1], dtype=torch.int32)
    if n is None:
        return out
    for i in range(idx.shape[-2]):
        out[i, idx[0, 0, i, : int(n[0, 0, i])].long()] = 1
    return out


def _by_pairs(Tq, S, w, q_start, doc):
    qs = torch.tensor(q_start)
    if doc is None:
        def mask_mod(b, h, qi, ki):
            return (ki <= qi + qs) & (ki > qi + qs - w)
    else:
        def mask_mod(b, h, qi, ki):
            return (doc[qi] == doc[ki]) & (ki <= qi) & (ki > qi - w)
    return flex.create_block_mask(mask_mod, None, None, Tq, S, device="cpu")


def _docs(lens):
    return torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), torch.tensor(lens))


@pytest.mark.parametrize("Tq,S,w,q_start,lens", [
    (300, 300, 64, 0, None), (1000, 1000, 512, 0, None), (129, 1129, 512, 1000, None), (1, 4097, 512, 4096, None),
    (513, 513, 128, 0, None), (777, 900, 200, 123, None),
    (1000, 1001, 512, 1, None), (1000, 1127, 512, 127, None), (256, 256, 1024, 0, None), (2048, 2048, 512, 0, None),
    (300, 300, 64, 0, (75, 100, 60, 65)), (1000, 1000, 512, 0, (1, 500, 128, 371)),
    (513, 513, 128, 0, (256, 257)), (2048, 2048, 512, 0, (128, 1024, 896)),
])
def test_band_block_mask_equals_create_block_mask(Tq, S, w, q_start, lens):
    doc = None if lens is None else _docs(lens)
    ours, theirs = band_block_mask(Tq, S, w, q_start, "cpu", doc), _by_pairs(Tq, S, w, q_start, doc)
    for which in ("partial", "full"):
        assert torch.equal(_blocks(ours, which), _blocks(theirs, which)), f"{which} blocks differ"
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    assert ours.seq_lengths == (Tq, S)


def test_band_block_mask_mask_mod_is_the_window():
    """Inside a partial block the mask_mod decides: it is the band (and the document)."""
    doc = _docs((200, 312))
    bm = band_block_mask(512, 512, 64, 0, "cpu", doc)
    qi, ki = torch.meshgrid(torch.arange(512), torch.arange(512), indexing="ij")
    want = (doc[qi] == doc[ki]) & (ki <= qi) & (ki > qi - 64)
    assert torch.equal(bm.mask_mod(0, 0, qi, ki), want)
