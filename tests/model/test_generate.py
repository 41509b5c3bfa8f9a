"""The single-request generate loop: same tokens as a cache-free loop and as HF generate; stops correctly."""

from __future__ import annotations

import pytest
import torch
from helpers.engine_utils import spread_out
from helpers.hf_models import KINDS, VOCAB, save_tiny_hf_model

from nanolab.model.config import ModelConfig
from nanolab.model.generate import generate
from nanolab.model.loading import load_model
from nanolab.model.sampling import SamplingParams, make_generator, sample
from nanolab.model.transformer import Transformer

ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .:()"


class CharTokenizer:
    """One token per character of ALPHABET; ``eos_token_id`` is whatever a test sets."""

    def __init__(self, eos_token_id: int | None = None) -> None:
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        return [ALPHABET.index(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(ALPHABET[i] if i < len(ALPHABET) else "?" for i in ids)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model(request) -> Transformer:
    config = ModelConfig(arch=request.param, vocab_size=len(ALPHABET) + 1, n_layers=2, n_heads=4,
                         n_kv_heads=4 if request.param == "gpt2" else 2, d_model=32, d_ff=64, max_seq_len=40)  # fmt: skip
    return spread_out(Transformer(config))


@torch.no_grad()
def reference_loop(model, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    """The same decoding without a KV cache: recompute the whole sequence for every new token."""
    ids, generator = list(prompt), make_generator(params.seed)
    for _ in range(n):
        logits = model.logits(torch.tensor([ids]))[:, -1]
        ids.append(int(sample(logits, [params], [generator])[0]))
    return ids[len(prompt) :]


def test_greedy_generate_equals_the_cache_free_loop(model):
    for prompt in ([1], [5, 9, 2, 7], list(range(12))):
        out = generate(model, None, prompt, max_new_tokens=20)
        assert out.token_ids == reference_loop(model, prompt, 20, SamplingParams(temperature=0))
        assert out.finish_reason == "length" and out.text is None


def test_seeded_sampling_is_reproducible_and_equals_the_cache_free_loop(model):
    params = SamplingParams(temperature=1.0, top_k=20, seed=5, max_tokens=15)
    first = generate(model, None, [3, 4, 5], sampling=params)
    assert first == generate(model, None, [3, 4, 5], sampling=params)
    assert first.token_ids == reference_loop(model, [3, 4, 5], 15, params)
    assert len(first.token_ids) == 15


def test_text_prompts_are_encoded_and_outputs_decoded(model):
    tok = CharTokenizer()
    out = generate(model, tok, "def f(x):", max_new_tokens=8)
    assert out.token_ids == generate(model, None, tok.encode("def f(x):"), max_new_tokens=8).token_ids
    assert out.text == tok.decode(out.token_ids)


def first_new_token(ids: list[int]) -> int:
    """Index k >= 1 of the first token that did not occur before it."""
    return next(k for k in range(1, len(ids)) if ids[k] not in ids[:k])


# Seeded sampling: the same tokens on every run until a stop condition cuts it short (a random tiny
# model's greedy output tends to repeat one token, which would make these tests vacuous).
SEEDED = dict(temperature=1.5, seed=0, max_tokens=20)


def test_generation_stops_at_eos_unless_ignore_eos(model):
    prompt = [1, 2, 3]
    full = generate(model, None, prompt, sampling=SamplingParams(**SEEDED)).token_ids
    k = first_new_token(full)
    tok = CharTokenizer(eos_token_id=full[k])
    out = generate(model, tok, prompt, sampling=SamplingParams(**SEEDED))
    assert out == (tok.decode(full[:k]), full[: k + 1], "stop")  # eos is kept in the ids, not in the text
    ignoring = generate(model, tok, prompt, sampling=SamplingParams(**SEEDED, ignore_eos=True))
    assert ignoring.token_ids == full and ignoring.finish_reason == "length"
    by_id = generate(model, None, prompt, sampling=SamplingParams(**SEEDED, stop_token_ids=[full[k]]))
    assert by_id.token_ids == full[: k + 1] and by_id.finish_reason == "stop"


def test_stop_strings_end_generation_and_are_cut_from_the_text(model):
    tok = CharTokenizer()
    prompt = [7, 8]
    full = generate(model, None, prompt, sampling=SamplingParams(**SEEDED)).token_ids
    text = tok.decode(full)
    stop = text[4:6]
    at = text.find(stop)
    out = generate(model, tok, prompt, sampling=SamplingParams(**SEEDED, stop=[stop, "never"]))
    assert out == (text[:at], full[: at + len(stop)], "stop")


def test_generation_stops_at_the_models_max_seq_len(model):
    prompt = list(range(36))  # max_seq_len is 40
    out = generate(model, None, prompt, max_new_tokens=10)
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


@pytest.mark.parametrize(
    "tokenizer, prompt, kwargs, message",
    [
        (None, [], {}, "prompt is empty"),
        (None, "abc", {}, "a text prompt needs a tokenizer"),
        (None, list(range(40)), {}, "prompt has 40 tokens but max_seq_len is 40; shorten it to at most 39"),
        (None, [1, 999], {}, "prompt token ids must be in \\[0, 68\\).*\\[999\\]"),
        (None, [1], {"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
        (None, [1], {"sampling": SamplingParams(stop=["x"])}, "stop strings need a tokenizer"),
    ],
)
def test_bad_requests_are_refused_with_what_to_do(model, tokenizer, prompt, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(model, tokenizer, prompt, **kwargs)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generate_equals_hf_generate_on_the_same_weights(kind, tmp_path):
    hf_model = save_tiny_hf_model(kind, tmp_path)
    model = load_model(tmp_path)
    g = torch.Generator().manual_seed(1)
    for length in (1, 5, 17):
        prompt = torch.randint(0, VOCAB, (1, length), generator=g)
        with torch.no_grad():
            expected = hf_model.generate(prompt, max_new_tokens=20, do_sample=False)[0, length:].tolist()
        assert len(expected) == 20
        assert generate(model, None, prompt[0].tolist(), max_new_tokens=20).token_ids == expected
