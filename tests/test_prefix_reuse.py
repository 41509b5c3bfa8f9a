"""What a prefix cache of whole blocks can serve (`reusable_prefix`), and Lab 6's solution against nanolab's
radix cache: its docstring examples, `reusable_prefix` and `RadixCache` through the same replay."""

from __future__ import annotations

import doctest
import random
from pathlib import Path

from grading_utils import solution_namespace
from hypothesis import given
from hypothesis import strategies as st

from nanolab import PyBlockAllocator
from nanolab.memory.prefix_cache import reusable_prefix
from nanolab.memory.radix_cache import RadixCache

LAB06 = Path(__file__).resolve().parents[1] / "solutions" / "lab06_radix_cache.ipynb"


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


def _lab06() -> dict:
    return solution_namespace(LAB06.name)


def test_lab06_docstring_examples_run_on_the_solution():
    namespace = _lab06()
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner()
    tests = [
        t
        for name in ("reusable_prefix", "RadixCache")
        for t in finder.find(namespace[name], name, globs=namespace)
    ]
    assert sum(len(t.examples) for t in tests) >= 10
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


def test_lab06_solution_replays_like_nanolabs_cache():
    namespace = _lab06()
    rng = random.Random(4)
    for _ in range(60):
        bs, nb = rng.choice([1, 2, 4]), rng.randint(8, 40)
        base = [rng.randint(1, 3) for _ in range(48)]
        ops, live = [], []
        for i in range(60):
            if rng.random() < 0.5 or not live:
                ops.append(("request", f"q{i}", base[rng.choice([0, 0, 3]) :][: rng.randint(1, 30)]))
                live.append(f"q{i}")
            elif rng.random() < 0.8:
                ops.append(("finish", live.pop(rng.randrange(len(live)))))
            else:
                ops.append(("evict", rng.randint(0, 6)))
        replay = namespace["replay_cache"]
        mine = replay(namespace["RadixCache"](namespace["BlockAllocator"](nb), bs), ops)
        theirs = replay(RadixCache(PyBlockAllocator(nb), bs), ops)
        assert [r[:2] if r[0] == "error" else r for r in mine] == [
            r[:2] if r[0] == "error" else r for r in theirs
        ]
