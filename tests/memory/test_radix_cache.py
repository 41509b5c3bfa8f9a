"""The radix prefix cache: matching, insertion, locks, LRU eviction, and the allocator references it holds.

Most invariants are checked by a hypothesis state machine that drives the cache the way the engine
does (match, lock, incref, allocate, insert, free, unlock, evict) against a plain dict of cached
block-aligned prefixes, with both the pure-Python and the default (C++ when built) allocator.
"""

from __future__ import annotations

import doctest
import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import nanolab.memory.radix_cache
from nanolab import BlockAllocator, PyBlockAllocator
from nanolab.memory.radix_cache import PrefixCacheProtocol, PrefixCacheStats, RadixCache, RadixNode

ALLOCATORS = {"python": PyBlockAllocator, "default": BlockAllocator}


@pytest.fixture(params=sorted(ALLOCATORS))
def make_allocator(request):
    return ALLOCATORS[request.param]


# --- helpers: a view of the tree that uses only public attributes, and a dict oracle ------------------


def walk(cache: RadixCache) -> list[tuple[RadixNode, tuple[int, ...]]]:
    """Every node but the root with the full token prefix that ends at it, parents first."""
    out, stack = [], [(c, c.key) for c in cache.root.children.values()]
    while stack:
        node, prefix = stack.pop()
        out.append((node, prefix))
        stack.extend((c, prefix + c.key) for c in node.children.values())
    return out


def contents(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """Each cached block-aligned prefix -> the block id holding its last block."""
    bs, out = cache.block_size, {}
    for node, prefix in walk(cache):
        start = len(prefix) - len(node.key)
        for i, block in enumerate(node.blocks):
            out[prefix[: start + (i + 1) * bs]] = block
    return out


def oracle_match(oracle: dict, tokens: list[int], bs: int, limit: int) -> tuple[list[int], int]:
    """The longest prefix of ``tokens`` in ``oracle`` of at most ``limit`` tokens, and its blocks."""
    blocks: list[int] = []
    while (len(blocks) + 1) * bs <= limit and tuple(tokens[: (len(blocks) + 1) * bs]) in oracle:
        blocks.append(oracle[tuple(tokens[: (len(blocks) + 1) * bs])])
    return blocks, len(blocks) * bs


def match_limit(n: int, bs: int) -> int:
    return max(0, (n - 1) // bs * bs)


def check_structure(cache: RadixCache) -> None:
    """Sizes recomputed from the tree agree with the counters, and the tree is well formed."""
    bs = cache.block_size
    nodes = walk(cache)
    total = sum(len(n.key) for n, _ in nodes)
    protected = sum(len(n.key) for n, _ in nodes if n.lock_ref > 0)
    assert cache.evictable_size + cache.protected_size == cache.total_size == total
    assert cache.protected_size == protected
    assert cache.num_cached_blocks * bs == total and cache.num_nodes == len(nodes)
    all_blocks = [b for n, _ in nodes for b in n.blocks]
    assert len(all_blocks) == len(set(all_blocks)), "a block is cached twice"
    for node, _ in [(cache.root, ())] + nodes:
        for first, child in node.children.items():
            assert child.parent is node and child.key[:bs] == first
            assert len(child.key) == len(child.blocks) * bs > 0
        assert node.lock_ref >= sum(c.lock_ref for c in node.children.values())


def insert_fresh(cache: RadixCache, allocator, tokens: list[int]) -> tuple[int, list[int]]:
    """Insert ``tokens`` as a finished request would (fresh blocks, then free them); returns
    (insert's result, the request's blocks)."""
    blocks = allocator.allocate(len(tokens) // cache.block_size)
    cached = cache.insert(tokens, blocks)
    allocator.free(blocks)
    return cached, blocks


# --- worked examples ------------------------------------------------------------------------------


def test_radix_cache_satisfies_the_protocol(make_allocator):
    assert isinstance(RadixCache(make_allocator(4), block_size=2), PrefixCacheProtocol)


def test_the_module_docstring_examples_hold():
    result = doctest.testmod(nanolab.memory.radix_cache)
    assert result.attempted > 0 and result.failed == 0


def test_match_leaves_at_least_one_prompt_token_to_compute():
    a = PyBlockAllocator(8)
    cache = RadixCache(a, block_size=2)
    insert_fresh(cache, a, [1, 2, 3, 4])
    assert cache.match_prefix([1, 2, 3, 4]).num_tokens == 2  # the whole prompt is cached, but capped
    assert cache.match_prefix([1, 2, 3]).num_tokens == 2
    assert cache.match_prefix([1, 2, 3, 4, 5]).num_tokens == 4
    assert cache.match_prefix([1, 2]).num_tokens == 0
    empty = cache.match_prefix([])
    assert empty.blocks == [] and empty.num_tokens == 0 and empty.node is cache.root


def test_match_splits_a_node_when_it_ends_inside_an_edge():
    a = PyBlockAllocator(8)
    cache = RadixCache(a, block_size=2)
    _, blocks = insert_fresh(cache, a, [1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.num_nodes == 1
    m = cache.match_prefix([1, 2, 3, 4, 9, 9])
    assert m.blocks == blocks[:2] and m.num_tokens == 4
    assert cache.num_nodes == 2 and m.node.key == (1, 2, 3, 4)
    (lower,) = m.node.children.values()
    assert lower.key == (5, 6, 7, 8) and lower.blocks == blocks[2:]
    assert cache.total_size == 8 and cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0]).blocks == blocks


def test_a_lock_taken_before_a_split_still_covers_its_whole_path():
    a = PyBlockAllocator(8)
    cache = RadixCache(a, block_size=1)
    insert_fresh(cache, a, [1, 2, 3])
    m = cache.match_prefix([1, 2, 3, 0])
    cache.lock(m.node)
    cache.match_prefix([1, 9])  # splits the locked node after token 1
    assert cache.num_nodes == 2 and cache.protected_size == 3 and cache.evict(10) == 0
    cache.unlock(m.node)
    assert cache.protected_size == 0 and cache.evictable_size == 3


def test_insert_returns_the_cached_length_and_the_tree_increfs_only_the_new_part(make_allocator):
    a = make_allocator(16)
    cache = RadixCache(a, block_size=2)
    first = a.allocate(2)
    assert cache.insert([1, 2, 3, 4], first) == 0
    assert [a.ref_count(b) for b in first] == [2, 2]
    second = a.allocate(3)
    assert cache.insert([1, 2, 3, 4, 5, 6, 7], second) == 4  # the partial block [7] is not cached
    assert [a.ref_count(b) for b in second] == [1, 1, 2]  # duplicates stay the caller's alone
    a.free(first + second)
    assert a.num_free == 16 - 3 and cache.num_cached_blocks == 3
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 0]).blocks == [first[0], first[1], second[2]]


def test_insert_rejects_a_block_count_that_does_not_match_the_tokens():
    a = PyBlockAllocator(8)
    cache = RadixCache(a, block_size=2)
    blocks = a.allocate(3)
    with pytest.raises(ValueError, match="got 3 blocks for 5 tokens.*exactly 2"):
        cache.insert([1, 2, 3, 4, 5], blocks)
    assert cache.total_size == 0 and all(a.ref_count(b) == 1 for b in blocks)


def test_unlock_below_zero_raises_and_changes_nothing():
    a = PyBlockAllocator(8)
    cache = RadixCache(a, block_size=2)
    insert_fresh(cache, a, [1, 2, 3, 4, 5])
    m = cache.match_prefix([1, 2, 3, 4, 5])
    cache.lock(m.node)
    cache.unlock(m.node)
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(m.node)
    assert m.node.lock_ref == 0 and cache.root.lock_ref == 0 and cache.evictable_size == 4
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(cache.root)


def test_locking_an_evicted_node_raises():
    a = PyBlockAllocator(8)
    cache = RadixCache(a, block_size=2)
    insert_fresh(cache, a, [1, 2, 3])
    m = cache.match_prefix([1, 2, 3])
    assert cache.evict(1) == 1
    with pytest.raises(ValueError, match="evicted"):
        cache.lock(m.node)


def test_reset_refuses_while_locked_and_then_frees_every_block(make_allocator):
    a = make_allocator(8)
    cache = RadixCache(a, block_size=2)
    insert_fresh(cache, a, [1, 2, 3, 4, 5, 6])
    insert_fresh(cache, a, [1, 2, 7, 7])
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 0])
    cache.lock(m.node)
    cache.lock(m.node)
    with pytest.raises(RuntimeError, match=r"2 lock\(s\) are outstanding on 2 node\(s\)"):
        cache.reset()
    assert cache.total_size == 8 and a.num_free == 4
    cache.unlock(m.node)
    cache.unlock(m.node)
    cache.record(7, 6)
    cache.reset()
    assert a.num_free == 8 and cache.total_size == cache.num_nodes == 0
    assert cache.stats() == PrefixCacheStats()
    assert cache.match_prefix([1, 2, 3]).num_tokens == 0


def test_lru_evicts_the_least_recently_used_leaf_first():
    a = PyBlockAllocator(8)
    cache = RadixCache(a, block_size=2)
    for tokens in ([1, 1], [2, 2], [3, 3]):
        insert_fresh(cache, a, tokens)
    cache.match_prefix([1, 1, 0])  # [1, 1] is now the most recent; [2, 2] the least
    order = []
    for _ in range(3):
        before = set(contents(cache))
        assert cache.evict(1) == 1
        order.extend(before - set(contents(cache)))
    assert order == [(2, 2), (3, 3), (1, 1)]


def test_a_parent_becomes_evictable_only_once_its_children_are_gone():
    a = PyBlockAllocator(8)
    cache = RadixCache(a, block_size=2)
    insert_fresh(cache, a, [1, 2, 3, 4])
    insert_fresh(cache, a, [1, 2, 5, 6])  # splits: [1 2] -> {[3 4], [5 6]}
    assert cache.evict(1) == 1 and set(contents(cache)) == {(1, 2), (1, 2, 5, 6)}  # [3 4] is older
    assert cache.evict(1) == 1 and set(contents(cache)) == {(1, 2)}
    assert cache.evict(1) == 1 and cache.total_size == 0 and a.num_free == 8


def test_locked_paths_are_never_evicted():
    a = PyBlockAllocator(8)
    cache = RadixCache(a, block_size=2)
    insert_fresh(cache, a, [1, 2, 3, 4])
    insert_fresh(cache, a, [1, 2, 5, 6])
    m = cache.match_prefix([1, 2, 3, 4, 0])
    cache.lock(m.node)
    assert cache.evict(100) == 1  # only [5 6]; [1 2] is on the locked path
    assert set(contents(cache)) == {(1, 2), (1, 2, 3, 4)} and cache.evictable_size == 0
    cache.unlock(m.node)
    assert cache.evict(100) == 2 and a.num_free == 8


def test_evict_frees_whole_leaves_and_returns_the_blocks_freed():
    a = PyBlockAllocator(8)
    cache = RadixCache(a, block_size=1)
    insert_fresh(cache, a, [1, 2, 3])
    assert cache.evict(0) == 0 and cache.evict(1) == 3 and a.num_free == 8
    with pytest.raises(ValueError, match="negative"):
        cache.evict(-1)


def test_hit_rate_is_cached_prompt_tokens_over_prompt_tokens():
    cache = RadixCache(PyBlockAllocator(4), block_size=2)
    assert cache.stats().hit_rate == 0.0
    cache.record(10, 0)
    cache.record(6, 4)
    assert cache.stats() == PrefixCacheStats(num_requests=2, prompt_tokens=16, cached_tokens=4)
    assert cache.stats().hit_rate == 0.25
    with pytest.raises(ValueError, match="between 0 and prompt_tokens"):
        cache.record(3, 4)


def test_pretty_shows_each_edge_with_its_blocks_and_lock_count():
    a = PyBlockAllocator(8)
    cache = RadixCache(a, block_size=2)
    insert_fresh(cache, a, [1, 2, 3, 4])
    insert_fresh(cache, a, [1, 2, 5, 6])
    cache.lock(cache.match_prefix([1, 2, 3, 4, 0]).node)
    text = cache.pretty()
    assert "[1 2] blocks=[0] lock=1" in text and "[3 4] blocks=[1] lock=1" in text
    assert "[5 6] blocks=[3] lock=0" in text and "protected 4" in text and str(cache) == text
    long = RadixCache(a, block_size=2)
    insert_fresh(long, a, [1, 2, 3, 4, 5, 6])
    assert "[1 2|3 4 ... (+2)]" in long.pretty(max_tokens=4)
    assert repr(cache).startswith("RadixCache(block_size=2, nodes=3, total_size=6")


def test_bad_block_size_is_refused():
    with pytest.raises(ValueError, match="block_size must be positive"):
        RadixCache(PyBlockAllocator(4), block_size=0)


def test_the_lru_heap_stays_bounded_however_often_the_cache_is_matched():
    a = PyBlockAllocator(8)
    cache = RadixCache(a, block_size=1)
    insert_fresh(cache, a, [1, 2])
    insert_fresh(cache, a, [1, 3])
    for i in range(1000):
        cache.match_prefix([1, 2 + i % 2, 0])
    assert len(cache._heap) <= 2 * cache.num_nodes + 65


# --- properties -----------------------------------------------------------------------------------

tokens_st = st.lists(st.integers(0, 2), min_size=0, max_size=12)
# Room for every block the properties can hold at once: up to 8 inserts of 12 one-token blocks each cached,
# plus the blocks of the insert in progress (a pool of 64 ran out on 8 long distinct inserts).
POOL = 8 * 12 + 12


@settings(max_examples=150, deadline=None)
@given(bs=st.integers(1, 3), inserts=st.lists(tokens_st, max_size=8), queries=st.lists(tokens_st, max_size=8))
def test_match_and_insert_agree_with_a_dict_of_inserted_prefixes(bs, inserts, queries):
    """Small vocabularies make prefixes collide; the tree must act like the set of all inserted
    block-aligned prefixes, whatever splits happened on the way."""
    a = PyBlockAllocator(POOL)
    cache = RadixCache(a, block_size=bs)
    oracle: dict[tuple[int, ...], int] = {}
    for tokens in inserts:
        n = len(tokens) // bs
        _, expected = oracle_match(oracle, tokens, bs, n * bs)
        cached, blocks = insert_fresh(cache, a, tokens)
        assert cached == expected
        for i in range(expected // bs, n):
            oracle[tuple(tokens[: (i + 1) * bs])] = blocks[i]
    assert contents(cache) == oracle
    for tokens in queries + inserts:
        m = cache.match_prefix(tokens)
        assert (m.blocks, m.num_tokens) == oracle_match(oracle, tokens, bs, match_limit(len(tokens), bs))
        assert m.num_tokens <= max(0, len(tokens) - 1)
        check_structure(cache)
    assert {b for b in range(POOL) if a.ref_count(b)} == set(oracle.values())


@settings(max_examples=100, deadline=None)
@given(
    bs=st.integers(1, 3), inserts=st.lists(tokens_st, max_size=6), query=tokens_st, probes=st.lists(tokens_st)
)
def test_a_split_changes_neither_the_sizes_nor_any_match(bs, inserts, query, probes):
    a = PyBlockAllocator(POOL)
    cache = RadixCache(a, block_size=bs)
    for tokens in inserts:
        insert_fresh(cache, a, tokens)
    probes = probes + inserts
    before = [(m.blocks, m.num_tokens) for m in map(cache.match_prefix, probes)]
    sizes = (cache.total_size, cache.evictable_size, cache.protected_size, contents(cache))
    cache.match_prefix(query)  # may split
    assert (cache.total_size, cache.evictable_size, cache.protected_size, contents(cache)) == sizes
    assert [(m.blocks, m.num_tokens) for m in map(cache.match_prefix, probes)] == before


@settings(max_examples=100, deadline=None)
@given(bs=st.integers(1, 3), inserts=st.lists(tokens_st, min_size=1, max_size=6), locks=st.lists(tokens_st))
def test_lock_then_unlock_restores_every_counter(bs, inserts, locks):
    a = PyBlockAllocator(POOL)
    cache = RadixCache(a, block_size=bs)
    for tokens in inserts:
        insert_fresh(cache, a, tokens)
    nodes = [cache.match_prefix(t).node for t in locks]  # match first: its splits are not the point
    snapshot = (cache.total_size, cache.evictable_size, cache.protected_size)
    refs = {id(n): n.lock_ref for n, _ in walk(cache)}
    for node in nodes:
        cache.lock(node)
        check_structure(cache)
    assert cache.root.lock_ref == len(nodes)
    for node in reversed(nodes):
        cache.unlock(node)
    assert (cache.total_size, cache.evictable_size, cache.protected_size) == snapshot
    assert {id(n): n.lock_ref for n, _ in walk(cache)} == refs and cache.root.lock_ref == 0


# --- the engine's use, as a state machine ---------------------------------------------------------


@dataclass
class Request:
    tokens: list[int]
    node: RadixNode  # the locked end of its match
    blocks: list[int]  # its block table: matched blocks (increfed) then its own


class EngineLikeUse(RuleBasedStateMachine):
    """Drives the cache as the engine does and checks it against a dict of cached prefixes."""

    block_size = 2
    num_blocks = 20
    make_allocator = PyBlockAllocator

    def __init__(self) -> None:
        super().__init__()
        self.allocator = type(self).make_allocator(self.num_blocks)
        self.cache = RadixCache(self.allocator, self.block_size)
        self.oracle: dict[tuple[int, ...], int] = {}
        self.running: list[Request] = []

    def check_match(self, tokens: list[int]):
        m = self.cache.match_prefix(tokens)
        limit = match_limit(len(tokens), self.block_size)
        assert (m.blocks, m.num_tokens) == oracle_match(self.oracle, tokens, self.block_size, limit)
        assert m.num_tokens <= max(0, len(tokens) - 1)
        return m

    def evict_and_check(self, num_blocks: int) -> int:
        bs = self.block_size
        before = walk(self.cache)
        children = {id(n): list(n.children.values()) for n, _ in before}
        locks = {id(n): n.lock_ref for n, _ in before}
        evictable = self.cache.evictable_size // bs
        freed = self.cache.evict(num_blocks)
        kept = {id(n) for n, _ in walk(self.cache)}
        gone = [(n, p) for n, p in before if id(n) not in kept]
        assert sum(len(n.blocks) for n, _ in gone) == freed
        assert min(num_blocks, evictable) <= freed <= evictable
        for node, prefix in gone:  # only unlocked leaves (counting children evicted first) went
            assert locks[id(node)] == 0 and all(id(c) not in kept for c in children[id(node)])
            for end in range(len(prefix) - len(node.key) + bs, len(prefix) + 1, bs):
                del self.oracle[prefix[:end]]
        leaves = [n for n, _ in walk(self.cache) if not n.children and n.lock_ref == 0]
        if gone and leaves:  # least recently used first
            assert max(n.last_access for n, _ in gone) <= min(n.last_access for n in leaves)
        return freed

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=13))
    def start_request(self, tokens):
        m = self.check_match(tokens)
        self.cache.lock(m.node)
        self.allocator.incref(m.blocks)
        need = math.ceil(len(tokens) / self.block_size) - len(m.blocks)
        if need > self.allocator.num_free:
            self.evict_and_check(need - self.allocator.num_free)
        if need > self.allocator.num_free:  # the pool is too small even after eviction: give up
            assert self.cache.evictable_size == 0
            self.allocator.free(m.blocks)
            self.cache.unlock(m.node)
            return
        self.running.append(Request(tokens, m.node, m.blocks + self.allocator.allocate(need)))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish_request(self, data):
        bs = self.block_size
        r = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        n = len(r.tokens) // bs
        _, expected = oracle_match(self.oracle, r.tokens, bs, n * bs)
        assert self.cache.insert(r.tokens, r.blocks[:n]) == expected
        for i in range(expected // bs, n):
            self.oracle[tuple(r.tokens[: (i + 1) * bs])] = r.blocks[i]
        self.allocator.free(r.blocks)
        self.cache.unlock(r.node)

    @rule(tokens=st.lists(st.integers(0, 2), max_size=13))
    def match_only(self, tokens):
        self.check_match(tokens)

    @rule(num_blocks=st.integers(0, 6))
    def evict(self, num_blocks):
        self.evict_and_check(num_blocks)

    @precondition(lambda self: not self.running)
    @rule()
    def reset(self):
        self.cache.reset()
        self.oracle.clear()
        assert self.allocator.num_free == self.num_blocks

    @invariant()
    def tree_matches_the_oracle_and_the_counters(self):
        check_structure(self.cache)
        assert contents(self.cache) == self.oracle

    @invariant()
    def every_ref_count_is_the_tree_plus_the_running_requests(self):
        in_tree = set(self.oracle.values())
        for b in range(self.num_blocks):
            holders = (b in in_tree) + sum(r.blocks.count(b) for r in self.running)
            assert self.allocator.ref_count(b) == holders, f"block {b}"

    @invariant()
    def every_lock_count_is_the_running_requests_below_the_node(self):
        expected: dict[int, int] = {}
        for r in self.running:
            node = r.node
            while node is not None:
                expected[id(node)] = expected.get(id(node), 0) + 1
                node = node.parent
        for node, _ in walk(self.cache):
            assert node.lock_ref == expected.get(id(node), 0)
        assert self.cache.root.lock_ref == len(self.running)

    def teardown(self):
        while self.running:
            r = self.running.pop()
            self.allocator.free(r.blocks)
            self.cache.unlock(r.node)
        self.cache.reset()
        assert self.allocator.num_free == self.num_blocks


class EngineLikeUseBlockSize1(EngineLikeUse):
    block_size = 1
    num_blocks = 24
    make_allocator = BlockAllocator


class EngineLikeUseBlockSize3(EngineLikeUse):
    block_size = 3
    num_blocks = 12
    make_allocator = BlockAllocator


_machine_settings = settings(max_examples=75, stateful_step_count=40, deadline=None)
TestEngineLikeUse = EngineLikeUse.TestCase
TestEngineLikeUse.settings = _machine_settings
TestEngineLikeUseBlockSize1 = EngineLikeUseBlockSize1.TestCase
TestEngineLikeUseBlockSize1.settings = _machine_settings
TestEngineLikeUseBlockSize3 = EngineLikeUseBlockSize3.TestCase
TestEngineLikeUseBlockSize3.settings = _machine_settings
