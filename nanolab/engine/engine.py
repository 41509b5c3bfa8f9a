"""The engine: continuous batching, one step at a time.

A step is five calls: the scheduler picks the requests and how many new tokens each computes
(`nanolab.engine.scheduler`); `layout_batch` flattens them into one batch; the `ModelRunner` runs one
forward for all of it and samples a token for every request whose tokens are all computed
(`nanolab.engine.model_runner`); the tokens are appended and the `OutputProcessor` checks the stop rules
and builds the outputs (`nanolab.engine.output_processor`); the step is recorded for observers
(`nanolab.engine.stats`). Requests join and leave the batch at every step: that is continuous batching.

The engine is assembled from swappable parts, each behind a small protocol: the block allocator
(`BlockAllocatorProtocol`), the prefix cache (`PrefixCacheProtocol`), the scheduler
(`SchedulerProtocol`) and the attention backend of the paged cache. Requests enter through
`add_requests` (see `nanolab.engine.prompt`); ``n > 1`` samples of one prompt are forked from it once
the prompt is computed (see `nanolab.engine.parallel`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from nanolab.engine.config import EngineConfig
from nanolab.engine.model_runner import BatchLayout, ModelRunner, layout_batch, needs_extras
from nanolab.engine.output_processor import OutputProcessor
from nanolab.engine.outputs import RequestOutput
from nanolab.engine.parallel import SampleGroup, fork_samples
from nanolab.engine.prompt import (
    Prompt,
    PromptProcessor,
    as_prompt_list,
    check_sampling_params,
    one_each,
)
from nanolab.engine.request import FinishReason, Request, RequestStatus, finish
from nanolab.engine.scheduler import Scheduler, SchedulerOutput, SchedulerProtocol
from nanolab.engine.stats import EngineStats, StepCounters, StepListener, StepRecord
from nanolab.memory.block_allocator import BlockAllocator, BlockAllocatorProtocol
from nanolab.memory.block_manager import BlockManager
from nanolab.memory.paged_kv_cache import PagedKVCache
from nanolab.memory.prefix_cache import PrefixCacheProtocol
from nanolab.memory.radix_cache import RadixCache
from nanolab.model.sampling import SamplingParams
from nanolab.model.transformer import Transformer


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
        self.runner = ModelRunner(self.model, self.kv_cache)
        self.outputs = OutputProcessor(tokenizer, cfg.max_model_len)
        self.requests: dict[str, Request] = {}  # unfinished requests (and samples) by id
        self.groups: dict[str, SampleGroup] = {}  # unfinished parallel-sampling requests by id
        # unfinished requests that need more than one sampled token (`needs_extras`): a step with none of
        # them about takes the model runner's fast path
        self._with_extras: set[str] = set()
        self._ids = itertools.count()
        self.listeners = tuple(listeners)
        self.prompts = PromptProcessor(tokenizer, model.config.vocab_size, cfg)
        self.counters = StepCounters()

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
        params = one_each(sampling_params or SamplingParams(), n, "SamplingParams", SamplingParams)
        priorities = one_each(priority, n, "priorities", int)
        if request_ids is None:
            request_ids = [str(next(self._ids)) for _ in range(n)]
        elif len(request_ids) != n:
            raise ValueError(f"got {n} prompts but {len(request_ids)} request ids")
        taken = [rid for rid in request_ids if rid in self.requests]
        if taken or len(set(request_ids)) != n:
            raise ValueError(f"request id {(taken or request_ids)[0]!r} is already in use")
        for sp in params:
            check_sampling_params(sp, self.model.config.vocab_size, self.config.max_num_seqs, self.scheduler)
        processed = self.prompts.process(items, params)
        requests = []
        for (ids, text), sp, prio, rid in zip(processed, params, priorities, request_ids):
            req = Request(rid, ids, sp, prompt=text, priority=prio)
            self._register(req)
            if req.group is not None:
                self.groups[rid] = req.group
            self.scheduler.add(req)
            requests.append(req)
        return requests

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
            return self.outputs.output(live[0])
        group.n = len(group.samples)  # aborted before it forked: no more samples will come
        del self.groups[group.request_id]
        return self.outputs.group_output(group, live)

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

    def _step(self, finished_only: bool) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if not sched:
            return self._nothing_scheduled()
        batch = layout_batch(sched.scheduled)
        self._in_flight = batch.requests
        tokens = self.runner.run(batch, sched.blocks_to_copy, bool(self._with_extras), self._fork)
        outputs = self._process(batch, tokens, finished_only)
        self._record(sched, batch, len(tokens), t0)
        return outputs

    def _nothing_scheduled(self) -> list[RequestOutput]:
        if any(r.status == RequestStatus.RUNNING for r in self.requests.values()) or not self.requests:
            return []
        raise RuntimeError("the scheduler admitted nothing although no request is running")

    def _process(self, batch: BatchLayout, tokens: list[int], finished_only: bool) -> list[RequestOutput]:
        """Append each sampled token, stop or go on, and build the outputs: every request that got a
        token (or, with ``finished_only``, those that finished), a parallel-sampling request once."""
        now = time.monotonic()
        for r, tok, prefilled in zip(batch.to_sample, tokens, batch.prefilled):
            if r.first_token_time is None:
                r.first_token_time = now
            r.output_token_ids.append(tok)
            reason = self.outputs.stop_reason(r, tok)
            if reason is not None:
                self._finish(r, reason)
            elif prefilled:
                self.block_manager.cache_computed(r)  # share the prompt with requests admitted from now on
        return self.outputs.step_outputs(batch.to_sample, self.groups, finished_only)

    def _record(self, sched: SchedulerOutput, batch: BatchLayout, num_generated: int, t0: float) -> None:
        record = StepRecord(
            len(batch.scheduled),
            sched.num_tokens,
            num_generated,
            self.runner.forward_seconds,
            time.perf_counter() - t0,
        )
        self.counters.add(record, self.block_manager.usage())
        for listener in self.listeners:
            listener(record)

    def _register(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.outputs.add(req)
        if needs_extras(req.sampling_params):
            self._with_extras.add(req.request_id)

    def _fork(self, parent: Request) -> list[Request]:
        """Start the further samples of ``parent``, whose n > 1 prompt was just computed."""
        children = fork_samples(parent)
        for child in children:
            self._register(child)
            self.scheduler.fork(parent, child)
        return children

    def _finish(self, r: Request, reason: FinishReason, release: bool = True) -> None:
        if release:
            self.scheduler.finish(r)
        finish(r, reason)
        r.finish_time = time.monotonic()
        self.counters.finished_requests += 1
        del self.requests[r.request_id]  # the engine forgets finished requests (its caller has the output)
        self._with_extras.discard(r.request_id)

    # -- introspection ------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """A snapshot of the counters and of the engine's state now (see `EngineStats`)."""
        running = sum(r.status == RequestStatus.RUNNING for r in self.requests.values())
        waiting = len(self.requests) - running
        preemptions = getattr(self.scheduler, "num_preemptions", 0)
        return self.counters.snapshot(running, waiting, preemptions, self.block_manager)


def _build(given: Any, default: type, *args: Any) -> Any:
    """An instance from ``given`` (None: the default class; a class or factory: called with args)."""
    if given is None:
        return default(*args)
    if isinstance(given, type) or (callable(given) and not hasattr(given, "allocate")):
        return given(*args)
    return given
