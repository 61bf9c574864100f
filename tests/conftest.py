"""Shared fixtures for the NSA core tests: configs and random float64 inputs, packed documents, the
``gpu`` marker's rule (deselected where CUDA is not available; ``-m gpu`` collects only the GPU modules),
a skip for a backend that cannot run on this device, and the ``--inject-fault`` test switch."""
from __future__ import annotations

import inspect
import itertools
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


def pytest_addoption(parser):
    parser.addoption("--inject-fault", default=None, choices=("cmp", "sel", "win"),
                     help="test switch: that branch's output is wrong in every backend but the reference "
                          "(experiments/validation/faults.py); the kernel tests must then fail")
    parser.addoption("--daemons", action="store_true", default=False,
                     help="run the tests marked daemons, which install and start system services (.ci/run does)")


@pytest.fixture(autouse=True)
def _injected_fault(request):
    branch = request.config.getoption("--inject-fault")
    if branch is None:
        yield
        return
    from experiments.validation import faults

    with faults.inject(branch):
        yield


def pytest_ignore_collect(collection_path, config):
    """``-m gpu`` collects only the GPU modules (tests/test_*_gpu.py): the interpreter's test modules set
    TRITON_INTERPRET=1 when imported, which would turn the compiled GPU tests into interpreted ones."""
    if config.getoption("markexpr") == "gpu" and collection_path.suffix == ".py" \
            and collection_path.name.startswith("test_") and not collection_path.stem.endswith("_gpu"):
        return True
    return None


UNAVAILABLE = "unavailable here: "


def skip_unavailable(reason: str):
    """Skip a test whose backend cannot run this path on this device, by the backend's own check (its
    reason): experiments.validate reports such a test as not run here, any other skip as a failure."""
    pytest.skip(UNAVAILABLE + reason)


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


@pytest.fixture(autouse=True)
def _release_gpu_memory(request):
    """After each test, PyTorch's cached GPU blocks go back to the device: with pytest-xdist several
    processes share one GPU, and one worker's cache would starve another's allocation. The test's peak
    of allocated GPU memory is recorded as the junit property ``peak_gib`` (experiments.validate's
    kernel table shows it: what a card needs to run the case)."""
    if _cuda_in_use():
        torch.cuda.reset_peak_memory_stats()
    yield
    if _cuda_in_use():  # the test itself may have been the first to touch CUDA
        request.node.user_properties.append(("peak_gib", f"{torch.cuda.max_memory_allocated() / 2**30:.2f}"))
        torch.cuda.empty_cache()


# The quick tier (``pytest -m quick``, the README's Quickstart): in-process tests of the reference, the configs,
# the models and the README, and the Triton kernels' interpreted twin of the GPU tests; a few minutes on 2
# cores. Named here, not by default: a new module joins the full suite only, so the tier stays quick; a test
# marked ``slow`` stays out of it.
QUICK_MODULES = frozenset(f"test_{m}.py" for m in (
    "conf", "lm_conf", "core_dense", "core_errors", "core_module", "core_oracle", "core_select", "core_varlen",
    "core_training", "flex_mask", "numerics", "parity_ties", "lm_data", "lm_model", "lm_probes", "sweep_parts",
    "block_sharing", "ragged_decode", "backends_sdpa", "toolchain", "decode_memory", "triton_gate", "readme",
    "kernels_interpret"))


def pytest_collection_modifyitems(config, items):
    """Tests of QUICK_MODULES not marked ``slow`` get the ``quick`` marker. Tests marked ``daemons`` skip unless
    ``--daemons`` asks for them (a plain pytest starts no system service). Tests marked ``gpu`` run compiled
    kernels on CUDA: without a CUDA device they are deselected (reported as deselected, never as passed or
    skipped)."""
    for item in items:
        if item.path.name in QUICK_MODULES and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.quick)
        if item.get_closest_marker("daemons") and not config.getoption("--daemons"):
            item.add_marker(pytest.mark.skip(reason="starts SLURM, munge and MariaDB as root: run with pytest --daemons"))
    if torch.cuda.is_available():
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]


# ------------------------------------------------------------------------------------------------
# Packed documents (cu_seqlens)
# ------------------------------------------------------------------------------------------------
def cu_of(lens, device="cpu") -> torch.Tensor:
    """cu_seqlens (int32) of documents of these lengths."""
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)


def doc_lengths(cfg: NSAConfig) -> list[int]:
    """Document lengths at every edge of a config: 1 token, l - 1 (no compressed token), l (one), l_sel + 3
    (a second selection block), an empty document, w + 5 (past the window), and one past n_sel blocks."""
    return [1, cfg.l - 1, cfg.l, cfg.l_sel + 3, 0, cfg.w + 5, (cfg.n_sel + 1) * cfg.l_sel + cfg.d + 1]


def packed_inputs(cfg: NSAConfig, lens, seed: int = 0, dtype=F64, requires_grad: bool = False, device="cpu"):
    """random_inputs over the N packed tokens of ``lens`` (B = 1), with k_cmp/v_cmp packed per document."""
    N = sum(lens)
    x = random_inputs(cfg, 1, N, seed=seed, dtype=dtype)
    Tc = sum(cfg.n_cmp(n) for n in lens)
    g = torch.Generator().manual_seed(seed + 1)
    x["k_cmp"] = torch.randn(1, Tc, cfg.n_kv_heads, cfg.d_k, generator=g, dtype=F64).mul(2).to(dtype)
    x["v_cmp"] = torch.randn(1, Tc, cfg.n_kv_heads, cfg.d_v, generator=g, dtype=F64).to(dtype)
    return {k: v.to(device).requires_grad_(requires_grad) for k, v in x.items()}


def document_slices(cfg: NSAConfig, lens):
    """(raw token slice, compressed token slice) of each document."""
    raw = list(itertools.accumulate(lens, initial=0))
    cmp = list(itertools.accumulate((cfg.n_cmp(n) for n in lens), initial=0))
    return [(slice(a, b), slice(c, e)) for a, b, c, e in zip(raw, raw[1:], cmp, cmp[1:])]


def per_document(fn, cfg: NSAConfig, lens, x: dict, names=ARG_ORDER):
    """``fn(*each document's slices of x[names])`` run on every non-empty document alone (k_cmp/v_cmp by their
    own offsets), outputs (a tensor or a tuple of them) concatenated along the token axis."""
    outs = []
    for raw, cmp in document_slices(cfg, lens):
        if raw.stop > raw.start:
            outs.append(fn(*(x[n][:, cmp if n in ("k_cmp", "v_cmp") else raw] for n in names)))
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(_same_width(parts), 1) for parts in zip(*outs))
    return torch.cat(outs, 1)


def _same_width(parts):
    """Index tensors of documents alone, -1 padded to the widest: a short document alone has fewer
    columns (n_sel bounded by its blocks, NSAConfig.sel_count) than the packed call's."""
    if parts[0].dtype.is_floating_point:
        return parts
    k = max(p.shape[-1] for p in parts)
    return [torch.nn.functional.pad(p, (0, k - p.shape[-1]), value=-1) for p in parts]


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def check_empty_inputs(backend: str, B: int, T: int, dtype=F64, win: str | None = None):
    """Every public function on empty inputs (B = 0 or T = 0: no query) returns empty outputs of the
    right shape, as torch's scaled_dot_product_attention does, and a backward through nsa_attention
    gives (empty or zero) gradients of the inputs' shapes. ``backend`` runs the dispatched branches,
    ``win`` (default: the same) the window branch."""
    from nsa import NSAAttention
    from nsa import functional as fn

    cfg = make_config(HQ=4, H=2, Dk=16, Dv=8, l=8, d=4, l_sel=8, n_sel=3, w=8)
    x = random_inputs(cfg, B, T, dtype=dtype, requires_grad=True)
    args = [x[a] for a in ARG_ORDER]
    win = win or backend
    plan = {"cmp": backend, "sel": backend, "win": win}
    o, idx = fn.nsa_attention(*args, cfg, backend=plan, return_indices=True)
    assert o.shape == (B, T, 4, 8) and idx.shape == (B, T, 2, 3) and idx.dtype == torch.int64
    grads = torch.autograd.grad(o.sum(), args, allow_unused=True)
    assert all(g is None or (g.shape == a.shape and not g.any()) for g, a in zip(grads, args))
    with torch.no_grad():  # the forward without gradient (the selected branch's fused gate)
        assert fn.nsa_attention(*args, cfg, backend=plan).shape == (B, T, 4, 8)
        q = x["q"]
        assert fn.compress(x["k_sel"], cfg).shape == (B, cfg.n_cmp(T), 2, 16)
        o_c, p = fn.compressed_attention(q, x["k_cmp"], x["v_cmp"], cfg)
        assert o_c.shape == (B, T, 4, 8) and p.shape == (B, T, 4, cfg.n_cmp(T))
        assert fn.selection_scores(p, cfg, cfg.n_blocks(T)).shape == (B, T, 2, cfg.n_blocks(T))
        assert fn.select_blocks(torch.zeros(B, T, 2, cfg.n_blocks(T), dtype=dtype), cfg).shape == (B, T, 2, 3)
        none = torch.full((B, T, 2, 3), -1, dtype=torch.int64)
        assert fn.selected_attention(q, x["k_sel"], x["v_sel"], none, cfg, backend=backend).shape == (B, T, 4, 8)
        assert fn.sliding_window_attention(q, x["k_win"], x["v_win"], cfg, backend=win).shape == (B, T, 4, 8)
        layer = NSAAttention(cfg, backend=plan).to(dtype)
        xs = torch.zeros(B, T, cfg.dim, dtype=dtype)
        assert layer(xs).shape == (B, T, cfg.dim)
        if B:  # a cache needs a batch; T = 0 appends nothing
            cache = layer.new_cache(B, 16)
            assert layer(xs, cache).shape == (B, T, cfg.dim) and cache.length == T


@pytest.fixture(scope="module")
def fast_interpreter():
    """Triton's interpreter re-patches triton.language on every nested @jit call (tl.max, tl.sum,
    tl.cdiv ...), ~5 ms each; skip a re-patch of modules the running kernel already patched.
    Test-speed only (the patched names are the same either way); restored after the module that
    uses it (``pytest.mark.usefixtures("fast_interpreter")``)."""
    import triton.language as tl
    from triton.runtime import interpreter as interp

    if not (hasattr(interp, "_patch_lang") and hasattr(interp, "_LangPatchScope")):
        # Older interpreters (triton 3.0: _patch_lang returns nothing to restore; 2.3: no
        # _patch_lang function) run unchanged, just slower.
        yield
        return
    orig = interp._patch_lang
    state = {"done": None}

    class _Null:
        def restore(self):
            pass

    def fast(fn):
        langs = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        if state["done"] is not None and langs <= state["done"]:
            return _Null()
        scope = orig(fn)
        if state["done"] is None:
            inner = scope.restore

            def restore():
                state["done"] = None
                inner()
            scope.restore = restore
            state["done"] = langs
        else:
            state["done"] = state["done"] | langs
        return scope

    interp._patch_lang = fast
    yield
    interp._patch_lang = orig


@pytest.fixture(params=["gather", "masked"])
def attend_path(request, monkeypatch):
    """Runs a test on both ways the reference computes the selected and sliding branches: each query's
    gathered key list, and every key under a mask (nsa/reference.py ``_masked_attend``, taken where it is no
    larger). Forced either way, so neither hides the other at the tests' small shapes."""
    from nsa import reference

    monkeypatch.setattr(reference, "_masked_cheaper", lambda *a: request.param == "masked")
    return request.param
