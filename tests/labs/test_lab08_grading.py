"""Grading Lab 8: the solution scores full marks, the blank lab zero, every planted bug loses the points of the
hidden test aimed at it (and keeps the others), and tampered submissions earn nothing.

The fixture notebooks are made from solutions/ and labs/ by text substitution and graded in one batch
(``jobs=2``) against a copy of the hidden tests. Everything of the learner's is driven from the grader through
handles (there is no notebook driver to rewrite), so a tampered submission can only return wrong values.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.grading_utils import (
    Batch,
    check_blank_lab_scores_zero,
    check_planted_bug_is_caught,
    check_solution_scores_full_marks,
    check_tamper_earns_nothing,
    lying,
)

from autograder.sandbox.limits import Limits

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ROOT / "solutions" / "lab08_serving.ipynb"
LAB = ROOT / "labs" / "lab08_serving.ipynb"
LIMITS = Limits(call_timeout_s=30, load_timeout_s=30, cpu_s=300, notebook_s=300)

PLANTED_BUGS = {
    # name: (cell, old, new, the hidden test that must catch it)
    "bool_is_an_int": (
        "validate",
        "return isinstance(x, int) and not isinstance(x, bool)",
        "return isinstance(x, int)",
        "test_parse_refuses_a_bad_field_naming_it",
    ),
    "ignored_unsorted": (
        "validate",
        "ignored = tuple(sorted(set(body) - KNOWN_FIELDS))",
        "ignored = tuple(k for k in body if k not in KNOWN_FIELDS)",
        "test_parse_builds_the_same_request_as_nanolab",
    ),
    "finish_reason_every_output": (
        "sse",
        "if c.finish_reason is not None and index not in finish_sent:",
        "if c.finish_reason is not None:",
        "test_events_match_nanolab_stream",
    ),
    "route_passes_everything": (
        "engine-loop",
        "if out is None or out.request_id not in self.live:",
        "if out is None:",
        "test_loop_matches_nanolab_round_by_round",
    ),
    "expire_strictly_before": (
        "engine-loop",
        "if deadline <= now]",
        "if deadline < now]",
        "test_expire_ends_requests_whose_deadline_has_come",
    ),
    "inf_bucket_is_inf": (
        "quantile",
        "if bound == math.inf:\n                return lower",
        "if bound == math.inf:\n                return bound",
        "test_quantile_matches_nanolab",
    ),
}

GARBAGE = {  # cell -> replacement for each stub, in order (wrong values of the right shapes)
    "validate": ["return _Yes()"],
    "sse": ["return _Yes(['data: [DONE]\\n\\n'])"],
    "engine-loop": [
        "self.round.refused.append(_Yes())",
        "pass",
        "pass",
        "pass",
        "pass",
        "return Round(_Yes(), _Yes(), _Yes(), _Yes())",
        "pass",
    ],
    "quantile": ["return float('nan')"],
}

TAMPERED = {
    "containers_that_claim_equality": lambda nb: lying(
        nb, GARBAGE, ("validate", "def parse_completion_request")
    ),
}


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    fixtures = Batch(tmp_path_factory.mktemp("grading_lab08"))
    fixtures.add_standard(SOLUTION, LAB, PLANTED_BUGS, TAMPERED)
    return fixtures.grade(LIMITS)


def test_solution_scores_full_marks(batch):
    check_solution_scores_full_marks(batch, lab=8)


def test_blank_lab_scores_zero(batch):
    check_blank_lab_scores_zero(batch)


@pytest.mark.parametrize("name", sorted(PLANTED_BUGS))
def test_planted_bug_loses_points_in_the_test_that_targets_it(batch, name):
    check_planted_bug_is_caught(batch, PLANTED_BUGS, name)


def test_feedback_names_the_mistake_without_the_answer(batch):
    """Each failing test says which rule the learner's code broke, on which input, in the terms of the lab."""
    outputs = {name: " ".join(t.output for t in batch[f"bug_{name}"].tests) for name in PLANTED_BUGS}
    assert "should be refused with InvalidRequest, but yours accepted it" in outputs["bool_is_an_int"]
    assert "outside KNOWN_FIELDS, sorted" in outputs["ignored_unsorted"]
    assert any(
        hint in outputs["finish_reason_every_output"]
        for hint in (
            "the finish reason (sent once)",
            "a sample that has new text or finishes now",
            "the finish reason sent once",
        )
    ), outputs["finish_reason_every_output"]
    assert "live requests only" in outputs["route_passes_everything"]
    assert "whose deadline is now or earlier" in outputs["expire_strictly_before"]
    assert "the +Inf bucket gets the largest finite bound" in outputs["inf_bucket_is_inf"]


def test_a_bug_in_one_exercise_keeps_the_points_of_the_others(batch):
    """Partial credit: a wrong stream costs the stream's test only; validation, the loop and the quantiles keep
    their points."""
    status = {t.id: t.status for t in batch["bug_finish_reason_every_output"].tests}
    assert status["test_events_match_nanolab_stream"] == "failed"
    for test_id in (
        "test_parse_builds_the_same_request_as_nanolab",
        "test_parse_refuses_a_bad_field_naming_it",
        "test_loop_matches_nanolab_round_by_round",
        "test_quantile_matches_nanolab",
    ):
        assert status[test_id] == "passed", test_id


def test_containers_that_lie_about_equality_earn_nothing(batch):
    """Only plain data crosses back, so a list whose == always says yes arrives as a plain list (or a handle,
    which is not data) and is compared by value in the grader."""
    check_tamper_earns_nothing(batch, "containers_that_claim_equality")
