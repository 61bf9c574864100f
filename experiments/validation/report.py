"""The validation report: one document, written as ``report.md`` and ``report.html`` (the same blocks;
the HTML embeds its images, so the file alone shows everything, in MLflow's artifact view too).

A check's section is a list of blocks (:class:`Text`, :class:`Table`, :class:`Image`, :class:`Code`,
:class:`Items`). The top: the PASS/FAIL headline, what ran where, one table row per check (verdict,
figures, time), then every check's section.
"""
from __future__ import annotations

import base64
import html
import os
from dataclasses import dataclass, field
from pathlib import Path

from .core import FAIL, NOT_RUN, PASS, SKIP, Check


@dataclass
class Text:
    text: str


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]
    collapsed: str | None = None  # HTML: folded under this summary line


@dataclass
class Image:
    path: Path
    alt: str


@dataclass
class Code:
    text: str


@dataclass
class Items:
    title: str
    items: list[str] = field(default_factory=list)
    collapsed: bool = False  # HTML: folded under the title


def headline(results: list[Check]) -> tuple[str, str]:
    """("PASS" | "FAIL", one line): PASS only where every check ran and passed."""
    failed = [r for r in results if r.verdict == FAIL]
    missing = [r for r in results if r.verdict in (SKIP, NOT_RUN)]
    passed = [r for r in results if r.verdict == PASS]
    parts = [f"{len(passed)} of {len(results)} checks passed"]
    if failed:
        parts.append("failed: " + "; ".join(f"{r.name} ({'; '.join(r.reasons) or 'failed'})" for r in failed))
    if missing:
        parts.append("not passed, did not run: " + "; ".join(f"{r.name} ({'; '.join(r.reasons)})" for r in missing))
    extra = [f"{r.name}: {x}" for r in results for x in r.not_passed]
    if extra:
        parts.append(f"not passed within passing checks: {len(extra)} (" + "; ".join(extra) + ")")
    return ("PASS" if not failed and not missing else "FAIL"), ". ".join(parts) + "."


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _md(block, base: Path) -> str:
    if isinstance(block, Text):
        return block.text
    if isinstance(block, Code):
        return "```\n" + block.text.rstrip() + "\n```"
    if isinstance(block, Image):
        return f"![{block.alt}]({os.path.relpath(block.path, base)})"
    if isinstance(block, Items):
        return f"{block.title}\n\n" + "\n".join(f"- {_cell(i)}" for i in block.items) if block.items else ""
    if block.collapsed:
        lines = [block.collapsed, ""]
    else:
        lines = []
    lines += ["| " + " | ".join(map(_cell, block.header)) + " |", "|" + "---|" * len(block.header)]
    return "\n".join(lines + ["| " + " | ".join(map(_cell, r)) + " |" for r in block.rows])


def _html(block) -> str:
    e = html.escape
    if isinstance(block, Text):
        return f"<p>{e(block.text)}</p>"
    if isinstance(block, Code):
        return f"<pre>{e(block.text.rstrip())}</pre>"
    if isinstance(block, Image):
        data = base64.b64encode(block.path.read_bytes()).decode()
        return (f'<figure><img alt="{e(block.alt)}" src="data:image/png;base64,{data}">'
                f"<figcaption>{e(block.alt)}</figcaption></figure>")
    if isinstance(block, Items):
        if not block.items:
            return ""
        items = "<ul>" + "".join(f"<li>{e(i)}</li>" for i in block.items) + "</ul>"
        if block.collapsed:
            return f"<details><summary>{e(block.title)}</summary>{items}</details>"
        return f"<p>{e(block.title)}</p>{items}"
    head = "".join(f"<th>{e(h)}</th>" for h in block.header)
    body = "".join("<tr>" + "".join(f"<td{_cell_class(c)}>{e(str(c))}</td>" for c in r) + "</tr>" for r in block.rows)
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    return f"<details><summary>{e(block.collapsed)}</summary>{table}</details>" if block.collapsed else table


def _cell_class(cell) -> str:
    """Verdicts in colour; short cells (figures with units) on one line."""
    verdict = {PASS: "pass", FAIL: "fail", SKIP: "skip", NOT_RUN: "skip"}.get(str(cell))
    return f' class="{verdict}"' if verdict else (' class="n"' if len(str(cell)) <= 28 else "")


CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;padding:0 1em;color:#222}
h1.pass{color:#0a7a2f}h1.fail{color:#b3141b}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.6em 0;font-size:14px}th,td{border:1px solid #ccc;padding:4px 8px;
text-align:left;vertical-align:top}th{background:#f3f3f3}td.pass{color:#0a7a2f;font-weight:bold}
td.fail{color:#b3141b;font-weight:bold}td.skip{color:#a15c00;font-weight:bold}pre{background:#f6f6f6;
padding:.6em;overflow-x:auto;font-size:13px}img{max-width:100%}figure{margin:.6em 0}
figcaption{font-size:13px;color:#555}.headline{font-size:15px}td.n{white-space:nowrap}
details{margin:.6em 0}summary{cursor:pointer;color:#333}"""


def write(out: Path, title: str, intro: list, results: list[Check]) -> tuple[Path, Path]:
    """report.md and report.html in ``out``: the headline, ``intro`` blocks, the table of checks, then
    each check's section (its reasons, notes and blocks)."""
    word, line = headline(results)
    table = Table(["check", "verdict", "figures", "time"],
                  [[r.name, r.verdict, r.figures, f"{r.seconds:.1f} s" if r.verdict != NOT_RUN else ""] for r in results])
    sections = []
    for r in results:
        blocks = [Text(f"Verdict: {r.verdict}. " + (r.figures or ""))]
        blocks.append(Items("Why it did not pass:", r.reasons))
        blocks.append(Items("Not passed (named, counted; the check itself passed):", r.not_passed))
        blocks.append(Items("Notes:", r.notes))
        sections.append((r.name, blocks + r.blocks))
    md = [f"# {title}: {word}", line, *(_md(b, out) for b in intro), "## Checks", _md(table, out)]
    for name, blocks in sections:
        md += [f"## {name}", *(_md(b, out) for b in blocks)]
    body = [f'<h1 class="{word.lower()}">{html.escape(title)}: {word}</h1>', f'<p class="headline">{html.escape(line)}</p>',
            *(_html(b) for b in intro), "<h2>Checks</h2>", _html(table)]
    for name, blocks in sections:
        body += [f'<h2 id="{name}">{html.escape(name)}</h2>', *(_html(b) for b in blocks)]
    md_path, html_path = out / "report.md", out / "report.html"
    _atomic(md_path, "\n\n".join(p for p in md if p) + "\n")
    _atomic(html_path, f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}: {word}</title>"
                       f"<style>{CSS}</style></head><body>\n" + "\n".join(p for p in body if p) + "\n</body></html>\n")
    return md_path, html_path


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------
# Plots (matplotlib's Agg canvas, no display)
# ------------------------------------------------------------------------------------------------
def _figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h))
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, path)
    return path


def stacked_shares(labels: list[str], parts: dict[str, list[float]], path: Path, title: str) -> Path:
    """Horizontal bars, one per label, each split into ``parts`` (percent; a negative remainder is drawn
    left of zero)."""
    fig = _figure(9, 0.55 * len(labels) + 1.6)
    ax = fig.add_subplot(1, 1, 1)
    left_pos, left_neg = [0.0] * len(labels), [0.0] * len(labels)
    for name, vals in parts.items():
        starts = [lp if v >= 0 else ln for v, lp, ln in zip(vals, left_pos, left_neg)]
        ax.barh(labels, vals, left=starts, label=name, height=0.7)
        for i, v in enumerate(vals):
            if v >= 0:
                left_pos[i] += v
            else:
                left_neg[i] += v
        for i, (v, s) in enumerate(zip(vals, starts)):
            if abs(v) >= 6:
                ax.text(s + v / 2, i, f"{v:.0f}%", ha="center", va="center", fontsize=8, color="white")
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlabel("% of the measured attention step")
    ax.set_title(title)
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return _save(fig, path)


def lines(series: dict[str, list[tuple[float, float]]], path: Path, title: str, xlabel: str, ylabel: str,
          logx: bool = True, logy: bool = True) -> Path:
    """One line per series (dashed where the name starts with "dense" or "reference")."""
    fig = _figure(7.5, 4.6)
    ax = fig.add_subplot(1, 1, 1)
    for name, pts in series.items():
        if pts:
            style = "--" if name.startswith(("dense", "reference")) else "-"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", markersize=3, label=name)
    if logx:
        ax.set_xscale("log", base=2)
    if logy and all(p[1] > 0 for pts in series.values() for p in pts):
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def table_text(results: list[Check]) -> str:
    """The table of checks for the console."""
    from ..framework.report import table

    return table(["check", "verdict", "time", "figures"],
                 [[r.name, r.verdict, f"{r.seconds:.1f} s" if r.verdict != NOT_RUN else "", r.figures or "; ".join(r.reasons)]
                  for r in results])
