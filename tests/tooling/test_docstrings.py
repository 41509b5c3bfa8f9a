"""Every ``Example:`` in the package's docstrings runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "nanolab"
WITH_EXAMPLES = sorted(
    ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)
    for p in PACKAGE.rglob("*.py")
    if ">>> " in p.read_text()
)


def test_examples_are_found():
    assert {"nanolab.memory.paging", "nanolab.text.pretokenize", "nanolab.engine.prompt"} <= set(
        WITH_EXAMPLES
    )


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0
