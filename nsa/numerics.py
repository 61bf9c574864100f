"""How far a result is from its reference: the one relative-L2 error of the library, the experiments
(kernel checks, parity, validation) and the tests, so that every tolerance means the same thing; and the
floating-point dtypes by the names configurations give them."""
from __future__ import annotations

import math

import torch

DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error ``||a - b||_2 / ||b||_2`` of ``a`` against the reference ``b``.

    Arguments:
        a: the result under test, any shape and floating dtype.
        b: the reference, ``a``'s shape, on ``a``'s device (any floating dtype).

    Returns:
        A Python float, accumulated in float64 (both tensors upcast before the difference, so a
        bfloat16 result is not rounded again by the check):

        * ``0.0`` for empty tensors;
        * a zero reference (``||b|| = 0``): ``0.0`` where ``a`` is zero too, else ``inf``;
        * ``nan`` where either tensor holds a NaN or an infinity (e.g. an element a kernel left
          NaN-poisoned), so that no non-finite result passes ``err <= tol``. Compare that way round:
          ``err > tol`` is False for NaN.

    Raises:
        ValueError: the shapes differ (no broadcasting: a shape error is not an error of the values).
    """
    if a.shape != b.shape:
        raise ValueError(f"rel_l2: shapes differ: {tuple(a.shape)} against the reference's {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return math.nan
    diff, ref = float(torch.linalg.vector_norm(a - b)), float(torch.linalg.vector_norm(b))
    if ref == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / ref
