"""The pytest plugin of ``experiments.validate``'s kernel check: ``-p experiments.validation.pytest_plugin``.

* every collected test carries two junit properties (``-o junit_family=xunit1`` writes them):
  ``nodeid``, and ``kernel``, what it checks (the ``kernel`` marker's name: cmp, sel, win, layer;
  else its module's name without ``test_`` and ``_gpu``), by which the report groups the tests;
* ``--validate-json PATH`` writes the tests that were deselected (by ``-m``, ``-k``, or the ``gpu``
  rule of tests/conftest.py), which junit XML does not list.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest


def pytest_addoption(parser):
    parser.addoption("--validate-json", default=None, help="experiments.validate: write the deselected tests here")


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
    if path:
        Path(path).write_text(json.dumps({"deselected": sorted(set(_DESELECTED))}, indent=1))


_DESELECTED: list[str] = []
