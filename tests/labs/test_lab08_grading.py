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

# Admission.admit: its check and count under the lock; and the same with the lock dropped, nothing else changed (the
# race test's limit gives up the GIL when compared, so a check and a count with no call between them race too).
LOCKED_ADMIT = """        with self._lock:
            if self.max_waiting is not None and (waiting := self.waiting) >= self.max_waiting:
                raise ServerOverloaded(
                    f"{waiting} requests are waiting, the limit is {self.max_waiting}: try again in {self.retry_after} s",
                    self.retry_after,
                )
            self._sent += num_prompts"""
UNLOCKED_ADMIT = """        if self.max_waiting is not None and (waiting := self.waiting) >= self.max_waiting:
            raise ServerOverloaded(
                f"{waiting} requests are waiting, the limit is {self.max_waiting}: try again in {self.retry_after} s",
                self.retry_after,
            )
        self._sent += num_prompts"""

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
    "chat_max_tokens_wins": (
        "validate-chat",
        'if newer is not None:\n        fields["max_tokens"] = newer',
        'if newer is not None and fields.get("max_tokens") is None:\n        fields["max_tokens"] = newer',
        "test_chat_parse_builds_the_same_request_as_nanolab",
    ),
    "chat_parts_not_checked": (
        "validate-chat",
        'p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):',
        "True for p in content):",
        "test_chat_parse_refuses_a_bad_field_naming_it",
    ),
    "chat_finish_on_every_output": (
        "sse-chat",
        "if c.finish_reason is not None and c.index not in finish_sent:",
        "if c.finish_reason is not None:",
        "test_chat_events_match_nanolab_stream",
    ),
    "admission_handled_not_subtracted": (
        "admission",
        "return engine_waiting + self._sent - handled",
        "return engine_waiting + self._sent",
        "test_admission_counts_like_nanolab",
    ),
    "admission_without_a_lock": (
        "admission",
        LOCKED_ADMIT,
        UNLOCKED_ADMIT,
        "test_admission_lets_exactly_max_waiting_through_racing_threads",
    ),
    "itl_split_across_samples": (
        "metrics",
        "m.itl.observe((now - last_token_time) / k)",
        "m.itl.observe((now - last_token_time) / new)",
        "test_observe_output_matches_nanolab",
    ),
    "kv_usage_is_free_fraction": (
        "metrics",
        "m.kv_usage.set(1 - stats.kv_blocks_free / stats.kv_blocks_total)",
        "m.kv_usage.set(stats.kv_blocks_free / stats.kv_blocks_total)",
        "test_observe_stats_sets_the_gauges",
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
    "validate-chat": ["return _Yes()"],
    "sse-chat": ["return _Yes(['data: [DONE]\\n\\n'])"],
    "admission": ["pass", "return _Yes()", "pass", "pass"],
    "metrics": ["pass", "pass"],
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
    assert "max_completion_tokens when given (it wins over max_tokens)" in outputs["chat_max_tokens_wins"]
    assert "refuse bad input with InvalidRequest" in outputs["chat_parts_not_checked"]
    assert "finish reason goes out once, on a chunk of its own" in outputs["chat_finish_on_every_output"]
    assert "waiting = engine_waiting + sent - handled" in outputs["admission_handled_not_subtracted"]
    assert (
        "one step under a lock, or two threads both take the last place"
        in outputs["admission_without_a_lock"]
    )
    assert "k observations of (now - last_token_time) / k" in outputs["itl_split_across_samples"]
    assert "the fraction of the pool's blocks that are not free" in outputs["kv_usage_is_free_fraction"]


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


FRONT_DOOR = {  # the hidden tests of the chat parser, the chat stream, the admission and the metrics: points
    "test_chat_parse_builds_the_same_request_as_nanolab": 1,
    "test_chat_parse_refuses_a_bad_field_naming_it": 1,
    "test_chat_events_match_nanolab_stream": 1,
    "test_admission_counts_like_nanolab": 1,
    "test_admission_lets_exactly_max_waiting_through_racing_threads": 1,
    "test_observe_output_matches_nanolab": 1,
    "test_observe_stats_sets_the_gauges": 1,
}


def test_the_front_door_is_worth_seven_points(batch):
    """The solution earns the seven points of the chat, admission and metrics tests on top of the others'."""
    earned = {t.id: t.score for t in batch["solution"].tests}
    assert {name: earned.get(name) for name in FRONT_DOOR} == FRONT_DOOR
    assert batch["solution"].max_score == sum(earned.values())


def test_a_racy_admission_loses_the_race_test_only(batch):
    """Partial credit for a check and a count outside a lock: the race test fails, the admission's trace and
    every other exercise keep their points."""
    race = "test_admission_lets_exactly_max_waiting_through_racing_threads"
    status = {t.id: t.status for t in batch["bug_admission_without_a_lock"].tests}
    assert status[race] == "failed"
    others = [name for name in FRONT_DOOR if name != race]
    for test_id in (
        *others,
        "test_parse_builds_the_same_request_as_nanolab",
        "test_events_match_nanolab_stream",
    ):
        assert status[test_id] == "passed", test_id


def test_containers_that_lie_about_equality_earn_nothing(batch):
    """Only plain data crosses back, so a list whose == always says yes arrives as a plain list (or a handle,
    which is not data) and is compared by value in the grader."""
    check_tamper_earns_nothing(batch, "containers_that_claim_equality")
