"""Hidden tests for Lab 4 (schedulers), part 2: the learner's Scheduler against nanolab's, event by event
on random workloads, its invariants on its own decisions, its speed, and its decisions inside nanolab's
engine on the bundled model.

Workloads are lists of events, ``("add", id, prompt_len, output_len, priority, arrival_time)``,
``("step",)`` and ``("abort", id)``, played around a scheduler by ``replay_schedule`` (the notebook's
copy in the sandbox, nanolab's here): one call runs a whole workload and brings back every step's
decisions as plain data. A notebook's setup cell can be edited, so its ``replay_schedule`` is not
trusted: after every replay the learner's Scheduler object itself is read back through its handle
(step count, preemptions, each live request's state, the free blocks) and compared with nanolab's
after the same events or, where the learner's decisions may differ from nanolab's, with the state its
own records imply; and one test drives the Scheduler through its handle alone. In the engine, the
models run here: a grader-side scheduler plays back the learner's recorded decisions (the engine's
requests get exactly the tokens, preemptions and block tables the learner's scheduler chose), and the
greedy outputs are compared with nanolab's. Feedback says what is wrong and on which input, never the
expected answer.
"""

from __future__ import annotations

import functools
import math
import os
import sysconfig

import pytest

import nanolab
from autograder.authoring.scheduling.compare import (
    check_generated_workloads,
    check_speed,
    compare_with_reference,
    request_state,
)
from autograder.authoring.scheduling.engine import compare_in_engine, drive, recorded_steps
from autograder.authoring.scheduling.replay import (
    POLICIES,
    Driver,
    describe,
    learner_replay,
    learner_scheduler,
    reference_scheduler,
    status_of,
)
from autograder.authoring.scheduling.workloads import (
    engine_events,
    random_config,
    random_workload,
    where,
    workload_with_a_readmission,
)
from autograder.testing import Remote, RemoteError, bundled_model, expect
from nanolab.engine.request import Request
from nanolab.model.sampling import SamplingParams

STDLIB_FILES = ("textwrap.py", "heapq.py", "bisect.py", "shlex.py", "fnmatch.py", "string.py")


# ---------------------------------------------------------------------------------------------- helpers


def check_driven(scheduler, allocator, events: list[tuple], records: list, cfg: dict, label: str) -> None:
    """The learner's Scheduler object counted the steps and the preemptions its records report, and, if
    the records finish every request, holds none and no block: what replay_schedule reported must be what
    this scheduler did (whatever it decided)."""
    where = f"{label}: after the workload, your Scheduler's own"
    steps = [r for e, r in zip(events, records) if e[0] == "step"]
    assert scheduler.step_count == len(steps), f"{where} step_count is not the number of schedule() calls"
    preempted = sum(len(r[2]) for r in steps if r[0] == "step" and len(r) == 4 and isinstance(r[2], list))
    assert scheduler.num_preemptions == preempted, (
        f"{where} num_preemptions is not the number of preemptions its steps reported"
    )
    timeline = Timeline(cfg)
    if timeline.play(events, records) is None and not timeline.live:
        queues = expect(scheduler.running, list, "Scheduler.running") + expect(
            scheduler.waiting, list, "Scheduler.waiting"
        )
        assert not queues, (
            f"{where} running or waiting list still holds requests, though all of them finished"
        )
        assert allocator.num_free == cfg["num_blocks"], (
            f"{label}: every request finished, yet some blocks are not free: finish, abort and preemption give a "
            "request's blocks back"
        )


# ---------------------------------------------------------------------------------------------- against the reference


@pytest.mark.points(3)
def test_scheduler_matches_the_reference_event_by_event_on_random_workloads(lab, rng):
    """Check Scheduler against nanolab's on random workloads (all policies, random seats, budgets, pools, block sizes, aborts, and one that ends with a readmitted request running): same batches, preemptions, block tables and errors at every event, and the same state after."""
    for trial in range(12):
        cfg = random_config(rng, POLICIES[trial % 3], seats_within_budget=trial % 4 != 3)
        events = random_workload(rng, cfg, rng.randint(20, 60), drain=False)
        label = f"on a random workload ({describe(cfg)})"
        compare_with_reference(lab, cfg, events, label)
    for policy in POLICIES:
        cfg, events = workload_with_a_readmission(rng, policy)
        compare_with_reference(lab, cfg, events, f"on a random workload with a readmission ({describe(cfg)})")


@pytest.mark.points(2)
def test_scheduler_agrees_with_the_reference_on_generated_workloads(lab, rng):
    """Check, on workloads generated by hypothesis (and shrunk to the smallest one that fails), that Scheduler makes nanolab's decisions at every event and ends with every block free."""
    check_generated_workloads(lab, rng, chunking=False)


class Timeline:
    """What a scheduler's own records say happened, event by event, checked against the rules every
    correct scheduler keeps (whatever order it admits in); at the end, the state its Scheduler object
    must be in if the records are its own."""

    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.live: dict[str, dict] = {}  # each live request: what the records say of it
        self.running: set[str] = set()  # running after the last step (and its finishes)
        self.steps = self.preemptions = self.admissions = 0

    def play(self, events: list[tuple], records: list) -> tuple[int, str] | None:
        """The first event at which the records break a rule, and what is wrong; None if they keep all."""
        for i, (event, record) in enumerate(zip(events, records)):
            problem = self._event(event, record)
            if problem is not None:
                return i, problem
        return None

    def _event(self, event: tuple, record: tuple) -> str | None:
        bs, nb = self.cfg["block_size"], self.cfg["num_blocks"]
        budget, seats = self.cfg["max_num_batched_tokens"], self.cfg["max_num_seqs"]
        live, running = self.live, self.running
        if event[0] == "add":
            _, rid, prompt, output, *_ = event
            never = prompt > budget or math.ceil(prompt / bs) > nb
            if record[0] == "ok" and never:
                return f"add accepted a request of {prompt} tokens, which can never run"
            if record[0] != "ok" and not never:
                return f"add refused a request of {prompt} tokens, which can run ({record[1]})"
            if record[0] == "ok":
                live[rid] = dict(tokens=prompt, output=output, outputs=0, computed=0, table=[], status="waiting",
                                 admitted_seq=None, num_preemptions=0, arrival_step=self.steps)  # fmt: skip
            return None
        if event[0] == "abort":
            if record[0] != "ok":
                return f"abort raised {record[1]}"
            live.pop(event[1], None)
            running.discard(event[1])
            return None
        if record[0] != "step" or len(record) != 4:
            return f"schedule raised {record[1] if record[0] == 'error' else 'something'}"
        self.steps += 1
        _, batch, preempted, tables = record
        if not isinstance(batch, dict) or not isinstance(preempted, list) or not isinstance(tables, dict):
            return "a step's record is malformed"
        unknown = [r for r in list(batch) + preempted if r not in live]
        if unknown:
            return f"your scheduler scheduled or preempted request {unknown[0]!r}, which had finished or was aborted"
        if sum(batch.values()) > budget:
            return (
                f"the step computes {sum(batch.values())} tokens, more than max_num_batched_tokens={budget}"
            )
        if len(set(preempted)) != len(preempted) or not set(preempted) <= running:
            return "your scheduler preempted a request that was not running (or preempted one twice)"
        starved = running - set(batch) - set(preempted)
        if starved:
            return (
                f"request {sorted(starved)[0]!r} was decoding and is neither scheduled nor preempted: running requests "
                "get their next token first, every step"
            )
        for rid in preempted:
            live[rid].update(computed=0, table=[], status="preempted")
            live[rid]["num_preemptions"] += 1
            self.preemptions += 1
        kept = running - set(preempted)
        if len(kept | set(batch)) > seats:
            return f"{len(kept | set(batch))} requests are running, more than max_num_seqs={seats}"
        owner: dict[int, str] = {}
        for rid, n in batch.items():
            state = live[rid]
            left = state["tokens"] - state["computed"]
            if n != left:
                return (
                    f"request {rid!r} was scheduled for {n} token(s) but has {left} to compute (a request admitted "
                    "after a preemption has nothing computed; a running one computes one token a step)"
                )
            table = tables.get(rid)
            if not isinstance(table, list) or any(type(b) is not int or not 0 <= b < nb for b in table):
                return f"request {rid!r}'s block table is not a list of block ids of the pool"
            if len(table) * bs < state["computed"] + n:
                return f"request {rid!r}'s block table is too short for its tokens"
            if rid in kept and table[: len(state["table"])] != state["table"]:
                return f"request {rid!r} lost or changed blocks it held while it ran"
            for b in table:
                if b in owner:
                    return f"block {b} is in the tables of two running requests ({owner[b]!r} and {rid!r}) at once"
                owner[b] = rid
            state["table"] = list(table)
            if rid not in kept:  # admitted in this step
                self.admissions += 1
                state.update(status="running", admitted_seq=self.admissions)
        self.running = set()
        for rid, n in batch.items():
            state = live[rid]
            state["computed"] += n
            if state["computed"] == state["tokens"]:
                state["tokens"] += 1
                state["outputs"] += 1
                if state["outputs"] >= state["output"]:
                    del live[rid]
                    continue
            self.running.add(rid)
        return None

    def held(self) -> int:
        """Blocks in the tables of the requests running after the last step."""
        return sum(len(self.live[rid]["table"]) for rid in self.running)

    def check(self, scheduler, allocator, label: str) -> None:
        """The learner's Scheduler object (read through its handle) in the state its records imply: what
        replay_schedule reported must be what this scheduler did."""
        where = f"{label}: after the workload, your Scheduler's own"
        assert scheduler.step_count == self.steps, f"{where} step_count is not the number of schedule() calls"
        assert scheduler.num_preemptions == self.preemptions, (
            f"{where} num_preemptions is not the number of preemptions its steps reported"
        )
        for queue in ("running", "waiting"):
            mine = {}
            for req in expect(getattr(scheduler, queue), list, f"Scheduler.{queue}"):
                expect(req, Remote, f"each request of Scheduler.{queue}")
                mine[req.request_id] = req
            want = sorted(self.running) if queue == "running" else sorted(set(self.live) - self.running)
            assert sorted(mine) == want, f"{where} {queue} list holds other requests than its steps imply"
            for rid, req in mine.items():
                state, model = request_state(req), self.live[rid]
                want_state = dict(
                    status=model["status"],
                    num_computed_tokens=model["computed"] if queue == "running" else 0,
                    block_table=model["table"] if queue == "running" else [],
                    admitted_seq=model["admitted_seq"],
                    num_preemptions=model["num_preemptions"],
                    arrival_step=model["arrival_step"],
                    outputs=model["outputs"],
                )
                wrong = [k for k in want_state if state[k] != want_state[k]]
                hint = " (a preempted request gives its blocks back)" if "block_table" in wrong else ""
                assert not wrong, (
                    f"{where} request {rid!r} ({queue}) has another {', '.join(wrong)} than its steps imply{hint}"
                )
        free, held = allocator.num_free, self.held()
        assert free + held == self.cfg["num_blocks"], (
            f"{label}: {self.cfg['num_blocks'] - free - held} block(s) are neither free nor in the table of a running "
            "request: finish, abort and preemption give a request's blocks back"
        )


@pytest.mark.points(2)
def test_scheduler_keeps_its_invariants_on_random_workloads(lab, rng):
    """Check the learner's own decisions on random workloads run to the end: budget and seats kept, decodes never starved, no block in two tables, every request finished and every block free at the end."""
    for trial in range(6):
        cfg = random_config(rng, POLICIES[trial % 3])
        events = random_workload(rng, cfg, rng.randint(15, 40), drain=True)
        label = f"on a random workload run to the end ({describe(cfg)})"
        records, scheduler, allocator = learner_replay(lab, cfg, events)
        timeline = Timeline(cfg)
        problem = timeline.play(events, records)
        if problem is not None:
            i, what = problem
            raise AssertionError(f"{label}, {where(events, i)}: {what}")
        timeline.check(scheduler, allocator, label)
        assert not timeline.live, (
            f"{label}: {len(timeline.live)} request(s) never finished in {timeline.steps} steps (nanolab's scheduler "
            "finishes them all in fewer)"
        )


def _batch(out, what: str) -> list[tuple]:
    expect(out, Remote, what)  # a SchedulerOutput
    scheduled = expect(out.scheduled, list, f"{what}.scheduled")
    pairs = []
    for item in scheduled:
        expect(item, tuple, f"each item of {what}.scheduled")
        assert len(item) == 2, (
            f"each item of {what}.scheduled should be a ScheduledRequest(request, num_new_tokens)"
        )
        expect(item[0], Remote, f"the request of a ScheduledRequest of {what}")
        pairs.append((item[0], item[1]))
    return pairs


def _compare_direct(lab, out, ref_out, what: str) -> None:
    mine = _batch(out, what)
    got = [(r.request_id, n) for r, n in mine]
    want = [(s.request.request_id, s.num_new_tokens) for s in ref_out.scheduled]
    assert got == want, f"{what} scheduled other requests, token counts or order than nanolab's"
    preempted = [r.request_id for r in expect(out.preempted, list, f"{what}.preempted")]
    assert preempted == [r.request_id for r in ref_out.preempted], (
        f"{what} preempted other requests than nanolab's"
    )
    for (req, _), s in zip(mine, ref_out.scheduled):
        state = request_state(req)
        assert state["status"] == "running", (
            f"{what}: scheduled request {s.request.request_id!r} is not RUNNING"
        )
        assert state["block_table"] == s.request.block_table, (
            f"{what}: scheduled request {s.request.request_id!r} holds other blocks than nanolab's"
        )
        assert state["admitted_seq"] == s.request.admitted_seq, (
            f"{what}: request {s.request.request_id!r} has another admitted_seq than nanolab's (1 for the "
            "scheduler's first admission, 2 for the next, ...)"
        )


@pytest.mark.points(2)
def test_scheduler_driven_directly_through_add_schedule_finish_abort(lab, rng):
    """Check Scheduler called directly (no replay): the first step's admissions, finish and abort giving blocks back, the next step's decodes and admissions."""
    for trial in range(3):
        seats = rng.randint(3, 5)
        cfg = dict(block_size=rng.choice([2, 4]), num_blocks=0, max_num_seqs=seats, max_num_batched_tokens=64,
                   scheduling_policy=POLICIES[trial], aging_steps=rng.choice([1, 3]))  # fmt: skip
        n = seats + rng.randint(2, 4)
        # at most seats - 2 one-token prompts: whichever requests fill the seats, two or more are longer
        ones = rng.randint(1, seats - 2)
        lengths = rng.sample([1] * ones + [rng.randint(2, 12) for _ in range(n - ones)], n)
        cfg["num_blocks"] = sum(math.ceil(p / cfg["block_size"]) for p in lengths) + rng.randint(2, 6)
        label = f"called directly ({describe(cfg)}, {n} requests of {lengths} tokens)"
        scheduler, allocator = learner_scheduler(lab, cfg)
        reference = reference_scheduler(cfg)
        mine, theirs = {}, {}
        for i, p in enumerate(lengths):
            priority = rng.randint(0, 2)
            rid = f"d{i}"
            mine[rid] = lab.Request(rid, [1] * p, priority=priority, arrival_time=float(i))
            theirs[rid] = Request(rid, [1] * p, SamplingParams(), priority=priority, arrival_time=float(i))
            scheduler.add(mine[rid])
            reference.add(theirs[rid])
        _compare_direct(lab, scheduler.schedule(), reference.schedule(), f"the first schedule() {label}")
        assert allocator.num_free == reference.block_manager.allocator.num_free, (
            f"{label}: after the first step, the number of free blocks differs from nanolab's"
        )
        # Finish or abort every running request longer than a token (the others still decode: without an
        # engine their one token stays uncomputed, which is a decode), and abort one waiting request.
        longer = [r.request_id for r in reference.running if r.num_prompt_tokens > 1]
        for k, rid in enumerate(longer):
            verb = ("finish", "abort")[k] if k < 2 else rng.choice(["finish", "abort"])
            getattr(scheduler, verb)(mine[rid])
            getattr(reference, verb)(theirs[rid])
            assert status_of(mine[rid].status) == "running", (
                f"{label}: Scheduler.{verb} changed the request's status (the engine moves it to FINISHED itself)"
            )
            assert allocator.num_free == reference.block_manager.allocator.num_free, (
                f"{label}: after Scheduler.{verb} of a running request, the number of free blocks differs from "
                f"nanolab's ({verb} gives the request's blocks back)"
            )
        if reference.waiting:
            rid = rng.choice(reference.waiting).request_id
            scheduler.abort(mine[rid])
            reference.abort(theirs[rid])
            assert allocator.num_free == reference.block_manager.allocator.num_free, (
                f"{label}: Scheduler.abort of a waiting request changed the number of free blocks"
            )
        for queue in ("running", "waiting"):
            got = sorted(r.request_id for r in expect(getattr(scheduler, queue), list, f"Scheduler.{queue}"))
            assert got == sorted(r.request_id for r in getattr(reference, queue)), (
                f"{label}: after finish and abort, Scheduler.{queue} holds other requests than nanolab's"
            )
        _compare_direct(lab, scheduler.schedule(), reference.schedule(), f"the second schedule() {label}")
        assert scheduler.step_count == 2, f"{label}: step_count should count the schedule() calls"


def test_add_refuses_requests_that_can_never_run(lab, rng):
    """Check that add raises ValueError naming the limit for a request over the token budget or the pool, counts prompt and output tokens, and accepts one exactly at both limits."""
    bs = rng.choice([2, 4, 8])
    nb = rng.randint(4, 12)
    budget = (nb - 1) * bs - rng.randint(0, bs - 1)  # a request one token over it still fits the pool
    cfg = dict(block_size=bs, num_blocks=nb, max_num_seqs=4, max_num_batched_tokens=budget,
               scheduling_policy="fcfs", aging_steps=4)  # fmt: skip
    scheduler, _ = learner_scheduler(lab, cfg)
    where = f"a scheduler with max_num_batched_tokens={budget} and {nb} blocks of {bs}"
    accepted = []
    for label, prompt, output in [
        (f"a request of exactly {budget} tokens", budget, 0),
        (f"a request of {budget + 1} tokens", budget + 1, 0),
        (f"a request of {budget - 2} prompt and 3 output tokens", budget - 2, 3),
    ]:
        req = lab.Request(f"x{len(accepted)}-{prompt}", [1] * prompt, output_token_ids=[5] * output)
        try:
            scheduler.add(req)
        except RemoteError as e:
            if prompt + output <= budget:
                raise AssertionError(f"{where}: add refused {label}, which can run ({e.type_name})") from None
            assert e.type_name == "ValueError", (
                f"{where}: add of {label} should raise ValueError, not {e.type_name}"
            )
            assert str(budget) in e.message, (
                f"{where}: the error for {label} should name the limit it is over"
            )
        else:
            assert prompt + output <= budget, (
                f"{where}: add accepted {label}, which can never run: refuse it at once with ValueError"
            )
            accepted.append(req)
    # The pool: a scheduler whose budget is larger than its pool.
    big = nb * bs + bs
    cfg = dict(cfg, max_num_batched_tokens=big)
    scheduler, _ = learner_scheduler(lab, cfg)
    where = f"a scheduler with max_num_batched_tokens={big} and {nb} blocks of {bs}"
    try:
        scheduler.add(lab.Request("fits", [1] * (nb * bs)))
    except RemoteError as e:
        raise AssertionError(
            f"{where}: add refused a request of {nb * bs} tokens, which fits the pool exactly ({e.type_name})"
        ) from None
    tokens = nb * bs + 1
    try:
        scheduler.add(lab.Request("too-big", [1] * tokens))
    except RemoteError as e:
        assert e.type_name == "ValueError", (
            f"{where}: add of a request of {tokens} tokens should raise ValueError"
        )
        assert str(nb) in e.message, (
            f"{where}: the error for a request needing more blocks than the pool has should name the pool's size"
        )
    else:
        raise AssertionError(
            f"{where}: add accepted a request of {tokens} tokens, which needs more blocks than the pool has"
        )
    waiting = [r.request_id for r in expect(scheduler.waiting, list, "Scheduler.waiting")]
    assert waiting == ["fits"], f"{where}: a refused request must not be queued"


# ---------------------------------------------------------------------------------------------- starvation


def _first_scheduled(records: list, events: list[tuple], rid: str) -> int | None:
    step = 0
    for event, record in zip(events, records):
        if event[0] != "step":
            continue
        step += 1
        if record[0] == "step" and isinstance(record[1], dict) and rid in record[1]:
            return step
    return None


@pytest.mark.points(1)
def test_aging_bounds_the_wait_of_a_low_priority_request(lab, rng):
    """Check that under a constant stream of priority-0 arrivals (more than the seats serve), a request of priority p is admitted no later than nanolab admits it.

    A request of priority p that arrived at step a outranks, from then on, every request that arrives at
    step a + p * aging_steps or later (both age, and equal levels go to the earlier arrival). So it waits
    at most p * aging_steps steps, plus the time to serve the Q requests still waiting at that step, which
    2 seats serve at 2 per ``output_len`` steps: bound = p * aging_steps + ceil(Q / 2) * output_len +
    output_len. The test computes the bound from nanolab's run and checks that nanolab keeps it (it
    reaches it exactly on some seeds); with these settings nanolab admits the request 20 to 70 steps after
    it arrived. Plain priority would make it wait for as long as the stream lasts.
    """
    for _ in range(2):
        aging = rng.randint(3, 6)
        p = rng.randint(2, 3)
        output = rng.randint(3, 4)
        seats = 2
        cfg = dict(block_size=4, num_blocks=4096, max_num_seqs=seats, max_num_batched_tokens=64,
                   scheduling_policy="priority", aging_steps=aging)  # fmt: skip
        arrive = rng.randint(2, 5)
        events: list[tuple] = []
        driver = Driver(cfg)
        admitted_at = ahead = None
        step = count = 0
        while step < 400:
            if step == arrive:
                events.append(("add", "old", rng.randint(2, 8), output, p, float(len(events))))
                driver.play(events[-1])
            if step == arrive + p * aging:  # from here on, newcomers rank behind it
                ahead = len(driver.in_state("waiting")) - 1
            for _ in range(2):
                events.append(("add", f"s{count}", rng.randint(2, 8), output, 0, float(len(events))))
                count += 1
                driver.play(events[-1])
            events.append(("step",))
            driver.play(("step",))
            step += 1
            if admitted_at is None and step > arrive and "old" not in driver.in_state("waiting"):
                admitted_at = step
            if admitted_at is not None and step >= 2 * admitted_at + 10:
                break
        waited = None if admitted_at is None else admitted_at - arrive
        bound = p * aging + (-(-(ahead or 0) // seats) + 1) * output
        assert waited is not None and waited <= bound, (
            "nanolab's scheduler did not keep the aging bound (a grader problem, not yours)"
        )
        label = (
            f"a request of priority {p} arriving at step {arrive} into a stream of two priority-0 requests a step "
            f"({seats} seats, {output} tokens each, aging_steps={aging})"
        )
        records, scheduler, allocator = learner_replay(lab, cfg, events)
        mine = _first_scheduled(records, events, "old")
        assert mine is not None, (
            f"{label}: your scheduler never admitted it in {step} steps: aging should bound its wait"
        )
        assert mine <= admitted_at, (
            f"{label}: your scheduler admitted it {mine - arrive} steps after its arrival; aging should have it "
            f"admitted within {waited} (a request moves up one level for every aging_steps it waits, counted from "
            "its arrival_step)"
        )
        check_driven(scheduler, allocator, events, records, cfg, label)


# ---------------------------------------------------------------------------------------------- speed


@pytest.mark.points(1)
def test_schedule_speed_is_within_budget(lab, rng):
    """Check that 50 steps with 256 running requests (then decoding) take at most 20x the CPU time of nanolab's scheduler, + 0.5 s.

    nanolab's scheduler runs in the notebook's replay here; the learner's is driven from the grader, the
    whole workload in one message (`driven_calls`), and its state read back, inside the timed window. Each
    side is timed by its own CPU time (the reference's thread here, the learner's processes as the grader
    reads them), so a busy machine does not move the budget. Reference figures on a 2-core machine:
    nanolab's scheduler and replay take 0.02 to 0.05 s, so the budget is 0.95 to 1.6 s; the solution about
    0.45 s, most of it the some 60,000 calls and the reads. A scheduler that re-sorts the running list for
    every request (0.3 s more) or scans the step's batch for every request (0.15 s more) passes; one that
    looks for a victim for every request whether or not it needs one (cubic in the running requests) takes
    more than 7 s and fails.
    """
    n = 256
    cfg = dict(block_size=16, num_blocks=4 * n, max_num_seqs=n, max_num_batched_tokens=8 * n,
               scheduling_policy=rng.choice(POLICIES), aging_steps=4)  # fmt: skip
    events = [("add", f"r{i}", rng.randint(1, 8), 60, rng.randint(0, 2), float(i)) for i in range(n)]
    events += [("step",)] * 50
    check_speed(lab, cfg, events, f"50 steps with {n} running requests")


# ---------------------------------------------------------------------------------------------- in the engine


@functools.cache
def _stdlib_text() -> str:
    root = sysconfig.get_paths()["stdlib"]
    return "".join(open(os.path.join(root, name), encoding="utf-8").read() for name in STDLIB_FILES)


pytestmark = pytest.mark.usefixtures("torch_on_one_thread")


def _engine_workload(rng, tokenizer) -> tuple[dict, dict, list[tuple]]:
    """Prompts cut from real text, arriving over the first steps, on a pool small enough that nanolab's
    scheduler preempts; then steps for twice as long as nanolab needs to finish them all."""
    text = _stdlib_text()
    for _ in range(50):
        bs = rng.choice([2, 4])
        prompts: dict[str, list[int]] = {}
        for i in range(rng.randint(7, 9)):
            start = rng.randrange(len(text) - 400)
            prompts[f"e{i}"] = tokenizer.encode(text[start : start + 400])[: rng.randint(3, 20)]
        outputs = {rid: rng.randint(6, 20) for rid in prompts}
        longest = max(len(p) + outputs[rid] for rid, p in prompts.items())
        cfg = dict(block_size=bs, num_blocks=math.ceil(longest / bs) + rng.randint(2, 8), max_num_seqs=rng.randint(3, 6),
                   max_num_batched_tokens=64, scheduling_policy=rng.choice(POLICIES), aging_steps=rng.randint(2, 6))  # fmt: skip
        events, driver = engine_events(rng, cfg, prompts, outputs)
        if driver.scheduler.num_preemptions > 0:
            return cfg, prompts, events
    raise AssertionError("the grader could not make a workload that preempts (a grader problem, not yours)")


@pytest.mark.points(3)
def test_your_schedulers_decisions_give_the_reference_outputs_in_the_engine(lab, rng):
    """Check that nanolab's engine, running your scheduler's decisions (batches, preemptions, block tables) on the bundled model, gives nanolab's greedy outputs through preemptions."""
    model, tokenizer = bundled_model()
    ties = 0
    for _ in range(2):
        cfg, prompts, events = _engine_workload(rng, tokenizer)
        label = f"with your scheduler's decisions ({describe(cfg)}, {len(prompts)} requests, preempting)"
        records, steps, scheduler, allocator = recorded_steps(lab, cfg, events, label)
        check_driven(scheduler, allocator, events, records, cfg, label)
        settings = {k: cfg[k] for k in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
                                         "scheduling_policy", "aging_steps")}  # fmt: skip
        settings.update(enable_chunked_prefill=False, enable_prefix_caching=False)
        want = drive(nanolab.LLM(model, tokenizer, **settings), events, prompts)
        ties = compare_in_engine(
            model, tokenizer, steps, events, prompts, want, settings, label, "nanolab", ties
        )
    print(f"near-ties of the top two logits accepted: {ties}")
