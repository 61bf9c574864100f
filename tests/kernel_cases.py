"""The kernel checks shared by tests/test_kernels_gpu.py (compiled, bfloat16, the paper's block sizes, up
to T = 128k) and tests/test_kernels_interpret.py (Triton's interpreter on the CPU, float32, tiny shapes).

Each check runs a backend, through ``nsa.dispatch`` as a user's call does, over the whole sequence, and
compares with ``nsa.reference`` on the same values upcast (float32 on a GPU, float64 on the CPU):

* the output of the last ``rows`` query rows, and the gradient of every input of a loss on those rows
  (``sum(o[:, -rows:] * w)``): the kernel still runs every row (all tiles, all offsets), the reference
  only the rows compared, which keeps it affordable at T = 128k;
* rows without loss get exactly zero query (and gate) gradients: a backward that writes into the wrong
  rows fails here;
* outputs are NaN-poisoned before the Triton kernels write them, so an unwritten element fails.

The selected branch of the whole layer runs on the kernel's own top-n; its reference takes the same
indices (``gated_branches(indices=...)``), so a near-tie flipped by rounding does not move the
comparison, and the indices themselves are held to the reference's own top-n (``Tol.index``).
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import ARG_ORDER, skip_unavailable

from nsa import NSAConfig, dispatch, reference
from nsa import functional as fn
from nsa.backends.triton import poisoned_outputs
from nsa.numerics import rel_l2

WIN_BACKENDS = ("triton", "sdpa", "fa2")


@dataclass(frozen=True)
class Case:
    """One shape: B sequences of T tokens, H key/value heads of G query heads each, head dims Dk/Dv, the
    block sizes (l, d, l_sel, n_sel, w) and the last ``rows`` query rows compared."""

    B: int
    T: int
    H: int
    G: int
    Dk: int
    Dv: int
    blocks: tuple  # (l, d, l_sel, n_sel, w)
    rows: int

    @property
    def id(self) -> str:
        return f"G{self.G}-B{self.B}-T{self.T}-H{self.H}-Dk{self.Dk}-Dv{self.Dv}"

    def config(self) -> NSAConfig:
        l, d, l_sel, n_sel, w = self.blocks
        HQ = self.H * self.G
        return NSAConfig(dim=HQ * self.Dk, n_heads=HQ, n_kv_heads=self.H, d_k=self.Dk, d_v=self.Dv, l=l, d=d,
                         l_sel=l_sel, n_sel=n_sel, w=w, n_init=1, n_local=2)


@dataclass(frozen=True)
class Tol:
    """Relative L2 error allowed against the reference: outputs, input gradients; and the fraction of
    top-n slots that may differ from the reference's own top-n."""

    out: float
    grad: float
    index: float


def inputs(case: Case, device, dtype, seed: int = 0) -> dict:
    """Random inputs of every branch in ``dtype`` (queries and keys with std 2, so that the compressed
    softmax is far from uniform and the top-n depends on the data), with gradients."""
    cfg = case.config()
    g = torch.Generator(device=device).manual_seed(seed)
    B, T, H, HQ, Dk, Dv, Tc = case.B, case.T, case.H, cfg.n_heads, case.Dk, case.Dv, cfg.n_cmp(case.T)

    def r(*shape, std=1.0):  # drawn in dtype: at T = 128k a float32 draw of q would take 13 GB
        return (torch.randn(*shape, generator=g, device=device, dtype=dtype) * std).requires_grad_()

    return dict(q=r(B, T, HQ, Dk, std=2.0), k_cmp=r(B, Tc, H, Dk, std=2.0), v_cmp=r(B, Tc, H, Dv),
                k_sel=r(B, T, H, Dk, std=2.0), v_sel=r(B, T, H, Dv), k_win=r(B, T, H, Dk, std=2.0),
                v_win=r(B, T, H, Dv),
                gates=torch.rand(B, T, HQ, 3, generator=g, device=device, dtype=dtype).requires_grad_())


class Compare:
    """The kernel's loss on the last rows, its gradients, and the same on the reference."""

    def __init__(self, case: Case, x: dict, names, ref_dtype):
        self.case, self.x, self.names, self.R = case, x, list(names), case.rows
        g = torch.Generator(device=x["q"].device).manual_seed(1)
        HQ, Dv = case.H * case.G, case.Dv
        self.w = torch.randn(case.B, self.R, HQ, Dv, generator=g, device=x["q"].device, dtype=torch.float32)
        # The reference's inputs: the rows compared of the per-query tensors, every key, upcast.
        self.ref = {n: (x[n][:, -self.R:] if n in ("q", "gates") else x[n]).detach().to(ref_dtype).requires_grad_()
                    for n in self.names}

    def loss(self, o):
        return (o[:, -self.R:].float() * self.w.to(o.device)).sum()

    def kernel_grads(self, o) -> dict:
        return dict(zip(self.names, torch.autograd.grad(self.loss(o), [self.x[n] for n in self.names])))

    def ref_grads(self, o_ref) -> dict:
        loss = (o_ref.double() * self.w.double()).sum()
        return dict(zip(self.names, torch.autograd.grad(loss, [self.ref[n] for n in self.names])))

    def check(self, o, grads, o_ref, ref_grads, tol: Tol, what: str):
        """Output rows and every gradient within tolerance; rows without loss: exactly zero dq, dgates."""
        errs = {"out": rel_l2(o[:, -self.R:], o_ref)}
        for n in self.names:
            g = grads[n]
            if n in ("q", "gates"):
                assert not g[:, :-self.R].any(), f"{what}: d{n} of rows without loss is not zero"
                g = g[:, -self.R:]
            errs[f"d{n}"] = rel_l2(g, ref_grads[n])
        bad = {k: e for k, e in errs.items() if not e <= (tol.out if k == "out" else tol.grad)}  # NaN too
        assert not bad, f"{what}: over tolerance (out {tol.out:g}, gradients {tol.grad:g}): {bad}; all: {errs}"


def _mismatch(idx, idx_ref) -> float:
    return float((idx != idx_ref).double().mean()) if idx.numel() else 0.0


_BRANCH_WORDS = {"cmp": "the compressed branch", "sel": "the selected branch", "win": "the window"}


def _require(backend: str, branch: str, device, dtype) -> None:
    """Skips the test (``skip_unavailable``) where ``backend`` cannot run ``branch`` on device/dtype."""
    reason = dispatch.get(backend).unavailable(branch, device, dtype)
    if reason is not None:
        skip_unavailable(f"backend {backend!r} cannot run {_BRANCH_WORDS[branch]} on {device}/{dtype}: {reason}")


def cmp_branch(case: Case, device, dtype, ref_dtype, tol: Tol, backend="triton"):
    """The compressed branch (Eq. 5 over compressed keys, Eqs. 8-12 top-n): o_cmp, dq, dk_cmp, dv_cmp and
    the indices."""
    device = torch.device(device)
    _require(backend, "cmp", device, dtype)
    cfg, S = case.config(), case.T
    x = inputs(case, device, dtype)
    c = Compare(case, x, ("q", "k_cmp", "v_cmp"), ref_dtype)
    be = dispatch.choose("cmp", backend, device, dtype, None)
    with poisoned_outputs():
        o, idx = be.compressed(x["q"], x["k_cmp"], x["v_cmp"], cfg, scale=case.Dk ** -0.5, q_start=0, n_keys=S)
        grads = c.kernel_grads(o)
    r = c.ref
    o_ref, idx_ref = reference.compressed_branch(r["q"], r["k_cmp"], r["v_cmp"], cfg, q_start=S - case.rows, n_keys=S)
    c.check(o, grads, o_ref, c.ref_grads(o_ref), tol, f"cmp/{backend}")
    frac = _mismatch(idx[:, -case.rows:], idx_ref)
    assert frac <= tol.index, f"cmp/{backend}: {frac:.2%} of the top-n slots differ from the reference's (tol {tol.index:g})"


def sel_branch(case: Case, device, dtype, ref_dtype, tol: Tol, backend="triton"):
    """The selected branch on the compressed branch's own top-n (every row): o_sel, dq, dk_sel, dv_sel."""
    device = torch.device(device)
    cfg, S = case.config(), case.T
    x = inputs(case, device, dtype)
    with torch.no_grad():
        _, idx = dispatch.choose("cmp", "triton", device, dtype, None).compressed(
            x["q"], x["k_cmp"], x["v_cmp"], cfg, scale=case.Dk ** -0.5, q_start=0, n_keys=S)
    c = Compare(case, x, ("q", "k_sel", "v_sel"), ref_dtype)
    with poisoned_outputs():
        o = fn.selected_attention(x["q"], x["k_sel"], x["v_sel"], idx, cfg, backend=backend)
        grads = c.kernel_grads(o)
    r = c.ref
    o_ref = reference.selected_attention(r["q"], r["k_sel"], r["v_sel"], idx[:, -case.rows:], cfg, q_start=S - case.rows)
    c.check(o, grads, o_ref, c.ref_grads(o_ref), tol, f"sel/{backend}")


def win_branch(case: Case, device, dtype, ref_dtype, tol: Tol, backend: str):
    """The sliding window on ``backend``: o_win, dq, dk_win, dv_win."""
    device = torch.device(device)
    _require(backend, "win", device, dtype)
    cfg, S = case.config(), case.T
    x = inputs(case, device, dtype)
    c = Compare(case, x, ("q", "k_win", "v_win"), ref_dtype)
    with poisoned_outputs():
        o = fn.sliding_window_attention(x["q"], x["k_win"], x["v_win"], cfg, backend=backend)
        grads = c.kernel_grads(o)
    r = c.ref
    o_ref = reference.sliding_window_attention(r["q"], r["k_win"], r["v_win"], cfg, q_start=S - case.rows)
    c.check(o, grads, o_ref, c.ref_grads(o_ref), tol, f"win/{backend}")


def layer(case: Case, device, dtype, ref_dtype, tol: Tol, win: str, cmp: str = "triton"):
    """The whole layer (``nsa_attention``: the compressed branch on ``cmp``, the selected on triton, the window
    on ``win``, the gated sum, Eq. 5): the output with a gradient, the output without one (the gate fused into the selected
    branch), every input's gradient, and the top-n against the reference's own."""
    device = torch.device(device)
    _require(win, "win", device, dtype)
    _require(cmp, "cmp", device, dtype)
    cfg, S, R = case.config(), case.T, case.rows
    x = inputs(case, device, dtype)
    args = [x[n] for n in ARG_ORDER]
    plan = {"cmp": cmp, "sel": "triton", "win": win}
    c = Compare(case, x, ARG_ORDER, ref_dtype)
    with poisoned_outputs():
        o, idx = fn.nsa_attention(*args, cfg, backend=plan, return_indices=True)
        grads = c.kernel_grads(o)
        with torch.no_grad():
            o_fused = fn.nsa_attention(*args, cfg, backend=plan)
    ref_be = {b: dispatch.get("reference") for b in dispatch.BRANCHES}
    o_ref, idx_ref = fn.gated_branches(*(c.ref[n] for n in ARG_ORDER), cfg, ref_be, scale=case.Dk ** -0.5,
                                       q_start=S - R, streams=False, indices=idx[:, -R:])
    what = f"layer/win={win}" + ("" if cmp == "triton" else f"/cmp={cmp}")
    c.check(o, grads, o_ref, c.ref_grads(o_ref), tol, what)
    err = rel_l2(o_fused[:, -R:], o_ref)
    assert err <= tol.out, f"{what}: output without gradient rel-L2 {err:.3g} > {tol.out:g}"
    frac = _mismatch(idx[:, -R:], idx_ref)
    assert frac <= tol.index, f"{what}: {frac:.2%} of the top-n slots differ from the reference's (tol {tol.index:g})"


LONG_T = 65536  # cases from this length run in pytest-xdist's group BIG (each holds tens of GB on the GPU)
BIG = "big"    # tests that hold over ~10 GB of GPU memory: one worker runs them one after another


def param(case: Case, *rest):
    """A pytest parameter of a case (and more values), named after the case; long cases in the xdist group
    BIG (``pytest -n N --dist loadgroup`` runs them one after another in one worker)."""
    marks = [pytest.mark.xdist_group(BIG)] if case.T >= LONG_T else []
    return pytest.param(case, *rest, id="-".join([case.id, *map(str, rest)]), marks=marks)


def tests(cases, device: str, dtype, ref_dtype, tol: Tol, win_backends, layer_params):
    """A test module's four tests over its cases (``test_cmp, test_sel, test_win, test_layer = tests(...)``):
    each branch on every case (the window on each of ``win_backends``), and the layer on ``layer_params``
    (``param(case, window backend)``), each marked with the kernel it checks."""
    @pytest.mark.kernel("cmp")
    @pytest.mark.parametrize("case", [param(c) for c in cases])
    def test_cmp(case):
        cmp_branch(case, device, dtype, ref_dtype, tol)

    @pytest.mark.kernel("sel")
    @pytest.mark.parametrize("case", [param(c) for c in cases])
    def test_sel(case):
        sel_branch(case, device, dtype, ref_dtype, tol)

    @pytest.mark.kernel("win")
    @pytest.mark.parametrize("case,backend", [param(c, b) for c in cases for b in win_backends])
    def test_win(case, backend):
        win_branch(case, device, dtype, ref_dtype, tol, backend)

    @pytest.mark.kernel("layer")
    @pytest.mark.parametrize("case,win", layer_params)
    def test_layer(case, win):
        layer(case, device, dtype, ref_dtype, tol, win)

    return test_cmp, test_sel, test_win, test_layer
