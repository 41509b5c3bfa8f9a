"""Grading Lab 3: the solution scores full marks, the blank lab zero, every planted bug loses the points of
the hidden test aimed at it (and keeps the others), and containers that lie about equality earn nothing.

The fixture notebooks are made from solutions/ and labs/ by text substitution, as in test_grading.py
(which covers the generic tampering cases), and graded in one batch (``jobs=2``) against a copy of the
hidden tests. What is Lab 3's own: graded classes live in the sandbox and are driven through handles,
allocators are compared through the notebook's ``replay``, and the engine runs in the grader with the
learner's allocator and paged cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.grading_utils import (
    LYING_LIST,
    Batch,
    check_blank_lab_scores_zero,
    check_planted_bug_is_caught,
    check_solution_scores_full_marks,
    check_tamper_earns_nothing,
    lying,
)

from autograder.sandbox.limits import Limits

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ROOT / "solutions" / "lab03_paged_kv.ipynb"
LAB = ROOT / "labs" / "lab03_paged_kv.ipynb"
LIMITS = Limits(call_timeout_s=20, load_timeout_s=30, cpu_s=300, notebook_s=240)

PLANTED_BUGS = {
    # name: (cell, old, new, the hidden test that must catch it)
    "release_only_after_the_end": (
        "simulate",
        "while ends and ends[0][0] <= r.arrival:",
        "while ends and ends[0][0] < r.arrival:",
        "test_simulate_matches_the_reference_on_random_streams",
    ),
    "external_waste_counts_any_free_slot": (
        "simulate",
        "external = free if free >= need else 0",
        "external = free",
        "test_simulate_edge_cases",
    ),
    "free_list_last_in_first_out": (
        "block-allocator",
        "self._free.popleft()",
        "self._free.pop()",
        "test_allocator_matches_the_twins_on_random_operations",
    ),
    "free_changes_counts_before_checking_them": (  # one loop: ids before a bad one are already freed
        "block-allocator",
        "        drops: dict[int, int] = {}\n"
        "        for b in block_ids:\n"
        "            drops[b] = drops.get(b, 0) + 1\n"
        "            if drops[b] > self.ref_count(b):  # (ref_count checks the id)\n"
        '                raise ValueError(f"double free of block {b}: it has {self._refs[b]} holder(s)")\n'
        "        for b in block_ids:\n"
        "            self._refs[b] -= 1\n",
        "        for b in block_ids:\n"
        "            if self.ref_count(b) == 0:\n"
        '                raise ValueError(f"double free of block {b}: it has no holder")\n'
        "            self._refs[b] -= 1\n",
        "test_errors_name_the_bad_block_and_change_nothing",
    ),
    "slot_forgets_the_block_size": (
        "slots",
        "return block_table[pos // block_size] * block_size + pos % block_size",
        "return block_table[pos // block_size] + pos % block_size",
        "test_slot_of_and_slot_mapping_match_the_reference",
    ),
    "grow_takes_a_block_one_token_early": (
        "block-manager",
        "needed = self.num_blocks_for(req.num_computed_tokens + num_new_tokens) - len(req.block_table)",
        "needed = self.num_blocks_for(req.num_computed_tokens + num_new_tokens + 1) - len(req.block_table)",
        "test_grow_takes_a_block_exactly_when_the_last_one_is_full",
    ),
    "fork_without_a_reference": (
        "block-manager",
        "        self.allocator.incref(parent.block_table)\n",
        "",
        "test_fork_shares_blocks_and_a_block_outlives_its_first_holder",
    ),
    "copy_on_write_keeps_the_old_reference": (
        "block-manager",
        "        self.allocator.free([old for old, _ in pairs])\n",
        "",
        "test_copy_on_write_leaves_the_other_holders_data_untouched",
    ),
    "gather_in_block_id_order": (
        "paged-kv-cache",
        "blocks = torch.tensor(table[: -(-context // self.block_size)], dtype=torch.long)",
        "blocks = torch.tensor(sorted(table[: -(-context // self.block_size)]), dtype=torch.long)",
        "test_paged_attention_equals_dense_attention_on_random_tables",
    ),
    "attend_to_the_new_tokens_only": (
        "paged-kv-cache",
        "flatten(0, 1)[:context]",
        "flatten(0, 1)[start:context]",
        "test_paged_attention_equals_dense_attention_on_random_tables",
    ),
    "copy_blocks_copies_keys_only": (
        "paged-kv-cache",
        "            v_pool[dst] = v_pool[src]\n",
        "",
        "test_copy_on_write_leaves_the_other_holders_data_untouched",
    ),
}

# Containers whose comparisons always say "equal", made in the learner's process: they cross to the
# grader as plain lists and tuples (or as handles), so the grader compares the data they hold.
LIAR = LYING_LIST

GARBAGE = {  # cell -> replacement for each stub, in order (wrong values of the right types)
    "simulate": ["return SimResult(_Yes(), 0, 0, 0, 0, None)"],
    "block-allocator": [
        "self._free = _Yes()",
        "return 0",
        "return 0",
        "return 0",
        "return _Yes()",
        "return None",
        "return None",
        "return _Yes()",
    ],
    "slots": ["return 0", "return _Yes()"],
    "block-manager": ["return 0", "return True", "return None", "return None", "return _Yes()"],
    "paged-kv-cache": [
        "self.k = self.v = []",
        "return torch.zeros(0, dtype=torch.long)",
        "return torch.zeros_like(q)",
        "return None",
    ],
}


def _lying(nb: dict) -> None:
    lying(nb, GARBAGE, ("simulate", "def simulate"), LIAR)


TAMPERED = {"containers_that_claim_equality": _lying}


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    fixtures = Batch(tmp_path_factory.mktemp("grading_lab03"))
    fixtures.add_standard(SOLUTION, LAB, PLANTED_BUGS, TAMPERED)
    return fixtures.grade(LIMITS)


def test_solution_scores_full_marks(batch):
    check_solution_scores_full_marks(batch, lab=3)


def test_blank_lab_scores_zero(batch):
    check_blank_lab_scores_zero(batch)


@pytest.mark.parametrize("name", sorted(PLANTED_BUGS))
def test_planted_bug_loses_points_in_the_test_that_targets_it(batch, name):
    check_planted_bug_is_caught(batch, PLANTED_BUGS, name)


def test_feedback_names_the_mistake_without_the_answer(batch):
    """The simulator and attention tests say which plausible mistake the result matches; the allocator
    tests which part of the state differs, after which calls."""
    outputs = {name: " ".join(t.output for t in batch[f"bug_{name}"].tests) for name in PLANTED_BUGS}
    assert "(<=, not <)" in outputs["release_only_after_the_end"]
    assert "add up to what the failing request needed" in outputs["external_waste_counts_any_free_slot"]
    assert "after the calls" in outputs["free_list_last_in_first_out"]
    assert "changed the allocator first" in outputs["free_changes_counts_before_checking_them"]
    assert "in the order of their ids" in outputs["gather_in_block_id_order"]
    assert "attend only to each other" in outputs["attend_to_the_new_tokens_only"]
    assert "exactly when the tokens no longer fit" in outputs["grow_takes_a_block_one_token_early"]


def test_a_bug_in_one_part_keeps_the_points_of_the_parts_that_do_not_use_it(batch):
    """Partial credit: a wrong simulator costs nothing elsewhere, and a wrong free-list order keeps the
    points of the tests that do not depend on the order (reference counts, errors, the engine)."""
    for name in ("release_only_after_the_end", "external_waste_counts_any_free_slot"):
        failed = {t.id for t in batch[f"bug_{name}"].tests if t.status != "passed"}
        assert failed and all("simulate" in test_id or "paged_waste" in test_id for test_id in failed), failed
    status = {t.id: t.status for t in batch["bug_free_list_last_in_first_out"].tests}
    for kept in (
        "test_reference_counts_equal_holders_and_no_block_is_free_and_held",
        "test_paged_attention_equals_dense_attention_on_random_tables",
        "test_your_allocator_and_cache_serve_the_bundled_model_through_preemptions",
    ):
        assert status[kept] == "passed", kept


@pytest.mark.parametrize("name", sorted(TAMPERED))
def test_containers_that_lie_about_equality_earn_nothing(batch, name):
    """Only plain data crosses back, so a list subclass whose == always says yes arrives as a plain list
    (or a handle, which is not data) and is compared by value in the grader."""
    check_tamper_earns_nothing(batch, name)
