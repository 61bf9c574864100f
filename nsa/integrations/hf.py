"""NSA in a Hugging Face ``transformers`` causal LM: Llama, Qwen2 and Mistral (``pip install -e ".[hf]"``).

    model = nsa.integrations.hf.convert(AutoModelForCausalLM.from_pretrained(path), l=32, d=16, n_sel=16, w=512)
    out = model.generate(ids, max_new_tokens=64)        # NSA's cached decode (NSACache), one per layer
    model.save_pretrained(out_dir)                      # safetensors; config.json records the NSA settings
    model = nsa.integrations.hf.from_pretrained(out_dir)

:func:`convert` puts an :class:`NSASelfAttention` (an :class:`nsa.NSAAttention` behind transformers' call) in
place of every decoder layer's ``self_attn``. Paper Section 3.3.3: the query and output projections are the
dense layer's; each branch's key and value projections (compressed, selected, window) start as copies of the
dense key and value projections (one shared pair with ``shared_kv=True``); phi (Eq. 7) and the gates (Eq. 5)
start as the layer's own init (``phi_init`` / ``gate_bias`` choose another). Heads, GQA groups, head dim,
projection biases and ``rope_theta`` come from the model; NSA rotates queries and keys with its own RoPE
(``nsa.module.rope``, rotate-half, the model's theta), so a RoPE scaling or a partial rotary is refused, and
so is a sliding-window attention (Mistral's ``sliding_window``, Qwen2's sliding layers): NSA replaces full
causal attention, and the refusal names the keyword that loads the model as that.

With a cache (``generate``, or ``model(ids, use_cache=True)``) each layer keeps an :class:`nsa.NSACache` in the
transformers cache's slot for that layer (:class:`NSACacheLayer`, which grows it as tokens arrive): a prompt
is the layer's cached prefill (``NSAAttention.forward(x, cache)``, on the backend given to :func:`convert`), and
every later token its cached decode step, run as ``decode`` says (:data:`DECODE`):

* ``module``: the layer's own cached forward, ``NSAAttention.forward(x_t, cache)`` (the reference path);
* ``step``: :class:`nsa.decode.GraphDecoder`'s eager step, the backend's fused decode kernels (``triton``);
* ``graph``: the same step captured once per layer in a CUDA graph and replayed at every token (GPU);
* ``model_step`` / ``model_graph`` / ``model_compiled``: the whole model's step, each layer's attention its
  ``GraphDecoder`` step, eager / in one CUDA graph / compiled by ``torch.compile`` and then in one CUDA graph
  (:mod:`nsa.integrations.hf_graph`; elsewhere, e.g. the prompt, the model's own forward);
* ``auto`` (the default): ``model_graph`` on a CUDA device where the layer's backend has decode kernels, under
  ``torch.no_grad()`` (as ``generate`` runs), else ``module``. ``NSASelfAttention.decode_ran`` says which ran last.

Without a cache, the whole sequence runs as prefill. A padded batch (``attention_mask`` of 0 at the pads, left
padding as ``generate`` batches prompts, right padding in training) runs each row's real tokens as that row
alone: packed along one sequence (``cu_seqlens``) in the prefill, then a ragged cache whose row b decodes at its
own length; the pads' outputs are zeros.

The model types: ``convert`` gives the model a copy of its config as ``NSALlamaConfig`` (``nsa_llama``;
``nsa_qwen2``, ``nsa_mistral``) and a ``LlamaForCausalLM`` becomes ``NSALlamaForCausalLM`` (its subclass), so
``save_pretrained`` writes that type, and ``AutoModelForCausalLM.from_pretrained(dir)`` loads the NSA model once
this module is imported (it registers the types with the Auto classes; without it transformers refuses the
type), on the reference backend: :func:`use_backend` moves it to another.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import fields
from functools import partial
from pathlib import Path

import torch
from torch import nn
try:
    from transformers import (AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                              MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)
    from transformers.modeling_outputs import CausalLMOutputWithPast
except ImportError as e:  # the [hf] extra is not installed: say which, in one line
    raise ImportError(f"nsa.integrations.hf needs transformers, the hf extra: pip install -e '.[hf]' ({e})") from None

from .. import dispatch
from ..config import NSAConfig
from ..decode import DECODE_PATHS
from ..module import NSAAttention
from .hf_cache import BUFFERS, NSACacheLayer, cache_layer
from .hf_graph import GRAPHED, MODEL_PATHS, ModelStep, layer_step, slots_for, step_key

__all__ = ["ARCHITECTURES", "BUFFERS", "DECODE", "NSACacheLayer", "NSASelfAttention", "SETTINGS", "cache_layer", "convert",
           "dense_config", "from_pretrained", "nsa_config", "use_backend"]
ARCHITECTURES = ("llama", "qwen2", "mistral")  # the dense models' config.model_type
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"  # 5.24 renamed it
# NSAConfig fields the model fixes (convert reads them from it); the others are the NSA settings.
FROM_MODEL = ("dim", "n_heads", "n_kv_heads", "d_k", "d_v", "rope_base", "qkv_bias", "o_bias")
SETTINGS = tuple(f.name for f in fields(NSAConfig) if f.name not in FROM_MODEL)
DECODE = ("auto", *MODEL_PATHS, *DECODE_PATHS[1:])  # how a model runs each new token (the module docstring)
# a layer's own path where the model's step does not apply
LAYER_PATH = {"model_graph": "graph", "model_compiled": "graph", "model_step": "step"}


def fused_decode(backend, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``backend`` (a layer's: a name or ``{branch: name}``) has fused decode kernels that run every branch
    on ``device`` in ``dtype`` (what :class:`nsa.decode.GraphDecoder` needs)."""
    names = set(dispatch.resolve(backend).values())
    if len(names) != 1:
        return False
    try:
        be = dispatch.get(names.pop())
    except dispatch.BackendUnavailable:
        return False
    return (type(be).decode_kernels is not dispatch.Backend.decode_kernels
            and all(be.unavailable(b, device, dtype) is None for b in dispatch.BRANCHES))


class Batch:
    """What the base model's forward pre-hook read from transformers' call for its NSA layers: ``real``, which of
    the call's tokens are real ([B,T] bool, from a 2D ``attention_mask``; None where every one is)."""

    real: torch.Tensor | None = None


class NSASelfAttention(nn.Module):
    """A decoder layer's ``self_attn``: transformers' call in, :class:`nsa.NSAAttention` (``.nsa``) run, with the
    layer's :class:`NSACacheLayer` when a cache is passed. Returns ``(output, None)``: no attention weights.

    A padded batch (``batch.real``, set by the model's pre-hook from ``attention_mask``): each row's real tokens
    are packed into one sequence per row (``cu_seqlens``) and run as if that row were alone; the masked tokens'
    outputs are zeros. With a cache, that is the prompt (its slot empty), filling a ragged cache whose row b
    continues at its own length."""

    def __init__(self, config: NSAConfig, layer_idx: int, *, backend="reference", fallback=None, streams=True,
                 decode: str = "auto", batch: Batch | None = None):
        super().__init__()
        if decode not in DECODE:
            raise ValueError(f"decode={decode!r}: one of {', '.join(DECODE)}")
        self.layer_idx, self.decode, self.batch = layer_idx, decode, batch or Batch()
        self.decode_ran: str | None = None  # how the last single cached token ran (DECODE's names; None: none yet)
        self.graph_step = None  # set by hf_graph.ModelStep while it runs the model: this layer's GraphDecoder
        self._fused: dict = {}  # (backend, device, dtype) -> fused_decode's answer, asked once, not per token
        self.nsa = NSAAttention(config, backend=backend, fallback=fallback, streams=streams)

    def decode_path(self, x: torch.Tensor) -> str:
        """How a single cached token ``x`` runs: ``decode`` with ``auto`` resolved (the module docstring)."""
        if self.decode != "auto":
            return LAYER_PATH.get(self.decode, self.decode)
        if x.device.type != "cuda" or torch.is_grad_enabled():  # the decoder's step records no gradient
            return "module"
        return self.fused_path(x.device, x.dtype)

    def fused_path(self, device: torch.device, dtype: torch.dtype) -> str:
        """``graph`` where the backend has fused decode kernels for ``device`` and ``dtype`` (asked once), else
        ``module``."""
        key = (repr(self.nsa.backend), device, dtype)
        if key not in self._fused:
            self._fused[key] = fused_decode(self.nsa.backend, device, dtype)
        return "graph" if self._fused[key] else "module"

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                cache=None, **kwargs):
        """transformers' attention call: ``(NSA's output, None)``; with a cache, the tokens are appended to this
        layer's :class:`NSACacheLayer` and attend to those before them."""
        if self.graph_step is not None:
            return layer_step(self.graph_step, hidden_states), None
        kv = cache if cache is not None else past_key_values  # transformers 5.24 renamed it `cache`
        if self.batch.real is not None:
            return self._padded(hidden_states, kv), None
        if kv is None:
            return self.nsa(hidden_states), None
        slot = cache_layer(kv, self.layer_idx)
        if hidden_states.shape[1] != 1 or slot.get_seq_length() == 0:
            return slot.append(self.nsa, hidden_states), None
        path = self.decode_path(hidden_states)
        if path != "module" and torch.is_grad_enabled():
            raise ValueError(f"decode={path!r}: GraphDecoder's step records no gradient; run under torch.no_grad() "
                             "(generate does) or convert with decode='module'")
        self.decode_ran = path
        return slot.append(self.nsa, hidden_states, path), None

    def _padded(self, x: torch.Tensor, kv) -> torch.Tensor:
        """x [B,T,dim] of which ``batch.real`` marks the real tokens: each row's packed and run alone."""
        real = self.batch.real
        B, T, dim = x.shape
        at = real.reshape(-1).nonzero().squeeze(1)
        cu = torch.zeros(B + 1, dtype=torch.int32, device=x.device)
        cu[1:] = real.sum(1).cumsum(0)
        packed = x.reshape(B * T, dim).index_select(0, at)[None]
        if kv is None:
            y = self.nsa(packed, cu_seqlens=cu)
        else:
            y = cache_layer(kv, self.layer_idx).prefill_rows(self.nsa, packed, cu, B)
        return x.new_zeros(B * T, dim).index_copy(0, at, y[0]).reshape(B, T, dim)


def _model_fields(model) -> tuple[str, dict]:
    """The architecture and what the NSA layers take from the model (FROM_MODEL); a one-line ValueError if
    NSA cannot express its attention."""
    cfg = model.config
    arch = getattr(cfg, "model_type", None)
    arch = arch.removeprefix("nsa_") if isinstance(cfg, tuple(CONFIGS.values())) else arch
    if arch not in ARCHITECTURES:
        raise ValueError(f"convert: architecture {arch!r} ({type(model).__name__}) is not supported; "
                         f"supported: {', '.join(ARCHITECTURES)}")
    rp = getattr(cfg, "rope_parameters", None) or {}
    if "rope_theta" not in rp:
        raise ValueError(f"convert: rope_parameters={rp!r} ({arch}): NSA needs one plain RoPE (rope_type default "
                         "and rope_theta) for every layer")
    if rp.get("rope_type", "default") != "default":
        raise ValueError(f"convert: rope_type={rp['rope_type']!r} ({arch}): NSA rotates with plain RoPE (rope_type "
                         "'default'); it cannot express this scaling")
    partial = rp.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"convert: partial_rotary_factor={partial!r} ({arch}): NSA rotates every dim of the head")
    if getattr(cfg, "attention_dropout", 0.0):
        raise ValueError(f"convert: attention_dropout={cfg.attention_dropout!r} ({arch}): NSA has no attention "
                         "dropout; set it to 0")
    windowed = _sliding_layers(cfg)
    if windowed:
        raise ValueError(f"convert: {windowed} ({arch}): a sliding-window attention, and NSA replaces full causal "
                         "attention (its window is one branch of three); to take the model's attention as full "
                         f"attention, load it with {_full_attention_fix(cfg)}")
    attn = _decoder_layers(model)[0].self_attn
    if isinstance(attn, NSASelfAttention):
        raise ValueError(f"convert: the model's attention is NSA already ({arch})")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return arch, dict(dim=cfg.hidden_size, n_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_key_value_heads,
                      d_k=head_dim, d_v=head_dim, rope_base=float(rp["rope_theta"]),
                      qkv_bias=attn.q_proj.bias is not None, o_bias=attn.o_proj.bias is not None)


def _sliding_layers(cfg) -> str | None:
    """What makes the model's dense attention a sliding window (transformers' ``layer_types`` naming a layer
    other than ``full_attention``, or, without them, a ``sliding_window`` set, as Mistral's); None where
    every layer attends to the whole causal prefix."""
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        other = [i for i, t in enumerate(types) if t != "full_attention"]
        return (f"layer_types: layer{'s' if len(other) > 1 else ''} {', '.join(map(str, other))} "
                f"{types[other[0]]!r}, sliding_window={getattr(cfg, 'sliding_window', None)}") if other else None
    w = getattr(cfg, "sliding_window", None)
    return f"sliding_window={w}" if w is not None else None


def _full_attention_fix(cfg) -> str:
    """The from_pretrained keyword that makes every layer of ``cfg`` full causal attention."""
    if getattr(cfg, "layer_types", None) is not None:
        return f"layer_types=['full_attention'] * {len(cfg.layer_types)}"
    return "sliding_window=None"


def _decoder_layers(model):
    return model.base_model.layers


def nsa_config(model, **settings) -> NSAConfig:
    """The NSAConfig :func:`convert` gives ``model``'s layers: its heads, dims, biases and rope_theta, and the
    NSA settings (NSAConfig's other fields; the rest at their defaults)."""
    arch, derived = _model_fields(model)
    for key in settings:
        if key in FROM_MODEL:
            raise ValueError(f"convert: {key} is the model's ({key}={derived[key]!r} from its config); it is not an "
                             "NSA setting")
        if key not in SETTINGS:
            raise ValueError(f"convert: unknown NSA setting {key!r}; the settings: {', '.join(SETTINGS)}")
    cfg = NSAConfig(**derived, **settings)
    if cfg.rope_rule():
        raise ValueError(f"convert: head_dim={cfg.d_k} ({arch}): {cfg.rope_rule()}")
    return cfg


def _cached_rows(cache) -> torch.Tensor | None:
    """Tokens each row of ``cache`` (a transformers Cache) holds in its NSA slots: int64 [B], or None (empty)."""
    for slot in getattr(cache, "layers", None) or ():
        if isinstance(slot, NSACacheLayer) and slot.nsa_cache is not None and slot.nsa_cache.length:
            return slot.nsa_cache.lengths
    return None


def _read_batch(batch: Batch, module, args, kwargs):
    """A forward pre-hook on the converted base model: which of the call's tokens are real (``attention_mask``,
    [B, past + T] of 0/1, as transformers pads a batch), into ``batch`` for the NSA layers. NSA places row b's
    real tokens at positions past_b, past_b + 1, ... with its own RoPE, so ``position_ids`` other than those,
    or a mask it cannot express, stop here in one line."""
    batch.real = None
    x = kwargs.get("input_ids", args[0] if args else None)
    x = x if x is not None else kwargs.get("inputs_embeds")
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if x is None:
        return
    B, T = x.shape[:2]
    past = _cached_rows(cache) if cache is not None else None
    real = None
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != B or mask.shape[1] < T \
                or not bool(((mask == 0) | (mask == 1)).all()):
            shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"attention_mask: an NSA model takes a [batch, tokens] mask of 0 (padding) and 1 (real "
                             f"token), got {shape}; it builds its own causal masks")
        new = mask[:, -T:].bool()
        if not bool(new.all()):
            if past is not None:
                raise ValueError(f"attention_mask: masks some of the {T} new tokens after {int(past.max())} cached "
                                 "ones; an NSA model takes padding in the prompt only (the tokens filling an empty "
                                 "cache)")
            if not bool(new.any(1).all()):
                raise ValueError(f"attention_mask: row {int((~new.any(1)).nonzero()[0])} masks every token; each row "
                                 "needs at least one real token")
            real = new
    pos = kwargs.get("position_ids")
    if isinstance(pos, torch.Tensor):
        start = (past if past is not None else torch.zeros(B, dtype=torch.int64)).to(pos.device)
        ones = real if real is not None else torch.ones(B, T, dtype=torch.bool, device=pos.device)
        want = start[:, None] + ones.long().cumsum(1) - 1
        if not bool((pos.expand(B, T) == want)[ones].all()):
            first = f"{int(start[0])}..{int(start[0]) + int(ones[0].sum()) - 1}"
            raise ValueError(f"position_ids: an NSA model places each row's real tokens at the positions after those "
                             f"cached (row 0: {first}); packed sequences or other positions are not supported")
    batch.real = real


def _clear_batch(batch: Batch, module, args, kwargs, output):
    batch.real = None


def convert(model, *, backend="reference", fallback=None, streams=True, decode="auto", **settings):
    """``model`` (a transformers Llama, Qwen2 or Mistral causal LM, or its base model) with every decoder
    layer's self-attention replaced by NSA, in place, and returned.

    Arguments:
        model: the transformers model; its dense weights start the NSA layers (see the module docstring).
        backend, fallback, streams: as :class:`nsa.NSAAttention`'s (``reference`` on a CPU; ``triton`` on a GPU).
        decode: how a cached layer runs each generated token (:data:`DECODE`, the module docstring; ``auto``: a
            CUDA graph of the fused decode kernels on a GPU backend that has them, else the layer's own forward).
        settings: NSAConfig fields other than those the model fixes (``l``, ``d``, ``l_sel``, ``n_sel``,
            ``w``, ``n_init``, ``n_local``, ``phi``, ``gate_hidden``, ``phi_hidden``, ``gate_bias``,
            ``shared_kv``, ``phi_init``); the rest at NSAConfig's defaults.
    Returns:
        the same model object; ``model.config.nsa`` holds the settings, which ``save_pretrained`` writes and
        :func:`from_pretrained` reads.
    """
    return _convert(model, settings, backend, fallback, streams, decode, copy_weights=True)


def _convert(model, settings, backend, fallback, streams=True, decode="auto", *, copy_weights: bool):
    if decode not in DECODE:
        raise ValueError(f"convert: decode={decode!r}: one of {', '.join(DECODE)}")
    cfg = nsa_config(model, **settings)
    batch = Batch()
    for i, layer in enumerate(_decoder_layers(model)):
        dense = layer.self_attn
        ref = dense.q_proj.weight
        new = NSASelfAttention(cfg, i, backend=backend, fallback=fallback, streams=streams, decode=decode,
                               batch=batch).to(device=ref.device, dtype=ref.dtype)
        if copy_weights:
            m = new.nsa
            pairs = [(m.q_proj, dense.q_proj), (m.o_proj, dense.o_proj)]
            pairs += [(m.kv_proj[f"{kind}_{branch}"], getattr(dense, f"{kind}_proj"))
                      for branch in ("cmp", "sel", "win") for kind in ("k", "v")]
            with torch.no_grad():
                for dst, src in pairs:
                    dst.weight.copy_(src.weight)
                    if src.bias is not None:
                        dst.bias.copy_(src.bias)
        layer.self_attn = new
    recorded = {k: v for k, v in cfg.to_dict().items() if k in SETTINGS}
    if recorded["gate_bias"] is not None:
        recorded["gate_bias"] = list(recorded["gate_bias"])
    if not isinstance(model.config, tuple(CONFIGS.values())):
        _retype(model)
    model.config.nsa = recorded
    # transformers builds no attention masks for an implementation it does not know: NSA has its own
    model.config._attn_implementation = "nsa"
    model.base_model.register_forward_pre_hook(partial(_read_batch, batch), with_kwargs=True)
    model.base_model.register_forward_hook(partial(_clear_batch, batch), with_kwargs=True, always_call=True)
    return model


def _retype(model) -> None:
    """``model`` onto the NSA model type: a copy of its config as the architecture's NSA config (``nsa_llama``,
    ...; the caller's config object is left as it was), given to every module that held the old one, and a
    ``LlamaForCausalLM`` (Qwen2's, Mistral's) becomes the NSA subclass, which ``save_pretrained`` names."""
    old = model.config
    new = _as(old, CONFIGS[old.model_type])
    for m in model.modules():
        if getattr(m, "config", None) is old:
            m.config = new
    dense_cls, nsa_cls = MODELS[old.model_type]
    if type(model) is dense_cls:
        model.__class__ = nsa_cls


class NSALlamaConfig(LlamaConfig):
    """A Llama whose attention is NSA: ``nsa`` holds the NSA settings (:data:`SETTINGS`)."""
    model_type = "nsa_llama"
    nsa: dict | None = None


class NSAQwen2Config(Qwen2Config):
    """A Qwen2 whose attention is NSA: ``nsa`` holds the NSA settings (:data:`SETTINGS`)."""
    model_type = "nsa_qwen2"
    nsa: dict | None = None


class NSAMistralConfig(MistralConfig):
    """A Mistral whose attention is NSA: ``nsa`` holds the NSA settings (:data:`SETTINGS`)."""
    model_type = "nsa_mistral"
    nsa: dict | None = None


class _NSAModel:
    """The dense causal LM built from the config, then every layer's attention replaced by NSA with the
    config's settings (random init; ``from_pretrained`` then loads the saved weights into it)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if not isinstance(getattr(config, "nsa", None), dict):
            raise ValueError(f"{type(config).__name__}.nsa: must be a dict of NSA settings, got {config.nsa!r}")
        _convert(self, dict(config.nsa), "reference", None, copy_weights=False)


def _forward(dense_cls):
    """``dense_cls.forward``, or, for a decode token where it applies, the whole model's step
    (:mod:`nsa.integrations.hf_graph`: ``decode`` model_graph / model_compiled / model_step, or auto on a CUDA
    device whose backend has fused decode kernels). It keeps the dense forward's signature, which ``generate``
    reads to choose what it passes (the attention mask among them)."""

    @functools.wraps(dense_cls.forward)
    def forward(self, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        ids = args[0] if args else kwargs.get("input_ids")
        path, slots = (None, None) if len(args) > 1 else _model_path(self, ids, cache, kwargs)
        if path is None:
            return dense_cls.forward(self, *args, **kwargs)
        step = getattr(cache, "_nsa_model_step", None)
        graph, compiled = path in GRAPHED, path == "model_compiled"
        if step is None or step.model is not self or step.key != step_key(slots) or (step.graph, step.compiled) != \
                (graph, compiled):
            step = cache._nsa_model_step = ModelStep(self, slots, graph=graph, compiled=compiled)
        if step.layers[0].decode_ran != path:
            for layer in step.layers:
                layer.decode_ran = path
        return CausalLMOutputWithPast(logits=step(ids), **{CACHE_FIELD: cache})

    return forward


def _model_path(model, ids, cache, kwargs) -> tuple[str | None, list | None]:
    """How ``model(ids, cache, **kwargs)`` runs as the whole model's step (MODEL_PATHS) and the cache's NSA slots,
    or (None, None): transformers' forward (a prompt, a chunk, outputs the step does not give, gradients, a cache
    without room). Per token, so it reads one layer's settings (convert sets them alike) and builds nothing."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1 or cache is None:
        return None, None
    if any(kwargs.get(k) is not None for k in ("inputs_embeds", "labels")) or \
            any(kwargs.get(k) for k in ("output_attentions", "output_hidden_states")):
        return None, None
    body = model.base_model.layers
    first = body[0].self_attn
    decode = first.decode
    if decode == "auto":
        if ids.device.type != "cuda" or torch.is_grad_enabled() or \
                first.fused_path(ids.device, first.nsa.q_proj.weight.dtype) != "graph":
            return None, None
        decode = "model_graph"
    slots = slots_for(cache, len(body)) if decode in MODEL_PATHS else None
    if slots is None:
        return None, None
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and not bool(mask[:, -1].all()):
        return None, None  # a masked new token: the model's forward refuses it in one line
    if torch.is_grad_enabled():
        raise ValueError(f"decode={decode!r}: the model's step records no gradient; run under torch.no_grad() "
                         "(generate does) or convert with decode='module'")
    if decode in GRAPHED and ids.device.type != "cuda":
        raise ValueError(f"decode={decode!r}: CUDA graphs need a CUDA device; decode='model_step' runs the same "
                         "step eager")
    return decode, slots


class NSALlamaForCausalLM(_NSAModel, LlamaForCausalLM):
    config_class = NSALlamaConfig
    forward = _forward(LlamaForCausalLM)


class NSAQwen2ForCausalLM(_NSAModel, Qwen2ForCausalLM):
    config_class = NSAQwen2Config
    forward = _forward(Qwen2ForCausalLM)


class NSAMistralForCausalLM(_NSAModel, MistralForCausalLM):
    config_class = NSAMistralConfig
    forward = _forward(MistralForCausalLM)


# dense model_type -> the NSA config class; -> (the dense causal LM class, its NSA subclass)
CONFIGS = {"llama": NSALlamaConfig, "qwen2": NSAQwen2Config, "mistral": NSAMistralConfig}
MODELS = {"llama": (LlamaForCausalLM, NSALlamaForCausalLM), "qwen2": (Qwen2ForCausalLM, NSAQwen2ForCausalLM),
          "mistral": (MistralForCausalLM, NSAMistralForCausalLM)}
for _arch, _config in CONFIGS.items():  # what AutoConfig / AutoModelForCausalLM.from_pretrained resolve
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModelForCausalLM.register(_config, MODELS[_arch][1], exist_ok=True)


def _as(config, cls):
    """A copy of ``config`` as a ``cls`` (a dense config class and its NSA subclass share every field but
    ``nsa``), its model_type the class's (a config read from a file holds the file's as an attribute)."""
    new = copy.deepcopy(config)
    new.__class__ = cls
    new.__dict__.pop("model_type", None)
    return new


def dense_config(config):
    """``(config of the dense architecture, NSA settings)``: for an NSA model type's config a copy as its dense
    architecture's (``nsa_llama`` -> ``llama``) and its ``nsa``; for another config, itself and its ``nsa``
    entry (a folder saved before the NSA model types), or None."""
    if isinstance(config, tuple(CONFIGS.values())):
        return _as(config, type(config).__mro__[1]), config.nsa
    return config, getattr(config, "nsa", None)


def use_backend(model, backend="reference", *, fallback=None, streams=True, decode="auto"):
    """Every NSA layer of ``model`` on ``backend`` (``fallback``, ``streams`` as :class:`nsa.NSAAttention`'s) and
    decoding as ``decode`` says (:data:`DECODE`): how a model loaded through the Auto classes, which build it on
    the reference backend, runs on a GPU (``use_backend(model, "triton")``). Returns the model."""
    if decode not in DECODE:
        raise ValueError(f"use_backend: decode={decode!r}: one of {', '.join(DECODE)}")
    layers = [m for m in model.modules() if isinstance(m, NSASelfAttention)]
    if not layers:
        raise ValueError(f"use_backend: {type(model).__name__} has no NSA layers (convert() it first)")
    for m in layers:
        m.nsa.backend, m.nsa.fallback, m.nsa.streams, m.decode, m._fused = backend, fallback, streams, decode, {}
    return model


def from_pretrained(path, *, backend="reference", fallback=None, streams=True, decode="auto", **kwargs):
    """A model saved by ``save_pretrained`` after :func:`convert` (a local folder): NSA with the recorded
    settings, every weight from its safetensors files, in eval mode, on ``backend`` (:func:`use_backend`'s
    arguments). ``kwargs`` go to transformers' ``from_pretrained`` (``dtype``, ``device_map``, ...). Folders
    saved with the dense model_type and an ``nsa`` entry in config.json load the same way."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: no such folder; hf.from_pretrained loads a folder written by save_pretrained")
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: no config.json (a folder written by save_pretrained)")
    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(path)
    if not isinstance(config, tuple(CONFIGS.values())):
        settings = getattr(config, "nsa", None)
        if not isinstance(settings, dict):
            raise ValueError(f"{path}: config.json has no 'nsa' settings (not saved from a converted model); load it "
                             "with transformers and convert() it")
        if config.model_type not in CONFIGS:
            raise ValueError(f"{path}: model_type {config.model_type!r} is not supported; supported: "
                             f"{', '.join(ARCHITECTURES)}")
        config = _as(config, CONFIGS[config.model_type])
    model, info = MODELS[config.model_type.removeprefix("nsa_")][1].from_pretrained(
        path, config=config, output_loading_info=True, **kwargs)
    if info["missing_keys"] or info["unexpected_keys"] or info.get("mismatched_keys"):
        raise ValueError(f"{path}: the weights do not match the converted model (missing "
                         f"{sorted(info['missing_keys'])}, unexpected {sorted(info['unexpected_keys'])}, mismatched "
                         f"{sorted(k for k, *_ in info.get('mismatched_keys') or [])})")
    return use_backend(model, backend, fallback=fallback, streams=streams, decode=decode).eval()
