"""experiments.generate through its real command line on the CPU (a tiny Llama, the reference backend): the
documented CPU sweep runs NSA and dense to FINISHED runs with their metrics, the token check among them; a bad
value is one line naming the key, exit 2, no run; the token comparison and the check can fail."""
from __future__ import annotations

import os
import re
from pathlib import Path

import entrypoints
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

pytest.importorskip("transformers")  # the [hf] extra

from experiments import generate  # noqa: E402
from experiments.framework.config import prepare  # noqa: E402

TINY = ["hardware=cpu", "model=tiny", "seq=64", "generate.lm.n_layers=2", "generate.lm.mlp_hidden=128",
        "generate.lm.vocab=256", "generate.new_tokens=6", "generate.check_prompt=48", "generate.check_new_tokens=6"]
HEADLINE = {"0_prefill_s", "0_prefill_tokens_per_s", "0_decode_tokens_per_s", "0_decode_step_p50_ms"}


def cpu_commands() -> list[list[str]]:
    """The documented experiments.generate commands that run on a CPU (the GPU's are refused here)."""
    cmds = [entrypoints.argv(c)[0] for c in entrypoints.documented_commands() if "experiments.generate" in c]
    return [c[2:] for c in cmds if "hardware=cpu" in c]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return entrypoints.make_template(tmp_path_factory.mktemp("template") / "mlflow.db")


def test_the_documented_cpu_sweep_runs_nsa_and_dense_with_their_metrics(tmp_path, template):
    docs = cpu_commands()
    assert docs and all("attention=nsa,dense" in c for c in docs)  # the CPU example: both, one sweep
    args = docs[0]
    rc, out, err = entrypoints.wait(entrypoints.start(tmp_path, "generate", *args, template=template), timeout=600)
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    client, runs = entrypoints.runs(tmp_path / "mlflow.db", "generate")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    assert len(children) == 2 and len(runs) == 3, [r.info.run_name for r in runs]
    by = {r.data.tags["attention"]: r for r in children}
    assert set(by) == {"nsa", "dense"} and all(r.info.status == "FINISHED" for r in runs)
    for kind, r in by.items():
        m = r.data.metrics
        assert HEADLINE <= set(m) and all(m[k] > 0 for k in HEADLINE), (kind, m)
        assert m["generated_tokens"] == 16 and m["seq"] == 256  # the documented command's defaults
    nsa, dense = by["nsa"].data.metrics, by["dense"].data.metrics
    assert nsa["params_m"] > dense["params_m"]  # three key/value pairs per layer, phi and the gates
    # reference against reference: the same tokens, the same logits, bit for bit
    assert nsa["tokens_equal"] == 1.0 and nsa["max_logit_diff"] == 0.0 and nsa["tokens_differing"] == 0
    assert by["nsa"].data.tags["token_check"].startswith("equal: 32 greedy tokens")
    # generate.decode=auto on a CPU: every new token through the layer's own cached forward, said on the run
    assert by["nsa"].data.tags["decode_ran"] == "module" and "decode_ran" not in by["dense"].data.tags
    assert "each token the layer's own cached forward" in by["nsa"].data.tags["generate_timed"]
    assert "tokens_equal" not in dense  # the check is the NSA model's
    # the cache made for prompt + new tokens (256 + 16): 2 layers, 2 key/value heads, d_k + d_v = 32, float32; the
    # three branches' raw keys/values and the compressed ones (l=16, d=8: (272 - 16) // 8 + 1 = 33)
    assert nsa["nsa_cache_gib"] * 2**30 == 2 * (272 * 2 * 32 * 4 * 3 + 33 * 2 * 32 * 4)


@pytest.mark.parametrize("arg,says", [
    ("generate.new_tokens=0", "generate.new_tokens=0: must be an integer >= 1"),
    ("generate.lm.arch=gpt2", "generate.lm.arch='gpt2': one of llama, qwen2, mistral"),
    ("attention=window", "attention=window: experiments.generate runs attention=nsa or attention=dense"),
    ("generate.check_dtype=float8", "generate.check_dtype='float8': one of"),
    ("generate.decode=cuda", "generate.decode='cuda': one of auto, model_graph, model_compiled, model_step, graph, step, module"),
])
def test_a_bad_value_is_one_line_naming_the_key_exit_2_and_no_run(arg, says, tmp_path, template):
    rc, out, err = entrypoints.wait(entrypoints.start(tmp_path, "generate", *TINY, arg, template=template), timeout=300)
    lines = entrypoints.one_line(err)
    assert rc == 2 and len(lines) == 1 and says in lines[0], err[-2000:]
    _, runs = entrypoints.runs(tmp_path / "mlflow.db", "generate") if _has_experiment(tmp_path) else (None, [])
    assert runs == [] and not (tmp_path / "out" / "x").exists()


def _has_experiment(tmp: Path) -> bool:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}").get_experiment_by_name("nsa-generate") is not None


def test_compare_tokens_finds_the_first_difference():
    a = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    assert generate.compare_tokens(a, a.clone()) == {"equal": True, "first_mismatch": -1, "n_mismatch": 0}
    b = a.clone()
    b[1, 2], b[0, 3] = 9, 0
    assert generate.compare_tokens(b, a) == {"equal": False, "first_mismatch": 2, "n_mismatch": 2}
    with pytest.raises(ValueError, match="shapes"):
        generate.compare_tokens(a[:, :3], a)


def _job(*overrides: str):
    with initialize_config_dir(config_dir=str(entrypoints.REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="generate", overrides=[*TINY, *overrides])
    return prepare(OmegaConf.create(OmegaConf.to_container(cfg)), "generate", check=generate.check_config)


def test_the_token_check_reports_a_difference_as_a_failure(monkeypatch):
    """The reference model's head perturbed (as a kernel that computed another attention would): the check's
    tokens differ, it says so and where, and returns the failure that ends the run FAILED."""
    job = _job()
    ok_metrics, ok_tags, ok_failure = generate.token_check(job)
    assert ok_failure is None and ok_metrics["tokens_equal"] == 1.0 and ok_metrics["max_logit_diff"] == 0.0
    greedy, calls = generate.greedy, []

    def perturbed(model, *args, **kwargs):  # the second call: the reference model's, after its weights were loaded
        calls.append(model)
        if len(calls) == 2:
            with torch.no_grad():
                model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight))
        return greedy(model, *args, **kwargs)

    monkeypatch.setattr(generate, "greedy", perturbed)
    metrics, tags, failure = generate.token_check(job)
    assert metrics["tokens_equal"] == 0.0 and metrics["tokens_differing"] >= 1 and metrics["max_logit_diff"] > 0
    assert failure is not None and re.match(r"token check: the tokens DIFFER from step \d+ on", failure)
    assert tags["token_check"] == failure and "ref_top2_gap_at_mismatch" in metrics


def test_the_default_model_has_a_few_hundred_million_parameters():
    """generate.yaml's default body around model=llama300m: 336M parameters dense, 376M converted (built on the
    meta device: shapes only)."""
    import transformers

    from nsa.integrations import hf

    count = {}
    for kind in ("dense", "nsa"):
        job = _job("model=llama300m", "generate.lm.n_layers=24", "generate.lm.mlp_hidden=2816", "generate.lm.vocab=32000")
        with torch.device("meta"):
            m = transformers.AutoModelForCausalLM.from_config(generate.hf_config(job, 70000))
            if kind == "nsa":
                hf.convert(m, **generate.nsa_settings(job))
        count[kind] = sum(p.numel() for p in m.parameters())
    assert round(count["dense"] / 1e6) == 336 and round(count["nsa"] / 1e6) == 376, count
    defaults = OmegaConf.load(entrypoints.REPO / "conf" / "generate.yaml").generate.lm
    assert (defaults.n_layers, defaults.mlp_hidden, defaults.vocab) == (24, 2816, 32000)


def test_the_memory_estimate_fits_64k_on_an_h100():
    """The default model (336M parameters) in bfloat16 at a 64k context, NSA and dense: the estimate, an upper
    bound of the job's tensors, stays under an H100's 80 GB; NSA's cache is its three branches' keys and values."""
    for kind in ("nsa", "dense"):
        job = _job("model=llama300m", "generate.lm.n_layers=24", "generate.lm.mlp_hidden=2816",
                   "generate.lm.vocab=32000", "seq=65536", "generate.new_tokens=64", "dtype=bfloat16",
                   f"attention={kind}")
        est = generate.estimate_bytes(job)
        assert 1e9 < est < 40e9, (kind, est / 1e9)
    c = job.nsa
    nsa_cache = 24 * (65536 + 64) * c.n_kv_heads * (c.d_k + c.d_v) * 3 * 2  # layers, tokens, heads, k+v, branches, bf16
    assert 4.5e9 < nsa_cache < 5e9


def test_the_wheelhouse_carries_the_hf_extra_when_asked():
    """scripts/wheelhouse.py --hf --list: the hf extra's requirements among those it resolves (no network)."""
    import subprocess
    import sys

    def listed(*args):
        r = subprocess.run([sys.executable, "scripts/wheelhouse.py", *args, "--list"], cwd=entrypoints.REPO,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        return r.stdout.splitlines()

    with_hf, plain = listed("--hf"), listed()
    assert {"transformers>=5.17,<6", "safetensors>=0.8", "mlflow"} <= set(with_hf)
    assert not any(x.startswith("transformers") for x in plain) and "mlflow" in plain


def test_bench_step_hf_generate_sweeps_nsa_and_dense_and_checks_the_tokens():
    import subprocess

    r = subprocess.run(["bash", "scripts/bench.sh", "--print", "hf-generate"], cwd=entrypoints.REPO,
                       capture_output=True, text=True, timeout=60, env={**os.environ, "OUT": "o"})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    runs = [ln for ln in r.stdout.splitlines() if "-m experiments.generate" in ln]
    assert len(runs) == 2
    assert "-m seq=8192,16384,32768,65536 attention=nsa,dense" in runs[0] and "backend=triton" in runs[0]
    assert "generate.check_tokens=false" in runs[0] and "check_tokens" not in runs[1]  # the check: its own run
    assert "attention=nsa" in runs[1] and "backend=triton" in runs[1]


def test_the_token_check_on_the_triton_kernels_equals_the_reference():
    """The check as the GPU runs it, here on Triton's interpreter: the triton backend's greedy tokens equal the
    reference's (float32; one layer, a 40-token prompt past the window of 32, 4 new tokens)."""
    from nsa import env

    if not env.triton_interpret():
        pytest.skip("the triton kernels run on a CPU under TRITON_INTERPRET=1 only")
    job = _job("backend=triton", "generate.lm.n_layers=1", "generate.check_prompt=40", "generate.check_new_tokens=4")
    assert job.plan == {"cmp": "triton", "sel": "triton", "win": "triton"}
    metrics, tags, failure = generate.token_check(job)
    assert failure is None and metrics["tokens_equal"] == 1.0, tags
    assert 0 < metrics["max_logit_diff"] < 1e-4  # the kernels' float32 rounding, not the reference's float64


def test_generate_decode_values_are_the_integration_s():
    """generate.decode is checked before the hf extra is imported: its list is nsa.integrations.hf.DECODE."""
    hf = pytest.importorskip("nsa.integrations.hf")
    assert generate.DECODE == hf.DECODE and set(generate.DECODE_SAYS) == set(hf.DECODE) - {"auto"}
