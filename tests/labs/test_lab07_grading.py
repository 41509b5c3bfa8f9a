"""Grading Lab 7: the solution scores full marks, the blank lab zero, every planted bug loses the points of the
hidden test aimed at it (and keeps the others), and tampered submissions earn nothing.

The fixture notebooks are made from solutions/ and labs/ by text substitution and graded in one batch
(``jobs=2``) against a copy of the hidden tests. The hidden tests drive the learner's Engine from the grader
(the notebook's ``run_engine`` is the reference's driver there), so a setup cell edited to drive a correct
engine of its own (and never the learner's) earns nothing, nor does a graded cell that binds ``run_engine``
again; one that rewrites it in place is `test_speed_forgery.py`'s.
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
SOLUTION = ROOT / "solutions" / "lab07_engine.ipynb"
LAB = ROOT / "labs" / "lab07_engine.ipynb"
LIMITS = Limits(call_timeout_s=30, load_timeout_s=30, cpu_s=300, notebook_s=240)

PLANTED_BUGS = {
    # name: (cell, old, new, the hidden test that must catch it)
    "decode_position_past": (
        "layout-batch",
        "lay.positions += range(start, start + n)",
        "lay.positions += range(start + (n == 1), start + n + (n == 1))",
        "test_layout_batch_matches_the_reference",
    ),
    "stop_search_new_text_only": (
        "stop-rules",
        "text.find(s, max(0, new_from - len(s) + 1))",
        "text.find(s, new_from)",
        "test_stop_rules_match_the_reference",
    ),
    "detok_each_token_alone": (
        "detokenizer",
        "        delta = self._decoder.decode(data)",
        '        delta = data.decode("utf-8", errors="replace")',
        "test_detokenizer_matches_the_reference",
    ),
    "no_holdback": (
        "engine",
        "            visible = max(shown_text, visible - held_back(text, req.sampling_params.stop))",
        "            pass",
        "test_engine_matches_the_reference_step_by_step",
    ),
    "abort_keeps_blocks": (
        "engine",
        "        self.scheduler.abort(req)\n",
        "\n",
        "test_aborts_free_every_block",
    ),
    "static_all_at_once": (
        "static",
        "        for r in batch:\n            engine.add(r)\n",
        "        for r in requests[i:]:\n            engine.add(r) if r.request_id not in engine.requests else None\n",
        "test_generate_static_matches_the_reference",
    ),
}

GARBAGE = {  # cell -> replacement for each stub, in order (wrong values of the right shapes)
    "layout-batch": ["return BatchLayout(_Yes(), _Yes(), _Yes(), _Yes(), _Yes(), _Yes(), _Yes())"],
    "stop-rules": ["return None, _Yes()", "return 0"],
    "detokenizer": ["self.text = ''", "return ''", "pass"],
    "engine": [
        "self.requests = {}",
        "pass",
        "return False",
        "return _Yes()",
        "return None",
        "return _Yes()",
        "pass",
        "return None",
    ],
    "static": ["return _Yes()"],
}


def _lying(nb: dict) -> None:
    lying(nb, GARBAGE, ("layout-batch", "def layout_batch"))


# A setup cell whose run_engine runs a correct engine of its own (the solution's cells, run in a namespace of
# their own) and never touches the learner's Engine, which is a stub.
OWN_DRIVER = """

_OWN = {own!r}
_plain_run_engine = run_engine


def run_engine(engine_class, requests, settings=None, aborts=None, digest=False):
    namespace = dict(globals())
    exec(_OWN, namespace)
    return _plain_run_engine(namespace["Engine"], requests, settings, aborts, digest)
"""


def _own_driver() -> str:
    solution = json.loads(SOLUTION.read_text())
    own = "\n\n".join(
        "".join(cell(solution, g)["source"]) for g in ("layout-batch", "stop-rules", "detokenizer", "engine")
    )
    return OWN_DRIVER.format(own=own)


def _setup_driver_ignores_the_engine(nb: dict) -> None:
    setup = cell(nb, "setup")
    setup["source"] = "".join(setup["source"]) + _own_driver()


def _graded_cell_rebinds_the_driver(nb: dict) -> None:
    prepend(nb, "static", _own_driver())


TAMPERED = {
    "containers_that_claim_equality": _lying,
    "setup_driver_that_ignores_the_engine": _setup_driver_ignores_the_engine,
    "graded_cell_that_rebinds_the_driver": _graded_cell_rebinds_the_driver,
}


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    fixtures = Batch(tmp_path_factory.mktemp("grading_lab07"))
    fixtures.add_standard(SOLUTION, LAB, PLANTED_BUGS, TAMPERED)
    return fixtures.grade(LIMITS)


def test_solution_scores_full_marks(batch):
    check_solution_scores_full_marks(batch, lab=7)


def test_blank_lab_scores_zero(batch):
    check_blank_lab_scores_zero(batch)


@pytest.mark.parametrize("name", sorted(PLANTED_BUGS))
def test_planted_bug_loses_points_in_the_test_that_targets_it(batch, name):
    check_planted_bug_is_caught(batch, PLANTED_BUGS, name)


def test_feedback_names_the_mistake_without_the_answer(batch):
    """Each failing test says which rule the learner's code broke, on which input, in the terms of the lab."""
    outputs = {name: " ".join(t.output for t in batch[f"bug_{name}"].tests) for name in PLANTED_BUGS}
    assert "the positions" in outputs["decode_position_past"]
    assert "stop strings" in outputs["stop_search_new_text_only"]
    assert "no half of one" in outputs["detok_each_token_alone"]
    assert "could still start a stop string" in outputs["no_holdback"]
    # an abort the scheduler is not told of shows (depending on the mix) as a step that differs in a mix with
    # aborts, as blocks held at the end, as requests waiting forever for them, or as the aborted request
    # found still in the scheduler's queue
    assert any(
        hint in outputs["abort_keeps_blocks"]
        for hint in ("with aborts", "gives its blocks back", "never given back", "must tell the scheduler")
    ), outputs["abort_keeps_blocks"]
    # requests added before their batch: fewer forwards, other outputs, or a finished request added again
    assert any(
        hint in outputs["static_all_at_once"]
        for hint in (
            "only then does the next one start",
            "final outputs differ",
            "only a new request can be added",
        )
    ), outputs["static_all_at_once"]


def test_a_bug_in_the_loop_keeps_the_points_of_the_pieces(batch):
    """Partial credit: a wrong stream in the loop costs the engine's tests only; layout, stop rules and the
    detokeniser keep their points."""
    status = {t.id: t.status for t in batch["bug_no_holdback"].tests}
    for test_id in (
        "test_layout_batch_matches_the_reference",
        "test_stop_rules_match_the_reference",
        "test_detokenizer_matches_the_reference",
    ):
        assert status[test_id] == "passed", test_id


def test_containers_that_lie_about_equality_earn_nothing(batch):
    """Only plain data crosses back, so a list whose == always says yes arrives as a plain list (or a handle,
    which is not data) and is compared by value in the grader."""
    check_tamper_earns_nothing(batch, "containers_that_claim_equality")


def test_an_edited_setup_cell_earns_nothing_and_is_noted(batch):
    """A setup cell whose run_engine runs a correct engine of its own and never the learner's (a stub) is not
    run: the grader runs the lab's own setup code, says so, and the stub earns what a blank lab does."""
    check_setup_edit_earns_nothing(batch, "setup_driver_that_ignores_the_engine")


def test_a_graded_cell_that_binds_the_driver_again_earns_nothing(batch):
    """The same driver defined in a graded cell: the hidden tests get the setup's run_engine, whose globals
    are the setup's own, so the learner's stub Engine is what runs."""
    check_tamper_earns_nothing(batch, "graded_cell_that_rebinds_the_driver")
