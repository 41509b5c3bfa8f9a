"""The engine core in a process of its own, so the HTTP front end and the engine no longer share a GIL.

    front end process (uvicorn, asyncio)                     engine core process
    ------------------------------------                     -------------------
    HTTP handlers: add / abort --- commands --> ZeroMQ --->  `EngineLoop`: take every queued command,
                                   (PUSH -> PULL, ipc)        expire deadlines, engine.step(),
    output thread: route to the <-- one `Round` per loop ---  send the round (outputs, acks, step
      RequestGroup queues, metrics   (PUSH -> PULL, ipc)      records, stats), step again at once

`ProcessAsyncEngine` is `nanolab.serving.async_engine.AsyncEngine` with its engine thread replaced by a
process: the same `EngineLoop` runs there, and the same `EngineClient` front end routes what it sends
back. vLLM V1 splits its server the same way (its "engine core" process). Why: in one process, every
time the HTTP thread parses JSON or writes a stream event it holds the GIL, and the engine's Python
code (scheduling, batch layout, sampling) waits; `bench/bench_server.py` measures both layouts.

Transport: two ZeroMQ PUSH/PULL sockets over Unix-domain ("ipc") endpoints in a temporary directory
only this user can open, bound by the front end; messages are pickled (they are the engine's own
dataclasses: `RequestOutput`, `SamplingParams`, ...). The engine side sends one message per step, all
of that step's outputs together; the front end's output thread wakes each event loop once per message.
A request's first output crosses whole; each later one only as what changed since the one before
(`OutputCodec`): the new tokens and text, not the prompt and everything generated so far again, so a
step's message stays the same size however long the prompts and outputs grow.

Life cycle:

- `start` launches the process (multiprocessing's "spawn": a fresh interpreter, safe with torch's
  threads) and waits until it built its engine (`startup_timeout`); a failure there (a bad checkpoint)
  is raised by `start` with the child's own traceback.
- Ctrl-C reaches every process of the terminal's group: the engine process ignores it and waits for
  the front end's stop command, so running requests end with finish reason "abort" as with a thread.
- If the front end dies (even by SIGKILL), the engine process notices within a second (its parent
  changed) and exits. If the engine process dies, the output thread notices within 0.2 s: running
  requests fail with `EngineStepError`, new ones get `EngineNotRunning` (HTTP 503), /health answers
  503, and ``on_engine_death`` is called (`nanolab serve` then exits with status 1, for its supervisor
  to restart it).

The factory that builds the engine is pickled to the child, so it must be importable: a module-level
function, or a `functools.partial` of one (`engine_from_checkpoint`, `engine_from_parts`).
"""

from __future__ import annotations

import atexit
import functools
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import zmq

from nanolab.engine.config import EngineConfig
from nanolab.engine.engine import Engine
from nanolab.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanolab.serving.async_engine import STOP, Command, EngineClient, EngineLoop, Round
from nanolab.serving.metrics import ServerMetrics

log = logging.getLogger("nanolab.server")

__all__ = ["EngineProcessError", "ProcessAsyncEngine", "engine_from_checkpoint", "engine_from_parts"]

PARENT_CHECK_S = 1.0  # how often an idle engine process checks that its front end is still there
DEATH_CHECK_S = 0.2  # how often the front end's output thread checks that the engine process lives
_READY, _FAILED, _BYE = "ready", "failed", "bye"


class EngineProcessError(RuntimeError):
    """The engine process could not start (its traceback is in the message) or died."""


def _load_engine(path: str, config: EngineConfig | None) -> Engine:
    from nanolab.model.loading import load_model, load_tokenizer

    return Engine(load_model(path), load_tokenizer(path), config)


def engine_from_checkpoint(path: str, config: EngineConfig | None = None) -> Callable[[], Engine]:
    """A factory the engine process calls: load the checkpoint at ``path`` (model and tokenizer)."""
    return functools.partial(_load_engine, str(path), config)


def engine_from_parts(
    model: Any, tokenizer: Any = None, config: EngineConfig | None = None, **components: Any
):
    """A factory of an `Engine` over these parts; they are pickled to the engine process (a copy)."""
    return functools.partial(Engine, model, tokenizer, config, **components)


_TAIL = True  # in place of a sample's delta that is its value's tail (see OutputCodec)


def _diff(old: Any, new: Any) -> tuple[int, Any] | None:
    """``new`` (a list, a string or None) as ``(kept, tail)``: the first ``kept`` items of ``old``, then
    ``tail``. ``kept`` is ``len(old)`` when ``new`` extends ``old``, 0 (``tail`` is all of ``new``) when not."""
    if new is None:
        return None
    if old is not None:
        n = len(old)
        if len(new) == n:  # unchanged, as a prompt always is: compared without copying
            if new == old:
                return n, new[:0]
        elif len(new) > n and (new.startswith(old) if isinstance(new, str) else new[:n] == old):
            return n, new[n:]
    return 0, new


def _undiff(old: Any, diff: tuple[int, Any] | None) -> Any:
    """What `_diff` was given as ``new``. An unchanged value is ``old`` itself (nobody changes outputs)."""
    if diff is None:
        return None
    kept, tail = diff
    if kept == 0:
        return tail
    if not tail and kept == len(old):
        return old
    return old[:kept] + tail


class OutputCodec:
    """The engine's outputs as they cross the socket: a request's first output whole, each later one as
    what changed since the one before.

    An output carries the request's prompt and everything generated so far, each step again; pickled whole,
    a step's message (and its pickling on one side and unpickling on the other) grows with every prompt and
    output in the batch. Here a later output is a tuple: the request's id, whether it finished, its metrics'
    fields, and for the prompt, its tokens, its log-probabilities and each sample's text, tokens and
    log-probabilities, only what the previous value lacks (`_diff`; the whole value when it is not an
    extension, say a text cut back at a stop string). A sample's deltas are sent as ``True`` when they are
    just that tail. The engine side encodes (`encode`), the front end decodes (`decode`) to outputs equal
    to the engine's, each side keeping every live request's last output; a request leaves both with its
    finished output, or its failure (`forget`). Decoded outputs are read-only, as every output is: a value
    that did not change (a prompt's tokens) is the previous output's own list."""

    def __init__(self) -> None:
        # request id -> (its last output, each sample's last completion by index)
        self.last: dict[str, tuple[RequestOutput, dict[int, CompletionOutput]]] = {}
        self.dropped: set[str] = set()  # requests failed for an output that could not be decoded

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self.last.pop(rid, None)

    def _keep(self, out: RequestOutput, samples: dict[int, CompletionOutput]) -> None:
        if out.finished:
            self.last.pop(out.request_id, None)
        else:
            self.last[out.request_id] = (out, samples)

    def encode(self, out: RequestOutput) -> RequestOutput | tuple:
        seen = self.last.get(out.request_id)
        if seen is None:
            self._keep(out, {c.index: c for c in out.outputs})
            return out
        prev, samples = seen
        completions = []
        for c in out.outputs:
            p = samples.get(c.index)
            samples[c.index] = c
            if p is None:
                completions.append(c)
                continue
            tokens, logprobs = _diff(p.token_ids, c.token_ids), _diff(p.logprobs, c.logprobs)
            completions.append(
                (
                    c.index,
                    _diff(p.text, c.text),
                    tokens,
                    c.finish_reason,
                    c.delta_text,
                    _TAIL if c.delta_token_ids == tokens[1] else c.delta_token_ids,
                    _TAIL if logprobs is not None and c.delta_logprobs == logprobs[1] else c.delta_logprobs,
                    logprobs,
                )
            )
        self._keep(out, samples)
        return (
            out.request_id,
            out.finished,
            tuple(vars(out.metrics).values()),
            _diff(prev.prompt, out.prompt),
            _diff(prev.prompt_token_ids, out.prompt_token_ids),
            _diff(prev.prompt_logprobs, out.prompt_logprobs),
            completions,
        )

    def decode(self, wire: RequestOutput | tuple) -> RequestOutput:
        if isinstance(wire, RequestOutput):
            self._keep(wire, {c.index: c for c in wire.outputs})
            return wire
        rid, finished, metrics, prompt, prompt_token_ids, prompt_logprobs, completions = wire
        prev, samples = self.last[rid]
        outputs = []
        for w in completions:
            if not isinstance(w, CompletionOutput):
                index, text, tokens, finish_reason, delta_text, delta_tokens, delta_logprobs, logprobs = w
                p = samples[index]
                w = CompletionOutput(
                    index=index,
                    text=_undiff(p.text, text),
                    token_ids=_undiff(p.token_ids, tokens),
                    finish_reason=finish_reason,
                    delta_text=delta_text,
                    delta_token_ids=tokens[1] if delta_tokens is _TAIL else delta_tokens,
                    logprobs=_undiff(p.logprobs, logprobs),
                    delta_logprobs=logprobs[1] if delta_logprobs is _TAIL else delta_logprobs,
                )
            samples[w.index] = w
            outputs.append(w)
        out = RequestOutput(
            rid,
            _undiff(prev.prompt, prompt),
            _undiff(prev.prompt_token_ids, prompt_token_ids),
            outputs,
            finished,
            RequestMetrics(*metrics),
            _undiff(prev.prompt_logprobs, prompt_logprobs),
        )
        self._keep(out, samples)
        return out

    def encode_round(self, rnd: Round) -> Round:
        """``rnd`` with its outputs encoded (in place), its failed requests forgotten."""
        rnd.outputs = [self.encode(out) for out in rnd.outputs]
        self.forget(rid for rid, _ in rnd.failed)
        return rnd

    def decode_round(self, rnd: Round) -> list[str]:
        """Decode ``rnd``'s outputs in place and forget its failed requests. An output that cannot be
        decoded (a bug) fails its request, whose id is returned (for an abort), and the rest of the round
        is delivered."""
        unreadable, outputs = [], []
        for wire in rnd.outputs:
            rid, finished = (wire.request_id, wire.finished) if isinstance(wire, RequestOutput) else wire[:2]
            if rid in self.dropped:  # failed already: its outputs until the abort lands are dropped
                if finished:
                    self.dropped.discard(rid)
                continue
            try:
                outputs.append(self.decode(wire))
            except Exception:
                log.exception("decoding request %s's output from the engine process failed", rid)
                rnd.failed.append((rid, "the server could not read this request's output from its engine"))
                unreadable.append(rid)
                if not finished:
                    self.dropped.add(rid)
        rnd.outputs = outputs
        self.forget(rid for rid, _ in rnd.failed)
        return unreadable


class ProcessAsyncEngine(EngineClient):
    """An `Engine` run by a process of its own, driven from asyncio code (see the module's docstring)."""

    def __init__(
        self,
        factory: Callable[[], Engine],
        tokenizer: Any = None,
        *,
        metrics: ServerMetrics | None = None,
        max_waiting: int | None = None,
        request_timeout: float | None = None,
        admission: Any = None,
        startup_timeout: float = 600.0,
        on_engine_death: Callable[[], None] | None = None,
        torch_threads: int | None = None,
    ) -> None:
        """``factory`` builds the engine inside the process (see `engine_from_checkpoint`); ``tokenizer``
        is the front end's copy (for chat templates and the text of log-probabilities). For
        ``max_waiting``, ``request_timeout`` and ``admission`` see `nanolab.serving.async_engine.EngineClient`.
        ``torch_threads``: torch's intra-op threads in the engine process (None: as many as this process
        uses when `start` is called, so ``torch.set_num_threads`` here holds there too; a fresh
        interpreter would otherwise take one per core, and their spinning starves the front end)."""
        super().__init__(
            metrics=metrics, max_waiting=max_waiting, request_timeout=request_timeout, admission=admission
        )
        if torch_threads is not None and (
            isinstance(torch_threads, bool) or not isinstance(torch_threads, int) or torch_threads < 1
        ):
            raise ValueError(
                f"torch_threads must be an integer >= 1 (None: this process's), got {torch_threads!r}"
            )
        self.torch_threads = torch_threads
        self.factory = factory
        self.tokenizer = tokenizer
        self.startup_timeout = startup_timeout
        self.on_engine_death = on_engine_death
        self.config: EngineConfig | None = None  # the engine's resolved settings, once started
        self.process: multiprocessing.process.BaseProcess | None = None
        self._dir: str | None = None
        self._ctx: zmq.Context | None = None
        self._commands: zmq.Socket | None = None
        self._outputs: zmq.Socket | None = None
        self._send_lock = threading.Lock()  # handlers on several threads may send
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: str | None = None  # why the engine process is gone, when it died

    # -- life cycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Launch the engine process and wait until its engine is built (raises `EngineProcessError`)."""
        if self.process is not None:
            raise RuntimeError("the engine process was already started")
        self._dir = tempfile.mkdtemp(prefix="nanolab-engine-")  # mode 0700: this user's alone
        self._ctx = zmq.Context()
        self._commands = self._ctx.socket(zmq.PUSH)
        self._outputs = self._ctx.socket(zmq.PULL)
        for sock in (self._commands, self._outputs):
            sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block: the other side drains every round
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
        addresses = (f"ipc://{self._dir}/commands", f"ipc://{self._dir}/outputs")
        self._commands.bind(addresses[0])
        self._outputs.bind(addresses[1])
        spawn = multiprocessing.get_context("spawn")
        self.process = spawn.Process(
            target=run_engine_core,
            args=(self.factory, *addresses, os.getpid(), self.torch_threads or torch.get_num_threads()),
            name="nanolab-engine-core",
            # Not a daemon: a daemon may start no processes, and a tensor-parallel engine starts its
            # workers. This interpreter's exit still ends it (see _kill_at_exit).
            daemon=False,
        )
        atexit.register(_kill_at_exit, self.process)
        # Ctrl-C goes to the whole process group; the child must only stop when told. Blocked signals
        # are inherited through fork and exec, so it starts with SIGINT blocked, then ignores it.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        try:
            self.config = self._wait_ready()
        except BaseException:
            self._close(kill=True)
            raise
        self._thread = threading.Thread(target=self._read_outputs, name="nanolab-engine-outputs", daemon=True)
        self._thread.start()

    def _wait_ready(self) -> EngineConfig:
        deadline = time.monotonic() + self.startup_timeout
        while not self._outputs.poll(100):
            if self.process.exitcode is not None:
                raise EngineProcessError(f"the engine process exited with code {self.process.exitcode}")
            if time.monotonic() > deadline:
                raise EngineProcessError(
                    f"the engine process was not ready after {self.startup_timeout:.0f} s"
                )
        kind, payload = pickle.loads(self._outputs.recv())
        if kind == _FAILED:
            raise EngineProcessError(f"the engine process could not build its engine:\n{payload}")
        config, stats = payload
        self.metrics.observe_stats(stats)
        return config

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine process: running requests are aborted (finish_reason "abort"), then it exits."""
        if self.process is None or self._stopping:
            return
        self._stopping = True
        if self._dead is None:
            self._send(STOP)
        if self._thread is not None:
            self._thread.join(timeout)
        self.process.join(timeout)
        self._close(kill=self.process.exitcode is None)
        self._fail_everything("the server is shutting down")  # adds that raced the stop

    def _close(self, kill: bool) -> None:
        if kill and self.process is not None and self.process.exitcode is None:
            self.process.kill()
            self.process.join(5)
        for sock in (self._commands, self._outputs):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self._commands = self._outputs = self._ctx = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    @property
    def started(self) -> bool:
        return self.process is not None

    @property
    def is_running(self) -> bool:
        return (
            self._thread is not None
            and self._dead is None
            and not self._stopping
            and self.process is not None
            and self.process.exitcode is None
        )

    def _send(self, cmd: Command) -> None:
        data = pickle.dumps(cmd, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            if self._commands is None:
                return
            try:  # never blocks: a PUSH socket with no peer (the engine process is gone) would wait forever
                self._commands.send(data, zmq.NOBLOCK)
            except zmq.Again:
                log.warning("the engine process is not listening; a command was dropped")

    # -- the output thread ----------------------------------------------------------------------------

    def _read_outputs(self) -> None:
        sock = self._outputs
        codec = OutputCodec()
        while True:
            if sock.poll(DEATH_CHECK_S * 1000):
                message = pickle.loads(sock.recv())
                if message == _BYE:
                    return
                try:
                    if unreadable := codec.decode_round(message):
                        self.abort(unreadable)  # the engine stops them (what it sends of them is dropped)
                    self._deliver(message)
                except Exception:
                    log.exception("routing the engine's outputs failed")
            elif self.process.exitcode is not None:
                self._died(self.process.exitcode)
                return

    def _died(self, code: int) -> None:
        why = f"the engine process died (exit code {code}); the server cannot serve until it is restarted"
        log.error(why)
        self._dead = why
        self.metrics.step_errors.inc()
        self._fail_everything(why)
        if self.on_engine_death is not None and not self._stopping:
            self.on_engine_death()


# -- the engine process ---------------------------------------------------------------------------------------


class _FrontEndGone(Exception):
    pass


def _kill_at_exit(process: multiprocessing.Process) -> None:
    """End the engine process when this interpreter exits without `ProcessAsyncEngine.shutdown` (it runs
    before multiprocessing's own exit handler, which would otherwise wait for it)."""
    if process.exitcode is None:
        process.kill()
        process.join(5)


def run_engine_core(
    factory: Callable[[], Engine], commands: str, outputs: str, parent: int, torch_threads: int | None = None
) -> None:
    """The engine process's main: build the engine, say ready, run `EngineLoop` until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when to stop (see `start`)
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (inbox, outbox):
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
    inbox.connect(commands)
    outbox.connect(outputs)

    codec = OutputCodec()

    def send(message: Any) -> None:
        if isinstance(message, Round):
            message = codec.encode_round(message)
        outbox.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def receive(timeout: float | None) -> Command | None:
        """The next command, or None after ``timeout`` s; leaves if the front end is gone."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            if os.getppid() != parent:
                raise _FrontEndGone
            wait = PARENT_CHECK_S if end is None else min(PARENT_CHECK_S, max(0.0, end - time.monotonic()))
            if inbox.poll(int(wait * 1000)):
                return pickle.loads(inbox.recv())
            if end is not None and time.monotonic() >= end:
                return None

    try:
        try:
            engine = factory()
        except Exception:
            send((_FAILED, traceback.format_exc()))
            return
        send((_READY, (engine.config, engine.stats())))
        try:
            EngineLoop(engine).run(receive, send)
        finally:
            engine.close()  # its tensor-parallel workers, if any
        send(_BYE)
    except _FrontEndGone:
        pass
    finally:
        outbox.close(linger=5000)  # the last round and the goodbye still reach the front end
        inbox.close(linger=0)
        ctx.term()
