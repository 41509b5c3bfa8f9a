"""The engine's loop: requests in, one step at a time, outputs out (Lab 7 builds it).

`EngineCore` holds the running requests and drives the parts it is given: a scheduler, the block manager
behind it, and a model runner. Each `step` is five calls: the scheduler picks the requests and how many
new tokens each computes (`nanolab.engine.scheduler`); `layout_batch` flattens them into one batch; the
runner runs one forward for all of it and samples a token for every request whose tokens are all
computed (`nanolab.engine.model_runner`); the tokens are appended and the `OutputProcessor` checks the
stop rules and builds the outputs (`nanolab.engine.output_processor`); the step is recorded for
observers (`nanolab.engine.stats`). Requests join and leave the batch at every step: that is continuous
batching. With a `Speculator`, each decoding request also gets guesses of its next tokens at the end of
a step, checked in the next (`nanolab.engine.speculative`).
 `nanolab.engine.engine.Engine` builds the parts from a model and a config, and turns prompts
into requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from nanolab.engine.model_runner import BatchLayout, ModelRunner, can_speculate, layout_batch, needs_extras
from nanolab.engine.output_processor import OutputProcessor
from nanolab.engine.outputs import RequestOutput
from nanolab.engine.parallel import SampleGroup, fork_samples
from nanolab.engine.request import FinishReason, Request, RequestStatus, finish
from nanolab.engine.scheduler import SchedulerOutput, SchedulerProtocol
from nanolab.engine.speculative import Speculator
from nanolab.engine.stats import EngineStats, StepCounters, StepListener, StepRecord
from nanolab.memory.block_manager import BlockManager


class EngineStepError(RuntimeError):
    """A step raised; the requests it was running were aborted and their KV blocks freed.

    ``outputs`` holds their final outputs (finish reason "abort"); the cause is chained. ``request_ids``
    names every request the failed step ended: those, and (set by `EngineCore.step`) any that finished
    inside the step before it raised, whose final output was lost with the step's.
    """

    def __init__(self, message: str, outputs: list[RequestOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs
        self.request_ids = [o.request_id for o in outputs]


class EngineCore:
    """The continuous-batching loop over a scheduler, its block manager and a model runner.

    ``tokenizer`` (None: outputs carry token ids only) gives the text and the end-of-sequence ids;
    ``max_model_len`` is the context length a request may fill.
    """

    def __init__(
        self,
        scheduler: SchedulerProtocol,
        block_manager: BlockManager,
        runner: ModelRunner,
        tokenizer: Any = None,
        max_model_len: int = 2048,
        listeners: Sequence[StepListener] = (),
        speculator: Speculator | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.runner = runner
        self.outputs = OutputProcessor(tokenizer, max_model_len)
        self.listeners = tuple(listeners)
        self.requests: dict[str, Request] = {}  # unfinished requests (and samples) by id
        self.groups: dict[str, SampleGroup] = {}  # unfinished parallel-sampling requests by id
        # unfinished requests that need more than one sampled token (`needs_extras`): a step with none of
        # them about takes the model runner's fast path
        self._with_extras: set[str] = set()
        self.counters = StepCounters()
        self.speculator = speculator

    @property
    def speculator(self) -> Speculator | None:
        """Speculative decoding's proposer and rules (None: off); setting it swaps them in for the next step."""
        return self._speculator

    @speculator.setter
    def speculator(self, speculator: Speculator | None) -> None:
        self._speculator = speculator
        self.runner.speculator = speculator

    # -- requests -----------------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        """Queue a request; the scheduler admits it when it can (ValueError if it never could)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.scheduler.add(req)
        self._register(req)
        if req.group is not None:
            self.groups[req.request_id] = req.group

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

    def run_until_finished(
        self, request_ids: Sequence[str], on_finished: Callable[[RequestOutput], None] | None = None
    ) -> list[RequestOutput]:
        """Step until every request of ``request_ids`` has finished; their final outputs, in that order.

        ``on_finished`` is called with each final output as it comes (a progress bar). Other requests
        step along with them.
        """
        done: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        while len(done) < len(wanted):
            if not self.has_unfinished():
                missing = sorted(wanted - set(done))
                raise ValueError(f"request {missing[0]!r} is not running in this engine")
            for out in self.step(finished_only=True):
                if out.request_id in wanted:
                    done[out.request_id] = out
                    if on_finished is not None:
                        on_finished(out)
        return [done[i] for i in request_ids]

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
            error = EngineStepError(
                f"the engine step failed ({type(exc).__name__}: {exc}); {len(outputs)} request(s) were aborted",
                outputs,
            )
            error.request_ids = list(ids)  # with those that finished in the step, their outputs lost
            raise error from exc

    def _step(self, finished_only: bool) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if not sched:
            return self._nothing_scheduled()
        batch = layout_batch(sched.scheduled)
        self._in_flight = batch.requests
        tokens = self.runner.run(batch, sched.blocks_to_copy, bool(self._with_extras), self._fork)
        if getattr(batch, "extra_tokens", None):  # (a lab's own BatchLayout has none)
            outputs, generated = self._process_speculative(batch, tokens, finished_only)
        else:
            outputs, generated = self._process(batch, tokens, finished_only), len(tokens)
        if self.speculator is not None:
            self._propose(batch.to_sample)
        self._record(sched, batch, generated, len(tokens), t0)
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

    def _process_speculative(
        self, batch: BatchLayout, tokens: list[int], finished_only: bool
    ) -> tuple[list[RequestOutput], int]:
        """`_process` for a step that checked guesses: each request's kept tokens appended one by one
        (the stop rules see each; what follows a stop is dropped), then the KV of rejected guesses
        rolled back. Returns the outputs and the number of tokens appended."""
        now, generated = time.monotonic(), 0
        for r, first, more, d, prefilled in zip(
            batch.to_sample, tokens, batch.extra_tokens, batch.num_drafts, batch.prefilled
        ):
            if r.first_token_time is None:
                r.first_token_time = now
            reason = None
            for tok in (first, *more):
                r.output_token_ids.append(tok)
                generated += 1
                reason = self.outputs.stop_reason(r, tok)
                if reason is not None:
                    break
            if d:
                r.spec_token_ids, r.spec_draft_probs = [], None
                # before a finish, which offers the computed blocks to the prefix cache: it must never see a guess
                held = len(r.block_table)
                if self.speculator is not None:
                    self.speculator.counters.add(d, len(more))
                    self.speculator.rollback(r, self.block_manager)
                else:
                    self.block_manager.rollback(r)
                self._check_rollback(r, held)
            if reason is not None:
                self._finish(r, reason)
            elif prefilled:
                self.block_manager.cache_computed(r)
        return self.outputs.step_outputs(batch.to_sample, self.groups, finished_only), generated

    def _check_rollback(self, r: Request, held: int) -> None:
        """A rollback (perhaps one's own, through the `Speculator`) must leave the last token to compute and
        keep the blocks of every token it held (``held``: its blocks before): otherwise the next step would
        compute nothing for the request, or read keys and values it no longer holds. RuntimeError (the step
        fails, its requests are aborted)."""
        need = min(held, self.block_manager.num_blocks_for(r.num_tokens))
        if r.num_computed_tokens >= r.num_tokens or len(r.block_table) < need:
            raise RuntimeError(
                f"after the rollback, request {r.request_id!r} has {r.num_computed_tokens} of its {r.num_tokens} "
                f"tokens computed and {len(r.block_table)} blocks; a rollback leaves at most "
                f"{r.num_tokens - 1} computed and keeps {need} blocks"
            )

    def _propose(self, reqs: list[Request]) -> None:
        """Ask the speculator for the next step's guesses of each decoding request that just got a token
        (none for those that need more than their tokens, see `can_speculate`, and never more than the
        request may still generate)."""
        spec = self.speculator
        live = [r for r in reqs if not r.is_finished and can_speculate(r)]
        if not live:
            return
        limit = self.outputs.max_model_len
        room = [
            min(spec.k, r.sampling_params.max_tokens - len(r.output_token_ids) - 1, limit - r.num_tokens - 1)
            for r in live
        ]
        for r in live:
            r.spec_draft_probs = None  # a proposer that has them sets them anew
        for r, guesses, k in zip(live, spec.proposer.propose(live, room), room):
            r.spec_token_ids = [int(t) for t in guesses[: max(k, 0)]]

    def _record(
        self, sched: SchedulerOutput, batch: BatchLayout, num_generated: int, num_sampled: int, t0: float
    ) -> None:
        record = StepRecord(
            len(batch.scheduled),
            sched.num_tokens,
            num_generated,
            self.runner.forward_seconds,
            time.perf_counter() - t0,
        )
        self.counters.add(record, self.block_manager.usage())
        self.counters.sampled_rows += num_sampled
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
        if self.speculator is not None:
            self.speculator.release(r)

    # -- introspection ------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """A snapshot of the counters and of the engine's state now (see `EngineStats`)."""
        running = sum(r.status == RequestStatus.RUNNING for r in self.requests.values())
        waiting = len(self.requests) - running
        preemptions = getattr(self.scheduler, "num_preemptions", 0)
        spec = self.speculator.counters if self.speculator is not None else None
        return self.counters.snapshot(running, waiting, preemptions, self.block_manager, spec)


def generate_static(
    engine: EngineCore, requests: Sequence[Request], max_batch_size: int
) -> list[RequestOutput]:
    """Static batching with ``engine``: the first ``max_batch_size`` requests, in order, run until every one
    of them has finished, then the next ones; their final outputs in the order of ``requests``.

    The baseline continuous batching is measured against (Lab 7): a batch waits for its longest request,
    and a request waits for the whole batch before it. ValueError if ``max_batch_size < 1``.
    """
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
    outputs: list[RequestOutput] = []
    for i in range(0, len(requests), max_batch_size):
        batch = requests[i : i + max_batch_size]
        for req in batch:
            engine.add(req)
        outputs += engine.run_until_finished([r.request_id for r in batch])
    return outputs
