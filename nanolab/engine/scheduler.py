"""The scheduler: each step, which requests run and how many of their tokens.

One step has a token budget (``max_num_batched_tokens``) and a cap on running requests
(``max_num_seqs``). It is filled in this order:

1. running requests that decode (one token each), so a long prompt never stalls generation;
2. running requests in the middle of a chunked prefill, a chunk each, up to the remaining budget;
3. waiting requests, in the policy's order, admitted while the budget, ``max_num_seqs`` and the KV pool
   allow; with chunked prefill their prompt may be split over several steps, without it a prompt must
   fit in one step's budget.

When a running request needs a new KV block and none is free (after evicting unlocked prefix cache
entries), the scheduler preempts the least important running request that is not yet in this step —
lowest priority, then most recently admitted — freeing its blocks; it will be recomputed from scratch
(its output so far is kept). Waiting requests never preempt running ones.

Policies order the waiting queue: "fcfs" (arrival), "priority" (lower value first; every
``aging_steps`` steps waited lowers the effective value by one, so nothing starves) and "shortest"
(fewest tokens to prefill first; can starve long prompts under constant load — that is the lesson).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, runtime_checkable

from nanolab.engine.config import EngineConfig, SchedulingPolicy
from nanolab.engine.request import Request, RequestStatus
from nanolab.memory.block_manager import BlockManager


class ScheduledRequest(NamedTuple):  # a NamedTuple: one is built per request per step, so cheap matters
    request: Request
    num_new_tokens: int  # tokens computed this step, from request.num_computed_tokens on


@dataclass
class SchedulerOutput:
    """One step's batch: decodes first, then prefill chunks. Also who was preempted to make room."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@runtime_checkable
class SchedulerProtocol(Protocol):
    """What the engine needs from a scheduler (a learner's own scheduler can stand in).

    The engine calls `add` for each new request, `schedule` once per step, then `finish` for each
    request that finished in that step (`abort` at any time). The scheduler owns the KV blocks of the
    requests it runs, through its `BlockManager`, and must release them on finish and abort.
    """

    waiting: list[Request]
    running: list[Request]

    def add(self, req: Request) -> None: ...

    def schedule(self) -> SchedulerOutput: ...

    def finish(self, req: Request) -> None: ...

    def abort(self, req: Request) -> None: ...


class Scheduler:
    """Token-budget scheduler with chunked prefill, three waiting policies and preemption by recompute."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        if config.max_num_batched_tokens is None:
            raise ValueError("the scheduler needs a resolved EngineConfig (see EngineConfig.resolve)")
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.step_count = 0
        self.num_preemptions = 0
        self._admissions = 0

    # -- bookkeeping --------------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        req.arrival_step = self.step_count
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def finish(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.release(req)

    def abort(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
            self.block_manager.release(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _waiting_key(self) -> Callable[[Request], tuple]:
        policy, now = self.config.scheduling_policy, self.step_count
        if policy is SchedulingPolicy.PRIORITY:
            aging = self.config.aging_steps
            return lambda r: (r.priority - (now - r.arrival_step) / aging, r.arrival_time)
        if policy is SchedulingPolicy.SHORTEST:
            return lambda r: (r.remaining_prefill(), r.arrival_time)
        return lambda r: (r.arrival_time,)

    @staticmethod
    def _importance(r: Request) -> tuple[int, int]:
        """Sort key among running requests: most important first (the victim is the last)."""
        return (r.priority, r.admitted_seq or 0)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.block_manager.release(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(victim)
        out.preempted.append(victim)

    def _make_room(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Grow ``req`` by ``num_new`` tokens, preempting less important unscheduled requests if needed.

        Returns False (and preempts ``req`` itself) when no such victim is left.
        """
        while not self.block_manager.grow(req, num_new):
            scheduled = {id(s.request) for s in out.scheduled}
            candidates = [r for r in self.running if id(r) not in scheduled and r is not req]
            victim = max(candidates, key=self._importance, default=None)
            if victim is None or self._importance(victim) < self._importance(req):
                self._preempt(req, out)
                return False
            self._preempt(victim, out)
        return True

    # -- the step -----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.step_count += 1
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens

        # 1. decodes (one token left to compute), then 2. chunks of running prefills; most important
        # first in each group.
        todo = [(r, r.remaining_prefill()) for r in sorted(self.running, key=self._importance)]
        for req, remaining in [x for x in todo if x[1] == 1] + [x for x in todo if x[1] > 1]:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            num_new = min(remaining, budget)
            if not self._make_room(req, num_new, out):
                continue
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new

        # 3. waiting requests, in policy order.
        self.waiting.sort(key=self._waiting_key())
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            if not cfg.enable_chunked_prefill and req.remaining_prefill() > budget:
                break  # the prompt must go in one step; it waits for a step with room
            num_new = self.block_manager.admit(req, budget if cfg.enable_chunked_prefill else None)
            if num_new is None:
                break  # not enough KV blocks: it waits until running requests release some
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            self._admissions += 1
            req.admitted_seq = self._admissions
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new

        # One-token entries (decodes, and 1-token prefill chunks, which attend the same way) go first:
        # the paged cache runs them as one decode-attention group. The sort is stable.
        out.scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        return out
