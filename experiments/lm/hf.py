"""``lm=hf``: a Hugging Face transformers model trained by the loop (the ``[hf]`` extra; ``conf/lm/hf.yaml``).

``lm.hf.arch`` (llama, qwen2, mistral) is built at random init, offline, at the lm node's shape: ``dim`` is its
hidden_size, ``mlp_hidden`` its intermediate_size, ``n_layers``, and from ``lm.nsa`` its heads, key/value heads,
head_dim (``d_k`` = ``d_v``) and rope_theta (``rope_base``); its head is tied to the embedding, as the loop's own
model's is. ``attention=nsa`` converts it (:func:`nsa.integrations.hf.convert`, the rest of ``lm.nsa`` as the
NSA settings, backend and fallback the run's); ``attention=dense`` trains it as transformers has it (SDPA).
:class:`HFLM` gives the loop the interface of :class:`experiments.lm.model.LM`.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

ARCHS = ("llama", "qwen2", "mistral")
SHAPE_FIELDS = ("n_heads", "n_kv_heads", "d_k", "d_v", "rope_base")  # lm.nsa fields the transformers config takes


def check(lm, attention: str, selection: str = "topn") -> None:
    """A one-line ValueError naming the key when ``lm=hf`` cannot run this configuration."""
    node = lm.hf
    if not isinstance(node, dict) or set(node) != {"arch"}:
        raise ValueError(f"lm.hf={node!r}: must be {{arch: one of {', '.join(ARCHS)}}}")
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


def hf_config(lm, vocab_size: int):
    """The transformers config of ``lm.hf.arch`` at the lm node's shape."""
    import transformers

    a = lm.attention_config()
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[lm.hf["arch"]]
    return cls(hidden_size=lm.dim, intermediate_size=lm.mlp_hidden, num_hidden_layers=lm.n_layers,
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
        self.hf = transformers.AutoModelForCausalLM.from_config(hf_config(lm, vocab_size), attn_implementation="sdpa")
        if attention == "nsa":
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
