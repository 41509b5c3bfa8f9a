"""Scheduler and engine invariants, checked after every step of random workloads; admission errors; the
waiting order of each policy, aging, and the choice of a preemption victim."""

from __future__ import annotations

from collections import Counter

import pytest
from helpers.engine_utils import random_prompts, tiny_model
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nanolab import LLM, PyBlockAllocator
from nanolab.engine.config import SchedulingPolicy
from nanolab.engine.engine import Engine, EngineConfig
from nanolab.engine.request import Request, RequestStatus
from nanolab.engine.scheduler import Scheduler, choose_victim, importance, waiting_order
from nanolab.memory.block_manager import BlockManager
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
        # the scheduler fills a step with the decodes of running requests first (the engine, not the
        # scheduler, then lays out every one-token entry first), and no request that was decoding starves
        # A request preempted in this step is no longer decoding: it may be admitted again in the same step,
        # behind other work, to recompute what it lost.
        decoding = {id(r) for r in decoding_before if r not in out.preempted}
        firsts = [id(s.request) in decoding for s in out.scheduled]
        assert firsts == sorted(firsts, reverse=True), "a decode was scheduled after other work"
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
# a decode that preempts itself for want of a block is admitted again in the same step, behind a prefill chunk
@example(
    dict(
        n=6,
        seed=0,
        budget=8,
        max_num_seqs=3,
        block_size=1,
        spare_blocks=0,
        chunked=True,
        prefix=False,
        policy="fcfs",
    )
)
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


# -- the waiting order, the choice of victim and admission errors, without a model ----------------------


def req(name, prompt_len=3, *, priority=0, arrival_time=0.0, arrival_step=0, seq=None) -> Request:
    r = Request(
        name,
        [1] * prompt_len,
        SamplingParams(),
        priority=priority,
        arrival_time=arrival_time,
        arrival_step=arrival_step,
    )
    r.admitted_seq = seq
    return r


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


@pytest.mark.parametrize("policy", ["fcfs", SchedulingPolicy.FCFS])
def test_fcfs_orders_by_arrival_time_only(policy):
    a = req("a", 50, priority=9, arrival_time=1.0)
    b = req("b", 1, priority=0, arrival_time=2.0)
    c = req("c", 9, priority=5, arrival_time=0.5)
    assert ids(waiting_order([a, b, c], policy, now=100, aging_steps=1)) == ["c", "a", "b"]


def test_waiting_order_returns_a_new_list_and_leaves_its_input_alone():
    waiting = [req("late", arrival_time=2.0), req("early", arrival_time=1.0)]
    ordered = waiting_order(waiting, "fcfs", now=0, aging_steps=16)
    assert ids(ordered) == ["early", "late"]
    assert ids(waiting) == ["late", "early"]
    assert waiting_order([], "priority", now=0, aging_steps=16) == []


@pytest.mark.parametrize("policy", ["priority", SchedulingPolicy.PRIORITY])
def test_priority_orders_by_lower_value_first_then_by_arrival_time(policy):
    waiting = [
        req("p2", priority=2, arrival_time=0.0),
        req("p0-late", priority=0, arrival_time=3.0),
        req("p1", priority=1, arrival_time=1.0),
        req("p0-early", priority=0, arrival_time=2.0),
        req("neg", priority=-1, arrival_time=9.0),
    ]
    # everyone arrived now: no aging
    order = waiting_order(waiting, policy, now=0, aging_steps=16)
    assert ids(order) == ["neg", "p0-early", "p0-late", "p1", "p2"]


@pytest.mark.parametrize("aging_steps", [1, 3, 16])
def test_aging_moves_a_request_up_one_level_per_whole_aging_steps_waited(aging_steps):
    """An old request of priority 1 against a new one of priority 0 that arrived earlier in time (so a tie
    goes to the new one): one level of aging makes a tie, the second puts the old one ahead."""
    old = req("old", priority=1, arrival_time=5.0, arrival_step=10)
    order = {}
    for waited in range(3 * aging_steps + 1):
        now = 10 + waited
        new = req("new", priority=0, arrival_time=1.0, arrival_step=now)
        order[waited] = ids(waiting_order([old, new], "priority", now=now, aging_steps=aging_steps))[0]
    assert all(order[w] == "new" for w in range(2 * aging_steps))
    assert all(order[w] == "old" for w in range(2 * aging_steps, 3 * aging_steps + 1))


@pytest.mark.parametrize("aging_steps", [1, 4, 20])
def test_aging_counts_whole_levels_only(aging_steps):
    """Waiting aging_steps - 1 steps is not yet a level up (floor division); exactly aging_steps steps is."""
    old = req("old", priority=1, arrival_time=1.0, arrival_step=0)  # arrived first: wins a tie
    for now, first in [(aging_steps - 1, "new"), (aging_steps, "old"), (2 * aging_steps - 1, "old")]:
        new = req("new", priority=0, arrival_time=2.0, arrival_step=now)
        order = waiting_order([old, new], "priority", now=now, aging_steps=aging_steps)
        assert ids(order)[0] == first, f"after {now} steps waited"


def test_the_waiting_order_docstring_example():
    old = req("old", 9, priority=2, arrival_time=0.0)
    new = req("new", 3, priority=0, arrival_time=1.0, arrival_step=30)
    assert ids(waiting_order([old, new], "priority", now=30, aging_steps=20)) == ["new", "old"]
    assert ids(waiting_order([old, new], "priority", now=60, aging_steps=20)) == ["old", "new"]


@pytest.mark.parametrize("policy", ["shortest", SchedulingPolicy.SHORTEST])
def test_shortest_orders_by_tokens_left_to_compute_then_by_arrival_time(policy):
    five = req("five", 5, arrival_time=0.0)
    two_late = req("two-late", 2, arrival_time=4.0)
    two_early = req("two-early", 2, arrival_time=3.0)
    cached = req("cached", 10, arrival_time=1.0)
    cached.num_computed_tokens = 7  # the prefix cache served 7 of its 10 tokens: 3 left
    resumed = req("resumed", 1, arrival_time=2.0, priority=-5)
    resumed.output_token_ids += [4, 4, 4, 4, 4]  # preempted: prompt and output to recompute, 6 tokens
    order = waiting_order([five, two_late, two_early, cached, resumed], policy, now=0, aging_steps=16)
    assert ids(order) == ["two-early", "two-late", "cached", "five", "resumed"]


@pytest.mark.parametrize("policy", ["lifo", "", "FCFS"])
def test_an_unknown_policy_raises_value_error_naming_the_policies(policy):
    with pytest.raises(ValueError, match=r"unknown scheduling policy .*'fcfs', 'priority', 'shortest'"):
        waiting_order([req("a")], policy, now=0, aging_steps=16)


@pytest.mark.parametrize("aging_steps", [0, -3])
def test_priority_with_aging_steps_below_one_raises_value_error(aging_steps):
    with pytest.raises(ValueError, match=f"aging_steps must be at least 1, got {aging_steps}"):
        waiting_order([req("a"), req("b")], "priority", now=5, aging_steps=aging_steps)


def test_the_victim_is_the_lowest_priority_then_the_latest_admitted():
    needy = req("needy", priority=0, seq=1)
    b = req("b", priority=2, seq=2)
    c = req("c", priority=2, seq=3)
    d = req("d", priority=1, seq=9)
    running = [needy, b, c, d]
    assert choose_victim(running, scheduled=[], needy=needy) is c
    assert choose_victim(running, scheduled=[c], needy=needy) is b
    # a higher priority value loses even against a later admission
    assert choose_victim(running, scheduled=[b, c], needy=needy) is d


def test_the_victim_is_never_a_request_already_in_this_step():
    needy, a, b = req("needy", seq=1), req("a", seq=2), req("b", seq=3)
    assert choose_victim([needy, a, b], scheduled=[b], needy=needy) is a


def test_when_every_other_running_request_is_scheduled_the_needy_request_gives_way():
    needy = req("needy", priority=0, seq=1)
    others = [req("a", priority=5, seq=2), req("b", priority=9, seq=3)]
    assert choose_victim([needy, *others], scheduled=others, needy=needy) is needy
    assert choose_victim([needy], scheduled=[], needy=needy) is needy


def test_when_the_needy_request_is_the_least_important_it_gives_way_itself():
    a, b = req("a", priority=0, seq=1), req("b", priority=1, seq=2)
    low = req("low", priority=3, seq=3)
    assert choose_victim([a, b, low], scheduled=[], needy=low) is low
    # same priority: the latest admitted is the least important
    x, y = req("x", priority=1, seq=1), req("y", priority=1, seq=2)
    assert choose_victim([x, y], scheduled=[], needy=y) is y
    assert choose_victim([x, y], scheduled=[], needy=x) is y


def test_the_choice_of_victim_does_not_depend_on_the_order_of_the_running_list():
    rs = [req(str(i), priority=i % 3, seq=i) for i in range(1, 8)]  # priority 2: requests 2 and 5
    needy, five = rs[0], rs[4]
    assert choose_victim(rs, scheduled=[], needy=needy).request_id == "5"
    assert choose_victim(rs[::-1], scheduled=[], needy=needy).request_id == "5"
    assert choose_victim(rs, scheduled=[five], needy=needy).request_id == "2"
    assert choose_victim(rs[::-1], scheduled=[five], needy=needy).request_id == "2"


def test_importance_sorts_by_priority_then_admission():
    rs = [req("a", priority=1, seq=1), req("b", priority=0, seq=3), req("c", priority=0, seq=2)]
    assert ids(sorted(rs, key=importance)) == ["c", "b", "a"]


def scheduler(cls: type[Scheduler] = Scheduler, cached: bool = False, **config) -> Scheduler:
    """A scheduler on a pool of plain blocks, no model needed (the config is given resolved); with ``cached``,
    its block manager has nanolab's radix prefix cache."""
    from nanolab.memory.radix_cache import RadixCache

    cfg = EngineConfig(**{"max_num_batched_tokens": 64, "num_blocks": 16, "block_size": 4, **config})
    allocator = PyBlockAllocator(cfg.num_blocks)
    cache = RadixCache(allocator, cfg.block_size) if cached else None
    return cls(cfg, BlockManager(allocator, cfg.block_size, cache))


def test_without_chunked_prefill_a_prompt_over_the_token_budget_is_refused():
    sched = scheduler(enable_chunked_prefill=False, max_num_batched_tokens=16, num_blocks=64)
    with pytest.raises(ValueError, match=r"request 'big' has 17 tokens .* max_num_batched_tokens=16"):
        sched.add(req("big", 17))
    assert sched.waiting == [] and not sched.has_unfinished()
    sched.add(req("fits", 16))  # exactly the budget is fine
    assert ids(sched.waiting) == ["fits"]


def test_with_chunked_prefill_a_prompt_over_the_token_budget_is_accepted():
    sched = scheduler(enable_chunked_prefill=True, max_num_batched_tokens=16, num_blocks=64)
    sched.add(req("big", 40))
    assert ids(sched.waiting) == ["big"]


@pytest.mark.parametrize("chunked", [True, False])
def test_a_prompt_needing_more_kv_blocks_than_the_pool_has_is_refused(chunked):
    sched = scheduler(enable_chunked_prefill=chunked, max_num_batched_tokens=256, block_size=4, num_blocks=4)
    with pytest.raises(
        ValueError, match=r"request 'huge' needs 5 KV blocks for its 17 tokens .* num_blocks=4"
    ):
        sched.add(req("huge", 17))
    assert sched.waiting == []
    sched.add(req("fits", 16))  # 4 blocks: the whole pool
    assert ids(sched.waiting) == ["fits"]


def test_the_generated_tokens_count_towards_the_limits():
    sched = scheduler(enable_chunked_prefill=False, max_num_batched_tokens=16, num_blocks=64)
    r = req("resumed", 10)
    r.output_token_ids += [1] * 7
    with pytest.raises(ValueError, match="17 tokens"):
        sched.add(r)


def test_an_added_request_is_stamped_with_the_current_step():
    sched = scheduler()
    sched.add(req("first"))
    assert sched.waiting[0].arrival_step == 0
    sched.schedule()
    sched.schedule()
    second = req("second", arrival_step=99)
    sched.add(second)
    assert second.arrival_step == 2


def test_the_scheduler_admits_waiting_requests_in_the_policy_order():
    sched = scheduler(max_num_seqs=1, scheduling_policy="shortest")
    for name, n in [("long", 12), ("short", 2), ("mid", 5)]:
        sched.add(req(name, n))
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("short", 2)]
    assert sched.running[0].status is RequestStatus.RUNNING
    assert ids(sched.waiting) == ["mid", "long"]


def test_without_chunked_prefill_no_request_outgrows_the_step_budget():
    """A preempted request is recomputed in one step, prompt and output: without chunked prefill the
    engine caps a request at max_num_batched_tokens, so a preempted one always fits again (uncapped, a
    request preempted with more tokens than the budget could never be admitted again)."""
    llm = LLM(MODEL, None, enable_chunked_prefill=False, enable_prefix_caching=False, block_size=4,
              num_blocks=3, max_num_seqs=2, max_num_batched_tokens=8)  # fmt: skip
    assert llm.engine.config.max_model_len == 8
    with pytest.raises(ValueError, match="at most max_num_batched_tokens"):
        llm.generate([[5, 6], [7, 8]], SamplingParams(max_tokens=14, temperature=0, ignore_eos=True))
    outs = llm.generate([[5, 6], [7, 8]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    assert llm.stats().preemptions > 0, (
        "two requests of 2 blocks each in a pool of 3 should force a preemption"
    )
    with pytest.raises(ValueError, match="max_model_len 16 is more than max_num_batched_tokens 8"):
        LLM(MODEL, None, enable_chunked_prefill=False, max_num_batched_tokens=8, max_model_len=16)


# -- shared prefixes computed once


def _cached_scheduler(cls: type[Scheduler] = Scheduler) -> Scheduler:
    return scheduler(cls, cached=True, max_num_batched_tokens=256, num_blocks=64)


def _prompt_req(name: str, tokens: list[int]) -> Request:
    return Request(name, list(tokens), SamplingParams(max_tokens=4))


def test_a_prompt_whose_prefix_is_being_computed_waits_and_those_behind_it_do_not():
    sched = _cached_scheduler()
    system = list(range(1, 21))  # 5 whole blocks
    a, b = _prompt_req("a", system + [30, 31]), _prompt_req("b", system + [40])
    c = _prompt_req("c", [50, 51, 52, 53, 54, 55])  # shares nothing
    for r in (a, b, c):
        sched.add(r)
    first = [(s.request.request_id, s.num_new_tokens) for s in sched.schedule().scheduled]
    assert first == [("a", 22), ("c", 6)]  # b waits for a's prompt; c, behind it, is admitted
    assert ids(sched.waiting) == ["b"]
    # the engine computes a's prompt and caches it (as EngineCore does once a prompt is done)
    for r in (a, c):
        r.num_computed_tokens = r.num_tokens
        r.output_token_ids.append(7)
        sched.block_manager.cache_computed(r)
    second = {s.request.request_id: s.num_new_tokens for s in sched.schedule().scheduled}
    assert second["b"] == 1  # its 20 shared tokens come from the cache: only its own token is computed
    assert b.num_cached_tokens == 20


def test_a_prompt_already_cached_or_sharing_less_than_a_block_does_not_wait():
    sched = _cached_scheduler()
    a = _prompt_req("a", [1, 2, 3, 9, 9, 9])
    b = _prompt_req("b", [1, 2, 3, 8, 8, 8])  # shares 3 tokens: less than a whole block
    sched.add(a)
    sched.add(b)
    assert ids(s.request for s in sched.schedule().scheduled) == ["a", "b"]
    # a prompt whose shared blocks the cache already holds is admitted beside the one computing more of it
    sched = _cached_scheduler()
    old = _prompt_req("old", list(range(1, 10)))
    sched.add(old)
    sched.schedule()
    old.num_computed_tokens = old.num_tokens
    old.output_token_ids.append(7)
    sched.block_manager.cache_computed(old)
    new1 = _prompt_req("n1", list(range(1, 9)) + [60, 61, 62, 63, 64])
    new2 = _prompt_req("n2", list(range(1, 9)) + [70])
    sched.add(new1)
    sched.add(new2)
    got = {s.request.request_id: s.num_new_tokens for s in sched.schedule().scheduled}
    assert got == {"old": 1, "n1": 5, "n2": 1}  # both served 8 cached tokens; neither waits for the other


def test_shared_prefixes_are_computed_once_with_the_outputs_of_no_cache():
    model = tiny_model()
    system = random_prompts(1, 96, 40, 40, seed=3)[0]
    prompts = [system + p for p in random_prompts(12, 96, 3, 9, seed=4)]
    params = SamplingParams(max_tokens=6, temperature=0)
    settings = dict(block_size=4, num_blocks=200, max_num_seqs=8)
    plain = LLM(model, None, enable_prefix_caching=False, **settings).generate(
        prompts, params, use_tqdm=False
    )
    llm = LLM(model, None, **settings)
    cached = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in plain]
    # every request after the first is served the system prompt's 10 whole blocks from the cache
    assert llm.stats().prefix_cached_tokens == 11 * 40


def test_static_batching_never_waits_for_a_prefix():
    from nanolab.engine.scheduler import StaticBatchScheduler

    sched = _cached_scheduler(StaticBatchScheduler)
    for name in "ab":
        sched.add(_prompt_req(name, list(range(1, 13))))
    assert ids(s.request for s in sched.schedule().scheduled) == ["a", "b"]  # one batch, as it forms
