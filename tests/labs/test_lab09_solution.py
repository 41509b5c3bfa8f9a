"""Lab 9's solution against nanolab: its docstring examples, `propose_ngram`, `verify_greedy` and
`expected_tokens_per_step` on random inputs, `rollback` against nanolab's block manager, the setup's `KVPool`
against nanolab's allocator, and the solution's sampler against the exact output distribution the hidden tests
use."""

from __future__ import annotations

import doctest
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.grading_utils import solution_namespace

from labkit.lab09 import KVPool, Seq, draw_many
from nanolab.engine import speculative
from nanolab.memory.block_allocator import BlockAllocator
from nanolab.memory.block_manager import BlockManager

LAB09 = Path(__file__).resolve().parents[2] / "solutions" / "lab09_speculative_decoding.ipynb"
HIDDEN = Path(__file__).resolve().parents[2] / "autograder" / "tests" / "test_lab09.py"


@pytest.fixture(scope="module")
def lab09() -> dict:
    return solution_namespace(LAB09.name)


@pytest.fixture(scope="module")
def hidden(pytestconfig) -> dict:
    """The hidden tests' module namespace (its exact distribution and chi-square test)."""
    for marker in ("points(n): a hidden test's points", "visibility(v): a hidden test's visibility"):
        pytestconfig.addinivalue_line("markers", marker)  # the grader's markers, which the module applies
    namespace: dict = {"__name__": "lab09_hidden"}
    exec(compile(HIDDEN.read_text(), str(HIDDEN), "exec"), namespace)
    return namespace


def test_lab09_docstring_examples_run_on_the_solution(lab09):
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner()
    names = ("propose_ngram", "verify_greedy", "rejection_sample", "rollback", "expected_tokens_per_step")
    tests = [t for name in names for t in finder.find(lab09[name], name, globs=lab09)]
    assert sum(len(t.examples) for t in tests) >= 12
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


def test_lab09_solution_agrees_with_nanolab_on_random_inputs(lab09):
    rng = random.Random(9)
    for _ in range(400):
        tokens = [rng.randint(1, rng.choice([2, 3, 8])) for _ in range(rng.randint(0, 40))]
        k, lo = rng.randint(0, 6), rng.randint(1, 3)
        hi = lo + rng.randint(0, 3)
        assert lab09["propose_ngram"](tokens, k, lo, hi) == speculative.propose_ngram(tokens, k, lo, hi)
        target = [rng.randint(0, 5) for _ in range(k + 1)]
        draft = [t if rng.random() < 0.7 else rng.randint(0, 5) for t in target[:k]]
        assert lab09["verify_greedy"](draft, target) == speculative.verify_greedy(draft, target)
        a = rng.random()
        assert lab09["expected_tokens_per_step"](a, k) == pytest.approx(
            speculative.expected_tokens_per_step(a, k)
        )


def test_lab09_rollback_agrees_with_nanolabs_block_manager(lab09):
    rng = random.Random(3)
    for _ in range(300):
        bs = rng.choice([1, 2, 4, 8])
        num_tokens = rng.randint(1, 50)
        computed = rng.randint(0, num_tokens + 8)
        held = max(-(-num_tokens // bs), -(-computed // bs)) + rng.randint(0, 1)
        allocator = BlockAllocator(held + 3)
        want = SimpleNamespace(
            num_tokens=num_tokens, num_computed_tokens=computed, block_table=allocator.allocate(held)
        )
        BlockManager(allocator, bs).rollback(want)
        pool = KVPool(held + 3, bs)
        seq = Seq(num_tokens, computed, pool.allocate(held))
        lab09["rollback"](seq, pool)
        assert (seq.num_computed_tokens, seq.block_table) == (want.num_computed_tokens, want.block_table)
        assert pool.allocate(pool.num_free) == allocator.allocate(allocator.num_free)


def test_setup_pool_hands_out_and_takes_back_blocks_as_nanolabs_allocator():
    rng = random.Random(5)
    pool, allocator = KVPool(12, 4), BlockAllocator(12)
    held: list[int] = []
    for _ in range(300):
        if held and rng.random() < 0.45:
            ids = rng.sample(held, rng.randint(1, len(held)))
            pool.free(ids)
            allocator.free(ids)
            for b in ids:
                held.remove(b)
        elif held and rng.random() < 0.2:
            b = rng.choice(held)
            pool.incref([b])
            allocator.incref([b])
            held.append(b)
        else:
            n = rng.randint(0, 3)
            if n <= allocator.num_free:
                got = pool.allocate(n)
                assert got == allocator.allocate(n)
                held += got
        assert pool.num_free == allocator.num_free
        assert [pool.ref_count(b) for b in range(12)] == [allocator.ref_count(b) for b in range(12)]
    free_before = pool.num_free
    with pytest.raises(ValueError):
        pool.free([0, 0] if pool.ref_count(0) < 2 else [99])
    assert pool.num_free == free_before  # a refused free changes nothing


def test_draw_many_checks_its_arguments_and_the_samplers_outputs():
    p = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    with pytest.raises(ValueError, match="not both"):
        draw_many(speculative.rejection_sample, [0], p, p[:1], n=2)
    with pytest.raises(ValueError, match="not both"):
        draw_many(speculative.rejection_sample, None, p, None, n=2)
    with pytest.raises(TypeError, match="list of ints"):
        draw_many(lambda *a: (0,), [0], p, None, n=2)
    counts = draw_many(speculative.rejection_sample, None, p, p[:1], n=50, seed=1)
    assert sum(counts.values()) == 50 and all(len(key) == 2 for key in counts)  # p = q: every guess kept


def test_solution_sampler_passes_the_hidden_distribution_test_and_a_wrong_residual_fails_it(lab09, hidden):
    """The exact distribution the hidden tests compare with is a correct sampler's (nanolab's and the solution's
    follow it), and the chi-square test rejects a sampler that draws its replacement from p instead of the residual."""
    rng = random.Random(1)
    p = hidden["_random_probs"](rng, 3, 4)
    q = hidden["_random_probs"](rng, 2, 4)
    probs = hidden["exact_distribution"](p, q, None)
    assert sum(probs.values()) == pytest.approx(1.0)
    for sampler in (speculative.rejection_sample, lab09["rejection_sample"]):
        counts = draw_many(sampler, None, p, q, n=6000, seed=2)
        assert hidden["chi_square_p_value"](counts, probs) > 1e-3

    def wrong(draft, target_probs, draft_probs, generator):  # the replacement drawn from p itself
        out = []
        for i, x in enumerate(draft):
            if float(torch.rand(1, generator=generator)) * float(draft_probs[i, x]) < float(
                target_probs[i, x]
            ):
                out.append(x)
                continue
            return [*out, int(torch.multinomial(target_probs[i], 1, generator=generator))]
        return [*out, int(torch.multinomial(target_probs[len(draft)], 1, generator=generator))]

    counts = draw_many(wrong, None, p, q, n=6000, seed=2)
    assert hidden["chi_square_p_value"](counts, probs) < 1e-6
