"""Grading Lab 9: the solution scores full marks, the blank lab zero, every planted bug loses the points of the
hidden test aimed at it (and keeps the others), and tampered submissions earn nothing.

The fixture notebooks are made from solutions/ and labs/ by text substitution and graded in one batch
(``jobs=2``) against a copy of the hidden tests. Distributions are drawn by the notebook's ``draw_many``, the
lab's setup code: the grader runs the lab's own, so a setup cell edited to draw from a correct sampler of its
own (and never the learner's) earns nothing, nor does a graded cell that binds ``draw_many`` again.
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
    check_setup_edit_earns_nothing,
    check_solution_scores_full_marks,
    check_tamper_earns_nothing,
    lying,
    prepend,
)

from autograder.sandbox.limits import Limits

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ROOT / "solutions" / "lab09_speculative_decoding.ipynb"
LAB = ROOT / "labs" / "lab09_speculative_decoding.ipynb"
LIMITS = Limits(call_timeout_s=60, load_timeout_s=30, cpu_s=300, notebook_s=240)

PLANTED_BUGS = {
    # name: (cell, old, new, the hidden test that must catch it)
    "ngram_last_occurrence": (
        "propose-ngram",
        "for start in range(length - n):",
        "for start in reversed(range(length - n)):",
        "test_propose_ngram_matches_the_reference",
    ),
    "no_bonus_token": (
        "verify-greedy",
        "    kept.append(int(target[len(kept)]))\n",
        "    if len(kept) < len(draft):\n        kept.append(int(target[len(kept)]))\n",
        "test_verify_greedy_matches_the_reference",
    ),
    "residual_from_p": (
        "rejection-sample",
        "residual = (p[i] - q[i]).clamp_min(0.0)",
        "residual = p[i]",
        "test_rejection_sampler_keeps_the_target_distribution_with_a_draft",
    ),
    "computed_to_num_tokens": (
        "rollback",
        "min(seq.num_computed_tokens, seq.num_tokens - 1)",
        "min(seq.num_computed_tokens, seq.num_tokens)",
        "test_rollback_matches_the_reference",
    ),
    "no_own_token": (
        "expected-tokens",
        "return (1.0 - acceptance_rate ** (k + 1)) / (1.0 - acceptance_rate)",
        "return (1.0 - acceptance_rate ** (k + 1)) / (1.0 - acceptance_rate) - 1.0",
        "test_expected_tokens_per_step_matches_the_reference",
    ),
}

GARBAGE = {  # cell -> replacement for each stub, in order (wrong values of the right shapes)
    "propose-ngram": ["return _Yes()"],
    "verify-greedy": ["return _Yes()"],
    "rejection-sample": ["return _Yes()"],
    "rollback": ["seq.block_table = _Yes()"],
    "expected-tokens": ["return 1.0"],
}


def _lying(nb: dict) -> None:
    lying(nb, GARBAGE, ("propose-ngram", "def propose_ngram"))


# A setup cell whose draw_many draws from a correct sampler of its own (the solution's, run in a namespace of
# its own) and never calls the learner's, which is a stub.
OWN_DRAWS = """

_OWN = {own!r}
_plain_draw_many = draw_many


def draw_many(sampler, draft, target_probs, draft_probs=None, n=1000, seed=0):
    namespace = dict(globals())
    exec(_OWN, namespace)
    return _plain_draw_many(namespace["rejection_sample"], draft, target_probs, draft_probs, n, seed)
"""


def _own_draws() -> str:
    solution = json.loads(SOLUTION.read_text())
    return OWN_DRAWS.format(own="".join(cell(solution, "rejection-sample")["source"]))


def _setup_draws_from_its_own_sampler(nb: dict) -> None:
    setup = cell(nb, "setup")
    setup["source"] = "".join(setup["source"]) + _own_draws()


def _graded_cell_rebinds_draw_many(nb: dict) -> None:
    prepend(nb, "expected-tokens", _own_draws())


TAMPERED = {
    "containers_that_claim_equality": _lying,
    "setup_that_draws_from_its_own_sampler": _setup_draws_from_its_own_sampler,
    "graded_cell_that_rebinds_draw_many": _graded_cell_rebinds_draw_many,
}


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    fixtures = Batch(tmp_path_factory.mktemp("grading_lab09"))
    fixtures.add_standard(SOLUTION, LAB, PLANTED_BUGS, TAMPERED)
    return fixtures.grade(LIMITS)


def test_solution_scores_full_marks(batch):
    check_solution_scores_full_marks(batch, lab=9)


def test_blank_lab_scores_zero(batch):
    check_blank_lab_scores_zero(batch)


@pytest.mark.parametrize("name", sorted(PLANTED_BUGS))
def test_planted_bug_loses_points_in_the_test_that_targets_it(batch, name):
    check_planted_bug_is_caught(batch, PLANTED_BUGS, name)


def test_feedback_names_the_mistake_without_the_answer(batch):
    """Each failing test says which rule the learner's code broke, on which input, in the terms of the lab."""
    outputs = {name: " ".join(t.output for t in batch[f"bug_{name}"].tests) for name in PLANTED_BUGS}
    assert "first earlier occurrence" in outputs["ngram_last_occurrence"]
    assert "the model's own token after the kept guesses is missing" in outputs["no_bonus_token"]
    assert "the residual max(0, p - q)" in outputs["residual_from_p"], outputs["residual_from_p"]
    assert "the last, which is computed next step" in outputs["computed_to_num_tokens"]
    assert "count the model's own token" in outputs["no_own_token"]


def test_a_wrong_sampler_keeps_the_points_of_the_other_pieces(batch):
    """Partial credit: a sampler that draws its replacement from p loses the draft-distribution test only (with
    certain guesses the residual is p without the guess: the bug shows there too only as a replacement equal to
    the rejected guess); the proposer, the verification, the rollback and the engine keep their points."""
    status = {t.id: t.status for t in batch["bug_residual_from_p"].tests}
    for test_id in (
        "test_propose_ngram_matches_the_reference",
        "test_verify_greedy_matches_the_reference",
        "test_rollback_matches_the_reference",
        "test_your_pieces_in_the_engine_keep_the_reference_outputs",
    ):
        assert status[test_id] == "passed", test_id


def test_containers_that_lie_about_equality_earn_nothing(batch):
    """Only plain data crosses back, so a list whose == always says yes arrives as a plain list and is compared by
    value in the grader."""
    check_tamper_earns_nothing(batch, "containers_that_claim_equality")


def test_an_edited_setup_cell_earns_nothing_and_is_noted(batch):
    """A setup cell whose draw_many draws from a correct sampler of its own and never the learner's (a stub) is not
    run: the grader runs the lab's own setup code, says so, and the stub earns what a blank lab does."""
    check_setup_edit_earns_nothing(batch, "setup_that_draws_from_its_own_sampler")


def test_a_graded_cell_that_binds_draw_many_again_earns_nothing(batch):
    """The same draw_many defined in a graded cell: the hidden tests get the setup's, whose globals are the
    setup's own, so the learner's stub sampler is what runs."""
    check_tamper_earns_nothing(batch, "graded_cell_that_rebinds_draw_many")
