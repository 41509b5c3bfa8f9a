"""One engine, many connections: the engine runs in its own thread and talks to asyncio by messages.

    HTTP handlers (asyncio event loop)             engine thread (the only code that touches the Engine)
    ----------------------------------             -----------------------------------------------------
    await add(prompts) --> command queue ------->  between two steps: take every queued command
     (ServerOverloaded  <-- "accepted" / ValueError   (add requests, abort requests)
      at once if too                               abort the requests whose deadline passed
      many wait)                                   engine.step()   (all requests share one batch)
    RequestGroup.queue <-- loop.call_soon_threadsafe -- each step's outputs (one wake-up per step)

One thread owns the `Engine`, so no lock guards it: the engine stays a single-threaded step loop,
and continuous batching happens by itself because every connection's requests land in the same
engine. With nothing to do the thread blocks on the command queue (no busy waiting; when a request
with a deadline is still pending, it blocks until that deadline at most).

Deadlines: ``add(..., timeout=S)`` (default: the engine's ``request_timeout``) gives each request of the
call a deadline S seconds after the call. Between two steps the engine thread aborts the requests whose
deadline passed with finish reason "timeout": their KV blocks are freed and their last output, with
the text generated so far, reaches the handler like any other.

Back-pressure: with ``max_waiting=N``, `add` refuses a call at once with `ServerOverloaded` (queueing
nothing) when N requests or more are already waiting, that is, not yet admitted into the running batch,
counting the adds still on their way to the engine thread. The asyncio side counts those itself, so a
burst of calls between two steps cannot overshoot the limit.

Failure is contained: if a step raises, the requests that were running fail with `EngineStepError`
(their KV blocks are freed by aborting them) and the thread goes on with the next command.

The price of one process: the HTTP thread and the engine thread share Python's GIL, so each slows
the other a little (`bench/bench_server.py` measures it). vLLM runs its engine core in a separate
process for that reason. Tokenization also runs on the engine thread, between steps.

Deliberately left out: an engine process, several engines (data parallelism), a retry delay estimated
from the load (`ServerOverloaded.retry_after` is a fixed `AsyncEngine.retry_after`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nanolab.engine.config import EngineConfig
from nanolab.engine.core import EngineStepError
from nanolab.engine.engine import Engine
from nanolab.engine.outputs import RequestOutput
from nanolab.engine.prompt import Prompt
from nanolab.engine.request import FinishReason
from nanolab.model.sampling import SamplingParams
from nanolab.serving.metrics import ServerMetrics

log = logging.getLogger("nanolab.server")

__all__ = ["AsyncEngine", "EngineNotRunning", "EngineStepError", "RequestGroup", "ServerOverloaded"]


class EngineNotRunning(RuntimeError):
    """The engine thread is not running (not started yet, or shut down)."""


class ServerOverloaded(RuntimeError):
    """Too many requests are waiting (``max_waiting``): the call was refused and nothing was queued.

    ``retry_after``: whole seconds (>= 1) after which a client may try again (HTTP's ``Retry-After``).
    """

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def _check_timeout(value: Any, name: str) -> float:
    """A number of seconds > 0 (finite), or `ValueError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    return float(value)


class RequestGroup:
    """The requests of one API call (one per prompt) and the asyncio queue their outputs arrive on.

    Queue items are ``(index, item)``: ``index`` is the prompt's position, ``item`` a `RequestOutput`
    (incremental: read ``delta_text``; ``finished`` on the last one) or an `EngineStepError` (the
    request's last item).
    """

    def __init__(self, group_id: str, size: int, loop: asyncio.AbstractEventLoop) -> None:
        self.group_id = group_id
        self.request_ids = [f"{group_id}-{i}" for i in range(size)]
        self.queue: asyncio.Queue[tuple[int, RequestOutput | EngineStepError]] = asyncio.Queue()
        self.arrival = time.monotonic()
        self.loop = loop


Delivery = tuple[RequestGroup, int, "RequestOutput | EngineStepError"]


class _Mailbox:
    """Items on their way from the engine thread to one event loop.

    Waking a loop (`call_soon_threadsafe`) costs a system call and a thread switch, so there is at
    most one wake-up in flight: items posted before the loop got to it ride along with it.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: list[Delivery] = []
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, items: list[Delivery]) -> None:
        with self._lock:
            self._items += items
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _drain(self) -> None:  # on the event loop
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for group, index, item in items:
            group.queue.put_nowait((index, item))


@dataclass
class _Add:
    group: RequestGroup
    prompts: list[Prompt]
    params: list[SamplingParams]
    priority: int
    accepted: concurrent.futures.Future
    deadline: float | None = None  # time.monotonic() after which the requests are aborted ("timeout")


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Live:
    """What the engine thread tracks per running request, for routing outputs and for latency metrics."""

    group: RequestGroup
    index: int
    last_token_time: float | None = None


_STOP = object()


class AsyncEngine:
    """An `Engine` run by a background thread, driven from asyncio code."""

    retry_after = 1  # seconds a refused client is told to wait (ServerOverloaded.retry_after)

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        config: EngineConfig | None = None,
        *,
        metrics: ServerMetrics | None = None,
        max_waiting: int | None = None,
        request_timeout: float | None = None,
        **components: Any,
    ) -> None:
        """Build the engine this front end owns (``components``: ``block_allocator``, ``prefix_cache``,
        ``scheduler``, as for `Engine`); the metrics listen to its steps.

        ``max_waiting``: refuse new calls (`ServerOverloaded`) while this many requests wait to be
        admitted (None: no limit). ``request_timeout``: the deadline, in seconds, of a request whose
        `add` gives none (None: no deadline).
        """
        if max_waiting is not None and (
            isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1
        ):
            raise ValueError(f"max_waiting must be an integer >= 1 (None: no limit), got {max_waiting!r}")
        self.max_waiting = max_waiting
        self.request_timeout = (
            None if request_timeout is None else _check_timeout(request_timeout, "request_timeout")
        )
        self.metrics = metrics or ServerMetrics()
        self.metrics.max_waiting.set(math.inf if max_waiting is None else max_waiting)
        self.engine = Engine(model, tokenizer, config, listeners=[self.metrics.observe_step], **components)
        self._commands: queue.Queue[Any] = queue.Queue()
        # Waiting requests, as the asyncio side counts them: prompts of the adds it queued (`_queued`,
        # written under `_admit_lock`) minus those the engine thread took (`_admission[0]`), plus the
        # engine's own waiting requests (`_admission[1]`). The engine thread publishes both numbers of
        # `_admission` at once, between steps, so no request is ever counted in neither.
        self._admit_lock = threading.Lock()
        self._queued = 0
        self._handled = 0  # engine thread only
        self._admission: tuple[int, int] = (0, 0)
        self._live: dict[str, _Live] = {}
        self._deadlines: dict[str, float] = {}  # live requests that have one (engine thread only)
        self._outbox: list[Delivery] = []  # outputs of this round, delivered together
        self._mailboxes: dict[asyncio.AbstractEventLoop, _Mailbox] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._publish()

    # -- the asyncio side ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine thread was already started")
        self._thread = threading.Thread(target=self._run, name="nanolab-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the thread: running requests are aborted (their streams end with finish_reason "abort")."""
        if self._thread is None or self._stopping:
            return
        self._stopping = True
        self._commands.put(_STOP)
        self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def num_waiting(self) -> int:
        """Requests not admitted into the running batch yet, adds still on their way to the engine included.

        The engine's part is as of the last step (requests admitted since still count): an upper bound.
        """
        handled, engine_waiting = self._admission
        return engine_waiting + self._queued - handled

    async def add(
        self,
        group_id: str,
        prompts: Sequence[Prompt],
        params: Sequence[SamplingParams],
        priority: int = 0,
        timeout: float | None = None,
    ) -> RequestGroup:
        """Queue one request per prompt; returns once the engine accepted them all.

        ``timeout``: seconds from this call after which the requests still unfinished are aborted with
        finish reason "timeout" (their last output holds the text so far); None: the engine's
        ``request_timeout``.

        Raises `ValueError` (and queues nothing) if any prompt could never run: empty, too long for
        ``max_model_len``, a token id outside the vocabulary, ... or for a ``timeout`` that is not a
        number > 0. Raises `ServerOverloaded` at once (queueing nothing) when ``max_waiting`` requests
        or more are waiting, and `EngineNotRunning` when stopped.
        """
        if not self.is_running:
            raise EngineNotRunning("the engine is not running")
        timeout = self.request_timeout if timeout is None else _check_timeout(timeout, "timeout")
        group = RequestGroup(group_id, len(prompts), asyncio.get_running_loop())
        deadline = None if timeout is None else group.arrival + timeout
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        with self._admit_lock:  # check and count as one: concurrent calls cannot both take the last place
            if self.max_waiting is not None and (waiting := self.num_waiting) >= self.max_waiting:
                self.metrics.requests.labels(status="overloaded").inc()
                raise ServerOverloaded(
                    f"the server is overloaded: {waiting} requests are waiting, its limit is "
                    f"{self.max_waiting} (max_waiting); try again in {self.retry_after} s",
                    self.retry_after,
                )
            self._queued += len(prompts)
            self._commands.put(_Add(group, list(prompts), list(params), priority, accepted, deadline))
        await asyncio.wrap_future(accepted)
        return group

    def abort(self, request_ids: Sequence[str]) -> None:
        """Ask the engine to stop these requests and free their KV blocks (unknown or finished ids: no-op)."""
        if request_ids:
            self._commands.put(_Abort(list(request_ids)))

    # -- the engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                if self.engine.has_unfinished():
                    cmd = self._commands.get_nowait()
                elif self._deadlines:  # idle, but a deadline is due: sleep until it at most
                    wait = min(self._deadlines.values()) - time.monotonic()
                    cmd = self._commands.get(timeout=max(0.0, wait))
                else:
                    cmd = self._commands.get()  # idle: sleep here
            except queue.Empty:
                cmd = None
            while cmd is not None:  # take every queued command before the next step
                if cmd is _STOP:
                    self._stop_all()
                    return
                self._handle(cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            try:
                if self._deadlines:
                    self._expire(time.monotonic())
                if self.engine.has_unfinished():
                    self._step()
                self._publish()
            except Exception:  # a bug outside the step itself (a plugged-in component?): keep the thread
                log.exception("the engine thread hit an error between steps")
            self._flush()

    def _flush(self) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[Delivery]] = {}
        for d in self._outbox:
            by_loop.setdefault(d[0].loop, []).append(d)
        for loop, items in by_loop.items():
            if loop not in self._mailboxes:
                self._mailboxes[loop] = _Mailbox(loop)
            self._mailboxes[loop].post(items)
        self._outbox = []

    def _handle(self, cmd: _Add | _Abort) -> None:
        if isinstance(cmd, _Add):
            self._handled += len(cmd.prompts)  # taken off the queue, whatever becomes of it
        try:
            if isinstance(cmd, _Add):
                self._add(cmd)
            else:
                for rid in cmd.request_ids:
                    if rid in self._live:
                        out = self.engine.abort(rid)
                        if out is not None:
                            self._route(out, time.monotonic())
        except Exception as exc:  # a bug, not bad input: keep serving the others
            log.exception("the engine thread failed to handle a command")
            if isinstance(cmd, _Add) and not cmd.accepted.done():
                cmd.accepted.set_exception(exc)

    def _add(self, cmd: _Add) -> None:
        if not cmd.accepted.set_running_or_notify_cancel():
            return  # the handler gave up waiting (its client left): add nothing
        try:  # all or none: one bad prompt rejects the whole call
            requests = self.engine.add_requests(cmd.prompts, cmd.params, cmd.priority, cmd.group.request_ids)
        except ValueError as exc:
            cmd.accepted.set_exception(exc)
            return
        for i, req in enumerate(requests):
            self._live[req.request_id] = _Live(cmd.group, i)
            if cmd.deadline is not None:
                self._deadlines[req.request_id] = cmd.deadline
            self.metrics.prompt_tokens.inc(len(req.prompt_token_ids))
        cmd.accepted.set_result(None)

    def _expire(self, now: float) -> None:
        """Abort the requests whose deadline passed: finish reason "timeout", blocks freed, output routed."""
        for rid in [rid for rid, deadline in self._deadlines.items() if deadline <= now]:
            out = self.engine.abort(rid, FinishReason.TIMEOUT)
            if out is not None:
                self._route(out, now)
            self._deadlines.pop(rid, None)  # gone, whatever the engine said

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except EngineStepError as err:
            log.exception("an engine step failed; its requests were aborted")
            self.metrics.step_errors.inc()
            self._fail(err)
            return
        now = time.monotonic()
        for out in outputs:
            self._route(out, now)

    def _route(self, out: RequestOutput, now: float) -> None:
        """Send an output to its group and account for it; forget the request once it finished."""
        live = self._live.get(out.request_id)
        if live is None:
            return
        self.metrics.observe_output(out, live.group.arrival, live.last_token_time, now)
        if any(c.delta_token_ids for c in out.outputs):
            live.last_token_time = now
        if out.finished:
            del self._live[out.request_id]
            self._deadlines.pop(out.request_id, None)
        self._outbox.append((live.group, live.index, out))

    def _fail(self, err: EngineStepError) -> None:
        """The requests of a failed step end with the error (the engine already freed their blocks)."""
        for out in err.outputs:
            live = self._live.pop(out.request_id, None)
            self._deadlines.pop(out.request_id, None)
            if live is not None:
                self.metrics.requests.labels(status="error").inc()
                self._outbox.append((live.group, live.index, err))

    def _stop_all(self) -> None:
        for rid in list(self._live):
            try:
                out = self.engine.abort(rid)
            except Exception:
                log.exception("aborting request %s at shutdown failed", rid)
                out = None
            if out is not None:
                self._route(out, time.monotonic())
        while True:  # commands that arrived after the stop
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                self._handled += len(cmd.prompts)
                if cmd.accepted.set_running_or_notify_cancel():
                    cmd.accepted.set_exception(EngineNotRunning("the server is shutting down"))
        self._flush()
        self._publish()

    def _publish(self) -> None:
        stats = self.engine.stats()  # only this thread may touch the engine
        self.metrics.observe_stats(stats)
        self._admission = (self._handled, stats.num_waiting)  # one assignment: read whole by `num_waiting`
