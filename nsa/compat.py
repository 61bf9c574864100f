"""Compatibility helpers across the supported torch versions (see ``nsa.toolchain``)."""
from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F


def _sdpa_has_enable_gqa() -> bool:
    # ``enable_gqa`` appeared in torch 2.5. SDPA is a builtin there, so its signature may not be
    # introspectable: fall back to the docstring, which lists every keyword.
    fn = F.scaled_dot_product_attention
    try:
        return "enable_gqa" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return "enable_gqa" in (getattr(fn, "__doc__", None) or "")


SDPA_ENABLE_GQA = _sdpa_has_enable_gqa()


def sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with grouped heads: q ``[B, HQ, T, D]``, k/v
    ``[B, H, S, D]`` with H dividing HQ (query head j reads kv head j // (HQ // H)). Passes
    ``enable_gqa=True`` where torch has it (>= 2.5), otherwise repeats k/v over the group.
    Other keyword arguments (``attn_mask``, ``is_causal``, ``scale`` ...) go to SDPA unchanged."""
    HQ, H = q.shape[-3], k.shape[-3]
    if HQ == H:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    if HQ % H or v.shape[-3] != H:
        raise ValueError(f"grouped attention needs kv heads dividing query heads, got q {HQ}, k {H}, v {v.shape[-3]}")
    if SDPA_ENABLE_GQA:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
    G = HQ // H
    return F.scaled_dot_product_attention(q, k.repeat_interleave(G, dim=-3), v.repeat_interleave(G, dim=-3), **kwargs)


def triton_version() -> tuple[int, int]:
    """(major, minor) of the installed triton; (0, 0) when it is not installed."""
    from .toolchain import installed_versions, parse_version

    version = installed_versions()[1]
    return parse_version(version) if version else (0, 0)


__all__ = ["SDPA_ENABLE_GQA", "sdpa_gqa", "triton_version"]


def custom_op(name: str, fake):
    """The decorated function registered as ``torch.library.custom_op(name, mutates_args=())``, with ``fake`` (its
    outputs' shapes and dtypes) by ``register_fake``. Returns a function that calls the op while torch.compile
    traces (one node of the graph; the op is its ``.op``) and the plain function otherwise: eager calls pay no
    dispatcher overhead (about 20 us a call, measured on CPU). torch < 2.4 has no custom_op: the plain function
    alone there (eager only)."""
    def wrap(fn):
        if not hasattr(torch.library, "custom_op"):
            return fn
        op = torch.library.custom_op(name, mutates_args=())(fn)
        op.register_fake(fake)

        @functools.wraps(fn)
        def call(*args):
            return op(*args) if torch.compiler.is_compiling() else fn(*args)

        call.op = op
        return call

    return wrap


def assume_constant_result(fn):
    """``torch.compiler.assume_constant_result(fn)``: torch.compile calls ``fn`` when it traces, and the result is
    a constant of the graph. Marks ``fn`` as that function does, without its import of torch._dynamo, which
    imports triton: importing nsa leaves triton unimported (its interpreter is chosen when it is imported)."""
    fn._dynamo_marked_constant = True
    return fn


def block_mask_from_kv_blocks(*args, seq_lengths: tuple[int, int], **kwargs):
    """``BlockMask.from_kv_blocks``, with ``seq_lengths`` where this torch takes it (>= 2.6; before, the
    lengths are the block counts times the block size)."""
    from torch.nn.attention.flex_attention import BlockMask

    if "seq_lengths" in inspect.signature(BlockMask.from_kv_blocks).parameters:
        kwargs["seq_lengths"] = seq_lengths
    return BlockMask.from_kv_blocks(*args, **kwargs)


def no_eager_fallback(recompile_limit: int):
    """Dynamo's settings for one compiled call: up to ``recompile_limit`` compilations of the function,
    then an error instead of dynamo's default of running it eagerly (for FlexAttention, the eager path
    materializes every score: at 64k tokens that is an out-of-memory error far from its cause).
    Settings this torch lacks are left out."""
    import torch._dynamo.config as cfg

    known = set(getattr(cfg, "_config", {})) or set(dir(cfg))
    if "recompile_limit" in known:  # the names since torch 2.7; cache_size_limit before
        want = {"recompile_limit": recompile_limit, "fail_on_recompile_limit_hit": True}
    else:
        want = {"cache_size_limit": recompile_limit, "fail_on_cache_limit_hit": True}
    return cfg.patch({k: v for k, v in want.items() if k in known})


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (torch < 2.4 has no device argument: CUDA, or its CPU twin)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:
        return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()
