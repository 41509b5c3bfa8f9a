"""Parallel sampling (``SamplingParams.n > 1``): the prompt is computed once, the samples share its KV
blocks (copy-on-write for the last partial block), and each sample is exactly what a request of its own
with seed ``seed + i`` would generate — under chunked prefill, prefix caching and preemption."""

from __future__ import annotations

import pytest
from helpers.engine_utils import random_prompts, tiny_model

from nanolab.engine.engine import Engine
from nanolab.engine.llm import LLM
from nanolab.engine.request import Request
from nanolab.engine.scheduler import Scheduler
from nanolab.model.sampling import SamplingParams

VOCAB = 96


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=4, vocab_size=VOCAB, max_seq_len=320)


def sampled(max_tokens: int, seed: int | None = 11, n: int = 1, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, n=n, ignore_eos=True, **kw)


def blocks_all_back(llm: LLM) -> bool:
    s = llm.stats()
    engine = llm.engine  # nothing left behind in the engine's or the scheduler's bookkeeping either
    forgotten = not (engine.requests or engine.groups or engine._with_extras or len(engine.outputs))
    return s.kv_blocks_free + s.kv_blocks_cached == s.kv_blocks_total and forgotten


def test_n_samples_compute_the_prompt_once_and_use_fewer_blocks(model):
    prompt = random_prompts(1, VOCAB, 200, 200, seed=1)[0]
    T = 12
    together = LLM(model, block_size=16, enable_prefix_caching=False, max_num_seqs=8)
    out = together.generate([prompt], sampled(T, n=8), use_tqdm=False)[0]
    apart = LLM(model, block_size=16, enable_prefix_caching=False, max_num_seqs=8)
    alone = apart.generate([prompt] * 8, [sampled(T, seed=11 + i) for i in range(8)], use_tqdm=False)

    s, a = together.stats(), apart.stats()
    # the prompt's 200 tokens once, then every sample's T - 1 decodes (its first token comes from the prompt)
    assert s.batched_tokens == 200 + 8 * (T - 1)
    assert a.batched_tokens == 8 * 200 + 8 * (T - 1)
    # 16-token blocks: the prompt's 12 full blocks are shared; each sample holds its own copy of the 13th
    # (copy-on-write) and a 14th for its last tokens. Apart, each request holds all 14 of its own.
    assert round(s.peak_kv_block_usage * s.kv_blocks_total) == 12 + 8 * 2
    assert round(a.peak_kv_block_usage * a.kv_blocks_total) == 8 * 14
    assert [o.index for o in out.outputs] == list(range(8))
    assert [o.token_ids for o in out.outputs] == [o.outputs[0].token_ids for o in alone]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # the seeds do give different samples
    assert out.metrics.num_output_tokens == 8 * T and out.finished
    assert blocks_all_back(together)


@pytest.mark.parametrize(
    "settings",
    [
        dict(block_size=4),  # the prompts end inside a block: the samples share it until they write
        dict(block_size=8, max_num_batched_tokens=16),  # chunked prefill
        dict(block_size=4, enable_prefix_caching=False),
        dict(block_size=4, num_blocks=40, max_num_batched_tokens=64),  # too few blocks: preemption
    ],
    ids=["shared-tail", "chunked", "no-prefix-cache", "preempted"],
)
def test_each_sample_is_the_request_alone_with_its_own_seed(model, settings):
    """Same tokens, and the same log-probabilities: a sample that read a sibling's keys and values in a
    block they should no longer share would still often draw the same tokens, but not with these."""
    prompts = random_prompts(4, VOCAB, 5, 30, seed=7)
    lengths = [9, 14, 6, 20]
    llm = LLM(model, max_num_seqs=16, **settings)
    params = [sampled(t, seed=100 * i, n=3, logprobs=1) for i, t in enumerate(lengths)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (prompt, t, out) in enumerate(zip(prompts, lengths, outs)):
        solo = LLM(model, block_size=4)
        alone = solo.generate(
            [prompt] * 3, [sampled(t, seed=100 * i + k, logprobs=1) for k in range(3)], use_tqdm=False
        )
        assert [o.token_ids for o in out.outputs] == [o.outputs[0].token_ids for o in alone], f"request {i}"
        for k, (got, want) in enumerate(zip(out.outputs, alone)):
            got_lp = [lp.logprob for lp in got.logprobs]
            want_lp = [lp.logprob for lp in want.outputs[0].logprobs]
            assert got_lp == pytest.approx(want_lp, abs=1e-4), f"request {i}, sample {k}"
    if "num_blocks" in settings:
        assert llm.stats().preemptions > 0, "the pool was meant to be too small"
    assert blocks_all_back(llm)


def test_greedy_samples_are_all_the_greedy_output(model):
    prompt = random_prompts(1, VOCAB, 10, 10, seed=2)[0]
    llm = LLM(model, block_size=4)
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, n=4), use_tqdm=False)[0]
    one = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
    assert [o.token_ids for o in out.outputs] == [one.outputs[0].token_ids] * 4


def test_streamed_deltas_of_each_sample_add_up_to_its_final_output(model):
    prompt = random_prompts(1, VOCAB, 9, 9, seed=5)[0]
    llm = LLM(model, block_size=4)
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    last = None
    for out in llm.stream([prompt], sampled(10, n=3)):
        for c in out.outputs:
            got[c.index] += c.delta_token_ids
        last = out
    assert last is not None and last.finished
    assert {c.index: c.token_ids for c in last.outputs} == got
    assert all(len(ids) == 10 for ids in got.values())


@pytest.mark.parametrize("steps", [0, 1, 3], ids=["before-any-step", "after-the-fork", "while-decoding"])
def test_aborting_a_parallel_request_stops_every_sample_and_frees_its_blocks(model, steps):
    prompt = random_prompts(1, VOCAB, 10, 10, seed=6)[0]
    llm = LLM(model, block_size=4)
    rid = llm.engine.add_request(prompt, sampled(50, n=4)).request_id
    for _ in range(steps):
        llm.engine.step()
    out = llm.engine.abort(rid)
    assert out is not None and out.finished and out.request_id == rid
    assert {c.finish_reason for c in out.outputs} == {"abort"}
    assert len(out.outputs) == (1 if steps == 0 else 4)
    assert llm.engine.abort(rid) is None
    assert blocks_all_back(llm)


def test_aborting_one_sample_by_its_id_aborts_the_whole_request(model):
    llm = LLM(model, block_size=4)
    rid = llm.engine.add_request([5, 6, 7, 8, 9], sampled(50, n=3)).request_id
    llm.engine.step()
    out = llm.engine.abort(f"{rid}#2")
    assert out is not None and out.request_id == rid and out.finished
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert blocks_all_back(llm)


def test_n_beyond_max_num_seqs_or_without_a_forking_scheduler_is_refused(model):
    llm = LLM(model, max_num_seqs=4)
    with pytest.raises(ValueError, match="n=5 samples cannot run at once: at most max_num_seqs=4 sequences"):
        llm.engine.add_request([1, 2, 3], sampled(4, n=5))
    with pytest.raises(
        ValueError, match="n=5 samples but at most max_num_seqs=4"
    ):  # the scheduler's own check
        llm.engine.scheduler.add(Request("x", [1, 2, 3], sampled(4, n=5)))

    class NoFork(Scheduler):
        fork = None

    engine = Engine(model, scheduler=NoFork)
    with pytest.raises(ValueError, match="n=2 needs a scheduler with a fork"):
        engine.add_request([1, 2, 3], sampled(4, n=2))
    assert not engine.requests


def test_a_parallel_request_waits_for_seats_for_all_its_samples(model):
    llm = LLM(model, max_num_seqs=4, block_size=4)
    engine = llm.engine
    engine.add_request([1, 2, 3], sampled(30, seed=1))
    engine.add_request([4, 5, 6], sampled(30, seed=2))
    group = engine.add_request([7, 8, 9], sampled(3, n=3))
    engine.step()
    assert group.status == "waiting"  # 2 seats taken, its 3 samples need 3 more
    running = [r for r in engine.requests.values() if r.status == "running"]
    assert len(running) == 2
    while engine.has_unfinished():
        assert sum(r.status == "running" for r in engine.requests.values()) <= 4
        engine.step()
    assert blocks_all_back(llm)
