"""nsa.integrations.hf's decode paths: generate() whose every new token runs GraphDecoder's fused decode step
(decode="step": the Triton decode kernels, here through the interpreter in float32) gives the tokens and logits
of the layer's own cached forward on the reference backend (decode="module"), after a prompt, across a cache
growth, after a crop and a beam reorder; "auto" takes the module path on a CPU; a bad value is one line."""
from __future__ import annotations

import inspect
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")  # the [hf] extra; CI installs it

from nsa.backends.triton import triton_unsupported  # noqa: E402
from nsa.decode import GraphDecoder  # noqa: E402
from nsa.integrations import hf, hf_cache  # noqa: E402

pytestmark = [pytest.mark.skipif(triton_unsupported() is not None, reason=triton_unsupported() or ""),
              pytest.mark.usefixtures("fast_interpreter")]

SETTINGS = dict(l=8, d=4, l_sel=8, n_sel=3, w=16, n_init=1, n_local=1, gate_hidden=8)
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=101)
ARCHS = {  # Qwen2: q/k/v biases (the decoder's projection GEMM carries them); Llama: none
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE)),
}
TOL = 1e-4  # float32 logits of two kernels' summation orders (measured: ~1e-6)


def pair(arch: str, decode: str = "step"):
    """The same weights converted twice: fused decode steps on triton (each layer's, or the whole model's:
    decode="model_step"), and the module path on reference."""
    torch.manual_seed(0)
    src = ARCHS[arch]().float().eval()
    step = hf.convert(ARCHS[arch]().float().eval(), backend="triton", decode=decode, **SETTINGS)
    ref = hf.convert(src, backend="reference", decode="module", **SETTINGS)
    step.load_state_dict(ref.state_dict())
    return step, ref


def ids(B=2, T=37, seed=1):
    return torch.randint(0, SHAPE["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


def cached(model, x, cache):
    """``model(x)`` appending to ``cache`` (transformers 5.24 renamed past_key_values to cache)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return model(x, use_cache=True, **{name: cache}).logits


def greedy(model, prompt, new):
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new, do_sample=False,
              output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        return model.generate(prompt, **kw)


@pytest.mark.parametrize("decode", ["step", "model_step"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_generate_on_the_fused_decode_step_equals_the_module_path(arch, decode, monkeypatch):
    """37-token prompt, 16 tokens: the compressed blocks complete every 4 tokens, the top-n chooses among 5-7
    blocks, and the cache (capacity in steps of 16 here: 48) grows at token 49, which makes a new decoder (and
    for model_step a new step of the whole model: the model's forward grows the cache at that token)."""
    monkeypatch.setattr(hf_cache, "_GROW", 16)
    made = []
    orig = GraphDecoder.__init__
    monkeypatch.setattr(GraphDecoder, "__init__", lambda self, *a, **k: made.append(1) or orig(self, *a, **k))
    step, ref = pair(arch, decode)
    prompt = ids()
    got, want = greedy(step, prompt, 16), greedy(ref, prompt, 16)
    assert torch.equal(got.sequences, want.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(got.logits, want.logits))
    assert diff <= TOL, diff
    assert {m.self_attn.decode_ran for m in step.model.layers} == {decode}
    assert {m.self_attn.decode_ran for m in ref.model.layers} == {"module"}
    assert len(made) == 2 * 2  # two layers: at the first token (capacity 48), again after the growth to 96
    cache = getattr(got, "cache", None) or got.past_key_values
    assert cache.layers[0].nsa_cache.max_len == 96 and cache.layers[0].nsa_cache.length == 37 + 16 - 1


def test_the_compiled_model_step_compiles_once_and_equals_the_module_path(monkeypatch):
    """model_compiled's body (hf_graph.compiled_logits, here on Dynamo's aot_eager backend, eager: a CPU has no CUDA
    graph): the NSA layers' steps run outside the compiled code, the same tokens as the module path, and a new
    cache's step, and the one after its growth, reuse what was compiled at the first call (nothing compiles again)."""
    from torch._dynamo.utils import counters

    from nsa.integrations import hf_graph

    torch._dynamo.reset()
    monkeypatch.setattr(hf_cache, "_GROW", 16)
    monkeypatch.setattr(hf_graph, "logits", torch.compile(hf_graph.logits, backend="aot_eager", dynamic=False))
    step, ref = pair("llama", "model_step")
    prompt = ids(B=1, T=45)
    got = greedy(step, prompt, 2)  # compiles at its first token
    first = counters["stats"]["unique_graphs"]
    got, want = greedy(step, prompt, 6), greedy(ref, prompt, 6)
    assert first > 0 and counters["stats"]["unique_graphs"] == first  # the new cache, its growth at token 49: nothing new
    assert torch.equal(got.sequences, want.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(got.logits, want.logits)) <= TOL
    torch._dynamo.reset()


@pytest.mark.parametrize("decode", ["step", "model_step"])
def test_crop_and_beam_reorder_on_the_fused_decode_step(decode):
    """A crop moves the positions under the decoder (it reads them back); a beam reorder makes new buffers (a new
    decoder): the next tokens still equal the module path's."""
    step, ref = pair("llama", decode)
    x = ids(B=2, T=33)
    perm = torch.tensor([1, 0])
    out = []
    for model in (step, ref):
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            cached(model, x[:, :28], cache)
            ys = [cached(model, x[:, t:t + 1], cache) for t in range(28, 30)]
            cache.crop(-2)  # back to 28 tokens
            ys += [cached(model, x[:, t:t + 1], cache) for t in range(28, 31)]
            cache.reorder_cache(perm)
            ys += [cached(model, x[perm, t:t + 1], cache) for t in range(31, 33)]
        out.append(torch.cat(ys, 1))
        if model is step:
            assert step.model.layers[0].self_attn.decode_ran == decode
    assert (out[0] - out[1]).abs().max().item() <= TOL
    with torch.no_grad():
        full = ref(x).logits
    assert (out[1][:, 2:5] - full[:, 28:31]).abs().max().item() <= TOL


def test_auto_is_the_module_path_on_a_cpu_and_bad_values_are_refused():
    torch.manual_seed(0)
    model = hf.convert(ARCHS["llama"]().float().eval(), backend="triton", **SETTINGS)
    assert {m.self_attn.decode for m in model.model.layers} == {"auto"}
    greedy(model, ids(B=1, T=20), 2)
    assert {m.self_attn.decode_ran for m in model.model.layers} == {"module"}
    with pytest.raises(ValueError, match=r"^convert: decode='cuda': one of auto, model_graph, model_compiled, "
                                         r"model_step, graph, step, module$"):
        hf.convert(ARCHS["llama"](), decode="cuda", **SETTINGS)
    step = hf.convert(ARCHS["llama"]().float(), backend="triton", decode="step", **SETTINGS)
    cache = transformers.DynamicCache(config=step.config)
    x = ids(B=1, T=21)
    cached(step, x[:, :20], cache)
    with pytest.raises(ValueError, match=r"^decode='step': GraphDecoder's step records no gradient"):
        cached(step, x[:, 20:], cache)
    for decode, pattern in [("model_step", r"^decode='model_step': the model's step records no gradient; run under "
                                           r"torch\.no_grad\(\)"),
                            ("model_graph", r"^decode='model_graph': CUDA graphs need a CUDA device; "
                                            r"decode='model_step' runs the same step eager$"),
                            ("model_compiled", r"^decode='model_compiled': CUDA graphs need a CUDA device; "
                                               r"decode='model_step' runs the same step eager$")]:
        hf.use_backend(step, "triton", decode=decode)
        with pytest.raises(ValueError, match=pattern), torch.set_grad_enabled(decode == "model_step"):
            cached(step, x[:, 20:], cache)
