"""``lm=hf``: a Hugging Face transformers model trained by the loop (the ``[hf]`` extra; ``conf/lm/hf.yaml``).

``lm.hf.arch`` (llama, qwen2, mistral) is built at random init, offline, at the lm node's shape: ``dim`` is its
hidden_size, ``mlp_hidden`` its intermediate_size, ``n_layers``, and from ``lm.nsa`` its heads, key/value heads,
head_dim (``d_k`` = ``d_v``) and rope_theta (``rope_base``); its head is tied to the embedding, as the loop's own
model's is. ``lm.hf.path``: a local folder instead, its ``config.json`` (random init) and, if it holds them, its
safetensors weights (``save_pretrained``'s; a converted model's through ``nsa.integrations.hf.from_pretrained``);
its architecture and shape must be the lm node's (checked, so flops and the run's params describe it).
``attention=nsa`` converts it (:func:`nsa.integrations.hf.convert`, the rest of ``lm.nsa`` as the NSA settings,
backend and fallback the run's); ``attention=dense`` trains it as transformers has it (SDPA). :class:`HFLM` gives
the loop the interface of :class:`experiments.lm.model.LM`.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

ARCHS = ("llama", "qwen2", "mistral")
SHAPE_FIELDS = ("n_heads", "n_kv_heads", "d_k", "d_v", "rope_base")  # lm.nsa fields the transformers config takes


def check(lm, attention: str, selection: str = "topn", vocab_size: int | None = None) -> None:
    """A one-line ValueError naming the key when ``lm=hf`` cannot run this configuration (``vocab_size``: the
    task's, which a model from ``lm.hf.path`` must hold)."""
    node = lm.hf
    if not isinstance(node, dict) or not {"arch"} <= set(node) <= {"arch", "path"}:
        raise ValueError(f"lm.hf={node!r}: must be {{arch: one of {', '.join(ARCHS)}, path: null or a local folder}}")
    if node["arch"] not in ARCHS:
        raise ValueError(f"lm.hf.arch={node['arch']!r}: must be one of {', '.join(ARCHS)}")
    nsa = dict(lm.nsa)
    if nsa.get("d_k") != nsa.get("d_v"):
        raise ValueError(f"lm.nsa.d_v={nsa.get('d_v')!r}: lm=hf has one head_dim, d_v = d_k = {nsa.get('d_k')!r}")
    for key in ("qkv_bias", "o_bias"):
        if key in nsa:
            raise ValueError(f"lm.nsa.{key}: lm=hf takes the projection biases from the architecture")
    if attention not in ("nsa", "dense"):
        raise ValueError(f"attention.kind={attention!r}: lm=hf trains nsa or dense")
    if selection != "topn":
        raise ValueError(f"train.ablation.selection={selection!r}: lm=hf runs the paper's top-n selection only")
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ValueError(f"lm=hf: needs the [hf] extra (pip install -e \".[hf]\"): {e}") from e
    if node.get("path") is not None:
        _check_folder(lm, Path(node["path"]), attention, vocab_size)


def _check_folder(lm, path: Path, attention: str, vocab_size: int | None) -> None:
    import transformers

    from nsa.integrations import hf  # registers the NSA model types (nsa_llama, ...) with AutoConfig

    if not (path / "config.json").is_file():
        raise ValueError(f"lm.hf.path={str(path)!r}: no config.json there (a save_pretrained folder or a config)")
    c, done = hf.dense_config(transformers.AutoConfig.from_pretrained(path))  # done: a converted model's settings
    if c.model_type != lm.hf["arch"]:
        raise ValueError(f"lm.hf.arch={lm.hf['arch']!r}: the model at lm.hf.path is {c.model_type!r}")
    want = hf_config(lm, getattr(c, "vocab_size", 0))
    wrong = []  # every setting the folder disagrees with, named at once
    for key, field in (("dim", "hidden_size"), ("mlp_hidden", "intermediate_size"), ("n_layers", "num_hidden_layers"),
                       ("nsa.n_heads", "num_attention_heads"), ("nsa.n_kv_heads", "num_key_value_heads"),
                       ("nsa.d_k", "head_dim")):
        got = getattr(c, field, None) if field != "head_dim" else (
            getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
        if got != getattr(want, field):
            wrong.append(f"lm.{key}={getattr(want, field)!r} (it has {field}={got!r})")
    theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta")
    if theta != want.rope_parameters["rope_theta"]:
        wrong.append(f"lm.nsa.rope_base={want.rope_parameters['rope_theta']!r} (it has rope_theta={theta!r})")
    if done is not None and attention == "nsa":
        from nsa import NSAConfig

        mine = lm.attention_config().to_dict()
        theirs = NSAConfig(**{**mine, **done}).to_dict()  # the same normal form (gate_bias a tuple)
        wrong += [f"lm.nsa.{key}={mine[key]!r} (it has {key}={theirs[key]!r})" for key in done if theirs[key] != mine[key]]
    if wrong:
        raise ValueError(f"lm.hf.path: the model there differs from this config in {len(wrong)} setting"
                         f"{'s' if len(wrong) > 1 else ''}: {'; '.join(wrong)}; set them to the folder's values")
    if vocab_size is not None and c.vocab_size < vocab_size:
        raise ValueError(f"lm.hf.path: the model's vocab_size={c.vocab_size} is smaller than the task's {vocab_size}")
    if done is not None and attention != "nsa":
        raise ValueError(f"attention.kind={attention!r}: the model at lm.hf.path is NSA already (converted)")


def hf_config(lm, vocab_size: int):
    """The transformers config of ``lm.hf.arch`` at the lm node's shape."""
    import transformers

    a = lm.attention_config()
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[lm.hf["arch"]]
    extra = {"sliding_window": None} if lm.hf["arch"] == "mistral" else {}  # full causal attention: what NSA replaces
    return cls(**extra, hidden_size=lm.dim, intermediate_size=lm.mlp_hidden, num_hidden_layers=lm.n_layers,
               num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads, head_dim=a.d_k,
               vocab_size=vocab_size, tie_word_embeddings=True,
               rope_parameters={"rope_type": "default", "rope_theta": a.rope_base})


class HFLM(nn.Module):
    """``forward(idx [B,T], sources=None) -> logits [B,T,vocab]`` of a transformers causal LM (``.hf``), NSA or
    dense; ``nsa_layers()`` its NSA layers (the probes' hooks), ``cfg`` / ``attention`` as LM's."""

    def __init__(self, lm, vocab_size: int, attention: str, *, backend="reference", fallback=None, streams=True,
                 selection: str = "topn"):
        super().__init__()
        check(lm, attention, selection)
        import transformers

        from nsa.integrations import hf

        self.cfg, self.attention, self.selection = lm, attention, "topn"
        path = Path(lm.hf["path"]) if lm.hf.get("path") is not None else None
        config = hf_config(lm, vocab_size) if path is None else transformers.AutoConfig.from_pretrained(path)
        weights = path is not None and any((path / f).exists() for f in ("model.safetensors",
                                                                          "model.safetensors.index.json"))
        meta = torch.empty(0).device.type == "meta"  # loop.parameter_counts: the shapes alone, no weights to load
        if weights and not meta and getattr(config, "nsa", None) is not None:
            self.hf = hf.from_pretrained(path, backend=backend, fallback=fallback, streams=streams)
        elif weights and not meta:
            self.hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
        else:
            self.hf = transformers.AutoModelForCausalLM.from_config(hf.dense_config(config)[0], attn_implementation="sdpa")
        self.hf.float()  # the loop's weights are float32 (bfloat16 runs under autocast)
        if attention == "nsa" and not self.nsa_layers():
            settings = {k: v for k, v in dict(lm.nsa).items() if k in hf.SETTINGS}
            hf.convert(self.hf, backend=backend, fallback=fallback, streams=streams, **settings)
        # cost.step_flops counts a tied head as emb.weight's product; here the head is lm_head, an nn.Linear the
        # count already takes, so that term is empty
        self.emb = SimpleNamespace(weight=torch.empty(0))

    def forward(self, idx, sources=None):
        return self.hf(input_ids=idx, use_cache=False).logits

    def nsa_layers(self):
        from nsa.integrations.hf import NSASelfAttention

        return [layer.self_attn.nsa for layer in self.hf.base_model.layers
                if isinstance(layer.self_attn, NSASelfAttention)]
