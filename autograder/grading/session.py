"""One submission's grading session: its sandbox across all of its tests, its seed, its time limits.

The session is what the ``lab`` fixture of `autograder.authoring.testing` reaches the submission through.

Sandbox policy: one sandboxed process serves all tests of a submission. If a call times out or the
process dies, that test fails and the next test starts a fresh process (the old one is killed and its
directory removed first); after ``max_restarts`` such restarts the remaining tests fail at once. If the
notebook's code itself cannot be loaded (it exits, hangs or crashes while its cells run), every test
fails with that reason.

The session owns the time limit of a call into the submission: `Limits.call_timeout_s`, or what a
test set for a block with `time_limit`, and never more than what is left of the notebook's total
(``Limits.notebook_s``); once that is used up, every call fails at once. Each sandbox it starts asks
it before every call, so the limits hold across a restart inside a block.

Whether a graded name is the learner's own code is decided here, from the notebook's text
(`autograder.submission.origin`); the sandbox's own report can only take credit away. The first sandbox may be
launched early (`Session.warm_up`), so that it starts while pytest loads the tests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest

from autograder.sandbox.limits import Limits
from autograder.sandbox.process import Sandbox
from autograder.sandbox.remote import RemoteError, SandboxFailure
from autograder.submission import origin
from autograder.submission.labs import LabSpec
from autograder.submission.notebook import Submission


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
        cells_of = {name: cell for cell, names in spec.graded_cells.items() for name in names}
        self.origins = origin.check(submission.cells, cells_of) if submission is not None else {}

    @contextmanager
    def time_limit(self, seconds: float) -> Iterator[None]:
        """Give each call into the submission inside the block ``seconds`` of wall clock."""
        old, self.call_timeout = self.call_timeout, seconds
        try:
            yield
        finally:
            self.call_timeout = old

    def remaining(self) -> float:
        """Seconds left of the notebook's total; `GradingProblem` once there are none."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise GradingProblem(
                f"not run: grading this notebook took longer than {self.limits.notebook_s:g} s in all; "
                "make the slow parts faster"
            )
        return left

    def next_call_timeout(self) -> float:
        """The time limit of the next call into the submission (see the module docstring)."""
        return min(self.call_timeout, self.remaining())

    def warm_up(self) -> None:
        """Launch the sandbox now, so that it loads its interpreter and preloads while pytest loads the
        hidden tests; the first `ready` runs the notebook's cells in it."""
        if self.submission is not None and not self.rejected and self.sandbox is None:
            sandbox = self._new_sandbox(self.remaining())
            try:
                sandbox.launch()
            except OSError:
                return  # `ready` starts one, and says why if it cannot
            self.sandbox = sandbox

    def ready(self) -> Sandbox:
        """The running sandbox, started or restarted as the policy in the module docstring says."""
        if self.rejected:
            raise GradingProblem(self.rejected)
        if self.fatal:
            raise GradingProblem(self.fatal)
        left = self.remaining()
        if self.sandbox is not None and self.sandbox.launched:
            return self._load(self.sandbox)  # launched by `warm_up`
        if self.sandbox is not None and self.sandbox.alive:
            return self.sandbox
        if self.sandbox is not None:
            self.sandbox.close()  # kill what is left of it and remove its directory
            if self.restarts >= self.max_restarts:
                raise GradingProblem(
                    f"not run: the process running your code stopped {self.restarts + 1} times "
                    f"(last: {self.last_failure}); fix that first"
                )
            self.restarts += 1
        sandbox = self.sandbox = self._new_sandbox(left)
        sandbox.launch()
        return self._load(sandbox)

    def _new_sandbox(self, left: float) -> Sandbox:
        assert self.submission is not None
        spec = self.spec
        graded = {cell: list(names) for cell, names in spec.graded_cells.items()}
        return Sandbox(
            self.submission.cells,
            graded,
            replace(self.limits, load_timeout_s=min(self.limits.load_timeout_s, left)),
            dict(spec.blocked_modules),
            spec.preload,
            spec.packages,
            current_call_timeout=self.next_call_timeout,
        )

    def _load(self, sandbox: Sandbox) -> Sandbox:
        """Run the notebook's cells in a launched sandbox; a notebook that cannot load fails every test."""
        try:
            sandbox.load()
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
        cell = self.spec.cell_of(name)
        if cell is not None and self.origins.get(name) is not None:  # decided here, from the notebook
            raise GradingProblem(
                f"`{name}` is not your own code: {self.origins[name]}. The grader grades the code you "
                "write in the notebook's graded cells: importing or re-exporting code from elsewhere gets "
                "no credit"
            )
        sandbox = self.ready()
        report = sandbox.load_report or {}
        if cell is not None:
            reported = report.get("origins", {}).get(name) or {}
            cell_error = next(
                (c.get("error") for c in report.get("cells", []) if c.get("id") == cell and c.get("error")),
                None,
            )
            error_text = ""
            if isinstance(cell_error, dict):
                error_text = f"{cell_error.get('type')}: {cell_error.get('message')}"
            if reported.get("defined") is not True:
                why = f" (running that cell raised {error_text})" if error_text else ""
                raise GradingProblem(
                    f"your notebook does not define `{name}`: it should come from the cell {cell!r}{why}"
                )
            if reported.get("own") is not True:  # the sandbox's report: it can only take credit away
                raise GradingProblem(
                    f"`{name}` is not your own code (it comes from {reported.get('where')}). The grader grades the "
                    "code you write in the notebook: re-exporting or subclassing nanolab's reference gets no credit"
                )
        return sandbox.get(None, name)

    def cpu_seconds(self) -> float:
        """CPU seconds the submission's processes have used so far (see `Sandbox.cpu_seconds`). It never
        restarts a sandbox that stopped (`SandboxFailure`), so two readings come from one process tree."""
        sandbox = self.sandbox if self.sandbox is not None else self.ready()
        return sandbox.cpu_seconds()

    def note_failure(self, reason: str) -> None:
        """Remember why the sandbox stopped answering, for the message when restarts run out."""
        self.last_failure = reason

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()


# Where a pytest run keeps its session: the grading plugin stores it, the fixtures read it.
SESSION_KEY = pytest.StashKey[Session]()
