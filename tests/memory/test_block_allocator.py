"""The KV block allocator: its contract, and the C++ class held identical to its pure-Python twin."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanolab import BlockAllocatorProtocol, OutOfBlocksError, PyBlockAllocator

_C = pytest.importorskip("nanolab._C", reason="the C++ extension is not built")

IMPLS = {"python": PyBlockAllocator, "cpp": _C.BlockAllocator}


@pytest.fixture(params=sorted(IMPLS))
def make(request):
    return IMPLS[request.param]


def state(a) -> tuple:
    return a.num_free, a.num_total, tuple(a.free_list()), tuple(a.ref_count(i) for i in range(a.num_total))


def test_both_satisfy_the_protocol(make):
    assert isinstance(make(3), BlockAllocatorProtocol)


def test_allocate_hands_out_distinct_blocks_with_ref_count_one(make):
    a = make(8)
    got = a.allocate(3) + a.allocate(5)
    assert sorted(got) == list(range(8))
    assert all(a.ref_count(b) == 1 for b in got)
    assert a.num_free == 0 and a.num_total == 8
    assert a.allocate(0) == []


def test_a_block_is_free_again_only_after_its_last_holder_frees_it(make):
    a = make(4)
    (b,) = a.allocate(1)
    a.incref([b])
    a.incref([b])
    assert a.ref_count(b) == 3
    a.free([b])
    a.free([b])
    assert a.ref_count(b) == 1 and a.num_free == 3
    a.free([b])
    assert a.ref_count(b) == 0 and a.num_free == 4


def test_freed_blocks_are_reused_last(make):
    a = make(4)
    first = a.allocate(2)
    a.free(first)
    assert a.allocate(4) == [2, 3, *first]


def test_over_allocation_raises_and_changes_nothing(make):
    a = make(4)
    a.allocate(3)
    before = state(a)
    with pytest.raises(OutOfBlocksError, match=r"cannot allocate 2 blocks: only 1 of 4 are free"):
        a.allocate(2)
    assert state(a) == before


@pytest.mark.parametrize(
    ("op", "arg", "match"),
    [
        ("free", [1], "double free of block 1"),
        ("free", [0, 0], "double free of block 0"),
        ("free", [0, 7], r"block id 7 is out of range \[0, 4\)"),
        ("free", [-1], r"block id -1 is out of range \[0, 4\)"),
        ("incref", [2], "cannot incref block 2: it is free"),
        ("incref", [0, 4], r"block id 4 is out of range"),
        ("allocate", -1, "cannot allocate a negative number of blocks"),
        ("ref_count", 4, r"block id 4 is out of range"),
    ],
)
def test_bad_calls_name_the_bad_value_and_change_nothing(make, op, arg, match):
    a = make(4)
    a.allocate(1)  # block 0 is held once
    before = state(a)
    with pytest.raises(ValueError, match=match):
        getattr(a, op)(arg)
    assert state(a) == before


@pytest.mark.parametrize("n", [0, -3])
def test_non_positive_pool_size_is_rejected(make, n):
    with pytest.raises(ValueError, match=f"num_blocks must be positive, got {n}"):
        make(n)


# --- differential: the C++ class and the twin, driven by the same random operations -------------

N_BLOCKS = 6
ids = st.integers(min_value=-2, max_value=N_BLOCKS + 1)  # includes out-of-range ids on purpose
ops = st.one_of(
    st.tuples(st.just("allocate"), st.integers(min_value=-1, max_value=N_BLOCKS + 1)),
    st.tuples(st.just("free"), st.lists(ids, max_size=4)),
    st.tuples(st.just("incref"), st.lists(ids, max_size=4)),
    st.tuples(st.just("ref_count"), ids),
)


def apply(a, op, arg):
    try:
        return ("ok", getattr(a, op)(arg))
    except Exception as exc:  # noqa: BLE001 - the error itself is what is compared
        return ("error", type(exc), str(exc))


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, min_size=1, max_size=40))
def test_cpp_and_python_agree_on_every_operation_sequence(sequence):
    """Same results, same errors (type and message) and same state after every single operation."""
    py, cpp = PyBlockAllocator(N_BLOCKS), _C.BlockAllocator(N_BLOCKS)
    for op, arg in sequence:
        assert apply(py, op, arg) == apply(cpp, op, arg), (op, arg)
        assert state(py) == state(cpp)
