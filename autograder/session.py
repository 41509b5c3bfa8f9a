"""One submission's grading session: its sandbox across all of its tests, its seed, its time limits.

The session is what the ``lab`` fixture of `autograder.testing` reaches the submission through.

Sandbox policy: one sandboxed process serves all tests of a submission. If a call times out or the
process dies, that test fails and the next test starts a fresh process; after ``max_restarts`` such
restarts the remaining tests fail at once, and so do the tests that start after the notebook's total
time (``Limits.notebook_s``) is used up. If the notebook's code itself cannot be loaded (it exits,
hangs or crashes while its cells run), every test fails with that reason.

The session owns the time limit of a call into the submission: `Limits.call_timeout_s`, or what a
test set for a block with `time_limit`. Each sandbox it starts asks it before every call, so the
limit holds across a restart inside the block.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest

from autograder.labs import LabSpec
from autograder.notebook import Submission
from autograder.remote import RemoteError, SandboxFailure
from autograder.sandbox import Limits, Sandbox


class GradingProblem(Exception):
    """A reason a test cannot pass that is about the submission, not an assertion (message for the learner)."""


class Session:
    """One submission's sandbox across the tests of a pytest run (see the module docstring)."""

    def __init__(
        self,
        submission: Submission | None,
        spec: LabSpec,
        limits: Limits,
        seed: int,
        rejected: str | None = None,
        max_restarts: int = 2,
    ):
        self.submission = submission  # None when the notebook was rejected
        self.spec = spec
        # The limits every sandbox of this session gets: the lab's memory unless the instructor set one.
        self.limits = replace(limits, memory_mb=limits.memory_mb or spec.memory_mb)
        self.seed = seed  # of the tests' random inputs
        self.rejected = rejected  # why the notebook cannot be graded: every test fails with it
        self.max_restarts = max_restarts
        self.sandbox: Sandbox | None = None
        self.fatal: str | None = None
        self.restarts = 0
        self.last_failure = ""
        self.call_timeout = self.limits.call_timeout_s
        self.deadline = time.monotonic() + self.limits.notebook_s

    @contextmanager
    def time_limit(self, seconds: float) -> Iterator[None]:
        """Give each call into the submission inside the block ``seconds`` of wall clock."""
        old, self.call_timeout = self.call_timeout, seconds
        try:
            yield
        finally:
            self.call_timeout = old

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
        sandbox = Sandbox(
            self.submission.cells,
            graded,
            self.limits,
            dict(spec.blocked_modules),
            spec.preload,
            current_call_timeout=lambda: self.call_timeout,
        )
        self.sandbox = sandbox
        try:
            sandbox.start()
        except (SandboxFailure, RemoteError) as e:
            tail = sandbox.output_tail(600).strip()
            self.fatal = f"your notebook's code could not be loaded: {e}" + (
                f"\nits last output:\n{tail}" if tail else ""
            )
            sandbox.close()
            raise GradingProblem(self.fatal) from None
        return sandbox

    def global_(self, name: str) -> Any:
        """The notebook's global ``name``: data, or a `Remote` handle; `GradingProblem` for a graded name
        the notebook does not define or that is not the learner's own code."""
        sandbox = self.ready()
        report = sandbox.load_report or {}
        cell = self.spec.cell_of(name)
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
        """Remember why the sandbox stopped answering, for the message when restarts run out."""
        self.last_failure = reason

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()


# Where a pytest run keeps its session: the grading plugin stores it, the fixtures read it.
SESSION_KEY = pytest.StashKey[Session]()
