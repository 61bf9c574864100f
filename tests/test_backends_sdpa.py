"""The ``sdpa`` and ``fa2`` backends on the CPU: what runs there equals the reference, and every
branch they cannot run raises ``BackendUnavailable`` naming the branch and the reason (no silent
fallback). Their CUDA paths (FlexAttention, PyTorch's FlashAttention-2) are measured in bf16 against
the reference by `python -m experiments.kernels op=window` on a GPU (metrics check_sdpa_*, check_fa2_*).
"""

from __future__ import annotations

import pytest
import torch

from nsa import NSAConfig, dispatch, reference
from nsa.dispatch import BackendUnavailable
from nsa.functional import nsa_attention, sliding_window_attention


def cfg_of(HQ=4, H=2, Dk=16, Dv=24, w=8):
    return NSAConfig(dim=HQ * Dk, n_heads=HQ, n_kv_heads=H, d_k=Dk, d_v=Dv, l=4, d=2, l_sel=4, n_sel=3, w=w)


def inputs(cfg, B=2, T=20, dtype=torch.float64, seed=0, q_start=0):
    g = torch.Generator().manual_seed(seed)
    S = q_start + T

    def r(*s, std=1.0):
        return (torch.randn(*s, generator=g, dtype=torch.float64) * std).to(dtype)

    H, HQ, Dk, Dv = cfg.n_kv_heads, cfg.n_heads, cfg.d_k, cfg.d_v
    Tc = cfg.n_cmp(S)
    return dict(
        q=r(B, T, HQ, Dk, std=2.0),
        k_cmp=r(B, Tc, H, Dk),
        v_cmp=r(B, Tc, H, Dv),
        k_sel=r(B, S, H, Dk),
        v_sel=r(B, S, H, Dv),
        k_win=r(B, S, H, Dk, std=2.0),
        v_win=r(B, S, H, Dv),
        gates=torch.rand(B, T, HQ, 3, generator=g, dtype=torch.float64).to(dtype),
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "HQ,H,Dk,Dv,w,T,q_start",
    [(4, 2, 16, 24, 8, 20, 0), (16, 1, 8, 8, 5, 9, 0), (2, 2, 16, 16, 64, 12, 0), (8, 2, 16, 16, 6, 3, 30)],
)
def test_sdpa_window_cpu_matches_reference(dtype, HQ, H, Dk, Dv, w, T, q_start):
    cfg = cfg_of(HQ, H, Dk, Dv, w)
    x = inputs(cfg, T=T, dtype=dtype, q_start=q_start)
    xs = [x[n].clone().requires_grad_() for n in ("q", "k_win", "v_win")]
    with dispatch.record() as rec:
        o = sliding_window_attention(*xs, cfg, q_start=q_start, backend="sdpa")
    assert rec.ran == {"win": "sdpa"}
    rx = [x[n].clone().requires_grad_() for n in ("q", "k_win", "v_win")]
    ro = reference.sliding_window_attention(*rx, cfg, q_start=q_start)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(o, ro, rtol=tol, atol=tol)
    do = torch.randn_like(o)
    for a, b in zip(torch.autograd.grad(o, xs, do), torch.autograd.grad(ro, rx, do)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_sdpa_in_nsa_attention_for_win():
    cfg = cfg_of()
    x = inputs(cfg)
    with dispatch.record() as rec:
        o = nsa_attention(**x, config=cfg, backend={"win": "sdpa"})
    assert rec.ran == {"cmp": "reference", "sel": "reference", "win": "sdpa"} and not rec.fallbacks
    torch.testing.assert_close(o, nsa_attention(**x, config=cfg), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("branch,words", [("cmp", "Eq. 9"), ("sel", "Eq. 12")])
def test_sdpa_unavailable_branches_raise(branch, words):
    cfg = cfg_of()
    x = inputs(cfg)
    with pytest.raises(BackendUnavailable) as e:
        nsa_attention(**x, config=cfg, backend={branch: "sdpa"})
    msg = str(e.value)
    assert f"branch {branch!r}" in msg and "'sdpa'" in msg and words in msg


def test_fa2_unavailable_on_cpu_names_branch_and_reason():
    cfg = cfg_of()
    x = inputs(cfg, dtype=torch.float16)
    with pytest.raises(BackendUnavailable) as e:
        nsa_attention(**x, config=cfg, backend="fa2")
    msg = str(e.value)
    assert "branch 'cmp'" in msg and "'fa2'" in msg and "Eq. 9" in msg
    with pytest.raises(BackendUnavailable) as e:
        nsa_attention(**x, config=cfg, backend={"win": "fa2"})
    msg = str(e.value)
    assert "branch 'win'" in msg and "CUDA" in msg
    with pytest.raises(BackendUnavailable) as e:
        sliding_window_attention(x["q"], x["k_win"], x["v_win"], cfg, backend="fa2")
    assert "branch 'win'" in str(e.value)


def test_fa2_reasons_and_impl():
    be = dispatch.get("fa2")
    assert be.impl.startswith("fa2:")
    cpu = torch.device("cpu")
    cuda = torch.device("cuda")
    assert "CUDA" in be.unavailable("win", cpu, torch.float16)
    assert "float16/bfloat16" in be.unavailable("win", cuda, torch.float32)
    assert "Eq. 12" in be.unavailable("sel", cuda, torch.bfloat16)


def test_explicit_fallback_is_recorded():
    cfg = cfg_of()
    x = inputs(cfg)
    with dispatch.record() as rec, pytest.warns(RuntimeWarning, match="fallback"):
        o = nsa_attention(**x, config=cfg, backend={"cmp": "fa2"}, fallback="reference")
    assert (
        rec.ran["cmp"] == "reference"
        and rec.fallbacks
        and rec.fallbacks[0].startswith("cmp: fa2 -> reference")
    )
    torch.testing.assert_close(o, nsa_attention(**x, config=cfg), rtol=1e-12, atol=1e-12)
