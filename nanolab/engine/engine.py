"""The engine: continuous batching, one step at a time.

Each `step` does: schedule (which requests, how many tokens each) -> build the flattened batch and lay
out the paged KV cache -> one model forward for all of it -> sample one token for every request whose
prompt is now fully computed -> append, detokenize, check stop conditions, release finished requests ->
return the incremental outputs. Requests join and leave the batch at every step: that is continuous
batching. A request with ``n > 1`` samples is forked when its prompt is computed: the samples share the
prompt's KV blocks, so the prompt is computed once (see `nanolab.engine.request.SampleGroup`).

The engine is assembled from swappable parts, each behind a small protocol: the block allocator
(`BlockAllocatorProtocol`), the prefix cache (`PrefixCacheProtocol`), the scheduler
(`SchedulerProtocol`) and the attention backend of the paged cache. Requests enter through
`add_requests` (see `nanolab.engine.prompt`); observers see the engine through the `StepRecord` each
step sends to its listeners and the `EngineStats` snapshot of `stats` (see `nanolab.engine.stats`).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Any

import torch

from nanolab.engine.config import EngineConfig
from nanolab.engine.prompt import Prompt, PromptProcessor, as_prompt_list
from nanolab.engine.request import (
    FinishReason,
    Request,
    RequestOutput,
    RequestStatus,
    SampleGroup,
    finish,
)
from nanolab.engine.scheduler import Scheduler, SchedulerProtocol
from nanolab.engine.stats import EngineStats, StepListener, StepRecord
from nanolab.memory.block_allocator import BlockAllocator, BlockAllocatorProtocol
from nanolab.memory.block_manager import BlockManager
from nanolab.memory.paged_kv_cache import PagedKVCache, SeqSlice
from nanolab.memory.prefix_cache import PrefixCacheProtocol
from nanolab.memory.radix_cache import RadixCache
from nanolab.model.sampling import SamplingParams, adjust_logits, sample, token_logprobs
from nanolab.model.transformer import Transformer


class SamplingParamsError(ValueError):
    """Sampling parameters this engine cannot run; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class EngineStepError(RuntimeError):
    """A step raised; the requests it was running were aborted and their KV blocks freed.

    ``outputs`` holds their final outputs (finish reason "abort"); the cause is chained.
    """

    def __init__(self, message: str, outputs: list[RequestOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs


class Engine:
    """Continuous-batching engine over one model. Use `nanolab.LLM` for the friendly API."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Any = None,
        config: EngineConfig | None = None,
        block_allocator: type | BlockAllocatorProtocol | None = None,
        prefix_cache: type | PrefixCacheProtocol | None = None,
        scheduler: type | SchedulerProtocol | None = None,
        listeners: Sequence[StepListener] = (),
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        cfg = (config or EngineConfig()).resolve(model.config)
        self.config = cfg

        allocator = _build(block_allocator, BlockAllocator, cfg.num_blocks)
        if allocator.num_total != cfg.num_blocks:
            raise ValueError(
                f"the block allocator has {allocator.num_total} blocks, expected {cfg.num_blocks}"
            )
        cache = None
        if cfg.enable_prefix_caching:
            cache = _build(prefix_cache, RadixCache, allocator, cfg.block_size)
        self.block_manager = BlockManager(allocator, cfg.block_size, cache)
        self.kv_cache = PagedKVCache(
            model.config, cfg.num_blocks, cfg.block_size, attention_backend=cfg.attention_backend.value
        )
        self.scheduler = _build(scheduler, Scheduler, cfg, self.block_manager)
        self.requests: dict[str, Request] = {}  # unfinished requests (and samples) by id
        self.groups: dict[str, SampleGroup] = {}  # unfinished parallel-sampling requests by id
        # unfinished requests with n > 1, logprobs, prompt logprobs, logit bias or penalties: a step with
        # none of them about skips every check for those
        self._special: set[str] = set()
        self._ids = itertools.count()
        self.listeners = tuple(listeners)
        self.prompts = PromptProcessor(tokenizer, model.config.vocab_size, cfg)
        # counters behind stats()
        self._steps = self._scheduled_seqs = self._batched_tokens = 0
        self._generated_tokens = self._finished_requests = 0
        self._busy_seconds = self._forward_seconds = self._peak_kv_usage = 0.0
        # Each token's bytes, looked up once here rather than decoded for every generated token;
        # special tokens (end-of-text, ...) add no text.
        self._token_bytes: list[bytes | None] | None = None
        if tokenizer is not None:
            special = set(getattr(tokenizer, "special_tokens", {}).values())
            self._token_bytes = [
                None if i in special else tokenizer.decode_bytes([i]) for i in range(tokenizer.vocab_size)
            ]
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None) if tokenizer else None
        # A Hugging Face checkpoint may name more than one (Llama 3 ends a text and a chat turn differently)
        self.more_eos_token_ids = frozenset(getattr(tokenizer, "eos_token_ids", ())) - {self.eos_token_id}

    # -- requests -----------------------------------------------------------------------------------

    def add_requests(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: int | Sequence[int] = 0,
        request_ids: Sequence[str] | None = None,
    ) -> list[Request]:
        """Queue one request per prompt, all or none.

        ``prompts``: one prompt (text or token ids) or a list of them. ``sampling_params`` and
        ``priority``: one for all, or one each. Every prompt is tokenized and checked before any is
        queued: a `nanolab.engine.prompt.PromptError` (a `ValueError`) names the first that could never
        run, and the engine is left untouched.
        """
        items = as_prompt_list(prompts)
        n = len(items)
        params = _one_each(sampling_params or SamplingParams(), n, "SamplingParams", SamplingParams)
        priorities = _one_each(priority, n, "priorities", int)
        if request_ids is None:
            request_ids = [str(next(self._ids)) for _ in range(n)]
        elif len(request_ids) != n:
            raise ValueError(f"got {n} prompts but {len(request_ids)} request ids")
        taken = [rid for rid in request_ids if rid in self.requests]
        if taken or len(set(request_ids)) != n:
            raise ValueError(f"request id {(taken or request_ids)[0]!r} is already in use")
        for sp in params:
            self._check_params(sp)
        processed = self.prompts.process(items, params)
        requests = []
        for (ids, text), sp, prio, rid in zip(processed, params, priorities, request_ids):
            req = Request(rid, ids, sp, prompt=text, priority=prio, token_bytes=self._token_bytes)
            self.requests[rid] = req
            if _is_special(sp):
                self._special.add(rid)
            if req.group is not None:
                self.groups[rid] = req.group
            self.scheduler.add(req)
            requests.append(req)
        return requests

    def _check_params(self, sp: SamplingParams) -> None:
        """What `SamplingParams` cannot check alone: token ids in the vocabulary, seats and a scheduler
        that forks for n samples. Raises `SamplingParamsError`."""
        vocab = self.model.config.vocab_size
        bad = [t for t in sp.logit_bias or () if t >= vocab]
        if bad:
            raise SamplingParamsError(
                f"logit_bias names token id {bad[0]} but the vocabulary has {vocab} tokens", "logit_bias"
            )
        if sp.n > self.config.max_num_seqs:
            raise SamplingParamsError(
                f"n={sp.n} samples cannot run at once: at most max_num_seqs={self.config.max_num_seqs} "
                "sequences run together (nanolab serve --max-num-seqs, or EngineConfig(max_num_seqs=...))",
                "n",
            )
        if sp.n > 1 and not callable(getattr(self.scheduler, "fork", None)):
            raise SamplingParamsError(
                f"n={sp.n} needs a scheduler with a fork(parent, child) method; "
                f"{type(self.scheduler).__name__} has none",
                "n",
            )

    def add_request(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> Request:
        """Queue one request (see `add_requests`)."""
        ids = None if request_id is None else [request_id]
        return self.add_requests([prompt], sampling_params, priority, ids)[0]

    def abort(self, request_id: str, reason: FinishReason | str = FinishReason.ABORT) -> RequestOutput | None:
        """Stop a request now; its KV blocks are freed. Returns its final output (None if unknown/finished).

        ``reason`` is "abort" or "timeout" (what the final output's ``finish_reason`` says). Aborting one
        sample of a parallel-sampling request aborts them all.
        """
        reason = FinishReason(reason)
        if reason not in (FinishReason.ABORT, FinishReason.TIMEOUT):
            raise ValueError(f"an abort's reason is 'abort' or 'timeout', got {reason.value!r}")
        req = self.requests.get(request_id)
        group = self.groups.get(request_id) or (req.group if req is not None else None)  # one sample: all
        live = [s for s in group.samples if not s.is_finished] if group is not None else [req] if req else []
        if not live:
            return None
        for r in live:
            self.scheduler.abort(r)
            self._finish(r, reason, release=False)
        if group is None:
            return RequestOutput.of(live[0], self.tokenizer is not None)
        group.n = len(group.samples)  # aborted before it forked: no more samples will come
        del self.groups[group.request_id]
        return RequestOutput.of_group(group, live, self.tokenizer is not None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step -----------------------------------------------------------------------------------

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that produced a token or finished.

        With ``finished_only`` it returns outputs for the requests that finished in this step only
        (what offline generation needs; it skips building a streaming delta for every running request).

        If anything in the step raises, the requests it was running are aborted (their blocks freed)
        and `EngineStepError` is raised with their final outputs; the engine can go on stepping. When
        the failure comes before a batch exists (admitting a request), the waiting requests are the
        ones aborted, or the next step would fail the same way.
        """
        self._in_flight: list[Request] | None = None
        try:
            return self._step(finished_only)
        except Exception as exc:
            waiting = [r for r in self.requests.values() if r.status != RequestStatus.RUNNING]
            victims = self._in_flight if self._in_flight is not None else waiting
            ids = dict.fromkeys(r.group.request_id if r.group else r.request_id for r in victims)
            outputs = [out for rid in ids if (out := self.abort(rid)) is not None]
            raise EngineStepError(
                f"the engine step failed ({type(exc).__name__}: {exc}); {len(outputs)} request(s) were aborted",
                outputs,
            ) from exc

    @torch.inference_mode()
    def _step(self, finished_only: bool) -> list[RequestOutput]:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if not out:
            if any(r.status == RequestStatus.RUNNING for r in self.requests.values()) or not self.requests:
                return []
            raise RuntimeError("the scheduler admitted nothing although no request is running")
        # One-token entries (decodes, and 1-token prefill chunks, which attend the same way) first: the
        # paged cache runs them as one decode-attention group. Stable, so a scheduler's order is kept.
        batch = sorted(out.scheduled, key=lambda s: s.num_new_tokens != 1)
        self._in_flight = [r for r, _ in batch]
        seqs, ids = [], []
        sample_rows, to_sample, prefilled = [], [], []
        row = 0
        for r, n in batch:
            start = r.num_computed_tokens
            seqs.append(SeqSlice(r.block_table, start, n))
            ids += r.token_slice(start, start + n)
            row += n
            if start + n == r.num_tokens:  # every token is computed: sample from the last row
                sample_rows.append(row - 1)
                to_sample.append(r)
                prefilled.append(n > 1)  # this step computed (the end of) a prompt, not a decode
        copies = out.blocks_to_copy  # copy-on-write (parallel samples), before any write
        if copies:
            self.kv_cache.copy_blocks(copies)
        positions = self.kv_cache.prepare(seqs)
        t1 = time.perf_counter()
        hidden = self.model(torch.tensor(ids, dtype=torch.long), positions, self.kv_cache)
        logits = self.model.compute_logits(hidden[sample_rows]) if to_sample else None
        special = bool(self._special)  # only then is there more to do than sample one token each
        if special and any(r.wants_prompt_logprobs for r, _ in batch):
            self._record_prompt_logprobs(batch, hidden)
        t2 = time.perf_counter()  # the model's share of the step ends here
        for r, n in batch:
            r.num_computed_tokens += n
        if special and any(r.samples_to_fork for r in to_sample):  # n > 1 prompts computed: fork them
            rows = []
            for i, r in enumerate(list(to_sample)):
                forks = self._fork(r)
                to_sample += forks
                prefilled += [False] * len(forks)  # the parent offers the prompt to the prefix cache
                rows += [i] * len(forks)
            logits = torch.cat([logits, logits[rows]])  # each sample draws its first token from the prompt's
        next_ids = self._sample(to_sample, logits, special) if to_sample else []

        now = time.monotonic()
        outputs = []
        has_text = self.tokenizer is not None
        changed: dict[str, list[Request]] = {}  # parallel-sampling requests: their samples with news
        for r, tok, was_prefill in zip(to_sample, next_ids, prefilled):
            if r.first_token_time is None:
                r.first_token_time = now
            r.output_token_ids.append(tok)
            reason = self._stop_reason(r, tok)
            if reason is not None:
                self._finish(r, reason)
            elif was_prefill:
                self.block_manager.cache_computed(r)  # share the prompt with requests admitted from now on
            if r.group is not None:
                changed.setdefault(r.group.request_id, []).append(r)
            elif reason is not None or not finished_only:
                outputs.append(RequestOutput.of(r, has_text))
        for gid, samples in changed.items():
            group = self.groups[gid]
            if group.finished:
                del self.groups[gid]
            if group.finished or not finished_only:
                outputs.append(RequestOutput.of_group(group, samples, has_text))

        step_seconds = time.perf_counter() - t0
        record = StepRecord(len(batch), out.num_tokens, len(next_ids), t2 - t1, step_seconds)
        self._steps += 1
        self._scheduled_seqs += record.num_seqs
        self._batched_tokens += record.num_tokens
        self._generated_tokens += record.num_generated
        self._forward_seconds += record.forward_seconds
        self._busy_seconds += record.step_seconds
        self._peak_kv_usage = max(self._peak_kv_usage, self.block_manager.usage())
        for listener in self.listeners:
            listener(record)
        return outputs

    def _sample(self, reqs: list[Request], logits: torch.Tensor, special: bool) -> list[int]:
        """One token per request; with ``special`` requests about, logit bias and penalties first (from
        each request's own tokens), and the logprobs of the chosen tokens (from the model's logits)."""
        params = [r.sampling_params for r in reqs]
        gens = [r.generator for r in reqs]
        if not special:
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

    def _fork(self, parent: Request) -> list[Request]:
        """The further samples of ``parent`` (none unless its n > 1 prompt was just computed), running and
        sharing its KV blocks. Sample i's seed is the request's seed + i (vLLM's rule)."""
        group, forks = parent.group, []
        if not parent.samples_to_fork:
            return forks
        seed = parent.sampling_params.seed
        for i in range(len(group.samples), group.n):
            params = dataclasses.replace(parent.sampling_params, n=1, seed=None if seed is None else seed + i)
            child = Request(
                group.sample_id(i),
                parent.prompt_token_ids,
                params,
                prompt=parent.prompt,
                priority=parent.priority,
                arrival_time=parent.arrival_time,
                token_bytes=self._token_bytes,
                group=group,
                sample_index=i,
            )
            child.prompt_logprobs = parent.prompt_logprobs  # the same prompt: known once for all
            group.samples.append(child)
            self.requests[child.request_id] = child
            if _is_special(params):
                self._special.add(child.request_id)
            self.scheduler.fork(parent, child)
            forks.append(child)
        return forks

    def _stop_reason(self, r: Request, tok: int) -> FinishReason | None:
        p = r.sampling_params
        if (tok == self.eos_token_id or tok in self.more_eos_token_ids) and not p.ignore_eos:
            return FinishReason.STOP
        if p.stop_token_ids and tok in p.stop_token_ids:
            return FinishReason.STOP
        if p.stop and self._truncate_at_stop(r):
            return FinishReason.STOP
        if len(r.output_token_ids) >= p.max_tokens or r.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    @staticmethod
    def _truncate_at_stop(r: Request) -> bool:
        text = r.output_text
        longest = max(map(len, r.sampling_params.stop))
        window = max(
            0, len(text) - longest - 8
        )  # only the tail can hold a new match (a token adds a few chars)
        hits = [i for s in r.sampling_params.stop if (i := text.find(s, window)) != -1]
        if not hits:
            return False
        r.output_text = text[: min(hits)]
        return True

    def _finish(self, r: Request, reason: FinishReason, release: bool = True) -> None:
        if release:
            self.scheduler.finish(r)
        finish(r, reason)
        r.finish_time = time.monotonic()
        self._finished_requests += 1
        del self.requests[r.request_id]  # the engine forgets finished requests (its caller has the output)
        self._special.discard(r.request_id)

    # -- introspection ------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """A snapshot of the counters and of the engine's state now (see `EngineStats`)."""
        allocator, cache = self.block_manager.allocator, self.block_manager.prefix_cache
        prefix = cache.stats() if cache is not None else None
        running = sum(r.status == RequestStatus.RUNNING for r in self.requests.values())
        return EngineStats(
            steps=self._steps,
            generated_tokens=self._generated_tokens,
            batched_tokens=self._batched_tokens,
            finished_requests=self._finished_requests,
            busy_seconds=self._busy_seconds,
            forward_seconds=self._forward_seconds,
            mean_batch_size=self._scheduled_seqs / self._steps if self._steps else 0.0,
            peak_kv_block_usage=self._peak_kv_usage,
            preemptions=getattr(self.scheduler, "num_preemptions", 0),
            num_running=running,
            num_waiting=len(self.requests) - running,
            kv_blocks_total=allocator.num_total,
            kv_blocks_free=allocator.num_free,
            kv_blocks_cached=cache.total_size // self.config.block_size if cache is not None else 0,
            prefix_hit_rate=prefix.hit_rate if prefix is not None else 0.0,
            prefix_cached_tokens=prefix.cached_tokens if prefix is not None else 0,
        )


def _is_special(p: SamplingParams) -> bool:
    """Whether a request needs more of a step than one sampled token (see ``Engine._special``)."""
    return p.n > 1 or p.logprobs is not None or p.prompt_logprobs is not None or p.adjusts_logits


def _build(given: Any, default: type, *args: Any) -> Any:
    """An instance from ``given`` (None: the default class; a class or factory: called with args)."""
    if given is None:
        return default(*args)
    if isinstance(given, type) or (callable(given) and not hasattr(given, "allocate")):
        return given(*args)
    return given


def _one_each(value: Any, n: int, what: str, kind: type) -> list:
    """``value`` for each of n prompts: one for all (an instance of ``kind``), or a sequence of n."""
    if isinstance(value, kind) and not isinstance(value, bool):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"got {n} prompts but {len(values)} {what}; give one for all or one each")
    return values
