"""Labs 4 and 5's setup code (`labkit.lab04`, `labkit.lab05`, the setup cells' text) against nanolab: its
types mirror the reference's, and nanolab's Scheduler runs the setup's own requests exactly as its own."""

from __future__ import annotations

import dataclasses
import random

import pytest

import nanolab
from autograder.authoring.scheduling.replay import reference_request
from labkit import lab04, lab05
from nanolab.engine.config import EngineConfig
from nanolab.engine.request import FinishReason, Request, RequestStatus
from nanolab.engine.scheduler import Scheduler, SchedulerOutput
from nanolab.memory.block_manager import BlockManager
from nanolab.model.sampling import SamplingParams

SETUPS = pytest.mark.parametrize("setup", [lab04, lab05], ids=["lab04", "lab05"])


@SETUPS
def test_the_setup_types_have_the_reference_fields_and_values(setup):
    """Every field of the setup's Request is one nanolab's Request has, the enums have nanolab's values,
    SchedulerOutput has nanolab's fields, and SchedulerConfig's fields are EngineConfig's."""
    reference = Request("r", [1, 2], SamplingParams())
    for f in dataclasses.fields(setup.Request):
        assert hasattr(reference, f.name), f"the setup's Request has {f.name}, nanolab's has not"
    assert {s.value for s in setup.RequestStatus} == {s.value for s in RequestStatus}
    assert {r.value for r in setup.FinishReason} <= {r.value for r in FinishReason}
    names = {f.name for f in dataclasses.fields(setup.SchedulerOutput)}
    assert names == {f.name for f in dataclasses.fields(SchedulerOutput)}
    assert {f.name for f in dataclasses.fields(setup.SchedulerConfig)} <= {
        f.name for f in dataclasses.fields(EngineConfig)
    }


@SETUPS
def test_the_parallel_sampling_members_default_to_not_used(setup):
    """The members nanolab's scheduler reads for parallel sampling and prompt logprobs are there, with the
    defaults that mean "not used", as nanolab's plain greedy request has them."""
    mine = setup.Request("r", [1, 2])
    reference = Request("r", [1, 2], SamplingParams())
    for name in ("group", "samples_to_fork", "wants_prompt_logprobs"):
        assert getattr(mine, name) == getattr(reference, name), name
    assert setup.SchedulerOutput().blocks_to_copy == []


@SETUPS
@pytest.mark.parametrize("chunked", [False, True])
def test_nanolabs_scheduler_runs_the_setups_requests_as_its_own(setup, chunked):
    """The setup's replay_schedule around nanolab's Scheduler gives the same records with the setup's own
    requests (the default) as with nanolab's: the scheduler needs nothing of a request beyond its fields."""
    rng = random.Random(5)
    events = []
    for i in range(40):
        events += [("step",)] * rng.randint(0, 2)
        events.append(("add", f"r{i}", rng.randint(1, 40), rng.randint(5, 30), rng.randint(0, 2), float(i)))
        if i % 7 == 6:
            events.append(("abort", f"r{rng.randrange(i)}"))
    events += [("step",)] * 150

    def scheduler() -> Scheduler:
        config = EngineConfig(block_size=4, num_blocks=20, max_model_len=256, max_num_seqs=6,
                              max_num_batched_tokens=64, enable_chunked_prefill=chunked,
                              enable_prefix_caching=False, scheduling_policy="priority", aging_steps=3)  # fmt: skip
        return Scheduler(config, BlockManager(nanolab.PyBlockAllocator(20), 4))

    theirs = setup.replay_schedule(scheduler(), events, reference_request)
    mine = setup.replay_schedule(scheduler(), events)
    assert any(r[0] == "step" and r[2] for r in theirs), "the workload should preempt someone"
    assert mine == theirs
