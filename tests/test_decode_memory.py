"""experiments.decode's memory guard and cache fill: the estimate counts the serving batches' tensors (and
refuses what cannot fit before allocating), a fill pass holds decode.fill_tokens tokens over the whole
batch, and the filled cache is the module's own cached prefill of the same tokens."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments import decode
from experiments.framework import config, hardware
from experiments.measure import inputs as measure_inputs
from experiments.measure.inputs import fill_cache, fill_per_seq, project
from nsa import NSAAttention
from nsa.backends.triton import decode_attention, tuning

CONF = Path(__file__).resolve().parent.parent / "conf"
GiB = 2**30


@pytest.fixture(scope="module", autouse=True)
def _hydra():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


@pytest.fixture
def h100(monkeypatch):
    """A faked H100 (132 SMs): hardware=auto takes the h100 profile, backend=auto the GraphDecoder path."""
    monkeypatch.setattr(hardware, "_DETECTED", hardware.Device("cuda", "NVIDIA H100 80GB HBM3", (9, 0), "570", 1))
    monkeypatch.setattr(config, "check_backends", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(tuning, "capability", lambda device=None: (9, 0))  # tuning's table for the device


def _job(B: int, S: int, *over: str):
    cfg = compose(config_name="decode", overrides=["model=h200bench", f"decode.batch={B}", f"seq={S}", *over])
    return config.prepare(cfg, "decode")


@pytest.mark.parametrize("B,S", [(256, 8192), (32, 65536)])
def test_serving_batches_pass_the_default_limit(h100, B, S):
    """h200bench (H=4, d_k=d_v=128, bf16): each branch's raw keys/values are B*S*4*256*2 bytes = 4 GiB at
    B=256, S=8k and at B=32, S=64k; with the compressed ones about 12.3 GiB, under the default 64 GiB.
    A fill pass is 4096 tokens whatever B (16 per sequence at B=256, 128 at B=32): its activations,
    4096 x (4096 + 8192 + 192 + 64 + 3072) bf16 kept and 4 x 4096 x 8192 float32 RoPE temporaries,
    are about 0.6 GiB, where 4096 tokens per sequence made them 120 GiB at B=256."""
    job = _job(B, S)
    assert decode.uses_decoder(job) and job.plan == dict.fromkeys(config.BRANCHES, "triton")
    parts = decode.memory_parts(job)
    raw = 3 * 4 * GiB
    Tc = (S - 32) // 16 + 1                                   # compressed tokens: 511 at 8k, 4095 at 64k
    cmp = B * Tc * 4 * 256 * 2
    assert parts["cache"] == raw + cmp + B * (Tc + 1) * 4 * 256 * 2  # + GraphDecoder's copy, one row longer
    per = 4096 // B
    assert fill_per_seq(4096, B) == per
    fill = 4096 * (4096 + 8192 + 192 + 64 + 3072) * 2 + 4 * 4096 * 8192 * 4 + 2 * B * (per // 16 + 1) * 4 * 32 * 256 * 2
    assert parts["fill"] == fill and fill < 0.7 * GiB
    assert parts["dense"] == 0  # SDPA's enable_gqa reads the grouped cache in place
    assert 0 < parts["step"] < 1 * GiB and 0 < parts["weights"] < 0.3 * GiB
    total = decode.estimate_bytes(job)
    assert raw + 2 * cmp < total < 15 * GiB < 64 * GiB


def test_a_batch_whose_cache_does_not_fit_is_refused_before_allocating(h100, monkeypatch):
    """B=256 at 64k: 96 GiB of raw cache. work() stops in its first line (nothing allocated), one line."""
    monkeypatch.setattr(NSAAttention, "new_cache", lambda *a, **k: pytest.fail("cache allocated before the memory check"))
    job = _job(256, 65536, "limits.max_memory_gib=64")
    with pytest.raises(config.ResourceLimit) as e:
        decode.work(job)
    msg = str(e.value)
    assert msg.startswith("seq=65536: estimated ") and "exceeds limits.max_memory_gib=64 (decode.batch=256: cache " in msg
    assert "\n" not in msg and float(msg.split("estimated ")[1].split(" GiB")[0]) > 96


def test_the_module_path_counts_no_decode_workspaces():
    """On a CPU (the module's forward): the cache once, a float32 copy of the compressed one (the reference's
    upcast), and the tiny model's fill pass of its seq-1 tokens (one pass under 4096 tokens)."""
    job = compose(config_name="decode", overrides=["seq=64"])
    job = config.prepare(job, "decode")
    parts = decode.memory_parts(job)
    Tc = (64 - 16) // 8 + 1  # tiny: l=16, d=8; H=2, d_k=d_v=16, float32
    assert parts["cache"] == 3 * 64 * 2 * 32 * 4 + Tc * 2 * 32 * 4 and parts["step"] == Tc * 2 * 32 * 4
    assert fill_per_seq(4096, 1) == 4096 and parts["fill"] > 63 * (64 + 64) * 4


def _launch_bytes(job, monkeypatch) -> tuple[int, dict]:
    """Bytes of the tensors DecodeKernels allocates for the job's batch and cache under the H100's rules
    (132 SMs, the "cuda" table with the active overrides): its own constructor, on the meta device, with
    launch_params told it runs on a GPU."""
    real = decode_attention.launch_params
    monkeypatch.setattr(decode_attention, "launch_params", lambda c, B, n, *, gpu, n_sm, tune, device=None:
                        real(c, B, n, gpu=True, n_sm=n_sm, tune=tuning.params("decode", "cuda")))
    c = job.nsa.bounded(job.seq)
    k = decode_attention.DecodeKernels(c, job.cfg.decode.batch, job.seq, "meta", dtype=job.dtype, n_sm=132)
    monkeypatch.setattr(decode_attention, "launch_params", real)
    return sum(t.nbytes for t in vars(k).values() if isinstance(t, torch.Tensor)), k.p


@pytest.mark.parametrize("B,S,tune,mode", [
    (1, 8192, {}, "three"),        # B*H*n_sel = 64 <= 132 SMs, 128 blocks: three launches, one tile a split
    (1, 65536, {}, "four"),        # 1024 selection blocks > 512: four launches, no per-program Eq. 10 sums
    (32, 8192, {}, "four"),        # B*H = 128 groups: 2048 selected-branch programs do not fit
    (2, 8192, {"nsc": 3, "sel_per": 2, "win_per": 3}, "three"),  # tuning overrides of the splits
    (2, 16384, {"mode": "two", "bw": 32}, "two"),
])
def test_the_estimate_sizes_the_decode_workspaces_as_the_kernels_do(h100, monkeypatch, B, S, tune, mode):
    """memory_parts' ``step`` (the GraphDecoder path) is, byte for byte, what DecodeKernels allocates for the
    same batch, cache and tuning: the 512-block rule, mode three's split rule and tuning overrides included."""
    job = _job(B, S)
    with tuning.overrides({"decode": tune}):
        step = decode.memory_parts(job)["step"]
        launched, p = _launch_bytes(job, monkeypatch)
    assert p["mode"] == mode and all(p[k] == v for k, v in tune.items() if k in p)
    assert step == launched > 0


@pytest.mark.parametrize("B,S,tune", [(1, 64, {}), (3, 200, {"nsc": 3, "sel_per": 1}), (2, 300, {"mode": "three"})])
def test_the_kernels_allocate_what_workspace_bytes_counts(B, S, tune):
    """On the CPU (the interpreter's rules) DecodeKernels' tensors are workspace_bytes' count, element for element."""
    from nsa import NSAConfig

    c = NSAConfig(dim=64, n_heads=4, n_kv_heads=2, d_k=16, d_v=16, l=16, d=8, l_sel=16, n_sel=4, w=32,
                  phi="mlp", gate_hidden=16, phi_hidden=32)
    with tuning.overrides({"decode": tune}):
        k = decode_attention.DecodeKernels(c, B, S, "cpu", dtype=torch.float32)
    held = sum(t.nbytes for t in vars(k).values() if isinstance(t, torch.Tensor))
    assert held == decode_attention.workspace_bytes(c, B, k.p, torch.float32) > 0
    assert ("sel_psum" in vars(k)) == (k.p["mode"] == "three")


@pytest.mark.parametrize("B,tokens,n", [(8, 20, 37), (8, 4, 13), (3, 4096, 40)])
def test_fill_cache_bounds_the_tokens_of_a_pass_and_equals_a_cached_prefill(monkeypatch, B, tokens, n):
    """fill_cache(tokens=T) over B sequences: passes of max(1, T // B) positions of every sequence (the last
    one shorter), and the cache it leaves is the module's own cached forward of the same tokens."""
    from nsa import NSAConfig

    c = NSAConfig(dim=64, n_heads=4, n_kv_heads=2, d_k=16, d_v=16, l=16, d=8, l_sel=16, n_sel=4, w=32,
                  phi="mlp", gate_hidden=16, phi_hidden=32)
    torch.manual_seed(0)
    layer = NSAAttention(c).double().eval()
    shapes = []
    monkeypatch.setattr(measure_inputs, "project",
                        lambda lay, x, start=0: shapes.append(tuple(x.shape)) or project(lay, x, start))
    cache = layer.new_cache(B, n)
    torch.manual_seed(1)
    fill_cache(layer, cache, n, tokens)
    per = max(1, tokens // B)
    assert [s[1] for s in shapes] == [per] * (n // per) + ([n % per] if n % per else [])
    assert all(s[0] == B for s in shapes) and (B * per <= tokens or per == 1) and cache.length == n
    torch.manual_seed(1)
    x = torch.cat([torch.randn(*s, dtype=torch.float64) for s in shapes], 1)  # the same random tokens
    ref = layer.new_cache(B, n)
    with torch.no_grad():
        layer(x, ref)
    for name in ("k_cmp_raw", "v_cmp_raw", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win"):
        torch.testing.assert_close(getattr(cache, name), getattr(ref, name), rtol=1e-12, atol=1e-12, msg=name)
