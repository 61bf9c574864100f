"""Every config group composes, and each composed config validates (or fails) as documented."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import nsa
from experiments import decode
from experiments.framework import config, hardware

CONF = Path(__file__).resolve().parent.parent / "conf"
ENTRIES = ("decode", "prefill", "parity")
TRAIN_GROUPS = ("lm", "attention", "data", "train")  # conf/train.yaml's own groups: tests/test_lm_conf.py composes them
KERNEL_GROUPS = ("op",)  # conf/kernels.yaml's own group: tests/test_kernels.py composes it
GROUPS = {g: opts for g, opts in config.groups().items() if g not in TRAIN_GROUPS + KERNEL_GROUPS}


@pytest.fixture(scope="module", autouse=True)
def _hydra():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


def _compose(entry, overrides=(), hydra_cfg=False):
    return compose(config_name=entry, overrides=list(overrides), return_hydra_config=hydra_cfg)


# A fresh interpreter that imports nothing of this project: the config groups come from conf/ and from Hydra's
# plugin scan (hydra_plugins/nsa_configs), not from whichever entry point a test happened to import first.
FRESH_COMPOSE = """
import sys
from hydra import compose, initialize_config_dir
with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
    for entry in ("prefill", "kernels"):
        cfg = compose(config_name=entry, overrides=["tuning.selection.warps=2"])
        assert cfg.tuning.selection.warps == 2, cfg.tuning
assert not any(m == "experiments" or m.startswith("experiments.") for m in sys.modules), "imported experiments"
print("composed")
"""


def test_tuning_group_composes_without_importing_an_entry_point():
    r = subprocess.run([sys.executable, "-c", FRESH_COMPOSE, str(CONF)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "composed", r.stderr[-2000:]


def test_groups_are_the_documented_decisions():
    assert set(GROUPS) == {"hardware", "backend", "branch_force", "seq_len", "model", "tracking"}
    assert set(GROUPS["hardware"]) == {"auto", "cpu", "rtx4090", "a100", "h100", "h200"}
    assert {"reference", "sdpa", "triton", "fa2"} <= set(GROUPS["backend"])
    assert set(GROUPS["branch_force"]) == {"none", "cmp", "sel", "win"}
    assert {"tiny", "smoke", "paper"} <= set(GROUPS["seq_len"])
    assert {"tiny", "paper", "bench4090", "h200bench"} <= set(GROUPS["model"])
    assert set(GROUPS["tracking"]) == {"local", "server"}


@pytest.mark.parametrize("entry", ENTRIES)
def test_every_entry_composes_and_validates(entry):
    cfg = _compose(entry, hydra_cfg=True)
    raw = OmegaConf.to_container(cfg.hydra, resolve=False)
    assert raw["job"]["chdir"] is False and raw["run"]["dir"].startswith("outputs/")
    assert raw["sweep"]["dir"].startswith("outputs/") and raw["sweeper"]["_target_"].endswith("NSASweeper")
    job = config.prepare(cfg, entry, check=decode.check_config if entry == "decode" else None)  # decode's own rules too
    assert job.profile.name == "cpu" and job.plan == {"cmp": "reference", "sel": "reference", "win": "reference"}


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_group_option_composes(group, option, monkeypatch):
    entry = "decode"
    over = [f"{group}={option}"]
    if group == "hardware" and option not in ("auto", "cpu"):
        over.append("hardware.strict=false")  # a GPU profile on this CPU machine
    cfg = _compose(entry, over)
    assert cfg[group] is not None
    if group == "backend" and option not in ("reference", "auto"):
        return  # resolves, but the GPU backends may be unavailable here: checked when a job runs
    if group == "hardware" and option not in ("auto", "cpu"):
        monkeypatch.setattr(config, "check_backends", lambda *a: None)  # backend=auto: the profile's GPU backends
    job = config.prepare(cfg, entry)
    assert job.seq == cfg.seq and isinstance(job.nsa, nsa.NSAConfig)


def test_hardware_profiles():
    for name in GROUPS["hardware"]:
        if name == "auto":
            continue
        p = hardware.load_profile(name)
        assert p.name == name and p.peak_hbm_gbps > 0 and p.peak_bf16_tflops > 0
        assert set(p.policy.preferred) == {"cmp", "sel", "win"}
    h200 = hardware.load_profile("h200")
    assert (h200.peak_hbm_gbps, h200.peak_bf16_tflops) == (4300.0, 790.0)
    assert list(h200.match.capability) == [9, 0] and "H200" in h200.match.name_contains
    r = hardware.load_profile("rtx4090")
    assert list(r.match.capability) == [8, 9] and r.policy.avoid.sel.backend == "triton"
    # Recognition by name and capability; auto picks the matching profile.
    dev = hardware.Device("cuda", "NVIDIA H200", (9, 0), "570", 1)
    assert hardware.resolve_profile(OmegaConf.create({"name": "auto"}), dev)[0].name == "h200"
    dev = hardware.Device("cuda", "NVIDIA GeForce RTX 4090", (8, 9), "570", 1)
    assert hardware.resolve_profile(OmegaConf.create({"name": "auto"}), dev)[0].name == "rtx4090"
    with pytest.raises(hardware.HardwareMismatch, match="hardware=h200 .*rtx|hardware=h200 .*4090"):
        hardware.resolve_profile(hardware.load_profile("h200"), dev)


def test_rtx4090_policy_keeps_triton_selection_off_unless_forced(monkeypatch):
    monkeypatch.setattr(config, "check_backends", lambda *a: None)  # the policy, whatever runs on this machine
    base = ["hardware=rtx4090", "hardware.strict=false", "backend=triton"]
    job = config.prepare(_compose("decode", base), "decode")
    assert job.plan == {"cmp": "triton", "sel": "reference", "win": "triton"}
    assert len(job.policy_notes) == 1 and "sel: triton -> reference" in job.policy_notes[0]
    job = config.prepare(_compose("decode", base + ["hardware.policy.force=true"]), "decode")
    assert job.plan["sel"] == "triton" and not job.policy_notes


def test_backend_auto_takes_the_profile_preference():
    job = config.prepare(_compose("decode", ["backend=auto", "hardware=cpu"]), "decode")
    assert job.plan == {"cmp": "reference", "sel": "reference", "win": "reference"}


@pytest.mark.parametrize("entry", ["decode", "prefill", "parity"])
def test_the_default_backend_is_auto_and_the_reference_on_a_cpu(entry):
    cfg = _compose(entry, hydra_cfg=True)
    assert cfg.hydra.runtime.choices.backend == "auto" and all(cfg.backend[b] is None for b in config.BRANCHES)
    job = config.prepare(cfg, entry)
    assert job.profile.name == "cpu" and set(job.plan.values()) == {"reference"} and not job.policy_notes


@pytest.fixture
def h100(monkeypatch):
    """hardware=auto on a faked H100; the backends' availability is not checked (no GPU here)."""
    monkeypatch.setattr(hardware, "_DETECTED", hardware.Device("cuda", "NVIDIA H100 80GB HBM3", (9, 0), "570", 1))
    monkeypatch.setattr(config, "check_backends", lambda *a: None)


def test_decode_takes_the_profiles_decode_preference(h100):
    """h100's policy.by_entry.decode (all triton: the GraphDecoder step) for decode; prefill and parity keep
    policy.preferred (win=sdpa). The run's policy notes say which preference chose the backends."""
    job = config.prepare(_compose("decode"), "decode")
    assert job.profile.name == "h100" and job.plan == dict.fromkeys(config.BRANCHES, "triton")
    assert job.policy_notes == ["decode preference cmp=triton sel=triton win=triton (hardware=h100 "
                                "policy.by_entry.decode; policy.preferred: cmp=triton sel=triton win=sdpa)"]
    for entry in ("prefill", "parity"):
        job = config.prepare(_compose(entry), entry)
        assert job.plan == {"cmp": "triton", "sel": "triton", "win": "sdpa"} and not job.policy_notes


def test_named_backends_win_over_the_decode_preference(h100):
    job = config.prepare(_compose("decode", ["backend.win=sdpa"]), "decode")
    assert job.plan == {"cmp": "triton", "sel": "triton", "win": "sdpa"}
    assert job.policy_notes[0].startswith("decode preference cmp=triton sel=triton (")
    job = config.prepare(_compose("decode", ["backend=reference"]), "decode")
    assert set(job.plan.values()) == {"reference"} and not job.policy_notes


def test_the_decode_preference_goes_before_by_seq_and_avoid_after_it(h100):
    """Precedence for a branch left to auto: by_entry.<entry>, then by_seq, then preferred; avoid last."""
    by_seq = ["hardware=h100", "+hardware.policy.by_seq={win: [{min_seq: 0, backend: fa2}]}"]
    assert config.prepare(_compose("decode", by_seq), "decode").plan["win"] == "triton"
    assert config.prepare(_compose("prefill", by_seq), "prefill").plan["win"] == "fa2"
    avoid = ["hardware=h100", "++hardware.policy.avoid={sel: {backend: triton, instead: reference, reason: slow}}"]
    job = config.prepare(_compose("decode", avoid), "decode")
    assert job.plan == {"cmp": "triton", "sel": "reference", "win": "triton"}
    assert "sel: triton -> reference (hardware=h100 policy: slow" in job.policy_notes[1]


@pytest.mark.parametrize("value,needle", [
    ("{decode: {win: nope}}", "hardware.policy.by_entry.decode.win='nope': unknown backend; known: cudnn, fa2, reference"),
    ("{decode: {attn: triton}}", "hardware.policy.by_entry.decode.attn: unknown branch; one of cmp, sel, win"),
    ("{decod: {win: triton}}", "hardware.policy.by_entry.decod: unknown entry point; one of decode, prefill"),
    ("{decode: triton}", "hardware.policy.by_entry.decode='triton': must be a mapping branch -> backend"),
    ("{prefill: {win: nope}}", "hardware.policy.by_entry.prefill.win='nope': unknown backend"),
])
def test_a_bad_entry_preference_is_a_config_error(value, needle):
    """Checked whole, whatever the entry point: a profile's typo fails every job at once."""
    with pytest.raises(config.ConfigError) as e:
        config.prepare(_compose("decode", ["hardware=cpu", f"++hardware.policy.by_entry={value}"]), "decode")
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", GROUPS["seq_len"])
def test_seq_len_presets_sweep_their_values(name):
    cfg = _compose("decode", [f"seq_len={name}"], hydra_cfg=True)
    swept = [int(v) for v in str(cfg.hydra.sweeper.params.seq).split(",")]
    assert swept == list(cfg.seq_len["values"]) and all(v >= 1 for v in swept)


def test_models():
    b = _compose("decode", ["model=bench4090"]).model.nsa
    assert (b.dim, b.n_heads, b.n_kv_heads, b.d_k, b.d_v, b.l, b.d, b.l_sel, b.n_sel, b.w) == \
        (256, 8, 2, 32, 32, 32, 16, 64, 16, 512)
    h = _compose("decode", ["model=h200bench"]).model.nsa
    assert (h.n_heads, h.n_kv_heads, h.d_k, h.d_v, h.l_sel, h.n_sel, h.w) == (64, 4, 128, 128, 64, 16, 512)
    p = _compose("decode", ["model=paper"]).model.nsa
    assert (p.n_heads, p.n_kv_heads, p.d_k, p.d_v, p.l, p.d, p.l_sel, p.n_sel, p.w) == \
        (64, 4, 192, 128, 32, 16, 64, 16, 512)


@pytest.mark.parametrize("entry,over,needle", [
    ("decode", ["model.nsa.l=20"], "NSAConfig.l=20"),
    ("decode", ["seq=0"], "seq=0"),
    ("decode", ["backend.sel=foo"], "backend.sel='foo'"),
    ("decode", ["backend.fallback=foo"], "backend.fallback='foo'"),
    ("decode", ["hardware=h200"], "hardware=h200 does not match"),
    ("decode", ["dtype=float8"], "dtype='float8'"),
    ("decode", ["limits.max_memory_gib=-1"], "limits.max_memory_gib=-1: must be a number > 0"),
    ("decode", ["decode.repeats=0"], "decode.repeats=0: must be an integer from 1 to 10000"),
    # what scales a job's time is bounded (a timing of 1e8 repeats ran for days)
    ("decode", ["decode.repeats=100000000"], "decode.repeats=100000000: must be an integer from 1 to 10000"),
    ("decode", ["model.timing.warmup=20000"], "model.timing.warmup=20000: must be an integer from 0 to 10000"),
    ("prefill", ["prefill.repeats=10001"], "prefill.repeats=10001: must be an integer from 1 to 10000"),
    ("kernels", ["kernels.rep_ms=1e9"], "kernels.rep_ms=1000000000.0: must be a number > 0 and at most 60000 (ms)"),
    ("kernels", ["kernels.cpu_repeats=1000000"], "kernels.cpu_repeats=1000000: must be an integer from 1 to 10000"),
    ("prefill", ["prefill.backward=maybe"], "prefill.backward='maybe': must be true or false"),
    ("parity", ["parity.batch=0"], "parity.batch=0: must be an integer >= 1"),
    ("parity", ["parity.ref_dtype=nosuch"], "parity.ref_dtype='nosuch': one of float64"),
    ("parity", ["parity.tol.float32.rel_l2=abc"], "parity.tol.float32.rel_l2='abc': must be a finite number >= 0"),
    ("parity", ["parity.tol.float32.max_abs=nan"], "parity.tol.float32.max_abs=nan: must be a finite number >= 0"),
    ("parity", ["parity.tol.float32.max_abs=inf"], "parity.tol.float32.max_abs=inf: must be a finite number >= 0"),
    # what torch takes: a seed past int64 failed inside torch.manual_seed after the run had started
    ("decode", ["seed=9223372036854775808"], "seed=9223372036854775808: must be an integer >= 0 (at most 2**63 - 1"),
    ("parity", ["~parity.batch"], "parity.batch: missing"),
    ("prefill", ["prefill.peers=[flax]"], "prefill.peers=['flax']: must be a list of peer names from: fla, flash_nsa"),
    ("decode", ["decode.peers=fla"], "decode.peers='fla': must be a list of peer names from: fla"),
])
def test_bad_configs_raise_one_line(entry, over, needle):
    with pytest.raises(config.ConfigError) as e:
        config.prepare(_compose(entry, over), entry)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_backend_that_cannot_run_here_is_a_config_error(monkeypatch):
    """Each backend's own availability check, at validation: triton on a CPU needs the interpreter."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(config.ConfigError, match=r"backend.cmp=triton: .*TRITON_INTERPRET=1"):
        config.prepare(_compose("decode", ["backend=triton"]), "decode")
    # Only the branches a job runs: branch_force=win times the window, and decode scores with cmp.
    over = ["backend=triton", "branch_force=win", "backend.cmp=reference", "backend.win=reference"]
    assert config.prepare(_compose("decode", over), "decode").plan["sel"] == "triton"


def test_a_job_run_elsewhere_is_matched_to_its_device_where_it_runs(monkeypatch):
    """prepare(here=False), as a SLURM launcher's sweep validates: the device match and the backends'
    availability are left to the job; every other rule still holds."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    over = ["hardware=h200", "model=h200bench", "backend=triton"]
    with pytest.raises(config.ConfigError, match="hardware=h200 does not match"):
        config.prepare(_compose("decode", over), "decode")
    job = config.prepare(_compose("decode", over), "decode", here=False)
    assert job.profile.name == "h200" and job.plan["cmp"] == "triton" and job.dtype.is_floating_point
    assert job.profile_note == "h200: matched to the device where the job runs"
    with pytest.raises(config.ConfigError, match="seq=0"):
        config.prepare(_compose("decode", [*over, "seq=0"]), "decode", here=False)


@pytest.mark.parametrize("profile,gpus,cpus", [("cpu", 0, 1), ("h200", 1, 1), ("auto", 1, 1)])
@pytest.mark.parametrize("launcher", ["slurm", "per_gpu"])
def test_launchers_take_gpus_and_cores_from_the_hardware_profile(launcher, profile, gpus, cpus):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the cluster extra: pip install -e '.[cluster]'")
    hc = _compose("decode", [f"hardware={profile}", f"hydra/launcher={launcher}"], hydra_cfg=True).hydra.launcher
    assert (hc.gpus_per_node, hc.cpus_per_task) == (gpus, cpus)
    threads = _compose("decode", ["hardware=cpu", "hardware.threads=4", f"hydra/launcher={launcher}"], hydra_cfg=True)
    assert threads.hydra.launcher.cpus_per_task == 4  # a CPU job's cores are its torch threads
    ranks = _compose("train", [f"hardware={profile}", f"hydra/launcher={launcher}", "hydra.launcher.tasks_per_node=2"],
                     hydra_cfg=True).hydra.launcher
    assert ranks.gpus_per_node == 2 * gpus  # one job over 2 tasks a host: each rank its own GPUs
