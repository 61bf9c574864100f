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

``flash_nsa`` (mdy666/Scalable-Flash-Native-Sparse-Attention, no package on an index: its ``flash_nsa``
directory importable, e.g. the repository's checkout on PYTHONPATH): its kernels for the compressed attention
(``compress_attn``, with its lse), the block scores and top-n (``slc_topk_indices``), the selected attention
(``select_attn``) and the gated sum (``fused_sigmoid_combine``), on this project's q, k_cmp/v_cmp (the same
compression), k_sel/v_sel and gates; its window needs flash-attn, so the window is this project's triton
kernel on k_win/v_win, as in the nsa row with ``backend.win=triton`` (one window kernel in both rows). Its
sigmoid is applied to the gates the layer already squashed: the same work as its own layer's. Only the ops
are imported (the package's ``__init__`` imports its layers and their dependencies: pandas, megatron).
"""
from __future__ import annotations

import importlib.util
import logging
import sys
import types
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


def _flash_nsa_ops():
    """flash_nsa's op modules, imported without running the package's ``__init__``."""
    if not hasattr(sys.modules.get("flash_nsa"), "__path__"):
        spec = importlib.util.find_spec("flash_nsa")
        pkg = types.ModuleType("flash_nsa")
        pkg.__path__, pkg.__spec__ = list(spec.submodule_search_locations), spec
        sys.modules["flash_nsa"] = pkg
    names = ("compress_attn", "topk", "select_attn", "combine")
    ops = {n: importlib.import_module(f"flash_nsa.ops.{n}") for n in names}
    return importlib.import_module("flash_nsa.utils").NSAHelper, ops


def flash_nsa_unavailable(c: NSAConfig, device: torch.device) -> str | None:
    if c.d & (c.d - 1) or c.l % c.d or c.l_sel % c.d:
        return f"flash_nsa needs a power-of-two stride d dividing l and l_sel (got l={c.l}, d={c.d}, l_sel={c.l_sel})"
    if importlib.util.find_spec("flash_nsa") is None:
        return ("flash_nsa is not importable (its repository, github.com/mdy666/Scalable-Flash-Native-Sparse-Attention, "
                "on PYTHONPATH)")
    if device.type != "cuda":
        return "flash_nsa's kernels run on CUDA only"
    try:
        _flash_nsa_ops()
    except Exception as e:  # noqa: BLE001 (any import failure: say which)
        return f"flash_nsa's ops failed to import: {type(e).__name__}: {e}"
    return None


def _flash_nsa_setup(c: NSAConfig, B: int, S: int, device: torch.device) -> dict:
    """flash_nsa's ops, its (class-level) hyperparameters set to ``c`` and its sequences to B of S tokens."""
    helper, ops = _flash_nsa_ops()
    helper.set_hyperparameters(kernel_size=c.l, stride=c.d, block_size=c.l_sel, window_size=c.w, top_n=c.n_sel,
                               num_init_blocks=c.n_init, num_local_blocks=c.n_local)
    helper.init_cu_seqlens(torch.arange(0, (B + 1) * S, S, device=device, dtype=torch.int32))
    return ops


def flash_nsa_selection(c: NSAConfig, B: int, S: int, device: torch.device) -> Callable[..., torch.Tensor]:
    """flash_nsa's selected attention alone (``select_attn``, differentiable) as ``fn(q, k, v, idx)`` on this
    project's layout: q ``[B,S,HQ,Dk]``, k/v ``[B,S,H,D]``, idx ``[B,S,H,n_sel]`` (ascending, -1 after the
    valid blocks: its kernels read the first min(n_sel, ceil((t+1)/l_sel)) of a row)."""
    ops = _flash_nsa_setup(c, B, S, device)

    def fn(q, k, v, idx):
        topk = idx.permute(2, 0, 1, 3).flatten(1, 2).contiguous()  # [H, B*S, n_sel]
        o = ops["select_attn"].select_attn(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), topk,
                                           sm_scale=q.shape[-1] ** -0.5)
        return o.view(*q.shape[:3], v.shape[-1])

    return fn


def flash_nsa(x: CoreInputs, c: NSAConfig) -> Peer:
    from nsa.backends.triton.window import sliding_window_attention

    B, S, HQ, Dk = x.q.shape
    Dv = x.v_sel.shape[-1]
    ops = _flash_nsa_setup(c, B, S, x.q.device)
    scale = Dk ** -0.5

    def fn():
        q = x.q.flatten(0, 1)
        cmp_o, lse = ops["compress_attn"].compress_attn(q, x.k_cmp.flatten(0, 1), x.v_cmp.flatten(0, 1), sm_scale=scale)
        topk, _ = ops["topk"].slc_topk_indices(q, x.k_cmp.flatten(0, 1), lse, sm_scale=scale,
                                               maybe_efficient_version=True, scale_slc_p=True)
        slc_o = ops["select_attn"].select_attn(q, x.k_sel.flatten(0, 1), x.v_sel.flatten(0, 1), topk, sm_scale=scale)
        win_o = sliding_window_attention(x.q, x.k_win, x.v_win, c, scale=scale, q_start=0).flatten(0, 1)
        return ops["combine"].fused_sigmoid_combine(cmp_o, slc_o, win_o, x.gates.flatten(0, 1)).view(B, S, HQ, Dv)

    note = (f"ran flash_nsa's compress_attn, slc_topk_indices (top-{c.n_sel}), select_attn and fused_sigmoid_combine "
            "on q, k_cmp/v_cmp, k_sel/v_sel and the gates; window: this project's triton kernel on k_win/v_win")
    return Peer("flash_nsa", fn, ("cmp", "sel", "win"), note)


BUILD = {"fla": (fla_unavailable, fla), "flash_nsa": (flash_nsa_unavailable, flash_nsa)}


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
