"""Speculative decoding: the proposer, the two verification rules, the KV rollback, and the engine with
them — greedy output equal to decoding one token at a time (under chunking, preemption and prefix
caching), sampling with exactly the model's distribution (chi-square tests with fixed seeds), and the
statistics that say how much it helped."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.engine_utils import compare_greedy, noisy_copy, random_prompts, reference_greedy, tiny_model

from nanolab.engine.config import EngineConfig
from nanolab.engine.llm import LLM
from nanolab.engine.speculative import (
    NgramProposer,
    SpeculativeConfig,
    Speculator,
    expected_tokens_per_step,
    propose_ngram,
    rejection_sample,
    verify_greedy,
)
from nanolab.memory.block_allocator import BlockAllocator
from nanolab.memory.block_manager import BlockManager
from nanolab.model.sampling import SamplingParams

VOCAB = 96
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The p-value of Pearson's chi-square test of ``counts`` against ``probs`` (cells with p > 0)."""
    keep = probs > 0
    assert int(counts[~keep].sum()) == 0, "a token the target never gives was drawn"
    expected = probs[keep] * counts.sum()
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


# -- the proposer ---------------------------------------------------------------------------------------


def test_propose_ngram_prefers_the_longest_suffix_and_its_first_occurrence():
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [7, 1, 2, 9, 5, 1, 2, 3, 4, 2]
    # "2" occurs at 2 and 6: the first occurrence's continuation is proposed
    assert propose_ngram(tokens, k=3, min_n=1, max_n=1) == [9, 5, 1]
    # with n = 2, the suffix "4 2" never occurred before; n = 1 decides
    assert propose_ngram(tokens, k=2, min_n=1, max_n=2) == [9, 5]
    assert propose_ngram(tokens, k=2, min_n=2, max_n=4) == []
    # "2 3" first occurs at 0, "1 2 3" at 4: the longest match wins over the first short one
    tokens = [2, 3, 8, 8, 1, 2, 3, 6, 6, 1, 2, 3]
    assert propose_ngram(tokens, k=2, min_n=1, max_n=3) == [6, 6]
    assert propose_ngram(tokens, k=2, min_n=1, max_n=2) == [8, 8]


def test_propose_ngram_stops_at_the_end_of_the_sequence_and_handles_short_input():
    assert propose_ngram([4, 5, 4], k=5) == [5, 4]  # what follows the match, up to the end
    assert propose_ngram([4], k=3) == []
    assert propose_ngram([], k=3) == []
    assert propose_ngram([4, 4], k=0) == []
    assert propose_ngram([3, 3, 3, 3], k=2, min_n=1, max_n=8) == [3]


def test_propose_ngram_agrees_with_a_plain_search():
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randint(0, 30))]
        k, lo = rng.randint(1, 5), rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        want: list[int] = []
        for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
            suffix = tokens[len(tokens) - n :]
            starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
            if starts:
                want = tokens[starts[0] + n : starts[0] + n + k]
                break
        assert propose_ngram(tokens, k, lo, hi) == want, (tokens, k, lo, hi)


# -- verification ---------------------------------------------------------------------------------------


def test_verify_greedy_keeps_the_agreeing_prefix_and_one_token_of_the_model():
    assert verify_greedy([], [3]) == [3]
    assert verify_greedy([3, 4], [3, 4, 5]) == [3, 4, 5]  # all kept, and the bonus token
    assert verify_greedy([3, 4], [2, 4, 5]) == [2]  # the first guess was wrong: the model's token
    assert verify_greedy([3, 4, 9], [3, 1, 9, 9]) == [3, 1]  # a later match does not count
    with pytest.raises(ValueError, match="2 guesses need 3"):
        verify_greedy([1, 2], [1, 2])


def _random_dist(g: torch.Generator, V: int, zeros: int = 1) -> torch.Tensor:
    p = torch.rand(V, generator=g) + 0.05
    p[torch.randperm(V, generator=g)[:zeros]] = 0.0
    return p / p.sum()


@pytest.mark.parametrize("certain", [True, False], ids=["certain-guess", "draft-distribution"])
def test_rejection_sampling_gives_the_target_distribution(certain):
    """Each kept token, the first and the one after an accepted guess, has the target's distribution
    (10,000 draws of 2 guesses over 6 tokens, chi-square p-value above 0.001; seeded)."""
    V, N = 6, 10_000
    g = torch.Generator().manual_seed(1234)
    p = torch.stack([_random_dist(g, V) for _ in range(3)])
    q = torch.stack([_random_dist(g, V, zeros=0) for _ in range(2)])
    first = torch.zeros(V)
    second = torch.zeros(V)  # the second token, when the first guess was kept and was token 2
    kept_lengths = torch.zeros(4)
    for _ in range(N):
        if certain:
            guesses = [2, int(torch.randint(V, (1,), generator=g))]
            out = rejection_sample(guesses, p, None, g)
        else:
            guesses = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
            out = rejection_sample(guesses, p, q, g)
        assert 1 <= len(out) <= 3 and out[: len(out) - 1] == guesses[: len(out) - 1]
        kept_lengths[len(out)] += 1
        first[out[0]] += 1
        if len(out) > 1 and out[0] == 2:
            second[out[1]] += 1
    assert chi_square_p_value(first, p[0]) > 1e-3
    assert chi_square_p_value(second, p[1]) > 1e-3
    assert kept_lengths[3] > 0 and kept_lengths[1] > 0  # both ends were exercised


def test_rejection_sampling_keeps_a_certain_guess_with_the_targets_probability():
    p = torch.tensor([[0.25, 0.75, 0.0], [1.0, 0.0, 0.0]])
    g = torch.Generator().manual_seed(5)
    kept = sum(len(rejection_sample([1], p, None, g)) == 2 for _ in range(4000))
    assert abs(kept / 4000 - 0.75) < 0.03
    # a guess the target never makes is never kept, and the redraw never gives it
    for _ in range(200):
        out = rejection_sample([2], p, None, g)
        assert len(out) == 1 and out[0] in (0, 1)


def test_rejection_sampling_checks_its_shapes():
    with pytest.raises(ValueError, match=r"2 guesses need target_probs of shape \(3, V\)"):
        rejection_sample([1, 2], torch.full((2, 4), 0.25))


# -- the KV rollback ------------------------------------------------------------------------------------


class _Seq:
    def __init__(self, tokens: int, computed: int, table: list[int]) -> None:
        self.prompt_token_ids = list(range(tokens))
        self.num_computed_tokens = computed
        self.block_table = table

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


def test_rollback_frees_the_blocks_wholly_past_the_kept_tokens():
    alloc = BlockAllocator(8)
    bm = BlockManager(alloc, block_size=4)
    table = alloc.allocate(3)
    seq = _Seq(tokens=6, computed=9, table=list(table))  # 3 guesses past 6 tokens were computed
    bm.rollback(seq)
    assert seq.num_computed_tokens == 5 and seq.block_table == table[:2]
    assert alloc.num_free == 6 and alloc.ref_count(table[2]) == 0
    seq = _Seq(tokens=8, computed=8, table=list(table[:2]))  # nothing to drop: the last token's slot stays
    bm.rollback(seq)
    assert seq.num_computed_tokens == 7 and seq.block_table == table[:2]
    seq = _Seq(tokens=9, computed=3, table=list(table[:2]))  # never raises what was computed
    bm.rollback(seq)
    assert seq.num_computed_tokens == 3


# -- the engine: greedy ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=1, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def workload(model):
    """16 requests: prompts that repeat a short pattern (what n-gram lookup is for) and random ones, with
    2..40 output tokens, half sharing a prefix; and the greedy reference of each."""
    rng = random.Random(3)
    prompts = random_prompts(8, VOCAB, 1, 30, seed=3, shared=12)
    for _ in range(8):
        pattern = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))]
        prompts.append((pattern * 12)[: rng.randint(8, 50)])
    lengths = [2 + (11 * i) % 39 for i in range(len(prompts))]
    refs = [reference_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    return prompts, lengths, refs


def _generate(llm, prompts, lengths, **params):
    sps = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **params) for n in lengths]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]


def _check(workload, got, record_property) -> int:
    _, _, refs = workload
    ties = sum(compare_greedy(ref, gaps, g) for (ref, gaps), g in zip(refs, got))
    record_property("near_ties", ties)
    print(f"near-ties accepted: {ties}")
    return ties


def _all_blocks_free(llm) -> None:
    bm = llm.engine.block_manager
    if bm.prefix_cache is not None:
        bm.prefix_cache.reset()
    assert bm.allocator.num_free == bm.allocator.num_total


SETTINGS = {
    "plain": {},
    "chunked-7": {"max_num_batched_tokens": 7, "enable_prefix_caching": False},
    "no-chunking": {"enable_chunked_prefill": False, "max_num_batched_tokens": 128},
    "preempting": {"num_blocks": 28, "block_size": 4, "max_num_batched_tokens": 64},
    "prefix-cache-blocks-4": {"block_size": 4, "max_num_seqs": 4},
}


@pytest.mark.parametrize(
    "setting, k",
    [("plain", 3), ("chunked-7", 1), ("no-chunking", 6), ("preempting", 3), ("prefix-cache-blocks-4", 6)],
)
def test_ngram_speculation_gives_the_greedy_output(model, workload, setting, k, record_property):
    prompts, lengths, _ = workload
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
    llm = LLM(model, speculative_config=spec, **SETTINGS[setting])
    got = _generate(llm, prompts, lengths)
    _check(workload, got, record_property)
    stats = llm.stats()
    assert stats.spec_accepted_tokens > 0 and stats.spec_draft_tokens > stats.spec_accepted_tokens
    assert stats.forwards_per_token < 1
    if setting == "preempting":
        assert stats.preemptions > 0
    _all_blocks_free(llm)


class NoisyOracle:
    """Guesses the true greedy continuation, each guess wrong with probability ``wrong``: long runs of
    kept guesses and rejections at every position, whatever the model."""

    def __init__(self, model, prompts, refs, wrong: float, seed: int) -> None:
        self.truth = {tuple(p): p + ref for p, (ref, _) in zip(prompts, refs)}
        self.wrong, self.rng = wrong, random.Random(seed)

    def propose(self, requests, num_tokens):
        out = []
        for r, k in zip(requests, num_tokens):
            truth = self.truth[tuple(r.prompt_token_ids)]
            guesses = truth[r.num_tokens : r.num_tokens + k]
            out.append([t if self.rng.random() > self.wrong else (t + 1) % VOCAB for t in guesses])
        return out


@pytest.mark.parametrize("wrong", [0.0, 0.3])
def test_guesses_kept_or_rejected_at_any_position_give_the_greedy_output(
    model, workload, wrong, record_property
):
    prompts, lengths, refs = workload
    config = EngineConfig(block_size=4, num_blocks=40, max_num_batched_tokens=32)
    oracle = NoisyOracle(model, prompts, refs, wrong, seed=2)
    llm = LLM(model, config=config, speculator=Speculator(SpeculativeConfig("ngram", 5), oracle))
    got = _generate(llm, prompts, lengths)
    ties = _check(workload, got, record_property)
    stats = llm.stats()
    if wrong == 0.0 and ties == 0:
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0
    else:
        assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert stats.generated_tokens == sum(lengths)
    _all_blocks_free(llm)


def test_requests_that_need_extras_keep_their_output_next_to_speculating_ones(
    model, workload, record_property
):
    """logprobs and penalties decode one token a step, next to speculating requests, and give the same
    tokens and log-probabilities; the samples of an n > 1 request speculate once forked."""
    prompts, lengths, refs = workload
    kinds = [{}, {"logprobs": 2}, {"repetition_penalty": 1.3, "frequency_penalty": 0.5}, {"n": 2}]

    def run(**engine):
        llm = LLM(model, block_size=4, **engine)
        params = [
            SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kinds[i % 4])
            for i, n in enumerate(lengths)
        ]
        return llm, llm.generate(prompts, params, use_tqdm=False)

    _, plain = run()
    llm, spec = run(speculative_config=NGRAM)
    ties = 0
    for i, (a, b) in enumerate(zip(plain, spec)):
        kind = i % 4
        if kind == 2:  # penalties: no reference but the engine without speculation
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"request {i} changed"
            continue
        for c in b.outputs:
            ties += compare_greedy(*refs[i], c.token_ids)
        if kind == 1 and a.outputs[0].token_ids == b.outputs[0].token_ids:
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-5)
                assert [t for t, _ in x.top] == [t for t, _ in y.top]
    record_property("near_ties", ties)
    print(f"near-ties accepted: {ties}")
    assert llm.stats().spec_accepted_tokens > 0


def test_a_speculator_of_ones_own_plugs_in_whole(model, workload, record_property):
    """Each part of a `Speculator` given to `LLM(speculator=...)` is the one the engine calls: the
    proposer, both verification rules and the rollback."""
    from nanolab.engine import speculative

    prompts, lengths, _ = workload
    calls = {"propose": 0, "greedy": 0, "sample": 0, "rollback": 0}

    def counted(name, fn):
        def wrapper(*args):
            calls[name] += 1
            return fn(*args)

        return wrapper

    class Proposer(NgramProposer):
        propose = counted("propose", NgramProposer.propose)

    def rollback(req, block_manager):
        calls["rollback"] += 1
        block_manager.rollback(req)

    config = SpeculativeConfig("ngram", 3)
    spec = Speculator(
        config,
        Proposer(config),
        counted("greedy", speculative.verify_greedy),
        counted("sample", speculative.rejection_sample),
        rollback,
    )
    llm = LLM(model, block_size=4, speculator=spec)
    _check(workload, _generate(llm, prompts, lengths), record_property)
    sampled = SamplingParams(max_tokens=12, temperature=0.7, seed=3, ignore_eos=True)
    llm.generate(prompts[-4:], sampled, use_tqdm=False)
    assert all(calls.values()), calls
    assert calls["rollback"] == llm.stats().spec_verifications == calls["greedy"] + calls["sample"]
    _all_blocks_free(llm)


# -- the engine: a draft model ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "setting, noise", [("plain", 0.0), ("preempting", 0.4), ("chunked-7", 0.4), ("preempting", 0.0)]
)
def test_draft_model_speculation_gives_the_greedy_output(model, workload, setting, noise, record_property):
    """The draft's own cache follows the target's: caught up on kept tokens, cut at rejected ones."""
    prompts, lengths, _ = workload
    draft = noisy_copy(model, noise)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 4}
    llm = LLM(model, speculative_config=spec, **SETTINGS[setting])
    got = _generate(llm, prompts, lengths)
    ties = _check(workload, got, record_property)
    s = llm.stats()
    print(f"guesses kept {s.spec_accepted_tokens} of {s.spec_draft_tokens}")
    if noise == 0.0 and ties == 0:  # the draft is the model: every guess is kept (up to float noise)
        assert s.spec_accepted_tokens >= 0.95 * s.spec_draft_tokens > 0
    else:
        assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens
    _all_blocks_free(llm)
    proposer = llm.engine.speculator.proposer
    assert not proposer.seqs and proposer.allocator.num_free == proposer.allocator.num_total


def test_a_draft_model_with_another_vocabulary_is_refused(model):
    draft = tiny_model("llama", seed=2, vocab_size=VOCAB + 1)
    with pytest.raises(ValueError, match="must share its target's tokenizer"):
        LLM(model, speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 2})


# -- the engine: sampling -------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@torch.inference_mode()
def test_sampled_tokens_have_the_models_distribution_with_speculation(method):
    """3,000 seeded requests at temperature 0.9 on a 12-token model: the second output token (the first
    one verified) is distributed as the model says (its exact marginal, summed over the first token),
    chi-square p-value above 0.001. n-gram guesses are certain (q = 1); a draft model's are drawn from
    its own distribution, which the rejection sampler corrects."""
    V, N = 12, 3000
    model = tiny_model("llama", seed=4, vocab_size=V)
    prompt = [3, 7, 1, 3, 7, 1, 3, 7, 1, 3, 7, 1]
    temperature = 0.9
    logits0 = model.logits(torch.tensor([prompt]))[0, -1] / temperature
    p0 = logits0.softmax(-1)
    nxt = model.logits(torch.tensor([prompt + [t] for t in range(V)]))[:, -1] / temperature
    p1 = (p0[:, None] * nxt.softmax(-1)).sum(0)

    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = noisy_copy(model, 0.5, seed=1)
    llm = LLM(model, max_num_seqs=512, block_size=4, speculative_config=spec)
    params = [
        SamplingParams(max_tokens=3, temperature=temperature, seed=i, ignore_eos=True) for i in range(N)
    ]
    outs = llm.generate([prompt] * N, params, use_tqdm=False)
    counts = torch.zeros(V)
    for o in outs:
        counts[o.outputs[0].token_ids[1]] += 1
    stats = llm.stats()
    print(
        f"verifications {stats.spec_verifications}, guesses kept {stats.spec_accepted_tokens} of {stats.spec_draft_tokens}"
    )
    assert stats.spec_verifications > 500 and 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert chi_square_p_value(counts, p1) > 1e-3


# -- config and stats -----------------------------------------------------------------------------------


def test_speculative_config_is_checked_with_clear_errors():
    with pytest.raises(ValueError, match="did you mean 'num_speculative_tokens'"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_token": 3})
    with pytest.raises(ValueError, match="method must be one of 'ngram', 'draft_model'"):
        SpeculativeConfig.parse({"method": "medusa", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be an integer in \[1, 16\]"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="prompt_lookup_min \\(3\\) is more than prompt_lookup_max \\(2\\)"):
        SpeculativeConfig.parse({**NGRAM, "prompt_lookup_min": 3, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match='needs "model"'):
        SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.parse("{method: ngram}")
    with pytest.raises(ValueError, match="needs 'num_speculative_tokens'"):
        SpeculativeConfig.parse({"method": "ngram"})
    parsed = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    assert parsed.speculative_config == SpeculativeConfig("ngram", 2)
    assert EngineConfig().speculative_config is None


def test_the_command_line_takes_the_config_as_json():
    import argparse

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert EngineConfig.from_cli_args(args).speculative_config.num_speculative_tokens == 3
    assert EngineConfig.from_cli_args(parser.parse_args([])).speculative_config is None


def test_stats_without_speculation_say_one_forward_per_token(model):
    llm = LLM(model)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)
    s = llm.stats()
    assert (s.spec_verifications, s.spec_draft_tokens, s.spec_accepted_tokens) == (0, 0, 0)
    assert s.forwards_per_token == 1.0 and s.spec_acceptance_rate == 0.0


def test_an_ngram_proposer_proposes_for_each_request_its_own_guesses():
    class R:
        def __init__(self, ids):
            self.all_token_ids = ids

    p = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_max=2))
    assert p.propose([R([1, 2, 3, 1, 2]), R([5, 5]), R([1, 2, 1])], [3, 2, 0]) == [[3, 1, 2], [5], []]


# -- the engine: text, stop rules and Hugging Face models ------------------------------------------------


def test_stop_strings_stop_tokens_and_streams_behave_as_without_speculation():
    """On the bundled model, with guesses kept several at a time: a stop string ends the text at the same
    place (nothing after it leaks, even from a guess kept in the same step), a stop token ends the
    output, and the streamed deltas add up to the final text, held-back text included."""
    prompts = [
        "class Stack:\n    def __init__(self):\n        self.items = []\n",
        "def fibonacci(n):\n",
        "import os\nimport sys\n",
    ]
    plain, spec = LLM(), LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    greedy = SamplingParams(max_tokens=48, temperature=0)
    full = [o.outputs[0] for o in plain.generate(prompts, greedy, use_tqdm=False)]
    stops = [c.text[len(c.text) // 2 : len(c.text) // 2 + 3] for c in full]  # a string from the middle
    stop_token = full[1].token_ids[len(full[1].token_ids) // 2]
    params = [
        SamplingParams(max_tokens=48, temperature=0, stop=[stops[0]]),
        SamplingParams(max_tokens=48, temperature=0, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=48, temperature=0, stop=[stops[2]]),
    ]
    want = [
        (o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason)
        for o in plain.generate(prompts, params, use_tqdm=False)
    ]
    texts: dict[str, str] = {}
    final = {}
    for out in spec.stream(prompts, params):
        texts[out.request_id] = texts.get(out.request_id, "") + out.outputs[0].delta_text
        if out.finished:
            final[out.request_id] = out.outputs[0]
    got = [(c.text, c.token_ids, c.finish_reason) for c in (final[k] for k in sorted(final, key=int))]
    assert got == want
    assert [texts[k] for k in sorted(texts, key=int)] == [t for t, _, _ in want]
    assert all(reason == "stop" for _, _, reason in want)
    assert spec.stats().spec_accepted_tokens > 0


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_greedy_output_equals_hugging_face_generate_with_speculation(kind, tmp_path, record_property):
    """A tiny Hugging Face checkpoint, 12 requests with repeating and random prompts, both proposers
    (the draft: the same checkpoint, so every guess is checked by a second copy of the model)."""
    from helpers.hf_models import hf_greedy, save_tiny_hf_model

    hf = save_tiny_hf_model(kind, tmp_path)
    vocab = hf.config.vocab_size
    rng = random.Random(5)
    prompts = random_prompts(6, vocab, 2, 20, seed=5)
    for _ in range(6):
        pattern = [rng.randrange(vocab) for _ in range(rng.randint(2, 5))]
        prompts.append((pattern * 8)[: rng.randint(6, 24)])
    lengths = [4 + (5 * i) % 20 for i in range(len(prompts))]
    expected = [hf_greedy(hf, prompt, n) for prompt, n in zip(prompts, lengths)]
    ties = 0
    for method in ("ngram", "draft_model"):
        spec = {"method": method, "num_speculative_tokens": 4}
        if method == "draft_model":
            spec["model"] = str(tmp_path)
        llm = LLM(tmp_path, block_size=4, max_num_batched_tokens=24, speculative_config=spec)
        got = _generate(llm, prompts, lengths)
        ties += sum(compare_greedy(ref, gaps, g) for (ref, gaps), g in zip(expected, got))
        assert llm.stats().spec_accepted_tokens > 0, method
    record_property("near_ties", ties)
    print(f"near-ties accepted: {ties}")


def test_aborting_speculating_requests_frees_every_block_of_both_models(model, workload):
    """Requests aborted between steps, while they hold guesses, give back their blocks in the engine and
    in the draft model's cache; the others finish with the greedy output."""
    prompts, lengths, refs = workload
    spec = {"method": "draft_model", "model": noisy_copy(model, 0.2), "num_speculative_tokens": 3}
    llm = LLM(model, block_size=4, speculative_config=spec)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    reqs = llm.engine.add_requests(prompts, params)
    for _ in range(6):
        llm.engine.step()
    guessing = [r for r in reqs if r.spec_token_ids and not r.is_finished]
    assert guessing, "no request held guesses after 6 steps"
    for r in guessing[::2]:
        assert llm.engine.abort(r.request_id).finished
    kept = [r for r in reqs if r not in guessing[::2]]
    outs = llm.engine.run_until_finished([r.request_id for r in kept if not r.is_finished])
    assert all(o.finished for o in outs)
    for r in kept:
        i = reqs.index(r)
        compare_greedy(*refs[i], r.output_token_ids)
    _all_blocks_free(llm)
    proposer = llm.engine.speculator.proposer
    assert not proposer.seqs and proposer.allocator.num_free == proposer.allocator.num_total


@pytest.mark.parametrize("bug", ["leaves-every-token-computed", "drops-the-last-tokens-block"])
def test_a_rollback_that_breaks_the_request_fails_the_step_rather_than_hang(model, bug):
    """A rollback of one's own that leaves no token to compute (the scheduler would never run the request
    again) or drops a block the request still needs fails the step with a message; the engine goes on."""
    from nanolab.engine.core import EngineStepError

    def broken(req, block_manager):
        block_manager.rollback(req)
        if bug == "leaves-every-token-computed":
            req.num_computed_tokens = req.num_tokens
        else:
            block_manager.allocator.free(req.block_table[-1:])
            del req.block_table[-1:]

    config = SpeculativeConfig("ngram", 3)
    llm = LLM(model, block_size=4, speculator=Speculator(config, NgramProposer(config), rollback=broken))
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    llm.engine.add_requests([[5, 6, 7, 5, 6, 7, 5, 6]], params)
    with pytest.raises(EngineStepError, match="after the rollback"):
        for _ in range(40):
            llm.engine.step()
    assert not llm.engine.has_unfinished()
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 1


def test_expected_tokens_per_step_is_the_mean_run_of_independent_acceptances():
    rng = random.Random(0)
    for a, k in [(0.0, 3), (0.3, 1), (0.6, 4), (0.9, 8), (1.0, 5)]:
        runs = []
        for _ in range(20000):
            n = 1  # the model's own token
            while n <= k and rng.random() < a:
                n += 1
            runs.append(n)
        mean = sum(runs) / len(runs)
        spread = (sum((r - mean) ** 2 for r in runs) / len(runs)) ** 0.5
        assert expected_tokens_per_step(a, k) == pytest.approx(mean, abs=5 * spread / len(runs) ** 0.5 + 1e-9)
    assert expected_tokens_per_step(1 - 1e-12, 3) == pytest.approx(4.0)
    for a, k in [(-0.1, 1), (1.1, 1), (0.5, -1)]:
        with pytest.raises(ValueError):
            expected_tokens_per_step(a, k)
