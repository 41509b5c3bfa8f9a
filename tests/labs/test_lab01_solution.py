"""Lab 1's solution against nanolab: the setup's patterns and the learner functions' signatures."""

from __future__ import annotations

import inspect
from pathlib import Path

from helpers.grading_utils import solution_namespace

ROOT = Path(__file__).resolve().parents[2]


def _solution_namespace(name: str = "lab01_tokenizer.ipynb") -> dict:
    return solution_namespace(name)


def test_lab01_setup_patterns_are_the_reference_patterns():
    from nanolab.text.pretokenize import GPT2_PATTERN, GPT4_PATTERN

    namespace = _solution_namespace()
    assert namespace["GPT2_PATTERN"] == GPT2_PATTERN and namespace["GPT4_PATTERN"] == GPT4_PATTERN


def test_lab01_learner_functions_have_the_reference_signatures():
    from nanolab.text import bpe
    from nanolab.text.tokenizer import Tokenizer as Reference

    namespace = _solution_namespace()
    for name in ("pair_counts", "merge", "bpe_encode"):
        assert inspect.signature(namespace[name]) == inspect.signature(getattr(bpe, name)), name
    learner_train = list(inspect.signature(namespace["train_merges"]).parameters)
    assert learner_train == list(inspect.signature(bpe.train_merges).parameters)[: len(learner_train)]
    learner = namespace["Tokenizer"]
    for method in ("__init__", "train", "encode", "decode", "decode_bytes"):
        mine = list(inspect.signature(getattr(learner, method)).parameters)
        theirs = list(inspect.signature(getattr(Reference, method)).parameters)
        assert mine == theirs[: len(mine)], method
    tok = learner.train("the cat sat on the mat " * 20, 265, special_tokens=["<|endoftext|>"])
    reference = Reference.train("the cat sat on the mat " * 20, 265, special_tokens=["<|endoftext|>"])
    for attribute in ("vocab_size", "special_tokens", "eos_token_id"):
        assert getattr(tok, attribute) == getattr(reference, attribute), attribute
    assert tuple(tok.merges) == reference.merges
