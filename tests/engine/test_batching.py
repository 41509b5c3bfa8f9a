"""Static and continuous batching on a clock of steps: hand-worked traces, properties of random traces,
agreement with a step-by-step reference written from the module's description, and the input errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanolab.engine.batching import BatchingResult, BatchRequest, simulate_batching

MODES = ("static", "continuous")


def run(trace, max_batch_size, mode):
    r = simulate_batching([BatchRequest(*x) for x in trace], max_batch_size, mode)
    return r.start, r.finish, r.batch_sizes


# -- hand-worked traces -------------------------------------------------------------------------------


def test_the_docstring_example():
    trace = [BatchRequest(0, 5), BatchRequest(0, 1), BatchRequest(1, 2)]
    s = simulate_batching(trace, 2, "static")
    assert (s.start, s.finish, s.batch_sizes) == ([0, 0, 5], [4, 4, 6], [2, 2, 2, 2, 2, 1, 1])
    c = simulate_batching(trace, 2, "continuous")
    assert (c.start, c.finish, c.batch_sizes) == ([0, 0, 1], [4, 0, 2], [2, 2, 2, 1, 1])
    assert s.num_steps == 7 and c.num_steps == 5
    assert s.latency(trace) == [5, 5, 6]
    assert c.latency(trace) == [5, 1, 2]


def test_static_makes_late_arrivals_wait_for_the_whole_batch_while_continuous_fills_free_seats():
    # static: {0} runs steps 0-2 alone although 1 and 2 arrive at step 1; {1, 2} then runs steps 3-4.
    # continuous: 1 takes the free seat at step 1 and leaves after it; 2 takes that seat at step 2.
    trace = [(0, 3), (1, 1), (1, 2)]
    assert run(trace, 2, "static") == ([0, 3, 3], [2, 4, 4], [1, 1, 1, 2, 2])
    assert run(trace, 2, "continuous") == ([0, 1, 2], [2, 1, 3], [1, 2, 2, 1])


def test_a_short_request_in_a_static_batch_is_returned_with_the_longest_and_its_row_is_padding():
    s = simulate_batching([BatchRequest(0, 1), BatchRequest(0, 4)], 2, "static")
    assert s.finish == [3, 3]
    assert s.batch_sizes == [2, 2, 2, 2]  # 8 rows computed for 5 tokens
    c = simulate_batching([BatchRequest(0, 1), BatchRequest(0, 4)], 2, "continuous")
    assert c.finish == [0, 3]
    assert c.batch_sizes == [2, 1, 1, 1]  # 5 rows for 5 tokens


@pytest.mark.parametrize("mode", MODES)
def test_steps_before_any_arrival_and_between_arrivals_are_idle(mode):
    assert run([(2, 2), (6, 1)], 2, mode) == ([2, 6], [3, 6], [0, 0, 1, 1, 0, 0, 1])


@pytest.mark.parametrize("mode", MODES)
def test_a_request_arriving_the_step_after_the_batch_ends_starts_at_once(mode):
    assert run([(0, 2), (2, 3)], 1, mode) == ([0, 2], [1, 4], [1, 1, 1, 1, 1])


def test_with_one_seat_both_modes_run_the_requests_one_after_another():
    trace = [(0, 3), (0, 1), (1, 2), (9, 1)]
    expected = ([0, 3, 4, 9], [2, 3, 5, 9], [1, 1, 1, 1, 1, 1, 0, 0, 0, 1])
    assert run(trace, 1, "static") == expected
    assert run(trace, 1, "continuous") == expected


def test_requests_of_equal_length_arriving_together_give_the_same_schedule_in_both_modes():
    # five requests of 3 tokens, two seats: batches {0, 1}, {2, 3}, {4}
    trace = [(0, 3)] * 5
    expected = ([0, 0, 3, 3, 6], [2, 2, 5, 5, 8], [2, 2, 2, 2, 2, 2, 1, 1, 1])
    assert run(trace, 2, "static") == expected
    assert run(trace, 2, "continuous") == expected


@pytest.mark.parametrize("mode", MODES)
def test_a_request_alone_has_a_latency_of_its_output_length(mode):
    trace = [BatchRequest(4, 7)]
    r = simulate_batching(trace, 3, mode)
    assert (r.start, r.finish) == ([4], [10])
    assert r.latency(trace) == [7]


@pytest.mark.parametrize("mode", MODES)
def test_an_empty_trace_gives_empty_lists(mode):
    r = simulate_batching([], 4, mode)
    assert (r.start, r.finish, r.batch_sizes) == ([], [], [])
    assert r.num_steps == 0
    assert r.latency([]) == []


@pytest.mark.parametrize("mode", MODES)
def test_the_input_trace_is_not_changed(mode):
    trace = [BatchRequest(0, 2), BatchRequest(1, 1)]
    copy = list(trace)
    simulate_batching(trace, 1, mode)
    assert trace == copy


# -- errors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("trace", "max_batch_size", "mode", "match"),
    [
        ([(0, 1)], 2, "dynamic", "mode must be one of 'static', 'continuous', got 'dynamic'"),
        ([], 2, "Static", "mode must be one of"),
        ([(0, 1)], 0, "static", "max_batch_size must be at least 1, got 0"),
        ([(0, 1)], -1, "continuous", "max_batch_size must be at least 1, got -1"),
        ([(0, 2), (1, 0)], 2, "static", "request 1 has output_len 0"),
        ([(0, -3)], 2, "continuous", "request 0 has output_len -3"),
        ([(-1, 2)], 2, "static", "request 0 arrives at -1"),
        (
            [(0, 1), (3, 1), (2, 1)],
            2,
            "continuous",
            "request 2 arrives at 2: arrivals must be >= 0 and in order",
        ),
    ],
)
def test_invalid_inputs_raise_value_error(trace, max_batch_size, mode, match):
    with pytest.raises(ValueError, match=match):
        simulate_batching([BatchRequest(*x) for x in trace], max_batch_size, mode)


@pytest.mark.parametrize("mode", MODES)
def test_requests_arriving_at_the_same_step_are_in_order(mode):
    r = simulate_batching([BatchRequest(3, 1), BatchRequest(3, 1), BatchRequest(3, 1)], 2, mode)
    assert r.start == [3, 3, 4]


# -- a reference, step by step, written from the module's description ---------------------------------


def reference(trace: list[BatchRequest], max_batch_size: int, mode: str) -> tuple[list, list, list]:
    """Static: each batch starts at the first step after the previous one where a request has arrived and
    takes as many waiting requests, in order, as fit; every row is held until the longest is done.
    Continuous: at each step, requests whose last token was made leave and waiting ones take the seats."""
    n = len(trace)
    start: list[int] = [-1] * n
    finish: list[int] = [-1] * n
    sizes: list[int] = []
    nxt = 0
    if mode == "static":
        end = -1
        while nxt < n:
            t = max(end + 1, trace[nxt].arrival)
            batch = []
            while nxt < n and trace[nxt].arrival <= t and len(batch) < max_batch_size:
                batch.append(nxt)
                nxt += 1
            end = t + max(trace[i].output_len for i in batch) - 1
            for i in batch:
                start[i], finish[i] = t, end
            sizes += [0] * (t - len(sizes)) + [len(batch)] * (end - t + 1)
    else:
        t = 0
        while nxt < n or (n > 0 and max(finish) >= t):
            seated = [i for i in range(nxt) if finish[i] >= t]
            while nxt < n and trace[nxt].arrival <= t and len(seated) < max_batch_size:
                start[nxt], finish[nxt] = t, t + trace[nxt].output_len - 1
                seated.append(nxt)
                nxt += 1
            sizes.append(len(seated))
            t += 1
    return start, finish, sizes


# -- properties of random traces ----------------------------------------------------------------------


@st.composite
def traces(draw, max_len=12):
    arrivals = sorted(draw(st.lists(st.integers(0, 20), max_size=max_len)))
    return [BatchRequest(a, draw(st.integers(1, 8))) for a in arrivals]


SEATS = st.integers(1, 5)


def occupancy(r: BatchingResult) -> list[int]:
    """Rows held at each step, counted from the start and finish of every request."""
    return [sum(s <= t <= f for s, f in zip(r.start, r.finish)) for t in range(r.num_steps)]


@settings(max_examples=400, deadline=None)
@given(traces(), SEATS, st.sampled_from(MODES))
def test_both_modes_agree_with_the_step_by_step_reference(trace, max_batch_size, mode):
    r = simulate_batching(trace, max_batch_size, mode)
    assert (r.start, r.finish, r.batch_sizes) == reference(trace, max_batch_size, mode)


@settings(max_examples=400, deadline=None)
@given(traces(), SEATS, st.sampled_from(MODES))
def test_properties_that_hold_in_both_modes(trace, max_batch_size, mode):
    """Starts at or after arrival and in arrival order; every token gets a step; the batch never holds
    more than max_batch_size rows; batch_sizes counts the rows held; the clock stops at the last return."""
    r = simulate_batching(trace, max_batch_size, mode)
    n = len(trace)
    assert len(r.start) == len(r.finish) == n
    for req, s, f in zip(trace, r.start, r.finish):
        assert s >= req.arrival
        assert f >= s + req.output_len - 1
    assert r.start == sorted(r.start)
    assert all(0 <= b <= max_batch_size for b in r.batch_sizes)
    assert r.batch_sizes == occupancy(r)
    assert r.num_steps == (max(r.finish) + 1 if n else 0)
    assert sum(r.batch_sizes) >= sum(req.output_len for req in trace)
    # a step is idle only when every request that has arrived has already been served
    for t, b in enumerate(r.batch_sizes):
        if b == 0:
            assert all(s <= t for req, s in zip(trace, r.start) if req.arrival <= t)
    assert r.latency(trace) == [f - req.arrival + 1 for req, f in zip(trace, r.finish)]


@settings(max_examples=400, deadline=None)
@given(traces(), SEATS)
def test_continuous_batching_computes_no_padding_and_leaves_no_seat_free_while_a_request_waits(
    trace, max_batch_size
):
    r = simulate_batching(trace, max_batch_size, "continuous")
    assert r.finish == [s + req.output_len - 1 for req, s in zip(trace, r.start)]
    assert sum(r.batch_sizes) == sum(req.output_len for req in trace)
    for t, b in enumerate(r.batch_sizes):
        arrived_and_waiting = [i for i, req in enumerate(trace) if req.arrival <= t and r.start[i] > t]
        assert b == max_batch_size or not arrived_and_waiting, (
            f"step {t}: a seat is free, {arrived_and_waiting} wait"
        )


@settings(max_examples=400, deadline=None)
@given(traces(), SEATS)
def test_a_static_batch_starts_together_and_is_returned_together_when_its_longest_request_is_done(
    trace, max_batch_size
):
    r = simulate_batching(trace, max_batch_size, "static")
    batches: dict[int, list[int]] = {}
    for i, s in enumerate(r.start):
        batches.setdefault(s, []).append(i)
    previous_end = -1
    for s, members in sorted(batches.items()):
        assert len(members) <= max_batch_size
        assert {r.finish[i] for i in members} == {s + max(trace[i].output_len for i in members) - 1}
        assert s > previous_end  # batches do not overlap
        previous_end = r.finish[members[0]]


@settings(max_examples=400, deadline=None)
@given(traces(), SEATS)
def test_continuous_batching_starts_and_returns_every_request_no_later_than_static_batching(
    trace, max_batch_size
):
    """Per request, not only on average. It holds in this model: when static starts a request at step t,
    every earlier request outside its batch was returned by static, hence by continuous, before t, so
    continuous has a free seat for it at t at the latest (by induction over the requests)."""
    s = simulate_batching(trace, max_batch_size, "static")
    c = simulate_batching(trace, max_batch_size, "continuous")
    assert all(cs <= ss for cs, ss in zip(c.start, s.start))
    assert all(cf <= sf for cf, sf in zip(c.finish, s.finish))
    assert c.num_steps <= s.num_steps
    assert sum(c.batch_sizes) <= sum(s.batch_sizes)


@settings(max_examples=200, deadline=None)
@given(traces())
def test_with_one_seat_static_and_continuous_batching_are_the_same(trace):
    s = simulate_batching(trace, 1, "static")
    c = simulate_batching(trace, 1, "continuous")
    assert (s.start, s.finish, s.batch_sizes) == (c.start, c.finish, c.batch_sizes)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(0, 12), SEATS)
def test_equal_lengths_arriving_together_give_the_same_schedule_in_both_modes(output_len, n, max_batch_size):
    trace = [BatchRequest(0, output_len)] * n
    s = simulate_batching(trace, max_batch_size, "static")
    c = simulate_batching(trace, max_batch_size, "continuous")
    assert (s.start, s.finish, s.batch_sizes) == (c.start, c.finish, c.batch_sizes)
    assert s.start == [(i // max_batch_size) * output_len for i in range(n)]
