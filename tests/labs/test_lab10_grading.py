"""Grading Lab 10: the solution scores full marks, the blank lab zero, every planted bug loses the points of the
hidden test aimed at it (and keeps the others), and tampered submissions earn nothing.

The fixture notebooks are made from solutions/ and labs/ by text substitution and graded in one batch
(``jobs=2``) against a copy of the hidden tests. The ranks of a sharded forward run in the setup's
``run_mlp_ranks`` and ``run_attention_ranks``, the lab's own setup code: a setup cell edited to run correct
forwards of its own (and never the learner's) earns nothing, nor does a graded cell that binds those names
again.
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
SOLUTION = ROOT / "solutions" / "lab10_tensor_parallel.ipynb"
LAB = ROOT / "labs" / "lab10_tensor_parallel.ipynb"
LIMITS = Limits(call_timeout_s=60, load_timeout_s=30, cpu_s=300, notebook_s=240)

PLANTED_BUGS = {
    # name: (cell, old, new, the hidden test that must catch it)
    "row_shard_cuts_rows": (
        "split-linear",
        "return weight[:, rank * n : (rank + 1) * n]",
        "return weight[rank * n : (rank + 1) * n]",
        "test_column_and_row_shards_match_the_reference",
    ),
    "kv_heads_split_never_replicated": (
        "heads",
        "kv = rank // (size // n_kv_heads)",
        "kv = rank % n_kv_heads",
        "test_head_ranges_match_the_reference",
    ),
    "qkv_cut_contiguously": (
        "fused",
        "    hd = t.shape[0] // (n_heads + 2 * n_kv_heads)\n",
        "    return column_shard(t, rank, size)\n",
        "test_fused_shards_match_the_reference",
    ),
    "bias_on_every_rank": (
        "mlp",
        "y = tp.all_reduce(F.linear(h, down_weight))\n    return y if down_bias is None else y + down_bias",
        "return tp.all_reduce(F.linear(h, down_weight, down_bias))",
        "test_mlp_forward_sums_to_the_whole_mlp",
    ),
    "rope_on_q_only": (
        "attention",
        "q, k = apply_rope(q, *rope), apply_rope(k, *rope)",
        "q = apply_rope(q, *rope)",
        "test_attention_forward_sums_to_the_whole_attention",
    ),
}

GARBAGE = {  # cell -> replacement for each stub, in order (wrong values of the right kinds)
    "split-linear": ["return _Yes()", "return _Yes()"],
    "heads": ["return _Yes()"],
    "fused": ["return _Yes()", "return _Yes()"],
    "mlp": ["return _Yes()"],
    "attention": ["return _Yes()"],
}


def _lying(nb: dict) -> None:
    lying(nb, GARBAGE, ("split-linear", "def column_shard"))


# A setup cell whose runners run correct forwards of its own (the solution's, run in a namespace of its own)
# and never call the learner's, which are stubs.
OWN_FORWARDS = """

_OWN = {own!r}
_plain_mlp_ranks, _plain_attention_ranks = run_mlp_ranks, run_attention_ranks


def _own(name):
    namespace = dict(globals())
    exec(_OWN, namespace)
    return namespace[name]


def run_mlp_ranks(mlp_forward, x, shards, act):
    return _plain_mlp_ranks(_own("mlp_forward"), x, shards, act)


def run_attention_ranks(attention_forward, x, shards, rope):
    return _plain_attention_ranks(_own("attention_forward"), x, shards, rope)
"""


def _own_forwards() -> str:
    solution = json.loads(SOLUTION.read_text())
    own = "".join(cell(solution, "mlp")["source"]) + "\n\n" + "".join(cell(solution, "attention")["source"])
    return OWN_FORWARDS.format(own=own)


def _setup_runs_its_own_forwards(nb: dict) -> None:
    setup = cell(nb, "setup")
    setup["source"] = "".join(setup["source"]) + _own_forwards()


def _graded_cell_rebinds_the_runners(nb: dict) -> None:
    prepend(nb, "attention", _own_forwards())


TAMPERED = {
    "containers_that_claim_equality": _lying,
    "setup_that_runs_its_own_forwards": _setup_runs_its_own_forwards,
    "graded_cell_that_rebinds_the_runners": _graded_cell_rebinds_the_runners,
}


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    fixtures = Batch(tmp_path_factory.mktemp("grading_lab10"))
    fixtures.add_standard(SOLUTION, LAB, PLANTED_BUGS, TAMPERED)
    return fixtures.grade(LIMITS)


def test_solution_scores_full_marks(batch):
    check_solution_scores_full_marks(batch, lab=10)


def test_blank_lab_scores_zero(batch):
    check_blank_lab_scores_zero(batch)


@pytest.mark.parametrize("name", sorted(PLANTED_BUGS))
def test_planted_bug_loses_points_in_the_test_that_targets_it(batch, name):
    check_planted_bug_is_caught(batch, PLANTED_BUGS, name)


def test_feedback_names_the_mistake_without_the_answer(batch):
    """Each failing test says which rule the learner's code broke, on which input, in the terms of the lab."""
    outputs = {name: " ".join(t.output for t in batch[f"bug_{name}"].tests) for name in PLANTED_BUGS}
    assert "block r of the input features" in outputs["row_shard_cuts_rows"]
    assert "the one KV head its query heads read" in outputs["kv_heads_split_never_replicated"]
    assert "then its KV heads' rows of k, then of v" in outputs["qkv_cut_contiguously"]
    assert "add its bias once" in outputs["bias_on_every_rank"]
    assert "rotate q and k (not v)" in outputs["rope_on_q_only"]


def test_a_wrong_mlp_keeps_the_points_of_the_other_pieces(batch):
    """Partial credit: an MLP that adds its bias on every rank loses the MLP tests and the whole models only; the
    cuts and the attention keep their points."""
    status = {t.id: t.status for t in batch["bug_bias_on_every_rank"].tests}
    assert status["test_your_pieces_run_whole_models"] == "failed"
    for test_id in (
        "test_column_and_row_shards_match_the_reference",
        "test_head_ranges_match_the_reference",
        "test_fused_shards_match_the_reference",
        "test_attention_forward_sums_to_the_whole_attention",
    ):
        assert status[test_id] == "passed", test_id


def test_containers_that_lie_about_equality_earn_nothing(batch):
    """Only plain data crosses back, so a tensor-like object whose == always says yes arrives as a handle and
    fails the type checks."""
    check_tamper_earns_nothing(batch, "containers_that_claim_equality")


def test_an_edited_setup_cell_earns_nothing_and_is_noted(batch):
    """A setup cell whose runners run correct forwards of its own and never the learner's (stubs) is not run: the
    grader runs the lab's own setup code, says so, and the stubs earn what a blank lab does."""
    check_setup_edit_earns_nothing(batch, "setup_that_runs_its_own_forwards")


def test_a_graded_cell_that_binds_the_runners_again_earns_nothing(batch):
    """The same runners defined in a graded cell: the hidden tests get the setup's, whose globals are the setup's
    own, so the learner's stub forwards are what run."""
    check_tamper_earns_nothing(batch, "graded_cell_that_rebinds_the_runners")
