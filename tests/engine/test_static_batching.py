"""`StaticBatchScheduler`, the baseline continuous batching is measured against: a batch forms only when
the previous one is done, so it waits for its longest request; on the same parts, the same greedy tokens."""

from __future__ import annotations

import pytest
from helpers.engine_utils import compare_greedy, random_prompts, reference_greedy, tiny_model

from nanolab.engine.llm import LLM
from nanolab.engine.scheduler import StaticBatchScheduler
from nanolab.engine.stats import StepRecord
from nanolab.model.sampling import SamplingParams

VOCAB = 96


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=5, vocab_size=VOCAB, max_seq_len=256)


def run(model, scheduler, lengths, max_num_seqs=4):
    steps: list[StepRecord] = []
    llm = LLM(model, scheduler=scheduler, max_num_seqs=max_num_seqs, block_size=8, listeners=[steps.append])
    prompts = random_prompts(len(lengths), VOCAB, 4, 30, seed=3)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs], steps, llm


def test_static_batches_wait_for_their_longest_request_and_give_the_same_tokens(model):
    lengths = [30, 2, 2, 2, 3, 3, 3, 3]  # the first batch holds one long request and three short ones
    prompts, static_ids, static_steps, llm = run(model, StaticBatchScheduler, lengths)
    _, cont_ids, cont_steps, _ = run(model, None, lengths)
    ties = 0
    for prompt, n, a, b in zip(prompts, lengths, static_ids, cont_ids):
        expected, gaps = reference_greedy(model, prompt, n)
        ties += compare_greedy(expected, gaps, a) + compare_greedy(expected, gaps, b)
    print(f"near-ties accepted: {ties}")
    # static: the second batch starts only after the 30-token request; continuous refills its seats
    assert len(static_steps) >= 30 + 3 > len(cont_steps)
    assert max(s.num_seqs for s in static_steps[5:30]) == 1  # the long request alone in its batch's tail
    s = llm.stats()
    assert s.kv_blocks_free + s.kv_blocks_cached == s.kv_blocks_total and s.num_running == s.num_waiting == 0


def test_no_request_joins_a_running_batch(model):
    llm = LLM(model, scheduler=StaticBatchScheduler, max_num_seqs=3, block_size=8)
    prompts = random_prompts(7, VOCAB, 4, 20, seed=4)
    for i, p in enumerate(prompts):
        llm.engine.add_request(p, SamplingParams(max_tokens=2 + 3 * i, temperature=0, ignore_eos=True))
    scheduler = llm.engine.scheduler
    while llm.engine.has_unfinished():
        was_running = {id(r) for r in scheduler.running}
        waiting_before = len(scheduler.waiting)
        llm.engine.step()
        if was_running:
            assert len(scheduler.waiting) == waiting_before, "a request joined a batch that was still running"
