"""The fragmentation simulator: worked examples by hand, and random streams against a slot-by-slot oracle."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanolab.memory.fragmentation import STRATEGIES, SimRequest, SimResult, simulate
from nanolab.memory.paging import cdiv


def oracle(requests: list[SimRequest], num_slots: int, strategy: str, block_size: int, max_len: int):
    """The same simulation done the slow, obvious way: a list of owners, scanned slot by slot."""
    owner: list[int | None] = [None] * num_slots
    live: set[int] = set()
    for i, r in enumerate(requests):
        for j in sorted(live):
            if requests[j].arrival + requests[j].lifetime <= r.arrival:
                live.discard(j)
                owner = [None if o == j else o for o in owner]
        if strategy == "paged":
            free = [b for b in range(num_slots // block_size) if owner[b * block_size] is None]
            n = cdiv(r.length, block_size)
            need = n * block_size
            slots = (
                [b * block_size + o for b in free[:n] for o in range(block_size)] if n <= len(free) else None
            )
        else:
            need = max_len if strategy == "reserve-max" else r.length
            start = next(
                (s for s in range(num_slots - need + 1) if all(o is None for o in owner[s : s + need])), None
            )
            slots = None if start is None else list(range(start, start + need))
        if slots is None:
            free_slots = owner.count(None)
            return owner, live, free_slots if free_slots >= need else 0, i
        for s in slots:
            owner[s] = i
        live.add(i)
    return owner, live, 0, None


def test_reserve_max_holds_max_len_per_request_and_fails_when_no_region_is_left():
    stream = [SimRequest(0, 5, 10), SimRequest(1, 3, 1), SimRequest(2, 4, 10), SimRequest(3, 7, 10)]
    r = simulate(stream, 16, "reserve-max", max_len=8)
    assert r.owner == [0] * 8 + [2] * 8  # request 1 left at time 2, before request 2 came
    assert (r.live, r.used, r.allocated, r.internal_waste) == (2, 9, 16, 7)
    assert (r.first_failure, r.external_waste) == (3, 0)


def test_exact_first_fit_fails_on_a_hole_pattern_even_with_enough_free_slots():
    stream = [SimRequest(0, 4, 5), SimRequest(0, 4, 100), SimRequest(0, 4, 5), SimRequest(0, 4, 100)]
    stream += [SimRequest(6, 6, 100)]  # 8 slots free at time 6, in two holes of 4
    r = simulate(stream, 16, "exact", max_len=8)
    assert r.owner == [None] * 4 + [1] * 4 + [None] * 4 + [3] * 4
    assert (r.live, r.used, r.allocated) == (2, 8, 8)
    assert (r.first_failure, r.external_waste) == (4, 8)
    paged = simulate(stream, 16, "paged", block_size=2, max_len=8)
    assert paged.first_failure is None and paged.external_waste == 0
    assert paged.owner == [4, 4, 4, 4, 1, 1, 1, 1, 4, 4, None, None, 3, 3, 3, 3]


def test_a_request_goes_to_the_lowest_hole_that_fits():
    stream = [SimRequest(0, 2, 1), SimRequest(0, 3, 9), SimRequest(0, 4, 1), SimRequest(0, 1, 9)]
    stream += [SimRequest(1, 3, 9)]  # holes at 0..1 (2 slots) and 5..8 (4 slots): the first fit is 5
    r = simulate(stream, 12, "exact", max_len=4)
    assert r.owner == [None, None, 1, 1, 1, 4, 4, 4, None, 3, None, None]


def test_paged_waste_is_the_tail_of_each_last_block():
    stream = [SimRequest(0, n, math.inf) for n in (50, 16, 1, 33)]
    r = simulate(stream, 256, "paged", block_size=16, max_len=64)
    assert r.allocated == 64 + 16 + 16 + 48 and r.used == 100
    assert r.internal_waste == 14 + 0 + 15 + 15  # at most block_size - 1 per request


def test_every_request_placed_reports_no_failure_and_an_empty_stream_an_empty_pool():
    assert simulate([], 8, "paged", block_size=4) == SimResult([None] * 8, 0, 0, 0, 0, None)
    r = simulate([SimRequest(0, 8, 1)], 8, "exact", max_len=8)
    assert r.first_failure is None and r.owner == [0] * 8 and r.utilization == 1.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(strategy="buddy"), "strategy must be one of"),
        (dict(strategy="paged", block_size=3), "not a multiple of block_size 3"),
        (
            dict(requests=[SimRequest(0, 9, 1)]),
            r"request 0 has length 9; lengths must be in \[1, max_len=8\]",
        ),
        (dict(requests=[SimRequest(0, 0, 1)]), "request 0 has length 0"),
        (dict(requests=[SimRequest(2, 1, 1), SimRequest(1, 1, 1)]), "request 1 arrives before request 0"),
    ],
)
def test_bad_input_is_refused_with_a_message_naming_it(kwargs, match):
    args = dict(requests=[SimRequest(0, 1, 1)], num_slots=16, strategy="exact", max_len=8) | kwargs
    with pytest.raises(ValueError, match=match):
        simulate(**args)


requests = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=3), st.integers(min_value=1, max_value=12), st.integers(0, 8)
    ),
    max_size=25,
)


@settings(max_examples=300, deadline=None)
@given(requests, st.sampled_from(STRATEGIES), st.sampled_from([1, 2, 4, 8]), st.integers(2, 6))
def test_random_streams_match_the_slot_by_slot_oracle(gaps, strategy, block_size, pool_blocks):
    t, stream = 0, []
    for gap, length, lifetime in gaps:
        t += gap
        stream.append(SimRequest(t, length, lifetime if lifetime < 8 else math.inf))
    num_slots = pool_blocks * 8
    got = simulate(stream, num_slots, strategy, block_size=block_size, max_len=12)
    owner, live, external, failure = oracle(stream, num_slots, strategy, block_size, 12)
    assert got.owner == owner
    assert (got.live, got.first_failure, got.external_waste) == (len(live), failure, external)
    assert got.used == sum(stream[j].length for j in live)
    assert got.allocated == num_slots - owner.count(None)
    if strategy == "paged":
        assert got.external_waste == 0 and got.internal_waste <= (block_size - 1) * got.live
