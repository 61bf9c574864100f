"""A transformers ``Cache`` slot that holds an NSA layer's :class:`nsa.NSACache` (:mod:`nsa.integrations.hf`)."""
from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ..decode import GraphDecoder
from ..module import NSAAttention, NSACache

BUFFERS = ("k_cmp_raw", "v_cmp_raw", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win")
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
        """``layer(x, cache)``: x's tokens appended after those cached (each row after its own), the cache grown
        first if needed; a single token after a prefill runs as ``decode`` says (``auto`` resolved by the caller)."""
        self._fit(layer, x.shape[0], (self.nsa_cache.length if self.nsa_cache is not None else 0) + x.shape[1],
                  x.device)
        if decode == "module" or x.shape[1] != 1 or self.nsa_cache.length == 0:
            return layer(x, self.nsa_cache)
        return self._step(layer, x, graph=decode == "graph")

    def prefill_rows(self, layer: NSAAttention, x: torch.Tensor, cu_seqlens: torch.Tensor, rows: int) -> torch.Tensor:
        """A padded batch's prompts, their real tokens packed in ``x [1,N,dim]`` (row b's between cu_seqlens[b]
        and [b+1]), into this empty slot: row b at positions 0..L_b-1, a ragged cache. The packed output."""
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        self._fit(layer, rows, max(lens), x.device)
        return layer(x, self.nsa_cache, cu_seqlens=cu_seqlens)

    def _fit(self, layer: NSAAttention, rows: int, n: int, device) -> None:
        """A cache of ``rows`` rows that holds ``n`` tokens in its longest row: made, or grown (its contents
        copied into one at least twice as long, each row at its length)."""
        old = self.nsa_cache
        if old is not None and n <= old.max_len:
            return
        cap = -(-max(n, 2 * old.max_len if old is not None else 0) // _GROW) * _GROW
        new = layer.new_cache(rows, cap, device=device)
        if old is not None:
            L, Lc = old.length, layer.config.n_cmp(old.length)
            for name in BUFFERS:
                m = Lc if name in ("k_cmp", "v_cmp") else L
                getattr(new, name)[:, :m] = getattr(old, name)[:, :m]
            new.lengths = old.lengths
        self.nsa_cache, self.is_initialized, self.decoder = new, True, None

    def decoder_for(self, layer: NSAAttention) -> GraphDecoder:
        """The :class:`nsa.decode.GraphDecoder` over this slot's cache (made at the first token after a prefill
        or a growth); positions moved by others (``crop``, ``reset``, a chunk through the module) read back."""
        dec = self.decoder
        if dec is None or dec.module is not layer:
            dec = self.decoder = GraphDecoder(layer, self.nsa_cache)
        elif dec.moved():
            dec.sync_position()
        return dec

    def _step(self, layer: NSAAttention, x: torch.Tensor, graph: bool) -> torch.Tensor:
        """One token through the layer's decoder: its eager step, or its captured step replayed."""
        dec = self.decoder_for(layer)
        if not graph:
            return dec.step(x)
        if not dec.captured:
            dec.capture()
        return dec.replay(x).clone()

    def get_seq_length(self) -> int:
        """Tokens cached in the longest row (0 before the first append)."""
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
        """Drop the last ``-tokens_to_remove`` tokens of every row (a positive value: keep that many in the
        longest row, transformers' older form). Compressed tokens of the kept blocks stay valid; later appends
        overwrite the rest."""
        L = self.get_seq_length()
        keep = tokens_to_remove if tokens_to_remove > 0 else L + tokens_to_remove
        if 0 <= keep < L:
            self.nsa_cache.lengths = (self.nsa_cache.lengths - (L - keep)).clamp(min=0)

    def _map(self, fn) -> None:
        """Every buffer and the row lengths through ``fn`` (a selection or repetition of rows, along dim 0)."""
        c = self.nsa_cache
        if c is not None:
            lengths = fn(c.lengths)
            self.nsa_cache = NSACache(*(fn(getattr(c, f)) for f in BUFFERS), max_len=c.max_len)
            self.nsa_cache.lengths = lengths
            self.decoder = None  # its buffers were the old cache's

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: the cache's rows reordered by ``beam_idx``."""
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row repeated ``repeats`` times (generate's expansion for beams or samples)."""
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """The rows ``indices`` kept."""
        self._map(lambda t: t[indices.to(t.device)])

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
