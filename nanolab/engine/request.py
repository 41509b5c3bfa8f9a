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

Deliberately left out: beam search and parallel sampling (n > 1), logprobs, LoRA adapters.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from nanolab.model.sampling import SamplingParams, make_generator


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
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

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
    """One generated continuation (nanolab always generates one per request)."""

    index: int
    text: str | None  # None when the engine has no tokenizer
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "timeout", None while running
    delta_text: str = ""  # text added since the previous streamed output
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    """What `LLM.generate` returns and `LLM.stream` yields for a request (vLLM's shape)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics

    @classmethod
    def of(cls, req: Request, has_text: bool) -> RequestOutput:
        """The request's output so far; the deltas are what no earlier `of` call returned.

        While a request runs, the last ``len(longest stop string) - 1`` characters are held back from
        ``delta_text``: they might be the start of a stop string that must not be shown.
        """
        visible = len(req.output_text)
        if not req.is_finished and req.sampling_params.stop:
            visible = max(req._emitted_text, visible - (max(map(len, req.sampling_params.stop)) - 1))
        new_text = req.output_text[req._emitted_text : visible]
        new_ids = req.output_token_ids[req._emitted_tokens :]
        req._emitted_text, req._emitted_tokens = visible, len(req.output_token_ids)
        completion = CompletionOutput(
            index=0,
            text=req.output_text if has_text else None,
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            delta_text=new_text if has_text else "",
            delta_token_ids=new_ids,
        )
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_token_time=req.first_token_time,
            finish_time=req.finish_time,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids),
            num_cached_tokens=req.num_cached_tokens,
            num_preemptions=req.num_preemptions,
        )
        return cls(
            req.request_id, req.prompt, list(req.prompt_token_ids), [completion], req.is_finished, metrics
        )
