"""Lab 6's solution against nanolab: its docstring examples, and `reusable_prefix` and `RadixCache` through
the same replay as nanolab's radix cache."""

from __future__ import annotations

import doctest
import random
from pathlib import Path

from helpers.grading_utils import solution_namespace

from nanolab import PyBlockAllocator
from nanolab.memory.radix_cache import RadixCache

LAB06 = Path(__file__).resolve().parents[2] / "solutions" / "lab06_radix_cache.ipynb"


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
