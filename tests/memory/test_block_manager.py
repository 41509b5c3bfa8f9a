"""Sharing blocks between sequences: `BlockManager.fork`, `copy_on_write` and `PagedKVCache.copy_blocks`.

The invariants: a block's ref count equals the number of block tables that list it (no prefix cache
here), a block is free exactly when nothing holds it, and a sequence reads back exactly the tokens it
wrote, whatever its siblings wrote after a fork.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanolab import PyBlockAllocator
from nanolab.memory.block_manager import BlockManager
from nanolab.memory.paged_attention import write_kv
from nanolab.memory.paged_kv_cache import PagedKVCache, SeqSlice
from nanolab.memory.paging import cdiv, slot_mapping
from nanolab.model.attention import dense_causal_attention
from nanolab.model.config import ModelConfig


@dataclass
class Seq:
    """A `PagedSequence` without a prompt: what the manager needs to grow, fork and release."""

    block_table: list[int] = field(default_factory=list)
    prefix_node: Any = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    tokens: list[int] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.tokens

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.tokens)


def holders(seqs: list[Seq], num_blocks: int) -> list[int]:
    counts = [0] * num_blocks
    for s in seqs:
        for b in s.block_table:
            counts[b] += 1
    return counts


def assert_ref_counts_equal_holders(manager: BlockManager, seqs: list[Seq]) -> None:
    alloc = manager.allocator
    counts = holders(seqs, alloc.num_total)
    assert [alloc.ref_count(b) for b in range(alloc.num_total)] == counts
    assert sorted(alloc.free_list()) == [b for b, c in enumerate(counts) if c == 0]


def computed(manager: BlockManager, seq: Seq, n: int) -> None:
    """Grow ``seq`` by ``n`` tokens and mark them computed (what an engine step does)."""
    assert manager.grow(seq, n)
    seq.num_computed_tokens += n


def test_fork_shares_every_block_and_counts_both_holders():
    manager = BlockManager(PyBlockAllocator(8), block_size=4)
    parent, child = Seq(), Seq()
    computed(manager, parent, 6)  # blocks [0, 1], the second half full
    manager.fork(parent, child)
    assert child.block_table == parent.block_table == [0, 1]
    assert child.block_table is not parent.block_table
    assert child.num_computed_tokens == 6
    assert_ref_counts_equal_holders(manager, [parent, child])
    assert manager.allocator.num_free == 6  # nothing was allocated by the fork


def test_a_shared_block_outlives_the_holder_that_lets_go_first():
    manager = BlockManager(PyBlockAllocator(8), block_size=4)
    parent, child = Seq(), Seq()
    computed(manager, parent, 6)
    manager.fork(parent, child)
    manager.release(parent)
    assert parent.block_table == []
    assert_ref_counts_equal_holders(manager, [parent, child])
    assert all(manager.allocator.ref_count(b) == 1 for b in child.block_table)
    manager.release(child)
    assert manager.allocator.num_free == 8


def test_fork_into_a_sequence_that_holds_blocks_is_refused_and_changes_nothing():
    manager = BlockManager(PyBlockAllocator(8), block_size=4)
    parent, child = Seq(), Seq()
    computed(manager, parent, 5)
    computed(manager, child, 1)
    with pytest.raises(ValueError, match="holds 1 blocks; release it first"):
        manager.fork(parent, child)
    assert child.block_table == [2] and child.num_computed_tokens == 1
    assert_ref_counts_equal_holders(manager, [parent, child])


def test_copy_on_write_copies_the_shared_partly_filled_last_block_only():
    manager = BlockManager(PyBlockAllocator(8), block_size=4)
    parent, child = Seq(), Seq()
    computed(manager, parent, 6)
    manager.fork(parent, child)
    assert manager.grow(child, 1)  # token 6 goes into block 1, which has room
    pairs = manager.copy_on_write(child)
    assert pairs == [(1, 2)]
    assert child.block_table == [0, 2] and parent.block_table == [0, 1]
    assert_ref_counts_equal_holders(manager, [parent, child])
    assert manager.copy_on_write(child) == []  # block 2 is its own now
    assert manager.copy_on_write(parent) == []  # and block 1 is the parent's alone


def test_copy_on_write_at_a_block_boundary_copies_nothing():
    manager = BlockManager(PyBlockAllocator(8), block_size=4)
    parent, child = Seq(), Seq()
    computed(manager, parent, 8)  # two full blocks
    manager.fork(parent, child)
    assert manager.grow(child, 1)  # token 8 opens a fresh, private block
    assert manager.copy_on_write(child) == []
    assert child.block_table[:2] == parent.block_table
    assert_ref_counts_equal_holders(manager, [parent, child])


def test_copy_on_write_of_a_chunk_copies_every_shared_block_it_touches():
    manager = BlockManager(PyBlockAllocator(12), block_size=4)
    parent, child = Seq(), Seq()
    computed(manager, parent, 2)
    assert manager.grow(parent, 8)  # room for 10 tokens: 3 blocks, the last two still empty
    manager.fork(parent, child)
    pairs = manager.copy_on_write(child, 8)  # tokens 2..9 land in all three blocks
    assert [src for src, _ in pairs] == parent.block_table
    assert [dst for _, dst in pairs] == child.block_table
    assert_ref_counts_equal_holders(manager, [parent, child])


def test_copy_on_write_without_free_blocks_returns_none_and_changes_nothing():
    manager = BlockManager(PyBlockAllocator(2), block_size=4)
    parent, child = Seq(), Seq()
    computed(manager, parent, 6)  # both blocks
    manager.fork(parent, child)
    assert manager.copy_on_write(child) is None
    assert child.block_table == parent.block_table == [0, 1]
    assert_ref_counts_equal_holders(manager, [parent, child])


def test_copy_blocks_copies_keys_and_values_in_every_layer_and_nothing_else():
    config = ModelConfig(n_layers=3, n_heads=2, n_kv_heads=1, d_model=8)
    cache = PagedKVCache(config, num_blocks=5, block_size=2)
    g = torch.Generator().manual_seed(0)
    for t in (*cache.k, *cache.v):
        t.copy_(torch.randn(t.shape, generator=g))
    before = [t.clone() for t in (*cache.k, *cache.v)]
    cache.copy_blocks([(1, 3), (4, 0)])
    for t, old in zip((*cache.k, *cache.v), before):
        assert torch.equal(t[3], old[1]) and torch.equal(t[0], old[4])
        assert torch.equal(t[[1, 2, 4]], old[[1, 2, 4]])
    cache.copy_blocks([])  # nothing to do
    for bad, match in [([(5, 1)], "src block 5"), ([(0, -1)], "dst block -1"), ([(0, 1), (2, 1)], "twice")]:
        with pytest.raises(ValueError, match=match):
            cache.copy_blocks(bad)


def test_copy_blocks_reads_every_source_before_writing():
    config = ModelConfig(n_layers=1, n_heads=1, n_kv_heads=1, d_model=2)
    cache = PagedKVCache(config, num_blocks=3, block_size=1)
    cache.k[0].copy_(torch.arange(3.0)[:, None, None, None].expand(3, 1, 1, 2))
    cache.copy_blocks([(0, 1), (1, 2)])  # a chain: block 2 gets block 1's old contents
    assert cache.k[0][:, 0, 0, 0].tolist() == [0.0, 0.0, 1.0]


def test_forked_samples_attend_over_their_own_tokens_and_the_parent_is_untouched():
    """Two samples of one prompt through a paged cache: shared prompt blocks, private last block."""
    config = ModelConfig(n_layers=2, n_heads=4, n_kv_heads=2, d_model=32)
    bs, nh, nkv, hs = 4, 4, 2, 8
    manager = BlockManager(PyBlockAllocator(10), bs)
    cache = PagedKVCache(config, 10, bs, attention_backend="torch")
    g = torch.Generator().manual_seed(1)
    prompt = [torch.randn(6, n, hs, generator=g) for n in (nh, nkv, nkv)]  # q, k, v of a 6-token prompt
    parent = Seq()
    assert manager.grow(parent, 6)
    positions = cache.prepare([SeqSlice(parent.block_table, 0, 6)])
    assert positions.tolist() == list(range(6))
    for layer in range(2):
        cache.attend(layer, *prompt)
    parent.num_computed_tokens = 6
    parent_kv = [t[parent.block_table].clone() for t in (*cache.k, *cache.v)]

    samples = []
    for _ in range(2):
        child = Seq()
        manager.fork(parent, child)
        samples.append((child, [torch.randn(3, n, hs, generator=g) for n in (nh, nkv, nkv)]))
    for step in range(3):  # three decode steps for both children, in one batch
        slices = []
        for child, _ in samples:
            assert manager.grow(child, 1)
            cache.copy_blocks(manager.copy_on_write(child))
            slices.append(SeqSlice(child.block_table, child.num_computed_tokens, 1))
        cache.prepare(slices)
        q, k, v = (torch.cat([new[i][step : step + 1] for _, new in samples]) for i in range(3))
        out = cache.attend(0, q, k, v)
        for b, (child, new) in enumerate(samples):
            full = [torch.cat([prompt[i], new[i][: step + 1]]) for i in range(3)]
            want = dense_causal_attention(*full)[-1]
            assert torch.allclose(out[b], want, atol=1e-5)
            child.num_computed_tokens += 1
    assert parent.num_computed_tokens == 6
    for t, old in zip((*cache.k, *cache.v), parent_kv):
        assert torch.equal(t[parent.block_table], old)  # the parent's tokens, untouched
    assert_ref_counts_equal_holders(manager, [parent] + [c for c, _ in samples])
    assert samples[0][0].block_table[0] == samples[1][0].block_table[0] == parent.block_table[0]
    assert len({c.block_table[1] for c, _ in samples} | {parent.block_table[1]}) == 3


# --- random sequences of fork / grow / write / release -------------------------------------------------

NUM_BLOCKS, BS = 10, 3
operations = st.lists(
    st.tuples(
        st.sampled_from(["start", "fork", "write", "release"]),
        st.integers(min_value=0, max_value=5),  # which sequence (modulo the live ones)
        st.integers(min_value=1, max_value=5),  # how many tokens
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations)
def test_random_fork_grow_write_release_keeps_counts_and_every_sequences_tokens(ops):
    """After every step: ref counts equal holders, free blocks are the unheld ones, and every sequence
    reads back through its table exactly the tokens it wrote (its siblings' writes never show)."""
    config = ModelConfig(n_layers=1, n_heads=1, n_kv_heads=1, d_model=2)
    manager = BlockManager(PyBlockAllocator(NUM_BLOCKS), BS)
    cache = PagedKVCache(config, NUM_BLOCKS, BS)
    live: list[tuple[Seq, list[float]]] = []  # each sequence and the token values it wrote
    counter = 0.0
    for op, which, n in ops:
        if op == "start" or not live:
            live.append((Seq(), []))
            which, op = len(live) - 1, "write"
        seq, tokens = live[which % len(live)]
        if op == "fork":
            child = Seq()
            manager.fork(seq, child)
            live.append((child, list(tokens)))
        elif op == "release":
            manager.release(seq)
            del live[which % len(live)]
        else:
            before = (list(seq.block_table), manager.allocator.free_list())
            if not manager.grow(seq, n):
                assert (seq.block_table, manager.allocator.free_list()) == before
                continue
            before = (list(seq.block_table), manager.allocator.free_list())
            pairs = manager.copy_on_write(seq, n)
            if pairs is None:  # out of blocks: nothing changed (grow's new blocks stay for a later try)
                assert (seq.block_table, manager.allocator.free_list()) == before
                continue
            cache.copy_blocks(pairs)
            values = [counter + i for i in range(n)]
            counter += n
            slots = torch.tensor(
                slot_mapping(seq.block_table, seq.num_computed_tokens, seq.num_computed_tokens + n, BS)
            )
            kv = torch.tensor(values)[:, None, None].expand(n, 1, 2)
            write_kv(cache.k[0], cache.v[0], slots, kv, kv)
            seq.num_computed_tokens += n
            tokens += values
        seqs = [s for s, _ in live]
        assert_ref_counts_equal_holders(manager, seqs)
        for s, toks in live:
            assert len(s.block_table) >= cdiv(s.num_computed_tokens, BS)
            got = cache.k[0].view(-1, 1, 2)[slot_mapping(s.block_table, 0, len(toks), BS), 0, 0]
            assert got.tolist() == toks
