"""Shared fixtures for the NSA core tests: configs and random float64 inputs."""
from __future__ import annotations

import math

import pytest
import torch

from nsa import NSAConfig

F64 = torch.float64

# These tests run many ops on tiny tensors; there, intra-op threads only add synchronization, and on a
# loaded 2-core CI machine they made the suite ~10x slower. One thread; results do not depend on it.
torch.set_num_threads(1)


def make_config(**kw) -> NSAConfig:
    """An NSAConfig from the short names used in the tests' parameter tables."""
    kw = dict(kw)
    kw.pop("B", None)  # B and T are not config fields
    kw.pop("T", None)
    HQ, H = kw.pop("HQ"), kw.pop("H")
    Dk, Dv = kw.pop("Dk"), kw.pop("Dv")
    return NSAConfig(dim=HQ * Dk, n_heads=HQ, n_kv_heads=H, d_k=Dk, d_v=Dv, **kw)


def random_inputs(cfg: NSAConfig, B: int, T: int, seed: int = 0, *, S: int | None = None, q_start: int = 0,
                  dtype=F64, requires_grad: bool = False) -> dict:
    """Random q over T query rows at positions q_start.., and keys/values of all branches over S keys.

    Queries and keys are scaled up a little (std 2) so that the compressed softmax is far from uniform
    and the top-n choice depends on the data.
    """
    S = q_start + T if S is None else S
    g = torch.Generator().manual_seed(seed)
    HQ, H, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v
    Tc = cfg.n_cmp(S)

    def r(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, dtype=F64) * std).to(dtype).requires_grad_(requires_grad)

    return dict(
        q=r(B, T, HQ, Dk, std=2.0),
        k_cmp=r(B, Tc, H, Dk, std=2.0), v_cmp=r(B, Tc, H, Dv),
        k_sel=r(B, S, H, Dk, std=2.0), v_sel=r(B, S, H, Dv),
        k_win=r(B, S, H, Dk, std=2.0), v_win=r(B, S, H, Dv),
        gates=torch.rand(B, T, HQ, 3, generator=g, dtype=F64).to(dtype).requires_grad_(requires_grad),
    )


ARG_ORDER = ("q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win", "gates")


def oracle_kwargs(cfg: NSAConfig) -> dict:
    return dict(l=cfg.l, d=cfg.d, l_sel=cfg.l_sel, n_sel=cfg.n_sel, w=cfg.w, n_init=cfg.n_init,
                n_local=cfg.n_local, scale=1.0 / math.sqrt(cfg.d_k))


def dense_causal_attention(q, k, v, scale=None):
    """Full causal attention in float64 with plain torch ops; query head h reads kv head h // G."""
    T, HQ, Dk = q.shape[1:]
    S, H = k.shape[1], k.shape[2]
    G = HQ // H
    scale = 1.0 / math.sqrt(Dk) if scale is None else scale
    kk = k.to(F64).repeat_interleave(G, dim=2)  # [B,S,HQ,Dk]: head h -> kv head h // G
    vv = v.to(F64).repeat_interleave(G, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q.to(F64), kk) * scale
    t = torch.arange(S - T, S)[:, None]
    s = s.masked_fill(torch.arange(S)[None, :] > t, float("-inf"))
    return torch.einsum("bhts,bshd->bthd", torch.softmax(s, dim=-1), vv)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
