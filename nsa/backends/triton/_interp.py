"""Interpreter compatibility shim, shared by every Triton kernel module of this backend.

Applied only when ``TRITON_INTERPRET=1`` (``nsa.env``); compiled kernels are untouched.
"""
from __future__ import annotations

import inspect

from ... import env


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
