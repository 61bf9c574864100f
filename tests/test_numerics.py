"""``nsa.numerics.rel_l2``, the one relative-L2 error every check uses: its edge cases, and that no other
is written in the repository."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from nsa.numerics import rel_l2

REPO = Path(__file__).resolve().parents[1]


def test_value_and_type():
    b = torch.tensor([3.0, 4.0])
    assert rel_l2(b + torch.tensor([0.0, 1.0]), b) == pytest.approx(0.2, rel=1e-15)
    assert rel_l2(b, b) == 0.0 and type(rel_l2(b, b)) is float
    assert rel_l2(b.bfloat16(), b) == 0.0  # mixed dtypes: both upcast


@pytest.mark.parametrize("scale", [1e30, 1e-30])
def test_accumulates_in_float64(scale):
    """float32 sums of squares overflow (1e30) or underflow (1e-30) to inf or 0: NaN in float32."""
    b = torch.full((4,), scale)
    a = b * 1.001
    assert math.isnan(float((a - b).norm() / b.norm()))  # what a float32 norm gives
    assert rel_l2(a, b) == pytest.approx(1e-3, rel=1e-4)


def test_zero_reference_and_empty():
    z = torch.zeros(3)
    assert rel_l2(z, z) == 0.0
    assert rel_l2(torch.tensor([0.0, 1e-40, 0.0], dtype=torch.float64), z) == math.inf
    assert rel_l2(torch.empty(0, 4), torch.empty(0, 4)) == 0.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["result", "reference"])
def test_non_finite_is_nan_and_never_within_a_tolerance(bad, where):
    b = torch.ones(4)
    a = b.clone()
    (a if where == "result" else b)[1] = bad
    err = rel_l2(a, b)
    assert math.isnan(err) and not err <= 1e9


def test_shapes_must_match():
    with pytest.raises(ValueError, match=r"shapes differ: \(3, 1\) against the reference's \(3,\)"):
        rel_l2(torch.ones(3, 1), torch.ones(3))  # would broadcast to 3x3


def test_no_other_relative_l2_in_the_repository():
    """``x.norm() / y.norm()`` written anywhere else is another clamp and NaN rule: use rel_l2."""
    pattern = re.compile(r"norm\(\)\s*/|norm\(\)\.item\(\)\s*/|vector_norm\([^)]*\)\s*/")
    found = [f"{p.relative_to(REPO)}:{i}" for d in ("nsa", "experiments", "scripts", "tests")
             for p in sorted((REPO / d).rglob("*.py")) if p.name != "test_numerics.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == [], found
