"""``python -m experiments.validate`` through the real CLI on the CPU (the README's commands: every check
passes; an injected fault fails, naming the check and the branch), the hardware profile its
thresholds check writes, and its parts in-process: the headline, junit parsing, decode shares, the
window policy, ``policy.by_seq``, the fault switch, the ``-m gpu`` collection rule."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import entrypoints
import pytest
import torch
from conftest import make_config, random_inputs
from omegaconf import OmegaConf

from experiments.framework import config
from experiments.measure import timing
from experiments.measure.timing import graph_ms
from experiments.validation import decode_breakdown, faults, kernels, report, thresholds
from experiments.validation import train as vtrain
from experiments.validation.core import FAIL, NOT_RUN, PASS, SKIP, Check
from nsa import dispatch

REPO = entrypoints.REPO
CHECKS = ["env", "kernels", "decode", "prefill", "thresholds", "train", "determinism"]
PASSING = "python -m experiments.validate hardware=cpu"
FAULT = "python -m experiments.validate hardware=cpu validate.checks=[env,kernels] validate.inject_fault=sel"


def test_the_readme_and_the_help_hold_the_commands_run_here():
    block = re.findall(r"```bash\n(.*?)```", entrypoints.doc_section("Validate a GPU"), re.S)
    lines = [" ".join(ln.split()) for b in block for ln in b.splitlines()]
    assert PASSING in lines and FAULT in lines and "python -m experiments.validate hardware=h200" in lines
    header = OmegaConf.load(REPO / "conf" / "validate.yaml").hydra.help.header
    assert PASSING in header and FAULT in header


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """Both documented CPU commands at once, as written, each in a folder of its own."""
    template = entrypoints.make_template(tmp_path_factory.mktemp("template") / "mlflow.db")
    procs = {}
    for key, cmd in (("pass", PASSING), ("fault", FAULT)):
        tmp = tmp_path_factory.mktemp(key)
        procs[key] = (tmp, entrypoints.start(tmp, "validate", *cmd.split()[3:], name=None, template=template))
    return {k: (tmp, *entrypoints.wait(p, timeout=1200)) for k, (tmp, p) in procs.items()}


def _run_dir(tmp: Path) -> Path:
    (out,) = (tmp / "outputs" / "validate").iterdir()
    return out


def test_every_check_passes_on_the_cpu(cli):
    tmp, rc, out, err = cli["pass"]
    assert rc == 0, (out[-3000:], err[-3000:])
    assert out.startswith("NSA validation: PASS\n7 of 7 checks passed.")
    c, rs = entrypoints.runs(tmp / "mlflow.db", "validate")
    (parent,) = [r for r in rs if "mlflow.parentRunId" not in r.data.tags]
    kids = {r.data.tags["check"]: r for r in rs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert sorted(kids) == sorted(CHECKS) and len(rs) == 8
    assert parent.info.status == "FINISHED" and parent.data.tags["headline"] == "PASS"
    assert all(r.info.status == "FINISHED" and r.data.tags["verdict"] == PASS for r in kids.values())
    assert parent.info.run_name == "validate cpu PASS" and kids["env"].info.run_name == "validate env PASS"
    run_dir = _run_dir(tmp)
    md, html = (run_dir / "report.md").read_text(), (run_dir / "report.html").read_text()
    assert md.startswith("# NSA validation: PASS\n") and "<h1 class=\"pass\">NSA validation: PASS</h1>" in html
    for name in CHECKS:
        assert re.search(rf"^\| {name} \| PASS \| .+ \| [\d.]+ s \|$", md, re.M), name
    # The kernel check on a CPU says what it is; the decode shares add up; the plots are there and embedded.
    assert "NOT the kernels compiled on a device" in md and "(interpreter, CPU)" in md
    assert kids["kernels"].data.metrics["tests_passed"] >= 8 and kids["kernels"].data.metrics["tests_failed"] == 0
    rows = re.findall(r"^\| \d \| \d+ \| .* \| (\d+\.\d) % \| n/a \(no graphs\) \|", md, re.M)
    assert rows and all(r == "100.0" for r in rows)
    for png in ("decode_shares.png", "prefill_vs_seq.png", "thresholds.png", "train_loss.png"):
        assert (run_dir / png).stat().st_size > 1000 and f"]({png})" in md
    assert html.count("data:image/png;base64,") == 4
    arts = {a.path for a in c.list_artifacts(parent.info.run_id)}
    assert {"report.md", "report.html", "decode_shares.png", "cpu_validated.yaml"} <= arts
    assert "kernels.csv" in {a.path for a in c.list_artifacts(kids["kernels"].info.run_id)}


def test_the_validated_profile_sets_the_window_backend(cli):
    """The thresholds check's hardware profile, loaded with -cd by another entry point: backend=auto takes
    its window backend for the job's length, and the run records why."""
    tmp, rc, _, err = cli["pass"]
    assert rc == 0, err[-2000:]
    conf = _run_dir(tmp) / "conf"
    prof = OmegaConf.load(conf / "hardware" / "cpu_validated.yaml")
    entries = list(prof.policy.by_seq.win)
    assert entries[0].min_seq == 0 and {e.backend for e in entries} <= {"reference", "sdpa"}
    seq = 64
    want = [e.backend for e in entries if e.min_seq <= seq][-1]
    p = subprocess.run([sys.executable, "-m", "experiments.prefill", "-cd", str(conf), "hardware=cpu_validated",
                        "backend=auto", f"seq={seq}", "prefill.per_branch=false", f"tracking.uri=sqlite:///{tmp / 'p.db'}",
                        f"hydra.run.dir={tmp / 'p'}"], cwd=tmp, env=entrypoints.env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    _, (run,) = entrypoints.runs(tmp / "p.db", "prefill")
    assert run.data.tags["backend_ran_win"] == want and run.data.tags["hardware_profile"] == "cpu_validated"
    assert f"win: {want} at seq={seq} (hardware=cpu_validated policy.by_seq" in run.data.tags["policy_overrides"]


def test_an_injected_fault_fails_naming_the_check_and_the_branch(cli):
    tmp, rc, out, err = cli["fault"]
    assert rc == 1, (out[-3000:], err[-3000:])
    first, second = out.splitlines()[:2]
    assert first == "NSA validation: FAIL"
    assert "failed: kernels (" in second and "sel: " in second and "tests failed" in second
    assert "did not run: decode (left out of validate.checks)" in second
    c, rs = entrypoints.runs(tmp / "mlflow.db", "validate")
    (parent,) = [r for r in rs if "mlflow.parentRunId" not in r.data.tags]
    kids = {r.data.tags["check"]: r for r in rs if "mlflow.parentRunId" in r.data.tags}
    assert parent.info.status == "FAILED" and parent.data.tags["inject_fault"] == "sel"
    assert sorted(kids) == ["env", "kernels"]  # the checks left out get no run
    assert kids["kernels"].info.status == "FAILED" and kids["kernels"].data.tags["verdict"] == FAIL
    assert parent.info.run_name == "validate cpu FAIL" and kids["kernels"].info.run_name == "validate kernels FAIL"
    assert "sel: " in kids["kernels"].data.tags["error"]
    md = (_run_dir(tmp) / "report.md").read_text()
    assert md.startswith("# NSA validation: FAIL\n") and "FAULT INJECTED (validate.inject_fault=sel)" in md
    assert "| kernels | FAIL |" in md and "| decode | NOT RUN |" in md
    assert re.search(r"^- tests/test_kernels_interpret.py::test_sel\[.*over tolerance", md, re.M)


def test_a_config_error_is_one_line_and_leaves_nothing(tmp_path):
    p = entrypoints.start(tmp_path, "validate", "hardware=cpu", "validate.checks=[env,nope]", name="x")
    rc, out, err = entrypoints.wait(p)
    assert rc == 2 and entrypoints.one_line(err) == [
        "config error: validate.checks: unknown check(s) ['nope']; choose from " + ", ".join(CHECKS)]
    assert not (tmp_path / "out").exists()
    _, rs = entrypoints.runs(tmp_path / "mlflow.db", "validate") if (tmp_path / "mlflow.db").exists() else (None, [])
    assert not rs


# ------------------------------------------------------------------------------------------------
# The parts, in-process
# ------------------------------------------------------------------------------------------------
def test_the_headline_says_pass_only_when_every_check_ran_and_passed():
    ok = [Check(n) for n in CHECKS]
    assert report.headline(ok) == (PASS, "7 of 7 checks passed.")
    skipped = ok[:-1] + [Check("determinism", verdict=SKIP, reasons=["no GPU"])]
    word, line = report.headline(skipped)
    assert word == FAIL and "6 of 7 checks passed" in line and "did not run: determinism (no GPU)" in line
    left_out = ok[:-1] + [Check("determinism", verdict=NOT_RUN, reasons=["left out of validate.checks"])]
    assert report.headline(left_out)[0] == FAIL
    failed = [Check("env"), Check("kernels", verdict=FAIL, reasons=["sel: 2 of 4 tests failed"])]
    assert report.headline(failed) == (FAIL, "1 of 2 checks passed. failed: kernels (sel: 2 of 4 tests failed).")
    named = [Check("kernels", not_passed=["t[fa2] unavailable here: no varlen"])]
    word, line = report.headline(named)
    assert word == PASS and "not passed within passing checks: 1 (kernels: t[fa2] unavailable here: no varlen)" in line


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_kernels_gpu" name="test_sel[a]" time="1.5"><properties>
<property name="nodeid" value="tests/test_kernels_gpu.py::test_sel[a]"/><property name="kernel" value="sel"/></properties>
<failure message="AssertionError: sel/triton: over tolerance">long text</failure></testcase>
<testcase classname="tests.test_kernels_gpu" name="test_cmp[a]" time="0.5"><properties>
<property name="nodeid" value="tests/test_kernels_gpu.py::test_cmp[a]"/><property name="kernel" value="cmp"/>
<property name="peak_gib" value="41.54"/></properties>
</testcase>
<testcase classname="tests.test_varlen_gpu" name="test_w[fa2]" time="0.0"><properties>
<property name="nodeid" value="tests/test_varlen_gpu.py::test_w[fa2]"/><property name="kernel" value="varlen"/></properties>
<skipped type="pytest.skip" message="unavailable here: no varlen_attn(window_size)">x</skipped></testcase>
<testcase classname="tests.test_varlen_gpu" name="test_v" time="0.0"><properties>
<property name="nodeid" value="tests/test_varlen_gpu.py::test_v"/><property name="kernel" value="varlen"/></properties>
<skipped type="pytest.skip" message="TRITON_INTERPRET=1 interprets the kernels">x</skipped></testcase>
</testsuite></testsuites>"""


def test_junit_outcomes_tell_an_unavailable_backend_from_a_skip(tmp_path):
    (tmp_path / "j.xml").write_text(JUNIT)
    got = {t["test"].split("::")[1]: (t["kernel"], t["outcome"], t["message"]) for t in kernels.parse(tmp_path / "j.xml")}
    assert got == {"test_sel[a]": ("sel", "failed", "AssertionError: sel/triton: over tolerance"),
                   "test_cmp[a]": ("cmp", "passed", ""),
                   "test_w[fa2]": ("varlen", "unavailable", "no varlen_attn(window_size)"),
                   "test_v": ("varlen", "skipped", "TRITON_INTERPRET=1 interprets the kernels")}
    peaks = {t["test"].split("::")[1]: t["peak_gib"] for t in kernels.parse(tmp_path / "j.xml")}
    assert peaks == {"test_sel[a]": None, "test_cmp[a]": 41.54, "test_w[fa2]": None, "test_v": None}


def _decode_rows(path: str, t: dict) -> list[dict]:
    tok = {"cmp": 10.0, "sel": 74.0 if path == "module" else 64.0, "win": 32.0, "nsa": 106.0}
    return [{"variant": v, "step_path": path, "p50_ms": t[v], "kv_tokens_read_per_step_per_group": tok.get(v, 0.0),
             "kv_tokens_formula_per_step_per_group": 107, "kv_bytes_read_per_step": 1, "hbm_floor_ms": 0.0}
            for v in ("layer", "nsa", "cmp", "sel", "win", "dense")]


def test_decode_shares_sum_to_100_with_the_remainder():
    t = {"layer": 0.2, "nsa": 0.04, "cmp": 0.02, "sel": 0.012, "win": 0.01, "dense": 0.03}
    sh = decode_breakdown.shares(_decode_rows("graph_decoder", t))
    assert sh["pct"]["cmp"] == pytest.approx(50) and sh["pct"]["remainder"] == pytest.approx(-5)
    assert sum(sh["pct"].values()) == pytest.approx(100) and not sh["sel_derived"]
    # The module path's sel row also scores with the compressed branch: sel alone is the difference.
    sh = decode_breakdown.shares(_decode_rows("module", {**t, "sel": 0.032}))
    assert sh["ms"]["sel"] == pytest.approx(0.012) and sh["sel_derived"]
    tk = decode_breakdown.tokens(_decode_rows("module", t), {})
    assert tk["indices"] == {"cmp": 10.0, "sel": 64.0, "win": 32.0} and tk["kernel"] == {"cmp": None, "sel": None, "win": None}


def test_the_window_policy_keeps_the_preferred_backend_within_the_margin():
    seqs = [1024, 4096, 16384, 65536]
    times = {"sdpa": dict(zip(seqs, [1.0, 2.0, 8.0, 40.0])), "triton": dict(zip(seqs, [0.95, 1.5, 7.5, 30.0])),
             "fa2": dict(zip(seqs, [2.0, 3.0, 9.0, 31.0]))}
    choice = thresholds.choose(times, seqs, "sdpa", margin=0.10)
    assert choice == {1024: "sdpa", 4096: "triton", 16384: "sdpa", 65536: "triton"}  # 5 % faster stays sdpa
    assert thresholds.by_seq(choice) == [{"min_seq": 0, "backend": "sdpa"}, {"min_seq": 4096, "backend": "triton"},
                                         {"min_seq": 16384, "backend": "sdpa"}, {"min_seq": 65536, "backend": "triton"}]
    assert thresholds.by_seq(thresholds.choose(times, seqs, "reference", margin=0.10))[0] == {"min_seq": 0, "backend": "triton"}


def test_policy_by_seq_picks_the_backend_for_the_jobs_length():
    pol = OmegaConf.create({"by_seq": {"win": [{"min_seq": 0, "backend": "sdpa"}, {"min_seq": 4096, "backend": "triton"}]}})
    assert config.backend_by_seq(pol, "win", 4095, "h200_validated")[0] == "sdpa"
    name, note = config.backend_by_seq(pol, "win", 4096, "h200_validated")
    assert name == "triton" and note == "win: triton at seq=4096 (hardware=h200_validated policy.by_seq: from 4096 tokens)"
    assert config.backend_by_seq(pol, "sel", 4096, "x") is None
    bad = OmegaConf.create({"by_seq": {"win": [{"min_seq": 8, "backend": "sdpa"}, {"min_seq": 8, "backend": "fa2"}]}})
    with pytest.raises(config.ConfigError, match=r"by_seq.win\[1\].min_seq=8: must be an integer >= 0, ascending"):
        config.backend_by_seq(bad, "win", 10, "x")
    bad = OmegaConf.create({"by_seq": {"win": [{"min_seq": 0, "backend": "nope"}]}})
    with pytest.raises(config.ConfigError, match=r"hardware.policy.by_seq.win\[0\].backend='nope': unknown backend"):
        config.backend_by_seq(bad, "win", 10, "x")


def test_train_on_a_bfloat16_device_runs_the_reference_in_float32():
    """The GPU size's train check: the run's backends in bfloat16, the reference backend (which does not run
    under bfloat16 autocast, a config error in RunConfig) in float32."""
    conf = OmegaConf.load(REPO / "conf" / "validate.yaml")
    plan = {"cmp": "triton", "sel": "triton", "win": "triton"}
    job = SimpleNamespace(dtype=torch.bfloat16, fallback=None, cfg=OmegaConf.create({"seed": 0, "streams": False}))
    ctx = SimpleNamespace(size=conf.validate.sizes.gpu, job=job, cfg=job.cfg)
    test, ref = vtrain.run_config(ctx, plan), vtrain.run_config(ctx, "reference")
    assert (test.dtype, test.backend) == ("bfloat16", plan)
    assert (ref.dtype, ref.backend) == ("float32", dict.fromkeys(plan, "reference"))
    assert test.to_dict() | {"dtype": None, "backend": None} == ref.to_dict() | {"dtype": None, "backend": None}


def test_an_injected_fault_moves_that_branch_only_and_is_undone():
    """sel: the selected branch (and its fused gated sum) is off by the offset; cmp and win, and the
    reference, are not; leaving the block restores the backends."""
    cfg = make_config(HQ=4, H=2, Dk=16, Dv=8, l=8, d=4, l_sel=8, n_sel=3, w=8)
    x = random_inputs(cfg, 1, 40, dtype=torch.float32)
    args = [x[n] for n in ("q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win", "gates")]
    plan = {"cmp": "reference", "sel": "reference", "win": "sdpa"}
    before = dispatch.get("sdpa")
    with torch.no_grad():
        o = dispatch.get("sdpa").window(x["q"], x["k_win"], x["v_win"], cfg, scale=0.25, q_start=0)
        ref = dispatch.get("reference").selected(x["q"], x["k_sel"], x["v_sel"], torch.zeros(1, 40, 2, 3, dtype=torch.int64),
                                                 cfg, scale=0.25, q_start=0)
        with faults.inject("win"):
            o_f = dispatch.get("sdpa").window(x["q"], x["k_win"], x["v_win"], cfg, scale=0.25, q_start=0)
            assert torch.allclose(o_f - o, faults.offset(x["v_win"]).expand_as(o))
            assert dispatch.get("reference").selected(x["q"], x["k_sel"], x["v_sel"], torch.zeros(1, 40, 2, 3, dtype=torch.int64),
                                                      cfg, scale=0.25, q_start=0).equal(ref)
            from nsa import functional as fn

            full_f = fn.nsa_attention(*args, cfg, backend=plan)
        full = fn.nsa_attention(*args, cfg, backend=plan)
    assert dispatch.get("sdpa") is before
    g_win = x["gates"][..., 2:3]
    assert torch.allclose(full_f - full, g_win * faults.offset(x["v_win"]), atol=1e-6)
    assert float(faults.offset(x["v_win"])) == pytest.approx(0.1 * float(x["v_win"].pow(2).mean().sqrt()), rel=1e-6)
    with pytest.raises(ValueError, match="inject_fault='gate': one of cmp, sel, win"):
        with faults.inject("gate"):
            pass


def test_graph_timing_divides_a_replay_by_the_steps_it_holds(monkeypatch):
    """measure.timing.graph_ms: reps calls in one captured graph, the replay's time / reps; and one call per graph."""
    calls = []
    captured = []

    def capture(fn):
        captured.append(fn)
        return fn

    stops = []
    monkeypatch.setattr(timing, "time_ms", lambda fn, device, warmup, repeats, should_stop: [
        fn() or should_stop() or 8.0 for _ in range(repeats)])
    q = graph_ms(capture, lambda: calls.append(1), torch.device("cpu"), 0, 3, reps=4, should_stop=lambda: stops.append(1))
    assert q["p50_ms"] == 2.0 and q["single_replay_p50_ms"] == 8.0 and len(stops) == 6  # passed on to each timing
    assert len(captured) == 2 and len(calls) == 3 * 4 + 3  # 3 replays of 4 calls, 3 of one


def test_minus_m_gpu_collects_only_the_gpu_modules():
    """The interpreter's modules set TRITON_INTERPRET=1 on import: `-m gpu` must not import them."""
    import conftest

    cfg = SimpleNamespace(getoption=lambda name: "gpu")
    assert conftest.pytest_ignore_collect(REPO / "tests" / "test_triton_backend.py", cfg) is True
    assert conftest.pytest_ignore_collect(REPO / "tests" / "test_kernels_interpret.py", cfg) is True
    assert conftest.pytest_ignore_collect(REPO / "tests" / "test_kernels_gpu.py", cfg) is None
    assert conftest.pytest_ignore_collect(REPO / "tests" / "conftest.py", cfg) is None
    assert conftest.pytest_ignore_collect(REPO / "tests" / "test_triton_backend.py",
                                          SimpleNamespace(getoption=lambda name: "")) is None
