"""The model's side of a step: lay out the batch, run one forward for all of it, sample.

`layout_batch` turns the scheduler's choice (which requests, how many new tokens each) into one flat
batch: every request's new tokens side by side, the position of each, the slice of the paged KV cache
each sequence writes and reads, and the rows whose logits are sampled. Decode tokens and prompt chunks
of any length share the forward: continuous batching runs different requests at different stages in the
same model call, it does not take turns between them.

`ModelRunner.run` then copies the blocks the scheduler asked to copy (copy-on-write), runs the forward,
records prompt log-probabilities for the requests that want them, marks the tokens computed, forks the
parallel-sampling requests whose prompt is done, and samples one token for every request whose tokens are
all computed. Requests that need only that one token ("plain": ``n == 1``, no logprobs, no logit bias
or penalties) take a fast path that skips every other check. A request that speculates (its entry
reaches into its guesses, see `layout_batch`) gets the tokens its verification keeps
(`nanolab.engine.speculative`): the first is returned with the others, the rest go to the batch's
``extra_tokens``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from nanolab.engine import speculative
from nanolab.engine.request import Request
from nanolab.memory.paged_kv_cache import PagedKVCache, SeqSlice
from nanolab.model.prepacked import Prepacked
from nanolab.model.sampling import (
    SamplingParams,
    adjust_logits,
    argmax,
    filter_logits,
    sample,
    token_logprobs,
)
from nanolab.model.transformer import Transformer


@dataclass
class BatchLayout:
    """One step's batch, flattened: row ``i`` of the forward is ``token_ids[i]`` at ``positions[i]``."""

    scheduled: list[tuple[Request, int]]  # (request, new tokens) in batch order
    token_ids: list[int]
    positions: list[int]
    seqs: list[SeqSlice]  # per sequence: its block table, first new position, new tokens
    sample_rows: list[int]  # the row whose logits each request of `to_sample` samples from
    to_sample: list[Request]  # requests whose every token is computed once this step is done
    prefilled: list[bool] = field(default_factory=list)  # per `to_sample`: this step ended its prompt
    # speculative decoding, per `to_sample`: the guesses checked after its sample row (rows
    # sample_rows[i] + 1 ..), and the tokens kept beyond the first (set by `ModelRunner.run`)
    num_drafts: list[int] = field(default_factory=list)
    extra_tokens: list[list[int]] = field(default_factory=list)

    @property
    def requests(self) -> list[Request]:
        return [r for r, _ in self.scheduled]


def layout_batch(scheduled: Sequence[tuple[Request, int]]) -> BatchLayout:
    """Lay out one step: the flat token ids and positions, each sequence's slice of the KV cache, and
    which rows are sampled.

    ``scheduled`` pairs each request with the number of its tokens to compute now, starting at its
    ``num_computed_tokens``: a prompt chunk, a whole prompt, or 1 for a decode. The batch puts the
    one-token entries first (the paged cache runs them as one decode group), otherwise keeping the
    scheduler's order. A request's token at index p of its prompt + output sits at position p, so a
    decode token sits at ``num_prompt_tokens + len(output_token_ids) - 1``. A request samples (from its
    last row) only when this step computes its last token; a prompt chunk that leaves some of the prompt
    for later samples nothing. Requests are only read.

    Speculative decoding: an entry may reach past the request's tokens into its ``spec_token_ids`` (a
    decode of 1 + d tokens: the last token and d guesses). It samples from its last token's row, and
    the d rows after it check the guesses (``num_drafts``).

    Example:
        >>> from nanolab import SamplingParams
        >>> a = Request("a", [5, 6, 7, 8], SamplingParams()); a.num_computed_tokens = 1
        >>> b = Request("b", [9], SamplingParams()); b.output_token_ids = [3]; b.num_computed_tokens = 1
        >>> lay = layout_batch([(a, 2), (b, 1)])
        >>> lay.token_ids, lay.positions, lay.sample_rows, [r.request_id for r in lay.to_sample]
        ([3, 6, 7], [1, 1, 2], [0], ['b'])
    """
    batch = sorted(scheduled, key=lambda s: s[1] != 1)  # stable: one-token entries first
    lay = BatchLayout(list(batch), [], [], [], [], [])
    for r, n in batch:
        start = r.num_computed_tokens
        end = min(start + n, r.num_tokens)
        drafts = start + n - end  # guesses past the request's tokens (speculative decoding)
        lay.seqs.append(SeqSlice(r.block_table, start, n))
        lay.token_ids += r.token_slice(start, end)
        if drafts:
            if drafts > len(r.spec_token_ids):
                raise ValueError(
                    f"request {r.request_id!r} is scheduled {n} tokens from {start} but has {r.num_tokens} "
                    f"tokens and {len(r.spec_token_ids)} guesses"
                )
            lay.token_ids += r.spec_token_ids[:drafts]
        lay.positions += range(start, start + n)
        if end == r.num_tokens:  # every token is computed: sample from the last token's row
            lay.sample_rows.append(len(lay.token_ids) - 1 - drafts)
            lay.to_sample.append(r)
            lay.prefilled.append(n - drafts > 1)  # this step computed (the end of) a prompt, not a decode
            lay.num_drafts.append(drafts)
    return lay


def needs_extras(p: SamplingParams) -> bool:
    """Whether a request needs more of a step than one sampled token: n > 1 samples, logprobs of its
    tokens or of its prompt, logit bias or penalties."""
    return p.n > 1 or p.logprobs is not None or p.prompt_logprobs is not None or p.adjusts_logits


def can_speculate(r: Request) -> bool:
    """Whether a request may check guesses (speculative decoding): when each of its steps needs only its
    tokens, not their logprobs, no logit bias or penalties (their logits depend on the tokens before),
    and it has no samples left to fork."""
    p = r.sampling_params
    return (
        p.logprobs is None and not p.adjusts_logits and not r.samples_to_fork and not r.wants_prompt_logprobs
    )


class ModelRunner:
    """Runs a laid-out batch through the model over the paged KV cache and samples its next tokens.

    A step's tensors are made on the model's device (``device``, where its weights are), which is the
    KV cache's too; tokens come back to Python as lists.
    """

    def __init__(self, model: Transformer, kv_cache: PagedKVCache, prepack_weights: bool = False) -> None:
        self.model = model
        self.device = model.lm_head.weight.device
        self.kv_cache = kv_cache
        self.forward_seconds = 0.0  # the model's share of the last `run`
        # speculative decoding: the engine's `Speculator`, whose rules check the guesses (None: nanolab's)
        self.speculator: speculative.Speculator | None = None
        # the layers' faster products (oneDNN's layouts; nanolab's kernel at 1-2 rows), inside this runner's
        # forward only (None: F.linear)
        self.prepacked = Prepacked.for_model(model) if prepack_weights else None

    @torch.inference_mode()
    def run(
        self,
        batch: BatchLayout,
        blocks_to_copy: Sequence[tuple[int, int]] = (),
        extras: bool = True,
        fork: Callable[[Request], list[Request]] | None = None,
    ) -> list[int]:
        """One forward for ``batch``; returns the token sampled for each request of ``batch.to_sample``,
        which grows by the samples ``fork`` makes (called for each request that has samples to fork).

        Every scheduled request's ``num_computed_tokens`` moves past the tokens this step computed. With
        ``extras`` False (no request about needs more than one sampled token), logprobs, prompt logprobs,
        logit adjustment and forking are all skipped.
        """
        t0 = time.perf_counter()
        hidden = self.forward(batch.token_ids, batch.seqs, blocks_to_copy)
        rows, firsts = batch.sample_rows, None
        num_drafts = getattr(batch, "num_drafts", ())  # (a lab's own BatchLayout has none)
        if any(num_drafts):  # speculation: each guess's row too, after its request's sample row
            firsts, rows = [], []
            for row, d in zip(batch.sample_rows, batch.num_drafts):
                firsts.append(len(rows))
                rows += range(row, row + d + 1)
        with self._products():
            logits = self.model.compute_logits(hidden[rows]) if batch.to_sample else None
        all_logits = logits
        if firsts is not None and logits is not None:
            logits = logits[firsts]
        if extras and any(r.wants_prompt_logprobs for r in batch.requests):
            self._record_prompt_logprobs(batch.scheduled, hidden)
        self.forward_seconds = time.perf_counter() - t0
        for r, n in batch.scheduled:
            r.num_computed_tokens += n
        if logits is None:
            return []
        if extras and fork is not None and any(r.samples_to_fork for r in batch.to_sample):
            rows = []
            for i, r in enumerate(list(batch.to_sample)):
                children = fork(r) if r.samples_to_fork else []
                batch.to_sample += children
                batch.prefilled += [False] * len(children)  # the parent offers the prompt to the cache
                if firsts is not None:
                    batch.num_drafts += [0] * len(children)
                rows += [i] * len(children)
            logits = torch.cat([logits, logits[rows]])  # each sample draws its first token from the prompt's
        if firsts is None:
            return self.sample(batch.to_sample, logits, extras)
        return self._verify(batch, logits, all_logits, firsts, extras)

    def forward(
        self, token_ids: list[int], seqs: list[SeqSlice], blocks_to_copy: Sequence[tuple[int, int]] = ()
    ) -> torch.Tensor:
        """The model's hidden states (T, d_model) for one step's flat batch, over the paged KV cache:
        the blocks to copy are copied first (copy-on-write), then the cache is laid out for ``seqs``."""
        if blocks_to_copy:
            self.kv_cache.copy_blocks(blocks_to_copy)
        positions = self.kv_cache.prepare(seqs)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        with self._products():
            return self.model(ids, positions, self.kv_cache)

    def _products(self) -> contextlib.AbstractContextManager:
        """Inside this block the model's products are the runner's faster ones (`prepack_weights`), if it has
        them, else F.linear."""
        return self.prepacked.active() if self.prepacked is not None else contextlib.nullcontext()

    def close(self) -> None:
        """Release what the runner holds beyond memory (a tensor-parallel runner's workers); nothing here."""

    def _verify(
        self,
        batch: BatchLayout,
        logits: torch.Tensor,
        all_logits: torch.Tensor,
        firsts: list[int],
        extras: bool,
    ) -> list[int]:
        """The first token of every request of ``batch.to_sample``: sampled from its row of ``logits``,
        or, for a request that checks guesses, the first its verification keeps (the others kept go to
        ``batch.extra_tokens``). ``all_logits[firsts[i]:]`` holds request i's row and its guesses' rows."""
        reqs = batch.to_sample
        spec = self.speculator
        verify_greedy = spec.verify_greedy if spec is not None else speculative.verify_greedy
        rejection_sample = spec.rejection_sample if spec is not None else speculative.rejection_sample
        tokens = [0] * len(reqs)
        batch.extra_tokens = [[] for _ in reqs]
        plain = [i for i, d in enumerate(batch.num_drafts) if not d]
        if plain:
            for i, tok in zip(plain, self.sample([reqs[i] for i in plain], logits[plain], extras)):
                tokens[i] = tok
        for i, d in enumerate(batch.num_drafts):
            if not d:
                continue
            r, p = reqs[i], reqs[i].sampling_params
            guesses, rows = r.spec_token_ids[:d], all_logits[firsts[i] : firsts[i] + d + 1]
            if p.greedy:
                kept = verify_greedy(guesses, argmax(rows.float()).tolist())
            else:
                q = r.spec_draft_probs[:d] if r.spec_draft_probs is not None else None
                probs = filter_logits(rows, [p] * (d + 1)).softmax(dim=-1)
                kept = rejection_sample(guesses, probs, q, r.generator)
            tokens[i], batch.extra_tokens[i] = kept[0], list(kept[1:])
        return tokens

    def sample(self, reqs: list[Request], logits: torch.Tensor, extras: bool = True) -> list[int]:
        """One token per request (row b of ``logits`` is request b's); with ``extras``, logit bias and
        penalties first (from each request's own tokens), and the logprobs of the chosen tokens (from the
        model's logits) appended to each request that asked for them."""
        params = [r.sampling_params for r in reqs]
        gens = [r.generator for r in reqs]
        if not extras:
            return sample(logits, params, gens).tolist()
        adjusted = logits
        if any(p.adjusts_logits for p in params):
            histories = [(r.prompt_token_ids, r.output_token_ids) for r in reqs]
            adjusted = adjust_logits(logits, params, histories)
        next_ids = sample(adjusted, params, gens).tolist()
        wanted = [b for b, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            ranked = token_logprobs(
                logits[wanted], [next_ids[b] for b in wanted], [params[b].logprobs for b in wanted]
            )
            for b, lp in zip(wanted, ranked):
                reqs[b].output_logprobs.append(lp)
        return next_ids

    def _record_prompt_logprobs(self, batch: list[tuple[Request, int]], hidden: torch.Tensor) -> None:
        """Log-probabilities of the prompt tokens this step's rows predict, for the requests that want
        them: the row of position p gives token p + 1's. A recomputed prompt (after preemption) adds
        none twice."""
        rows, targets, owners = [], [], []
        row = 0
        for r, n in batch:
            if r.wants_prompt_logprobs:
                if not r.prompt_logprobs:
                    r.prompt_logprobs.append(None)  # the first token has nothing before it
                start = r.num_computed_tokens
                for p in range(
                    max(start, len(r.prompt_logprobs) - 1), min(start + n, r.num_prompt_tokens - 1)
                ):
                    rows.append(row + p - start)
                    targets.append(r.prompt_token_ids[p + 1])
                    owners.append(r)
            row += n
        if not rows:
            return
        tops = [r.sampling_params.prompt_logprobs for r in owners]
        for r, lp in zip(owners, token_logprobs(self.model.compute_logits(hidden[rows]), targets, tops)):
            r.prompt_logprobs.append(lp)
