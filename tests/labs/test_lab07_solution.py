"""Lab 7's solution against nanolab: its docstring examples, and its engine on the toy parts step by step
against nanolab's `EngineCore` (random mixes with stop strings, preemption and aborts)."""

from __future__ import annotations

import doctest
import random
from pathlib import Path

from helpers.grading_utils import solution_namespace

from nanolab.engine.core import EngineCore

LAB07 = Path(__file__).resolve().parents[2] / "solutions" / "lab07_engine.ipynb"
STOPS = ["\n\n", "#", "é", "€x", "😀", " = 1", "ab", "b#", "!", "#!", "é!", "xy", "##"]


def test_lab07_docstring_examples_run_on_the_solution():
    namespace = solution_namespace(LAB07.name)
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner()
    names = ("layout_batch", "check_stop", "held_back", "IncrementalDetokenizer")
    tests = [t for name in names for t in finder.find(namespace[name], name, globs=namespace)]
    assert sum(len(t.examples) for t in tests) >= 8
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


def test_lab07_solution_serves_like_nanolabs_core():
    namespace = solution_namespace(LAB07.name)
    run_engine = namespace["run_engine"]
    rng = random.Random(3)
    seen = {"stop": 0, "length": 0, "preemptions": 0, "aborted": 0}
    for _ in range(60):
        requests = [
            dict(
                id=f"r{i}",
                prompt=[rng.randint(1, 25) for _ in range(rng.randint(1, 20))],
                max_tokens=rng.randint(1, 30),
                stop=rng.sample(STOPS, rng.randint(0, 3)) or None,
                stop_token_ids=rng.sample(range(1, 40), rng.randint(0, 2)) or None,
                ignore_eos=rng.random() < 0.3,
                arrival=rng.randint(0, 10),
            )
            for i in range(rng.randint(1, 12))
        ]
        bs = rng.choice([1, 2, 4, 8])
        settings = dict(
            num_blocks=64 // bs + rng.choice([0, 4, 40]),
            block_size=bs,
            max_num_seqs=rng.randint(1, 6),
            max_num_batched_tokens=rng.choice([4, 8, 16, 64]),
            max_model_len=rng.choice([24, 48, 64]),
        )
        aborts = {rng.randint(0, 15): [rng.choice(requests)["id"]]} if rng.random() < 0.5 else {}
        mine = run_engine(namespace["Engine"], requests, settings, aborts)
        theirs = run_engine(EngineCore, requests, settings, aborts)
        assert mine == theirs
        assert theirs["free_blocks"] == theirs["total_blocks"] and not theirs["unfinished"]
        for step in theirs["steps"]:
            for out in step:
                if out["finished"]:
                    seen[out["reason"]] += 1
        seen["preemptions"] += theirs["preemptions"]
        seen["aborted"] += sum(a is not None for a in theirs["aborted"])
    assert min(seen.values()) > 0, seen  # the mixes covered every way a request ends, and preemption
