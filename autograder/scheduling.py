"""What the hidden tests of the scheduler labs (4 and 5) share: a learner's Scheduler against nanolab's.

Workloads are lists of events, ``("add", id, prompt_len, output_len, priority, arrival_time)``,
``("step",)`` and ``("abort", id)``, played around a scheduler by ``replay_schedule`` (the notebook's
copy in the sandbox, nanolab's here): one call runs a whole workload and brings back every step's
decisions as plain data, compared event by event. A notebook's setup cell can be edited, so its
``replay_schedule`` is not trusted: after a replay the learner's Scheduler object itself is read back
through its handle and compared with nanolab's (`check_state`). In the engine, a grader-side scheduler
plays back the learner's recorded decisions (`RecordedScheduler`), so the models run here.

A settings dict (``cfg``) has ``block_size``, ``num_blocks``, ``max_num_seqs``,
``max_num_batched_tokens``, ``scheduling_policy``, ``aging_steps`` and, for Lab 5, ``chunked``
(``enable_chunked_prefill``; Lab 4's settings have no such key and its notebook no such choice).
"""

from __future__ import annotations

import functools
import math
import random
import time

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

import nanolab
from autograder.testing import Remote, expect
from nanolab import PyBlockAllocator
from nanolab.engine.config import EngineConfig
from nanolab.engine.engine import EngineStepError
from nanolab.engine.request import Request, RequestStatus, admit, preempt
from nanolab.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput, replay_schedule
from nanolab.memory.block_manager import BlockManager
from nanolab.model.sampling import SamplingParams

POLICIES = ("fcfs", "shortest", "priority")
TIE_GAP = 1e-4  # a greedy choice closer than this may go either way with a different batch


def status_of(value) -> str:
    """A status read from the sandbox (an enum member crosses as its value: "running")."""
    return "None" if value is None else str(value)


def describe(cfg: dict) -> str:
    return (
        f"policy {cfg['scheduling_policy']!r}"
        + (f" (aging_steps={cfg['aging_steps']})" if cfg["scheduling_policy"] == "priority" else "")
        + f", max_num_seqs={cfg['max_num_seqs']}, max_num_batched_tokens={cfg['max_num_batched_tokens']}, "
        f"{cfg['num_blocks']} blocks of {cfg['block_size']}"
        + ("" if "chunked" not in cfg else f", chunked prefill {'on' if cfg['chunked'] else 'off'}")
    )


def reference_scheduler(cfg: dict) -> Scheduler:
    """nanolab's scheduler with ``cfg``'s settings: chunked prefill only if ``cfg["chunked"]`` (Lab 5; Lab 4
    has none), no prefix cache."""
    config = EngineConfig(
        block_size=cfg["block_size"],
        num_blocks=cfg["num_blocks"],
        max_num_seqs=cfg["max_num_seqs"],
        max_num_batched_tokens=cfg["max_num_batched_tokens"],
        max_model_len=4096,
        enable_chunked_prefill=cfg.get("chunked", False),
        enable_prefix_caching=False,
        scheduling_policy=cfg["scheduling_policy"],
        aging_steps=cfg["aging_steps"],
    )
    return Scheduler(config, BlockManager(PyBlockAllocator(cfg["num_blocks"]), cfg["block_size"]))


def learner_scheduler(lab, cfg: dict):
    """The learner's Scheduler on the notebook's block manager; returns it and its allocator (handles)."""
    allocator = lab.BlockAllocator(cfg["num_blocks"])
    config = lab.SchedulerConfig(
        max_num_seqs=cfg["max_num_seqs"],
        max_num_batched_tokens=cfg["max_num_batched_tokens"],
        scheduling_policy=cfg["scheduling_policy"],
        aging_steps=cfg["aging_steps"],
        **({"enable_chunked_prefill": cfg["chunked"]} if "chunked" in cfg else {}),
    )
    return lab.Scheduler(config, lab.BlockManager(allocator, cfg["block_size"])), allocator


def learner_replay(lab, cfg: dict, events: list[tuple]) -> tuple[list, Remote, Remote]:
    """The learner's Scheduler through the notebook's replay_schedule: the records, and the scheduler
    and its allocator (handles) to check afterwards."""
    scheduler, allocator = learner_scheduler(lab, cfg)
    records = expect(lab.replay_schedule(scheduler, events), list, "replay_schedule(Scheduler(...), events)")
    assert len(records) == len(events), "replay_schedule should return one record per event"
    for record in records:
        expect(record, tuple, "each record of replay_schedule(...)")
    return records, scheduler, allocator


def reference_replay(cfg: dict, events: list[tuple]) -> tuple[list, Scheduler]:
    scheduler = reference_scheduler(cfg)
    return replay_schedule(scheduler, events), scheduler


def comparable(record: tuple) -> tuple:
    """A record with the order of the batch and of the tables kept (dicts compare without it), and an
    error's message left out (only its type counts)."""
    if record[:1] == ("error",):
        return tuple(record[:2])
    if (
        record[:1] == ("step",)
        and len(record) == 4
        and isinstance(record[1], dict)
        and isinstance(record[3], dict)
    ):
        return ("step", list(record[1].items()), record[2], list(record[3].items()))
    return tuple(record)


class Driver:
    """nanolab's replay_schedule one event at a time, to build workloads around what the reference does
    (abort a request while it is waiting, running or preempted)."""

    def __init__(self, cfg: dict) -> None:
        self.scheduler = reference_scheduler(cfg)
        self.live: dict[str, tuple] = {}
        self.steps = 0

    def play(self, event: tuple) -> None:
        if event[0] == "add":
            rid, prompt_len, output_len, priority, arrival = event[1:]
            req = Request(rid, [1] * prompt_len, SamplingParams(), priority=priority, arrival_time=arrival)
            try:
                self.scheduler.add(req)
            except ValueError:
                return
            self.live[rid] = (req, output_len)
        elif event[0] == "abort":
            req, _ = self.live.pop(event[1])
            self.scheduler.abort(req)
            req.status = RequestStatus.FINISHED
        else:
            self.steps += 1
            out = self.scheduler.schedule()
            for req, n in out.scheduled:
                req.num_computed_tokens += n
                if req.num_computed_tokens == req.num_tokens:
                    req.output_token_ids.append(0)
                    if len(req.output_token_ids) >= self.live[req.request_id][1]:
                        self.scheduler.finish(req)
                        req.status = RequestStatus.FINISHED
                        del self.live[req.request_id]

    def in_state(self, state: str) -> list[str]:
        return [rid for rid, (req, _) in self.live.items() if req.status == state]


def random_config(
    rng, policy: str | None = None, seats_within_budget: bool = True, chunked: bool | None = None
) -> dict:
    """Settings for a random workload: small pools (preemptions), budgets from a few prompts' worth down to
    fewer tokens than seats (``seats_within_budget=False``: decodes alone can use up the budget).
    ``chunked``: a setting of its own (True/False, Lab 5), under which prompts may be longer than the
    budget; None (Lab 4): no such setting, every prompt fits in one step."""
    block_size = rng.choice([1, 2, 4, 4, 8, 16])
    budget = rng.choice([8, 16, 24, 32, 48, 64])
    seats = rng.randint(1, 8)
    if not seats_within_budget:
        budget = rng.randint(3, 5)
        seats = rng.randint(budget + 1, 8)
    if chunked:
        longest = rng.choice([6, 12, 20, 30, 60, 100])
    else:
        longest = min(budget, rng.choice([6, 12, 20, 30]))
    num_blocks = max(2, math.ceil(rng.uniform(1.2, 4.0) * (longest + 8) / block_size))
    extra = {} if chunked is None else {"chunked": chunked}
    return dict(
        **extra,
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=seats,
        max_num_batched_tokens=budget,
        scheduling_policy=policy or rng.choice(POLICIES),
        aging_steps=rng.choice([1, 2, 3, 5, 8]),
        longest=longest,
    )


def random_workload(
    rng, cfg: dict, steps: int, drain: bool, aborts: bool = True, invalid: bool = True
) -> list[tuple]:
    """Events over ``steps`` steps: bursts and lulls of arrivals (a few that can never run), aborts of
    requests in every live state; with ``drain``, steps until nanolab's scheduler has finished them all."""
    driver = Driver(cfg)
    capacity = cfg["num_blocks"] * cfg["block_size"]
    events: list[tuple] = []
    count = 0
    for _ in range(steps):
        for _ in range(rng.choice([0, 0, 0, 1, 1, 2, 3])):
            prompt = rng.choice(
                [1, rng.randint(1, cfg["longest"]), rng.randint(1, cfg["longest"]), cfg["longest"]]
            )
            if invalid and rng.random() < 0.04:
                prompt = rng.choice([cfg["max_num_batched_tokens"] + 1, capacity + 1])
            # A request alone always fits, and so does its recompute after a preemption (prompt and output
            # but the last token), in the pool and (without chunked prefill) in one step's budget: otherwise
            # it could never come back.
            fits = capacity if cfg.get("chunked") else min(capacity, cfg["max_num_batched_tokens"])
            room = fits - prompt + 1
            output = rng.randint(1, max(1, min(20, room)))
            event = ("add", f"r{count}", prompt, output, rng.randint(0, 3), float(len(events)))
            count += 1
            events.append(event)
            driver.play(event)
        if aborts and driver.live and rng.random() < 0.12:
            state = rng.choice(["waiting", "running", "preempted"])
            pool = driver.in_state(state) or list(driver.live)
            event = ("abort", rng.choice(pool))
            events.append(event)
            driver.play(event)
        events.append(("step",))
        driver.play(("step",))
    if drain:
        for _ in range(3000):
            if not driver.live:
                break
            events.append(("step",))
            driver.play(("step",))
        assert not driver.live, "nanolab's scheduler did not finish a workload (a grader problem, not yours)"
        events.append(("step",))
    return events


def workload_with_a_readmission(rng, policy: str, chunked: bool | None = None) -> tuple[dict, list[tuple]]:
    """A random workload (not drained) at whose end a request that was preempted and admitted again is still
    running, so its state after the readmission (``admitted_seq``, the blocks it got back) is read back from
    the learner's scheduler whatever the later decisions are."""
    for _ in range(500):
        cfg = random_config(rng, policy, chunked=chunked)
        events = random_workload(rng, cfg, rng.randint(20, 60), drain=False)
        driver = Driver(cfg)
        for event in events:
            driver.play(event)
        if any(
            req.num_preemptions and req.status == RequestStatus.RUNNING for req, _ in driver.live.values()
        ):
            return cfg, events
    raise AssertionError(
        "the grader could not make a workload with a readmission (a grader problem, not yours)"
    )


def where(events: list[tuple], i: int) -> str:
    step = sum(1 for e in events[: i + 1] if e[0] == "step")
    kind = events[i][0]
    if kind == "step":
        return f"at step {step}"
    return f"at the {kind} of request {events[i][1]!r} (after step {step})"


def first_difference(
    mine: list, theirs: list, events: list[tuple], chunked: bool = False
) -> tuple[int, str] | None:
    for i, (a, b) in enumerate(zip(mine, theirs)):
        a, b = comparable(a), comparable(b)
        if a == b:
            continue
        kind = events[i][0]
        if a[0] == "error" or b[0] == "error":
            if kind == "add":
                if b[0] == "error":
                    return (
                        i,
                        f"add should refuse a request that can never run ({events[i][2]} tokens) with ValueError",
                    )
                return i, f"add refused a request of {events[i][2]} tokens that can run (it raised {a[1]})"
            if a[0] == "error":
                return i, f"{'schedule' if kind == 'step' else kind} raised {a[1]}"
            return i, f"{kind} answered differently"
        if kind != "step" or len(a) != 4:
            return i, f"{kind} answered differently"
        batch_a, batch_b = a[1], b[1]
        if a[2] != b[2]:
            return i, "your scheduler preempted other requests (or in another order) than nanolab's"
        if batch_a != batch_b:
            if sorted(batch_a) == sorted(batch_b):
                order = (
                    "decodes first, then prompts in progress (most important first in each), then admissions in "
                    "waiting_order"
                    if chunked
                    else "running requests first (most important first), then admissions in waiting_order"
                )
                return i, f"your batch has the right requests and token counts in another order: {order}"
            if batch_a[: len(batch_b)] == batch_b:
                return i, (
                    "your scheduler put more into this step than nanolab's: check the token budget, the seats "
                    "(max_num_seqs) and the blocks, and that admission stops at the first request that does not fit"
                )
            if batch_b[: len(batch_a)] == batch_a:
                return i, "your scheduler put less into this step than nanolab's"
            return i, "your scheduler scheduled other requests or token counts than nanolab's"
        return i, "your scheduler gave the scheduled requests other block tables than nanolab's"
    return None


def compare_with_reference(lab, cfg: dict, events: list[tuple], label: str) -> None:
    """The learner's replay against nanolab's, event by event, then the state both schedulers end in.

    A decision that differs often comes from state that went wrong earlier without showing in the
    records (a request readmitted with its old admitted_seq only changes who is picked later): at the
    first difference, the two schedulers are replayed up to the event before it and their states
    compared, so the feedback names the field that is wrong rather than the decision it led to."""
    mine, scheduler, allocator = learner_replay(lab, cfg, events)
    theirs, reference = reference_replay(cfg, events)
    diff = first_difference(mine, theirs, events, cfg.get("chunked", False))
    if diff is not None:
        i, what = diff
        if i > 0:
            _, before, before_allocator = learner_replay(lab, cfg, events[:i])
            _, before_reference = reference_replay(cfg, events[:i])
            check_state(
                before,
                before_allocator,
                before_reference,
                label,
                f"just before the first decision that differs ({where(events, i)})",
            )
        raise AssertionError(f"{label}, {where(events, i)}: {what}")
    check_state(scheduler, allocator, reference, label)


STATE_FIELDS = (
    "status",
    "num_computed_tokens",
    "block_table",
    "admitted_seq",
    "num_preemptions",
    "arrival_step",
)


def request_state(req) -> dict:
    got = {name: getattr(req, name) for name in STATE_FIELDS}
    got["status"] = status_of(got["status"])
    got["outputs"] = len(expect(req.output_token_ids, list, "output_token_ids"))
    return got


def check_state(
    scheduler, allocator, reference: Scheduler, label: str, when: str = "after the workload"
) -> None:
    """The learner's Scheduler object (read through its handle) against nanolab's after the same events:
    what replay_schedule reported must be what the scheduler did."""
    where = f"{label}: {when}, your Scheduler's own"
    for name in ("step_count", "num_preemptions"):
        got = getattr(scheduler, name)
        assert got == getattr(reference, name), (
            f"{where} {name} differs from nanolab's (it should count the schedule calls and the preemptions)"
        )
    for queue in ("running", "waiting"):
        got = expect(getattr(scheduler, queue), list, f"Scheduler.{queue}")
        theirs = {r.request_id: r for r in getattr(reference, queue)}
        mine = {}
        for req in got:
            expect(req, Remote, f"each request of Scheduler.{queue}")
            mine[req.request_id] = req
        assert sorted(mine) == sorted(theirs), f"{where} {queue} list holds other requests than nanolab's"
        for rid, req in mine.items():
            want = theirs[rid]
            state = request_state(req)
            ref = dict(
                status=want.status.value,
                num_computed_tokens=want.num_computed_tokens,
                block_table=want.block_table,
                admitted_seq=want.admitted_seq,
                num_preemptions=want.num_preemptions,
                arrival_step=want.arrival_step,
                outputs=len(want.output_token_ids),
            )
            wrong = [k for k in ref if state[k] != ref[k]]
            assert not wrong, (
                f"{where} request {rid!r} ({queue}) has another {', '.join(wrong)} than nanolab's"
            )
    assert allocator.num_free == reference.block_manager.allocator.num_free, (
        f"{where} block allocator has another number of free blocks than nanolab's"
    )


# ---------------------------------------------------------------------------------------------- in the engine


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


def check_speed(lab, cfg: dict, events: list[tuple], what: str) -> None:
    """The learner's replay of ``events`` is nanolab's, and takes at most 20x the CPU time of nanolab's
    scheduler (the best of 3 runs) + 0.5 s. Each side is timed by its own CPU time (the reference's thread
    here, the learner's processes as the grader reads them), so a busy machine does not move the budget.
    ``what`` says what the workload is, for the message."""
    learner_replay(
        lab, dict(cfg, num_blocks=8, max_num_seqs=2), events[:2] + [("step",)]
    )  # fail fast if missing
    timings = []
    for _ in range(3):
        start = time.thread_time()
        want, reference = reference_replay(cfg, events)
        timings.append(time.thread_time() - start)
    budget = 20 * min(timings) + 0.5
    scheduler, allocator = learner_scheduler(lab, cfg)
    with lab.time_limit(2 * budget + 5.0):
        before = lab.cpu_seconds()
        got = expect(lab.replay_schedule(scheduler, events), list, "replay_schedule(...)")
        elapsed = lab.cpu_seconds() - before
    diff = first_difference(got, want, events, cfg.get("chunked", False))
    if diff is not None:
        raise AssertionError(
            f"only a correct result counts: on this workload, {where(events, diff[0])}: {diff[1]}"
        )
    check_state(scheduler, allocator, reference, "on the speed workload")
    assert elapsed <= budget, (
        f"{what} took {elapsed:.2f} s of CPU time; the budget is {budget:.2f} s (20x nanolab's scheduler + "
        "0.5 s): a step should do a few operations per running request, not work that grows with their number "
        "for each of them"
    )


def check_generated_workloads(lab, rng, chunking: bool) -> None:
    """On 20 workloads generated by hypothesis (and shrunk to the smallest one that fails), the learner's
    Scheduler makes nanolab's decisions at every event and ends in nanolab's state. ``chunking``: Lab 5's
    settings, chunked prefill on or off (drawn); otherwise Lab 4's, which have no such setting."""

    @hypothesis_seed(rng.randrange(2**32))
    @settings(
        max_examples=20,
        deadline=None,
        database=None,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(
        st.integers(0, 2**32 - 1), st.integers(1, 30), st.sampled_from(POLICIES), st.booleans(), st.booleans()
    )
    def check(seed, steps, policy, tight, chunked):
        draw = random.Random(seed)
        cfg = random_config(
            draw, policy, seats_within_budget=not tight, chunked=chunked if chunking else None
        )
        events = random_workload(draw, cfg, steps, drain=True)
        compare_with_reference(
            lab, cfg, events, f"on a generated workload of {steps} steps of arrivals ({describe(cfg)})"
        )

    check()


def engine_events(
    rng, cfg: dict, prompts: dict[str, list[int]], outputs: dict[str, int]
) -> tuple[list[tuple], Driver]:
    """The prompts arriving over the first steps (greedy, ``outputs[rid]`` tokens each), then steps for twice
    as long as nanolab's scheduler needs to finish them all; and the `Driver` that ran them with nanolab's."""
    events: list[tuple] = []
    driver = Driver(cfg)
    for rid in prompts:
        events.append(("add", rid, len(prompts[rid]), outputs[rid], rng.randint(0, 2), float(len(events))))
        events += [("step",)] * rng.choice([0, 0, 1, 2])
    for event in events:
        driver.play(event)
    while driver.live:
        driver.play(("step",))
    events += [("step",)] * (2 * driver.steps - sum(e[0] == "step" for e in events) + 20)
    return events, driver


def recorded_steps(lab, cfg: dict, events: list[tuple], label: str) -> tuple[list, list, Remote, Remote]:
    """The learner's replay of an engine workload, which must neither fail a step nor refuse a request that
    can run: its records, its step records, and its scheduler and allocator (handles)."""
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
