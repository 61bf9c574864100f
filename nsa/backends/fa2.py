"""The ``fa2`` backend: FlashAttention-2 for the sliding-window branch (spec step 6).

Which FlashAttention-2 runs is decided at import and recorded in ``BACKEND.impl``:

* ``"fa2:flash_attn <version>"`` where the flash-attn package is installed:
  ``flash_attn_func(q, k, v, causal=True, window_size=(w-1, 0))``;
* ``"fa2:torch-flash"`` otherwise: PyTorch's own FlashAttention-2 kernel,
  ``torch.ops.aten._flash_attention_forward`` with ``window_size_left=w-1, window_size_right=0``
  (the kernel behind SDPA's FLASH backend and ``torch.nn.attention.varlen.varlen_attn``; SDPA itself
  has no window argument). Its backward is PyTorch's registered ``_flash_attention_backward``.

Both take the batch-first layout ``[B,T,H,D]`` and grouped heads natively. Causality with Tq < S
queries is bottom-right aligned, so keys are cut to ``[max(0, q_start-w+1), q_start+Tq)``. FA-2 needs
one head dim for q, k and v: where Dk != Dv (or a dim is not a multiple of 8) all three are padded with
zeros to a common multiple of 8, which leaves q·k and the output unchanged (the pad is sliced off).

Packed documents (``varlen``): ``flash_attn_varlen_func`` (flash-attn) or, without the package,
``torch.nn.attention.varlen.varlen_attn`` where this PyTorch has it with a ``window_size`` argument
(``enable_gqa=True`` where it has that too; the kernel takes grouped heads natively), both with
cu_seqlens and the same window; empty documents are left out of the cu_seqlens they get. Otherwise
``varlen_unavailable`` says what is missing.

The ``cmp`` and ``sel`` branches are not FlashAttention shapes (Eq. 9 scores from the compressed
probabilities; per-query block sets of Eq. 12) and are reported unavailable.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from ..dispatch import Backend, BackendUnavailable

try:  # the flash-attn package (CUDA only), if installed
    import flash_attn as _flash_attn
    from flash_attn import flash_attn_func as _flash_attn_func
    from flash_attn import flash_attn_varlen_func as _flash_attn_varlen_func

    _IMPL = f"fa2:flash_attn {_flash_attn.__version__}"
except Exception:  # noqa: BLE001 (any import failure means: not usable)
    _flash_attn_func = _flash_attn_varlen_func = None
    _IMPL = "fa2:torch-flash"


def _torch_varlen():
    """(PyTorch's ``varlen_attn`` and whether it takes ``enable_gqa``, None) where it exists with a
    ``window_size`` argument, else (None, False, why not)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, False, f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
    params = inspect.signature(varlen_attn).parameters
    if "window_size" not in params:
        return None, False, f"torch {torch.__version__}'s varlen_attn has no window_size argument"
    return varlen_attn, "enable_gqa" in params, None


_TORCH_VARLEN, _TORCH_VARLEN_GQA, _NO_TORCH_VARLEN = _torch_varlen()

_HALF = (torch.float16, torch.bfloat16)


def _pad_to(x, D):
    return x if x.shape[-1] == D else F.pad(x, (0, D - x.shape[-1]))


def _torch_flash_window(q, k, v, w, scale):
    # 4-D (batch) layout: no cumulative sequence lengths; is_causal aligns bottom-right.
    out = torch.ops.aten._flash_attention_forward(
        q,
        k,
        v,
        None,
        None,
        q.shape[1],
        k.shape[1],
        0.0,
        True,
        False,
        scale=scale,
        window_size_left=w - 1,
        window_size_right=0,
    )
    return out[0]


def _varlen_window(q, k, v, varlen, w, scale):
    """Sliding window inside each packed document: q ``[N,HQ,D]``, k/v ``[N,H,D]`` -> ``[N,HQ,D]``."""
    def nonempty_cu():  # the documents' bounds without empty documents
        ends = [s + n for s, n in zip(varlen.starts, varlen.lens) if n]
        return torch.tensor([0] + ends, dtype=torch.int32).to(q.device)

    if varlen.total == 0:
        return q.new_zeros(q.shape)
    cu = varlen.kept(("fa2_cu", str(q.device)), nonempty_cu)
    n = varlen.max_len
    if _flash_attn_varlen_func is not None:
        return _flash_attn_varlen_func(q, k, v, cu, cu, n, n, softmax_scale=scale, causal=True, window_size=(w - 1, 0))
    gqa = dict(enable_gqa=True) if _TORCH_VARLEN_GQA and q.shape[1] != k.shape[1] else {}
    return _TORCH_VARLEN(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, n, n, scale=scale,
                         window_size=(w - 1, 0), **gqa)


class FA2Backend(Backend):
    name = "fa2"
    impl = _IMPL

    def unavailable(self, branch, device, dtype):
        """The window branch only, on CUDA in float16/bfloat16, with flash-attn or PyTorch's
        FlashAttention kernel. Arguments and Returns: as :meth:`nsa.dispatch.Backend.unavailable`.
        """
        if branch == "cmp":
            return (
                "the compressed branch needs the Eq. 9 block scores from its own probabilities, which "
                "FlashAttention-2 does not return; use the 'triton' or 'reference' backend"
            )
        if branch == "sel":
            return (
                "the selected branch attends to per-query block sets (Eq. 12), which FlashAttention-2's "
                "causal/window masks cannot express; use the 'triton' or 'reference' backend"
            )
        if device.type != "cuda":
            return f"FlashAttention-2 ({self.impl}) runs on CUDA devices only, got {device.type}"
        if dtype not in _HALF:
            return f"FlashAttention-2 ({self.impl}) supports float16/bfloat16 only, got {dtype}"
        avail = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
        if _flash_attn_func is None and not avail():
            return "this PyTorch build has no FlashAttention kernel and flash-attn is not installed"
        return None

    def varlen_unavailable(self, branch, device, dtype):
        """A reason where neither flash-attn's nor PyTorch's varlen FlashAttention is there.
        Arguments and Returns: as :meth:`nsa.dispatch.Backend.varlen_unavailable`.
        """
        if _flash_attn_varlen_func is None and _TORCH_VARLEN is None:
            return f"packed documents need flash-attn's flash_attn_varlen_func, which is not installed, or {_NO_TORCH_VARLEN}"
        return None

    def window(self, q, k_win, v_win, config, *, scale, q_start, varlen=None):
        """FlashAttention-2 with a (w-1, 0) window over the keys the queries can reach, head dims padded to a
        multiple of 8 (at most 256, else ``BackendUnavailable``). Arguments and Returns: as :meth:`nsa.dispatch.Backend.window`.
        """
        Tq, Dk = q.shape[1], q.shape[3]
        Dv = v_win.shape[-1]
        S = q_start + Tq
        lo = max(0, q_start - config.w + 1)
        k, v = k_win[:, lo:S], v_win[:, lo:S]
        D = -(-max(Dk, Dv) // 8) * 8
        if D > 256:
            raise BackendUnavailable(f"backend 'fa2' cannot run branch 'win': head dim {D} > 256")
        qp, kp, vp = _pad_to(q, D), _pad_to(k, D), _pad_to(v, D)
        if varlen is not None:
            return _varlen_window(qp[0], kp[0], vp[0], varlen, config.w, scale)[None, ..., :Dv]
        if _flash_attn_func is not None:
            o = _flash_attn_func(qp, kp, vp, softmax_scale=scale, causal=True, window_size=(config.w - 1, 0))
        else:
            o = _torch_flash_window(qp.contiguous(), kp.contiguous(), vp.contiguous(), config.w, scale)
        return o[..., :Dv]


BACKEND = FA2Backend()
