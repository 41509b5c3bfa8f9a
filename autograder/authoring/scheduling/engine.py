"""The learner's decisions inside nanolab's engine: a grader-side scheduler that plays back what the
learner's scheduler recorded, so the model runs here, and greedy outputs compared with the near-tie rule.
"""

from __future__ import annotations

import functools

import torch

import nanolab
from autograder.authoring.scheduling.replay import learner_replay
from autograder.authoring.scheduling.workloads import where
from autograder.authoring.testing import Remote
from nanolab.engine.config import EngineConfig
from nanolab.engine.core import EngineStepError
from nanolab.engine.request import RequestStatus, admit, preempt
from nanolab.engine.scheduler import ScheduledRequest, SchedulerOutput
from nanolab.model.sampling import SamplingParams

TIE_GAP = 1e-4  # a greedy choice closer than this may go either way with a different batch


class RecordedScheduler:
    """nanolab's engine's scheduler that plays back the learner's recorded decisions, step by step.

    Each step, the requests the learner's scheduler preempted are preempted (nanolab's `preempt`: back
    to nothing computed), and those it scheduled are admitted if they were not running, given the block
    table it gave them, and computed for the token count it chose. Anything an engine could not run is a
    failure that says what the scheduler did.
    """

    def __init__(self, steps: list[tuple], config: EngineConfig, block_manager) -> None:
        self.steps = list(steps)
        self.config = config
        self.block_manager = block_manager
        self.waiting: list = []
        self.running: list = []
        self.by_id: dict = {}
        self.num_preemptions = 0
        self.step = 0

    def add(self, req) -> None:
        self.by_id[req.request_id] = req
        self.waiting.append(req)

    def finish(self, req) -> None:
        self.running.remove(req)
        req.block_table = []

    def abort(self, req) -> None:
        for queue in (self.running, self.waiting):
            if req in queue:
                queue.remove(req)
        req.block_table = []

    def schedule(self) -> SchedulerOutput:
        self.step += 1
        where = f"at step {self.step}"
        assert self.step <= len(self.steps), f"{where}: the engine ran more steps than were recorded"
        record = self.steps[self.step - 1]
        _, batch, preempted, tables = record
        out = SchedulerOutput()
        for rid in preempted:
            req = self.by_id.get(rid)
            assert req is not None and req in self.running, (
                f"{where} your scheduler preempted {rid!r}, which was not running"
            )
            self.running.remove(req)
            req.block_table = []
            preempt(req)
            self.num_preemptions += 1
            self.waiting.append(req)
            out.preempted.append(req)
        bs, nb = self.config.block_size, self.config.num_blocks
        for rid, n in batch.items():
            req = self.by_id.get(rid)
            assert req is not None and not req.is_finished, (
                f"{where} your scheduler scheduled {rid!r}, which had finished"
            )
            if req.status != RequestStatus.RUNNING:
                admit(req)
                self.waiting.remove(req)
                self.running.append(req)
            table = tables.get(rid)
            done = req.num_computed_tokens
            assert type(n) is int and 1 <= n <= req.num_tokens - done, (
                f"{where} your scheduler scheduled {n} token(s) of request {rid!r}, which has "
                f"{req.num_tokens - done} left to compute"
            )
            assert isinstance(table, list) and all(type(b) is int and 0 <= b < nb for b in table), (
                f"{where} request {rid!r}'s block table is not a list of block ids of the pool"
            )
            assert len(table) * bs >= done + n, (
                f"{where} request {rid!r}'s block table is too short for its tokens"
            )
            req.block_table = list(table)
            out.scheduled.append(ScheduledRequest(req, n))
        return out


def drive(llm, events: list[tuple], prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Play the events on an engine; every request's generated token ids."""
    engine = llm.engine
    requests = {}
    step = 0
    for event in events:
        if event[0] == "add":
            _, rid, _, output, priority, _ = event
            params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
            requests[rid] = engine.add_request(prompts[rid], params, request_id=rid, priority=priority)
        elif event[0] == "abort":
            engine.abort(event[1])
        else:
            step += 1
            try:
                engine.step(finished_only=True)
            except EngineStepError as e:  # the recorded decisions could not run
                cause = e.__cause__
                if isinstance(cause, AssertionError):
                    raise cause from None
                raise AssertionError(
                    f"at step {step} the engine could not run your scheduler's decisions: it scheduled nothing "
                    "although requests were waiting and none was running"
                    if isinstance(cause, RuntimeError) and "admitted nothing" in str(cause)
                    else f"at step {step} the engine could not run your scheduler's decisions ({type(cause).__name__})"
                ) from None
    assert not engine.has_unfinished(), (
        f"some requests had not finished after {sum(e[0] == 'step' for e in events)} steps"
    )
    return {rid: list(req.output_token_ids) for rid, req in requests.items()}


@torch.inference_mode()
def tie_at(model, prompt: list[int], want: list[int], got: list[int]) -> bool | None:
    """None if equal; True if they first differ where the reference's top two logits are a near tie."""
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            top = model.logits(torch.tensor([prompt + want[:i]]))[0, -1].topk(2).values
            return float(top[0] - top[1]) < TIE_GAP
    return None if len(want) == len(got) else False


def recorded_steps(lab, cfg: dict, events: list[tuple], label: str) -> tuple[list, list, Remote, Remote]:
    """The learner's Scheduler on an engine workload, driven from here through its handle (`learner_replay`),
    which must neither fail a step nor refuse a request that can run: its records, its step records, and its
    scheduler and allocator (handles)."""
    records, scheduler, allocator = learner_replay(lab, cfg, events)
    for i, record in enumerate(records):
        if events[i][0] == "step" and record[0] != "step":
            raise AssertionError(f"{label}, {where(events, i)}: schedule raised {record[1]}")
        if events[i][0] == "add" and record[0] != "ok":
            raise AssertionError(
                f"{label}: add refused request {events[i][1]!r}, which can run (it raised {record[1]})"
            )
    return records, [r for e, r in zip(events, records) if e[0] == "step"], scheduler, allocator


def compare_in_engine(model, tokenizer, steps: list, events: list[tuple], prompts: dict, want: dict, settings: dict,
                      label: str, reference: str, ties: int) -> int:  # fmt: skip
    """nanolab's engine playing back the learner's step records (`RecordedScheduler`) must give the greedy
    outputs ``want`` (what ``reference`` gave), but where the reference's top two logits are a near tie.
    Returns ``ties`` plus the near ties accepted."""
    learners = nanolab.LLM(
        model, tokenizer, scheduler=functools.partial(RecordedScheduler, steps), **settings
    )
    try:
        got = drive(learners, events, prompts)
    except AssertionError as e:
        raise AssertionError(f"{label}: {e}") from None
    for rid, prompt in prompts.items():
        tie = tie_at(model, prompt, want[rid], got[rid])
        if tie is None:
            continue
        assert tie, (
            f"{label}, the engine continued request {rid!r} ({len(prompt)}-token prompt) differently from {reference}: "
            "its tokens were computed from the wrong keys and values (a block in the tables of two running requests, "
            "a running request's blocks changed, or a chunk that does not start where the last one ended) "
            f"({ties} near-tie(s) of the top two logits accepted so far)"
        )
        ties += 1
    return ties
