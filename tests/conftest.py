"""The suite's layout and markers. ``tests/`` mirrors the code: ``text/ model/ memory/ engine/ serving/``
test nanolab's layers, ``autograder/`` the grader, ``labs/`` each lab (``test_labNN_solution.py``: the
solution against nanolab; ``test_labNN_grading.py``: its grading; ``test_lab01_hostile.py``: hostile
submissions), ``tooling/`` the notebooks, the commands and the packaging; ``helpers/`` holds what several
of them share (imported as ``helpers.<module>``).

Markers (registered in ``pyproject.toml``): ``sandbox`` for every test that grades a notebook or starts
the grader's sandbox, ``browser`` for the JupyterLab browser test, ``slow`` for tests that take more than
a few seconds each: every ``sandbox`` and ``browser`` test, and any test marked so itself (a notebook run
top to bottom). ``pytest tests -m "not slow"`` is a fast inner loop; ``make test`` runs all.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SANDBOX_FOLDERS = ("autograder", "labs")  # every module there grades notebooks or starts a sandbox
SANDBOX_FREE = {"test_autograder_layers.py", "test_lab01_solution.py", "test_lab02_solution.py",
                "test_lab03_solution.py", "test_lab05_solution.py", "test_lab06_solution.py",
                "test_lab07_solution.py", "test_lab08_solution.py"}  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(item.path).resolve()
        try:
            folder = path.relative_to(HERE).parts[0]
        except ValueError:
            continue
        if folder in SANDBOX_FOLDERS and path.name not in SANDBOX_FREE:
            item.add_marker(pytest.mark.sandbox)
        if path.name == "test_browser.py":
            item.add_marker(pytest.mark.browser)
        if item.get_closest_marker("sandbox") or item.get_closest_marker("browser"):
            item.add_marker(pytest.mark.slow)
