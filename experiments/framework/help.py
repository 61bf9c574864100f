"""``--help`` of each entry point: its own config groups and settings, not every entry point's.

Hydra's ``$APP_CONFIG_GROUPS`` lists every group of the shared ``conf/`` folder (a decode's help named
the training tasks) and ``$CONFIG`` prints the whole composed config. The help template
(``conf/common.yaml``, ``hydra.help.template``) calls these OmegaConf resolvers instead, which read the
composed config: the groups this entry point composed (``hydra.runtime.choices``) with the options of
each, and its own section (``decode:``, ``prefill:``, ...). ``--cfg job`` still prints everything.
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .config import option_meaning

CONF = Path(__file__).resolve().parents[2] / "conf"


def options(group: str) -> list[str]:
    """The options of a config group: its YAML files in conf/<group>/."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def groups(_root_: DictConfig) -> str:
    """``group: option, option (chosen)`` for each group this entry point composed (Hydra's own, hydra/...,
    are in --hydra-help)."""
    choices = _root_.hydra.runtime.choices
    lines = []
    for g in sorted(k for k in choices if not k.startswith("hydra/") and (CONF / k).is_dir()):
        if choices[g] is not None:  # None: a group of the shared defaults this entry point leaves out
            lines.append(f"{g}: {', '.join(options(g))} (now: {choices[g]})")
            if g == "backend":  # an option that is another backend for some branches says so
                mixed = [f"backend={o} runs {m}" for o in options(g) if (m := option_meaning(o))]
                lines += [f"  ({'; '.join(mixed)})"] if mixed else []
    return "\n".join(lines)


def section(_root_: DictConfig) -> str:
    """This entry point's own section of the config (e.g. ``decode:``), unresolved (``$`` doubled: Hydra
    passes the template through ``string.Template``); mappings below ``DEPTH`` levels are named by their
    keys, lists and small mappings of plain values are written on one line: a screenful, not validate's every size
    table."""
    name = _root_.hydra.job.name
    node = _root_.get(name)
    if node is None:
        return f"(no {name} section)"
    text = "\n".join(_lines({name: OmegaConf.to_container(node, resolve=False)}, 0))
    return text.replace("$", "$$")


DEPTH = 3


def _scalar(v) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_scalar(x) for x in v) + "]"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


FLOW = 110  # a mapping of plain values is written on one line up to this width


def _flow(v: dict) -> str | None:
    """``{k: v, ...}`` for a mapping of plain values (no mapping inside) that fits in FLOW characters, else None."""
    if any(isinstance(x, dict) for x in v.values()):
        return None
    text = "{" + ", ".join(f"{k}: {_scalar(x)}" for k, x in v.items()) + "}"
    return text if len(text) <= FLOW else None


def _lines(node: dict, depth: int) -> list[str]:
    out = []
    for k, v in node.items():
        pad = "  " * depth
        if isinstance(v, dict) and v and _flow(v) is not None and depth > 0:
            out.append(f"{pad}{k}: {_flow(v)}")
        elif isinstance(v, dict) and depth + 1 >= DEPTH:
            out.append(f"{pad}{k}: ... ({', '.join(map(str, v))}; --cfg job shows them)")
        elif isinstance(v, dict):
            out += [f"{pad}{k}:", *_lines(v, depth + 1)]
        else:
            out.append(f"{pad}{k}: {_scalar(v)}")
    return out


def register() -> None:
    for name, fn in (("nsa_help_groups", groups), ("nsa_help_section", section)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
