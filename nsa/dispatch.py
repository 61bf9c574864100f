"""The one dispatch point: which backend runs each NSA branch, and a record of what really ran.

A backend implements three branch operators with the reference's signatures
(``nsa.reference.compressed_branch``, ``selected_attention``, ``sliding_window_attention``):

* ``cmp``: compressed attention + selection scores + top-n -> ``(o_cmp, indices)``
* ``sel``: selected attention given indices -> ``o_sel``
* ``win``: sliding-window attention -> ``o_win``

and the gated sum of the three outputs (``combine``, spec step 7), which runs on the backend chosen
for the ``sel`` branch (the base class: the plain PyTorch expression; ``triton``: one fused kernel).
Every branch operator takes ``varlen`` (a :class:`nsa.varlen.Varlen` for packed documents, else None);
a backend that cannot run a branch on packed documents says why in ``varlen_unavailable``.
A backend may also provide the fused kernels of a whole decode step (``decode_kernels``, for
``nsa.decode.GraphDecoder``, which chooses its backend here too).

``backend`` arguments take a name (every branch) or a mapping ``{"cmp": .., "sel": .., "win": ..}``.
A backend that cannot run a branch on the given device/dtype raises ``BackendUnavailable`` naming
the branch, backend and reason. Only when the caller passes ``fallback="<name>"`` does the
dispatch run that backend instead; it then warns once per (branch, backend, reason) and the
fallback appears in the record. Nothing falls back silently.

Record what ran::

    with nsa.dispatch.record() as rec:
        y = layer(x)
    rec.ran        # {"cmp": "reference", "sel": "triton", "win": "sdpa"}
    rec.fallbacks  # ["sel: triton -> reference (no CUDA device)"]
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib
import warnings
from dataclasses import dataclass, field
from typing import Mapping

import torch

from . import reference
from .compat import assume_constant_result

BRANCHES = ("cmp", "sel", "win")


class BackendUnavailable(RuntimeError):
    """A requested backend cannot run a branch here (and no fallback was allowed)."""


class Backend:
    """Base class: the reference operators, available everywhere. Subclasses override."""

    name = "reference"

    def unavailable(self, branch: str, device: torch.device, dtype: torch.dtype) -> str | None:
        """Whether this backend can run a branch for tensors on ``device`` in ``dtype``.

        Arguments:
            branch: ``"cmp"``, ``"sel"`` or ``"win"``.
            device: where the branch's tensors are.
            dtype: the branch's input dtype.

        Returns:
            None if it can, else the reason in a few words (the dispatch puts it in
            ``BackendUnavailable`` or in the fallback's record).
        """
        return None

    def varlen_unavailable(self, branch: str, device: torch.device, dtype: torch.dtype) -> str | None:
        """Whether this backend can run a branch on packed documents (``varlen``); asked after
        :meth:`unavailable`.

        Arguments:
            branch: ``"cmp"``, ``"sel"`` or ``"win"``.
            device: where the branch's tensors are.
            dtype: the branch's input dtype.

        Returns:
            None if it can, else the reason.
        """
        return None

    def compressed(self, q, k_cmp, v_cmp, config, *, scale, q_start, n_keys, on_scored=None, varlen=None):
        """The compressed branch (Eqs. 5 and 7-12): attention over the compressed tokens, then the top-n
        selection blocks from its scores (``nsa.reference.compressed_branch``).

        Arguments:
            q: queries ``[B,Tq,HQ,Dk]`` at positions ``q_start..q_start+Tq-1``.
            k_cmp, v_cmp: compressed keys ``[B,Tc,H,Dk]`` and values ``[B,Tc,H,Dv]``.
            config: the layer's :class:`nsa.NSAConfig` (block sizes, n_sel, forced blocks).
            scale: the softmax scale.
            q_start: the position of the first query row.
            n_keys: the number of raw tokens S (None: q_start + Tq), which fixes the number of selection
                blocks ceil(S / l_sel).
            on_scored: None, or called with no arguments once the block scores are computed (queued, on a
                GPU) and before the top-n; a backend that cannot split the two calls it at the end.
            varlen: packed documents (:class:`nsa.varlen.Varlen`, B = 1) or None.

        Returns:
            ``(o_cmp [B,Tq,HQ,Dv], indices [B,Tq,H,n_sel])``: the indices ascending, -1 padded.
        """
        out = reference.compressed_branch(q, k_cmp, v_cmp, config, scale=scale, q_start=q_start, n_keys=n_keys,
                                          varlen=varlen)
        if on_scored is not None:
            on_scored()
        return out

    def selected(self, q, k_sel, v_sel, indices, config, *, scale, q_start, varlen=None):
        """The selected branch (Eq. 5 over the blocks of Eq. 12): attention over the raw tokens at or
        before each query in its group's selected blocks (``nsa.reference.selected_attention``).

        Arguments:
            q: queries ``[B,Tq,HQ,Dk]``.
            k_sel, v_sel: the branch's raw keys ``[B,S,H,Dk]`` and values ``[B,S,H,Dv]``.
            indices: the selected blocks ``[B,Tq,H,n_sel]`` (ascending, -1 entries ignored).
            config: the layer's :class:`nsa.NSAConfig`.
            scale: the softmax scale.
            q_start: the position of the first query row.
            varlen: packed documents or None (block j of a row covers its document's tokens
                ``[j*l_sel, (j+1)*l_sel)``).

        Returns:
            ``o_sel [B,Tq,HQ,Dv]``.
        """
        return reference.selected_attention(q, k_sel, v_sel, indices, config, scale=scale, q_start=q_start,
                                            varlen=varlen)

    def window(self, q, k_win, v_win, config, *, scale, q_start, varlen=None):
        """The sliding-window branch: attention over the ``config.w`` latest tokens up to each query
        (``nsa.reference.sliding_window_attention``).

        Arguments:
            q: queries ``[B,Tq,HQ,Dk]``.
            k_win, v_win: the branch's raw keys ``[B,S,H,Dk]`` and values ``[B,S,H,Dv]``.
            config: the layer's :class:`nsa.NSAConfig` (``w``).
            scale: the softmax scale.
            q_start: the position of the first query row.
            varlen: packed documents or None (the window stays inside the row's document).

        Returns:
            ``o_win [B,Tq,HQ,Dv]``.
        """
        return reference.sliding_window_attention(q, k_win, v_win, config, scale=scale, q_start=q_start,
                                                  varlen=varlen)

    def combine(self, o_cmp, o_sel, o_win, gates):
        """The gated sum of the three branches (paper Eq. 5): ``sum_c gates[..., c, None] * o_c``.

        Arguments:
            o_cmp, o_sel, o_win: the branches' outputs ``[B,Tq,HQ,Dv]``.
            gates: ``[B,Tq,HQ,3]``, in the order cmp, sel, win.

        Returns:
            ``o [B,Tq,HQ,Dv]``.
        """
        g = gates.unsqueeze(-1)
        return g[..., 0, :] * o_cmp + g[..., 1, :] * o_sel + g[..., 2, :] * o_win

    def selected_gated(self, q, k_sel, v_sel, indices, config, o_cmp, o_win, gates, *, scale, q_start, varlen=None):
        """``combine(o_cmp, selected(...), o_win, gates)`` when no gradient is needed (the layer's forward
        in prefill/inference); a backend may fuse the gated sum into its selected branch.

        Arguments:
            q, k_sel, v_sel, indices, config, scale, q_start, varlen: as :meth:`selected`.
            o_cmp, o_win: the other two branches' outputs ``[B,Tq,HQ,Dv]``.
            gates: ``[B,Tq,HQ,3]``, as :meth:`combine`.

        Returns:
            ``o [B,Tq,HQ,Dv]``.
        """
        o_sel = self.selected(q, k_sel, v_sel, indices, config, scale=scale, q_start=q_start, varlen=varlen)
        return self.combine(o_cmp, o_sel, o_win, gates)

    def decode_kernels(self, config, B, max_len, device, dtype, *, n_sm=None):
        """The kernels of one fused decode step (``nsa.decode.GraphDecoder`` asks for them).

        Arguments:
            config: the layer's :class:`nsa.NSAConfig`.
            B: sequences per step.
            max_len: the caches' capacity in raw tokens.
            device, dtype: the caches' device and dtype.
            n_sm: multiprocessors to size the launches for (None: the device's).

        Returns:
            An object with ``attend`` (see ``nsa.backends.triton.decode_attention.DecodeKernels``) that owns
            its workspaces, or None where this backend has none (the base class).
        """
        return None


_REGISTRY: dict[str, Backend] = {"reference": Backend()}
# Backends that import heavier modules register on first use: name -> "module:attribute".
_LAZY: dict[str, str] = {
    "triton": "nsa.backends.triton:BACKEND",
    "sdpa": "nsa.backends.sdpa:BACKEND",
    "fa2": "nsa.backends.fa2:BACKEND",
    "cudnn": "nsa.backends.cudnn:BACKEND",
}


def register(backend: Backend) -> None:
    """Make a backend available by its name (``backend.name``; replaces one of the same name).

    Arguments:
        backend: a :class:`Backend` instance.
    """
    _REGISTRY[backend.name] = backend


def known_backends() -> tuple[str, ...]:
    """The backend names :func:`get` accepts.

    Returns:
        The names registered, or registered on first use, sorted.
    """
    return tuple(sorted(set(_REGISTRY) | set(_LAZY)))


def get(name: str) -> Backend:
    """The backend of a name, importing (and registering) it on first use.

    Arguments:
        name: one of :func:`known_backends`.

    Returns:
        The :class:`Backend`. Raises ValueError for an unknown name, ``BackendUnavailable`` where its
        module cannot be imported, ``ToolchainError`` for ``triton`` on a known-bad torch/triton pair.
    """
    if name not in _REGISTRY:
        if name not in _LAZY:
            raise ValueError(f"backend={name!r}: unknown backend; known: {', '.join(known_backends())}")
        module, attr = _LAZY[name].split(":")
        if name == "triton":
            from .toolchain import check_toolchain

            check_toolchain()  # refuses a known-bad torch/triton pairing (ToolchainError, one line)
        try:
            register(getattr(importlib.import_module(module), attr))
        except ImportError as e:
            raise BackendUnavailable(f"backend {name!r} cannot be imported: {e}") from e
    return _REGISTRY[name]


@assume_constant_result  # traced, it would read the registry before a backend registers (choose_plan)
def resolve(backend: str | Mapping[str, str]) -> dict[str, str]:
    """Normalize a backend argument to ``{branch: name}`` and check every name exists."""
    if isinstance(backend, str):
        plan = {b: backend for b in BRANCHES}
    else:
        extra = set(backend) - set(BRANCHES)
        if extra:
            raise ValueError(f"backend: unknown branch {sorted(extra)}; branches are {BRANCHES}")
        plan = {b: backend.get(b, "reference") for b in BRANCHES}
    for b, name in plan.items():
        if name not in _REGISTRY and name not in _LAZY:
            raise ValueError(f"backend[{b}]={name!r}: unknown backend; known: {', '.join(known_backends())}")
    return plan


@dataclass
class Record:
    """What ran, per branch (the last call wins), plus every fallback taken."""

    ran: dict[str, str] = field(default_factory=dict)
    fallbacks: list[str] = field(default_factory=list)
    calls: int = 0


_CURRENT: contextvars.ContextVar[Record | None] = contextvars.ContextVar("nsa_dispatch_record", default=None)
_WARNED: set[str] = set()


@contextlib.contextmanager
def record():
    """A context in which every dispatch notes what ran.

    Returns:
        (as the ``with`` target) the :class:`Record`, filled in as branches run.
    """
    rec = Record()
    token = _CURRENT.set(rec)
    try:
        yield rec
    finally:
        _CURRENT.reset(token)


def record_ran(ran: Mapping[str, str]) -> None:
    """Note in the current ``record()`` that backends ran branches (``{branch: name}``), for callers
    that chose them once with :func:`choose` and run them again later (a decode step, a replayed
    CUDA graph)."""
    rec = _CURRENT.get()
    if rec is not None:
        rec.ran.update(ran)


def choose(branch: str, name: str, device: torch.device, dtype: torch.dtype, fallback: str | None, *,
           varlen: bool = False) -> Backend:
    """The backend that will run ``branch`` (on packed documents where ``varlen``); raises or falls back
    (loudly) if ``name`` can't."""
    chosen = _choose(branch, name, device, dtype, fallback, varlen)  # registers it on first use: read after
    return _REGISTRY[chosen]


def choose_plan(plan: Mapping[str, str], device: torch.device, dtype: torch.dtype, fallback: str | None, *,
                varlen: bool = False) -> dict[str, Backend]:
    """:func:`choose` for every branch of ``plan`` (``{branch: name}``, :func:`resolve`'s), all chosen before the
    registry is read: torch.compile keeps the registry as it first read it in a trace, and a backend that
    registers on first use does so while the call is traced (``_choose``).

    Returns:
        ``{branch: Backend}``.
    """
    chosen = {b: _choose(b, plan[b], device, dtype, fallback, varlen) for b in BRANCHES}
    return {b: _REGISTRY[n] for b, n in chosen.items()}


# torch.compile runs these two when it traces (assume_constant_result: their results are constants of the
# graph), since it cannot trace what they do (a lazy import, a warning, a ContextVar): a compiled call is
# checked and recorded when it is traced, not each time its graph runs. In eager, on every call.
@assume_constant_result
def _choose(branch: str, name: str, device: torch.device, dtype: torch.dtype, fallback: str | None,
            varlen: bool) -> str:
    """:func:`choose`'s backend, by name; notes it (and the fallback taken) in the current ``record()``."""
    def why(be):
        return be.unavailable(branch, device, dtype) or (be.varlen_unavailable(branch, device, dtype) if varlen else None)

    what = f"{device.type}/{str(dtype).replace('torch.', '')}" + (" with packed documents (cu_seqlens)" if varlen else "")
    try:
        be = get(name)
        reason = why(be)
    except BackendUnavailable as e:
        be, reason = None, str(e)
    if reason is None:
        chosen, note = be, None
    elif fallback is None:
        raise BackendUnavailable(
            f"backend {name!r} cannot run branch {branch!r} on {what}: {reason} (choose another backend, or allow a fallback)"
        )
    else:
        chosen = get(fallback)
        second = why(chosen)
        if second is not None:
            raise BackendUnavailable(f"fallback {fallback!r} cannot run branch {branch!r} either: {second}")
        note = f"{branch}: {name} -> {fallback} ({reason})"
        if note not in _WARNED:
            _WARNED.add(note)
            warnings.warn(f"NSA backend fallback: {note}", RuntimeWarning, stacklevel=4)
    rec = _CURRENT.get()
    if rec is not None:
        rec.ran[branch] = chosen.name
        if note is not None and note not in rec.fallbacks:
            rec.fallbacks.append(note)
    return chosen.name


@assume_constant_result
def count_call() -> bool:
    """Count one ``nsa_attention`` call in the current ``record()``."""
    rec = _CURRENT.get()
    if rec is not None:
        rec.calls += 1
    return True
