"""The pytest plugin that runs hidden tests against one submission and records their verdicts.

What a hidden test sees (the ``lab`` and ``rng`` fixtures, the markers) is `autograder.authoring.testing`; this
module is the machinery behind it. It registers those fixtures and markers, keeps the submission's
`Session` where the fixtures find it, makes one `TestResult` per collected test and fills it in from
pytest's reports.

Verdicts are taken from those reports in this (trusted) process. A failure's feedback is the
assertion's own message (pytest runs with ``--assert=plain``, so compared values are not shown), or a
description of what the learner's code raised, or why the sandbox stopped answering; it goes through
the ``safe`` filter it is given (`autograder.grading.feedback`: no control characters, no grader source).
Each collected test and each finished one is also handed to ``report``, so that a watchdog that
stops the grading keeps the verdicts already decided (`autograder.grading.batch`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from autograder.authoring import testing
from autograder.grading.results import TestResult
from autograder.grading.session import SESSION_KEY, GradingProblem, Session
from autograder.sandbox.remote import RemoteError, SandboxFailure

MAX_OUTPUT_CHARS = 3000


def feedback(exc: BaseException) -> str:
    """The learner-facing text for a test's failure."""
    if isinstance(exc, AssertionError):
        text = str(exc) or "a hidden check failed"
    elif isinstance(exc, RemoteError):
        text = f"your code raised {exc}"
        if exc.traceback.strip():
            text += "\n" + exc.traceback.rstrip()
    elif isinstance(exc, (SandboxFailure, GradingProblem)):
        text = str(exc)
    else:
        text = f"the check could not use what your code returned ({type(exc).__name__}: {exc})"
    return text if len(text) <= MAX_OUTPUT_CHARS else text[: MAX_OUTPUT_CHARS - 20] + "\n... (cut)"


class GradingPlugin:
    """Collects one `TestResult` per hidden test of one submission's pytest run.

    ``id_prefixes`` maps a folder of test modules to the prefix of its tests' ids, so an instructor's
    extra test never shares an id (a CSV column) with a built-in one.
    """

    def __init__(
        self,
        session: Session,
        id_prefixes: dict[Path, str] | None = None,
        safe: Callable[[str], str] = lambda text: text,
        report: Callable[..., Any] | None = None,
    ):
        self.session = session
        self.id_prefixes = {Path(folder).resolve(): prefix for folder, prefix in (id_prefixes or {}).items()}
        self.safe = safe  # what every feedback text goes through
        self.report = report or (lambda *message: None)  # ("collected", [tests]) and ("test", test)
        self.results: dict[str, TestResult] = {}  # by pytest node id, in collection order
        self.collection_errors: list[str] = []

    def pytest_configure(self, config: pytest.Config) -> None:
        config.stash[SESSION_KEY] = self.session
        config.pluginmanager.register(testing, "nanolab-testing")  # the fixtures
        config.addinivalue_line("markers", "points(n): points a hidden test is worth (default 1)")
        config.addinivalue_line("markers", "visibility(v): Gradescope visibility of the test's result")

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            points = item.get_closest_marker("points")
            visibility = item.get_closest_marker("visibility")
            doc = (getattr(item, "obj", None).__doc__ or "").strip().splitlines()
            self.results[item.nodeid] = TestResult(
                id=self.id_prefixes.get(item.path.parent.resolve(), "") + item.name,
                name=doc[0].strip() if doc else item.name,
                max_score=float(points.args[0]) if points else 1.0,
                visibility=visibility.args[0]
                if visibility and visibility.args[0] in testing.VISIBILITIES
                else "visible",
            )
        self.report("collected", [asdict(result) for result in self.results.values()])

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collection_errors.append(f"{report.nodeid}: {str(report.longrepr)[-1500:]}")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
        outcome = yield
        report = outcome.get_result()
        result = self.results.get(item.nodeid)
        if result is None:
            return
        if call.when == "setup" or call.when == "call":
            if report.passed and call.when == "call":
                result.status, result.output = "passed", ""
            elif report.failed:
                exc = call.excinfo.value if call.excinfo is not None else None
                result.status = "failed"
                result.output = self.safe(feedback(exc)) if exc is not None else "failed"
                if isinstance(exc, SandboxFailure):
                    self.session.note_failure(str(exc))
            elif report.skipped:
                result.status, result.output = (
                    "failed",
                    f"not run ({report.longrepr[-1] if isinstance(report.longrepr, tuple) else 'skipped'})",
                )
        elif call.when == "teardown":
            if report.failed:
                result.status = "failed"
                result.output = (result.output + "\n" if result.output else "") + "the test's cleanup failed"
            self.report("test", asdict(result))

    def pytest_sessionfinish(self) -> None:
        self.session.close()
