"""The dense baseline: causal SDPA over the same heads (grouped keys/values), and its ragged decode step
under a key mask."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from nsa.compat import sdpa_gqa


def math_path(device: torch.device, d_k: int, d_v: int) -> bool:
    """Whether SDPA runs its math kernel for :func:`dense_attention` here: on a CPU where the key and value
    head dims differ (its flash kernel takes one head dim). That path repeats the grouped keys and values to
    every query head and copies the keys once more, transposed (1.6x B*S*HQ*(d_k+d_v) elements in a decode
    step of the paper's model, torch 2.13, measured), and keeps the scores, the causal mask and the
    probabilities (2.5x B*HQ*Tq*S float32 values, measured on a prefill)."""
    return device.type == "cpu" and d_k != d_v


def dense_attention(q, k, v, causal: bool, kernel: str = "auto"):
    """Dense baseline: torch SDPA over ``[B,T,H*,D]`` layouts with grouped heads. A single decode
    query is not causal-masked (is_causal aligns top-left: one query would see one key).
    ``kernel``: "auto" lets PyTorch pick (cuDNN attention on an H200 with torch 2.11), "flash" forces
    its FlashAttention-2 kernel (``SDPBackend.FLASH_ATTENTION``; an error where it cannot run)."""
    if kernel not in ("auto", "flash"):
        raise ValueError(f"kernel={kernel!r}: one of auto, flash")
    pick = contextlib.nullcontext()
    if kernel == "flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        pick = sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    with pick:
        return sdpa_gqa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)


def key_mask(lengths: torch.Tensor, S: int, device) -> torch.Tensor:
    """``[B,1,1,S]`` bool: key j of row b is read (j < lengths[b])."""
    return (torch.arange(S, device=device)[None, :] < torch.as_tensor(lengths, device=device)[:, None])[:, None, None]


def dense_attention_ragged(q, k, v, mask):
    """Dense baseline of a ragged decode step: one query per row ``q [B,1,HQ,Dk]`` over that row's own keys,
    ``k``/``v`` ``[B,S,H,D*]`` under the key mask ``mask [B,1,1,S]`` (``key_mask``). The G query heads of a
    group are laid out as G queries of its key head (``[B,H,G,Dk]``), so SDPA reads the grouped cache as it
    is: ``sdpa_gqa`` with a mask would repeat the keys/values to every query head (SDPA's GQA runs only in
    its flash and math kernels, and flash takes no mask). The masked SDPA may run another kernel than the
    unmasked one of ``dense_attention`` (e.g. memory-efficient attention or the math path instead of flash
    or cuDNN), so its time includes that choice."""
    B, T, HQ, Dk = q.shape
    H = k.shape[2]
    if T != 1:
        raise ValueError(f"q: one decode query per row expected, got {tuple(q.shape)}")
    o = F.scaled_dot_product_attention(q.reshape(B, H, HQ // H, Dk), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask)
    return o.reshape(B, 1, HQ, v.shape[-1])
