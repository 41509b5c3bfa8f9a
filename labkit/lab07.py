from __future__ import annotations

import codecs
import hashlib
import time
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

# ---------------------------------------------------------------------------------- requests and outputs


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


@dataclass(frozen=True)
class SamplingParams:
    """The fields of nanolab's `SamplingParams` the loop reads (greedy: the toy model has no sampling)."""

    max_tokens: int = 16
    stop: Sequence[str] | None = None  # stop strings
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    n: int = 1  # (parallel sampling's: nanolab's engine forks; this lab's loop runs n == 1)
    logprobs: int | None = None  # (nanolab's engine records them; this lab's loop does not)
    prompt_logprobs: int | None = None
    adjusts_logits: bool = False  # (logit bias and penalties: nanolab's)


@dataclass(eq=False)
class Request:
    """The fields of nanolab's `Request` the engine loop, the scheduler and the model runner use."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_step: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose keys and values are in the KV cache
    block_table: list[int] = field(default_factory=list)  # its KV blocks, in token order
    num_cached_tokens: int = 0  # (the prefix cache's, Lab 6)
    prefix_node: object = None  # (the prefix cache's, Lab 6)
    num_preemptions: int = 0
    admitted_seq: int | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    generator: object = None  # (sampling's: a seeded generator)
    group: object = None  # (parallel sampling's)
    sample_index: int = 0
    samples_to_fork: int = 0
    wants_prompt_logprobs: bool = False
    output_logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)

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

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]``."""
        return self.all_token_ids[start:end]

    def remaining_prefill(self) -> int:
        """Tokens to compute before the request samples again: 1 for a decode step."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED


def admit(req: Request) -> None:
    """WAITING or PREEMPTED -> RUNNING (Lab 4's)."""
    if req.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
        raise IllegalTransition(
            f"request {req.request_id!r} is {RequestStatus(req.status).value}: it cannot be admitted"
        )
    req.status = RequestStatus.RUNNING


def preempt(req: Request) -> None:
    """RUNNING -> PREEMPTED: nothing computed any more, one more preemption, the output kept (Lab 4's)."""
    if req.status != RequestStatus.RUNNING:
        raise IllegalTransition(
            f"request {req.request_id!r} is {RequestStatus(req.status).value}: it cannot be preempted"
        )
    req.status = RequestStatus.PREEMPTED
    req.num_computed_tokens = 0
    req.num_preemptions += 1


def finish(req: Request, reason: FinishReason) -> None:
    """-> FINISHED with ``reason``: "stop" or "length" from RUNNING only, "abort" from any live state (Lab 4's)."""
    reason = FinishReason(reason)
    allowed = (RequestStatus.RUNNING,) if reason != FinishReason.ABORT else tuple(RequestStatus)[:3]
    if req.status not in allowed:
        raise IllegalTransition(
            f"request {req.request_id!r} is {RequestStatus(req.status).value}: it cannot finish with {reason.value!r}"
        )
    req.status = RequestStatus.FINISHED
    req.finish_reason = reason


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int


@dataclass
class CompletionOutput:
    """One generated continuation (nanolab's, without the logprobs)."""

    index: int
    text: str | None
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort", None while running
    delta_text: str = ""  # text added since the request's previous output
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    delta_logprobs: list | None = None


@dataclass
class RequestOutput:
    """What the engine hands back for a request at a step (nanolab's shape)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list | None = None


def request_output(req: Request, text: str | None, delta_text: str, first_new_token: int) -> RequestOutput:
    """``req``'s output now: its whole ``text`` (None: no tokenizer), the ``delta_text`` no earlier output
    carried, and its output tokens from index ``first_new_token`` on as the new tokens."""
    metrics = RequestMetrics(
        req.arrival_time,
        req.first_token_time,
        req.finish_time,
        req.num_prompt_tokens,
        len(req.output_token_ids),
        req.num_cached_tokens,
        req.num_preemptions,
    )
    done = req.status == RequestStatus.FINISHED
    completion = CompletionOutput(
        0,
        text,
        list(req.output_token_ids),
        req.finish_reason.value if done and req.finish_reason is not None else None,
        delta_text,
        req.output_token_ids[first_new_token:],
    )
    return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), [completion], done, metrics)


# ------------------------------------------------------------------------------- a step's batch, laid out


class SeqSlice(NamedTuple):
    """One sequence of a step: its block table, the position of its first new token, its new tokens."""

    block_table: list[int]
    start_pos: int
    num_new: int


@dataclass
class BatchLayout:
    """One step's batch, flattened: row ``i`` of the forward is ``token_ids[i]`` at ``positions[i]``."""

    scheduled: list[tuple[Request, int]]  # (request, new tokens) in batch order
    token_ids: list[int]
    positions: list[int]
    seqs: list[SeqSlice]  # per sequence, in batch order
    sample_rows: list[int]  # the row each request of `to_sample` samples from
    to_sample: list[Request]  # requests whose every token is computed once this step is done
    prefilled: list[bool] = field(default_factory=list)  # per `to_sample`: this step ended its prompt

    @property
    def requests(self) -> list[Request]:
        return [r for r, _ in self.scheduled]


class ScheduledRequest(NamedTuple):
    request: Request
    num_new_tokens: int  # tokens computed this step, from request.num_computed_tokens on


@dataclass
class SchedulerOutput:
    """One step's batch, and the requests preempted to make room for it."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


# --------------------------------------------------------------- toy parts: a loop you can test in a second


class ToyTokenizer:
    """A 40-token vocabulary with multi-byte characters split across tokens, for the toy model."""

    PIECES = [
        None,  # 0: <|endoftext|> (no text)
        *(
            s.encode()
            for s in ["a", "b", "x", "y", "=", "#", "!", " ", "\n", "ab", "b#", "#!", " = 1", "def", "(", ")"]
        ),
        *(s.encode() for s in ["é", "€", "😀", "ü", ":", "_", "z", "\n\n", "é!"]),
        b"\xc3",  # 26..27: "é" in two tokens
        b"\xa9",
        b"\xe2\x82",  # 28..29: "€" in two tokens
        b"\xac",
        b"\xf0\x9f",  # 30..31: "😀" in two tokens
        b"\x98\x80",
        b"\xf0",  # 32..34: "😀" in three tokens
        b"\x9f\x98",
        b"\x80",
        *(s.encode() for s in ["1", "2", "q", " #", "##"]),
    ]
    FOLLOWERS = {26: 27, 28: 29, 30: 31, 32: 33, 33: 34}  # a split character's next piece

    def __init__(self) -> None:
        self.vocab_size = len(self.PIECES)
        self.eos_token_id = 0
        self.special_tokens = {"<|endoftext|>": 0}

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return b"".join(self.PIECES[i] or b"" for i in ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


class ToyBlockManager:
    """Lab 3's block tables over a first-in-first-out free list (nanolab's `BlockManager`'s methods)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_total_blocks = num_blocks
        self._free = deque(range(num_blocks))
        self.cached: list[str] = []  # requests whose computed prompt was offered to the (absent) prefix cache

    @property
    def num_free(self) -> int:
        return len(self._free)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def usage(self) -> float:
        return 1 - len(self._free) / self.num_total_blocks

    def grow(self, req: Request, num_new_tokens: int) -> bool:
        """Blocks for ``req``'s next ``num_new_tokens`` tokens; False (changing nothing) if too few are free."""
        needed = self.num_blocks_for(req.num_computed_tokens + num_new_tokens) - len(req.block_table)
        if needed > len(self._free):
            return False
        req.block_table += [self._free.popleft() for _ in range(max(needed, 0))]
        return True

    def release(self, req: Request) -> None:
        self._free.extend(req.block_table)
        req.block_table = []
        req.num_computed_tokens = 0

    def cache_computed(self, req: Request) -> None:
        """The engine offers a request's computed prompt to the prefix cache (this toy one only notes it)."""
        self.cached.append(req.request_id)


class ToyScheduler:
    """First come, first served, with a token budget, chunked prefill and preemption by recompute (the
    latest admitted request gives its blocks back). nanolab's `Scheduler` has the same methods."""

    def __init__(
        self, block_manager: ToyBlockManager, max_num_seqs: int = 4, max_num_batched_tokens: int = 16
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._admissions = 0

    def add(self, req: Request) -> None:
        """Queue a new request; ValueError for one that is not new, has no tokens, or holds more tokens than
        the pool (nanolab's rules)."""
        if req.status != RequestStatus.WAITING:
            raise ValueError(
                f"request {req.request_id!r} is {RequestStatus(req.status).value}: only a new request can be added"
            )
        if req.num_tokens == 0:
            raise ValueError(f"request {req.request_id!r} has no tokens: a prompt needs at least one")
        if self.block_manager.num_blocks_for(req.num_tokens) > self.block_manager.num_total_blocks:
            raise ValueError(f"request {req.request_id!r} has more tokens than the KV pool holds")
        self.waiting.append(req)

    def admits_new_requests(self) -> bool:
        """Whether waiting requests may join the batch in this step: always, in continuous batching."""
        return True

    def schedule(self) -> SchedulerOutput:
        finished = [r.request_id for r in self.waiting + self.running if r.status == RequestStatus.FINISHED]
        if finished:
            raise RuntimeError(
                f"request {finished[0]!r} is finished but still in the scheduler's queue: an abort or a finish "
                "must tell the scheduler (scheduler.abort, scheduler.finish)"
            )
        out, budget, taken = SchedulerOutput(), self.max_num_batched_tokens, set()
        for req in sorted(self.running, key=lambda r: (r.remaining_prefill() != 1, r.admitted_seq)):
            if budget == 0 or req.status != RequestStatus.RUNNING:
                continue
            num_new = min(req.remaining_prefill(), budget)
            while not self.block_manager.grow(req, num_new):
                victim = max((r for r in self.running if id(r) not in taken), key=lambda r: r.admitted_seq)
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status == RequestStatus.RUNNING:
                out.scheduled.append(ScheduledRequest(req, num_new))
                taken.add(id(req))
                budget -= num_new
        admitting = self.admits_new_requests()
        while admitting and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            num_new = min(req.num_tokens, budget)
            if not self.block_manager.grow(req, num_new):
                break
            self.waiting.pop(0)
            admit(req)
            self._admissions += 1
            req.admitted_seq = self._admissions
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
        return out

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.block_manager.release(victim)
        preempt(victim)
        self.num_preemptions += 1
        self.waiting.insert(0, victim)
        out.preempted.append(victim)

    def finish(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.release(req)

    def abort(self, req: Request) -> None:
        if req in self.running:
            self.finish(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)


class ToyModelRunner:
    """A stand-in model you can read. Each new token is written into the KV slot its position maps to through
    its sequence's block table, together with a digest of the whole sequence up to it: the digest read back,
    through the table, from the slot of the position before (what attention would read). A sampled row's
    next token is a function of its digest. A wrong position, table or row gives other tokens, or an error
    that says which."""

    def __init__(self, num_blocks: int, block_size: int, tokenizer: ToyTokenizer) -> None:
        self.block_size = block_size
        self.slots: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)  # (token, digest)
        self.vocab_size = tokenizer.vocab_size
        self.followers = tokenizer.FOLLOWERS
        self.calls = 0  # forwards run
        self.forward_seconds = 0.0  # the last one's time

    def _slot(self, table: list[int], pos: int) -> int:
        if pos < 0 or pos // self.block_size >= len(table):
            raise IndexError(
                f"position {pos} needs block {pos // self.block_size} but the table has {len(table)}"
            )
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def run(
        self,
        batch: BatchLayout,
        blocks_to_copy: Sequence[tuple[int, int]] = (),
        extras: bool = False,
        fork=None,
    ) -> list[int]:
        """Write the batch's tokens, sample each of ``batch.to_sample`` from its row, and mark the scheduled
        tokens computed; returns one token per request of ``batch.to_sample``."""
        self.calls += 1
        t0 = time.perf_counter()
        bs = self.block_size
        for src, dst in blocks_to_copy:
            self.slots[dst * bs : (dst + 1) * bs] = self.slots[src * bs : (src + 1) * bs]
        if len(batch.token_ids) != len(batch.positions):
            raise ValueError(f"{len(batch.token_ids)} token ids but {len(batch.positions)} positions")
        written, row = [], 0  # each row's (token, digest)
        for seq in batch.seqs:
            for pos in range(seq.start_pos, seq.start_pos + seq.num_new):
                if row >= len(batch.positions) or batch.positions[row] != pos:
                    raise ValueError(
                        f"row {row} is its sequence's token at position {pos}, but the batch says otherwise"
                    )
                before = self.slots[self._slot(seq.block_table, pos - 1)] if pos else (0, 7)
                token = batch.token_ids[row]
                digest = ((before[1] if before else 99_991) * 1_000_003 + token * 31 + pos) % 2_147_483_647
                written.append((token, digest))
                self.slots[self._slot(seq.block_table, pos)] = written[-1]
                row += 1
        if row != len(batch.token_ids):
            raise ValueError(
                f"the sequences hold {row} new tokens but the batch has {len(batch.token_ids)} rows"
            )
        if len(batch.sample_rows) != len(batch.to_sample):
            raise ValueError(f"{len(batch.sample_rows)} rows to sample for {len(batch.to_sample)} requests")
        tokens = [self.next_token(*written[r]) for r in batch.sample_rows]
        for req, n in batch.scheduled:
            req.num_computed_tokens += n
        self.forward_seconds = time.perf_counter() - t0
        return tokens

    def next_token(self, last: int, digest: int) -> int:
        if last in self.followers:
            return self.followers[last]  # the next piece of a split character
        h = (digest * 48_271) % 2_147_483_647
        if h % 23 == 0:
            return 0  # end of text, now and then
        pick = 1 + h % (self.vocab_size - 1)
        return pick if pick not in (27, 29, 31, 33, 34) else pick - 1  # never a character's tail on its own


def toy_parts(
    num_blocks: int = 48, block_size: int = 4, max_num_seqs: int = 4, max_num_batched_tokens: int = 16
):
    """A toy scheduler, its block manager, a toy model runner and the toy tokenizer, ready for an engine."""
    tokenizer = ToyTokenizer()
    manager = ToyBlockManager(num_blocks, block_size)
    scheduler = ToyScheduler(manager, max_num_seqs, max_num_batched_tokens)
    return scheduler, manager, ToyModelRunner(num_blocks, block_size, tokenizer), tokenizer


def run_engine(
    engine_class,
    requests: list[dict],
    settings: dict | None = None,
    aborts: dict | None = None,
    digest: bool = False,
) -> dict:
    """Serve ``requests`` with ``engine_class(scheduler, block_manager, runner, tokenizer, max_model_len)`` on
    the toy parts, one step at a time; the checks and the grader compare engines this way.

    Each request is ``{"id", "prompt": token ids, "max_tokens", "stop", "stop_token_ids", "ignore_eos",
    "arrival": the step before which it is added}``; ``aborts`` maps a step to the ids aborted before it.
    Returns every step's outputs as plain data (with ``digest``: a SHA-256 of them, and the final outputs),
    the abort results, and what is left at the end.
    """
    settings = dict(settings or {})
    max_model_len = settings.pop("max_model_len", 64)
    scheduler, manager, runner, tokenizer = toy_parts(**settings)
    engine = engine_class(scheduler, manager, runner, tokenizer, max_model_len)
    pending = sorted(requests, key=lambda r: r.get("arrival", 0))
    aborts = {int(k): v for k, v in (aborts or {}).items()}
    steps, aborted, step = [], [], 0
    while pending or engine.has_unfinished() or any(k >= step for k in aborts):
        while pending and pending[0].get("arrival", 0) <= step:
            r = pending.pop(0)
            params = SamplingParams(
                r["max_tokens"], r.get("stop"), r.get("stop_token_ids"), r.get("ignore_eos", False)
            )
            engine.add(Request(r["id"], list(r["prompt"]), params, arrival_time=float(step)))
        for rid in aborts.get(step, []):
            out = engine.abort(rid)
            aborted.append(None if out is None else _plain(out))
        steps.append([_plain(o) for o in engine.step()])
        step += 1
        if step > 2000:
            raise RuntimeError(
                "the engine ran 2000 steps without finishing its requests: one never stops, or KV blocks are "
                "never given back (a finish or an abort the scheduler is not told of) and the others wait for them"
            )
    if digest:
        finals = [o for step in steps for o in step if o["finished"]]
        steps = [hashlib.sha256(repr(steps).encode()).hexdigest(), finals]
    return {
        "steps": steps,
        "aborted": aborted,
        "unfinished": engine.has_unfinished(),
        "free_blocks": manager.num_free,
        "total_blocks": manager.num_total_blocks,
        "preemptions": scheduler.num_preemptions,
        "cached": manager.cached,
        "forwards": runner.calls,
    }


def _plain(out: RequestOutput) -> dict:
    c = out.outputs[0]
    return {
        "id": out.request_id,
        "finished": out.finished,
        "reason": c.finish_reason,
        "text": c.text,
        "tokens": list(c.token_ids),
        "delta_text": c.delta_text,
        "delta_tokens": list(c.delta_token_ids),
    }


def lay_out(layout, cases: list[dict]) -> dict:
    """``layout`` (a ``layout_batch``) on requests built from plain data, and its layout as plain data.

    Each case is ``{"id", "prompt", "output", "computed", "table", "new"}``: a request with those prompt and
    output tokens, ``computed`` of them in the KV cache, that block table, scheduled for ``new`` tokens.
    """
    reqs = []
    for c in cases:
        r = Request(c["id"], list(c["prompt"]), SamplingParams())
        r.output_token_ids, r.num_computed_tokens, r.block_table = (
            list(c["output"]),
            c["computed"],
            list(c["table"]),
        )
        reqs.append(r)
    lay = layout([(r, c["new"]) for r, c in zip(reqs, cases)])
    untouched = all(
        (r.output_token_ids, r.num_computed_tokens, r.block_table) == (c["output"], c["computed"], c["table"])
        for r, c in zip(reqs, cases)
    )
    return {
        "scheduled": [(r.request_id, n) for r, n in lay.scheduled],
        "token_ids": list(lay.token_ids),
        "positions": list(lay.positions),
        "seqs": [(list(s.block_table), s.start_pos, s.num_new) for s in lay.seqs],
        "sample_rows": list(lay.sample_rows),
        "to_sample": [r.request_id for r in lay.to_sample],
        "prefilled": list(lay.prefilled),
        "untouched": untouched,
    }


def stop_of(check, case: dict) -> tuple:
    """``check`` (a ``check_stop``) on a request built from plain data: ``{"prompt", "output", "params": the
    keywords of SamplingParams, "text", "new_from", "eos", "max_model_len"}``; the token is the last output.
    Returns the reason's value (None: it goes on) and the text."""
    req = Request("r", list(case["prompt"]), SamplingParams(**case["params"]))
    req.output_token_ids = list(case["output"])
    reason, text = check(
        req, case["output"][-1], case["text"], case["new_from"], set(case["eos"]), case["max_model_len"]
    )
    return (None if reason is None else FinishReason(reason).value, text)


def run_static(
    generate, engine_class, requests: list[dict], max_batch_size: int, settings: dict | None = None
) -> dict:
    """``generate`` (a ``generate_static``) with ``engine_class`` on the toy parts, for ``requests`` (as in
    `run_engine`); the final outputs as plain data (without deltas), the forwards run and the blocks free at
    the end."""
    settings = dict(settings or {})
    max_model_len = settings.pop("max_model_len", 64)
    scheduler, manager, runner, tokenizer = toy_parts(**settings)
    engine = engine_class(scheduler, manager, runner, tokenizer, max_model_len)
    reqs = [
        Request(
            r["id"],
            list(r["prompt"]),
            SamplingParams(
                r["max_tokens"], r.get("stop"), r.get("stop_token_ids"), r.get("ignore_eos", False)
            ),
        )
        for r in requests
    ]
    outs = generate(engine, reqs, max_batch_size)
    return {
        "outputs": [{k: v for k, v in _plain(o).items() if not k.startswith("delta")} for o in outs],
        "forwards": runner.calls,
        "free_blocks": manager.num_free,
        "total_blocks": manager.num_total_blocks,
    }
