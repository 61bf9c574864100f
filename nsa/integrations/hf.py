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
* ``auto`` (the default): ``graph`` on a CUDA device where the layer's backend has decode kernels, under
  ``torch.no_grad()`` (as ``generate`` runs), else ``module``. ``NSASelfAttention.decode_ran`` says which ran last.

Without a cache, the whole sequence runs as prefill. Padding is refused: NSA places each row's tokens at
positions 0..T-1 (run rows of unequal length one at a time).
"""
from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import torch
from torch import nn
try:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.cache_utils import CacheLayerMixin
except ImportError as e:  # the [hf] extra is not installed: say which, in one line
    raise ImportError(f"nsa.integrations.hf needs transformers, the hf extra: pip install -e '.[hf]' ({e})") from None

from .. import dispatch
from ..config import NSAConfig
from ..decode import DECODE_PATHS, GraphDecoder
from ..module import NSAAttention, NSACache

ARCHITECTURES = ("llama", "qwen2", "mistral")  # config.model_type
# NSAConfig fields the model fixes (convert reads them from it); the others are the NSA settings.
FROM_MODEL = ("dim", "n_heads", "n_kv_heads", "d_k", "d_v", "rope_base", "qkv_bias", "o_bias")
SETTINGS = tuple(f.name for f in fields(NSAConfig) if f.name not in FROM_MODEL)
BUFFERS = ("k_cmp_raw", "v_cmp_raw", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win")
DECODE = DECODE_PATHS  # how a cached layer runs one new token (the module docstring)
_GROW = 1024  # an NSACacheLayer's capacity grows in multiples of this many tokens


class NSACacheLayer(CacheLayerMixin):
    """One decoder layer's slot of a transformers ``Cache``: the layer's :class:`nsa.NSACache`, grown (copied
    into one twice as long) when a prompt or step does not fit. Beam search, assisted decoding and batch
    expansion reach it through the methods transformers calls on every cache layer."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self):
        super().__init__()
        self.nsa_cache: NSACache | None = None
        self.decoder = None  # a GraphDecoder over nsa_cache (decode "step" / "graph"), made at the first token

    def lazy_initialization(self, key_states, value_states) -> None:
        """transformers' hook before a layer's first update: nothing (the NSA cache is made on the first append)."""

    def update(self, key_states, value_states, *args, **kwargs):
        """transformers' dense key/value update: refused, an NSA layer appends through :meth:`append`."""
        raise RuntimeError("NSACacheLayer: an NSA layer keeps its own keys and values (NSACacheLayer.append)")

    def append(self, layer: NSAAttention, x: torch.Tensor, decode: str = "module") -> torch.Tensor:
        """``layer(x, cache)``: x's tokens appended after those cached, the cache grown first if needed; a single
        token after a prefill runs as ``decode`` says (:data:`DECODE`; ``auto`` resolved by the caller)."""
        old = self.nsa_cache
        n = (old.length if old is not None else 0) + x.shape[1]
        if old is None or n > old.max_len:
            cap = -(-max(n, 2 * old.max_len if old is not None else 0) // _GROW) * _GROW
            new = layer.new_cache(x.shape[0], cap, device=x.device)
            if old is not None:
                L, Lc = old.length, layer.config.n_cmp(old.length)
                for name in BUFFERS:
                    m = Lc if name in ("k_cmp", "v_cmp") else L
                    getattr(new, name)[:, :m] = getattr(old, name)[:, :m]
                new.length = L
            self.nsa_cache, self.is_initialized, self.decoder = new, True, None
        if decode == "module" or x.shape[1] != 1 or self.nsa_cache.length == 0:
            return layer(x, self.nsa_cache)
        return self._step(layer, x, graph=decode == "graph")

    def _step(self, layer: NSAAttention, x: torch.Tensor, graph: bool) -> torch.Tensor:
        """One token through the layer's :class:`nsa.decode.GraphDecoder` over this cache (made, and its step
        captured, at the first token after a prefill or a growth); positions moved by others (``crop``,
        ``reset``, a chunk through the module) are read back first."""
        dec = self.decoder
        if dec is None or dec.module is not layer:
            dec = self.decoder = GraphDecoder(layer, self.nsa_cache)
        elif dec.moved():
            dec.sync_position()
        if not graph:
            return dec.step(x)
        if not dec.captured:
            dec.capture()
        return dec.replay(x).clone()

    def get_seq_length(self) -> int:
        """Tokens cached (0 before the first append)."""
        return 0 if self.nsa_cache is None else self.nsa_cache.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """transformers' mask shape for ``query_length`` new tokens: (keys seen, offset 0)."""
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        """-1: no fixed maximum (the cache grows by doubling)."""
        return -1

    def reset(self) -> None:
        """Empty the cache (its buffers kept)."""
        if self.nsa_cache is not None:
            self.nsa_cache.reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (a positive value: keep that many, transformers' older
        form). Compressed tokens of the kept blocks stay valid; later appends overwrite the rest."""
        L = self.get_seq_length()
        keep = tokens_to_remove if tokens_to_remove > 0 else L + tokens_to_remove
        if 0 <= keep < L:
            self.nsa_cache.length = keep

    def _map(self, fn) -> None:
        c = self.nsa_cache
        if c is not None:
            self.nsa_cache = NSACache(*(fn(getattr(c, f)) for f in BUFFERS), max_len=c.max_len, length=c.length)
            self.decoder = None  # its buffers were the old cache's

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: the cache's rows reordered by ``beam_idx``."""
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row repeated ``repeats`` times (generate's expansion for beams or samples)."""
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """The rows ``indices`` kept."""
        self._map(lambda t: t[indices])

    def offload(self):
        """Refused: the NSA cache stays on its device."""
        raise NotImplementedError("NSACacheLayer: cache offloading is not supported")

    prefetch = offload


def cache_layer(cache, layer_idx: int) -> NSACacheLayer:
    """The NSA slot of ``cache`` (a transformers ``Cache``) for decoder layer ``layer_idx``, put in place of the
    empty dense layer transformers made there."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        raise ValueError(f"past_key_values: {type(cache).__name__} is not a transformers Cache of layers; NSA layers "
                         "take a DynamicCache (generate's default) or none")
    while len(layers) <= layer_idx:  # a DynamicCache made without a config adds its layers lazily
        layers.append(NSACacheLayer())
    slot = layers[layer_idx]
    if not isinstance(slot, NSACacheLayer):
        if slot.get_seq_length() > 0:
            raise ValueError(f"past_key_values: layer {layer_idx} holds a dense model's keys and values; an NSA "
                             "model's cache starts empty")
        slot = layers[layer_idx] = NSACacheLayer()
    return slot


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


class NSASelfAttention(nn.Module):
    """A decoder layer's ``self_attn``: transformers' call in, :class:`nsa.NSAAttention` (``.nsa``) run, with the
    layer's :class:`NSACacheLayer` when a cache is passed. Returns ``(output, None)``: no attention weights."""

    def __init__(self, config: NSAConfig, layer_idx: int, *, backend="reference", fallback=None, streams=True,
                 decode: str = "auto"):
        super().__init__()
        if decode not in DECODE:
            raise ValueError(f"decode={decode!r}: one of {', '.join(DECODE)}")
        self.layer_idx, self.decode = layer_idx, decode
        self.decode_ran: str | None = None  # how the last single cached token ran (DECODE's names; None: none yet)
        self._fused: dict = {}  # (backend, device, dtype) -> fused_decode's answer, asked once, not per token
        self.nsa = NSAAttention(config, backend=backend, fallback=fallback, streams=streams)

    def decode_path(self, x: torch.Tensor) -> str:
        """How a single cached token ``x`` runs: ``decode`` with ``auto`` resolved (the module docstring)."""
        if self.decode != "auto":
            return self.decode
        if x.device.type != "cuda" or torch.is_grad_enabled():  # the decoder's step records no gradient
            return "module"
        key = (repr(self.nsa.backend), x.device, x.dtype)
        if key not in self._fused:
            self._fused[key] = fused_decode(self.nsa.backend, x.device, x.dtype)
        return "graph" if self._fused[key] else "module"

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                cache=None, **kwargs):
        """transformers' attention call: ``(NSA's output, None)``; with a cache, the tokens are appended to this
        layer's :class:`NSACacheLayer` and attend to those before them."""
        kv = cache if cache is not None else past_key_values  # transformers 5.24 renamed it `cache`
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


def _model_fields(model) -> tuple[str, dict]:
    """The architecture and what the NSA layers take from the model (FROM_MODEL); a one-line ValueError if
    NSA cannot express its attention."""
    cfg = model.config
    arch = getattr(cfg, "model_type", None)
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


def _refuse_padding_and_offsets(module, args, kwargs):
    """A forward pre-hook on the converted base model: NSA places row b's tokens at positions past..past+T-1
    with its own RoPE and masks; padding or other positions would be silently wrong, so they stop here."""
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if isinstance(mask, torch.Tensor) and (mask.dim() != 2 or not bool(mask.all())):
        raise ValueError("attention_mask: an NSA model takes no padding or custom mask (each row's tokens at "
                         "positions 0..T-1); run rows of unequal length one at a time")
    pos = kwargs.get("position_ids")
    if isinstance(pos, torch.Tensor):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = cache.get_seq_length() if cache is not None else 0
        want = torch.arange(past, past + pos.shape[-1], device=pos.device)
        if not bool((pos == want).all()):
            raise ValueError(f"position_ids: an NSA model places its tokens at positions {past}..{past + pos.shape[-1] - 1} "
                             "(after those cached); packed sequences or other positions are not supported")


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
    for i, layer in enumerate(_decoder_layers(model)):
        dense = layer.self_attn
        ref = dense.q_proj.weight
        new = NSASelfAttention(cfg, i, backend=backend, fallback=fallback, streams=streams,
                               decode=decode).to(device=ref.device, dtype=ref.dtype)
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
    model.config.nsa = recorded
    # transformers builds no attention masks for an implementation it does not know: NSA has its own
    model.config._attn_implementation = "nsa"
    model.base_model.register_forward_pre_hook(_refuse_padding_and_offsets, with_kwargs=True)
    return model


def _dtype(config) -> torch.dtype | None:
    d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return getattr(torch, d) if isinstance(d, str) else d


def _state_dict(path: Path) -> dict:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path}: no model.safetensors (or its index) to load")
    out = {}
    for f in files:
        out.update(load_file(path / f))
    return out


def from_pretrained(path, *, backend="reference", fallback=None, streams=True, decode="auto"):
    """A model saved by ``save_pretrained`` after :func:`convert`: its architecture from ``config.json``, NSA
    with the recorded settings, every weight from its safetensors files (in their dtype), in eval mode;
    ``backend``, ``fallback``, ``streams``, ``decode``: as :func:`convert`'s."""
    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    settings = getattr(config, "nsa", None)
    if not isinstance(settings, dict):
        raise ValueError(f"{path}: config.json has no 'nsa' settings (not saved from a converted model); load it "
                         "with transformers and convert() it")
    model = AutoModelForCausalLM.from_config(config)
    if _dtype(config) is not None:
        model.to(_dtype(config))
    _convert(model, settings, backend, fallback, streams, decode, copy_weights=False)
    state = _state_dict(path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(params[k]) for k in state if k in params}
    untied = [k for k in missing if id(params.get(k)) not in loaded]  # a tied weight is loaded through its twin
    if unexpected or untied:
        raise ValueError(f"{path}: the weights do not match the converted model (missing {untied}, unexpected "
                         f"{sorted(unexpected)})")
    if (path / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()
