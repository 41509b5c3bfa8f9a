"""The bundled draft model, tinypy-draft: it speaks tinypy's tokens, its card's numbers hold, and as a
draft it gets guesses kept without changing tinypy's greedy output."""

from __future__ import annotations

import math
import platform
import re

import pytest
from helpers.engine_utils import compare_greedy, reference_greedy
from test_bundled_model import SAME_TEXT_TOLERANCE, card_number, card_row, script

from nanolab import LLM, SamplingParams
from nanolab.model.loading import ASSETS_DIR, load_model, load_tokenizer

DRAFT = ASSETS_DIR / "tinypy-draft"
TARGET = ASSETS_DIR / "tinypy"


def test_the_draft_uses_its_targets_tokenizer_and_is_a_fraction_of_its_size():
    assert (DRAFT / "nanolab_tokenizer.json").read_bytes() == (TARGET / "nanolab_tokenizer.json").read_bytes()
    draft, target = load_model("tinypy-draft"), load_model("tinypy")
    assert draft.config.vocab_size == target.config.vocab_size
    assert draft.num_parameters() < 0.5 * target.num_parameters()
    card = (DRAFT / "MODEL_CARD.md").read_text()
    assert card_number(card, "parameters") == draft.num_parameters()
    assert "draft model of `tinypy`" in card


def test_the_cards_check_sample_loss_and_agreement_hold():
    """The held-out check sample gives the card's loss; the draft agrees with tinypy on it about as often
    as the card says of the whole held-out set (a looser bound: it is a sample of it)."""
    card = (DRAFT / "MODEL_CARD.md").read_text()
    python = re.search(r"standard library of Python (\S+?)\s", card).group(1)
    if python != platform.python_version():
        pytest.skip(f"the card was measured on Python {python}'s standard library")
    train = script()
    draft, target, tokenizer = load_model("tinypy-draft"), load_model("tinypy"), load_tokenizer("tinypy")
    sample = train.check_sample(tokenizer, train.stdlib_dir(), draft.config.max_seq_len)
    check = float(re.match(r"[\d.]+", card_row(card, "check sample loss")).group())
    assert math.isclose(train.mean_loss(draft, sample), check, abs_tol=SAME_TEXT_TOLERANCE)
    agreement = train.draft_agreement(draft, target, sample)
    greedy = float(re.match(r"[\d.]+", card_row(card, "greedy agreement")).group())
    assert abs(agreement["greedy"] - greedy) < 0.1, (agreement, greedy)
    assert agreement["greedy"] > 0.2  # an untrained draft agrees on about 1 position in 4096


def test_as_a_draft_it_keeps_tinypys_greedy_output(record_property):
    tokenizer = load_tokenizer("tinypy")
    prompts = [
        tokenizer.encode(p) for p in ("def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n")
    ]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    spec = {"method": "draft_model", "model": "tinypy-draft", "num_speculative_tokens": 4}
    llm = LLM(speculative_config=spec)
    fast = llm.generate(prompts, params, use_tqdm=False)
    target = load_model("tinypy")
    ties = sum(
        compare_greedy(*reference_greedy(target, p, 40), o.outputs[0].token_ids)
        for p, o in zip(prompts, fast)
    )
    record_property("near_ties", ties)
    print(f"near-ties accepted: {ties}")
    stats = llm.stats()
    assert stats.spec_accepted_tokens > 0 and stats.forwards_per_token < 1
