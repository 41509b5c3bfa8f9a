"""The engine: continuous batching, one step at a time.

Each `step` does: schedule (which requests, how many tokens each) -> build the flattened batch and lay
out the paged KV cache -> one model forward for all of it -> sample one token for every request whose
prompt is now fully computed -> append, detokenize, check stop conditions, release finished requests ->
return the incremental outputs. Requests join and leave the batch at every step: that is continuous
batching.

The engine is assembled from swappable parts, each behind a small protocol: the block allocator
(`BlockAllocatorProtocol`), the prefix cache (`PrefixCacheProtocol`), the scheduler
(`SchedulerProtocol`) and the attention backend of the paged cache.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from nanolab.engine.config import EngineConfig
from nanolab.engine.request import FinishReason, Request, RequestOutput, RequestStatus
from nanolab.engine.scheduler import Scheduler, SchedulerProtocol
from nanolab.memory.block_allocator import BlockAllocator, BlockAllocatorProtocol
from nanolab.memory.block_manager import BlockManager
from nanolab.memory.paged_kv_cache import PagedKVCache, SeqSlice
from nanolab.memory.paging import cdiv
from nanolab.memory.prefix_cache import PrefixCacheProtocol
from nanolab.memory.radix_cache import RadixCache
from nanolab.model.sampling import SamplingParams, sample
from nanolab.model.transformer import Transformer


@dataclass
class EngineStats:
    """Counters since the engine started (see `Engine.stats`)."""

    steps: int = 0
    scheduled_seqs: int = 0  # sum over steps of requests in the batch
    batched_tokens: int = 0  # prompt + decode tokens computed
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    generated_tokens: int = 0
    finished_requests: int = 0
    busy_time: float = 0.0  # seconds spent inside step()
    forward_time: float = 0.0  # of which in the model forward + logits
    peak_kv_usage: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


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
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        cfg = (config or EngineConfig()).resolve(model.config)
        self.config = cfg
        self.max_model_len = cfg.max_model_len
        self.num_blocks = cfg.num_blocks

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
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self._ids = itertools.count()
        self.stats_ = EngineStats()
        # Set to a list to record (requests, tokens, forward seconds, step seconds) for every step.
        self.step_log: list[tuple[int, int, float, float]] | None = None
        # Each token's bytes, looked up once here rather than decoded for every generated token;
        # special tokens (end-of-text, ...) add no text.
        self._token_bytes: list[bytes | None] | None = None
        if tokenizer is not None:
            special = set(getattr(tokenizer, "special_tokens", {}).values())
            self._token_bytes = [
                None if i in special else tokenizer.decode_bytes([i]) for i in range(tokenizer.vocab_size)
            ]
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None) if tokenizer else None

    # -- requests -----------------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text or as token ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass the prompt as a list of token ids")
            return prompt, self.tokenizer.encode(prompt, allowed_special="all")
        return None, [int(t) for t in prompt]

    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        prompt_text: str | None = None,
    ) -> Request:
        """Queue a request. Raises `ValueError` at once for a request that could never run."""
        params = sampling_params or SamplingParams()
        text, ids = self.tokenize(prompt)
        self.check_request(ids, params)
        rid = str(next(self._ids)) if request_id is None else request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(
            rid, ids, params, prompt=text or prompt_text, priority=priority, token_bytes=self._token_bytes
        )
        self.requests[rid] = req
        self.scheduler.add(req)
        return req

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        """Raise `ValueError` (saying which limit and how to change it) for a request that could never run."""
        P, M, L = len(ids), params.max_tokens, self.max_model_len
        if P == 0:
            raise ValueError("the prompt is empty; give at least one token")
        vocab = self.model.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if P + M > L:
            raise ValueError(
                f"the prompt has {P} tokens and max_tokens is {M}: {P + M} > max_model_len {L}; "
                "shorten the prompt, lower max_tokens or raise max_model_len"
            )
        need = cdiv(P + M, self.config.block_size)
        if need > self.num_blocks:
            raise ValueError(
                f"the request needs up to {need} KV blocks ({P} prompt + {M} output tokens) but the pool has only "
                f"{self.num_blocks}; raise num_blocks or lower max_tokens"
            )
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and P > budget:
            raise ValueError(
                f"the prompt has {P} tokens but, without chunked prefill, a prompt must fit in one step of "
                f"max_num_batched_tokens={budget}; raise it or enable chunked prefill"
            )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its KV blocks are freed. Returns its final output (None if unknown/finished)."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        self.scheduler.abort(req)
        self._finish(req, FinishReason.ABORT, release=False)
        return RequestOutput.of(req, self.tokenizer is not None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that produced a token or finished.

        With ``finished_only`` it returns outputs for the requests that finished in this step only
        (what offline generation needs; it skips building a streaming delta for every running request).
        """
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if not out:
            if self.scheduler.running or not self.scheduler.waiting:
                return []
            raise RuntimeError("the scheduler admitted nothing although no request is running")
        batch = out.scheduled
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
        positions = self.kv_cache.prepare(seqs)
        t1 = time.perf_counter()
        hidden = self.model(torch.tensor(ids, dtype=torch.long), positions, self.kv_cache)
        logits = self.model.compute_logits(hidden[sample_rows]) if to_sample else None
        t2 = time.perf_counter()  # the model's share of the step ends here
        next_ids: list[int] = []
        if to_sample:
            gens = [r.generator for r in to_sample]
            next_ids = sample(logits, [r.sampling_params for r in to_sample], gens).tolist()

        for r, n in batch:
            r.num_computed_tokens += n
        now = time.monotonic()
        outputs = []
        has_text = self.tokenizer is not None
        for r, tok, was_prefill in zip(to_sample, next_ids, prefilled):
            if r.first_token_time is None:
                r.first_token_time = now
            r.output_token_ids.append(tok)
            reason = self._stop_reason(r, tok)
            if reason is not None:
                self._finish(r, reason)
            elif was_prefill:
                self.block_manager.cache_computed(r)  # share the prompt with requests admitted from now on
            if reason is not None or not finished_only:
                outputs.append(RequestOutput.of(r, has_text))

        st = self.stats_
        st.steps += 1
        st.scheduled_seqs += len(batch)
        st.batched_tokens += out.num_tokens
        st.generated_tokens += len(next_ids)
        st.forward_time += t2 - t1
        step_time = time.perf_counter() - t0
        st.busy_time += step_time
        if self.step_log is not None:
            self.step_log.append((len(batch), out.num_tokens, t2 - t1, step_time))
        st.peak_kv_usage = max(st.peak_kv_usage, self.block_manager.usage())
        return outputs

    def _stop_reason(self, r: Request, tok: int) -> FinishReason | None:
        p = r.sampling_params
        if tok == self.eos_token_id and not p.ignore_eos:
            return FinishReason.STOP
        if p.stop_token_ids and tok in p.stop_token_ids:
            return FinishReason.STOP
        if p.stop and self._truncate_at_stop(r):
            return FinishReason.STOP
        if len(r.output_token_ids) >= p.max_tokens or r.num_tokens >= self.max_model_len:
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
        r.status = RequestStatus.FINISHED
        r.finish_reason = reason
        r.finish_time = time.monotonic()
        self.stats_.finished_requests += 1
        del self.requests[r.request_id]  # the engine forgets finished requests (its caller has the output)

    # -- introspection ------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        st = self.stats_
        cache = self.block_manager.prefix_cache
        return {
            "steps": st.steps,
            "generated_tokens": st.generated_tokens,
            "batched_tokens": st.batched_tokens,
            "finished_requests": st.finished_requests,
            "throughput_tokens_per_s": st.generated_tokens / st.busy_time if st.busy_time else 0.0,
            "mean_batch_size": st.scheduled_seqs / st.steps if st.steps else 0.0,
            "forward_fraction": st.forward_time / st.busy_time if st.busy_time else 0.0,
            "kv_blocks_total": self.num_blocks,
            "kv_block_usage": self.block_manager.usage(),
            "peak_kv_block_usage": st.peak_kv_usage,
            "prefix_hit_rate": cache.stats().hit_rate if cache is not None else 0.0,
            "prefix_cached_tokens": cache.stats().cached_tokens if cache is not None else 0,
            "preemptions": getattr(self.scheduler, "num_preemptions", 0),
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
        }


def _build(given: Any, default: type, *args: Any) -> Any:
    """An instance from ``given`` (None: the default class; a class or factory: called with args)."""
    if given is None:
        return default(*args)
    if isinstance(given, type) or (callable(given) and not hasattr(given, "allocate")):
        return given(*args)
    return given
