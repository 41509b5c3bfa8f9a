"""Grading Lab 5: the solution scores full marks, the blank lab zero, every planted bug loses the points of
the hidden test aimed at it (and keeps the others), and tampered submissions earn nothing.

The fixture notebooks are made from solutions/ and labs/ by text substitution, as in test_grading.py, and
graded in one batch (``jobs=2``) against a copy of the hidden tests. As in Lab 4, schedulers are compared
through the notebook's ``replay_schedule``, the lab's setup code: the grader runs the lab's own, so a setup
cell whose replay plays a correct scheduler of its own earns nothing, nor does a graded cell that binds
``replay_schedule`` again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.grading_utils import (
    Batch,
    cell,
    check_blank_lab_scores_zero,
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
SOLUTION = ROOT / "solutions" / "lab05_chunked_prefill.ipynb"
LAB = ROOT / "labs" / "lab05_chunked_prefill.ipynb"
LIMITS = Limits(call_timeout_s=20, load_timeout_s=30, cpu_s=300, notebook_s=240)

PLANTED_BUGS = {
    # name: (cell, old, new, the hidden test that must catch it)
    "mask_queries_at_zero": (
        "chunk-mask",
        "query_pos = torch.arange(start, start + num_new)[:, None]",
        "query_pos = torch.arange(num_new)[:, None]",
        "test_chunk_mask_matches_the_reference",
    ),
    "plan_decodes_not_counted": (
        "plan-prefill",
        "row, room, last = [0] * len(left), budget - num_decodes, None",
        "row, room, last = [0] * len(left), budget, None",
        "test_plan_prefill_matches_the_reference_on_random_inputs",
    ),
    "plan_round_robin_restarts_at_zero": (
        "plan-prefill",
        '        if order == "round_robin":\n            first = (last + 1) % len(left)\n',
        "",
        "test_plan_prefill_matches_the_reference_on_random_inputs",
    ),
    "prompt_in_progress_skipped_when_it_does_not_fit": (
        "scheduler",
        "            num_new = min(req.remaining_prefill(), budget)\n            if self._make_room(req, num_new, out):",
        "            num_new = req.remaining_prefill()\n            if num_new > budget:\n                continue\n"
        "            if self._make_room(req, num_new, out):",
        "test_a_long_prompt_is_chunked_beside_decodes",
    ),
    "new_prompt_admitted_whole_or_not_at_all": (
        "scheduler",
        "num_new = self.block_manager.admit(req, budget if cfg.enable_chunked_prefill else None)",
        "num_new = self.block_manager.admit(req, None) if req.remaining_prefill() <= budget else None",
        "test_a_long_prompt_is_chunked_beside_decodes",
    ),
    "prefills_before_decodes": (
        "scheduler",
        "for req in decodes + prefills:",
        "for req in prefills + decodes:",
        "test_a_long_prompt_is_chunked_beside_decodes",
    ),
    "add_refuses_over_the_budget_when_chunked": (
        "scheduler",
        "if not cfg.enable_chunked_prefill and tokens > cfg.max_num_batched_tokens:",
        "if tokens > cfg.max_num_batched_tokens:",
        "test_add_refuses_only_what_can_never_run",
    ),
}

GARBAGE = {  # cell -> replacement for each stub, in order (wrong values of the right shapes)
    "chunk-mask": ["return _Yes()"],
    "plan-prefill": ["return _Yes()"],
    "scheduler": ["self.waiting.append(req)", "return SchedulerOutput(_Yes(), _Yes())"],
}


def _lying(nb: dict) -> None:
    lying(nb, GARBAGE, ("chunk-mask", "def chunk_mask"))


TAMPERED = {
    "containers_that_claim_equality": _lying,
    **scheduler_tampers("".join(cell(json.loads(SOLUTION.read_text()), "scheduler")["source"])),
}


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    fixtures = Batch(tmp_path_factory.mktemp("grading_lab05"))
    fixtures.add_standard(SOLUTION, LAB, PLANTED_BUGS, TAMPERED)
    return fixtures.grade(LIMITS)


def test_solution_scores_full_marks(batch):
    check_solution_scores_full_marks(batch, lab=5)


def test_blank_lab_scores_zero(batch):
    check_blank_lab_scores_zero(batch)


@pytest.mark.parametrize("name", sorted(PLANTED_BUGS))
def test_planted_bug_loses_points_in_the_test_that_targets_it(batch, name):
    check_planted_bug_is_caught(batch, PLANTED_BUGS, name)


def test_feedback_names_the_mistake_without_the_answer(batch):
    """Each failing test says which rule the learner's code broke, on which input, in the terms of the lab
    (on every seed: each message comes from an input built to show that mistake)."""
    outputs = {name: " ".join(t.output for t in batch[f"bug_{name}"].tests) for name in PLANTED_BUGS}
    assert "does not see the whole cached prefix" in outputs["mask_queries_at_zero"]
    assert (
        "more prompt tokens than the budget leaves after the decodes" in outputs["plan_decodes_not_counted"]
    )
    assert "differs from nanolab's plan: step" in outputs["plan_round_robin_restarts_at_zero"]
    assert (
        "never skipped because it does not fit whole"
        in outputs["prompt_in_progress_skipped_when_it_does_not_fit"]
    )
    assert (
        "admitted with a first chunk of what the budget leaves"
        in outputs["new_prompt_admitted_whole_or_not_at_all"]
    )
    assert "leaves after the decodes" in outputs["prefills_before_decodes"]
    assert "which can run" in outputs["add_refuses_over_the_budget_when_chunked"]


def test_a_bug_in_one_part_keeps_the_points_of_the_parts_that_do_not_use_it(batch):
    """Partial credit: a wrong mask costs only the mask's tests, a wrong planner only the planner's, and a
    wrong scheduler keeps the mask's and the planner's points."""
    parts = {
        "mask_queries_at_zero": "mask",
        "plan_decodes_not_counted": "plan_prefill",
        "plan_round_robin_restarts_at_zero": "plan_prefill",
    }
    for name, word in parts.items():
        failed = {t.id for t in batch[f"bug_{name}"].tests if t.status != "passed"}
        assert failed and all(word in test_id for test_id in failed), failed
    for name in ("prompt_in_progress_skipped_when_it_does_not_fit", "prefills_before_decodes"):
        status = {t.id: t.status for t in batch[f"bug_{name}"].tests}
        for kept in (
            "test_chunk_mask_matches_the_reference",
            "test_prefill_in_chunks_with_your_mask_gives_the_logits_of_one_pass",
            "test_plan_prefill_matches_the_reference_on_random_inputs",
            "test_plan_prefill_edges_and_errors",
        ):
            assert status[kept] == "passed", (name, kept)


def test_containers_that_lie_about_equality_earn_nothing(batch):
    """Only plain data crosses back, so a list whose == always says yes arrives as a plain list (or a handle,
    which is not data) and is compared by value in the grader."""
    check_tamper_earns_nothing(batch, "containers_that_claim_equality")
