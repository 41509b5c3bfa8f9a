"""Lab 5's solution against nanolab: its docstring examples, and `chunk_mask`, `plan_prefill` and the
chunking Scheduler on random inputs."""

from __future__ import annotations

import doctest
import random
from pathlib import Path

import torch
from helpers.engine_utils import random_plans
from helpers.grading_utils import solution_namespace

import nanolab
from autograder.authoring.scheduling.replay import reference_request
from labkit.lab05 import replay_schedule
from nanolab.engine.config import EngineConfig
from nanolab.engine.scheduler import Scheduler
from nanolab.memory.block_manager import BlockManager
from nanolab.model.attention import chunk_mask

ROOT = Path(__file__).resolve().parents[2]
LAB05 = ROOT / "solutions" / "lab05_chunked_prefill.ipynb"


def _lab05() -> dict:
    return solution_namespace(LAB05.name)


def test_lab05_docstring_examples_run_on_the_solution():
    namespace = _lab05()
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner()
    names = ("chunk_mask", "plan_prefill", "Scheduler")
    tests = [
        t for name in names for t in finder.find(namespace[name], name, globs=dict(namespace)) if t.examples
    ]
    assert len(tests) == len(names)
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


def test_lab05_solution_is_the_reference_on_random_inputs():
    namespace = _lab05()
    rng = random.Random(3)
    for _ in range(50):
        start, num_new = rng.randint(0, 200), rng.randint(0, 50)
        assert torch.equal(namespace["chunk_mask"](start, num_new), chunk_mask(start, num_new))
    for lens, decodes, budget, order, chunk, plan in random_plans(100):
        assert namespace["plan_prefill"](lens, decodes, budget, order, chunk) == plan
    events = []
    for i in range(30):
        events += [("step",)] * rng.randint(0, 2) + [
            ("add", f"r{i}", rng.randint(1, 90), rng.randint(1, 12), 0, float(i))
        ]
    events += [("step",)] * 200
    for chunked in (True, False):
        budget = 24 if chunked else 96
        settings = dict(max_num_seqs=5, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
        theirs = replay_schedule(
            Scheduler(
                EngineConfig(
                    block_size=4, num_blocks=40, max_model_len=512, enable_prefix_caching=False, **settings
                ),
                BlockManager(nanolab.PyBlockAllocator(40), 4),
            ),
            events,
            reference_request,
        )
        config = namespace["SchedulerConfig"](**settings)
        manager = namespace["BlockManager"](namespace["BlockAllocator"](40), 4)
        mine = namespace["replay_schedule"](namespace["Scheduler"](config, manager), events)
        assert mine == theirs
