"""A converted model in transformers' own loading API: save_pretrained writes the NSA model type (nsa_llama,
nsa_qwen2, nsa_mistral), which AutoModelForCausalLM.from_pretrained loads, in a fresh process that imported
nsa.integrations.hf, as the NSA model with its weights exactly; without that import transformers refuses the
type instead of building a dense model. convert leaves the caller's config object as it was;
hf.from_pretrained takes transformers' loading arguments, loads folders saved with the dense model type, and
names a folder that is not there in one line."""
from __future__ import annotations

import json
import subprocess
import sys

import entrypoints
import pytest
import torch

transformers = pytest.importorskip("transformers")  # the [hf] extra; CI installs it

from nsa.integrations import hf  # noqa: E402

F64 = torch.float64
SETTINGS = dict(l=8, d=4, l_sel=8, n_sel=3, w=16, n_init=1, n_local=1, gate_hidden=8)
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=101)
ARCHS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, attention_bias=True)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**SHAPE, sliding_window=None)),
}
NAMES = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}
X = torch.arange(48).remainder(SHAPE["vocab_size"])[None]

LOAD = """
import sys, torch
{imports}
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
with torch.no_grad():
    logits = model(torch.arange(48).remainder(101)[None]).logits
torch.save({{"type": type(model).__name__, "attn": type(model.model.layers[0].self_attn).__name__,
            "logits": logits, "state": model.state_dict()}}, sys.argv[2])
"""


def saved(arch: str, folder):
    torch.manual_seed(0)
    model = hf.convert(ARCHS[arch]().to(F64).eval(), phi_init="mean", **SETTINGS)
    model.save_pretrained(folder)
    with torch.no_grad():
        return model, model(X).logits


def fresh(code: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          cwd=entrypoints.REPO, env=entrypoints.env(), timeout=300)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_auto_classes_load_the_nsa_model_in_a_fresh_process(arch, tmp_path):
    model, logits = saved(arch, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["model_type"] == f"nsa_{arch}" and config["architectures"] == [f"NSA{NAMES[arch]}ForCausalLM"]
    assert config["nsa"] == model.config.nsa and "_attn_implementation" not in config
    p = fresh(LOAD.format(imports="import nsa.integrations.hf"), tmp_path / "m", tmp_path / "out.pt")
    assert p.returncode == 0, p.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    assert (got["type"], got["attn"]) == (f"NSA{NAMES[arch]}ForCausalLM", "NSASelfAttention")
    assert torch.equal(got["logits"], logits)
    state = model.state_dict()
    assert got["state"].keys() == state.keys() and all(torch.equal(got["state"][k], v) for k, v in state.items())
    p = fresh(LOAD.format(imports=""), tmp_path / "m", tmp_path / "dense.pt")
    assert p.returncode == 1 and not (tmp_path / "dense.pt").exists()  # no dense model built in its place
    assert f"ValueError: The checkpoint you are trying to load has model type `nsa_{arch}` but Transformers does not " \
        "recognize this architecture" in p.stderr, p.stderr[-3000:]


def test_from_config_builds_an_nsa_model_at_its_own_init():
    config = hf.NSALlamaConfig(**SHAPE, nsa=dict(SETTINGS))
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert type(model) is hf.NSALlamaForCausalLM and model.config.nsa["n_sel"] == 3
    assert all(isinstance(layer.self_attn, hf.NSASelfAttention) for layer in model.model.layers)
    assert torch.isfinite(model(X).logits).all()
    with pytest.raises(ValueError, match=r"^NSALlamaConfig\.nsa: must be a dict of NSA settings, got None$"):
        transformers.AutoModelForCausalLM.from_config(hf.NSALlamaConfig(**SHAPE))


def test_convert_leaves_the_caller_s_config_as_it_was():
    """A dense baseline built from the same config object after convert is dense and runs."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**SHAPE)
    model = transformers.LlamaForCausalLM(cfg)  # which sets cfg._attn_implementation (sdpa)
    before = (cfg.to_dict(), cfg._attn_implementation, type(cfg))
    hf.convert(model, **SETTINGS)
    assert (cfg.to_dict(), cfg._attn_implementation, type(cfg)) == before and not hasattr(cfg, "nsa")
    assert model.config is not cfg and model.model.config is model.config and model.config.model_type == "nsa_llama"
    assert isinstance(model, transformers.LlamaForCausalLM) and type(model) is hf.NSALlamaForCausalLM
    baseline = transformers.LlamaForCausalLM(cfg)
    assert type(baseline.model.layers[0].self_attn).__name__ == "LlamaAttention"
    assert torch.isfinite(baseline(X).logits).all()


def test_from_pretrained_takes_transformers_arguments_and_older_folders(tmp_path):
    model, logits = saved("qwen2", tmp_path / "m")
    back = hf.from_pretrained(tmp_path / "m", dtype=torch.float32)
    assert back.dtype == torch.float32 and not back.training and type(back) is hf.NSAQwen2ForCausalLM
    assert (back(X).logits.double() - logits).abs().max().item() < 1e-4  # float32 against float64
    # a folder written before the NSA model types: the dense model_type with an 'nsa' entry
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    old = hf.from_pretrained(tmp_path / "m")
    assert type(old) is hf.NSAQwen2ForCausalLM and old.config.nsa == model.config.nsa
    with torch.no_grad():
        assert torch.equal(old(X).logits, logits)


def test_from_pretrained_names_what_is_wrong_in_one_line(tmp_path):
    _, _ = saved("llama", tmp_path / "m")
    (tmp_path / "empty").mkdir()
    cases = [(tmp_path / "mm", rf"^{tmp_path / 'mm'}: no such folder; hf\.from_pretrained loads a folder written by "
                               r"save_pretrained$"),
             (tmp_path / "empty", rf"^{tmp_path / 'empty'}: no config\.json \(a folder written by save_pretrained\)$")]
    for path, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            hf.from_pretrained(path)
    (tmp_path / "m" / "model.safetensors").rename(tmp_path / "m" / "other.bin")
    with pytest.raises(OSError):
        hf.from_pretrained(tmp_path / "m")


def test_use_backend_sets_every_layer_and_refuses_a_bad_value(tmp_path):
    saved("llama", tmp_path / "m")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    layers = [m for m in model.modules() if isinstance(m, hf.NSASelfAttention)]
    assert {(m.nsa.backend, m.decode) for m in layers} == {("reference", "auto")}
    hf.use_backend(model, "triton", decode="step")
    assert {(m.nsa.backend, m.decode) for m in layers} == {("triton", "step")}
    with pytest.raises(ValueError, match=r"^use_backend: decode='fast': one of "):
        hf.use_backend(model, decode="fast")
    with pytest.raises(ValueError, match=r"^use_backend: LlamaForCausalLM has no NSA layers"):
        hf.use_backend(ARCHS["llama"]())
