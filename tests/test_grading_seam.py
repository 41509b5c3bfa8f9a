"""Where hidden tests meet the grader: a test's time limit holds across a sandbox restart, and the memory
limit comes from one default."""

from __future__ import annotations

import doctest
from pathlib import Path
from types import MappingProxyType

import pytest

import autograder.testing
from autograder.labs import LABS, LabSpec
from autograder.notebook import Submission
from autograder.remote import SandboxFailure
from autograder.sandbox import DEFAULT_MEMORY_MB, Limits
from autograder.session import Session
from autograder.testing import Learner


def test_the_memory_limit_is_the_default_unless_the_lab_or_the_instructor_says_otherwise():
    lab1, lab2 = LABS[1], LABS[2]
    assert lab1.memory_mb == DEFAULT_MEMORY_MB
    assert Session(None, lab1, Limits(), seed=0).limits.memory_mb == DEFAULT_MEMORY_MB
    assert Session(None, lab2, Limits(), seed=0).limits.memory_mb == lab2.memory_mb > DEFAULT_MEMORY_MB
    assert Session(None, lab2, Limits(memory_mb=300), seed=0).limits.memory_mb == 300


def _toy_session(source: str, limits: Limits) -> Session:
    spec = LabSpec(
        number=99,
        name="toy",
        title="Lab 99: Toy",
        notebook="lab99_toy.ipynb",
        setup_cells=(),
        graded_cells=MappingProxyType({"code": ("nap", "die")}),
        blocked_modules=MappingProxyType({}),
    )
    submission = Submission(Path("lab99_toy.ipynb"), spec, [{"id": "code", "source": source}])
    return Session(submission, spec, limits, seed=0, max_restarts=3)


def test_a_time_limit_holds_across_a_restart_and_ends_with_its_block():
    """The session owns the call timeout: a test's ``time_limit`` also covers the sandbox started after
    a crash inside the block, and the default comes back after it."""
    source = (
        "import os, time\n\ndef nap(s):\n    time.sleep(s)\n    return s\n\ndef die():\n    os._exit(5)\n"
    )
    session = _toy_session(source, Limits(call_timeout_s=0.5, load_timeout_s=20))
    lab = Learner(session)
    try:
        with lab.time_limit(5.0):
            with pytest.raises(SandboxFailure, match="exit code 5"):
                lab.die()
            assert lab.nap(1.0) == 1.0  # in a fresh sandbox, still under the block's limit
        assert session.restarts == 1
        with pytest.raises(SandboxFailure, match="time limit"):
            lab.nap(1.0)
    finally:
        session.close()


def test_the_test_author_api_examples_run():
    result = doctest.testmod(autograder.testing)
    assert result.attempted > 0 and result.failed == 0
