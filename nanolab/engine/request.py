r"""A request's life in the engine: its state machine, its progress and its outputs.

    WAITING --admit--> RUNNING --finish--> FINISHED
                       ^     |
                  admit|     |preempt          (abort: WAITING, RUNNING or PREEMPTED -> FINISHED)
                       |     v
                      PREEMPTED

A request is WAITING until the scheduler admits it, RUNNING while it holds KV blocks and is being
prefilled or decoded, PREEMPTED when the scheduler took its blocks back (it is back in the waiting queue,
to be recomputed from scratch, keeping the tokens it already generated), and FINISHED with a reason:
"stop" (end-of-sequence, a stop token or a stop string), "length" (max_tokens or the model's context
length), "abort", or "timeout" (an abort because the request's deadline passed). `admit`, `preempt` and `finish` are the only moves; any other raises
`IllegalTransition`. As in vLLM, a preempted request is admitted again straight from PREEMPTED.

`num_computed_tokens` is the number of the request's tokens whose keys and values are in the KV cache.
Prefill is over once it reaches the prompt length; each decode step then adds one. Preemption resets it
to 0 (recompute), and the prefix cache may start it above 0.

Parallel sampling (``n > 1``): the request is sample 0 of a `SampleGroup`. Once its prompt is computed,
the engine forks it into ``n - 1`` more samples that share the prompt's KV blocks (see
`nanolab.memory.block_manager.BlockManager.fork`); each is a `Request` of its own from then on, and the
group's outputs carry one `CompletionOutput` per sample.

Deliberately left out: beam search, LoRA adapters.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from nanolab.model.sampling import SamplingParams, TokenLogprob, make_generator


class RequestStatus(str, Enum):
    """Where a request is in its life (compare with ``==``: a status equals its value, ``"running"``)."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    TIMEOUT = "timeout"  # aborted because its deadline passed (the server's request timeout)


class IllegalTransition(RuntimeError):
    """A request was asked to move between two states its state machine does not connect."""


def _move(req: Request, allowed: tuple[RequestStatus, ...], to: RequestStatus, event: str) -> None:
    if req.status not in allowed:
        raise IllegalTransition(
            f"request {req.request_id!r} cannot {event}: it is {RequestStatus(req.status).value}, "
            f"and only a {' or '.join(s.value for s in allowed)} request can"
        )
    req.status = to


def admit(req: Request) -> None:
    """WAITING or PREEMPTED -> RUNNING: the scheduler gave the request its KV blocks.

    Raises IllegalTransition from any other state.

    Example:
        >>> r = Request("r", [1, 2, 3], SamplingParams())
        >>> admit(r); r.status.value
        'running'
    """
    _move(req, (RequestStatus.WAITING, RequestStatus.PREEMPTED), RequestStatus.RUNNING, "be admitted")


def preempt(req: Request) -> None:
    """RUNNING -> PREEMPTED: the request lost its KV blocks and will be recomputed from scratch.

    ``num_computed_tokens`` goes back to 0 and ``num_preemptions`` up by one; the tokens it generated are
    kept (recomputing them gives their keys and values back). Raises IllegalTransition unless RUNNING.
    """
    _move(req, (RequestStatus.RUNNING,), RequestStatus.PREEMPTED, "be preempted")
    req.num_computed_tokens = 0
    req.num_preemptions += 1


def finish(req: Request, reason: FinishReason) -> None:
    """-> FINISHED with ``reason``: "stop" or "length" from RUNNING only, "abort" or "timeout" from any live
    state.

    Raises IllegalTransition for a finished request, or for "stop"/"length" on a request not running.
    """
    reason = FinishReason(reason)
    live = (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED)
    allowed = live if reason in (FinishReason.ABORT, FinishReason.TIMEOUT) else (RequestStatus.RUNNING,)
    _move(req, allowed, RequestStatus.FINISHED, f"finish with {reason.value!r}")
    req.finish_reason = reason


@dataclass(eq=False)
class Request:
    """One generation request and everything the engine tracks about it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    priority: int = 0  # lower value = served first (as in vLLM)
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_step: int = 0  # engine step at arrival, for priority aging

    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens with KV in the cache
    block_table: list[int] = field(default_factory=list)  # KV block ids, in token order
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at the last admission
    prefix_node: Any = None  # the prefix cache node this request has locked, if any
    num_preemptions: int = 0
    admitted_seq: int | None = None  # order of the last admission, for picking preemption victims

    first_token_time: float | None = None
    finish_time: float | None = None
    generator: torch.Generator | None = None

    group: SampleGroup | None = None  # the n samples this request is one of (None when n == 1)
    sample_index: int = 0  # which sample of its group (its CompletionOutput's index)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # with SamplingParams.logprobs
    # with SamplingParams.prompt_logprobs: one per prompt token computed so far (None for the first)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)

    # Each token id's bytes (None: a special token, no text), shared by every request of an engine;
    # None when the engine has no tokenizer. `output_text` decodes through it.
    token_bytes: Sequence[bytes | None] | None = None
    _text: str = field(default="", init=False)  # output_token_ids[:_num_decoded], decoded
    _num_decoded: int = field(default=0, init=False)
    _decoder: Any = field(default=None, init=False)  # incremental UTF-8 decoder over the output bytes
    _emitted_text: int = field(default=0, init=False)  # output_text characters already handed out
    _emitted_tokens: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.generator = make_generator(self.sampling_params.seed)
        if self.sampling_params.n > 1 and self.group is None:
            self.group = SampleGroup(self.request_id, self.sampling_params.n, [self])
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while some prompt token's log-probability is still to be computed. Such a request
        computes its whole prompt: the prefix cache would skip the positions it needs."""
        want = self.sampling_params.prompt_logprobs is not None
        return want and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def samples_to_fork(self) -> int:
        """How many more samples this request forks into once its prompt is computed (n - 1, then 0)."""
        g = self.group
        return g.n - len(g.samples) if g is not None and self.sample_index == 0 else 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list (the engine calls it every step)."""
        P = len(self.prompt_token_ids)
        if start >= P:
            return self.output_token_ids[start - P : end - P]
        if end <= P:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - P]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        """True until every token but the last has its KV cached (a resumed request re-prefills its output)."""
        return self.num_computed_tokens < self.num_tokens - 1

    def remaining_prefill(self) -> int:
        """Tokens still to compute before the request samples again (1 for a decode step)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def output_text(self) -> str:
        """The output so far as text; an incomplete UTF-8 character at the end waits for its next bytes.

        Decoded on demand — when a stop string is checked or an output is built — rather than at every
        generated token: offline generation without stop strings decodes each request once, at the end.
        Feeding the incremental decoder many tokens' bytes at once gives the same text as one at a time.
        """
        table = self.token_bytes
        if table is not None and self._num_decoded < len(self.output_token_ids):
            new = self.output_token_ids[self._num_decoded :]
            data = b"".join(b for t in new if t < len(table) and (b := table[t]) is not None)
            self._text += self._decoder.decode(data)
            self._num_decoded += len(new)
        return self._text

    @output_text.setter
    def output_text(self, text: str) -> None:
        """Replace the text of every token generated so far (used to cut the output at a stop string)."""
        self._num_decoded = len(self.output_token_ids)
        self._text = text


@dataclass(eq=False)
class SampleGroup:
    """The ``n`` samples of one request: sample 0 computes the prompt, then forks into the others."""

    request_id: str  # the request's id (sample 0's); the other samples' ids add "#<index>"
    n: int  # samples in all (lowered to those that exist if the group is aborted before it forks)
    samples: list[Request]

    @property
    def finished(self) -> bool:
        return len(self.samples) == self.n and all(s.is_finished for s in self.samples)

    def sample_id(self, index: int) -> str:
        return f"{self.request_id}#{index}"


@dataclass(frozen=True)
class RequestMetrics:
    """Timing of one request, in seconds (time.monotonic clock)."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int

    @property
    def ttft(self) -> float | None:
        """Time to first token: from arrival to the first output token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between output tokens after the first (the inter-token latency)."""
        if self.finish_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass
class CompletionOutput:
    """One generated continuation: a request has one per sample (``SamplingParams.n``)."""

    index: int  # the sample's index, 0 .. n - 1
    text: str | None  # None when the engine has no tokenizer
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "timeout", None while running
    delta_text: str = ""  # text added since the previous streamed output
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, with SamplingParams.logprobs
    delta_logprobs: list[TokenLogprob] | None = None  # those of delta_token_ids


@dataclass
class RequestOutput:
    """What `LLM.generate` returns and `LLM.stream` yields for a request (vLLM's shape)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # with SamplingParams.prompt_logprobs: one per prompt token (None for the first), once all are known
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @classmethod
    def of(cls, req: Request, has_text: bool) -> RequestOutput:
        """The request's output so far; the deltas are what no earlier `of` call returned.

        While a request runs, the last ``len(longest stop string) - 1`` characters are held back from
        ``delta_text``: they might be the start of a stop string that must not be shown.
        """
        return cls._build(req, [_completion(req, has_text)], req.is_finished, len(req.output_token_ids))

    @classmethod
    def of_group(cls, group: SampleGroup, changed: Sequence[Request], has_text: bool) -> RequestOutput:
        """A parallel-sampling request's output: a `CompletionOutput` for each sample in ``changed`` (by
        index), or for every sample once the group has finished. Its metrics count every sample's tokens."""
        samples = group.samples if group.finished else sorted(changed, key=lambda s: s.sample_index)
        completions = [_completion(s, has_text) for s in samples]
        num_output = sum(len(s.output_token_ids) for s in group.samples)
        return cls._build(group.samples[0], completions, group.finished, num_output)

    @classmethod
    def _build(
        cls, req: Request, completions: list[CompletionOutput], finished: bool, num_output: int
    ) -> RequestOutput:
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_token_time=req.first_token_time,
            finish_time=req.finish_time,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=num_output,
            num_cached_tokens=req.num_cached_tokens,
            num_preemptions=req.num_preemptions,
        )
        rid = req.group.request_id if req.group is not None else req.request_id
        prompt_lp = None
        if req.sampling_params.prompt_logprobs is not None and not req.wants_prompt_logprobs:
            prompt_lp = list(req.prompt_logprobs)
        return cls(rid, req.prompt, list(req.prompt_token_ids), completions, finished, metrics, prompt_lp)


def _completion(req: Request, has_text: bool) -> CompletionOutput:
    """One sample's `CompletionOutput`; its deltas are what no earlier call returned (see `RequestOutput.of`)."""
    visible = len(req.output_text)
    if not req.is_finished and req.sampling_params.stop:
        visible = max(req._emitted_text, visible - (max(map(len, req.sampling_params.stop)) - 1))
    new_text = req.output_text[req._emitted_text : visible]
    first_new = req._emitted_tokens
    req._emitted_text, req._emitted_tokens = visible, len(req.output_token_ids)
    with_logprobs = req.sampling_params.logprobs is not None
    return CompletionOutput(
        index=req.sample_index,
        text=req.output_text if has_text else None,
        token_ids=list(req.output_token_ids),
        finish_reason=req.finish_reason.value if req.finish_reason else None,
        delta_text=new_text if has_text else "",
        delta_token_ids=req.output_token_ids[first_new:],
        logprobs=list(req.output_logprobs) if with_logprobs else None,
        delta_logprobs=req.output_logprobs[first_new:] if with_logprobs else None,
    )
