"""The README's usage examples run as written (the CUDA-only block is skipped on CPU machines)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_the_examples():
    assert len(BLOCKS) >= 3
    assert "NSAAttention" in BLOCKS[0] and "nsa_attention" in BLOCKS[1] and "GraphDecoder" in BLOCKS[2]


@pytest.mark.parametrize("i", [0, 1])
def test_readme_example_runs(i, capsys):
    exec(compile(BLOCKS[i], f"README.md block {i}", "exec"), {})
    if i == 1:
        out = capsys.readouterr().out
        assert "torch.Size([1, 200, 4, 16])" in out and "'sel': 'reference'" in out


def test_quickstart_has_exactly_two_command_lines():
    quick = README.read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    bash = re.findall(r"```bash\n(.*?)```", quick, re.S)
    lines = [ln for b in bash for ln in b.strip().splitlines() if ln.strip()]
    assert len(lines) == 2
    assert "pip install torch==2.13.0" in lines[0] and "experiments.decode" in lines[0]
    assert "pytest" in lines[1]
    ci = (README.parent / ".ci" / "run").read_text()
    assert lines[1] in ci, ".ci/run must run the README's test command"
