"""A request's state machine: every legal move and every illegal one; RequestStatus compares equal to its
string value."""

from __future__ import annotations

from enum import Enum

import pytest

from nanolab.engine.request import (
    FinishReason,
    IllegalTransition,
    Request,
    RequestStatus,
    admit,
    finish,
    preempt,
)
from nanolab.model.sampling import SamplingParams

# -- the state machine: admit, preempt, finish --------------------------------------------------------

WAITING, RUNNING, PREEMPTED, FINISHED = (
    RequestStatus.WAITING,
    RequestStatus.RUNNING,
    RequestStatus.PREEMPTED,
    RequestStatus.FINISHED,
)
MOVES = {
    "admit": admit,
    "preempt": preempt,
    "finish stop": lambda r: finish(r, FinishReason.STOP),
    "finish length": lambda r: finish(r, FinishReason.LENGTH),
    "finish abort": lambda r: finish(r, FinishReason.ABORT),
}
# every legal move and where it leads; every (state, move) pair not listed is illegal
LEGAL = {
    (WAITING, "admit"): RUNNING,
    (WAITING, "finish abort"): FINISHED,
    (RUNNING, "preempt"): PREEMPTED,
    (RUNNING, "finish stop"): FINISHED,
    (RUNNING, "finish length"): FINISHED,
    (RUNNING, "finish abort"): FINISHED,
    (PREEMPTED, "admit"): RUNNING,
    (PREEMPTED, "finish abort"): FINISHED,
}
ALL_PAIRS = [(state, move) for state in RequestStatus for move in MOVES]


def request_in(state: RequestStatus, request_id: str = "r") -> Request:
    """A request brought to ``state`` by legal moves only."""
    r = Request(request_id, [1, 2, 3], SamplingParams(max_tokens=8))
    if state in (RUNNING, PREEMPTED):
        admit(r)
    if state == PREEMPTED:
        preempt(r)
    if state == FINISHED:
        admit(r)
        finish(r, FinishReason.LENGTH)
    assert r.status is state
    return r


def test_the_table_covers_every_state_and_move():
    assert len(ALL_PAIRS) == 4 * 5
    assert set(LEGAL) < set(ALL_PAIRS)


@pytest.mark.parametrize(("state", "move"), [p for p in ALL_PAIRS if p in LEGAL])
def test_a_legal_move_leads_to_its_state(state, move):
    r = request_in(state)
    MOVES[move](r)
    assert r.status is LEGAL[(state, move)]
    if move.startswith("finish"):
        assert r.finish_reason is FinishReason(move.split()[1])
        assert r.is_finished
    else:
        assert r.finish_reason is None
        assert not r.is_finished


@pytest.mark.parametrize(("state", "move"), [p for p in ALL_PAIRS if p not in LEGAL])
def test_an_illegal_move_raises_and_changes_nothing(state, move):
    r = request_in(state, request_id="req-42")
    r.num_computed_tokens = 2
    before = (r.status, r.finish_reason, r.num_computed_tokens, r.num_preemptions)
    with pytest.raises(IllegalTransition) as info:
        MOVES[move](r)
    assert (r.status, r.finish_reason, r.num_computed_tokens, r.num_preemptions) == before
    message = str(info.value)
    assert "'req-42'" in message
    assert f"it is {state.value}" in message


@pytest.mark.parametrize(
    ("state", "move", "words"),
    [
        (WAITING, preempt, ["'a'", "be preempted", "it is waiting", "only a running request"]),
        (RUNNING, admit, ["'a'", "be admitted", "it is running", "waiting or preempted"]),
        (PREEMPTED, lambda r: finish(r, "stop"), ["'a'", "finish with 'stop'", "it is preempted"]),
        (FINISHED, lambda r: finish(r, "abort"), ["'a'", "finish with 'abort'", "it is finished"]),
    ],
)
def test_the_illegal_transition_message_says_what_was_tried_on_which_request_in_which_state(
    state, move, words
):
    with pytest.raises(IllegalTransition) as info:
        move(request_in(state, "a"))
    for w in words:
        assert w in str(info.value)


def test_illegal_transition_is_a_runtime_error():
    assert issubclass(IllegalTransition, RuntimeError)


def test_a_finished_request_keeps_its_first_reason():
    r = request_in(RUNNING)
    finish(r, FinishReason.STOP)
    for reason in FinishReason:
        with pytest.raises(IllegalTransition):
            finish(r, reason)
    assert r.finish_reason is FinishReason.STOP


@pytest.mark.parametrize("reason", ["stop", "length", "abort"])
def test_finish_takes_the_reason_as_a_string(reason):
    r = request_in(RUNNING)
    finish(r, reason)
    assert r.finish_reason is FinishReason(reason)
    assert r.status is FINISHED


def test_finish_with_an_unknown_reason_raises_value_error_and_changes_nothing():
    r = request_in(RUNNING)
    with pytest.raises(ValueError):
        finish(r, "cancelled")
    assert r.status is RUNNING and r.finish_reason is None


@pytest.mark.parametrize("state", [WAITING, RUNNING, PREEMPTED])
def test_timeout_finishes_from_any_live_state_like_abort(state):
    r = request_in(state)
    finish(r, "timeout")
    assert r.status is FINISHED and r.finish_reason is FinishReason.TIMEOUT


def test_preempt_resets_the_computed_tokens_and_keeps_the_output():
    r = request_in(RUNNING)
    r.num_computed_tokens = 5
    r.output_token_ids += [7, 8, 9]
    preempt(r)
    assert r.status is PREEMPTED
    assert r.num_computed_tokens == 0
    assert r.num_preemptions == 1
    assert r.output_token_ids == [7, 8, 9]
    assert r.prompt_token_ids == [1, 2, 3]
    assert r.finish_reason is None
    # re-admitted, it recomputes its prompt and its output from scratch
    admit(r)
    assert r.status is RUNNING
    assert r.num_computed_tokens == 0
    assert r.remaining_prefill() == 6 and r.is_prefilling
    r.num_computed_tokens = 4
    preempt(r)
    assert r.num_preemptions == 2 and r.num_computed_tokens == 0
    assert r.output_token_ids == [7, 8, 9]


def test_admit_changes_only_the_status():
    r = request_in(WAITING)
    r.num_computed_tokens = 2  # the prefix cache may start a request above 0
    admit(r)
    assert r.status is RUNNING
    assert r.num_computed_tokens == 2 and r.num_preemptions == 0 and r.finish_reason is None


def test_a_request_can_be_preempted_and_admitted_again_many_times_then_finish():
    r = request_in(WAITING)
    for i in range(1, 4):
        admit(r)
        preempt(r)
        assert r.num_preemptions == i
    admit(r)
    finish(r, FinishReason.LENGTH)
    assert r.status is FINISHED and r.finish_reason is FinishReason.LENGTH and r.num_preemptions == 3


# -- RequestStatus is a str Enum ----------------------------------------------------------------------


class OtherStatus(str, Enum):
    RUNNING = "running"
    WAITING = "waiting"


@pytest.mark.parametrize("status", list(RequestStatus))
def test_a_status_equals_its_string_value(status):
    assert status == status.value
    assert status.value == status
    assert RequestStatus(status.value) is status
    assert hash(status) == hash(status.value)
    assert {status.value: 1}[status] == 1


def test_a_status_differs_from_another_value():
    assert RequestStatus.RUNNING != "waiting"
    assert RequestStatus.RUNNING != RequestStatus.WAITING


def test_a_status_equals_a_member_of_another_str_enum_with_the_same_value():
    assert RequestStatus.RUNNING == OtherStatus.RUNNING
    assert RequestStatus.WAITING == OtherStatus.WAITING
    assert RequestStatus.RUNNING != OtherStatus.WAITING


def test_moves_accept_a_status_stored_as_a_plain_string():
    r = request_in(WAITING)
    r.status = "waiting"
    admit(r)
    assert r.status is RUNNING
    r.status = "finished"
    with pytest.raises(IllegalTransition, match="it is finished"):
        preempt(r)
