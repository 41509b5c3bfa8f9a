"""The pytest plugin that connects hidden tests to one submission and records the verdicts.

Hidden tests are ordinary pytest functions that ask for two fixtures:

- ``lab``: the submission's notebook, reached through the sandbox. ``lab.merge([1, 2], (1, 2), 256)``
  runs the learner's ``merge`` in the sandboxed process and returns plain data; objects that are not
  data (a ``Tokenizer``) come back as `autograder.sandbox.Remote` handles whose methods are proxied.
  A graded name that the notebook does not define, that is not the learner's own code, or whose cell
  failed to run, raises `GradingProblem` with a message for the learner.
  ``lab.hold(value)`` copies plain data into the sandbox and keeps it there; the handle it returns
  reaches the learner's code as that object, and ``lab.peek(handle)`` reads it back afterwards, so a
  test can check that a call leaves its input unchanged (arguments are otherwise copied both ways).
- ``rng``: a `random.Random` seeded from the grading run's seed and the test's name, so inputs differ
  from run to run (reading the tests does not reveal them) but a run can be repeated with ``--seed``.

Markers: ``@pytest.mark.points(2)`` (default 1) and ``@pytest.mark.visibility("after_published")``
(Gradescope's values; default "visible"). A test's name is the first line of its docstring.

Verdicts are taken from pytest's reports in this (trusted) process. A failure's feedback is the
assertion's own message (pytest runs with ``--assert=plain``, so compared values are not shown), or a
description of what the learner's code raised, or why the sandbox stopped answering.

Sandbox policy: one sandboxed process serves all tests of a submission. If a call times out or the
process dies, that test fails and the next test starts a fresh process; after ``max_restarts`` such
restarts the remaining tests fail at once, and so do the tests that start after the notebook's total
time (``Limits.notebook_s``) is used up. If the notebook's code itself cannot be loaded (it exits,
hangs or crashes while its cells run), every test fails with that reason.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import pytest

from autograder.labs import LabSpec
from autograder.notebook import Submission
from autograder.remote import Remote, RemoteError, SandboxFailure
from autograder.sandbox import Limits, Sandbox

VISIBILITIES = ("visible", "hidden", "after_due_date", "after_published")
MAX_OUTPUT_CHARS = 3000


class GradingProblem(Exception):
    """A reason a test cannot pass that is about the submission, not an assertion (message for the learner)."""


@dataclass
class TestRecord:
    id: str
    name: str
    max_score: float
    visibility: str
    status: str = "failed"
    output: str = "did not run"


class Session:
    """One submission's sandbox across the tests of a pytest session."""

    def __init__(
        self,
        submission: Submission | None,
        spec: LabSpec,
        limits: Limits,
        rejected: str | None,
        max_restarts: int,
    ):
        self.submission = submission
        self.spec = spec
        self.limits = limits
        self.rejected = rejected
        self.max_restarts = max_restarts
        self.sandbox: Sandbox | None = None
        self.fatal: str | None = None
        self.restarts = 0
        self.last_failure = ""
        self.call_timeout = limits.call_timeout_s
        self.deadline = time.monotonic() + limits.notebook_s

    def ready(self) -> Sandbox:
        """The running sandbox, started or restarted as the policy in the module docstring says."""
        if self.rejected:
            raise GradingProblem(self.rejected)
        if self.fatal:
            raise GradingProblem(self.fatal)
        if time.monotonic() > self.deadline:
            raise GradingProblem(
                f"not run: grading this notebook took longer than {self.limits.notebook_s:g} s in all; "
                "make the slow parts faster"
            )
        if self.sandbox is not None and self.sandbox.alive:
            self.sandbox.call_timeout = self.call_timeout
            return self.sandbox
        if self.sandbox is not None:
            if self.restarts >= self.max_restarts:
                raise GradingProblem(
                    f"not run: the process running your code stopped {self.restarts + 1} times "
                    f"(last: {self.last_failure}); fix that first"
                )
            self.restarts += 1
        assert self.submission is not None
        spec = self.spec
        graded = {cell: list(names) for cell, names in spec.graded_cells.items()}
        limits = replace(self.limits, memory_mb=self.limits.memory_mb or spec.memory_mb)
        sandbox = Sandbox(self.submission.cells, graded, limits, dict(spec.blocked_modules), spec.preload)
        self.sandbox = sandbox
        try:
            sandbox.start()
            sandbox.call_timeout = self.call_timeout
        except (SandboxFailure, RemoteError) as e:
            tail = sandbox.output_tail(600).strip()
            self.fatal = f"your notebook's code could not be loaded: {e}" + (
                f"\nits last output:\n{tail}" if tail else ""
            )
            sandbox.close()
            raise GradingProblem(self.fatal) from None
        return sandbox

    def global_(self, name: str) -> Any:
        sandbox = self.ready()
        report = sandbox.load_report or {}
        spec = self.spec
        cell = spec.cell_of(name)
        if cell is not None:
            origin = report.get("origins", {}).get(name) or {}
            cell_error = next(
                (c.get("error") for c in report.get("cells", []) if c.get("id") == cell and c.get("error")),
                None,
            )
            error_text = ""
            if isinstance(cell_error, dict):
                error_text = f"{cell_error.get('type')}: {cell_error.get('message')}"
            if origin.get("defined") is not True:
                why = f" (running that cell raised {error_text})" if error_text else ""
                raise GradingProblem(
                    f"your notebook does not define `{name}`: it should come from the cell {cell!r}{why}"
                )
            if origin.get("own") is not True:
                raise GradingProblem(
                    f"`{name}` is not your own code (it comes from {origin.get('where')}). The grader grades the "
                    "code you write in the notebook: re-exporting or subclassing nanolab's reference gets no credit"
                )
        return sandbox.get(None, name)

    def note_failure(self, reason: str) -> None:
        self.last_failure = reason

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()


class Learner:
    """The submission's notebook namespace as a hidden test sees it (see the module docstring)."""

    def __init__(self, session: Session):
        object.__setattr__(self, "_session", session)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._session.global_(name)

    def hold(self, value: Any) -> Remote:
        """``value`` (plain data) copied into the learner's process and kept there (see the module docstring)."""
        return self._session.ready().hold(value)

    def peek(self, held: Remote) -> Any:
        """What the object behind ``held`` is now, as plain data."""
        return self._session.ready().value(held)

    @contextmanager
    def time_limit(self, seconds: float) -> Iterator[None]:
        """Give each call inside the block ``seconds`` of wall clock (instead of ``--timeout``)."""
        session = self._session
        old, session.call_timeout = session.call_timeout, seconds
        if session.sandbox is not None:
            session.sandbox.call_timeout = seconds
        try:
            yield
        finally:
            session.call_timeout = old
            if session.sandbox is not None:
                session.sandbox.call_timeout = old


def expect(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    """Fail with a clear message unless ``value`` is plain data of type ``kind``; returns ``value``."""
    if isinstance(value, kind):
        return value
    names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
    got = value.type_name + " object" if isinstance(value, Remote) else type(value).__name__
    raise AssertionError(f"{what} should be a {names}, but it is a {got}")


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
    """Provides the fixtures and collects one `TestRecord` per hidden test."""

    def __init__(self, session: Session, seed: int):
        self.session = session
        self.seed = seed
        self.records: dict[str, TestRecord] = {}
        self.collection_errors: list[str] = []

    # -- fixtures

    @pytest.fixture
    def lab(self) -> Learner:
        return Learner(self.session)

    @pytest.fixture
    def rng(self, request: pytest.FixtureRequest) -> random.Random:
        return random.Random(f"{self.seed}:{request.node.nodeid}")

    # -- hooks

    def pytest_configure(self, config: pytest.Config) -> None:
        config.addinivalue_line("markers", "points(n): points a hidden test is worth (default 1)")
        config.addinivalue_line("markers", "visibility(v): Gradescope visibility of the test's result")

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            points = item.get_closest_marker("points")
            visibility = item.get_closest_marker("visibility")
            doc = (getattr(item, "obj", None).__doc__ or "").strip().splitlines()
            self.records[item.nodeid] = TestRecord(
                id=item.name,
                name=doc[0].strip() if doc else item.name,
                max_score=float(points.args[0]) if points else 1.0,
                visibility=visibility.args[0]
                if visibility and visibility.args[0] in VISIBILITIES
                else "visible",
            )

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collection_errors.append(f"{report.nodeid}: {str(report.longrepr)[-1500:]}")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
        outcome = yield
        report = outcome.get_result()
        record = self.records.get(item.nodeid)
        if record is None:
            return
        if call.when == "setup" or call.when == "call":
            if report.passed and call.when == "call":
                record.status, record.output = "passed", ""
            elif report.failed:
                exc = call.excinfo.value if call.excinfo is not None else None
                record.status = "failed"
                record.output = feedback(exc) if exc is not None else "failed"
                if isinstance(exc, SandboxFailure):
                    self.session.note_failure(str(exc))
            elif report.skipped:
                record.status, record.output = (
                    "failed",
                    f"not run ({report.longrepr[-1] if isinstance(report.longrepr, tuple) else 'skipped'})",
                )
        elif call.when == "teardown" and report.failed:
            record.status = "failed"
            record.output = (record.output + "\n" if record.output else "") + "the test's cleanup failed"

    def pytest_sessionfinish(self) -> None:
        self.session.close()
