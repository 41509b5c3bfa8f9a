from __future__ import annotations

import json
import logging
import math  # noqa: F401 (for your code: math.inf, math.isfinite)
import threading  # noqa: F401 (for your code: threading.Lock)
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

log = logging.getLogger("lab08")

# ------------------------------------------------------------------------------------------ the API's side


class InvalidRequest(ValueError):
    """Bad input from a client: the server answers HTTP 400 with OpenAI's error body naming ``param``
    (the body's field at fault; None when the body as a whole is wrong). nanolab's has the same name."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class SamplingParams:
    """The fields of nanolab's `SamplingParams` this lab's requests carry, with OpenAI's defaults. It checks
    nothing itself: validating them is your `parse_completion_request`'s job."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: list[str] | None = None  # always a list here (a single stop string becomes a list of one)
    seed: int | None = None


@dataclass(frozen=True)
class CompletionRequest:
    """A parsed, valid completions request (the fields of nanolab's this lab covers)."""

    prompts: list  # each a non-empty string or a non-empty list of token ids
    params: SamplingParams
    model: str
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the token counts
    ignored: tuple[str, ...] = ()  # the body's fields this server does not know, sorted


@dataclass(frozen=True)
class ChatRequest:
    """A parsed, valid chat completions request (the fields of nanolab's this lab covers)."""

    messages: list  # [{"role": str, "content": str}]: each message's role and its content as one string
    params: SamplingParams  # max_tokens: a placeholder when max_tokens_given is false
    max_tokens_given: bool  # false: the server gives the answer the room the model's context leaves
    model: str
    stream: bool = False
    include_usage: bool = False
    ignored: tuple[str, ...] = ()


def sse(data: dict | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line (``data: [DONE]`` for the string "[DONE]")."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


# ---------------------------------------------------------------------------------------- engine outputs


@dataclass
class CompletionOutput:
    """One sample of a request, as nanolab's: everything so far, and what is new since its last output."""

    index: int  # the sample, 0 .. n - 1
    text: str | None
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "timeout"; None while it runs
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    """What the engine hands back for one request after a step (nanolab's fields that serving reads)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool


class EngineStepError(RuntimeError):
    """A step raised: the requests it was running were aborted and their blocks freed (nanolab's has the
    same name). ``outputs``: their final outputs (finish reason "abort")."""

    def __init__(self, message: str, outputs: Sequence[RequestOutput] = ()) -> None:
        super().__init__(message)
        self.outputs = list(outputs)


class ServerOverloaded(RuntimeError):
    """Too many requests are waiting: the call was refused and nothing was counted (nanolab's has the same
    name). ``retry_after``: whole seconds after which a client may try again (HTTP's ``Retry-After``)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


# ------------------------------------------------------------------- what crosses between the two sides


@dataclass
class AddCommand:
    """Add one request per prompt (all or none). ``deadline``: a `time.monotonic()` time, or None."""

    add_id: int
    request_ids: list[str]
    prompts: list
    params: list
    priority: int = 0
    deadline: float | None = None


@dataclass
class AbortCommand:
    request_ids: list[str]


STOP = "stop"  # the command that ends the loop


@dataclass
class Round:
    """What the engine side hands back after one round of its loop (nanolab's `Round`)."""

    accepted: list = field(default_factory=list)  # (add id, prompt tokens of the add's requests)
    refused: list = field(
        default_factory=list
    )  # (add id, kind, message, param); kind "invalid" | "error" | "stopped"
    outputs: list = field(default_factory=list)  # RequestOutput of live requests, in the order they came
    failed: list = field(default_factory=list)  # (request id, why): requests a failed step took down
    steps: list = field(default_factory=list)  # step records (the loop's `run` collects them)
    step_errors: int = 0  # steps that raised
    stats: Any = None  # the engine's stats() when the round was taken
    handled: int = 0  # prompts of every add taken off the command queue so far

    def __bool__(self) -> bool:
        return bool(self.accepted or self.refused or self.outputs or self.failed or self.steps)


class LoopBase:
    """What your `EngineLoop` inherits: the loop that waits for commands and steps (`run`), the dispatch of
    one command (`handle`) and the shutdown (`stop_all`). They use your ``engine``, ``live``, ``deadlines``,
    ``handled`` and ``round`` and your methods ``add``, ``abort``, ``expire``, ``step``, ``route`` and
    ``take_round``.

    ``run(receive, send)``: ``receive(timeout)`` returns the next command, or None once ``timeout`` seconds
    passed (0: do not wait; None: wait as long as it takes); ``send(round)`` hands a round back.
    """

    engine: Any
    live: set
    deadlines: dict
    handled: int
    round: Round

    def run(self, receive: Callable[[float | None], Any], send: Callable[[Round], None]) -> None:
        self.engine.listeners = (*getattr(self.engine, "listeners", ()), self.record_step)
        while True:
            if self.engine.has_unfinished():
                cmd = receive(0)
            elif self.deadlines:  # idle, but a deadline is due: sleep until it at most
                cmd = receive(max(0.0, min(self.deadlines.values()) - time.monotonic()))
            else:
                cmd = receive(None)  # idle: sleep here
            while cmd is not None:  # every queued command before the next step
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
            except Exception:
                log.exception("the engine loop hit an error between steps")
            if self.round:
                send(self.take_round())

    def record_step(self, record: Any) -> None:
        """The engine's step listener: the record rides on the next round (for the step metrics)."""
        self.round.steps.append(record)

    def handle(self, cmd: Any) -> None:
        """Take one command off the queue (by its class's name: nanolab's commands work too)."""
        kind = type(cmd).__name__
        if kind == "AddCommand":
            self.handled += len(cmd.prompts)  # taken off the queue, whatever becomes of it
        try:
            if kind == "AddCommand":
                self.add(cmd)
            elif kind == "AbortCommand":
                self.abort(cmd.request_ids)
            else:
                raise TypeError(f"not a command: {cmd!r}")
        except Exception as exc:  # a bug, not bad input: keep serving the others
            log.exception("the engine failed to handle a command")
            if kind == "AddCommand":
                self.round.refused.append((cmd.add_id, "error", f"{type(exc).__name__}: {exc}", None))

    def stop_all(self, receive: Callable[[float | None], Any]) -> None:
        """Abort every live request; refuse the adds that arrived after the stop."""
        try:
            self.abort(list(self.live))
        except Exception:
            log.exception("aborting the live requests at shutdown failed")
        while (cmd := receive(0)) is not None:
            if type(cmd).__name__ == "AddCommand":
                self.handled += len(cmd.prompts)
                self.round.refused.append((cmd.add_id, "stopped", "the server is shutting down", None))

    # what your EngineLoop defines
    def add(self, cmd: AddCommand) -> None:
        raise NotImplementedError

    def abort(self, request_ids: Sequence[str]) -> None:
        raise NotImplementedError

    def expire(self, now: float) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def route(self, out: RequestOutput | None) -> None:
        raise NotImplementedError

    def take_round(self) -> Round:
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------- metrics

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STATUSES = ("stop", "length", "abort", "timeout", "error", "rejected", "overloaded")


class MetricSet:
    """The metrics your `observe_output` and `observe_stats` write: `prometheus_client` objects with the
    names, labels and buckets of nanolab's `ServerMetrics` (which has the same attributes), registered in a
    `CollectorRegistry` of their own (``registry``), so that several sets can live in one process.

    Counters only go up (``.inc(amount=1)``); a counter with labels is one counter per label value
    (``requests.labels(status="stop").inc()``). A histogram counts observations per bucket
    (``.observe(seconds)``); a gauge holds one number (``.set(x)``).
    """

    def __init__(self, prefix: str = "nanolab") -> None:
        r = self.registry = CollectorRegistry()
        p = prefix
        self.requests = Counter(f"{p}_requests_total", "Requests by final status.", ["status"], registry=r)
        for status in STATUSES:
            self.requests.labels(status=status)  # every status shows from the start, at 0
        self.generation_tokens = Counter(
            f"{p}_generation_tokens_total", "Output tokens generated.", registry=r
        )
        self.ttft = Histogram(
            f"{p}_time_to_first_token_seconds",
            "Time from receiving a request to its first output token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            f"{p}_inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{p}_e2e_request_latency_seconds",
            "Time from receiving a request to its end.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge(f"{p}_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge(f"{p}_requests_waiting", "Requests waiting to be admitted.", registry=r)
        self.kv_total = Gauge(f"{p}_kv_blocks_total", "KV cache blocks in the pool.", registry=r)
        self.kv_free = Gauge(f"{p}_kv_blocks_free", "KV cache blocks free in the allocator.", registry=r)
        self.kv_cached = Gauge(
            f"{p}_kv_blocks_cached", "KV cache blocks held by the prefix cache.", registry=r
        )
        self.kv_usage = Gauge(f"{p}_kv_block_usage", "Fraction of KV blocks not free (0..1).", registry=r)

    def values(self) -> dict[str, float]:
        """Every sample now, by name (with its labels, as /metrics writes them), without ``_created``."""
        out = {}
        for family in self.registry.collect():
            for s in family.samples:
                if not s.name.endswith("_created"):
                    labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                    out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out


@dataclass
class EngineStats:
    """What `observe_stats` reads of the engine's snapshot (nanolab's `EngineStats` has these fields)."""

    num_running: int  # requests in the running batch (holding KV blocks)
    num_waiting: int  # requests waiting to be admitted
    kv_blocks_total: int
    kv_blocks_free: int  # free in the allocator
    kv_blocks_cached: int  # held by the prefix cache


# ------------------------------------------------------------------------- a toy engine to drive the loop


@dataclass
class ToyStats:
    steps: int
    num_running: int
    num_waiting: int


@dataclass
class ToyRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    shown: int = 0  # output tokens already handed out


class ToyEngine:
    """A stand-in for nanolab's `Engine` with its serving methods: ``add_requests``, ``step``, ``abort``,
    ``has_unfinished``, ``stats``. No model: each step, each of up to ``max_num_seqs`` running requests gets
    one token (a letter), picked from its prompt and what it has generated. A request ends after its
    ``max_tokens`` (finish reason "length") or on the token 0, end of text ("stop").

    ``add_requests`` checks every prompt before adding any and raises ValueError (adding none) for an empty
    prompt, a token outside the vocabulary, a prompt plus ``max_tokens`` beyond ``max_model_len``, or an id
    in use. ``fail_at``: numbers of the steps (1, 2, ...) that raise `EngineStepError`, as a crashing model
    would: that step's running requests are aborted first and their final outputs ride on the error.
    """

    VOCAB = 26

    def __init__(self, max_num_seqs: int = 4, max_model_len: int = 64, fail_at: Sequence[int] = ()) -> None:
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.fail_at = set(fail_at)
        self.listeners: tuple = ()
        self.waiting: deque[ToyRequest] = deque()
        self.running: list[ToyRequest] = []
        self.num_steps = 0

    def add_requests(
        self, prompts: Sequence, params: Sequence, priority: int = 0, request_ids: Sequence[str] | None = None
    ) -> list[ToyRequest]:
        ids = (
            list(request_ids)
            if request_ids is not None
            else [f"toy-{self.num_steps}-{i}" for i in range(len(prompts))]
        )
        known = {r.request_id for r in (*self.waiting, *self.running)}
        reqs = []
        for rid, prompt, sp in zip(ids, prompts, params, strict=True):
            tokens = [ord(c) % self.VOCAB for c in prompt] if isinstance(prompt, str) else list(prompt)
            if not tokens:
                raise ValueError(f"request {rid}: the prompt is empty")
            if any(not 0 <= t < self.VOCAB for t in tokens):
                raise ValueError(f"request {rid}: a token id is outside the vocabulary (0..{self.VOCAB - 1})")
            if len(tokens) + sp.max_tokens > self.max_model_len:
                raise ValueError(
                    f"request {rid}: prompt and max_tokens exceed max_model_len={self.max_model_len}"
                )
            if rid in known:
                raise ValueError(f"request id {rid!r} is already in use")
            known.add(rid)
            reqs.append(ToyRequest(rid, tokens, sp.max_tokens))
        self.waiting.extend(reqs)
        return reqs

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> ToyStats:
        return ToyStats(self.num_steps, len(self.running), len(self.waiting))

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        while self.waiting and len(self.running) < self.max_num_seqs:
            self.running.append(self.waiting.popleft())
        if self.num_steps in self.fail_at:
            doomed, self.running = self.running, []
            for r in doomed:
                r.finish_reason = "abort"
            raise EngineStepError(f"step {self.num_steps} failed", [self._output(r) for r in doomed])
        outputs = []
        for r in self.running:
            seq = r.prompt_token_ids + r.output_token_ids
            token = (sum(seq) * 7 + len(seq)) % self.VOCAB
            r.output_token_ids.append(token)
            if token == 0:
                r.finish_reason = "stop"
            elif len(r.output_token_ids) >= r.max_tokens:
                r.finish_reason = "length"
            outputs.append(self._output(r))
        self.running = [r for r in self.running if r.finish_reason is None]
        for listener in self.listeners:
            listener(ToyStats(self.num_steps, len(outputs), len(self.waiting)))
        return outputs

    def abort(self, request_id: str, reason: Any = "abort") -> RequestOutput | None:
        """Stop a request now (finish reason ``reason``); its final output, or None if unknown or finished."""
        for queue in (self.waiting, self.running):
            for r in queue:
                if r.request_id == request_id:
                    queue.remove(r)
                    r.finish_reason = str(getattr(reason, "value", reason))
                    return self._output(r)
        return None

    def _output(self, r: ToyRequest) -> RequestOutput:
        new = r.output_token_ids[r.shown :]
        r.shown = len(r.output_token_ids)
        text = "".join(chr(ord("a") + t) for t in r.output_token_ids)
        delta = "".join(chr(ord("a") + t) for t in new)
        sample = CompletionOutput(0, text, list(r.output_token_ids), r.finish_reason, delta, list(new))
        return RequestOutput(r.request_id, list(r.prompt_token_ids), [sample], r.finish_reason is not None)
