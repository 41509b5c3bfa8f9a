"""One engine, many connections: the engine runs on its own and talks to asyncio by messages.

    HTTP handlers (asyncio event loops)            engine side (the only code that touches the Engine)
    -----------------------------------            ----------------------------------------------------
    await add(prompts) --> AddCommand ---------->  `EngineLoop`, between two steps: take every queued
     (ServerOverloaded at once if too many wait)     command (add requests, abort requests), abort the
    abort(ids)         --> AbortCommand -------->    requests whose deadline passed, engine.step()
    RequestGroup.queue <-- `Round` -------------   then hand back one `Round`: acks, outputs, failures,
       (acks resolve the adds; one wake-up            step records and a stats snapshot
        per loop per round)

`EngineClient` is the asyncio side and `EngineLoop` the engine side; what crosses between them is plain
data (commands and `Round`s), so the engine side can run in a thread of this process or in a process of
its own:

- `AsyncEngine` runs the loop in a background thread. One thread owns the `Engine`, so no lock guards
  it, and tests can reach into it (``aengine.engine``). The price: the HTTP code and the engine share
  Python's GIL, so each slows the other (`bench/bench_server.py` measures it).
- `nanolab.serving.engine_process.ProcessAsyncEngine` runs it in a process of its own, as vLLM V1 runs
  its engine core; `nanolab serve` uses it by default.

Either way the engine stays a single-threaded step loop, and continuous batching happens by itself
because every connection's requests land in the same engine. With nothing to do the engine side blocks
on its commands (no busy waiting; when a request with a deadline is still pending, until that deadline
at most).

Deadlines: ``add(..., timeout=S)`` (default: ``request_timeout``) gives each request of the call a
deadline S seconds after the call. Between two steps the engine side aborts the requests whose deadline
passed with finish reason "timeout": their KV blocks are freed and their last output, with the text
generated so far, reaches the handler like any other.

Back-pressure: with ``max_waiting=N``, `add` refuses a call at once with `ServerOverloaded` (queueing
nothing) when N requests or more are already waiting, that is, not yet admitted into the running batch,
counting the adds still on their way to the engine. The asyncio side counts those itself (`Admission`), so
a burst of calls between two steps cannot overshoot the limit.

Failure is contained: if a step raises, the requests that were running fail with `EngineStepError`
(their KV blocks are freed by aborting them) and the loop goes on with the next command.

Deliberately left out: several engines (data parallelism), a retry delay estimated from the load
(`ServerOverloaded.retry_after` is `Admission`'s fixed ``retry_after``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nanolab.engine.config import EngineConfig
from nanolab.engine.core import EngineStepError
from nanolab.engine.engine import Engine
from nanolab.engine.outputs import RequestOutput
from nanolab.engine.prompt import Prompt
from nanolab.engine.request import FinishReason
from nanolab.engine.stats import EngineStats, StepRecord
from nanolab.model.sampling import SamplingParams
from nanolab.serving.metrics import ServerMetrics

log = logging.getLogger("nanolab.server")

__all__ = [
    "AsyncEngine",
    "EngineClient",
    "EngineLoop",
    "EngineNotRunning",
    "EngineStepError",
    "Admission",
    "RequestGroup",
    "RequestRejected",
    "ServerOverloaded",
]


class EngineNotRunning(RuntimeError):
    """The engine is not running (not started yet, shut down, or its process died)."""


class ServerOverloaded(RuntimeError):
    """Too many requests are waiting (``max_waiting``): the call was refused and nothing was queued.

    ``retry_after``: whole seconds (>= 1) after which a client may try again (HTTP's ``Retry-After``).
    """

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Admission:
    """The front end's count of waiting requests, and its refusal beyond ``max_waiting`` (None: no limit).

    A request waits from the moment its add is sent until the engine admits it into the running batch. The
    engine's own count (``engine_waiting``) comes back only with its rounds, so between two rounds this
    side adds what it sent since: ``waiting = engine_waiting + sent - handled``, where ``sent`` counts the
    prompts of every add let through and ``handled`` (from the same round) those the engine side had taken
    off its queue by then. Counting on the engine's number alone would let a burst of adds that arrives
    between two rounds through, all of it.

    `admit` may run in several threads at once, and alongside `on_round` (the thread that receives
    rounds): the check and the count are one step under a lock, and a round's two numbers are stored as
    one pair, so no request is ever counted in neither.
    """

    def __init__(self, max_waiting: int | None = None, retry_after: int = 1) -> None:
        if max_waiting is not None and (
            isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1
        ):
            raise ValueError(f"max_waiting must be an integer >= 1 (None: no limit), got {max_waiting!r}")
        self.max_waiting, self.retry_after = max_waiting, retry_after
        self._lock = threading.Lock()
        self._sent = 0
        self._seen: tuple[int, int] = (0, 0)  # (handled, engine_waiting) of the last round

    @property
    def waiting(self) -> int:
        """Requests not admitted into the running batch yet, adds on their way included (an upper bound:
        the engine's part is as of its last round)."""
        handled, engine_waiting = self._seen
        return engine_waiting + self._sent - handled

    def admit(self, num_prompts: int) -> None:
        """Let an add of ``num_prompts`` requests through (counting them), or raise `ServerOverloaded`
        (counting nothing) when ``max_waiting`` requests or more are waiting."""
        with self._lock:  # check and count as one: concurrent calls cannot both take the last place
            if self.max_waiting is not None and (waiting := self.waiting) >= self.max_waiting:
                raise ServerOverloaded(
                    f"the server is overloaded: {waiting} requests are waiting, its limit is "
                    f"{self.max_waiting} (max_waiting); try again in {self.retry_after} s",
                    self.retry_after,
                )
            self._sent += num_prompts

    def on_round(self, handled: int, engine_waiting: int) -> None:
        """A round came back: the engine side had taken ``handled`` prompts off its queue, and
        ``engine_waiting`` requests were waiting in the engine."""
        self._seen = (handled, engine_waiting)  # one assignment: read whole


class RequestRejected(ValueError):
    """The engine refused a call's prompts or parameters; ``param`` names the field when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _check_timeout(value: Any, name: str) -> float:
    """A number of seconds > 0 (finite), or `ValueError` naming ``name``."""
    try:
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < float(value) < math.inf
    except OverflowError:  # an int too large for a float
        ok = False
    if not ok:
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    return float(value)


# -- what crosses between the two sides: plain values ---------------------------------------------------


@dataclass
class AddCommand:
    add_id: int
    request_ids: list[str]
    prompts: list[Prompt]
    params: list[SamplingParams]
    priority: int
    deadline: float | None  # time.monotonic() (one clock for every process of the machine)


@dataclass
class AbortCommand:
    request_ids: list[str]


STOP = "stop"  # the command that ends the loop: running requests are aborted first

Command = AddCommand | AbortCommand | str


@dataclass
class Round:
    """What the engine side hands back after one round of its loop."""

    accepted: list[tuple[int, int]] = field(default_factory=list)  # (add id, prompt tokens)
    # (add id, kind, message, param); kind: "invalid" (bad input), "stopped" or "error" (a bug)
    refused: list[tuple[int, str, str, str | None]] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (request id, why): a failed step
    steps: list[StepRecord] = field(default_factory=list)
    step_errors: int = 0
    stats: EngineStats | None = None
    handled: int = 0  # prompts of every add taken off the command queue so far

    def __bool__(self) -> bool:
        return bool(self.accepted or self.refused or self.outputs or self.failed or self.steps)


# -- the engine side ---------------------------------------------------------------------------------------


class EngineLoop:
    """Runs an `Engine` for an `EngineClient`: commands in, one `Round` out per step (or per batch of commands).

    ``run(receive, send)``: ``receive(timeout)`` returns the next command, or None once ``timeout``
    seconds passed (0: do not wait; None: wait as long as it takes); ``send(round)`` hands a round back.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.live: set[str] = set()  # requests added and not finished
        self.deadlines: dict[str, float] = {}  # live requests that have one
        self.handled = 0
        self.round = Round()
        engine.listeners = (*engine.listeners, self.round_steps)

    def round_steps(self, record: StepRecord) -> None:
        self.round.steps.append(record)

    def run(self, receive: Callable[[float | None], Command | None], send: Callable[[Round], None]) -> None:
        while True:
            if self.engine.has_unfinished():
                cmd = receive(0)
            elif self.deadlines:  # idle, but a deadline is due: sleep until it at most
                cmd = receive(max(0.0, min(self.deadlines.values()) - time.monotonic()))
            else:
                cmd = receive(None)  # idle: sleep here
            while cmd is not None:  # take every queued command before the next step
                if cmd == STOP:
                    self.stop_all(receive)
                    send(self.take_round())
                    return
                self.handle(cmd)
                cmd = receive(0)
            if self.round:  # acks at once: a handler does not wait for the step to learn its fate
                send(self.take_round())
            try:
                if self.deadlines:
                    self.expire(time.monotonic())
                if self.engine.has_unfinished():
                    self.step()
            except Exception:  # a bug outside the step itself (a plugged-in component?): keep going
                log.exception("the engine loop hit an error between steps")
            if self.round:
                send(self.take_round())

    def take_round(self) -> Round:
        out, self.round = self.round, Round()
        out.stats, out.handled = self.engine.stats(), self.handled
        return out

    def handle(self, cmd: Command) -> None:
        if isinstance(cmd, AddCommand):
            self.handled += len(cmd.prompts)  # taken off the queue, whatever becomes of it
        try:
            if isinstance(cmd, AddCommand):
                self.add(cmd)
            elif isinstance(cmd, AbortCommand):
                for rid in cmd.request_ids:
                    if rid in self.live:
                        self.route(self.engine.abort(rid))
            else:
                raise TypeError(f"not a command: {cmd!r}")
        except Exception as exc:  # a bug, not bad input: keep serving the others
            log.exception("the engine failed to handle a command")
            if isinstance(cmd, AddCommand):
                self.round.refused.append((cmd.add_id, "error", f"{type(exc).__name__}: {exc}", None))

    def add(self, cmd: AddCommand) -> None:
        try:  # all or none: one bad prompt rejects the whole call
            requests = self.engine.add_requests(cmd.prompts, cmd.params, cmd.priority, cmd.request_ids)
        except ValueError as exc:
            self.round.refused.append((cmd.add_id, "invalid", str(exc), getattr(exc, "param", None)))
            return
        for req in requests:
            self.live.add(req.request_id)
            if cmd.deadline is not None:
                self.deadlines[req.request_id] = cmd.deadline
        self.round.accepted.append((cmd.add_id, sum(len(r.prompt_token_ids) for r in requests)))

    def expire(self, now: float) -> None:
        """Abort the requests whose deadline passed: finish reason "timeout", blocks freed, output routed."""
        for rid in [rid for rid, deadline in self.deadlines.items() if deadline <= now]:
            self.route(self.engine.abort(rid, FinishReason.TIMEOUT))
            self.deadlines.pop(rid, None)  # gone, whatever the engine said

    def step(self) -> None:
        try:
            outputs = self.engine.step()
        except EngineStepError as err:
            log.exception("an engine step failed; its requests were aborted")
            self.round.step_errors += 1
            # the engine already freed their blocks; the ids include requests that finished inside the
            # failed step, whose outputs were lost with it (their callers would wait forever otherwise)
            for rid in err.request_ids:
                if rid in self.live:
                    self.forget(rid)
                    self.round.failed.append((rid, str(err)))
            return
        for out in outputs:
            self.route(out)

    def route(self, out: RequestOutput | None) -> None:
        if out is None or out.request_id not in self.live:
            return
        if out.finished:
            self.forget(out.request_id)
        self.round.outputs.append(out)

    def forget(self, request_id: str) -> None:
        self.live.discard(request_id)
        self.deadlines.pop(request_id, None)

    def stop_all(self, receive: Callable[[float | None], Command | None]) -> None:
        """Abort every live request, and refuse the adds that arrived after the stop."""
        for rid in list(self.live):
            try:
                self.route(self.engine.abort(rid))
            except Exception:
                log.exception("aborting request %s at shutdown failed", rid)
                self.forget(rid)
        while (cmd := receive(0)) is not None:
            if isinstance(cmd, AddCommand):
                self.handled += len(cmd.prompts)
                self.round.refused.append((cmd.add_id, "stopped", "the server is shutting down", None))


# -- the asyncio side ----------------------------------------------------------------------------------------


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
    """Items on their way from the engine side to one event loop.

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
class _Pending:
    group: RequestGroup
    accepted: concurrent.futures.Future


@dataclass
class _Live:
    """What the asyncio side tracks per running request, for routing outputs and for latency metrics."""

    group: RequestGroup
    index: int
    last_token_time: float | None = None


class EngineClient:
    """The asyncio side of an engine that runs elsewhere (a thread, a process): see the module's docstring.

    A subclass starts and stops the engine side, sends it commands (`_send`) and calls `_deliver` with
    every `Round` it hands back, from one thread that is not an event loop's.
    """

    tokenizer: Any = None
    config: EngineConfig  # the resolved settings the engine runs with

    def __init__(
        self,
        *,
        metrics: ServerMetrics | None = None,
        max_waiting: int | None = None,
        request_timeout: float | None = None,
        admission: Any = None,
    ) -> None:
        """``max_waiting``: refuse new calls (`ServerOverloaded`) while this many requests wait to be
        admitted (None: no limit). ``request_timeout``: the deadline, in seconds, of a request whose
        `add` gives none (None: no deadline). ``admission``: the object that counts waiting requests and
        refuses (an `Admission`, or one with its ``max_waiting``, ``waiting``, ``admit`` and ``on_round``,
        a learner's in Lab 8); None: ``Admission(max_waiting)``."""
        if admission is not None and max_waiting is not None:
            raise ValueError("give max_waiting or admission, not both (an admission has its own max_waiting)")
        self.admission = Admission(max_waiting) if admission is None else admission
        self.request_timeout = (
            None if request_timeout is None else _check_timeout(request_timeout, "request_timeout")
        )
        self.metrics = metrics or ServerMetrics()
        limit = self.admission.max_waiting
        self.metrics.max_waiting.set(math.inf if limit is None else limit)
        self._lock = threading.Lock()  # an add's admission, id and command go out in one order
        self._add_ids = itertools.count()
        self._pending: dict[int, _Pending] = {}  # adds sent, not yet acknowledged
        self._live: dict[str, _Live] = {}
        self._mailboxes: dict[asyncio.AbstractEventLoop, _Mailbox] = {}

    # -- what a subclass provides ---------------------------------------------------------------------

    def start(self) -> None:
        raise NotImplementedError

    def shutdown(self, timeout: float = 30.0) -> None:
        raise NotImplementedError

    @property
    def started(self) -> bool:
        raise NotImplementedError

    @property
    def is_running(self) -> bool:
        raise NotImplementedError

    def _send(self, cmd: Command) -> None:
        raise NotImplementedError

    # -- the API the HTTP handlers use ----------------------------------------------------------------

    @property
    def max_waiting(self) -> int | None:
        return self.admission.max_waiting

    @property
    def num_waiting(self) -> int:
        """Requests not admitted into the running batch yet, adds still on their way to the engine included
        (see `Admission.waiting`)."""
        return self.admission.waiting

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
        finish reason "timeout" (their last output holds the text so far); None: ``request_timeout``.

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
        with self._lock:
            try:
                self.admission.admit(len(prompts))
            except ServerOverloaded:
                self.metrics.requests.labels(status="overloaded").inc()
                raise
            add_id = next(self._add_ids)
            self._pending[add_id] = _Pending(group, accepted)
            self._send(AddCommand(add_id, group.request_ids, list(prompts), list(params), priority, deadline))
        await asyncio.wrap_future(accepted)
        return group

    def abort(self, request_ids: Sequence[str]) -> None:
        """Ask the engine to stop these requests and free their KV blocks (unknown or finished ids: no-op)."""
        if request_ids and self.is_running:
            self._send(AbortCommand(list(request_ids)))

    # -- rounds coming back ---------------------------------------------------------------------------------

    def _deliver(self, rnd: Round) -> None:
        """Account for one round and hand its outputs to their groups (one wake-up per event loop)."""
        now = time.monotonic()
        out: list[Delivery] = []
        for add_id, num_prompt_tokens in rnd.accepted:
            pending = self._pending.pop(add_id)
            if not pending.accepted.set_running_or_notify_cancel():
                self.abort(pending.group.request_ids)  # the handler gave up waiting (its client left)
                continue
            for i, rid in enumerate(pending.group.request_ids):
                self._live[rid] = _Live(pending.group, i)
            self.metrics.prompt_tokens.inc(num_prompt_tokens)
            pending.accepted.set_result(None)
        for add_id, kind, message, param in rnd.refused:
            pending = self._pending.pop(add_id)
            if pending.accepted.set_running_or_notify_cancel():
                error = {"invalid": RequestRejected, "stopped": EngineNotRunning}.get(kind, RuntimeError)
                pending.accepted.set_exception(
                    RequestRejected(message, param) if error is RequestRejected else error(message)
                )
        for record in rnd.steps:
            self.metrics.observe_step(record)
        if rnd.step_errors:
            self.metrics.step_errors.inc(rnd.step_errors)
        for o in rnd.outputs:
            live = self._live.get(o.request_id)
            if live is None:
                continue
            self.metrics.observe_output(o, live.group.arrival, live.last_token_time, now)
            if any(c.delta_token_ids for c in o.outputs):
                live.last_token_time = now
            if o.finished:
                del self._live[o.request_id]
            out.append((live.group, live.index, o))
        for rid, why in rnd.failed:
            live = self._live.pop(rid, None)
            if live is not None:
                self.metrics.requests.labels(status="error").inc()
                out.append((live.group, live.index, EngineStepError(why, [])))
        if rnd.stats is not None:
            self.metrics.observe_stats(rnd.stats)
            self.admission.on_round(rnd.handled, rnd.stats.num_waiting)
        self._post(out)

    def _fail_everything(self, why: str) -> None:
        """The engine side is gone: every live request ends with an error, every pending add is refused."""
        out: list[Delivery] = []
        for live in self._live.values():
            self.metrics.requests.labels(status="error").inc()
            out.append((live.group, live.index, EngineStepError(why, [])))
        self._live.clear()
        for pending in self._pending.values():
            if pending.accepted.set_running_or_notify_cancel():
                pending.accepted.set_exception(EngineNotRunning(why))
        self._pending.clear()
        self._post(out)

    def _post(self, deliveries: list[Delivery]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[Delivery]] = {}
        for d in deliveries:
            by_loop.setdefault(d[0].loop, []).append(d)
        for loop, items in by_loop.items():
            if loop not in self._mailboxes:
                self._mailboxes[loop] = _Mailbox(loop)
            self._mailboxes[loop].post(items)


class AsyncEngine(EngineClient):
    """An `Engine` run by a background thread of this process, driven from asyncio code."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        config: EngineConfig | None = None,
        *,
        metrics: ServerMetrics | None = None,
        max_waiting: int | None = None,
        request_timeout: float | None = None,
        admission: Any = None,
        loop_class: Callable[[Engine], Any] = EngineLoop,
        **components: Any,
    ) -> None:
        """Build the engine this front end owns (``components``: ``block_allocator``, ``prefix_cache``,
        ``scheduler``, as for `Engine`); for ``max_waiting``, ``request_timeout`` and ``admission`` see
        `EngineClient`.
        ``loop_class(engine)`` builds the engine side: `EngineLoop`, or a class with its ``run`` (a
        learner's, in Lab 8)."""
        super().__init__(
            metrics=metrics, max_waiting=max_waiting, request_timeout=request_timeout, admission=admission
        )
        self.engine = Engine(model, tokenizer, config, **components)
        self.tokenizer = tokenizer
        self.loop = loop_class(self.engine)
        self._commands: queue.Queue[Command] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._crashed: str | None = None  # why the loop died, if it did
        self._crash_lock = threading.Lock()
        self.metrics.observe_stats(self.engine.stats())

    @property
    def config(self) -> EngineConfig:  # type: ignore[override]
        return self.engine.config

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
        self._commands.put(STOP)
        self._thread.join(timeout)
        if not self._thread.is_alive():  # adds that raced the stop are refused, not left waiting
            self._fail_everything("the server is shutting down")
            self.engine.close()  # its tensor-parallel workers, if any

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def is_running(self) -> bool:
        return (
            self._thread is not None and self._thread.is_alive() and not self._stopping and not self._crashed
        )

    def _send(self, cmd: Command) -> None:
        self._commands.put(cmd)
        if self._crashed:  # the loop died after the caller checked is_running: refuse what it will never see
            with self._crash_lock:
                self._fail_everything(self._crashed)

    def _run(self) -> None:
        try:
            self.loop.run(self._receive, self._deliver)
        except (
            BaseException
        ) as exc:  # the loop itself broke (a plugged-in loop's bug): nobody may wait forever
            log.exception("the engine loop crashed; the engine thread stops")
            with self._crash_lock:
                self._crashed = f"the engine loop crashed: {type(exc).__name__}: {exc}"
                self._fail_everything(self._crashed)

    def _receive(self, timeout: float | None) -> Command | None:
        try:
            if timeout == 0:
                return self._commands.get_nowait()
            return self._commands.get(timeout=timeout)
        except queue.Empty:
            return None
