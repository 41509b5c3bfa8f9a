"""Grading Lab 4: the solution scores full marks, the blank lab zero, every planted bug loses the points of
the hidden test aimed at it (and keeps others), and tampered submissions earn nothing.

The fixture notebooks are made from solutions/ and labs/ by text substitution, as in test_grading.py
(which covers the generic tampering cases), and graded in one batch (``jobs=2``) against a copy of the
hidden tests. What is Lab 4's own: requests are the notebook's objects, driven through handles; schedulers
are compared through the notebook's ``replay_schedule``, the lab's setup code: the grader runs the lab's
own, so a setup cell whose replay plays a correct scheduler of its own (and ignores the learner's) earns
nothing, nor does a graded cell that binds ``replay_schedule`` again; and the engine runs in the grader on
the learner's recorded decisions.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers.grading_utils import (
    LYING_LIST,
    Batch,
    cell,
    check_planted_bug_is_caught,
    check_solution_scores_full_marks,
    check_tamper_earns_nothing,
    lying,
    scheduler_tampers,
    # the scheduler labs' tamper tests, written once for Labs 4 and 5; pytest collects them here
    test_a_graded_cell_that_binds_the_replay_again_earns_nothing,  # noqa: F401
    test_a_replay_rewritten_in_place_earns_nothing,  # noqa: F401
    test_a_replay_that_ignores_the_scheduler_earns_nothing,  # noqa: F401
)

from autograder.sandbox.limits import Limits

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ROOT / "solutions" / "lab04_schedulers.ipynb"
LAB = ROOT / "labs" / "lab04_schedulers.ipynb"
LIMITS = Limits(call_timeout_s=20, load_timeout_s=30, cpu_s=300, notebook_s=240)

PLANTED_BUGS = {
    # name: (cell, old, new, the hidden test that must catch it)
    "finish_stop_from_a_waiting_request": (
        "transitions",
        "allowed = live if reason == FinishReason.ABORT else (RequestStatus.RUNNING,)",
        "allowed = live",
        "test_every_state_and_move_is_legal_or_refused_changing_nothing",
    ),
    "preempt_not_counted": (
        "transitions",
        "    req.num_preemptions += 1\n",
        "",
        "test_preempt_resets_the_computed_tokens_counts_and_keeps_the_output",
    ),
    "static_returns_each_request_at_its_own_end": (
        "batching",
        "                    finish[i] = end\n",
        "                    finish[i] = min(finish[i], end)\n",
        "test_simulate_batching_matches_the_reference_on_random_traces",
    ),
    "continuous_refills_only_when_empty": (
        "batching",
        'if mode == "continuous" or not batch:',
        "if not batch:",
        "test_simulate_batching_matches_the_reference_on_random_traces",
    ),
    "aging_with_true_division": (
        "policies",
        "(now - r.arrival_step) // aging_steps",
        "(now - r.arrival_step) / aging_steps",
        "test_aging_moves_a_request_up_a_level_exactly_at_each_multiple_of_aging_steps",
    ),
    "shortest_by_prompt_length": (
        "policies",
        "key=lambda r: (r.remaining_prefill(), r.arrival_time)",
        "key=lambda r: (r.num_prompt_tokens, r.arrival_time)",
        "test_waiting_order_matches_the_reference_on_random_queues",
    ),
    "victim_may_be_in_the_batch": (
        "victim",
        "candidates = [r for r in running if r is not needy and not any(r is s for s in scheduled)]",
        "candidates = [r for r in running if r is not needy]",
        "test_choose_victim_matches_the_reference_on_random_running_sets",
    ),
    "admission_skips_a_blocked_head": (
        "scheduler",
        "        while self.waiting and len(self.running) < cfg.max_num_seqs:\n"
        "            req = self.waiting[0]\n"
        "            if req.remaining_prefill() > budget:\n"
        "                break\n"
        "            num_new = self.block_manager.admit(req, None)\n"
        "            if num_new is None:\n"
        "                break\n"
        "            self.waiting.pop(0)\n",
        "        for req in list(self.waiting):\n"
        "            if len(self.running) >= cfg.max_num_seqs:\n"
        "                break\n"
        "            if req.remaining_prefill() > budget:\n"
        "                continue\n"
        "            num_new = self.block_manager.admit(req, None)\n"
        "            if num_new is None:\n"
        "                continue\n"
        "            self.waiting.remove(req)\n",
        "test_scheduler_matches_the_reference_event_by_event_on_random_workloads",
    ),
    "abort_keeps_the_blocks": (
        "scheduler",
        "            self.running.remove(req)\n            self.block_manager.release(req)\n        elif",
        "            self.running.remove(req)\n        elif",
        "test_scheduler_keeps_its_invariants_on_random_workloads",
    ),
    "add_counts_the_prompt_only": (
        "scheduler",
        "if req.num_tokens > limit:",
        "if req.num_prompt_tokens > limit:",
        "test_add_refuses_requests_that_can_never_run",
    ),
    "admitted_seq_kept_on_readmission": (
        "scheduler",
        "req.admitted_seq = self.num_admissions",
        "req.admitted_seq = req.admitted_seq or self.num_admissions",
        "test_scheduler_matches_the_reference_event_by_event_on_random_workloads",
    ),
}

# Containers and strings whose comparisons always say "equal", made in the learner's process: they cross
# to the grader as plain lists and strings (or as handles), so the grader compares the data they hold.
LIAR = (
    LYING_LIST
    + """

class _YesStr(str):
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = str.__hash__
"""
)

GARBAGE = {  # cell -> replacement for each stub, in order (wrong values of the right types)
    "transitions": [
        "req.status = _YesStr('running')",
        "req.status, req.num_computed_tokens = _YesStr('preempted'), _Yes()",
        "req.status, req.finish_reason = _YesStr('finished'), _YesStr(reason)",
    ],
    "batching": ["return BatchingResult(_Yes(), _Yes(), _Yes())"],
    "policies": ["return _Yes(waiting)"],
    "victim": ["return needy"],
    "scheduler": [
        "self.waiting.append(req)",
        "return SchedulerOutput(_Yes(), _Yes())",
        "self.running = _Yes()",
        "self.waiting = _Yes()",
    ],
}


def _lying(nb: dict) -> None:
    lying(nb, GARBAGE, ("transitions", "def admit"), LIAR)


def _solution_code(*grade_ids: str) -> str:
    solution = json.loads(SOLUTION.read_text())
    return "\n\n".join("".join(cell(solution, g)["source"]) for g in grade_ids)


TAMPERED = {
    "containers_that_claim_equality": _lying,
    **scheduler_tampers(_solution_code("transitions", "policies", "victim", "scheduler")),
}


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    fixtures = Batch(tmp_path_factory.mktemp("grading_lab04"))
    fixtures.add_standard(SOLUTION, LAB, PLANTED_BUGS, TAMPERED)
    return fixtures.grade(LIMITS)


def test_solution_scores_full_marks(batch):
    check_solution_scores_full_marks(batch, lab=4)


def test_blank_lab_scores_zero(batch):
    result = batch["blank"]
    assert result.max_score == batch["solution"].max_score
    assert result.score == 0
    assert all(t.status == "failed" and t.output for t in result.tests), {
        t.id: t.output for t in result.tests
    }


@pytest.mark.parametrize("name", sorted(PLANTED_BUGS))
def test_planted_bug_loses_points_in_the_test_that_targets_it(batch, name):
    check_planted_bug_is_caught(batch, PLANTED_BUGS, name)


def test_feedback_names_the_mistake_without_the_answer(batch):
    """Each failing test says which rule the learner's code broke, on which input, in the terms of the lab."""
    outputs = {name: " ".join(t.output for t in batch[f"bug_{name}"].tests) for name in PLANTED_BUGS}
    assert "is not a move of the state machine" in outputs["finish_stop_from_a_waiting_request"]
    assert "num_preemptions should go up by exactly one" in outputs["preempt_not_counted"]
    assert "returned at the batch's last step" in outputs["static_returns_each_request_at_its_own_end"]
    assert "taken at the very next step" in outputs["continuous_refills_only_when_empty"]
    assert "whole multiple of aging_steps" in outputs["aging_with_true_division"]
    assert "remaining_prefill(), not the prompt's length" in outputs["shortest_by_prompt_length"]
    assert "already in this step's batch keeps its blocks" in outputs["victim_may_be_in_the_batch"]
    assert (
        "admission stops at the first request that does not fit" in outputs["admission_skips_a_blocked_head"]
    )
    # the random workloads' invariant check, or (when a workload's steps went wrong first) the direct abort check
    assert re.search(r"gives? (a|the) request's blocks back", outputs["abort_keeps_the_blocks"])
    assert "can never run: refuse it at once with ValueError" in outputs["add_counts_the_prompt_only"]
    assert "admitted_seq" in outputs["admitted_seq_kept_on_readmission"]


def test_a_bug_in_one_part_keeps_the_points_of_the_parts_that_do_not_use_it(batch):
    """Partial credit: a wrong simulator, or a wrong state machine, costs nothing in the other parts; a
    scheduler that jumps the queue keeps the points of the state machine, the simulator and the policies."""
    for name in ("static_returns_each_request_at_its_own_end", "continuous_refills_only_when_empty"):
        failed = {t.id for t in batch[f"bug_{name}"].tests if t.status != "passed"}
        assert failed and all("simulate_batching" in test_id for test_id in failed), failed
    failed = {t.id for t in batch["bug_finish_stop_from_a_waiting_request"].tests if t.status != "passed"}
    assert failed == {"test_every_state_and_move_is_legal_or_refused_changing_nothing"}, failed
    status = {t.id: t.status for t in batch["bug_admission_skips_a_blocked_head"].tests}
    for kept in (
        "test_every_state_and_move_is_legal_or_refused_changing_nothing",
        "test_simulate_batching_matches_the_reference_on_random_traces",
        "test_waiting_order_matches_the_reference_on_random_queues",
        "test_choose_victim_matches_the_reference_on_random_running_sets",
    ):
        assert status[kept] == "passed", kept


def test_containers_that_lie_about_equality_earn_nothing(batch):
    """Only plain data crosses back, so a list or string subclass whose == always says yes arrives as a
    plain list or string (or a handle, which is not data) and is compared by value in the grader."""
    check_tamper_earns_nothing(batch, "containers_that_claim_equality")
