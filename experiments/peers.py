"""Public NSA kernels timed beside this project's in ``experiments.prefill`` and ``experiments.decode``
(``prefill.peers`` / ``decode.peers``, rows named after the peer), on the same inputs. A peer is an
optional extra (``pip install -e ".[peers]"``); where it cannot run a shape, is not installed or needs
another device, its row is skipped and the reason is a run tag ``peer_<name>`` (and a log line); where
it runs, the tag says what it computes.

``fla`` (fla-core, ``fla.ops.nsa.parallel_nsa``; its kernels are autotuned Triton, CUDA only): called
with q, the selected branch's keys/values k_sel/v_sel and the gates of the compressed and selected
branches. What it computes differs from this project's layer:

* one key/value set for every branch: its compressed keys are the mean of k_sel/v_sel over blocks of
  l_sel tokens (no learned phi, no separate k_cmp/v_cmp), recomputed on every call (a decode step pools
  the whole cache); so it needs l = d = l_sel;
* its own top-n of n_sel blocks (the first and the two newest forced: n_init = 1, n_local = 2) from its
  compressed scores; query heads grouped by G >= 16, a power of two;
* the sliding window only through the flash-attn package (on k_sel/v_sel); without flash-attn (the GPU
  boxes) it has no window branch, and its row is compressed + selected.
"""
from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nsa import NSAConfig

from .measure.inputs import CoreInputs

log = logging.getLogger("experiments.peers")


@dataclass
class Peer:
    name: str
    fn: Callable[[], torch.Tensor]     # the output on the job's inputs, [B,Tq,HQ,Dv]
    branches: tuple[str, ...]          # this project's branches whose keys it reads (token counts)
    note: str                          # what it computes (the run tag)


def fla_unavailable(c: NSAConfig, device: torch.device) -> str | None:
    """Why fla's parallel_nsa cannot run this shape here, or None. Shape rules first (they hold on
    any machine), then the installation, then the device."""
    G = c.G
    if G < 16 or G & (G - 1):
        return f"fla needs G = n_heads / n_kv_heads >= 16 and a power of two (G={G})"
    if not c.l == c.d == c.l_sel:
        return (f"fla compresses blocks of l = d = l_sel (got l={c.l}, d={c.d}, l_sel={c.l_sel}; "
                f"model=h200bench64, or model.nsa.l={c.l_sel} model.nsa.d={c.l_sel}, runs it)")
    if (c.n_init, c.n_local) != (1, 2):
        return f"fla always selects the first block and the 2 newest (got n_init={c.n_init}, n_local={c.n_local})"
    if importlib.util.find_spec("fla") is None:
        return 'fla-core is not installed (pip install -e ".[peers]")'
    if device.type != "cuda":
        return "fla's kernels run on CUDA only (their triton.autotune needs a GPU driver)"
    return None


def fla(x: CoreInputs, c: NSAConfig) -> Peer:
    from fla.ops.nsa import parallel as fla_nsa

    window = fla_nsa.flash_attn_func is not None
    g = x.gates

    def fn():
        return fla_nsa.parallel_nsa(x.q, x.k_sel, x.v_sel, g[..., 0], g[..., 1], g[..., 2] if window else None,
                                    block_counts=c.n_sel, block_size=c.l_sel, window_size=c.w if window else 0,
                                    scale=x.q.shape[-1] ** -0.5)

    note = ("ran fla.ops.nsa.parallel_nsa on q, k_sel, v_sel and the gates: compressed keys = mean of k_sel/v_sel "
            f"over blocks of {c.l_sel} (no phi), its own top-{c.n_sel}, selected attention; window: "
            + (f"flash-attn over the last {c.w} tokens of k_sel/v_sel" if window else "none (flash-attn is not installed)"))
    return Peer("fla", fn, ("cmp", "sel", "win") if window else ("cmp", "sel"), note)


BUILD = {"fla": (fla_unavailable, fla)}


def rows(names, x: CoreInputs, c: NSAConfig, device: torch.device, tags: dict[str, str]) -> dict[str, Peer]:
    """The peers of ``names`` that run on these inputs; each skipped one's reason, and each running
    one's note, in ``tags`` (``peer_<name>``) and the log."""
    out = {}
    for name in names:
        unavailable, build = BUILD[name]
        why = unavailable(c, device)
        if why:
            tags[f"peer_{name}"] = f"skipped: {why}"
        else:
            out[name] = build(x, c)
            tags[f"peer_{name}"] = out[name].note
        log.info(f"[peers] {name}: {tags[f'peer_{name}']}")
    return out
