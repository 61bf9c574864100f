"""nsa.NSAAttention: causality, cached decode == prefill, and gradients (float64)."""
from __future__ import annotations

import pytest
import torch
from conftest import ARG_ORDER, make_config, random_inputs

from nsa import NSAAttention, NSAConfig
from nsa import functional as fn

F64 = torch.float64
TOL = 1e-10


def small_layer(phi="mlp", seed=0, **over) -> NSAAttention:
    # T = 45 below crosses n_sel * l_sel = 24 and w = 6; compressed tokens end at 7, 11, 15, ...
    kw = dict(dim=16, n_heads=4, n_kv_heads=2, d_k=4, d_v=6, l=8, d=4, l_sel=8, n_sel=3, w=6, n_init=1,
              n_local=1, phi=phi, gate_hidden=8)
    torch.manual_seed(seed)
    return NSAAttention(NSAConfig(**{**kw, **over})).double()


# ------------------------------------------------------------------------------------------------
# Causality
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("phi", ["mlp", "avg"])
def test_future_tokens_never_change_past_outputs(phi):
    layer = small_layer(phi)
    B, T = 2, 48
    x = torch.randn(B, T, 16, dtype=F64)
    with torch.no_grad():
        y = layer(x)
        # 6 (before any compressed token), 7 (first token emitted), 10, 11, 30, 46 (last but one)
        for t in (0, 6, 7, 10, 11, 30, 46):
            x2 = x.clone()
            x2[:, t + 1:] = torch.randn(B, T - t - 1, 16, dtype=F64) * 3
            y2 = layer(x2)
            assert (y2[:, : t + 1] - y[:, : t + 1]).abs().max().item() <= 1e-12, t
            # ... while every later output does see the change
            assert (y2[:, t + 1:] - y[:, t + 1:]).abs().amax(dim=(0, 2)).min().item() > 1e-6


@pytest.mark.parametrize("phi", ["mlp", "avg"])
def test_gradient_of_past_outputs_wrt_future_inputs_is_zero(phi):
    layer = small_layer(phi)
    T = 40
    x = torch.randn(1, T, 16, dtype=F64, requires_grad=True)
    y = layer(x)
    for t in (5, 11, 23, 38):
        (g,) = torch.autograd.grad(y[:, t].sum(), x, retain_graph=True)
        assert torch.all(g[:, t + 1:] == 0), t
        assert g[:, t].abs().max() > 0 and g[:, 0].abs().max() > 0


# ------------------------------------------------------------------------------------------------
# Decode == prefill
# ------------------------------------------------------------------------------------------------
def _chunks(pattern, T):
    out, s, i = [], 0, 0
    while s < T:
        n = min(pattern[i % len(pattern)], T - s)
        out.append(n)
        s, i = s + n, i + 1
    return out


# Emission steps (t = i*d + l - 1) are 7, 11, 15, ...; these patterns end chunks before, on and after them.
PATTERNS = {
    "token_by_token": [1],
    "one_chunk": [45],
    "prefill_then_tokens": [13] + [1] * 32,
    "straddle_3_5": [3, 5],
    "straddle_6_4_9": [6, 4, 9],
    "stride_multiple": [8, 4],
    "uneven": [2, 11, 1, 7],
}


@pytest.mark.parametrize("phi", ["mlp", "avg"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_chunked_decode_equals_prefill(phi, pattern):
    layer = small_layer(phi)
    B, T = 2, 45
    x = torch.randn(B, T, 16, dtype=F64)
    with torch.no_grad():
        want = layer(x)
        cache = layer.new_cache(B, max_len=T)
        outs, s = [], 0
        for n in _chunks(PATTERNS[pattern], T):
            outs.append(layer(x[:, s: s + n], cache))
            s += n
            assert cache.length == s
        got = torch.cat(outs, dim=1)
    assert (got - want).abs().max().item() <= TOL
    # The compressed stream in the cache equals the one prefill builds.
    with torch.no_grad():
        pos = torch.arange(T)
        _, kv, _ = layer.project(x, pos)
        k_cmp, v_cmp = layer.compress(kv["k_cmp_raw"], kv["v_cmp_raw"])
    assert (cache.k_cmp - k_cmp).abs().max().item() <= TOL
    assert (cache.v_cmp - v_cmp).abs().max().item() <= TOL


def test_decode_in_a_longer_cache_and_after_reset():
    """max_len > T (unused cache rows), and a reset cache reused for another batch of sequences."""
    layer = small_layer("mlp")
    B, T = 3, 30
    cache = layer.new_cache(B, max_len=64)
    with torch.no_grad():
        for seed in (1, 2):
            x = torch.randn(B, T, 16, dtype=F64, generator=torch.Generator().manual_seed(seed))
            cache.reset()
            got = torch.cat([layer(x[:, s: s + 1], cache) for s in range(T)], dim=1)
            assert (got - layer(x)).abs().max().item() <= TOL
            assert cache.length == T


@pytest.mark.parametrize("shared_kv", [False, True])
def test_projection_biases_reach_the_output_and_decode_equals_prefill(shared_kv):
    """qkv_bias / o_bias (a converted Qwen2's or biased Llama's attention): every projection carries a bias that
    changes the output, and the cached decode still equals prefill."""
    layer = small_layer("mlp", qkv_bias=True, o_bias=True, shared_kv=shared_kv)
    biases = {n for n, p in layer.named_parameters() if n.endswith(".bias") and "proj" in n}
    want = {"q_proj.bias", "o_proj.bias"} | {f"kv_proj.{k}_{b}.bias" for k in "kv" for b in ("sel", "cmp", "win")}
    assert biases == ({"q_proj.bias", "o_proj.bias", "kv_proj.k_sel.bias", "kv_proj.v_sel.bias"} if shared_kv else want)
    B, T = 2, 45
    x = torch.randn(B, T, 16, dtype=F64)
    with torch.no_grad():
        y = layer(x)
        cache = layer.new_cache(B, max_len=T)
        steps = torch.cat([layer(x[:, :20], cache)] + [layer(x[:, t:t + 1], cache) for t in range(20, T)], 1)
        assert (steps - y).abs().max().item() <= TOL
        for name in biases:
            dict(layer.named_parameters())[name].add_(0.5)
            assert (layer(x) - y).abs().max().item() > 1e-3, name
            dict(layer.named_parameters())[name].sub_(0.5)


def test_append_past_max_len_raises_and_leaves_the_cache_intact():
    layer = small_layer("mlp")
    B, T = 2, 20
    x = torch.randn(B, T, 16, dtype=F64)
    with torch.no_grad():
        want = layer(x)
        cache = layer.new_cache(B, max_len=T)
        first = layer(x[:, :15], cache)
        before = {n: getattr(cache, n).clone() for n in
                  ("k_cmp_raw", "v_cmp_raw", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win")}
        with pytest.raises(ValueError, match=r"cache: appending 6 tokens at position 15 exceeds max_len=20"):
            layer(torch.randn(B, 6, 16, dtype=F64), cache)
        assert cache.length == 15
        for n, t in before.items():
            assert torch.equal(getattr(cache, n), t), n
        rest = layer(x[:, 15:], cache)  # exactly fills the cache
        assert cache.length == T
        with pytest.raises(ValueError, match="exceeds max_len"):
            layer(x[:, :1], cache)
        assert cache.length == T
    assert (torch.cat([first, rest], 1) - want).abs().max().item() <= TOL


# ------------------------------------------------------------------------------------------------
# Gradients
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("phi", ["mlp", "avg"])
def test_gradcheck_module_wrt_input(phi):
    # T = 14 with l = 4, d = 2, l_sel = 4, n_sel = 2: 4 blocks > n_sel, so top-n really chooses.
    cfg = NSAConfig(dim=4, n_heads=2, n_kv_heads=1, d_k=2, d_v=2, l=4, d=2, l_sel=4, n_sel=2, w=3,
                    n_init=1, n_local=0, phi=phi, gate_hidden=4)
    torch.manual_seed(0)
    layer = NSAAttention(cfg).double()
    x = torch.randn(1, 14, 4, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (x,), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_nsa_attention_all_branches():
    cfg = make_config(HQ=2, H=1, Dk=3, Dv=2, l=4, d=2, l_sel=4, n_sel=2, w=3, n_init=1, n_local=0)
    x = random_inputs(cfg, 1, 14, seed=5, requires_grad=True)
    args = tuple(x[a] for a in ARG_ORDER)

    def f(*a):
        return fn.nsa_attention(*a, cfg)

    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7, rtol=1e-5)
    # Every input is live (a zero gradient would let gradcheck pass vacuously for it).
    grads = torch.autograd.grad(f(*args).square().sum(), args)
    for name, g in zip(ARG_ORDER, grads, strict=True):
        assert g.abs().max() > 1e-6, name


@pytest.mark.slow  # a process of its own: not the quick tier's
def test_a_layer_on_the_meta_device_leaves_dynamo_unimported():
    """The memory estimates build the layer on the meta device: that must not import torch._dynamo (a meta
    multiply's Python kernel does, on its first call), which every decode and prefill run would pay for."""
    import subprocess
    import sys

    code = ("import sys, torch\nfrom nsa import NSAAttention, NSAConfig\nwith torch.device('meta'):\n"
            "    n = sum(p.numel() for p in NSAAttention(NSAConfig(dim=64, n_heads=4, n_kv_heads=2, d_k=16, d_v=16,"
            " l=8, d=4, l_sel=8, n_sel=4, w=16, phi='mlp')).parameters())\n"
            "print(n, 'torch._dynamo' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    n, imported = p.stdout.split()
    assert int(n) > 0 and imported == "False", p.stdout
