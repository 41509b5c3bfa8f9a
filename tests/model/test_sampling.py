"""Sampling: HF's warpers keep the same tokens, rows do not affect each other, bad parameters fail clearly."""

from __future__ import annotations

import math

import pytest
import torch

from nanolab.model.sampling import SamplingParams, filter_logits, make_generator, sample

logits_process = pytest.importorskip("transformers.generation.logits_process")

V = 200


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return 3 * torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))


def hf_filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The same chain HF's generate builds: temperature, top-k, top-p, min-p."""
    warpers = [logits_process.TemperatureLogitsWarper(p.temperature)]
    if p.top_k is not None:
        warpers.append(logits_process.TopKLogitsWarper(p.top_k))
    if p.top_p < 1:
        warpers.append(logits_process.TopPLogitsWarper(p.top_p))
    if p.min_p > 0:
        warpers.append(logits_process.MinPLogitsWarper(p.min_p))
    for warp in warpers:
        logits = warp(None, logits)
    return logits


SETTINGS = [
    SamplingParams(temperature=0.7),
    SamplingParams(top_k=1),
    SamplingParams(top_k=5),
    SamplingParams(top_k=50, temperature=1.3),
    SamplingParams(top_p=0.9),
    SamplingParams(top_p=0.3, temperature=0.5),
    SamplingParams(top_p=1e-6),
    SamplingParams(min_p=0.05),
    SamplingParams(min_p=0.2, temperature=2.0),
    SamplingParams(top_k=20, top_p=0.8, min_p=0.1, temperature=0.8),
]


@pytest.mark.parametrize("params", SETTINGS, ids=repr)
def test_filter_keeps_the_same_tokens_and_distribution_as_hf_warpers(params):
    logits = random_logits(8)
    ours = filter_logits(logits, [params] * 8)
    theirs = hf_filter(logits.clone(), params)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
    torch.testing.assert_close(ours.softmax(-1), theirs.softmax(-1), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("which", ["all", "every_ranked_row_has_top_k"])
def test_per_row_parameters_give_each_row_what_it_would_get_alone(which):
    settings = SETTINGS + [SamplingParams(temperature=0.0)]
    if which == "every_ranked_row_has_top_k":  # ranks only a window of max(k) tokens
        settings = [p for p in settings if p.top_p == 1 or p.top_k is not None]
    logits = random_logits(len(settings), seed=1)
    batch = filter_logits(logits, settings)
    for i, p in enumerate(settings):
        torch.testing.assert_close(batch[i : i + 1], filter_logits(logits[i : i + 1], [p]))


def test_greedy_rows_are_exact_argmax_even_among_sampled_rows():
    logits = random_logits(6, seed=2)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5)] * 3
    generators = [make_generator(i) for i in range(6)]
    for _ in range(20):
        got = sample(logits, params, generators)
        assert torch.equal(got[::2], logits[::2].argmax(-1))
    kept = filter_logits(logits, params)
    assert torch.isfinite(kept[0]).sum() == 1 and torch.isfinite(kept[0, logits[0].argmax()])


def test_sampled_tokens_are_always_among_the_kept_ones():
    logits = random_logits(len(SETTINGS), seed=3)
    kept = torch.isfinite(filter_logits(logits, SETTINGS))
    generators = [make_generator(100 + i) for i in range(len(SETTINGS))]
    for _ in range(50):
        tokens = sample(logits, SETTINGS, generators)
        assert kept[torch.arange(len(SETTINGS)), tokens].all()


def test_a_seeded_row_draws_the_same_tokens_whatever_else_is_in_the_batch():
    """Request output must not depend on batch composition: same seed, same logits -> same tokens."""
    logits = random_logits(5, seed=4)
    mine = SamplingParams(temperature=1.0, top_p=0.95, seed=7)

    def run(batch_rows: list[int]) -> list[int]:
        params = [mine if r == 0 else SamplingParams(temperature=0.5 + r, seed=r) for r in batch_rows]
        generators = [make_generator(p.seed) for p in params]
        drawn = []
        for _ in range(30):
            tokens = sample(logits[batch_rows], params, generators)
            drawn.append(int(tokens[batch_rows.index(0)]))
        return drawn

    alone = run([0])
    assert run([3, 0, 1]) == alone
    assert run([2, 4, 1, 3, 0]) == alone
    assert len(set(alone)) > 1, "temperature 1 over spread logits should not always pick one token"


def test_draws_follow_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])
    params = SamplingParams(temperature=1.0, top_k=3)
    probs = filter_logits(logits, [params]).softmax(-1)[0]
    n = 6000  # one row per draw, each with its own seed
    tokens = sample(logits.expand(n, 5), [params] * n, [make_generator(seed) for seed in range(n)])
    counts = torch.bincount(tokens, minlength=5)
    assert counts[3:].sum() == 0
    torch.testing.assert_close(counts / counts.sum(), probs, atol=0.025, rtol=0)


def test_make_generator_seeds_reproducibly():
    assert make_generator(None) is None
    a, b = make_generator(3), make_generator(3)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), "temperature must be a finite number >= 0.*-0.1"),
        (dict(temperature=math.inf), "temperature must be a finite number"),
        (dict(temperature=math.nan), "temperature must be a finite number"),
        (dict(temperature=True), "temperature must be a finite number.*True"),
        (dict(top_p=True), r"top_p must be in \(0, 1\].*True"),
        (dict(min_p=False), r"min_p must be in \[0, 1\].*False"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\].*0.0"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\].*1.5"),
        (dict(top_k=0), "top_k must be None \\(off\\) or an integer >= 1, got 0"),
        (dict(top_k=-1), "top_k must be None.*-1"),
        (dict(top_k=2.5), "top_k must be None.*2.5"),
        (dict(min_p=-0.1), r"min_p must be in \[0, 1\]"),
        (dict(min_p=1.1), r"min_p must be in \[0, 1\]"),
        (dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
        (dict(max_tokens=True), "max_tokens must be an integer"),
        (dict(seed="7"), "seed must be an integer in"),
        (dict(seed=2**64), "seed must be an integer in"),
        (dict(temperature=10**400), "temperature must be a finite number"),
        (dict(stop=3), "stop must be a non-empty string or a list"),
        (dict(stop=["ok", ""]), "stop must be a non-empty string"),
        (dict(stop_token_ids=[1, -2]), "stop_token_ids must be a list of token ids"),
        (dict(stop_token_ids=5), "stop_token_ids must be a list"),
        (dict(ignore_eos="yes"), "ignore_eos must be True or False"),
    ],
)
def test_impossible_parameters_are_refused_naming_the_value_and_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_stop_accepts_a_single_string_and_params_are_frozen():
    p = SamplingParams(stop="\n\n", stop_token_ids=(3, 4))
    assert p.stop == ["\n\n"] and p.stop_token_ids == [3, 4]
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    with pytest.raises(AttributeError):
        p.temperature = 0.0


def test_sample_checks_the_batch_shapes():
    with pytest.raises(ValueError, match="1 SamplingParams but 2 generators"):
        sample(random_logits(1), [SamplingParams()], [None, None])
    with pytest.raises(ValueError, match="B = len\\(params\\) = 2"):
        filter_logits(random_logits(3), [SamplingParams()] * 2)
