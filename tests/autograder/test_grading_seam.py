"""Where hidden tests meet the grader: an instructor's extra tests count in addition to the built-in
ones, a test's time limit holds across a sandbox restart, and the memory limit comes from one default."""

from __future__ import annotations

import argparse
import doctest
import json
import shutil
from pathlib import Path
from types import MappingProxyType

import pytest

import autograder.authoring.testing
from autograder.authoring.testing import Learner
from autograder.grading.cli import add_arguments, grade_options
from autograder.grading.grade import DEFAULT_TESTS_DIR, GradeOptions, grade
from autograder.grading.session import Session
from autograder.sandbox.limits import DEFAULT_MEMORY_MB, Limits
from autograder.sandbox.remote import SandboxFailure
from autograder.submission.labs import LABS, LabSpec
from autograder.submission.notebook import Submission

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ROOT / "solutions" / "lab01_tokenizer.ipynb"
LIMITS = Limits(call_timeout_s=10, load_timeout_s=20, cpu_s=120, notebook_s=120)

# Named like the built-in module, with a test named like a built-in one: both must still count.
EXTRA_TESTS = '''
import pytest

from autograder.authoring.testing import expect


@pytest.mark.points(2)
def test_merge_of_nothing_is_nothing(lab):
    """merge of an empty list is an empty list"""
    assert expect(lab.merge([], (1, 2), 256), list, "merge([], (1, 2), 256)") == []


@pytest.mark.points(3)
def test_a_check_the_solution_fails(lab):
    """an extra check the solution fails"""
    assert lab.merge([1, 2], (1, 2), 256) == [1, 2], "the instructor's extra check failed"


def test_merge_replaces_every_occurrence_left_to_right(lab):
    """an extra test named like a built-in one"""
    assert lab.merge([1, 2], (1, 2), 256) == [], "the instructor's same-named check failed"
'''


def test_extra_tests_are_graded_in_addition_to_the_built_in_ones(tmp_path):
    """``--tests DIR`` adds the instructor's tests: every built-in test is still graded, each extra test
    is reported under its own id (``extra/...``) and the score counts both."""
    builtin = tmp_path / "hidden"
    shutil.copytree(DEFAULT_TESTS_DIR, builtin, ignore=shutil.ignore_patterns("__pycache__"))
    extra = tmp_path / "private-tests"
    extra.mkdir()
    (extra / "test_lab01.py").write_text(EXTRA_TESTS)

    def grade_solution(extra_tests_dir: Path | None):
        options = GradeOptions(tests_dir=builtin, extra_tests_dir=extra_tests_dir, limits=LIMITS)
        [result] = grade([SOLUTION], options, progress=False)
        assert result.internal_error is None, result.internal_error
        return result

    alone, both = grade_solution(None), grade_solution(extra)
    assert alone.score == alone.max_score > 0
    builtin_ids = [t.id for t in both.tests if not t.id.startswith("extra/")]
    assert builtin_ids == [t.id for t in alone.tests]
    assert sorted(t.id for t in both.tests if t.id.startswith("extra/")) == [
        "extra/test_a_check_the_solution_fails",
        "extra/test_merge_of_nothing_is_nothing",
        "extra/test_merge_replaces_every_occurrence_left_to_right",
    ]
    assert len({t.id for t in both.tests}) == len(both.tests), "test ids (CSV columns) must be unique"
    assert both.max_score == alone.max_score + 2 + 3 + 1
    assert both.score == alone.score + 2
    failed = {t.id: t.output for t in both.tests if t.status != "passed"}
    assert failed == {
        "extra/test_a_check_the_solution_fails": "the instructor's extra check failed",
        "extra/test_merge_replaces_every_occurrence_left_to_right": "the instructor's same-named check failed",
    }


def test_cli_tests_option_adds_a_folder_and_says_so(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    options = grade_options(parser.parse_args(["x.ipynb", "--tests", str(tmp_path)]))
    assert options.tests_dir == DEFAULT_TESTS_DIR and options.extra_tests_dir == tmp_path
    assert grade_options(parser.parse_args(["x.ipynb"])).extra_tests_dir is None
    help_text = " ".join(parser.format_help().split())
    assert "in addition to the built-in hidden tests" in help_text


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
    result = doctest.testmod(autograder.authoring.testing)
    assert result.attempted > 0 and result.failed == 0


def test_results_keep_extra_ids_through_json(tmp_path):
    """The JSON export names each test by its id, prefix included (the key a gradebook joins on)."""
    from autograder.grading.results import SubmissionResult, TestResult, write_json

    result = SubmissionResult("a.ipynb", 1, tests=[TestResult("extra/test_x", "x", 2.0, status="passed")])
    write_json([result], tmp_path / "r.json")
    [row] = json.loads((tmp_path / "r.json").read_text())
    assert [(t["id"], t["score"]) for t in row["tests"]] == [("extra/test_x", 2.0)]
