"""Logit bias, repetition/frequency/presence penalties and logprobs: each row from its own tokens and
parameters only, equal to independent formulas (Hugging Face's repetition penalty, OpenAI's frequency and
presence penalties), and in the engine equal to a full-recompute reference whatever the batch holds."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.engine_utils import random_prompts, tiny_model

from nanolab.engine.llm import LLM
from nanolab.model.sampling import SamplingParams, adjust_logits, sample, token_logprobs

VOCAB = 96


def openai_penalties(
    logits: torch.Tensor, output: list[int], frequency: float, presence: float
) -> torch.Tensor:
    """OpenAI's documented formula: mu[j] - c[j] * frequency - (c[j] > 0) * presence."""
    counts = torch.zeros_like(logits)
    for t in output:
        counts[t] += 1
    return logits - counts * frequency - (counts > 0).float() * presence


def test_repetition_penalty_equals_hugging_face():
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=g) * 3
    history = [([1, 2, 3], [4, 4, 5]), ([0], []), ([7, 8], [9, 39, 7])]
    params = [SamplingParams(repetition_penalty=r) for r in (1.3, 0.7, 2.0)]
    got = adjust_logits(logits, params, history)
    for b, (p, (prompt, output)) in enumerate(zip(params, history)):
        hf = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)
        want = hf(torch.tensor([prompt + output]), logits[b : b + 1].clone())[0]
        torch.testing.assert_close(got[b], want)


def test_frequency_and_presence_penalties_follow_openais_formula_on_the_output_only():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 30, generator=g)
    history = [([3, 3, 3], [3, 5, 5, 5, 29]), ([1], [])]
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=1.5),
        SamplingParams(presence_penalty=-2),
    ]
    got = adjust_logits(logits, params, history)
    torch.testing.assert_close(got[0], openai_penalties(logits[0], history[0][1], 0.5, 1.5))
    torch.testing.assert_close(got[1], logits[1])  # no output yet: nothing to penalize


def test_logit_bias_adds_to_the_logits_and_can_force_or_ban_a_token():
    logits = torch.zeros(2, 10)
    logits[:, 4] = 5.0
    params = [
        SamplingParams(temperature=0, logit_bias={7: 100}),
        SamplingParams(temperature=0, logit_bias={4: -100}),
    ]
    adjusted = adjust_logits(logits, params, [([], []), ([], [])])
    assert sample(adjusted, params, [None, None]).tolist() == [7, 0]
    adjusted = adjust_logits(logits, [SamplingParams(logit_bias={2: 1.5, 3: -0.25})], [([], [])])
    assert adjusted[0, 2] == 1.5 and adjusted[0, 3] == -0.25 and adjusted[0, 4] == 5.0


def test_a_row_is_adjusted_the_same_alone_or_in_any_batch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 50, generator=g)
    params = [
        SamplingParams(frequency_penalty=1.0),
        SamplingParams(),
        SamplingParams(repetition_penalty=1.5, logit_bias={3: 2.0}),
        SamplingParams(presence_penalty=0.5, temperature=0),
    ]
    history = [([1], [2, 2]), ([5], [5]), ([9, 9], [1]), ([], [7])]
    together = adjust_logits(logits, params, history)
    for b in range(4):
        alone = adjust_logits(logits[b : b + 1], params[b : b + 1], history[b : b + 1])
        torch.testing.assert_close(together[b], alone[0])
    assert adjust_logits(logits, [SamplingParams()] * 4, None) is logits  # nothing to do: no copy


def test_penalties_without_the_token_history_are_refused():
    with pytest.raises(ValueError, match="penalties need each row's"):
        adjust_logits(torch.zeros(1, 5), [SamplingParams(frequency_penalty=1)], None)


def test_token_logprobs_are_the_log_softmax_and_the_top_tokens_in_order():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 20, generator=g)
    got = token_logprobs(logits, [5, 6], [3, 0])
    logp = logits.log_softmax(-1)
    assert got[0].token_id == 5 and got[0].logprob == pytest.approx(float(logp[0, 5]))
    top = logp[0].topk(3)
    assert [t for t, _ in got[0].top] == top.indices.tolist()
    assert [lp for _, lp in got[0].top] == pytest.approx(top.values.tolist())
    assert got[1].top == () and got[1].logprob == pytest.approx(float(logp[1, 6]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=0), "n must be an integer >= 1"),
        (dict(presence_penalty=2.5), r"presence_penalty must be a number in \[-2, 2\]"),
        (dict(frequency_penalty="1"), r"frequency_penalty must be a number in \[-2, 2\]"),
        (dict(repetition_penalty=0), "repetition_penalty must be a finite number > 0"),
        (dict(logit_bias={"3": 1}), r"logit_bias keys must be token ids \(integers >= 0\), got '3'"),
        (dict(logit_bias={3: 101}), r"logit_bias values must be numbers in \[-100, 100\], got 101 for 3"),
        (dict(logit_bias=[3]), "logit_bias must be a dict"),
        (dict(logprobs=21), r"logprobs must be None \(off\) or an integer in \[0, 20\]"),
        (dict(logprobs=True), "logprobs must be None"),
        (dict(prompt_logprobs=-1), r"prompt_logprobs must be None \(off\) or an integer in \[0, 20\]"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


# -- in the engine --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=8, vocab_size=VOCAB)


@torch.inference_mode()
def reference(model, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[float]]:
    """Greedy with penalties and bias by full recompute; returns the tokens and their raw logprobs."""
    out, lps = [], []
    for _ in range(params.max_tokens):
        raw = model.logits(torch.tensor([prompt + out]))[0, -1]
        x = raw.clone()
        for t, bias in (params.logit_bias or {}).items():
            x[t] += bias
        for t in set(prompt + out):
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
        x = openai_penalties(x, out, params.frequency_penalty, params.presence_penalty)
        tok = int(x.argmax())
        out.append(tok)
        lps.append(float(raw.log_softmax(-1)[tok]))
    return out, lps


def test_engine_applies_each_requests_penalties_from_its_own_tokens_in_any_batch(model):
    prompts = random_prompts(6, VOCAB, 3, 40, seed=4)
    base = dict(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    params = [
        SamplingParams(**base, frequency_penalty=1.5),
        SamplingParams(**base),
        SamplingParams(**base, presence_penalty=2.0, repetition_penalty=1.3),
        SamplingParams(**base, repetition_penalty=0.8, logit_bias={5: 3.0}),
        SamplingParams(**base, frequency_penalty=-0.5),
        SamplingParams(**base, logit_bias={0: -100, 1: -100}),
    ]
    llm = LLM(model, block_size=4, max_num_batched_tokens=24)  # chunked prefill, mixed batches
    outs = llm.generate(prompts, params, use_tqdm=False)
    differs = 0
    for prompt, p, out in zip(prompts, params, outs):
        want, want_lp = reference(model, prompt, p)
        got = out.outputs[0]
        assert got.token_ids == want
        assert [lp.logprob for lp in got.logprobs] == pytest.approx(want_lp, abs=1e-4)
        assert all(len(lp.top) == 2 and lp.top[0][1] >= lp.top[1][1] for lp in got.logprobs)
        differs += want != reference(model, prompt, SamplingParams(**base))[0]
    assert differs >= 4, "the penalties were meant to change most outputs"


def test_logprobs_of_a_greedy_token_are_the_top_one_and_sampled_ones_are_finite(model):
    prompt = random_prompts(1, VOCAB, 12, 12, seed=9)[0]
    llm = LLM(model, block_size=4)
    greedy = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, logprobs=0), use_tqdm=False)
    for lp in greedy[0].outputs[0].logprobs:
        assert lp.top == ()
        assert lp.logprob <= 0
    top = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, logprobs=1), use_tqdm=False)
    assert all(lp.top[0] == (lp.token_id, pytest.approx(lp.logprob)) for lp in top[0].outputs[0].logprobs)
    sampled = llm.generate(
        [prompt], SamplingParams(max_tokens=6, temperature=1.5, seed=0, logprobs=3), use_tqdm=False
    )
    assert all(math.isfinite(lp.logprob) for lp in sampled[0].outputs[0].logprobs)
    assert llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].logprobs is None


def test_a_logit_bias_outside_the_vocabulary_is_refused_before_anything_runs(model):
    llm = LLM(model)
    with pytest.raises(ValueError, match=f"logit_bias names token id {VOCAB} but the vocabulary has {VOCAB}"):
        llm.engine.add_request([1, 2], SamplingParams(logit_bias={VOCAB: 1.0}))
    assert not llm.engine.requests


@pytest.mark.parametrize(
    "settings",
    [dict(), dict(max_num_batched_tokens=8), dict(num_blocks=12, max_num_batched_tokens=32)],
    ids=["one-chunk", "chunked", "preempted"],
)
def test_prompt_logprobs_equal_a_full_recompute_whatever_the_cache_and_chunks(model, settings):
    prompts = random_prompts(4, VOCAB, 10, 30, seed=12)
    llm = LLM(model, block_size=4, **settings)
    llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)  # the prefix cache now holds them
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=2, n=2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = model.logits(torch.tensor([prompt]))[0].log_softmax(-1)
        got = out.prompt_logprobs
        assert got is not None and len(got) == len(prompt) and got[0] is None
        assert [lp.token_id for lp in got[1:]] == prompt[1:]
        assert [lp.logprob for lp in got[1:]] == pytest.approx(
            [float(ref[i, prompt[i + 1]]) for i in range(len(prompt) - 1)], abs=1e-4
        )
        assert all(len(lp.top) == 2 for lp in got[1:])
    if "num_blocks" in settings:
        assert llm.stats().preemptions > 0, "the pool was meant to be too small"
    s = llm.stats()
    assert s.kv_blocks_free + s.kv_blocks_cached == s.kv_blocks_total
    assert llm.generate(prompts[0], SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_logprobs is None
