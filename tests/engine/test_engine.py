"""The engine's correctness: greedy output never depends on how requests are batched, chunked, cached
or preempted; KV blocks are always accounted for; the scheduler keeps its promises."""

from __future__ import annotations

import pytest
from helpers.engine_utils import compare_greedy, random_prompts, reference_greedy, tiny_model

from nanolab.engine.llm import LLM
from nanolab.model import prepacked
from nanolab.model.sampling import SamplingParams

VOCAB = 96


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=1, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def workload(model):
    """20 requests of mixed prompt (1..70 tokens) and output (1..24 tokens) lengths, half sharing a prefix."""
    prompts = random_prompts(20, VOCAB, 1, 50, seed=3, shared=20)
    lengths = [1 + (7 * i) % 24 for i in range(len(prompts))]
    refs = [reference_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    return prompts, lengths, refs


def run(model, prompts, lengths, **engine_kwargs):
    llm = LLM(model, **engine_kwargs)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def check_all(workload, got, record_property) -> None:
    prompts, lengths, refs = workload
    ties = sum(compare_greedy(ref, gaps, g) for (ref, gaps), g in zip(refs, got))
    record_property("near_ties", ties)
    print(f"near-ties accepted: {ties}")


def test_each_request_alone_matches_full_recompute(model, workload, record_property):
    prompts, lengths, _ = workload
    got = [run(model, [p], [n])[1][0] for p, n in zip(prompts, lengths)]
    check_all(workload, got, record_property)


def test_continuous_batch_matches_requests_run_alone(model, workload, record_property):
    llm, got = run(model, *workload[:2])
    check_all(workload, got, record_property)
    assert llm.stats().mean_batch_size > 2  # it really batched


@pytest.mark.parametrize("budget", [7, 16, 33, 200])
def test_chunked_prefill_at_any_budget_gives_the_same_output(model, workload, budget, record_property):
    llm, got = run(model, *workload[:2], max_num_batched_tokens=budget, enable_prefix_caching=False)
    check_all(workload, got, record_property)


def test_without_chunked_prefill_gives_the_same_output(model, workload, record_property):
    llm, got = run(model, *workload[:2], enable_chunked_prefill=False, max_num_batched_tokens=128)
    check_all(workload, got, record_property)


@pytest.mark.parametrize("prefix", [True, False])
def test_prefix_cache_on_or_off_gives_the_same_output(model, workload, prefix, record_property):
    llm, got = run(model, *workload[:2], enable_prefix_caching=prefix, max_num_seqs=4, block_size=4)
    check_all(workload, got, record_property)
    assert (llm.stats().prefix_hit_rate > 0) == prefix


def test_preemption_gives_the_same_output(model, workload, record_property):
    """A pool of 24 blocks of 4 tokens cannot hold the batch: requests get preempted and recomputed."""
    llm, got = run(model, *workload[:2], num_blocks=24, block_size=4, max_num_batched_tokens=64)
    assert llm.stats().preemptions > 0
    check_all(workload, got, record_property)


@pytest.mark.skipif(not prepacked.available(), reason="this build of torch lacks oneDNN")
def test_prepacked_weights_give_the_same_output_alone_or_batched_chunked_and_preempted(
    model, workload, record_property
):
    """Through oneDNN's layouts of the weights (3 rows or more) and nanolab's own kernel (1 or 2 rows),
    products are summed in another order than F.linear's: the outputs still equal the reference, near-ties
    aside. Alone, every decode step is a product of one row."""
    prompts, lengths, _ = workload
    alone = [run(model, [p], [n], prepack_weights=True)[1][0] for p, n in zip(prompts, lengths)]
    check_all(workload, alone, record_property)
    llm, got = run(
        model, prompts, lengths, prepack_weights=True, num_blocks=24, block_size=4, max_num_batched_tokens=33
    )
    assert llm.stats().preemptions > 0
    check_all(workload, got, record_property)


def test_every_block_is_free_after_the_run(model, workload):
    llm, _ = run(model, *workload[:2], block_size=4, num_blocks=64)
    kv = llm.engine.block_manager
    kv.prefix_cache.reset()
    alloc = kv.allocator
    assert alloc.num_free == alloc.num_total
    assert all(alloc.ref_count(b) == 0 for b in range(alloc.num_total))
