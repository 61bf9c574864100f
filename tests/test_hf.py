"""nsa.integrations.hf: a tiny random Llama, Qwen2 and Mistral, converted in float64 on the reference backend,
equal NSAAttention run layer by layer; generate() with NSA's cache equals recomputing the whole sequence; the
save_pretrained / from_pretrained round trip; every NSA parameter learns; what cannot convert is refused."""
from __future__ import annotations

import copy
import subprocess
import sys

import entrypoints
import pytest
import torch

transformers = pytest.importorskip("transformers")  # the [hf] extra; CI installs it

from nsa import NSAAttention, NSAConfig  # noqa: E402
from nsa.integrations import hf, hf_cache  # noqa: E402

F64 = torch.float64
# T = 40..64 below: 5-8 selection blocks for n_sel = 3 (the top-n chooses), past the window of 16, and a
# compressed token every 4 positions from 7 on.
SETTINGS = dict(l=8, d=4, l_sel=8, n_sel=3, w=16, n_init=1, n_local=1, gate_hidden=8)
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=101)
ARCHS = {  # Qwen2 has q/k/v biases and here a head tied to the embedding; Llama biased everywhere, Mistral none
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SHAPE, attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**SHAPE, sliding_window=None)),
}


def dense(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    return ARCHS[arch]().to(F64).eval()


def converted(arch: str, seed: int = 0, **settings):
    m = dense(arch, seed)
    return hf.convert(m, **{**SETTINGS, **settings})


def ids(B=2, T=40, seed=1):
    return torch.randint(0, SHAPE["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


def nsa_params(model) -> dict:
    return {n: p for n, p in model.named_parameters() if ".self_attn.nsa." in n}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_convert_reuses_the_dense_weights_and_equals_nsa_layer_by_layer(arch):
    src = dense(arch)
    model = hf.convert(copy.deepcopy(src), **SETTINGS)
    x = ids(T=64)
    with torch.no_grad():
        got = model(x).logits
        want_dense = src(x).logits
    # the reference: the model's own embedding, norms and MLPs around an NSAAttention per layer built here from
    # the dense layer's q/k/v/o (each branch's k/v from the dense k/v) and the converted layer's phi and gates
    c = src.config
    theta = c.rope_parameters["rope_theta"]
    biased = src.model.layers[0].self_attn.q_proj.bias is not None
    o_biased = src.model.layers[0].self_attn.o_proj.bias is not None
    cfg = NSAConfig(dim=64, n_heads=4, n_kv_heads=2, d_k=16, d_v=16, rope_base=theta, qkv_bias=biased,
                    o_bias=o_biased, **SETTINGS)
    assert model.config.nsa == {k: v for k, v in cfg.to_dict().items() if k in hf.SETTINGS}
    with torch.no_grad():
        h = src.model.embed_tokens(x)
        for dl, new in zip(src.model.layers, model.model.layers):
            ref = NSAAttention(cfg).to(F64)
            a = dl.self_attn
            state = {k: v for k, v in new.self_attn.nsa.state_dict().items() if k.startswith(("phi_", "gate."))}
            for name, mod in [("q_proj", a.q_proj), ("o_proj", a.o_proj)] + [
                    (f"kv_proj.{k}_{b}", getattr(a, f"{k}_proj")) for k in "kv" for b in ("cmp", "sel", "win")]:
                state[f"{name}.weight"] = mod.weight
                if mod.bias is not None:
                    state[f"{name}.bias"] = mod.bias
            ref.load_state_dict(state, strict=True)
            h = h + ref(dl.input_layernorm(h))
            h = h + dl.mlp(dl.post_attention_layernorm(h))
        want = src.lm_head(src.model.norm(h))
    assert (got - want).abs().max().item() <= 1e-9
    assert (got - want_dense).abs().max().item() > 1e-3  # the attention did change
    layer = model.model.layers[1].self_attn.nsa
    assert torch.equal(layer.kv_proj["k_win"].weight, src.model.layers[1].self_attn.k_proj.weight)
    assert (layer.q_proj.bias is not None) == biased and (layer.o_proj.bias is not None) == o_biased


@pytest.mark.parametrize("arch", list(ARCHS))
def test_generate_with_nsa_cache_equals_recomputation(arch, monkeypatch):
    """generate() with the cache: the prompt is each layer's cached prefill, every new token a cached decode step
    on NSACache (grown on the way, copied into one twice as long: capacity in steps of 16 here); without it, the whole sequence
    is recomputed at every step. NSA rotates with its own float64 RoPE, so transformers' float32 RoPE is on
    neither path: the two differ by float64 summation order at most (0.0 measured here), hence 1e-12."""
    monkeypatch.setattr(hf_cache, "_GROW", 16)
    calls = []
    append = hf.NSACacheLayer.append
    monkeypatch.setattr(hf.NSACacheLayer, "append",
                        lambda self, layer, x, *a: calls.append(x.shape[1]) or append(self, layer, x, *a))
    model = converted(arch)
    prompt, new = ids(T=40), 24
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new, do_sample=False,
              output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        cached = model.generate(prompt, **kw)
        assert calls == [40, 40] + [1, 1] * (new - 1)  # two layers: the prompt, then one token per step
        calls.clear()
        full = model.generate(prompt, use_cache=False, **kw)
        assert calls == []
    assert cached.sequences.shape == (2, 40 + new)
    assert torch.equal(cached.sequences, full.sequences)
    for a, b in zip(cached.logits, full.logits):
        assert (a - b).abs().max().item() <= 1e-12
    past = getattr(cached, "cache", None) or cached.past_key_values  # transformers 5.24 renamed it
    layer = past.layers[0]
    assert isinstance(layer, hf.NSACacheLayer) and layer.nsa_cache.length == 40 + new - 1
    assert layer.nsa_cache.max_len == 96  # the prompt's 48 (40 in steps of 16), doubled at token 49


def test_cache_crop_and_beam_reorder():
    """Assisted decoding crops the cache, beam search reorders its rows: the next step equals prefill."""
    model = converted("llama")
    x = ids(B=3, T=30)
    with torch.no_grad():
        want = model(x).logits
        cache = transformers.DynamicCache(config=model.config)
        model(x[:, :28], past_key_values=cache, use_cache=True)
        cache.crop(-3)  # back to 25 tokens
        assert cache.get_seq_length() == 25
        perm = torch.tensor([2, 0, 1])
        cache.reorder_cache(perm)
        got = model(x[perm, 25:30], past_key_values=cache, use_cache=True).logits
    assert (got - want[perm, 25:30]).abs().max().item() <= 1e-12


@pytest.mark.parametrize("arch", list(ARCHS))
def test_save_pretrained_from_pretrained_round_trip(arch, tmp_path):
    model = converted(arch, phi_init="mean", gate_bias=[1.0, 0.5, -0.5])
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    back = hf.from_pretrained(tmp_path)
    assert back.config.nsa == model.config.nsa and back.config.nsa["gate_bias"] == [1.0, 0.5, -0.5]
    assert isinstance(back.model.layers[0].self_attn, hf.NSASelfAttention)
    assert back.dtype == F64 and not back.training
    x = ids(T=48)
    with torch.no_grad():
        assert torch.equal(back(x).logits, model(x).logits)
    b, a = dict(back.named_parameters()), dict(model.named_parameters())
    assert b.keys() == a.keys() and all(torch.equal(b[k], a[k]) for k in a)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_nsa_parameter_gets_a_gradient(arch):
    """As trained: model(ids, labels=ids).loss.backward(), without a cache and with transformers' default
    use_cache (a cache filled on the way: the cached prefill), which gives the same gradients."""
    grads = {}
    for use_cache in (False, None):
        model = converted(arch).train()
        x = ids(T=48)
        model(x, labels=x, use_cache=use_cache).loss.backward()
        grads[use_cache] = {n: p.grad for n, p in nsa_params(model).items()}
    kinds = {n.split(".self_attn.nsa.")[1].split(".")[0] for n in grads[False]}
    assert {"q_proj", "o_proj", "kv_proj", "phi_k", "phi_v", "gate"} <= kinds
    assert not [n for n, g in grads[False].items() if g is None or not g.abs().sum() > 0]
    assert all((grads[None][n] - g).abs().max().item() <= 1e-12 for n, g in grads[False].items())


def test_refusals_are_one_line_naming_the_cause():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    cases = [
        (lambda: hf.convert(gpt2), r"^convert: architecture 'gpt2' \(GPT2LMHeadModel\) is not supported"),
        (lambda: hf.convert(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **SHAPE, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}))),
         r"^convert: rope_type='linear' \(llama\)"),
        (lambda: hf.convert(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}))),
         r"^convert: partial_rotary_factor=0.5"),
        (lambda: hf.convert(dense("llama"), n_heads=8), r"^convert: n_heads is the model's \(n_heads=4"),
        (lambda: hf.convert(dense("llama"), window=8), r"^convert: unknown NSA setting 'window'"),
        (lambda: hf.convert(dense("llama"), n_sel=1), r"^NSAConfig\.n_sel=1"),
        (lambda: hf.convert(converted("llama")), r"^convert: the model's attention is NSA already"),
    ]
    for call, pattern in cases:
        with pytest.raises(ValueError, match=pattern) as e:
            call()
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("arch, windowed, fix", [
    ("mistral", dict(sliding_window=24), dict(sliding_window=None)),  # MistralConfig's default: 4096
    ("qwen2", dict(use_sliding_window=True, sliding_window=24, max_window_layers=1, num_hidden_layers=3),
     dict(layer_types=["full_attention"] * 3))])
def test_a_sliding_window_model_is_refused_and_the_named_keyword_converts_it(arch, windowed, fix, tmp_path):
    """NSA replaces full causal attention: a model whose dense attention is a sliding window (every layer of a
    Mistral with sliding_window, Qwen2's layers past max_window_layers) is refused in one line naming the
    from_pretrained keyword that loads it as full attention; with that keyword it converts."""
    cls = {"mistral": (transformers.MistralForCausalLM, transformers.MistralConfig),
           "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config)}[arch]
    torch.manual_seed(0)
    cls[0](cls[1](**{**SHAPE, **windowed})).save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError) as e:
        hf.convert(model, **SETTINGS)
    assert "\n" not in str(e.value)
    assert str(e.value).startswith({"mistral": "convert: sliding_window=24 (mistral)",
                                    "qwen2": "convert: layer_types: layers 1, 2 'sliding_attention', sliding_window=24 "
                                             "(qwen2)"}[arch])
    kw = ", ".join(f"{k}={v!r}" if k != "layer_types" else "layer_types=['full_attention'] * 3" for k, v in fix.items())
    assert str(e.value).endswith(f"load it with {kw}")
    assert not any(isinstance(layer.self_attn, hf.NSASelfAttention) for layer in model.model.layers)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, **fix)
    hf.convert(model, **SETTINGS)
    assert all(isinstance(layer.self_attn, hf.NSASelfAttention) for layer in model.model.layers)


def test_masks_and_positions_it_cannot_express_and_dense_checkpoints_are_refused(tmp_path):
    """Padding is taken in a prompt (tests/test_hf_padding.py); what NSA cannot express stops in one line."""
    model = converted("llama")
    x = ids(T=20)
    cases = [
        (dict(attention_mask=torch.ones(2, 1, 20, 20)), r"^attention_mask: an NSA model takes a \[batch, tokens\] mask "
                                                        r"of 0 \(padding\) and 1 \(real token\), got \(2, 1, 20, 20\)"),
        (dict(attention_mask=torch.full_like(x, 2)), r"^attention_mask: an NSA model takes a \[batch, tokens\] mask"),
        (dict(attention_mask=torch.zeros_like(x).index_fill(0, torch.tensor([1]), 1)),
         r"^attention_mask: row 0 masks every token; each row needs at least one real token$"),
        (dict(position_ids=torch.arange(20)[None] + 5),
         r"^position_ids: an NSA model places each row's real tokens at the positions after those cached \(row 0: 0\.\.19\)"),
    ]
    for kw, pattern in cases:
        with pytest.raises(ValueError, match=pattern) as e:
            model(x, **kw)
        assert "\n" not in str(e.value)
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(x[:, :12], past_key_values=cache, use_cache=True)
        mask = torch.ones_like(x)
        mask[0, 14] = 0
        with pytest.raises(ValueError, match=r"^attention_mask: masks some of the 8 new tokens after 12 cached ones; an "
                                             r"NSA model takes padding in the prompt only"):
            model(x[:, 12:], attention_mask=mask, past_key_values=cache, use_cache=True)
    dense("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"config\.json has no 'nsa' settings"):
        hf.from_pretrained(tmp_path)


# ------------------------------------------------------------------------------------------------
# experiments.train lm=hf (experiments/lm/hf.py)

def test_documented_lm_hf_sweep_trains_nsa_and_dense_to_finished(tmp_path):
    """The docs' command as written: a random-init Llama (conf/lm/hf.yaml) on the smoke preset's text, NSA and
    dense, one parent run; both learn (byte-level text: ln 256 = 5.5 at the start, measured 2.9-3.0 at step 60)."""
    cmds = [c for c in entrypoints.documented_commands() if "lm=hf" in c.split()]
    assert cmds == ["python -m experiments.train -m train=smoke lm=hf attention=nsa,dense"]
    args, env = entrypoints.argv(cmds[0])
    p = subprocess.run([sys.executable, *args], cwd=tmp_path, env=entrypoints.env(**env), capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    c, rs = entrypoints.runs(tmp_path / "mlflow.db", "train")
    (parent,) = [r for r in rs if "mlflow.parentRunId" not in r.data.tags]
    kids = {r.data.params["attention"]: r for r in rs if "mlflow.parentRunId" in r.data.tags}
    assert set(kids) == {"nsa", "dense"} and all(r.info.status == "FINISHED" for r in rs)
    for kind, r in kids.items():
        assert r.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert r.data.params["lm"] == "hf" and r.data.params["lm.hf.arch"] == "llama"
        loss = [m.value for m in sorted(c.get_metric_history(r.info.run_id, "loss"), key=lambda m: m.step)]
        assert len(loss) == 60 and sum(loss[:5]) / 5 > 5.0 and sum(loss[-5:]) / 5 < 3.5, (kind, loss[:5], loss[-5:])
        counts = {k.split(".", 1)[1]: int(v) for k, v in r.data.params.items() if k.startswith("n_params.")}
        assert counts["embedding"] == 256 * 64 and counts["total"] == sum(v for k, v in counts.items() if k != "total")
        assert (counts["attn_extra"] > 0) == (kind == "nsa")
    assert "gate_sel" in kids["nsa"].data.metrics and "0_sel_recall" in kids["nsa"].data.metrics
    assert "gate_sel" not in kids["dense"].data.metrics


def test_lm_hf_refuses_what_it_cannot_train(tmp_path):
    """attention=window, or a bad architecture: one line, exit 2, before any run or output."""
    for args, line in [(["attention=window"], "config error: attention.kind='window': lm=hf trains nsa or dense"),
                       (["lm.hf.arch=gpt2"], "config error: lm.hf.arch='gpt2': must be one of llama, qwen2, mistral")]:
        p = subprocess.run([sys.executable, "-m", "experiments.train", "train=smoke", "lm=hf", *args], cwd=tmp_path,
                           env=entrypoints.env(), capture_output=True, text=True, timeout=300)
        assert p.returncode == 2 and entrypoints.one_line(p.stderr) == [line], p.stderr[-2000:]
        assert not (tmp_path / "outputs").exists() and not (tmp_path / "mlflow.db").exists()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """save_pretrained folders of conf/lm/hf.yaml's shape (vocab 300 >= the text task's 256): a dense Llama, its
    config alone, and the model converted with lm.nsa's settings."""
    from omegaconf import OmegaConf

    from experiments.lm.hf import hf_config
    from experiments.lm.model import LMConfig

    node = OmegaConf.to_container(OmegaConf.load(entrypoints.REPO / "conf" / "lm" / "hf.yaml"))
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(3)
    m = transformers.AutoModelForCausalLM.from_config(hf_config(LMConfig(**node), 300))
    m.save_pretrained(root / "dense")
    m.config.save_pretrained(root / "config")
    hf.convert(m, **{k: v for k, v in node["nsa"].items() if k in hf.SETTINGS}).save_pretrained(root / "nsa")
    return root


def _build(*overrides):
    from hydra import compose, initialize_config_dir

    from experiments.lm.config import RunConfig
    from experiments.lm.loop import build_model, parameter_counts
    from experiments.lm.model import count_parameters

    with initialize_config_dir(config_dir=str(entrypoints.REPO / "conf"), version_base="1.3"):
        run = RunConfig.from_conf(compose("train", ["lm=hf", *overrides]))
    model = build_model(run)
    assert parameter_counts(run) == count_parameters(model)  # built on the meta device: from the config alone
    return model


def test_lm_hf_path_starts_from_the_folder(folders):
    """lm.hf.path: the dense checkpoint's weights start both models (NSA's branches from its k/v), a converted
    checkpoint's every weight, a config alone a random init of its shape."""
    from safetensors.torch import load_file

    saved = load_file(folders / "dense" / "model.safetensors")
    nsa, dense = (_build(f"lm.hf.path={folders / 'dense'}", f"attention={a}") for a in ("nsa", "dense"))
    k = saved["model.layers.1.self_attn.k_proj.weight"]
    assert torch.equal(nsa.hf.model.layers[1].self_attn.nsa.kv_proj["k_win"].weight, k)
    assert torch.equal(dense.hf.model.layers[1].self_attn.k_proj.weight, k)
    assert all(p.dtype == torch.float32 for p in nsa.parameters())
    converted = load_file(folders / "nsa" / "model.safetensors")
    got = _build(f"lm.hf.path={folders / 'nsa'}").hf.state_dict()
    assert converted.keys() <= got.keys() and all(torch.equal(got[n], v) for n, v in converted.items())
    fresh = _build(f"lm.hf.path={folders / 'config'}", "attention=dense").hf.model.layers[1].self_attn.k_proj.weight
    assert fresh.shape == k.shape and not torch.equal(fresh, k)


def test_lm_hf_mistral_is_full_attention_for_nsa_and_its_dense_baseline():
    """lm.hf.arch=mistral: MistralConfig's default sliding_window (4096) would window the dense baseline and is
    refused by convert; the experiments build it with full causal attention, what NSA replaces."""
    dense = _build("lm.hf.arch=mistral", "attention=dense").hf
    assert dense.config.sliding_window is None
    nsa = _build("lm.hf.arch=mistral", "attention=nsa").hf
    assert isinstance(nsa.model.layers[0].self_attn, hf.NSASelfAttention)


def test_lm_hf_path_runs_and_refuses_in_one_line(folders, tmp_path):
    run = [sys.executable, "-m", "experiments.train", "train=smoke", "lm=hf", f"lm.hf.path={folders / 'dense'}"]
    p = subprocess.run([*run, "-m", "attention=nsa,dense", "train.steps=3", "train.eval_every=3", "train.ckpt_every=3"],
                       cwd=tmp_path, env=entrypoints.env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    _, rs = entrypoints.runs(tmp_path / "mlflow.db", "train")
    assert len(rs) == 3 and all(r.info.status == "FINISHED" for r in rs)
    (tmp_path / "x").mkdir()  # the refusals below leave nothing in it
    differs = "lm.hf.path: the model there differs from this config in "
    for args, line in [(["lm.n_layers=3"], differs + "1 setting: lm.n_layers=3 (it has num_hidden_layers=2); set them "
                                                     "to the folder's values"),
                       ([f"lm.hf.path={folders / 'nsa'}", "lm.nsa.w=64", "lm.nsa.n_sel=5", "lm.mlp_hidden=64"],
                        differs + "3 settings: lm.mlp_hidden=64 (it has intermediate_size=256); lm.nsa.n_sel=5 (it "
                                  "has n_sel=4); lm.nsa.w=64 (it has w=32); set them to the folder's values"),
                       ([f"lm.hf.path={folders / 'nope'}"],
                        f"lm.hf.path={str(folders / 'nope')!r}: no config.json there (a save_pretrained folder or a config)")]:
        p = subprocess.run([*run, *args], cwd=tmp_path / "x", env=entrypoints.env(), capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 2 and entrypoints.one_line(p.stderr) == ["config error: " + line], p.stderr[-2000:]
        assert not (tmp_path / "x" / "outputs").exists() and not (tmp_path / "x" / "mlflow.db").exists()
