"""Nested configuration mappings as one level of dotted keys (MLflow params, a checkpoint's config
compared with the run's)."""
from __future__ import annotations

from collections.abc import Mapping


def flatten(d: Mapping, prefix: str = "") -> dict:
    """A nested mapping as one level of dotted keys: ``{"lm": {"d": 1}}`` -> ``{"lm.d": 1}``.

    Arguments:
        d: the mapping; values that are mappings are descended into, any other value is a leaf.
        prefix: put before every key (``"lm."`` gives ``lm.d``).

    Returns:
        ``{dotted key: leaf value}``, leaves as they are (not converted to strings).
    """
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
