"""Hidden tests for Lab 9 (speculative decoding): `propose_ngram` and `verify_greedy` against nanolab's on
random token sequences, the rejection sampler's whole output distribution (a chi-square test against the exact
distribution, computed here, with certain guesses and with guesses drawn from a draft distribution), its use
of the generator it is given, `rollback` against nanolab's block manager on random caches, the expected-tokens
formula, and the learner's pieces inside nanolab's engine on the bundled model and a tiny random Qwen2 model.

Distributions are sampled in the sandbox by the notebook's ``draw_many`` (the lab's own setup code: a graded
cell that binds the name again does not change what the tests call), so thousands of draws cost one call. In
the engine, the models run here and every call the engine makes to its proposer, its verification rules, its
rollback and its block allocator goes to the learner's code and the setup's `KVPool` in the sandbox; outputs are
compared with nanolab's own speculative engine run with the same settings, which takes the same steps.
Feedback says what is wrong and on which input, never the expected answer.
"""

from __future__ import annotations

import itertools
import math
import time
from types import SimpleNamespace

import pytest
import torch

import nanolab
from autograder.testing import (
    RemoteError,
    SandboxAllocator,
    bundled_model,
    expect,
    expect_value_error,
    spread_out,
    stdlib_text,
    tiny_qwen2_model,
)
from nanolab.engine import speculative as reference
from nanolab.engine.speculative import SpeculativeConfig, Speculator
from nanolab.memory.block_allocator import BlockAllocator
from nanolab.memory.block_manager import BlockManager
from nanolab.model.config import ModelConfig
from nanolab.model.transformer import Transformer

pytestmark = pytest.mark.usefixtures("torch_on_one_thread")

STDLIB_FILES = ("textwrap.py", "shlex.py", "fnmatch.py")
P_VALUE = 1e-6  # a correct sampler fails a distribution test about once in a million runs


# ---------------------------------------------------------------------------------------------- propose_ngram


def _ngram_cases(rng) -> list[tuple]:
    cases = [
        ([1, 2, 3, 4, 9, 1, 2, 3], 2, 1, 4),
        ([7, 8, 7, 8, 7], 4, 1, 4),
        ([6, 6], 3, 1, 4),
        ([9], 3, 1, 4),
        ([], 2, 1, 4),
        ([1, 2, 1, 2], 0, 1, 4),
        ([2, 5, 1, 2, 6, 7, 1, 2], 3, 1, 4),
        ([1, 2, 9, 1, 2], 2, 3, 5),
        ([4, 5, 9, 4, 5, 8, 4, 5], 3, 1, 2),
        ([3, 3, 3, 3, 3, 3], 4, 2, 3),
    ]
    for _ in range(250):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randint(1, vocab) for _ in range(rng.randint(0, 60))]
        if tokens and rng.random() < 0.3:  # a copied stretch, as in code
            start = rng.randrange(len(tokens))
            tokens += tokens[start : start + rng.randint(1, 12)]
        lo = rng.randint(1, 3)
        cases.append((tokens, rng.randint(0, 9), lo, lo + rng.randint(0, 4)))
    return cases


def _ngram_hint(tokens: list[int], k: int, got: list, want: list) -> str:
    if len(got) > k:
        return f" (more than k = {k} guesses)"
    if want and not got:
        return " (nothing, though the suffix occurs earlier)"
    if got and not want:
        return " (a guess, though no suffix of the allowed lengths occurs earlier)"
    if len(got) < len(want):
        return " (too few tokens: a guess stops only at k or at the end of the text)"
    return " (another match: try the longest suffix first, and its first earlier occurrence)"


@pytest.mark.points(2)
def test_propose_ngram_matches_the_reference(lab, rng):
    """Check propose_ngram against nanolab's on random token sequences (small vocabularies, copied stretches, k from 0 to 9, min_n and max_n from 1 to 7), texts of 0 and 1 tokens, and that it leaves the tokens it is given unchanged."""
    for tokens, k, lo, hi in _ngram_cases(rng):
        want = reference.propose_ngram(tokens, k, lo, hi)
        got = expect(lab.propose_ngram(tokens, k, lo, hi), list, "propose_ngram(...)")
        assert got == want, (
            f"propose_ngram on a {len(tokens)}-token text with k={k}, min_n={lo}, max_n={hi}: yours guessed "
            f"{len(got)} tokens" + _ngram_hint(tokens, k, got, want)
        )
    held = lab.hold([1, 2, 3, 1, 2])
    lab.propose_ngram(held, 3)
    assert lab.peek(held) == [1, 2, 3, 1, 2], "propose_ngram changed the token list it was given"


@pytest.mark.points(1)
def test_propose_ngram_speed_is_within_budget(lab, rng):
    """Check that 10 lookups on 12,000-token texts with no long repeat take at most 60x the CPU time of nanolab's + 1 s.

    The engine calls the proposer for every speculating request at every step, on the whole text so far.
    Reference figures on a 2-core machine: nanolab's (NumPy) about 0.03 s in all, so the budget is about
    3 s; the solution, a Python scan of the text for each suffix length, about 0.3 s. One that copies the
    text before each position it looks at is quadratic, and takes about a minute.
    """
    texts = []
    for _ in range(10):
        tokens = [rng.randint(1, 50) for _ in range(12_000)]
        texts.append(tokens)
    timings = []
    for _ in range(3):
        start = time.thread_time()
        want = [reference.propose_ngram(t, 4, 1, 4) for t in texts]
        timings.append(time.thread_time() - start)
    budget = 60 * min(timings) + 1.0
    with lab.time_limit(3 * budget + 10):
        before = lab.cpu_seconds()
        got = [lab.propose_ngram(t, 4, 1, 4) for t in texts]
        elapsed = lab.cpu_seconds() - before
    assert got == want, (
        "only a correct result counts: on the speed workload your guesses differ from nanolab's"
    )
    assert elapsed <= budget, (
        f"10 lookups on 12,000-token texts took {elapsed:.2f} s of CPU time; the budget is {budget:.2f} s "
        "(60x nanolab's + 1 s): compare each window with the suffix in place, without copying the text"
    )


# ---------------------------------------------------------------------------------------------- verify_greedy


@pytest.mark.points(1)
def test_verify_greedy_matches_the_reference(lab, rng):
    """Check verify_greedy against nanolab's on random guesses agreeing with the model for 0 to k tokens (k from 0 to 10), and ValueError for targets of the wrong length."""
    for _ in range(200):
        k = rng.randint(0, 10)
        target = [rng.randint(0, 30) for _ in range(k + 1)]
        agree = rng.randint(0, k)
        draft = target[:agree] + [rng.randint(0, 30) for _ in range(k - agree)]
        want = reference.verify_greedy(draft, target)
        got = expect(lab.verify_greedy(draft, target), list, "verify_greedy(...)")
        assert all(type(t) is int for t in got), "verify_greedy should return a list of ints"
        kept = len(want) - 1
        assert got == want, (
            f"verify_greedy with {k} guesses of which the first {kept} agree with the model: yours returned "
            f"{len(got)} tokens"
            + (" (the model's own token after the kept guesses is missing)" if len(got) == kept else "")
            + (" (guesses after the first mismatch must be dropped)" if len(got) > kept + 1 else "")
        )
    for k, n in [(2, 2), (1, 3), (0, 0), (3, 1)]:
        expect_value_error(
            lambda k=k, n=n: lab.verify_greedy(list(range(k)), list(range(n))),
            f"verify_greedy with {k} guesses and {n} target tokens should raise ValueError",
        )


# ---------------------------------------------------------------------------------------------- rejection_sample


def exact_distribution(
    p: torch.Tensor, q: torch.Tensor | None, draft: list[int] | None
) -> dict[tuple, float]:
    """The probability of every output of a correct rejection sampler, with guesses ``draft`` (certain) or
    drawn from the rows of ``q``: a run of kept guesses t_0 .. t_(i-1) (each kept with probability
    min(p_j(t), q_j(t)) once drawn), then a token y drawn from the residual, max(0, p_i(y) - q_i(y)), or,
    after all k guesses, from the last row."""
    k = p.shape[0] - 1
    if q is None:
        q = torch.zeros(k, p.shape[1], dtype=torch.float64)
        for i, x in enumerate(draft):
            q[i, x] = 1.0
    p, q = p.double(), q.double()
    kept = torch.minimum(p[:k], q)
    residual = (p[:k] - q).clamp_min(0.0)
    out: dict[tuple, float] = {}
    vocab = range(p.shape[1])
    for i in range(k + 1):
        for run in itertools.product(vocab, repeat=i):
            chance = math.prod(float(kept[j, t]) for j, t in enumerate(run))
            if chance == 0:
                continue
            last = p[k] if i == k else residual[i]
            for y in vocab:
                if float(last[y]) > 0:
                    out[(*run, y)] = out.get((*run, y), 0.0) + chance * float(last[y])
    return out


def why_impossible(key: tuple, p: torch.Tensor, q: torch.Tensor | None, draft: list[int] | None) -> str:
    """What rule an output of probability 0 breaks, in the lab's terms."""
    k = p.shape[0] - 1
    if not key:
        return "no token at all (a verification always yields at least the model's own token)"
    if len(key) > k + 1:
        return f"{len(key)} tokens from {k} guesses (at most k + 1)"
    for j, t in enumerate(key[:-1]):
        if draft is not None and t != draft[j]:
            return f"token {j} is not guess {j}, yet more tokens follow it (a replacement ends the step)"
        if float(p[j, t]) == 0:
            return f"guess {j} was kept though the model gives it probability 0"
    i, y = len(key) - 1, key[-1]
    if i == k:
        return "a bonus token the last row gives probability 0 (draw the bonus from the row after the last guess)"
    if draft is not None and y == draft[i]:
        return "a replacement equal to the rejected guess (take the guess out of the residual)"
    return "a replacement token that the residual max(0, p - q) gives probability 0"


def chi_square_p_value(counts: dict[tuple, int], probs: dict[tuple, float]) -> float:
    """Pearson's chi-square test of ``counts`` against ``probs`` (outcomes expected fewer than 5 times are
    pooled into one); 0 if an outcome of probability 0 was drawn."""
    n = sum(counts.values())
    if any(key not in probs for key in counts):
        return 0.0
    stat, df, pooled_seen, pooled_expected = 0.0, -1, 0, 0.0
    for key, prob in probs.items():
        expected = n * prob
        if expected < 5:
            pooled_seen += counts.get(key, 0)
            pooled_expected += expected
            continue
        stat += (counts.get(key, 0) - expected) ** 2 / expected
        df += 1
    if pooled_expected > 0:
        stat += (pooled_seen - pooled_expected) ** 2 / max(pooled_expected, 1e-9)
        df += 1
    if df < 1:
        return 1.0
    return float(
        torch.special.gammaincc(
            torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        )
    )


def _random_probs(rng, rows: int, vocab: int, zeros: bool = True) -> torch.Tensor:
    out = torch.tensor([[rng.random() ** 2 for _ in range(vocab)] for _ in range(rows)], dtype=torch.float64)
    if zeros:
        for r in range(rows):
            if rng.random() < 0.4:
                out[r, rng.randrange(vocab)] = 0.0
    out[:, 0] += 1e-3  # never an all-zero row
    return (out / out.sum(dim=1, keepdim=True)).float()


def _where(k: int, vocab: int, certain: bool) -> str:
    kind = "certain guesses (draft_probs None)" if certain else "guesses drawn from a draft distribution"
    return f"{k} guess{'es' if k != 1 else ''} over a vocabulary of {vocab}, {kind}"


def _draw(lab, draft, p, q, n: int, seed: int, where: str) -> dict[tuple, int]:
    try:
        with lab.time_limit(120):
            counts = lab.draw_many(lab.rejection_sample, draft, p, q, n, seed)
    except RemoteError as e:
        raise AssertionError(
            f"{where}: your rejection_sample raised {e.type_name}: {e.message[:160]}"
        ) from None
    return {tuple(key): value for key, value in expect(counts, dict, "draw_many(...)").items()}


def _check_distribution(lab, rng, certain: bool) -> None:
    for k, vocab in [(1, 3), (1, 6), (2, 4), (3, 3)]:
        p = _random_probs(rng, k + 1, vocab)
        q = None if certain else _random_probs(rng, k, vocab)
        # guesses the model often agrees with (its likeliest token) as well as random ones: runs of kept guesses
        draft = [int(p[j].argmax()) if rng.random() < 0.6 else rng.randrange(vocab) for j in range(k)]
        draft = draft if certain else None
        where = _where(k, vocab, certain)
        counts = _draw(lab, draft, p, q, 6000, rng.randrange(2**31), where)
        probs = exact_distribution(p, q, draft)
        impossible = [key for key in counts if key not in probs]
        assert not impossible, (
            f"{where}: your sampler returned an output a correct one never gives: "
            + why_impossible(impossible[0], p, q, draft)
        )
        p_value = chi_square_p_value(counts, probs)
        firsts: dict[int, int] = {}
        for key, n in counts.items():
            firsts[key[0]] = firsts.get(key[0], 0) + n
        first_p = chi_square_p_value(
            {(t,): n for t, n in firsts.items()}, {(t,): float(p[0, t]) for t in range(vocab)}
        )
        assert p_value > P_VALUE, (
            f"{where}: over 6000 draws your outputs do not follow the target's distribution (chi-square p-value "
            f"{p_value:.1e}"
            + (f"; the first token alone is off too, p-value {first_p:.1e}" if first_p < P_VALUE else "; the first token alone looks right")
            + "): check the acceptance test min(1, p/q), the residual max(0, p - q) and the bonus token's row"
        )  # fmt: skip


@pytest.mark.points(2)
def test_rejection_sampler_keeps_the_target_distribution_with_certain_guesses(lab, rng):
    """Check that with certain guesses (draft_probs None) every output of your sampler, not only its first token, has the probability a correct sampler gives it (chi-square over 6000 draws against the exact distribution, 1 to 3 guesses, vocabularies of 3 to 6 with some zero probabilities)."""
    _check_distribution(lab, rng, certain=True)


@pytest.mark.points(2)
def test_rejection_sampler_keeps_the_target_distribution_with_a_draft(lab, rng):
    """Check that with guesses drawn from a draft distribution q every output of your sampler has the probability a correct sampler gives it (chi-square over 6000 draws against the exact distribution, 1 to 3 guesses, vocabularies of 3 to 6)."""
    _check_distribution(lab, rng, certain=False)


@pytest.mark.points(1)
def test_rejection_sampler_uses_the_generator_and_handles_edges(lab, rng):
    """Check that your sampler draws every random number from the generator it is given (the same seed, the same outputs), that no guesses give one token from the first row, that p = q keeps every guess, that a guess of probability 0 is never kept, and ValueError for target_probs of the wrong shape."""
    p = _random_probs(rng, 3, 5)
    seed = rng.randrange(2**31)
    first = _draw(lab, [1, 2], p, None, 300, seed, _where(2, 5, True))
    again = _draw(lab, [1, 2], p, None, 300, seed, _where(2, 5, True))
    assert first == again, (
        "300 draws with a generator seeded alike gave other outputs the second time: draw every random number "
        "from the generator you are given (torch.rand(..., generator=generator), torch.multinomial(..., generator=generator))"
    )
    none = _draw(lab, [], p[:1], None, 2000, seed, "no guesses")
    assert all(len(key) == 1 for key in none), "with no guesses the sampler returns exactly one token"
    p_value = chi_square_p_value(none, {(t,): float(p[0, t]) for t in range(5) if float(p[0, t]) > 0})
    assert p_value > P_VALUE, (
        f"with no guesses your token does not follow the first row (p-value {p_value:.1e})"
    )
    same = _draw(lab, None, p, p[:2], 500, seed, "p equal to q")
    assert all(len(key) == 3 for key in same), "where q equals p every guess must be kept (min(1, p/q) = 1)"
    p0 = p.clone()
    p0[0] = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0])
    zero = _draw(lab, [0, 1], p0, None, 500, seed, "a first guess of probability 0")
    assert all(key[0] != 0 for key in zero), "a guess the model gives probability 0 must never be kept"
    for rows in (2, 4):
        expect_value_error(
            lambda rows=rows: lab.rejection_sample([1, 2], torch.full((rows, 5), 0.2)),
            f"rejection_sample with 2 guesses and target_probs of {rows} rows should raise ValueError",
        )


# ---------------------------------------------------------------------------------------------- rollback


def _rollback_cases(rng) -> list[tuple[int, int, int, int]]:
    """(block_size, num_tokens, num_computed_tokens, blocks held) as a verification leaves them."""
    cases = [(4, 6, 9, 3), (4, 8, 9, 3), (4, 9, 9, 3), (4, 4, 8, 2), (4, 7, 3, 2), (1, 3, 7, 7), (4, 1, 4, 1)]
    for _ in range(120):
        bs = rng.choice([1, 2, 3, 4, 8, 16])
        before = rng.randint(1, 70)  # tokens before the step
        k = rng.randint(0, 8)
        written = before + k  # the last token and k guesses were computed
        kept = rng.randint(0, k)  # guesses kept; the model's own token comes on top
        num_tokens = before + kept + 1
        computed = written if rng.random() < 0.85 else rng.randint(0, num_tokens - 1)  # a partly computed one
        held = max(-(-written // bs), -(-num_tokens // bs)) + rng.choice([0, 0, 0, 1])
        cases.append((bs, num_tokens, computed, held))
    return cases


@pytest.mark.points(2)
def test_rollback_matches_the_reference(lab, rng):
    """Check rollback against nanolab's block manager on random caches (block sizes 1 to 16, 0 to 8 guesses of which any number were kept, partly computed requests, kept tokens ending inside and at block edges): num_computed_tokens, the block table, which blocks went back to the pool and in which order."""
    for bs, num_tokens, computed, held in _rollback_cases(rng):
        where = (
            f"block size {bs}, {num_tokens} tokens kept, {computed} tokens' keys and values computed, "
            f"{held} blocks in the table"
        )
        ref_allocator = BlockAllocator(held + 4)
        want = SimpleNamespace(
            num_tokens=num_tokens, num_computed_tokens=computed, block_table=ref_allocator.allocate(held)
        )
        BlockManager(ref_allocator, bs).rollback(want)
        pool = lab.KVPool(held + 4, bs)
        seq = lab.Seq(num_tokens, computed, pool.allocate(held))
        try:
            result = lab.rollback(seq, pool)
        except RemoteError as e:
            raise AssertionError(f"{where}: your rollback raised {e.type_name}: {e.message[:160]}") from None
        assert result is None, f"{where}: rollback changes the request in place and returns None"
        got_computed = expect(seq.num_computed_tokens, int, "num_computed_tokens")
        got_table = expect(seq.block_table, list, "block_table")
        assert expect(seq.num_tokens, int, "num_tokens") == num_tokens, (
            f"{where}: rollback must not change num_tokens"
        )
        assert got_computed == want.num_computed_tokens, (
            f"{where}: num_computed_tokens is {got_computed} after your rollback"
            + (" (more than the kept tokens minus the last, which is computed next step)" if got_computed > num_tokens - 1 else "")
            + (" (a request whose tokens were not all computed keeps its smaller count)" if computed < num_tokens - 1 and got_computed < computed else "")
        )  # fmt: skip
        assert got_table == want.block_table, (
            f"{where}: your table holds {len(got_table)} blocks after the rollback: keep, in order, the blocks that "
            "hold the kept tokens' positions, and no others"
        )
        assert pool.num_free == ref_allocator.num_free, (
            f"{where}: the pool has {pool.num_free} free blocks after your rollback: the blocks dropped from the "
            "table go back to it, the others stay held"
        )
        # what comes back first, in order, is what the pool had free: the dropped blocks freed in table order
        assert pool.allocate(pool.num_free) == ref_allocator.allocate(ref_allocator.num_free), (
            f"{where}: the blocks went back to the pool in another order: free the dropped blocks in table order"
        )


@pytest.mark.points(1)
def test_rollback_changes_nothing_when_the_pool_refuses(lab, rng):
    """Check that when the pool refuses the blocks (the last of them not held), rollback raises its ValueError and leaves the request's count and table, and the pool, as they were."""
    for _ in range(10):
        bs = rng.choice([2, 4, 8])
        num_tokens = rng.randint(1, 20)
        keep = -(-num_tokens // bs)
        extra = rng.randint(2, 4)
        pool = lab.KVPool(keep + extra + 2, bs)
        table = pool.allocate(keep + extra)
        pool.free([table[-1]])  # the pool no longer holds the last block of the table
        computed = num_tokens + rng.randint(0, bs * extra - 1)
        seq = lab.Seq(num_tokens, computed, table)
        free_before = pool.num_free
        expect_value_error(
            lambda seq=seq, pool=pool: lab.rollback(seq, pool),
            "rollback over a table whose last block the pool does not hold should raise the pool's ValueError",
        )
        assert (seq.num_computed_tokens, seq.block_table) == (computed, table), (
            f"block size {bs}, {num_tokens} tokens, {computed} computed: after the pool refused, your rollback "
            "left num_computed_tokens or the table changed (check before you change anything, or free first)"
        )
        assert pool.num_free == free_before, (
            f"block size {bs}, {num_tokens} tokens, {len(table)} blocks of which the last is not held: after the "
            "pool refused, some blocks had been freed all the same (give the dropped blocks back in one pool.free call)"
        )


# ---------------------------------------------------------------------------------------------- expected tokens


@pytest.mark.points(1)
def test_expected_tokens_per_step_matches_the_reference(lab, rng):
    """Check expected_tokens_per_step against nanolab's for random rates (0, 1 and rates within 1e-9 of 1 included) and k from 0 to 16, and ValueError for rates outside [0, 1] and negative k."""
    cases = [(0.0, 3), (1.0, 5), (0.5, 0), (1 - 1e-12, 4), (1e-12, 2)]
    cases += [(rng.random(), rng.randint(0, 16)) for _ in range(100)]
    for rate, k in cases:
        want = reference.expected_tokens_per_step(rate, k)
        got = expect(lab.expected_tokens_per_step(rate, k), (float, int), "expected_tokens_per_step(...)")
        assert math.isclose(got, want, rel_tol=1e-6), (
            f"expected_tokens_per_step({rate!r}, {k}) is {got!r}: count the model's own token, then one more for each "
            "guess kept in a row"
        )
    for rate, k in [(-0.01, 2), (1.01, 2), (0.5, -1)]:
        expect_value_error(
            lambda rate=rate, k=k: lab.expected_tokens_per_step(rate, k),
            f"expected_tokens_per_step({rate}, {k}) should raise ValueError",
        )


# ---------------------------------------------------------------------------------------------- in the engine


class SandboxNgram:
    """A proposer whose guesses come from the learner's propose_ngram."""

    def __init__(self, lab) -> None:
        self.lab = lab

    def propose(self, requests, num_tokens) -> list[list[int]]:
        out = []
        for r, k in zip(requests, num_tokens):
            guess = (
                expect(self.lab.propose_ngram(r.all_token_ids, k), list, "propose_ngram(...)")
                if k > 0
                else []
            )
            if len(guess) > k or not all(type(t) is int for t in guess):
                raise AssertionError(
                    f"in the engine, propose_ngram asked for {k} guesses returned {len(guess)} values"
                )
            out.append(guess)
        return out


def learners_speculator(lab, config: SpeculativeConfig, pool, proposer=None) -> Speculator:
    """A Speculator whose proposer (n-gram unless given), verification, sampler and rollback are the learner's."""

    def verify(draft, target):
        return expect(lab.verify_greedy(list(draft), list(target)), list, "verify_greedy(...)")

    def sample(draft, target_probs, draft_probs, generator):
        # a generator cannot cross into the sandbox: the learner's sampler draws from the sandbox's own
        return expect(
            lab.rejection_sample(list(draft), target_probs, draft_probs), list, "rejection_sample(...)"
        )

    def rollback(request, block_manager):
        seq = lab.Seq(request.num_tokens, request.num_computed_tokens, list(request.block_table))
        lab.rollback(seq, pool)
        request.num_computed_tokens = expect(seq.num_computed_tokens, int, "num_computed_tokens")
        request.block_table = expect(seq.block_table, list, "block_table")

    return Speculator(config, proposer or SandboxNgram(lab), verify, sample, rollback)


def run_capped(llm, prompts, params, what: str, max_steps: int = 2000) -> list[list[int]]:
    """Each prompt's output tokens, the engine stepped at most ``max_steps`` times."""
    requests = llm.engine.add_requests(prompts, params)
    for _ in range(max_steps):
        if not llm.engine.has_unfinished():
            return [list(r.output_token_ids) for r in requests]
        try:
            llm.engine.step()
        except RemoteError as e:
            raise AssertionError(
                f"{what}: your code raised {e.type_name} when the engine called it: {e.message[:160]}"
            ) from None
    raise AssertionError(f"{what}: the requests had not finished after {max_steps} engine steps")


def _compare_in_engine(lab, model, tokenizer, prompts, params, settings: dict, k: int, what: str) -> None:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=k)
    nb, bs = settings["num_blocks"], settings["block_size"]
    reference_llm = nanolab.LLM(model, tokenizer, speculative_config=config, **settings)
    want = run_capped(reference_llm, prompts, params, what)
    remote_pool = lab.KVPool(nb, bs)
    pool = SandboxAllocator(remote_pool)
    yours = nanolab.LLM(model, tokenizer, block_allocator=pool, speculator=learners_speculator(lab, config, remote_pool), **settings)  # fmt: skip
    got = run_capped(yours, prompts, params, what)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a == b, (
            f"{what}: prompt {i} ({len(prompts[i])} tokens) was continued differently with your pieces than with "
            "nanolab's (the same guesses checked the same way must keep the same tokens, and the next step must "
            "start from the right place in the cache)"
        )
    mine, theirs = yours.stats(), reference_llm.stats()
    assert (mine.spec_draft_tokens, mine.spec_accepted_tokens) == (
        theirs.spec_draft_tokens,
        theirs.spec_accepted_tokens,
    ), (
        f"{what}: your pieces checked {mine.spec_draft_tokens} guesses and kept {mine.spec_accepted_tokens}; "
        f"nanolab's checked {theirs.spec_draft_tokens} and kept {theirs.spec_accepted_tokens}"
    )
    cached = yours.engine.block_manager.prefix_cache.total_size // bs
    assert pool.num_free + cached == nb, (
        f"{what}: every request finished, yet {nb - pool.num_free - cached} blocks are still held: the blocks "
        "past a request's kept tokens must go back to the pool"
    )


@pytest.mark.points(3)
def test_your_pieces_in_the_engine_keep_the_reference_outputs(lab, rng):
    """Check that nanolab's engine on the bundled model, speculating with your propose_ngram, verify_greedy and rollback (over the setup's KVPool as its allocator), gives the greedy outputs and acceptance of nanolab's own speculation with the same settings (a cache of 260 token slots for 4 requests at once, so requests are usually preempted between speculative steps), and frees every block."""
    model, tokenizer = bundled_model()
    ids = tokenizer.encode(stdlib_text(*STDLIB_FILES))
    prompts = []
    for _ in range(6):
        start = rng.randrange(len(ids) - 200)
        prompts.append(ids[start : start + rng.randint(10, 60)])
    copied = ids[rng.randrange(len(ids) - 60) :][:40]
    prompts.append(copied + ids[:5] + copied[:10])  # a prompt that repeats itself
    bs = rng.choice([2, 4, 8])
    settings = dict(block_size=bs, num_blocks=260 // bs, max_num_seqs=4)
    params = nanolab.SamplingParams(max_tokens=rng.randint(24, 40), temperature=0, ignore_eos=True)
    k = rng.choice([2, 3, 4, 6])
    what = f"in the engine (k = {k}, block size {bs}, {260 // bs} blocks, 7 prompts, greedy)"
    _compare_in_engine(lab, model, tokenizer, prompts, params, settings, k, what)


@pytest.mark.points(1)
def test_your_pieces_serve_other_models(lab, rng):
    """Check your pieces in the engine on a random Llama-style model and a tiny random Qwen2 model (small vocabularies, so guesses are often right): the outputs and acceptance of nanolab's own speculation, every block freed."""
    config = ModelConfig(
        vocab_size=24, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, d_ff=64, max_seq_len=96
    )
    models = [(spread_out(Transformer(config), rng.randrange(2**31)), "a random Llama-style model")]
    qwen = tiny_qwen2_model(rng.randrange(2**31), vocab_size=32, max_positions=96)
    models.append((qwen, "a tiny random Qwen2 model"))
    for model, label in models:
        vocab = model.config.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(4, 30))] for _ in range(5)]
        params = nanolab.SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        settings = dict(block_size=4, num_blocks=40, max_num_seqs=3)
        _compare_in_engine(
            lab, model, None, prompts, params, settings, 4, f"{label} in the engine (k = 4, 40 blocks of 4)"
        )


@pytest.mark.points(1)
def test_sampled_requests_speculate_to_the_end_with_your_sampler(lab, rng):
    """Check that sampled requests (temperature 0.8) run to their length with your rejection_sample in the engine, for n-gram guesses (certain) and the bundled draft model's (with its distributions), with guesses kept and every block freed."""
    model, tokenizer = bundled_model()
    ids = tokenizer.encode(stdlib_text(*STDLIB_FILES))
    start = rng.randrange(len(ids) - 100)
    prompts = [ids[start : start + 40], ids[start + 40 : start + 70] * 2]
    settings = dict(block_size=4, num_blocks=48, max_num_seqs=2)
    draft = nanolab.load_model("tinypy-draft")
    for config, label in [
        (SpeculativeConfig(method="ngram", num_speculative_tokens=3), "n-gram guesses"),
        (
            SpeculativeConfig(method="draft_model", model=draft, num_speculative_tokens=3),
            "the draft model's guesses",
        ),
    ]:
        what = f"sampled requests in the engine with {label}"
        drafted = []
        # Whether a sampled guess is kept is chance: a correct sampler keeps one in nearly every run, but not
        # in every one, so a run that keeps none is tried again with another seed, up to three runs in all.
        for _attempt in range(3):
            params = nanolab.SamplingParams(
                max_tokens=24, temperature=0.8, seed=rng.randrange(2**31), ignore_eos=True
            )
            remote_pool = lab.KVPool(48, 4)
            pool = SandboxAllocator(remote_pool)
            proposer = None
            if config.method == "draft_model":
                proposer = reference.DraftModelProposer(config, draft, 48, 4)
            llm = nanolab.LLM(model, tokenizer, block_allocator=pool, speculator=learners_speculator(lab, config, remote_pool, proposer), **settings)  # fmt: skip
            got = run_capped(llm, prompts, params, what)
            assert all(len(tokens) == 24 for tokens in got), f"{what}: a request did not get its 24 tokens"
            cached = llm.engine.block_manager.prefix_cache.total_size // 4
            assert pool.num_free + cached == 48, (
                f"{what}: every request finished, yet some blocks are still held"
            )
            drafted.append(llm.stats().spec_draft_tokens)
            if llm.stats().spec_accepted_tokens > 0:
                break
        else:
            raise AssertionError(f"{what}: not one guess was kept in {len(drafted)} runs ({drafted} guesses)")
