"""A converted transformers model's whole decode step as one CUDA graph (:mod:`nsa.integrations.hf`).

Per token, ``generate()`` calls the model once; eager, that call is transformers' Python (the base model's
forward, each decoder layer's, the cache's bookkeeping) around a few hundred small kernels, and a 336M model's
step is bound by the host. :class:`ModelStep` runs transformers' own forward of the base model and the head once
with every NSA layer's attention as its :class:`nsa.decode.GraphDecoder` step (projections, RoPE at each row's
device position, the cache writes, the three branches' decode kernels, the gated sum, ``o_proj``: no host
positions), and captures that in one CUDA graph (``model_graph``); each later token is one replay and a copy of
the token ids in. ``model_step`` runs the same function eager (a CPU runs it through the Triton interpreter).
``model_compiled`` is ``model_graph`` with transformers' part of the step (the norms, the MLPs, the residual adds,
the head) compiled by ``torch.compile`` first, so that Inductor fuses its elementwise kernels; the NSA layers' steps
stay out of the compiled code (``torch.compiler.disable``: they are fused kernels already), and the graph of the
whole step is then captured as for ``model_graph``. It compiles at the first token after a prompt (tens of seconds;
later caches and processes reuse Inductor's cache).

The step reads each row's position from its decoder, so it serves uniform and ragged (left-padded) caches alike;
it applies where ``generate`` decodes: one token per row, a cache whose every layer holds NSA tokens and room for
one more, no gradient, no labels, attentions or hidden states asked for. Elsewhere the model's own forward runs
(the layer's own ``decode`` path per token). A cache that grows, or whose rows are reordered or selected (beam
search), has new buffers: the step is made and captured again for it.
"""
from __future__ import annotations

import functools

import torch

from .hf_cache import NSACacheLayer

MODEL_PATHS = ("model_graph", "model_compiled", "model_step")
GRAPHED = ("model_graph", "model_compiled")  # captured in a CUDA graph


class ModelStep:
    """One decode token for every row of ``model`` (an NSA causal LM) over the NSA slots ``slots`` of its cache
    (one per decoder layer, filled by the prompt): ``step(ids [B,1]) -> logits [B,1,vocab]``; ``graph``: captured
    in a CUDA graph and replayed; ``compiled``: transformers' part of the body through ``torch.compile``."""

    def __init__(self, model, slots: list[NSACacheLayer], graph: bool, compiled: bool = False):
        self.model, self.slots, self.graph, self.compiled = model, slots, graph, compiled
        self.layers = [layer.self_attn for layer in model.base_model.layers]
        self.decoders = [slot.decoder_for(attn.nsa) for slot, attn in zip(slots, self.layers)]
        self.key = step_key(slots)
        cache = slots[0].nsa_cache
        self._ids = torch.zeros(cache.batch_size, 1, dtype=torch.long, device=cache.k_sel.device)
        self._graph = self._logits = None
        if graph:
            self._capture()

    def _body(self) -> torch.Tensor:
        """transformers' base model and head on the static ids, each NSA layer's attention its decoder's step
        (which advances that decoder's device positions)."""
        for attn, dec in zip(self.layers, self.decoders):
            attn.graph_step = dec
        try:
            return (compiled_logits() if self.compiled else logits)(self.model, self._ids)
        finally:
            for attn in self.layers:
                attn.graph_step = None

    def _capture(self) -> None:
        """Two warm-up runs on a side stream (Triton's compilation, cuBLAS's workspaces, the allocator), each
        position put back after, then the capture (which runs nothing)."""
        saved = [d.positions.clone() for d in self.decoders]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self._body()
                for d, p in zip(self.decoders, saved):
                    d.positions.copy_(p)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self._logits = self._body()

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        for dec in self.decoders:
            if dec.moved():  # a crop or reset since the last token: the device positions read back
                dec.sync_position()
            dec.check_room()  # the longest row has room
        self._ids.copy_(ids)
        if self._graph is not None:
            self._graph.replay()
            logits = self._logits.clone()
        else:
            logits = self._body()
        for dec in self.decoders:
            dec.advance_host()  # the host mirror of the positions the step advanced on the device
        return logits


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    """transformers' base model and head on ``ids`` without a cache (each NSA layer runs its ``graph_step``)."""
    return model.lm_head(model.base_model(input_ids=ids, use_cache=False).last_hidden_state)


@functools.cache
def compiled_logits():
    """:func:`logits` through ``torch.compile`` (static shapes), made once: Dynamo's guards tell models and
    batch sizes apart."""
    return torch.compile(logits, dynamic=False)


@torch.compiler.disable
def layer_step(decoder, x: torch.Tensor) -> torch.Tensor:
    """An NSA layer's decoder step, outside any compiled code (its fused kernels and device positions)."""
    return decoder.step_body(x)


def step_key(slots: list[NSACacheLayer]) -> tuple:
    """What a :class:`ModelStep` was made for: its slots' caches and decoders (a growth, reorder or selection of
    rows makes new ones)."""
    return tuple(id(s.nsa_cache) for s in slots) + tuple(id(s.decoder) for s in slots)


def slots_for(cache, n_layers: int) -> list[NSACacheLayer] | None:
    """The NSA slots of ``cache`` when every layer's holds tokens and room for one more, else None."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or len(layers) != n_layers:
        return None
    for slot in layers:
        if not isinstance(slot, NSACacheLayer) or slot.nsa_cache is None or not slot.nsa_cache.length \
                or slot.nsa_cache.length + 1 > slot.nsa_cache.max_len:
            return None
    return layers
