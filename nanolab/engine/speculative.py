"""Speculative decoding: guess several tokens cheaply, check them all in one forward of the model.

A decode step computes one token per request, and on a small batch its cost is mostly reading the
weights, whatever the number of tokens in the forward. Speculative decoding spends that slack: a
*proposer* guesses the next k tokens of a request (``spec_token_ids``), the engine computes the
request's last token and the k guesses in one forward (k + 1 rows, like a short prompt chunk), and the
*verifier* keeps the guesses the model agrees with, plus one token of the model's own. A step then
yields between 1 and k + 1 tokens per request, and the output is exactly what decoding one token at a
time gives:

- greedy (`verify_greedy`): row i's argmax is the model's token after the first i guesses; the guesses
  are kept while they equal it, and the argmax at the first mismatch (or after the last guess: the
  "bonus" token) is added;
- sampling (`rejection_sample`): guess i is kept with probability min(1, p(x) / q(x)), p the model's
  distribution at row i and q the proposer's; at the first rejection a token is drawn from
  max(0, p - q) normalised, and after k kept guesses from p at the last row. Every token then has
  exactly the model's distribution (Leviathan et al., 2023; Chen et al., 2023). A proposer that guesses
  one token for certain (n-gram lookup) has q = 1 at its guess: the guess is kept with probability
  p(guess), and a rejection draws from p with the guess taken out.

After the step, the keys and values of rejected guesses are in the cache: the request's
``num_computed_tokens`` goes back to its accepted length and the KV blocks wholly past its end are freed
(`nanolab.memory.block_manager.BlockManager.rollback`); their stale slots are overwritten later.

Proposers: `NgramProposer` (prompt lookup: the request's last n tokens found earlier in its prompt or
output; what follows that match is the guess; free, and good on text that repeats itself, like code)
and `DraftModelProposer` (a smaller model with the same tokenizer runs k steps ahead). The config uses
vLLM's names: ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
"prompt_lookup_min": 1}`` or ``{"method": "draft_model", "model": ..., "num_speculative_tokens": 4}``.

Requests that need more of a step than its tokens (logprobs, logit bias or penalties: see
`nanolab.engine.model_runner.can_speculate`) do not speculate; they decode a token per step in the same
batch as the others. The samples of an n > 1 request speculate once forked.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

import numpy as np
import torch

SPEC_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates (vLLM's ``speculative_config`` keys). Checked on construction."""

    method: str  # "ngram" (prompt lookup) or "draft_model"
    num_speculative_tokens: int  # k: tokens guessed per request per step
    prompt_lookup_max: int = 4  # ngram: the longest suffix looked up
    prompt_lookup_min: int = 1  # ngram: the shortest suffix looked up
    model: Any = None  # draft_model: a bundled model's name, a checkpoint directory, or a Transformer

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            choices = ", ".join(map(repr, SPEC_METHODS))
            raise ValueError(f"speculative_config method must be one of {choices}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {k!r}"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {value!r}")
        if lo > hi:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({lo}) is more than prompt_lookup_max ({hi})"
            )
        if self.method == "draft_model" and (self.model is None or self.model == ""):
            raise ValueError('speculative_config method "draft_model" needs "model": the draft model to load')
        if self.method == "ngram" and self.model is not None:
            raise ValueError('speculative_config "model" is for method "draft_model"; ngram needs none')

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """A config from a dict, a JSON object string (the command line's form), a config, or None (off).

        An unknown key is a ValueError that suggests the right one.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON ({exc}): {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or its JSON), got {value!r}")
        known = [f.name for f in fields(cls)]
        for key in value:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; the keys are {', '.join(known)}"
                raise ValueError(f"unknown speculative_config key {key!r}{hint}")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"speculative_config needs {key!r}")
        return cls(**value)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# -- proposing ----------------------------------------------------------------------------------------


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Prompt lookup: up to ``k`` guesses of what follows ``token_ids``, or [] when nothing matches.

    For n from ``max_n`` down to ``min_n``, the last n tokens are looked for earlier in the sequence;
    at the first n that has a match, the guess is the (at most k) tokens that followed its first
    occurrence. Longer matches are tried first: they are likelier to continue the same way.

    Example:
        >>> propose_ngram([1, 2, 3, 4, 9, 1, 2, 3], k=2)
        [4, 9]
        >>> propose_ngram([1, 2, 3], k=2)
        []
    """
    L = len(token_ids)
    if k < 1 or L < 2:
        return []
    arr = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        # every window of n tokens that starts early enough to have a token after it
        windows = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)
        hits = np.flatnonzero((windows == arr[L - n :]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return arr[start : start + k].tolist()
    return []


class Proposer(Protocol):
    """What guesses a request's next tokens (`NgramProposer`, `DraftModelProposer`, a learner's own)."""

    def propose(self, requests: Sequence[Any], num_tokens: Sequence[int]) -> list[list[int]]:
        """At most ``num_tokens[i]`` guesses for each request (fewer, or none, is fine)."""
        ...


class NgramProposer:
    """Prompt-lookup proposer: `propose_ngram` on each request's prompt and output."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, requests: Sequence[Any], num_tokens: Sequence[int]) -> list[list[int]]:
        return [
            propose_ngram(r.all_token_ids, k, self.min_n, self.max_n) if k > 0 else []
            for r, k in zip(requests, num_tokens)
        ]


# -- verifying ----------------------------------------------------------------------------------------


def verify_greedy(draft: Sequence[int], target: Sequence[int]) -> list[int]:
    """The tokens greedy decoding keeps: ``draft`` while it agrees with ``target``, then target's next.

    ``target[i]`` is the model's greedy token after the first i guesses (len(draft) + 1 of them). The
    result has between 1 and len(draft) + 1 tokens: the accepted guesses and one token of the model's.

    Example:
        >>> verify_greedy([5, 6, 7], [5, 6, 8, 9])
        [5, 6, 8]
        >>> verify_greedy([5, 6], [5, 6, 4])
        [5, 6, 4]
    """
    if len(target) != len(draft) + 1:
        raise ValueError(f"{len(draft)} guesses need {len(draft) + 1} target tokens, got {len(target)}")
    out: list[int] = []
    for guess, want in zip(draft, target):
        if guess != want:
            break
        out.append(guess)
    out.append(int(target[len(out)]))
    return out


def rejection_sample(
    draft: Sequence[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The tokens speculative sampling keeps; each has exactly the target's distribution.

    ``target_probs`` is (len(draft) + 1, V): row i is the model's distribution after the first i
    guesses. ``draft_probs`` is (len(draft), V), the proposer's distribution each guess was drawn from;
    None means each guess was certain (q = 1 at the guess). Guess i is kept with probability
    min(1, p_i(x) / q_i(x)); at the first rejection a token is drawn from max(0, p_i - q_i), normalised,
    and the rest is dropped; if every guess is kept, a last token is drawn from the final row. Random
    numbers come from ``generator`` (torch's global one when None), on the CPU like `sample`'s: the
    probabilities are moved there first, so a seed keeps the same tokens on every device.
    """
    k = len(draft)
    if target_probs.ndim != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(
            f"{k} guesses need target_probs of shape ({k + 1}, V), got {tuple(target_probs.shape)}"
        )
    p = target_probs.float().cpu()
    q = draft_probs.float().cpu() if draft_probs is not None else None
    accept = torch.rand(k, generator=generator, device="cpu") if k else torch.empty(0, device="cpu")
    out: list[int] = []
    for i, x in enumerate(draft):
        px = float(p[i, x])
        qx = 1.0 if q is None else float(q[i, x])
        if float(accept[i]) * qx < px:  # kept with probability min(1, px / qx)
            out.append(int(x))
            continue
        if q is None:
            residual = p[i].clone()
            residual[x] = 0.0
        else:
            residual = (p[i] - q[i]).clamp_min(0.0)
        if not float(residual.sum()) > 0:  # p == q up to rounding: nothing left but p itself
            residual = p[i]
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[k], 1, generator=generator)))
    return out


def expected_tokens_per_step(acceptance_rate: float, k: int) -> float:
    """Tokens a verification yields on average when each guess is kept with probability ``acceptance_rate``
    (independently of the others) and ``k`` are checked: 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a).

    The first rejected guess ends the run, and the model's own token comes either way. With a = 1 every
    guess is kept: k + 1. A ValueError for a rate outside [0, 1] or a negative k.

    Example:
        >>> expected_tokens_per_step(0.5, 3)
        1.875
        >>> expected_tokens_per_step(1.0, 4)
        5.0
    """
    if not 0.0 <= acceptance_rate <= 1.0:
        raise ValueError(f"an acceptance rate is in [0, 1], got {acceptance_rate!r}")
    if k < 0:
        raise ValueError(f"the number of guesses k is at least 0, got {k!r}")
    if acceptance_rate == 1.0:
        return float(k + 1)
    return (1.0 - acceptance_rate ** (k + 1)) / (1.0 - acceptance_rate)


@dataclass
class SpecCounters:
    """Speculation's running totals (part of `nanolab.engine.stats.EngineStats`)."""

    verifications: int = 0  # request-steps that checked at least one guess
    draft_tokens: int = 0  # guesses checked
    accepted_tokens: int = 0  # guesses kept

    def add(self, num_drafts: int, num_accepted: int) -> None:
        self.verifications += 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_accepted


class Speculator:
    """The engine's speculation: a proposer, the two verification rules and the KV rollback, each of which
    can be swapped for another with the same signature (`LLM(speculator=...)`; a learner's own plugs in here).

    ``rollback(request, block_manager)`` forgets the KV past a request's kept tokens; None: the block
    manager's own (`nanolab.memory.block_manager.BlockManager.rollback`).
    """

    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        verify_greedy: Any = verify_greedy,
        rejection_sample: Any = rejection_sample,
        rollback: Any = None,
    ) -> None:
        self.config = config
        self.proposer = proposer
        self.verify_greedy = verify_greedy
        self.rejection_sample = rejection_sample
        self._rollback = rollback
        self.counters = SpecCounters()

    def rollback(self, request: Any, block_manager: Any) -> None:
        """Forget the keys and values of ``request``'s rejected guesses (see the module)."""
        if self._rollback is None:
            block_manager.rollback(request)
        else:
            self._rollback(request, block_manager)

    @property
    def k(self) -> int:
        return self.config.num_speculative_tokens

    def release(self, request: Any) -> None:
        """``request`` finished: the proposer forgets it (a draft model frees its cache)."""
        release = getattr(self.proposer, "release", None)
        if release is not None:
            release(request)


@dataclass(eq=False)
class _DraftSeq:
    """The draft model's cache of one request: the tokens whose keys and values it holds, and where."""

    request: Any
    fed: list[int]  # tokens in the draft's cache, in order (position i holds fed[i])
    block_table: list[int]


class DraftModelProposer:
    """A smaller model with the target's tokenizer guesses each request's next tokens.

    The draft keeps its own paged KV cache (``num_blocks`` blocks of ``block_size`` tokens), on
    ``device`` with the draft (which is moved there in place). Each step it
    first catches up, in one forward for all requests, on the tokens it has not seen (a new request's
    prompt, or the tokens the target kept and added last step); its cache past the first difference
    from the request's tokens (a rejected guess) is dropped first. Then one forward per further guess,
    all requests together. A greedy request's guess is the draft's argmax (q is certain); a sampled
    request draws from the draft's distribution under its own sampling parameters, and that
    distribution goes to ``spec_draft_probs`` for the rejection sampler. A request that cannot get the
    draft's blocks guesses nothing this step; a finished request's blocks are freed at the next call.
    """

    def __init__(
        self,
        config: SpeculativeConfig,
        draft: Any,
        num_blocks: int,
        block_size: int,
        attention_backend: str = "auto",
        device: torch.device | str = "cpu",
    ) -> None:
        from nanolab.memory.block_allocator import BlockAllocator
        from nanolab.memory.paged_kv_cache import PagedKVCache

        self.config = config
        self.device = torch.device(device)
        self.model = draft.eval().to(self.device)
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.kv_cache = PagedKVCache(
            draft.config, num_blocks, block_size, attention_backend=attention_backend, device=self.device
        )
        self.seqs: dict[str, _DraftSeq] = {}

    def release(self, request: Any) -> None:
        """Free the draft's blocks of a request that finished."""
        seq = self.seqs.pop(request.request_id, None)
        if seq is not None:
            self.allocator.free(seq.block_table)

    def _forget_finished(self) -> None:  # those the engine did not report (a learner's engine loop)
        for seq in [s for s in self.seqs.values() if s.request.is_finished]:
            self.release(seq.request)

    def _reserve(self, seq: _DraftSeq, num_tokens: int) -> bool:
        """Blocks for ``num_tokens`` positions in ``seq``'s table (False, changing nothing, if there are none)."""
        needed = -(-num_tokens // self.block_size) - len(seq.block_table)
        if needed <= 0:
            return True
        if self.allocator.num_free < needed:
            return False
        seq.block_table += self.allocator.allocate(needed)
        return True

    @torch.inference_mode()
    def propose(self, requests: Sequence[Any], num_tokens: Sequence[int]) -> list[list[int]]:
        from nanolab.memory.paged_kv_cache import SeqSlice

        self._forget_finished()
        max_len = self.model.config.max_seq_len
        out: list[list[int]] = [[] for _ in requests]
        active = []  # (index, request, seq, tokens, k)
        for i, (r, k) in enumerate(zip(requests, num_tokens)):
            tokens = r.all_token_ids
            k = min(k, max_len - len(tokens) + 1)
            if k <= 0:
                continue
            seq = self.seqs.get(r.request_id)
            if seq is None:
                seq = self.seqs[r.request_id] = _DraftSeq(r, [], [])
            same = 0
            for a, b in zip(seq.fed, tokens[:-1]):  # the last token is always fed now
                if a != b:
                    break
                same += 1
            del seq.fed[same:]
            keep = -(-(len(tokens) + k - 1) // self.block_size)  # blocks this step writes into
            if len(seq.block_table) > keep:  # what lies wholly past them goes back
                self.allocator.free(seq.block_table[keep:])
                del seq.block_table[keep:]
            if self._reserve(seq, len(tokens) + k - 1):
                active.append((i, r, seq, tokens, k))
        if not active:
            return out
        # round 0: catch up on the unseen tokens (one-token entries first, as the paged cache wants)
        entries = sorted(active, key=lambda a: len(a[3]) - len(a[2].fed) != 1)
        ids: list[int] = []
        slices, rows = [], []
        for _, _, seq, tokens, _ in entries:
            start = len(seq.fed)
            slices.append(SeqSlice(seq.block_table, start, len(tokens) - start))
            ids += tokens[start:]
            rows.append(len(ids) - 1)
            seq.fed = list(tokens)
        last = self._guess(entries, self._forward(ids, slices, rows), out)
        # rounds 1 .. k-1: feed each request's last guess
        for rnd in range(1, max(a[4] for a in entries)):
            entries = [a for a in entries if a[4] > rnd]
            tokens_in = [last[a[0]] for a in entries]
            slices = [SeqSlice(a[2].block_table, len(a[2].fed), 1) for a in entries]
            for a, t in zip(entries, tokens_in):
                a[2].fed.append(t)
            last = self._guess(entries, self._forward(tokens_in, slices, list(range(len(entries)))), out)
        return out

    def _forward(self, ids: list[int], slices: list[Any], rows: list[int]) -> torch.Tensor:
        positions = self.kv_cache.prepare(slices)
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=self.device), positions, self.kv_cache)
        return self.model.compute_logits(hidden[rows]).float()

    def _guess(self, entries: list[tuple], logits: torch.Tensor, out: list[list[int]]) -> dict[int, int]:
        """Each entry's next guess from its row of ``logits``, appended to ``out``; the sampled ones'
        distributions appended to their request's ``spec_draft_probs``."""
        from nanolab.model.sampling import argmax, filter_logits

        params = [a[1].sampling_params for a in entries]
        guesses = argmax(logits).tolist()
        sampled = [b for b, p in enumerate(params) if not p.greedy]
        if sampled:
            probs = filter_logits(logits[sampled], [params[b] for b in sampled]).softmax(dim=-1)
            for row, b in zip(probs, sampled):
                r = entries[b][1]
                # drawn on the CPU, where the request's generator lives (see `sample`)
                guesses[b] = int(torch.multinomial(row.cpu(), 1, generator=r.generator))
                before = [] if not out[entries[b][0]] else [r.spec_draft_probs]
                r.spec_draft_probs = torch.cat([*before, row[None]])
        last = {}
        for (i, r, *_), g in zip(entries, guesses):
            if r.sampling_params.greedy:
                r.spec_draft_probs = None
            out[i].append(int(g))
            last[i] = int(g)
        return last
