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

Parallel sampling (``n > 1``): the request is sample 0 of a `SampleGroup` (see
`nanolab.engine.parallel`). The request's text, its stop rules and its outputs are not here: see
`nanolab.engine.output_processor`.

Deliberately left out: beam search, LoRA adapters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from nanolab.engine.parallel import SampleGroup
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
    # speculative decoding: the proposer's guesses of the next tokens, checked in the next decode step
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: Any = (
        None  # (len(spec_token_ids), V): the distributions they were drawn from; None: certain
    )
    # with SamplingParams.prompt_logprobs: one per prompt token computed so far (None for the first)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.generator = make_generator(self.sampling_params.seed)
        if self.sampling_params.n > 1 and self.group is None:
            self.group = SampleGroup(self.request_id, self.sampling_params.n, [self])

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
