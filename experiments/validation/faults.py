"""A test switch: a fault in one branch's kernels, to prove that ``experiments.validate`` and the kernel
tests fail when a kernel is wrong (``validate.inject_fault=<branch>``, pytest's ``--inject-fault``).

Inside :func:`inject`, every backend but the reference is replaced in ``nsa.dispatch`` by a wrapper
whose ``branch`` output is off by a constant: 10 % of the root mean square of that branch's values
(``v_cmp``, ``v_sel`` or ``v_win``) added to every element. Every path that chooses its backend
through the dispatch sees it: the branch operators, the fused gated sum of the selected branch
(``selected_gated``: the gate times the constant) and the decode kernels of ``nsa.decode.GraphDecoder``.
The gradients are the backend's own (the constant does not depend on the inputs). The reference stays
exact: it is what the checks compare against.
"""
from __future__ import annotations

import contextlib

import torch

from nsa import dispatch
from nsa.dispatch import BRANCHES

SIZE = 0.1  # the constant: this fraction of the RMS of the branch's values


def offset(v: torch.Tensor) -> torch.Tensor:
    """The constant a faulty branch adds: SIZE x RMS(v), a 0-dim tensor in v's dtype (no gradient)."""
    if v.numel() == 0:
        return torch.zeros((), device=v.device, dtype=v.dtype)
    return (SIZE * v.detach().float().pow(2).mean().sqrt()).to(v.dtype)


class FaultyBackend(dispatch.Backend):
    """``inner`` with its ``branch`` output off by :func:`offset` of that branch's values."""

    def __init__(self, inner: dispatch.Backend, branch: str):
        self.inner, self.branch, self.name = inner, branch, inner.name

    def __getattr__(self, attr):  # impl and anything else a backend carries
        return getattr(self.inner, attr)

    def unavailable(self, branch, device, dtype):
        return self.inner.unavailable(branch, device, dtype)

    def varlen_unavailable(self, branch, device, dtype):
        return self.inner.varlen_unavailable(branch, device, dtype)

    def compressed(self, q, k_cmp, v_cmp, config, **kw):
        o, idx = self.inner.compressed(q, k_cmp, v_cmp, config, **kw)
        return (o + offset(v_cmp) if self.branch == "cmp" else o), idx

    def selected(self, q, k_sel, v_sel, indices, config, **kw):
        o = self.inner.selected(q, k_sel, v_sel, indices, config, **kw)
        return o + offset(v_sel) if self.branch == "sel" else o

    def window(self, q, k_win, v_win, config, **kw):
        o = self.inner.window(q, k_win, v_win, config, **kw)
        return o + offset(v_win) if self.branch == "win" else o

    def combine(self, o_cmp, o_sel, o_win, gates):
        return self.inner.combine(o_cmp, o_sel, o_win, gates)

    def selected_gated(self, q, k_sel, v_sel, indices, config, o_cmp, o_win, gates, **kw):
        o = self.inner.selected_gated(q, k_sel, v_sel, indices, config, o_cmp, o_win, gates, **kw)
        return o + gates[..., 1:2] * offset(v_sel) if self.branch == "sel" else o

    def decode_kernels(self, config, B, max_len, device, dtype, **kw):
        kernels = self.inner.decode_kernels(config, B, max_len, device, dtype, **kw)
        return None if kernels is None else FaultyDecode(kernels, self.branch)


class FaultyDecode:
    """Decode kernels whose ``branch`` output is off by :func:`offset` (times its gate in the gated sum)."""

    def __init__(self, inner, branch: str):
        self.inner, self.branch = inner, branch

    def __getattr__(self, attr):  # indices, counts, p
        return getattr(self.inner, attr)

    def attend(self, q, gates, pos, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, *, branches, **kw):
        o = self.inner.attend(q, gates, pos, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, branches=branches, **kw)
        if self.branch in branches:
            i = BRANCHES.index(self.branch)
            o.add_(gates[..., i:i + 1] * offset((v_cmp, v_sel, v_win)[i]))
        return o


@contextlib.contextmanager
def inject(branch: str):
    """Inside the block, ``branch``'s output is wrong in every backend but the reference (see above)."""
    if branch not in BRANCHES:
        raise ValueError(f"inject_fault={branch!r}: one of {', '.join(BRANCHES)}")
    saved = []
    for name in dispatch.known_backends():
        if name == "reference":
            continue
        try:
            be = dispatch.get(name)
        except dispatch.BackendUnavailable:  # cannot be imported here: nothing runs it
            continue
        saved.append(be)
        dispatch.register(FaultyBackend(be, branch))
    try:
        yield
    finally:
        for be in saved:
            dispatch.register(be)
