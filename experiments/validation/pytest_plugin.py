"""The pytest plugin of ``experiments.validate``'s kernel check: ``-p experiments.validation.pytest_plugin``.

* every collected test carries two junit properties (``-o junit_family=xunit1`` writes them):
  ``nodeid``, and ``kernel``, what it checks (the ``kernel`` marker's name: cmp, sel, win, layer;
  else its module's name without ``test_`` and ``_gpu``), by which the report groups the tests;
* ``--validate-json PATH`` writes the tests that were deselected (by ``-m``, ``-k``, or the ``gpu``
  rule of tests/conftest.py), which junit XML does not list;
* ``--validate-progress PATH``: a line ``total <n>`` once the tests are collected, then a line ``done``
  per test that ended (the validate process draws its progress bar from it).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest


def pytest_addoption(parser):
    parser.addoption("--validate-json", default=None, help="experiments.validate: write the deselected tests here")
    parser.addoption("--validate-progress", default=None, help="experiments.validate: the tests' count, then one line a test")


_CONFIG: list = []  # this session's pytest config (the progress hooks have none of their own)


def pytest_configure(config):
    _CONFIG[:] = [config]


def _progress(line: str) -> None:
    """A line of the progress file, from the process that reports (not an xdist worker: its controller does)."""
    config = _CONFIG[0] if _CONFIG else None
    path = config.getoption("--validate-progress") if config else None
    if path and not hasattr(config, "workerinput"):
        with open(path, "a") as f:
            f.write(line + "\n")


def pytest_collection_finish(session):
    if not getattr(session.config.option, "numprocesses", None):  # xdist: its controller collects nothing
        _progress(f"total {len(session.items)}")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    if not any(ln.startswith("total") for ln in _lines()):  # each worker collects the same list
        _progress(f"total {len(ids)}")


def _lines() -> list[str]:
    path = _CONFIG[0].getoption("--validate-progress") if _CONFIG else None
    return Path(path).read_text().splitlines() if path and Path(path).exists() else []


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and not report.passed):  # ran, or skipped/errored before
        _progress("done")


def kernel_of(item) -> str:
    mark = item.get_closest_marker("kernel")
    if mark is not None:
        return str(mark.args[0])
    return Path(str(item.fspath)).stem.removeprefix("test_").removesuffix("_gpu")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    for item in items:
        item.user_properties += [("nodeid", item.nodeid), ("kernel", kernel_of(item))]


def pytest_deselected(items):
    _DESELECTED.extend(item.nodeid for item in items)


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--validate-json")
    if not path:
        return
    if getattr(session.config.option, "numprocesses", None) and not hasattr(session.config, "workerinput"):
        return  # pytest-xdist's controller collects nothing: its workers write (each the same list)
    tmp = Path(f"{path}.{getattr(session.config, 'workerinput', {}).get('workerid', 'main')}")
    tmp.write_text(json.dumps({"deselected": sorted(set(_DESELECTED))}, indent=1))
    tmp.replace(path)


_DESELECTED: list[str] = []
