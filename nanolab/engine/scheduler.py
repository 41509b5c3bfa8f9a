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

Parallel sampling: a request with ``n > 1`` samples is admitted only when ``max_num_seqs`` has a seat for
each of them; once its prompt is computed the engine calls `Scheduler.fork` for each further sample,
which joins the running requests sharing the prompt's KV blocks. A sample about to write into a block it
shares gets its own copy first (copy-on-write): the step's ``blocks_to_copy`` tells the engine which
blocks' keys and values to copy before the forward.

Speculative decoding: a decoding request with guesses (``spec_token_ids``) is scheduled for its last
token and as many guesses as the budget and the KV pool allow (``1 + d`` tokens; see
`nanolab.engine.speculative`); the guesses it cannot have this step are dropped, never the decode, and
no request is preempted to make room for a guess.

Shared prefixes are computed once: a waiting request whose prompt starts with whole blocks that a running
request is computing right now (and the prefix cache does not hold yet) waits until that prompt is done and
cached, rather than computing the same blocks again in parallel (SGLang's in-batch prefix caching); the
requests behind it are admitted meanwhile. Only requests that share a prefix with a prompt in progress
ever wait for this; static batching (`StaticBatchScheduler`) never does.

Policies order the waiting queue: "fcfs" (arrival), "priority" (lower value first; every
``aging_steps`` steps waited lowers the effective value by one, so nothing starves) and "shortest"
(fewest tokens to prefill first; can starve long prompts under constant load — that is the lesson).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, runtime_checkable

from nanolab.engine.config import EngineConfig, SchedulingPolicy
from nanolab.engine.request import Request, RequestStatus, admit, preempt
from nanolab.memory.block_manager import BlockManager


class ScheduledRequest(NamedTuple):  # a NamedTuple: one is built per request per step, so cheap matters
    request: Request
    num_new_tokens: int  # tokens computed this step, from request.num_computed_tokens on


@dataclass
class SchedulerOutput:
    """One step's batch: decodes first, then prefill chunks. Also who was preempted to make room."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before the forward

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

    `schedule` returns a `SchedulerOutput`, or an object with the same three fields (the labs' setup code
    has one, with ``blocks_to_copy`` empty unless it forks samples). The requests a scheduler handles have
    the fields of `Request` it reads; those of parallel sampling and prompt logprobs have defaults that
    mean "not used" (``group`` None, ``samples_to_fork`` 0, ``wants_prompt_logprobs`` False), and the
    labs' setup `Request` declares them so.
    """

    waiting: list[Request]
    running: list[Request]

    def add(self, req: Request) -> None: ...

    def schedule(self) -> SchedulerOutput: ...

    def finish(self, req: Request) -> None:
        """A running request is done: it leaves the batch and its KV blocks go back."""
        ...

    def abort(self, req: Request) -> None:
        """Forget a request in any live state (running: its blocks go back; waiting or preempted: it leaves the queue)."""
        ...


def waiting_order(waiting: Sequence[Request], policy: str, now: int, aging_steps: int) -> list[Request]:
    """The waiting requests in the order ``policy`` admits them (a new list; ties go by arrival time).

    - ``"fcfs"``: by ``arrival_time``.
    - ``"priority"``: by ``priority`` (lower first) minus one level per whole ``aging_steps`` steps
      waited since ``arrival_step`` (``now`` is the current step), so a request waits a bounded time.
    - ``"shortest"``: by tokens still to compute (``remaining_prefill()``), fewest first.

    Raises ValueError for another policy.

    Example:
        >>> from nanolab.model.sampling import SamplingParams
        >>> old = Request("old", [1] * 9, SamplingParams(), priority=2, arrival_time=0.0)
        >>> new = Request("new", [1] * 3, SamplingParams(), priority=0, arrival_time=1.0, arrival_step=30)
        >>> [r.request_id for r in waiting_order([old, new], "priority", now=30, aging_steps=20)]
        ['new', 'old']
        >>> [r.request_id for r in waiting_order([old, new], "priority", now=60, aging_steps=20)]
        ['old', 'new']
    """
    if policy == SchedulingPolicy.FCFS:
        key: Callable[[Request], tuple] = lambda r: (r.arrival_time,)  # noqa: E731
    elif policy == SchedulingPolicy.PRIORITY:
        if aging_steps < 1:
            raise ValueError(f"aging_steps must be at least 1, got {aging_steps}")
        key = lambda r: (r.priority - (now - r.arrival_step) // aging_steps, r.arrival_time)  # noqa: E731
    elif policy == SchedulingPolicy.SHORTEST:
        key = lambda r: (r.remaining_prefill(), r.arrival_time)  # noqa: E731
    else:
        names = ", ".join(repr(p.value) for p in SchedulingPolicy)
        raise ValueError(f"unknown scheduling policy {policy!r}; the policies are {names}")
    return sorted(waiting, key=key)


def importance(req: Request) -> tuple[int, int]:
    """Sort key among running requests, most important first: priority, then earliest admitted."""
    return (req.priority, req.admitted_seq or 0)


def choose_victim(running: Sequence[Request], scheduled: Sequence[Request], needy: Request) -> Request:
    """Which request gives its KV blocks back when ``needy`` (running) needs a block and none is free.

    The least important running request (see `importance`) that is neither ``needy`` nor already in this
    step's batch (``scheduled``) — unless there is none, or it is more important than ``needy``: then
    ``needy`` itself (it goes back to waiting rather than push out a more important request).

    Example:
        >>> from nanolab.model.sampling import SamplingParams
        >>> a, b, c = (Request(n, [1], SamplingParams()) for n in "abc")
        >>> a.admitted_seq, b.admitted_seq, c.admitted_seq = 1, 2, 3
        >>> choose_victim([a, b, c], scheduled=[c], needy=a).request_id
        'b'
        >>> choose_victim([a, b, c], scheduled=[b, c], needy=a).request_id
        'a'
    """
    taken = {id(r) for r in scheduled}
    candidates = [r for r in running if id(r) not in taken and r is not needy]
    victim = max(candidates, key=importance, default=None)
    if victim is None or importance(victim) < importance(needy):
        return needy
    return victim


class Scheduler:
    """Token-budget scheduler with chunked prefill, three waiting policies and preemption by recompute."""

    waits_for_shared_prefix = True  # a prompt whose prefix is being computed waits for it (see the module)

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
        """Queue a new request; ValueError, naming the limit, for one that could never be admitted."""
        cfg, tokens = self.config, req.num_tokens
        if tokens == 0:
            raise ValueError(f"request {req.request_id!r} has no tokens: a prompt needs at least one")
        if not cfg.enable_chunked_prefill and tokens > cfg.max_num_batched_tokens:
            raise ValueError(
                f"request {req.request_id!r} has {tokens} tokens to prefill but, without chunked prefill, "
                f"a step computes at most max_num_batched_tokens={cfg.max_num_batched_tokens}"
            )
        if self.block_manager.num_blocks_for(tokens) > self.block_manager.num_total_blocks:
            raise ValueError(
                f"request {req.request_id!r} needs {self.block_manager.num_blocks_for(tokens)} KV blocks "
                f"for its {tokens} tokens but the pool has num_blocks={self.block_manager.num_total_blocks}"
            )
        if req.samples_to_fork and req.sampling_params.n > cfg.max_num_seqs:
            raise ValueError(
                f"request {req.request_id!r} asks for n={req.sampling_params.n} samples but at most "
                f"max_num_seqs={cfg.max_num_seqs} sequences run at once"
            )
        req.arrival_step = self.step_count
        self.waiting.append(req)

    def fork(self, parent: Request, child: Request) -> None:
        """Start ``child``, a further sample of ``parent``'s prompt, sharing the parent's KV blocks.

        Called by the engine once the parent's prompt is computed; the child runs from then on (its seat
        was reserved when the parent was admitted).
        """
        self.block_manager.fork(parent, child)
        admit(child)
        self._admissions += 1
        child.admitted_seq = self._admissions
        child.arrival_step = parent.arrival_step
        self.running.append(child)

    def finish(self, req: Request) -> None:
        """``req``, running, is done (the engine calls it before moving the request to FINISHED): it leaves
        the running list and its KV blocks go back (those the prefix cache shares stay cached)."""
        self.running.remove(req)
        self.block_manager.release(req)

    def abort(self, req: Request) -> None:
        """Forget ``req`` in whatever state: running (its blocks go back), waiting or preempted (it leaves the
        queue). The engine moves it to FINISHED."""
        if req in self.running:
            self.running.remove(req)
            self.block_manager.release(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _make_room(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Grow ``req`` by ``num_new`` tokens, preempting less important unscheduled requests if needed.

        A sample of a parallel-sampling group also gets private copies of the shared blocks those tokens
        go into (copy-on-write; the copies are added to ``out.blocks_to_copy``). Returns False (and
        preempts ``req`` itself) when no victim is left.
        """
        while True:
            if self.block_manager.grow(req, num_new):
                shares = req.group is not None  # a sample may share its last block
                copies = self.block_manager.copy_on_write(req, num_new) if shares else []
                if copies is not None:
                    out.blocks_to_copy += copies
                    return True
            victim = choose_victim(self.running, [s.request for s in out.scheduled], req)
            self._preempt(victim, out)
            if victim is req:
                return False

    def _room_for_guesses(self, req: Request, budget: int) -> int:
        """How many of a decoding request's guesses go into this step: at most ``budget``, and only if
        their KV blocks can be had without preempting anyone (else none). The rest are dropped."""
        d = min(len(req.spec_token_ids), budget)
        if d and not self.block_manager.grow(req, 1 + d):
            d = 0
        del req.spec_token_ids[d:]
        if req.spec_draft_probs is not None:
            req.spec_draft_probs = req.spec_draft_probs[:d] if d else None
        return d

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.block_manager.release(victim)
        preempt(victim)
        self.num_preemptions += 1
        self.waiting.append(victim)
        out.preempted.append(victim)

    # -- the step -----------------------------------------------------------------------------------

    def admits_new_requests(self) -> bool:
        """Whether waiting requests may join the batch in this step: always, in continuous batching."""
        return True

    def schedule(self) -> SchedulerOutput:
        self.step_count += 1
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens

        # 1. decodes (one token left to compute), then 2. chunks of running prefills; most important
        # first in each group.
        todo = [(r, r.remaining_prefill()) for r in sorted(self.running, key=importance)]
        for req, remaining in [x for x in todo if x[1] == 1] + [x for x in todo if x[1] > 1]:
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            num_new = min(remaining, budget)
            if remaining == 1 and getattr(req, "spec_token_ids", None):  # (the labs' requests have none)
                num_new += self._room_for_guesses(req, budget - 1)
            if not self._make_room(req, num_new, out):
                continue
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new

        # 3. waiting requests, in policy order.
        self.waiting = waiting_order(self.waiting, cfg.scheduling_policy, self.step_count, cfg.aging_steps)
        seats = len(self.running) + sum(r.samples_to_fork for r in self.running)  # forks to come included
        admitting = self.admits_new_requests()
        deferred: list[Request] = []  # waiting for a prefix that a running prompt is computing
        while admitting and self.waiting and budget > 0 and seats < cfg.max_num_seqs:
            req = self.waiting[0]
            if self.waits_for_shared_prefix and self._prefix_in_progress(req):
                deferred.append(self.waiting.pop(0))
                continue
            if seats + 1 + req.samples_to_fork > cfg.max_num_seqs:
                break  # its samples need more seats than are free: it waits for them
            if not cfg.enable_chunked_prefill and req.remaining_prefill() > budget:
                break  # the prompt must go in one step; it waits for a step with room
            num_new = self.block_manager.admit(req, budget if cfg.enable_chunked_prefill else None)
            if num_new is None:
                break  # not enough KV blocks: it waits until running requests release some
            self.waiting.pop(0)
            admit(req)
            self._admissions += 1
            req.admitted_seq = self._admissions
            self.running.append(req)
            seats += 1 + req.samples_to_fork
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
        self.waiting[:0] = deferred  # at the front again, in their order

        return out

    def _prefix_in_progress(self, req: Request) -> bool:
        """Whether a running request's prompt, once computed and cached, gives ``req`` more whole blocks from the
        prefix cache than it holds now. Cheap when nothing is shared: only prompts with the same first block
        are compared, and the cache is asked only when some are."""
        manager = self.block_manager
        cache = getattr(manager, "prefix_cache", None)  # (the labs' block managers have none)
        if cache is None or getattr(req, "wants_prompt_logprobs", False):
            return False
        bs = manager.block_size
        tokens = req.all_token_ids
        servable = (len(tokens) - 1) // bs  # whole blocks a match can serve (one token is always computed)
        if servable == 0:
            return False
        head = tokens[:bs]
        shared = 0
        for other in self.running:
            prompt_len = other.num_prompt_tokens
            if other.num_computed_tokens >= prompt_len or other.prompt_token_ids[:bs] != head:
                continue  # its prompt is done (and cached), or shares no whole block with this one
            theirs = other.prompt_token_ids
            n = 1
            limit = min(servable, prompt_len // bs)
            while n < limit and theirs[n * bs : (n + 1) * bs] == tokens[n * bs : (n + 1) * bs]:
                n += 1
            shared = max(shared, n)
        if shared == 0:
            return False
        return shared > cache.match_prefix(tokens).num_tokens // bs


class StaticBatchScheduler(Scheduler):
    """Static batching on the same parts, the baseline continuous batching is measured against.

    A batch forms only when the previous one is done: waiting requests join in a step that starts with
    no request running, and none joins while any of that batch still runs. A request that finishes early
    leaves its seat empty, so the batch waits for its longest request (it returns early, rather than as
    padding, but no other request uses its seat). Budget, blocks and preemption are the `Scheduler`'s.
    """

    waits_for_shared_prefix = False  # a batch is whoever is waiting when it forms

    def admits_new_requests(self) -> bool:
        return not self.running
