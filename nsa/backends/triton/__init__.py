"""The ``triton`` backend: Triton kernels for the three NSA branches.

Runs on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` (see ``nsa.env``), which is
how CI tests every kernel at small shapes. Each operator keeps the reference's signature
(``nsa.reference``): ``compressed`` (compressed attention + Eq. 9-12 top-n), ``selected``,
``window``, the fused gated sum ``combine``, ``selected_gated`` (the selected branch with the
gated sum in its epilogue, for forwards that need no gradient) and ``decode_kernels`` (the fused
decode step of ``nsa.decode.GraphDecoder``). Every branch runs on packed documents too (``varlen``:
tile tables of ``nsa.varlen``, see ``tiles``).

One module per operation: ``compressed`` (+ Eq. 9 scores), ``topn`` (Eqs. 11-12), ``selection``,
``window``, ``attention_bwd`` (the compressed and window backward), ``gate`` (Eq. 5), ``rowdot``
(the backward's delta), ``decode``; ``tiles`` holds the JIT tile helpers several of them share,
``utils`` the host-side ones, ``tuning`` every launch parameter.

torch.compile: each forward and backward is a custom op (``nsa::compressed_fwd``, ``nsa::compressed_scores`` (the
score-only pass the ``cudnn`` backend runs), ``nsa::window_fwd``,
``nsa::attention_bwd``, ``nsa::selection_fwd``, ``nsa::selection_bwd``, ``nsa::gate_fwd``, ``nsa::gate_bwd``;
``nsa.compat.custom_op``) with a fake implementation (its outputs' shapes and dtypes), called by the
branch's ``torch.autograd.Function``, so ``torch.compile(fullgraph=True)`` traces a layer built on this backend,
forward and backward, with one graph node per op. Their non-tensor arguments are ints, floats and strings:
the config's block sizes (``utils.Blocks``) and the launch parameters read when the call is traced
(``tuning.to_ints``), so a backward uses its forward's. In eager, the autograd.Functions call the ops'
functions directly (no dispatcher overhead). Packed documents (``varlen``) and the stream hook
(``on_scored``) run in eager only.
"""
from __future__ import annotations

import torch

from ... import env
from ...dispatch import Backend
from .utils import poisoned_outputs

__all__ = ["BACKEND", "TritonBackend", "poisoned_outputs", "triton_unsupported"]

# Why bfloat16 is refused under the interpreter: its tl.dot on bf16 inputs returns wrong products
# (outputs off by up to 2e9 on the layer's shapes), so a run there would finish with wrong numbers.
INTERPRETER_BF16 = ("bfloat16 under Triton's interpreter (TRITON_INTERPRET=1 on CPU tensors): its bf16 tl.dot "
                    "returns wrong products; use float32 or float16 there, or a CUDA device")


def triton_unsupported() -> str | None:
    """Why the installed triton cannot run these kernels, or None (from ``triton.__version__``).
    Triton < 3.0 (2.3): its language lacks ``tl.exp2``/``tl.log2`` and ``tl.dot(input_precision=)``,
    which the kernels use, and its interpreter returns raw numpy arrays from ``x[:, None]`` and lacks
    ``tl.minimum`` and atomics. The reference backend runs there."""
    from ...compat import triton_version

    major, minor = triton_version()
    if (major, minor) < (3, 0):
        return f"triton {major}.{minor} cannot run these kernels (they need triton >= 3.0)"
    return None


class TritonBackend(Backend):
    name = "triton"

    def unavailable(self, branch, device, dtype):
        """float16/bfloat16/float32 on CUDA with a supported triton, or CPU tensors under
        ``TRITON_INTERPRET=1`` (not bfloat16). Arguments and Returns: as :meth:`nsa.dispatch.Backend.unavailable`.
        """
        try:
            import triton  # noqa: F401
        except ImportError as e:
            return f"triton is not installed ({e})"
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"dtype {dtype} unsupported (float16, bfloat16, float32)"
        if device.type == "cuda":
            return triton_unsupported()
        if device.type == "cpu" and env.triton_interpret():
            return INTERPRETER_BF16 if dtype == torch.bfloat16 else triton_unsupported()
        return f"needs a CUDA device (or CPU tensors with TRITON_INTERPRET=1), got {device.type}"

    def compressed(self, q, k_cmp, v_cmp, config, *, scale, q_start, n_keys, on_scored=None, varlen=None):
        """The compressed branch's Triton kernels (:func:`.compressed.compressed_branch`).
        Arguments and Returns: as :meth:`nsa.dispatch.Backend.compressed`.
        """
        from .compressed import compressed_branch
        return compressed_branch(q, k_cmp, v_cmp, config, scale=scale, q_start=q_start, n_keys=n_keys,
                                 on_scored=on_scored, varlen=varlen)

    def selected(self, q, k_sel, v_sel, indices, config, *, scale, q_start, varlen=None):
        """The selected branch's Triton kernels (:func:`.selection.selected_attention`).
        Arguments and Returns: as :meth:`nsa.dispatch.Backend.selected`.
        """
        from .selection import selected_attention
        return selected_attention(q, k_sel, v_sel, indices, config, scale=scale, q_start=q_start, varlen=varlen)

    def window(self, q, k_win, v_win, config, *, scale, q_start, varlen=None):
        """The window branch's Triton kernels (:func:`.window.sliding_window_attention`).
        Arguments and Returns: as :meth:`nsa.dispatch.Backend.window`.
        """
        from .window import sliding_window_attention
        return sliding_window_attention(q, k_win, v_win, config, scale=scale, q_start=q_start, varlen=varlen)

    def combine(self, o_cmp, o_sel, o_win, gates):
        """The gated sum in one fused kernel (:func:`.gate.gated_sum`).
        Arguments and Returns: as :meth:`nsa.dispatch.Backend.combine`."""
        from .gate import gated_sum
        return gated_sum(o_cmp, o_sel, o_win, gates)

    def selected_gated(self, q, k_sel, v_sel, indices, config, o_cmp, o_win, gates, *, scale, q_start, varlen=None):
        """The gated sum in the selection kernel's epilogue (:func:`.selection.selected_gated`).
        Arguments and Returns: as :meth:`nsa.dispatch.Backend.selected_gated`.
        """
        from .selection import selected_gated  # Eq. 5 in the selection kernel's epilogue
        return selected_gated(q, k_sel, v_sel, indices, config, o_cmp, o_win, gates, scale=scale, q_start=q_start,
                              varlen=varlen)

    def decode_kernels(self, config, B, max_len, device, dtype, *, n_sm=None):
        """A :class:`.decode_attention.DecodeKernels`. Arguments and Returns: as :meth:`nsa.dispatch.Backend.decode_kernels`."""
        from .decode_attention import DecodeKernels
        return DecodeKernels(config, B, max_len, device, dtype=dtype, n_sm=n_sm)


BACKEND = TritonBackend()
