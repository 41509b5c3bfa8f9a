"""Grading Lab 6: the solution scores full marks, the blank lab zero, every planted bug loses the points of
the hidden test aimed at it (and keeps the others), and tampered submissions earn nothing.

The fixture notebooks are made from solutions/ and labs/ by text substitution, as in test_grading.py, and
graded in one batch (``jobs=2``) against a copy of the hidden tests. The grader runs the lab's own setup code
and drives the learner's cache from its side, so a setup cell whose ``replay_cache`` runs a correct cache of
its own earns nothing.
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
)

from autograder.sandbox.limits import Limits

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ROOT / "solutions" / "lab06_radix_cache.ipynb"
LAB = ROOT / "labs" / "lab06_radix_cache.ipynb"
LIMITS = Limits(call_timeout_s=20, load_timeout_s=30, cpu_s=300, notebook_s=240)

PLANTED_BUGS = {
    # name: (cell, old, new, the hidden test that must catch it)
    "whole_prompt_served": (
        "reusable-prefix",
        "return min(common // block_size * block_size, cap)",
        "return common // block_size * block_size",
        "test_reusable_prefix_matches_the_reference",
    ),
    "split_loses_the_lock": (
        "radix-cache",
        "id=self.next_id,\n                          lock_ref=child.lock_ref, last_access=child.last_access)",
        "id=self.next_id,\n                          last_access=child.last_access)",
        "test_splits_locks_and_evictions_on_crafted_trees",
    ),
    "insert_increfs_every_block": (
        "radix-cache",
        "self.allocator.incref(new_blocks)",
        "self.allocator.incref(list(blocks))",
        "test_cache_matches_the_reference_operation_by_operation",
    ),
    "lock_only_the_node": (
        "radix-cache",
        "        while node is not None:\n            node.lock_ref += 1\n            node = node.parent",
        "        node.lock_ref += 1",
        "test_cache_matches_the_reference_operation_by_operation",
    ),
    "evict_most_recent_first": (
        "radix-cache",
        "victim = min(leaves, key=lambda n: (n.last_access, n.id))",
        "victim = max(leaves, key=lambda n: (n.last_access, n.id))",
        "test_eviction_order_is_least_recently_used",
    ),
    "insert_returns_the_new_tokens": (
        "radix-cache",
        "        self._touch(node)\n        return cached",
        "        self._touch(node)\n        return len(tokens) - cached",
        "test_cache_matches_the_reference_operation_by_operation",
    ),
}

GARBAGE = {  # cell -> replacement for each stub, in order (wrong values of the right shapes)
    "reusable-prefix": ["return _Yes()"],
    "radix-cache": [
        "return child",
        "return self.root, 0, _Yes()",
        "pass",
        "return MatchResult(_Yes(), 0, self.root)",
        "return 0",
        "pass",
        "pass",
        "return 0",
    ],
}


def _lying(nb: dict) -> None:
    lying(nb, GARBAGE, ("reusable-prefix", "def reusable_prefix"))


# A setup cell whose replay_cache runs a correct cache of its own (the solution's code, run in a namespace of
# its own, on an allocator of its own) and never touches the cache it is given.
OWN_REPLAY = """

_OWN = {own!r}
_plain_replay = replay_cache


def replay_cache(cache, ops):
    namespace = dict(globals())
    exec(_OWN, namespace)
    own = namespace["RadixCache"](BlockAllocator(cache.allocator.num_total), cache.block_size)
    return _plain_replay(own, ops)
"""


def _replay_ignores_the_cache(nb: dict) -> None:
    own = "".join(cell(json.loads(SOLUTION.read_text()), "radix-cache")["source"])
    setup = cell(nb, "setup")
    setup["source"] = "".join(setup["source"]) + OWN_REPLAY.format(own=own)


TAMPERED = {
    "containers_that_claim_equality": _lying,
    "replay_that_ignores_the_cache": _replay_ignores_the_cache,
}


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    fixtures = Batch(tmp_path_factory.mktemp("grading_lab06"))
    fixtures.add_standard(SOLUTION, LAB, PLANTED_BUGS, TAMPERED)
    return fixtures.grade(LIMITS)


def test_solution_scores_full_marks(batch):
    check_solution_scores_full_marks(batch, lab=6)


def test_blank_lab_scores_zero(batch):
    check_blank_lab_scores_zero(batch)


@pytest.mark.parametrize("name", sorted(PLANTED_BUGS))
def test_planted_bug_loses_points_in_the_test_that_targets_it(batch, name):
    check_planted_bug_is_caught(batch, PLANTED_BUGS, name)


def test_feedback_names_the_mistake_without_the_answer(batch):
    """Each failing test says which rule the learner's code broke, on which input, in the terms of the lab."""
    outputs = {name: " ".join(t.output for t in batch[f"bug_{name}"].tests) for name in PLANTED_BUGS}
    assert "more than the prompt minus one token" in outputs["whole_prompt_served"]
    assert "keep both parts locked" in outputs["split_loses_the_lock"]
    assert "reference counts" in outputs["insert_increfs_every_block"] or (
        "free blocks" in outputs["insert_increfs_every_block"]
    )
    # a lock on the node alone shows as a protected size that differs, or as an unlock its walk up the path
    # refuses (which the learner's own error message then explains)
    assert (
        "protected_size" in outputs["lock_only_the_node"]
        or "raised ValueError" in outputs["lock_only_the_node"]
    )
    assert "least recently matched or inserted leaf goes first" in outputs["evict_most_recent_first"]
    assert "insert's return value differs" in outputs["insert_returns_the_new_tokens"]


def test_a_bug_in_the_cache_keeps_the_points_of_reusable_prefix(batch):
    """Partial credit: a wrong reusable_prefix costs only its own test, and a wrong cache keeps its points."""
    failed = {t.id for t in batch["bug_whole_prompt_served"].tests if t.status != "passed"}
    assert failed == {"test_reusable_prefix_matches_the_reference"}, failed
    for name in ("split_loses_the_lock", "evict_most_recent_first", "insert_returns_the_new_tokens"):
        status = {t.id: t.status for t in batch[f"bug_{name}"].tests}
        assert status["test_reusable_prefix_matches_the_reference"] == "passed", name


def test_containers_that_lie_about_equality_earn_nothing(batch):
    """Only plain data crosses back, so a list whose == always says yes arrives as a plain list (or a handle,
    which is not data) and is compared by value in the grader; a cache that stores nothing earns nothing."""
    check_tamper_earns_nothing(batch, "containers_that_claim_equality")


def test_a_replay_that_ignores_the_cache_earns_nothing(batch):
    """A setup cell whose replay_cache reports a correct cache's results (the learner's RadixCache is a stub) is
    not run: the grader runs the lab's own setup code and says so, and the cache's tests drive the stub from
    the grader, so it earns nothing."""
    check_setup_edit_earns_nothing(batch, "replay_that_ignores_the_cache")
