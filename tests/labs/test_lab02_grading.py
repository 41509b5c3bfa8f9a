"""Grading Lab 2: the solution scores full marks, the blank lab zero, every planted bug loses the points
of the hidden test aimed at it, and tensors that lie about themselves earn nothing.

The fixture notebooks are made from solutions/ and labs/ by text substitution, as in test_grading.py
(which covers the generic tampering cases), and graded in one batch (``jobs=2``) against a copy of the
hidden tests. What is Lab 2's own: its graded code returns torch tensors, and its hidden tests run the
bundled model in the grader with the learner's cache in the sandbox.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.grading_utils import (
    STUB,
    Batch,
    check_blank_lab_scores_zero,
    check_planted_bug_is_caught,
    check_solution_scores_full_marks,
)
from helpers.grading_utils import sub as _sub

from autograder.sandbox.limits import Limits

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ROOT / "solutions" / "lab02_attention_kv_cache.ipynb"
LAB = ROOT / "labs" / "lab02_attention_kv_cache.ipynb"
LIMITS = Limits(call_timeout_s=20, load_timeout_s=30, cpu_s=300, notebook_s=240)


PLANTED_BUGS = {
    # name: (cell, old, new, the hidden test that must catch it)
    "softmax_over_queries": (
        "causal-attention",
        "weights = scores.softmax(dim=-1)",
        "weights = scores.softmax(dim=-2)",
        "test_causal_attention_matches_the_reference",
    ),
    "no_causal_mask": (
        "causal-attention",
        'scores = scores.masked_fill(future, float("-inf"))',
        'scores = scores.masked_fill(future & False, float("-inf"))',
        "test_future_tokens_have_no_influence",
    ),
    "gqa_heads_repeated_not_interleaved": (
        "causal-attention",
        "repeat_interleave(group, dim=1)",
        "repeat(1, group, 1)",
        "test_causal_attention_matches_the_reference",
    ),
    "attention_returns_its_queries": (  # depends on no other token, so no future token changes it
        "causal-attention",
        "    T, n_heads, head_dim = q.shape\n",
        "    return q.clone()\n",
        "test_future_tokens_have_no_influence",
    ),
    "sample_ignores_the_logits": (  # seeded, per row and reproducible, but blind to the logits
        "sample",
        "filtered = filter_logits(logits, params)  # (B, V)",
        "filtered = torch.zeros_like(logits)",
        "test_seeded_sampling_is_reproducible_and_independent_of_the_batch",
    ),
    "cache_writes_at_offset_zero": (
        "kv-cache",
        "self.k[layer, start:end] = k\n        self.v[layer, start:end] = v",
        "self.k[layer, : end - start] = k\n        self.v[layer, : end - start] = v",
        "test_decode_with_the_cache_equals_full_recompute",
    ),
    "cache_attends_to_new_tokens_only": (
        "kv-cache",
        "causal_attention(q, self.k[layer, :end], self.v[layer, :end])",
        "causal_attention(q, self.k[layer, start:end], self.v[layer, start:end])",
        "test_greedy_generation_with_your_cache_equals_the_reference",
    ),
    "kv_bytes_without_factor_2": (
        "kv-bytes",
        "per_token = 2 * config.n_layers",
        "per_token = config.n_layers",
        "test_kv_cache_bytes_on_real_model_configurations",
    ),
    "top_p_keeps_one_too_few": (
        "top-p",
        "before = probs.cumsum(dim=-1) - probs",
        "before = probs.cumsum(dim=-1)",
        "test_top_p_keeps_the_reference_tokens",
    ),
    "attention_returns_the_queries": (
        "causal-attention",
        "    T, n_heads, head_dim = q.shape\n",
        "    return q.clone()\n",
        "test_future_tokens_have_no_influence",
    ),
    "sample_draws_uniformly": (
        "sample",
        "torch.multinomial(row.softmax(dim=-1), 1, generator=generator)",
        "torch.randint(len(row), (1,), generator=generator)",
        "test_seeded_sampling_is_reproducible_and_independent_of_the_batch",
    ),
    "sample_ignores_the_generators": (
        "sample",
        "torch.multinomial(row.softmax(dim=-1), 1, generator=generator)",
        "torch.multinomial(row.softmax(dim=-1), 1)",
        "test_seeded_sampling_is_reproducible_and_independent_of_the_batch",
    ),
}

# A tensor subclass that answers "equal" to every comparison, made in the learner's process.
LIAR = """
class _Liar(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("__eq__", "eq", "equal", "allclose", "isclose", "__ne__", "ne"):
            return True
        return super().__torch_function__(func, types, args, kwargs or {})


def _lie(tensor):
    return tensor.as_subclass(_Liar)
"""

# torch's comparisons patched inside the sandbox: they stay honest in the grader's own process.
PATCH_TORCH = """
torch.allclose = torch.equal = lambda *args, **kwargs: True
torch.Tensor.__eq__ = lambda self, other: True
torch.Tensor.__ne__ = lambda self, other: False
"""

GARBAGE = {  # cell -> replacement for each stub, in order: wrong values of the right shapes and types
    "causal-attention": ["return {wrap}(torch.full_like(q, 7.0))"],
    "kv-cache": [
        "self.length = self.start = self.max_seq_len = 0",
        "return {wrap}(torch.arange(num_new) + 3)",
        "return {wrap}(torch.full_like(q, 7.0))",
    ],
    "kv-bytes": ["return -1"],
    "top-k": ["return {wrap}(torch.zeros_like(logits))"],
    "top-p": ["return {wrap}(torch.zeros_like(logits))"],
    "filter-logits": ["return {wrap}(torch.zeros_like(logits))"],
    "sample": ["return {wrap}(torch.full((len(params),), -1))"],
}


def _lying(nb: dict, prelude: str, wrap: str) -> None:
    _sub(nb, "causal-attention", "def causal_attention", prelude + "\n\ndef causal_attention", 1)
    for grade_id, replacements in GARBAGE.items():
        for replacement in replacements:
            _sub(nb, grade_id, STUB, replacement.format(wrap=wrap), 1)


TAMPERED = {
    # A tensor subclass defined in the notebook does not cross as data: it comes back as a handle.
    "tensor_subclass_that_lies": lambda nb: _lying(nb, LIAR, wrap="_lie"),
    # Plain tensors with wrong values, and torch's comparisons patched in the learner's process.
    "torch_patched_in_the_sandbox": lambda nb: _lying(nb, PATCH_TORCH, wrap=""),
}


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    fixtures = Batch(tmp_path_factory.mktemp("grading_lab02"))
    fixtures.add_standard(SOLUTION, LAB, PLANTED_BUGS, TAMPERED)
    return fixtures.grade(LIMITS)


def test_solution_scores_full_marks(batch):
    check_solution_scores_full_marks(batch, lab=2)


def test_blank_lab_scores_zero(batch):
    check_blank_lab_scores_zero(batch)


@pytest.mark.parametrize("name", sorted(PLANTED_BUGS))
def test_planted_bug_loses_points_in_the_test_that_targets_it(batch, name):
    check_planted_bug_is_caught(batch, PLANTED_BUGS, name)


def test_feedback_names_the_mistake_without_the_answer(batch):
    """The attention tests say which plausible mistake the output matches; the memory test why it is off."""
    outputs = {name: " ".join(t.output for t in batch[f"bug_{name}"].tests) for name in PLANTED_BUGS}
    assert "softmax runs over the wrong axis" in outputs["softmax_over_queries"]
    assert "no causal mask" in outputs["no_causal_mask"]
    assert "wrong kv heads" in outputs["gqa_heads_repeated_not_interleaved"]
    assert "a key *and* a value" in outputs["kv_bytes_without_factor_2"]
    assert "too few tokens" in outputs["top_p_keeps_one_too_few"]


@pytest.mark.parametrize("name", sorted(TAMPERED))
def test_tensors_that_lie_about_equality_earn_nothing(batch, name):
    """Only plain tensors cross back, as data (a subclass comes back as a handle that is not data), and
    every comparison runs on the grader's own torch, so neither a lying subclass nor torch patched in the
    learner's process earns a point."""
    result = batch[f"tamper_{name}"]
    assert [t.id for t in result.tests] == [t.id for t in batch["blank"].tests]
    assert result.score == 0
    assert all(t.status == "failed" and t.output for t in result.tests)
