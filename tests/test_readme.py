"""The README's and docs/layer.md's usage examples run as written (the CUDA-only block is skipped on CPU
machines), the Quickstart is two lines CI runs, and the README stays short, its depth in docs/."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
LAYER = README.parent / "docs" / "layer.md"
BLOCKS = re.findall(r"```python\n(.*?)```", LAYER.read_text(), re.S)
README_BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_docs_have_the_examples():
    assert len(README_BLOCKS) == 2 and "NSAAttention" in README_BLOCKS[0] and "hf.convert" in README_BLOCKS[1]
    assert len(BLOCKS) >= 3
    assert "NSAAttention" in BLOCKS[0] and "nsa_attention" in BLOCKS[1] and "GraphDecoder" in BLOCKS[2]


def test_readme_example_runs():
    exec(compile(README_BLOCKS[0], "README.md block 0", "exec"), {})


def test_readme_hf_example_runs(tmp_path, monkeypatch):
    """The Hugging Face block (the [hf] extra, which CI installs): converted, generating, saved and loaded back."""
    pytest.importorskip("transformers")
    from nsa.integrations.hf import NSASelfAttention

    monkeypatch.chdir(tmp_path)
    ns = {}
    exec(compile(README_BLOCKS[1], "README.md block 1", "exec"), ns)
    assert ns["tokens"].shape == (1, 11) and (tmp_path / "nsa-llama" / "model.safetensors").exists()
    assert isinstance(ns["model"].model.layers[1].self_attn, NSASelfAttention) and ns["model"].config.nsa["n_sel"] == 16
    assert type(ns["model"]).__name__ == "NSALlamaForCausalLM"  # loaded back through the Auto class


@pytest.mark.parametrize("i", [0, 1])
def test_layer_example_runs(i, capsys):
    exec(compile(BLOCKS[i], f"docs/layer.md block {i}", "exec"), {})
    if i == 1:
        out = capsys.readouterr().out
        assert "torch.Size([1, 200, 4, 16])" in out and "'sel': 'reference'" in out


def test_readme_is_short_and_links_resolve():
    """A newcomer's read: at most 200 lines; every relative link of the README and docs/ names a file
    that exists (and, with a #fragment, a heading of it)."""
    assert len(README.read_text().splitlines()) <= 200
    for page in [README, *sorted((README.parent / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]*)(?:#([^)]*))?\)", page.read_text()):
            path, frag = target
            f = (page.parent / path).resolve() if path else page
            assert f.exists(), f"{page.name}: link to {path} (missing)"
            if frag:
                slugs = {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
                         for h in re.findall(r"^#+ (.*)$", f.read_text(), re.M)}
                assert frag in slugs, f"{page.name}: link to {path}#{frag} (no such heading)"


def _quickstart_lines() -> list[str]:
    quick = README.read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    bash = re.findall(r"```bash\n(.*?)```", quick, re.S)
    return [ln for b in bash for ln in b.strip().splitlines() if ln.strip()]


def test_quickstart_has_exactly_two_command_lines():
    lines = _quickstart_lines()
    assert len(lines) == 2
    assert "pip install" in lines[0] and "experiments.decode" in lines[0]
    assert "pytest" in lines[1]
    ci = (README.parent / ".ci" / "run").read_text()
    for line in lines:
        assert line in ci.splitlines(), f".ci/run must run the README's line as written: {line}"


QUICK_TIER = "TRITON_INTERPRET=1 python -m pytest -q -n auto --dist loadfile -m quick"


def test_quickstart_names_the_quick_tier_and_ci_runs_it_before_the_suite():
    quick = " ".join(README.read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0].split())
    assert f"`{QUICK_TIER}`" in quick
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    assert ci.index(QUICK_TIER) < ci.index(_quickstart_lines()[1])


def test_the_quick_tier_names_modules_that_exist():
    import conftest

    tests = README.parent / "tests"
    assert len(conftest.QUICK_MODULES) >= 20 and all((tests / m).is_file() for m in conftest.QUICK_MODULES)


def test_quickstart_installs_a_supported_pair():
    from nsa.toolchain import supported_ids, toolchain_id

    pins = dict(re.findall(r"\b(torch|triton)==([0-9][^\s\"']*)", _quickstart_lines()[0]))
    assert set(pins) == {"torch", "triton"}, "the Quickstart pins torch and triton together"
    assert toolchain_id(pins["torch"], pins["triton"]) in supported_ids()


def test_ci_checks_the_install_lines_on_a_stock_index():
    ci = (README.parent / ".ci" / "run").read_text()
    assert "python scripts/check_install.py" in ci


def test_the_readme_test_command_starts_no_daemons():
    """The README's test command on the tests that start system services: skipped with the option that asks for
    them named (a plain pytest installs and starts nothing of the system's)."""
    import subprocess
    import sys

    import entrypoints

    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "tests/test_cluster_prefix.py"], cwd=entrypoints.REPO,
                       env=entrypoints.env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "2 skipped" in p.stdout, p.stdout[-2000:]
    assert "starts SLURM, munge and MariaDB as root: run with pytest --daemons" in p.stdout
    assert "passed" not in p.stdout
