"""The flash_nsa peer of ``experiments.prefill`` (experiments/peers.py): why it is skipped, that only its ops are
imported (not the package's ``__init__``), and what its row calls, with a stand-in package on the CPU (the real
kernels run on CUDA: bash scripts/bench.sh cmp-peers)."""
from __future__ import annotations

import sys

import pytest
import torch

from experiments import peers
from experiments.measure.inputs import CoreInputs
from nsa import NSAConfig

CFG = NSAConfig(dim=64, n_heads=4, n_kv_heads=1, d_k=16, d_v=16, l=8, d=4, l_sel=8, n_sel=4, w=16)

FAKE_OPS = {
    "__init__.py": "raise ImportError('the package __init__ ran')\n",
    "utils.py": ("class NSAHelper:\n    calls = []\n    @classmethod\n"
                 "    def set_hyperparameters(cls, **kw): cls.calls.append(kw)\n"
                 "    @classmethod\n    def init_cu_seqlens(cls, cu): cls.calls.append(cu.tolist())\n"),
    "ops/__init__.py": "",
    "ops/compress_attn.py": "def compress_attn(q, k, v, sm_scale): return q * 0 + 1, None\n",
    "ops/topk.py": "def slc_topk_indices(q, k, lse, sm_scale, **kw): return kw, None\n",
    "ops/select_attn.py": "def select_attn(q, k, v, topk, sm_scale): assert topk['scale_slc_p']; return q * 0 + 2\n",
    "ops/combine.py": "def fused_sigmoid_combine(a, b, c, w): return a + b + c * 0 + 10 * w[..., :1]\n",
}


@pytest.fixture
def fake_flash_nsa(tmp_path, monkeypatch):
    for name, text in FAKE_OPS.items():
        (tmp_path / "flash_nsa" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "flash_nsa" / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    for m in [m for m in sys.modules if m == "flash_nsa" or m.startswith("flash_nsa.")]:
        monkeypatch.delitem(sys.modules, m)
    yield
    for m in [m for m in sys.modules if m == "flash_nsa" or m.startswith("flash_nsa.")]:
        del sys.modules[m]


def test_skip_reasons(monkeypatch):
    odd = NSAConfig(dim=64, n_heads=4, n_kv_heads=1, d_k=16, d_v=16, l=12, d=6, l_sel=12, n_sel=4, w=16)
    assert "power-of-two stride" in peers.flash_nsa_unavailable(odd, torch.device("cuda"))
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None)
    assert "not importable" in peers.flash_nsa_unavailable(CFG, torch.device("cuda"))


def test_cpu_is_refused_and_ops_load_without_the_package_init(fake_flash_nsa):
    assert peers.flash_nsa_unavailable(CFG, torch.device("cpu")) == "flash_nsa's kernels run on CUDA only"
    helper, ops = peers._flash_nsa_ops()
    assert peers._flash_nsa_ops()[1] == ops and peers.importlib.util.find_spec("flash_nsa") is not None  # again: prefill's order
    assert set(ops) == {"compress_attn", "topk", "select_attn", "combine"} and helper.__name__ == "NSAHelper"


def test_row_calls_its_ops_on_the_projects_inputs(fake_flash_nsa, monkeypatch):
    B, S = 2, 12
    r = lambda *s: torch.randn(*s)  # noqa: E731
    x = CoreInputs(r(B, S, 4, 16), r(B, 2, 1, 16), r(B, 2, 1, 16), r(B, S, 1, 16), r(B, S, 1, 16), r(B, S, 1, 16),
                   r(B, S, 1, 16), r(B, S, 4, 3))
    import nsa.backends.triton.window as win

    seen = []
    monkeypatch.setattr(win, "sliding_window_attention",
                        lambda q, k, v, c, **kw: seen.append((q.shape, kw)) or torch.zeros_like(q))
    p = peers.flash_nsa(x, CFG)
    o = p.fn()
    assert p.name == "flash_nsa" and p.branches == ("cmp", "sel", "win") and "window: this project's triton" in p.note
    assert o.shape == (B, S, 4, 16)
    assert torch.equal(o, torch.full_like(o, 3.0) + 10 * x.gates[..., :1])
    assert seen == [((B, S, 4, 16), {"scale": 0.25, "q_start": 0})]
    helper = sys.modules["flash_nsa.utils"].NSAHelper
    assert helper.calls[0] == dict(kernel_size=8, stride=4, block_size=8, window_size=16, top_n=4, num_init_blocks=1,
                                   num_local_blocks=2)
    assert helper.calls[1] == [0, 12, 24]


def test_selection_alone_passes_heads_first_indices(fake_flash_nsa, monkeypatch):
    """op=selection's flash_nsa row: select_attn gets [t, heads, D] tensors and the indices as [H, B*S, n_sel]."""
    B, S, H, n = 2, 12, 2, 3
    c = NSAConfig(dim=64, n_heads=4, n_kv_heads=H, d_k=16, d_v=8, l=8, d=4, l_sel=8, n_sel=n, w=16)
    q, k, v = torch.randn(B, S, 4, 16), torch.randn(B, S, H, 16), torch.randn(B, S, H, 8)
    idx = torch.randint(-1, 2, (B, S, H, n), dtype=torch.int32)
    fn = peers.flash_nsa_selection(c, B, S, torch.device("cpu"))
    got = {}

    def select_attn(q_, k_, v_, topk, sm_scale):
        got.update(q=q_, k=k_, topk=topk, scale=sm_scale)
        return torch.arange(q_.shape[0] * q_.shape[1] * v_.shape[-1], dtype=torch.float32).view(*q_.shape[:2], -1)

    monkeypatch.setattr(sys.modules["flash_nsa.ops.select_attn"], "select_attn", select_attn)
    o = fn(q, k, v, idx)
    assert got["topk"].shape == (H, B * S, n) and got["topk"].is_contiguous()
    for b, t, h in [(0, 0, 0), (1, 5, 1), (1, 11, 0), (0, 7, 1)]:
        assert torch.equal(got["topk"][h, b * S + t], idx[b, t, h])
    assert torch.equal(got["q"], q.flatten(0, 1)) and torch.equal(got["k"], k.flatten(0, 1)) and got["scale"] == 0.25
    assert o.shape == (B, S, 4, 8) and o[1, 0, 0, 0] == S * 4 * 8  # row b*S + t of its output is (b, t)
    helper = sys.modules["flash_nsa.utils"].NSAHelper
    assert helper.calls[-1] == [0, 12, 24] and helper.calls[-2]["top_n"] == n
