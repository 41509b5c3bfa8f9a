"""What a prefix cache of whole blocks can serve (`reusable_prefix`), and Lab 6's solution against nanolab's
radix cache."""

from __future__ import annotations

import random
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from nanolab import PyBlockAllocator
from nanolab.memory.prefix_cache import reusable_prefix
from nanolab.memory.radix_cache import RadixCache

LAB06 = Path(__file__).resolve().parents[2] / "solutions" / "lab06_radix_cache.ipynb"


@given(st.lists(st.integers(1, 3), max_size=40), st.lists(st.integers(1, 3), max_size=40), st.integers(1, 8))
def test_reusable_prefix_is_whole_blocks_of_the_common_prefix_and_never_the_whole_prompt(prompt, cached, bs):
    got = reusable_prefix(prompt, cached, bs)
    assert got % bs == 0 and prompt[:got] == cached[:got]
    assert got <= max(0, len(prompt) - 1)
    # the largest such: one more block would break one of the rules
    more = got + bs
    assert more > len(prompt) - 1 or prompt[:more] != cached[:more]


def test_a_radix_cache_serves_what_reusable_prefix_says():
    rng = random.Random(0)
    for _ in range(100):
        bs = rng.choice([1, 2, 4])
        first = [rng.randint(1, 3) for _ in range(rng.randint(1, 30))]
        second = first[: rng.randint(0, len(first))] + [rng.randint(1, 3) for _ in range(rng.randint(0, 10))]
        if not second:
            continue
        allocator = PyBlockAllocator(64)
        cache = RadixCache(allocator, bs)
        blocks = allocator.allocate(len(first) // bs)
        cache.insert(first, blocks)
        assert cache.match_prefix(second).num_tokens == reusable_prefix(second, first, bs)
