"""Host-side helpers shared by every operation of the triton backend: constants, power-of-two sizes,
the output allocator (NaN-filled inside :func:`poisoned_outputs`), the product precision, and
Triton's interpreter shim (applied on import when ``TRITON_INTERPRET=1``, see ``nsa.env``), and the
TMA descriptors of tensors (:func:`tma_ok`, :func:`descriptor`). Imports no triton module at import
time, so ``poisoned_outputs`` is importable where triton is not installed.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
from typing import NamedTuple

import torch

from ... import env
from ...compat import assume_constant_result, triton_version

LOG2E = 1.4426950408889634  # the kernels' softmax is in base 2: exp(x) = exp2(x * log2(e))
# Smallest tl.dot dimension the running triton accepts: 3.0 asserts every one >= 16 (compiled and
# interpreted); later versions ask the target (the interpreter takes any size).
DOT_MIN = 16 if triton_version() < (3, 1) else 1
# Host-side TMA descriptors (triton.tools.tensor_descriptor) and their loads in kernels: triton 3.4+.
HOST_DESCRIPTORS = triton_version() >= (3, 4)


def p2(n: int, lo: int = 1) -> int:
    """The smallest power of two >= n, and >= lo (tile sizes: ``tl.arange`` needs powers of two)."""
    return max(lo, 1 << (max(1, int(n)) - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: IEEE fp32 products for fp32 inputs (no tf32), else the default."""
    return "ieee" if dtype == torch.float32 else "tf32"


def launch_options(tune: dict) -> dict:
    """Triton launch options from an op's tuning: warps, stages and, where set, ptxas's register cap
    (``maxnreg``: fewer registers per thread, more programs per SM)."""
    opts = dict(num_warps=tune["warps"], num_stages=tune["stages"])
    if tune.get("maxnreg"):
        opts["maxnreg"] = tune["maxnreg"]
    return opts


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@assume_constant_result  # torch.compile: asked when tracing, a constant of the graph
def capability(device: torch.device | int | None = None) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device (None or no index: the current one), queried
    once per device: the launchers ask on every call."""
    index = device.index if isinstance(device, torch.device) else device
    return _capability(torch.cuda.current_device() if index is None else index)


def tma_ok(on: bool | None, varlen, G: int, GP: int, *xs: torch.Tensor) -> bool:
    """Whether kernels load ``xs`` through TMA descriptors (block loads by the copy engine instead of
    per-element pointers): ``on`` (a ``tma`` tuning value; None: on sm_90+ and under the interpreter), a
    triton with host-side descriptors (3.4+), one sequence per batch row (varlen None), a power-of-two
    group (G == GP: a block holds exactly the group's heads), and tensors a descriptor can describe
    (non-empty, unit last stride, 16-byte aligned base and strides)."""
    if on is None:
        dev = xs[0].device
        on = dev.type != "cuda" or capability(dev)[0] >= 9
    return (bool(on) and HOST_DESCRIPTORS and varlen is None and G == GP
            and all(x.numel() > 0 and x.stride(-1) == 1 and x.data_ptr() % 16 == 0
                    and all(st * x.element_size() % 16 == 0 for st in x.stride()[:-1]) for x in xs))


def descriptor(x: torch.Tensor, block: list[int]):
    """A TMA descriptor of ``x`` (its shape and strides) with tiles of ``block``; elements past the
    tensor's edges load as zero."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(x, list(x.shape), list(x.stride()), block)


class Blocks(NamedTuple):
    """The block sizes of an ``NSAConfig`` that the kernels read: what a custom op (``nsa::*``) carries of
    the config, as ``list(Blocks.of(config))``, and rebuilds with ``Blocks(*blocks)``. Sizes only: what
    follows from them (the selection blocks of T tokens, ``NSAConfig.n_blocks``) is the config's to say,
    computed before the op and passed beside them as an int."""

    l: int  # noqa: E741  (the paper's name)
    d: int
    l_sel: int
    n_sel: int
    w: int
    n_init: int
    n_local: int

    @classmethod
    def of(cls, config) -> "Blocks":
        """Arguments:
            config: an :class:`nsa.NSAConfig`.

        Returns:
            Its block geometry (l, d, l_sel, n_sel, w, n_init, n_local).
        """
        return cls(config.l, config.d, config.l_sel, config.n_sel, config.w, config.n_init, config.n_local)


def default_scale(q: torch.Tensor, scale) -> float:
    """The softmax scale: 1/sqrt(Dk) unless given (spec "Shapes and names")."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def interpreted(x: torch.Tensor) -> bool:
    """True where ``x``'s kernels run in Triton's interpreter (CPU tensors) rather than compiled."""
    return x.device.type != "cuda"


# Set only by poisoned_outputs(); a plain module flag (not a context variable) so that backward
# passes that autograd runs on its own threads see it too.
_POISON = False


@contextlib.contextmanager
def poisoned_outputs():
    """Inside this block the kernels' outputs (and gradients) are allocated filled with NaN (integer
    outputs with -7), so an element a kernel fails to write shows up in any comparison (tests,
    ``experiments.parity``)."""
    global _POISON
    saved, _POISON = _POISON, True
    try:
        yield
    finally:
        _POISON = saved


def empty(shape, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.empty`` on ``like``'s device (and dtype unless given), poisoned inside
    :func:`poisoned_outputs`: for tensors a kernel must write entirely."""
    dtype = like.dtype if dtype is None else dtype
    if _POISON:
        fill = float("nan") if dtype.is_floating_point else -7
        return torch.full(shape, fill, device=like.device, dtype=dtype)
    return torch.empty(shape, device=like.device, dtype=dtype)


def poisoning() -> bool:
    """True inside :func:`poisoned_outputs` (for workspaces allocated once and reused per call)."""
    return _POISON


def _fix_interpreter_index():
    """Triton 3.6's interpreter converts a scalar to a Python int with ``int(array)``, but scalars
    there are 1-element arrays and numpy >= 2.4 refuses that, so ``range(lo, hi)`` over runtime
    scalars fails under TRITON_INTERPRET=1. Re-register ``__index__`` with ``.item()`` (interpreter
    only; compiled kernels are untouched).

    Only for interpreters with the ``_patch_lang_tensor(tensor, scope)`` form this was written for
    (triton >= 3.x with ``_LangPatchScope``): triton 3.0 has ``(tensor)``, triton 2.3 has
    ``(tensor, builder)``, and both run only with numpy < 2, which still accepts ``int(array)``."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    orig = getattr(interpreter, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_nsa_fixed", False):
        return
    try:
        params = list(inspect.signature(orig).parameters)
    except (TypeError, ValueError):
        return
    if params != ["tensor", "scope"] or not hasattr(interpreter, "_LangPatchScope"):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._nsa_fixed = True
    interpreter._patch_lang_tensor = patched


if env.triton_interpret():
    _fix_interpreter_index()
