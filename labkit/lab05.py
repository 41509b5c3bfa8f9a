from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import torch


class RequestStatus(str, Enum):
    """Where a request is in its life (nanolab's has the same values; a status equals its value, "running")."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, Enum):
    STOP = "stop"  # end of text, a stop token or a stop string
    LENGTH = "length"  # max_tokens, or the model's context length
    ABORT = "abort"  # the caller gave up: a disconnect, a timeout


class IllegalTransition(RuntimeError):
    """A move the request state machine does not have (nanolab's error has the same name)."""


@dataclass(eq=False)
class Request:
    """The fields of nanolab's `Request` that a scheduler reads and writes (the engine's has more)."""

    request_id: str
    prompt_token_ids: list[int]
    priority: int = 0  # lower value = more important (as in vLLM)
    arrival_time: float = 0.0  # when it arrived; every policy breaks ties by it, earliest first
    arrival_step: int = 0  # the scheduler's step count when it arrived (Scheduler.add sets it)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose keys and values are in the KV cache
    block_table: list[int] = field(default_factory=list)  # its KV blocks (the block manager fills it)
    num_preemptions: int = 0
    admitted_seq: int | None = None  # 1 for the scheduler's first admission, 2 for the next, ...
    num_cached_tokens: int = 0  # (the prefix cache's, Lab 6)
    prefix_node: object = None  # (the prefix cache's, Lab 6)
    group: object = None  # (parallel sampling's: the samples of one request, which share blocks)
    samples_to_fork: int = 0  # (parallel sampling's: samples still to fork once the prompt is computed)
    wants_prompt_logprobs: bool = False  # (True: the prefix cache may not serve its prompt)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def remaining_prefill(self) -> int:
        """Tokens to compute before the request samples again: 1 for a decode step."""
        return self.num_tokens - self.num_computed_tokens


class OutOfBlocksError(RuntimeError):
    """More KV blocks were asked for than are free (nanolab's own error has the same name)."""


class BlockAllocator:
    """Lab 3's allocator, without sharing: block ids handed out and taken back first in, first out."""

    def __init__(self, num_blocks: int) -> None:
        self.num_total = num_blocks
        self._free = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(f"cannot allocate {n} blocks: only {len(self._free)} are free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, block_ids: Sequence[int]) -> None:
        self._free.extend(block_ids)


class BlockManager:
    """Lab 3's block tables: nanolab's `BlockManager` without the prefix cache and sharing (same methods)."""

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size

    @property
    def num_total_blocks(self) -> int:
        return self.allocator.num_total

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def usage(self) -> float:
        """Fraction of the pool's blocks held."""
        return 1 - self.allocator.num_free / self.allocator.num_total

    def admit(self, req: Request, max_new_tokens: int | None) -> int | None:
        """Give a waiting request blocks for its next chunk and return its token count: all its tokens (capped
        at ``max_new_tokens``; None: no cap). Returns None, changing nothing, if the blocks are not free."""
        num_new = req.num_tokens if max_new_tokens is None else min(req.num_tokens, max_new_tokens)
        needed = self.num_blocks_for(num_new)
        if num_new <= 0 or needed > self.allocator.num_free:
            return None
        req.block_table = self.allocator.allocate(needed)
        req.num_computed_tokens = 0
        return num_new

    def grow(self, req: Request, num_new_tokens: int) -> bool:
        """Make room for a running request's next ``num_new_tokens`` tokens; False (changing nothing) if the
        blocks are not free."""
        needed = self.num_blocks_for(req.num_computed_tokens + num_new_tokens) - len(req.block_table)
        if needed <= 0:
            return True
        if needed > self.allocator.num_free:
            return False
        req.block_table += self.allocator.allocate(needed)
        return True

    def release(self, req: Request) -> None:
        """Give back every block of a request (finish, abort or preemption); its KV is gone."""
        self.allocator.free(req.block_table)
        req.block_table = []
        req.num_computed_tokens = 0


def importance(req: Request) -> tuple[int, int]:
    """Sort key among running requests, most important first: priority, then the earliest admitted."""
    return (req.priority, req.admitted_seq or 0)


@dataclass
class SchedulerConfig:
    """The settings a scheduler reads: the fields of nanolab's `EngineConfig` with the same names."""

    max_num_seqs: int = 64  # requests running at once, at most
    max_num_batched_tokens: int = 512  # tokens computed per step, at most (the token budget)
    scheduling_policy: str = "fcfs"  # "fcfs", "priority" or "shortest" (see waiting_order)
    aging_steps: int = 16  # with "priority": steps of waiting that count as one level
    enable_chunked_prefill: bool = True  # split a prompt over several steps (this lab); False: one step each


class ScheduledRequest(NamedTuple):
    request: Request
    num_new_tokens: int  # tokens computed this step, from request.num_computed_tokens on


@dataclass
class SchedulerOutput:
    """One step's batch, and the requests preempted to make room for it."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (parallel sampling's copy-on-write)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


# Lab 4's answers: the moves of the state machine, the waiting queue's order and the preemption victim.


def admit(req: Request) -> None:
    """WAITING or PREEMPTED -> RUNNING (IllegalTransition from any other state)."""
    if req.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
        raise IllegalTransition(
            f"request {req.request_id!r} is {RequestStatus(req.status).value}: it cannot be admitted"
        )
    req.status = RequestStatus.RUNNING


def preempt(req: Request) -> None:
    """RUNNING -> PREEMPTED: nothing computed any more, one more preemption, the output kept."""
    if req.status != RequestStatus.RUNNING:
        raise IllegalTransition(
            f"request {req.request_id!r} is {RequestStatus(req.status).value}: it cannot be preempted"
        )
    req.status = RequestStatus.PREEMPTED
    req.num_computed_tokens = 0
    req.num_preemptions += 1


def waiting_order(waiting: Sequence[Request], policy: str, now: int, aging_steps: int) -> list[Request]:
    """The waiting requests in admission order: "fcfs", "shortest" (fewest tokens left) or "priority" (aged by
    one level per whole ``aging_steps`` steps waited); ties by arrival_time."""
    if policy == "fcfs":
        return sorted(waiting, key=lambda r: r.arrival_time)
    if policy == "shortest":
        return sorted(waiting, key=lambda r: (r.remaining_prefill(), r.arrival_time))
    if policy == "priority":
        if aging_steps < 1:
            raise ValueError(f"aging_steps must be at least 1, got {aging_steps}")
        return sorted(
            waiting, key=lambda r: (r.priority - (now - r.arrival_step) // aging_steps, r.arrival_time)
        )
    raise ValueError(f"unknown policy {policy!r}: use 'fcfs', 'priority' or 'shortest'")


def choose_victim(running: Sequence[Request], scheduled: Sequence[Request], needy: Request) -> Request:
    """The least important running request outside this step's batch and other than ``needy``; ``needy``
    itself if there is none or it is more important than ``needy``."""
    candidates = [r for r in running if r is not needy and not any(r is s for s in scheduled)]
    if not candidates:
        return needy
    victim = max(candidates, key=importance)
    return needy if importance(victim) < importance(needy) else victim


def replay_schedule(scheduler, events: list[tuple], new_request=None) -> list[tuple]:
    """Play an engine's part around ``scheduler``: the checks and the grader compare schedulers this way.

    Events: ``("add", request_id, prompt_len, output_len, priority, arrival_time)``, ``("step",)`` and
    ``("abort", request_id)``. At each step the scheduler schedules; every scheduled request then gets its
    tokens computed, one that computed its last token gets a new one (token id 0), and one that has
    ``output_len`` output tokens finishes ("length"). One record per event: for "add" and "abort"
    ``("ok",)`` or ``("error", exception type name, message)``; for "step" ``("step", {request_id:
    num_new_tokens}, [preempted ids, in order], {request_id: block table} of the scheduled requests)``.
    ``new_request(request_id, prompt_len, priority, arrival_time)`` builds a request (default: a `Request`).
    """
    if new_request is None:
        new_request = lambda rid, n, priority, arrival: Request(rid, [1] * n, priority, arrival)  # noqa: E731
    live: dict = {}
    records = []
    for event in events:
        try:
            if event[0] == "add":
                rid, prompt_len, output_len, priority, arrival = event[1:]
                req = new_request(rid, prompt_len, priority, arrival)
                scheduler.add(req)
                live[rid] = (req, output_len)
                record: tuple = ("ok",)
            elif event[0] == "abort":
                req, _ = live.pop(event[1])
                scheduler.abort(req)
                req.status, req.finish_reason = RequestStatus.FINISHED, FinishReason.ABORT
                record = ("ok",)
            else:
                out = scheduler.schedule()
                batch = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
                tables = {s.request.request_id: list(s.request.block_table) for s in out.scheduled}
                record = ("step", batch, [r.request_id for r in out.preempted], tables)
                for req, n in out.scheduled:
                    req.num_computed_tokens += n
                    if req.num_computed_tokens == req.num_tokens:  # sampled: one more token
                        req.output_token_ids.append(0)
                        if len(req.output_token_ids) >= live[req.request_id][1]:
                            scheduler.finish(req)
                            req.status, req.finish_reason = RequestStatus.FINISHED, FinishReason.LENGTH
                            del live[req.request_id]
        except Exception as e:  # the error is part of the behaviour being compared
            record = ("error", type(e).__name__, str(e))
        records.append(record)
    return records
