"""Scheduler and engine invariants, checked after every step of random workloads; admission errors."""

from __future__ import annotations

from collections import Counter

import pytest
from engine_utils import random_prompts, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanolab.engine.engine import Engine, EngineConfig
from nanolab.engine.request import RequestStatus
from nanolab.model.sampling import SamplingParams

VOCAB = 64
MODEL = tiny_model("llama", seed=2, vocab_size=VOCAB, max_seq_len=128)


class Watched:
    """Runs an engine step by step and checks the invariants after each step."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.outputs = []
        sched = engine.scheduler
        self.last = None
        original = sched.schedule

        def schedule():
            self.last = original()
            return self.last

        sched.schedule = schedule

    def step(self) -> None:
        engine = self.engine
        sched = engine.scheduler
        decoding_before = [r for r in sched.running if not r.is_prefilling]
        self.outputs += engine.step()
        out = self.last
        cfg = engine.config
        # the step's budget and the cap on running requests
        assert out.num_tokens <= cfg.max_num_batched_tokens
        assert len(sched.running) <= cfg.max_num_seqs
        # decodes come first in the batch, and every request that was decoding was scheduled
        kinds = [s.num_new_tokens == 1 for s in out.scheduled]
        assert kinds == sorted(kinds, reverse=True) or not any(kinds)
        scheduled = {id(s.request) for s in out.scheduled}
        for r in decoding_before:
            if r not in out.preempted:
                assert id(r) in scheduled, f"decode of request {r.request_id} was starved"
        self.check_ref_counts()

    def check_ref_counts(self) -> None:
        """A block's ref count equals its number of holders: running requests and the prefix cache."""
        kv = self.engine.block_manager
        holders = Counter(b for r in self.engine.scheduler.running for b in r.block_table)
        if kv.prefix_cache is not None:
            holders.update(b for node in kv.prefix_cache._nodes() for b in node.blocks)
        alloc = kv.allocator
        for b in range(alloc.num_total):
            assert alloc.ref_count(b) == holders[b], (
                f"block {b}: ref count {alloc.ref_count(b)}, holders {holders[b]}"
            )
        cache = kv.prefix_cache
        if cache is not None:
            assert cache.evictable_size + cache.protected_size == cache.total_size

    def run(self) -> None:
        while self.engine.has_unfinished():
            self.step()


workloads = st.fixed_dictionaries(
    {
        "n": st.integers(1, 10),
        "seed": st.integers(0, 1000),
        "budget": st.integers(8, 80),
        "max_num_seqs": st.integers(1, 8),
        "block_size": st.sampled_from([1, 2, 4, 8]),
        "spare_blocks": st.integers(0, 40),
        "chunked": st.booleans(),
        "prefix": st.booleans(),
        "policy": st.sampled_from(["fcfs", "priority", "shortest"]),
    }
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads)
def test_invariants_hold_at_every_step_of_random_workloads(w):
    """Budget, max_num_seqs, decodes-first, no starved decode, ref counts == holders; all blocks free at the end."""
    prompts = random_prompts(w["n"], VOCAB, 1, 40, seed=w["seed"], shared=8 if w["seed"] % 2 else 0)
    lengths = [1 + (w["seed"] + 3 * i) % 12 for i in range(w["n"])]
    longest = max(len(p) + n for p, n in zip(prompts, lengths))
    bs = w["block_size"]
    config = EngineConfig(
        block_size=bs,
        num_blocks=-(-longest // bs) + w["spare_blocks"],
        max_num_seqs=w["max_num_seqs"],
        max_num_batched_tokens=max(w["budget"], longest) if not w["chunked"] else w["budget"],
        enable_chunked_prefill=w["chunked"],
        enable_prefix_caching=w["prefix"],
        scheduling_policy=w["policy"],
    )
    engine = Engine(MODEL, None, config)
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), priority=i % 3)
    watched = Watched(engine)
    watched.run()
    finished = [o for o in watched.outputs if o.finished]
    assert sorted(int(o.request_id) for o in finished) == list(range(w["n"]))
    assert all(
        len(o.outputs[0].token_ids) == n
        for o, n in zip(sorted(finished, key=lambda o: int(o.request_id)), lengths)
    )
    if engine.block_manager.prefix_cache is not None:
        engine.block_manager.prefix_cache.reset()
    alloc = engine.block_manager.allocator
    assert alloc.num_free == alloc.num_total


def test_priority_aging_eventually_admits_a_low_priority_request():
    """One slot, a constant stream of priority-0 requests: the priority-5 request still gets in."""
    engine = Engine(
        MODEL, None, EngineConfig(max_num_seqs=1, scheduling_policy="priority", enable_prefix_caching=False)
    )
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    low = engine.add_request([1, 2, 3], params, priority=5)
    steps = 0
    while not low.is_finished:
        if len(engine.scheduler.waiting) < 3:
            engine.add_request([4, 5, 6], params, priority=0)
        engine.step()
        steps += 1
        assert steps < 500, "the low-priority request starved"
    # it did have to wait behind higher-priority requests
    assert low.admitted_seq > 1


def test_without_aging_priority_order_is_strict():
    engine = Engine(
        MODEL, None, EngineConfig(max_num_seqs=1, scheduling_policy="priority", enable_prefix_caching=False)
    )
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    reqs = [engine.add_request([7, 8], params, priority=p) for p in (3, 1, 2)]
    while engine.has_unfinished():
        engine.step()
    assert [r.admitted_seq for r in reqs] == [3, 1, 2]


def test_shortest_prompt_first_admits_short_prompts_first():
    engine = Engine(
        MODEL, None, EngineConfig(max_num_seqs=1, scheduling_policy="shortest", enable_prefix_caching=False)
    )
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    reqs = [engine.add_request(list(range(1, n + 1)), params) for n in (30, 5, 12)]
    while engine.has_unfinished():
        engine.step()
    assert [r.admitted_seq for r in reqs] == [3, 1, 2]


def test_preemption_picks_the_lowest_priority_then_latest_admitted():
    """Tight pool: the request with the worst priority is the one preempted."""
    engine = Engine(
        MODEL,
        None,
        EngineConfig(block_size=2, num_blocks=12, enable_prefix_caching=False, scheduling_policy="priority"),
    )
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    reqs = [engine.add_request([1, 2, 3, 4], params, priority=p) for p in (0, 2, 1)]
    first_victim = None
    while engine.has_unfinished():
        engine.step()
        if first_victim is None:
            first_victim = next((r for r in reqs if r.num_preemptions), None)
    assert first_victim is reqs[1]


@pytest.mark.parametrize(
    ("prompt", "params", "kwargs", "match"),
    [
        ([], SamplingParams(), {}, "the prompt is an empty list of token ids"),
        ([1] * 120, SamplingParams(max_tokens=16), {}, r"136 > max_model_len 128; shorten the prompt"),
        (
            [1] * 10,
            SamplingParams(max_tokens=30),
            dict(num_blocks=4, block_size=8),
            "needs up to 5 KV blocks",
        ),
        (
            [1] * 40,
            SamplingParams(),
            dict(enable_chunked_prefill=False, max_num_batched_tokens=32),
            "without chunked",
        ),
        ([1, VOCAB], SamplingParams(), {}, f"token id {VOCAB} is outside the vocabulary"),
    ],
)
def test_impossible_requests_are_rejected_at_add_request(prompt, params, kwargs, match):
    engine = Engine(MODEL, None, EngineConfig(**kwargs))
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished()


def test_abort_frees_the_requests_blocks():
    engine = Engine(MODEL, None, EngineConfig(block_size=4, enable_prefix_caching=False))
    req = engine.add_request(
        list(range(1, 20)), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    )
    engine.step()
    engine.step()
    assert req.block_table and engine.block_manager.allocator.num_free < engine.config.num_blocks
    out = engine.abort(req.request_id)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert req.status is RequestStatus.FINISHED
    assert engine.block_manager.allocator.num_free == engine.config.num_blocks
    assert not engine.has_unfinished()


def test_stop_token_ids_and_max_tokens_set_the_finish_reason():
    engine = Engine(MODEL, None, EngineConfig())
    probe = engine.add_request([5, 6, 7], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert probe.finish_reason.value == "length" and len(probe.output_token_ids) == 6
    third = probe.output_token_ids[2]
    stopped = engine.add_request(
        [5, 6, 7], SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[third])
    )
    while engine.has_unfinished():
        engine.step()
    assert stopped.finish_reason.value == "stop"
    assert stopped.output_token_ids == probe.output_token_ids[: probe.output_token_ids.index(third) + 1]
