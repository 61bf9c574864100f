"""nsa.integrations.hf on a CUDA GPU, compiled: generate() whose every new token replays one CUDA graph of the whole
model's step (decode="model_graph", the default "auto" there) gives the tokens of the layer's own cached forward on
the reference backend (decode="module"), in float32; the whole model's graph and each layer's graph (decode="graph")
replay the tokens and logits of their eager steps (model_step, step), bit for bit, in bfloat16 too, across a cache
growth and on a left-padded batch. Marked ``gpu``; its CPU twin (the eager steps through the interpreter) is
tests/test_hf_decode.py."""
from __future__ import annotations

import pytest
import torch

from nsa import env

transformers = pytest.importorskip("transformers")  # the [hf] extra

from nsa.integrations import hf  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(env.triton_interpret(), reason="TRITON_INTERPRET=1 interprets the kernels; these tests "
                                                      "check the compiled ones"),
]

# lm=small-like attention (l=32, d=16, l_sel=64, n_sel=16, w=512 as the paper) in a 2-layer Llama: a 700-token
# prompt has 11 selection blocks and 43 compressed tokens; 40 new tokens cross two compression strides' worth
SETTINGS = dict(l=32, d=16, l_sel=64, n_sel=16, w=512)
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, vocab_size=512,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def model(dtype, backend, decode, seed=0):
    torch.manual_seed(seed)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).to("cuda", dtype).eval()
    return hf.convert(m, backend=backend, decode=decode, **SETTINGS)


def greedy(m, prompt, new, attention_mask=None):
    kw = dict(attention_mask=torch.ones_like(prompt) if attention_mask is None else attention_mask, max_new_tokens=new,
              min_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        return m.generate(prompt, **kw)


def prompt(T=700, B=2):
    return torch.randint(0, SHAPE["vocab_size"], (B, T), device="cuda",
                         generator=torch.Generator("cuda").manual_seed(1))


@pytest.mark.parametrize("decode, ran", [("auto", "model_graph"), ("model_compiled", "model_compiled")])
def test_graph_decode_gives_the_reference_tokens_in_float32(decode, ran):
    """Also the compiled step (Inductor's fused norms and MLPs inside the graph), against the reference."""
    g = model(torch.float32, "triton", decode)
    ref = model(torch.float32, "reference", "module")
    ref.load_state_dict(g.state_dict())
    x = prompt()
    got, want = greedy(g, x, 40), greedy(ref, x, 40)
    assert {layer.self_attn.decode_ran for layer in g.model.layers} == {ran}
    assert torch.equal(got.sequences, want.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(got.logits, want.logits))
    assert diff <= 1e-3, diff  # float32 kernels (tf32 off) against the reference's float32 ops


@pytest.mark.parametrize("graph, eager", [("graph", "step"), ("model_graph", "model_step")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replays_equal_the_eager_fused_step(dtype, graph, eager):
    """The captured step replays the eager step's kernels: the same tokens and, bit for bit, the same logits; a
    1000-token prompt grows the cache at token 1024 (a new decoder, a new capture), and a left-padded batch decodes
    on a ragged cache."""
    g = model(dtype, "triton", graph)
    s = model(dtype, "triton", eager)
    s.load_state_dict(g.state_dict())
    x = prompt(T=1000)
    mask = torch.ones_like(x)
    mask[1, :300] = 0
    for kw in ({}, {"attention_mask": mask}):
        got, want = greedy(g, x, 40, **kw), greedy(s, x, 40, **kw)
        assert {layer.self_attn.decode_ran for layer in s.model.layers} == {eager}
        assert {layer.self_attn.decode_ran for layer in g.model.layers} == {graph}
        assert torch.equal(got.sequences, want.sequences)
        assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
