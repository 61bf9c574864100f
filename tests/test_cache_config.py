"""A cache made for a layer of another config: the layer refuses it with one ValueError
line naming the buffer and the config's fields, for a prefill chunk, a decode step and nsa.decode.GraphDecoder,
where before a torch RuntimeError (a shape mismatch in a copy) came from inside the write."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from nsa import NSAAttention, NSAConfig

BASE = NSAConfig(dim=32, n_heads=4, n_kv_heads=2, d_k=8, d_v=8, l=8, d=4, l_sel=8, n_sel=3, w=8, gate_hidden=8,
                 phi_hidden=16)
OTHER = {  # another config's cache: other key/value heads, head dims, or compression blocks
    "n_kv_heads": dict(n_kv_heads=4),
    "d_k": dict(d_k=16, phi_hidden=32),
    "d_v": dict(d_v=4),
    "l_and_d": dict(l=16, d=8, l_sel=16),
}


@pytest.mark.parametrize("what", sorted(OTHER))
@pytest.mark.parametrize("tokens", [1, 12])  # a decode step, a prefill chunk
def test_a_cache_of_another_config_is_refused_in_one_line(what, tokens):
    torch.manual_seed(0)
    layer = NSAAttention(BASE).double().eval()
    other = NSAAttention(dataclasses.replace(BASE, **OTHER[what])).double()
    cache = other.new_cache(2, 32)
    with pytest.raises(ValueError) as e, torch.no_grad():
        layer(torch.randn(2, tokens, BASE.dim, dtype=torch.float64), cache)
    msg = str(e.value)
    assert msg.startswith("cache.") and "another config" in msg and "\n" not in msg, msg


def test_the_layers_own_cache_is_taken():
    torch.manual_seed(0)
    layer = NSAAttention(BASE).double().eval()
    cache = layer.new_cache(2, 32)
    with torch.no_grad():
        layer(torch.randn(2, 12, BASE.dim, dtype=torch.float64), cache)
    assert cache.length == 12


def test_the_graph_decoder_refuses_it_too():
    from nsa.decode import GraphDecoder

    layer = NSAAttention(BASE).double()
    cache = NSAAttention(dataclasses.replace(BASE, n_kv_heads=4)).double().new_cache(1, 32)
    with pytest.raises(ValueError, match=r"^cache\.k_cmp_raw: .*another config"):
        GraphDecoder(layer, cache)
