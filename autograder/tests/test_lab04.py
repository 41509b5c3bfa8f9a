"""Hidden tests for Lab 4 (schedulers), part 1: the request state machine, the batching simulator, the
waiting-queue policies and the choice of a preemption victim, against nanolab's reference
(`nanolab.engine.request`, `nanolab.engine.batching`, `nanolab.engine.scheduler`).

Each test reaches the learner's code through the ``lab`` fixture (a sandboxed process) and draws its
inputs from ``rng``, seeded afresh for every grading run. Requests are the notebook's own `Request`
objects, made in the sandbox and read back field by field through their handles; the reference runs on
nanolab's requests with the same fields. Feedback says what is wrong and on which input, never the
expected answer.
"""

from __future__ import annotations

import pytest

from autograder.testing import Remote, RemoteError, expect
from nanolab.engine import request as reference
from nanolab.engine.batching import BatchRequest, simulate_batching
from nanolab.engine.scheduler import choose_victim, waiting_order
from nanolab.model.sampling import SamplingParams

STATES = ("waiting", "running", "preempted", "finished")
MOVES = ("admit", "preempt", "stop", "length", "abort")  # the last three: finish with that reason
POLICIES = ("fcfs", "shortest", "priority")
MODES = ("static", "continuous")


# ---------------------------------------------------------------------------------------------- helpers


def status_of(value) -> str:
    """A status or reason read from the sandbox (an enum member crosses as its value: "running")."""
    return "None" if value is None else str(value)


def raises(error: str, function, *args) -> str | None:
    """None if ``function(*args)`` raises ``error`` in the learner's code; else what happened instead."""
    try:
        function(*args)
    except RemoteError as e:
        return None if e.type_name == error else f"it raised {e.type_name}"
    return "it raised nothing"


FIELDS = (
    "status",
    "finish_reason",
    "num_computed_tokens",
    "num_preemptions",
    "output_token_ids",
    "block_table",
    "admitted_seq",
    "prompt_token_ids",
)


def fields_of(req) -> dict:
    """The fields a move may touch, read back through the handle."""
    got = {name: getattr(req, name) for name in FIELDS}
    got["status"] = status_of(got["status"])
    got["finish_reason"] = status_of(got["finish_reason"])
    return got


def new_request(lab, rng, rid: str):
    """A waiting request of the notebook's with progress in every field a move could touch."""
    prompt = [rng.randrange(100) for _ in range(rng.randint(2, 9))]
    output = [rng.randrange(100) for _ in range(rng.randint(1, 5))]
    return lab.Request(
        rid,
        prompt,
        priority=rng.randint(0, 3),
        arrival_time=float(rng.randint(0, 50)),
        output_token_ids=output,
        num_computed_tokens=rng.randint(1, len(prompt) + len(output)),
        block_table=rng.sample(range(40), rng.randint(1, 4)),
        num_preemptions=rng.randint(0, 2),
        admitted_seq=rng.randint(1, 9),
    )


def move(lab, req, name: str) -> None:
    if name == "admit":
        lab.admit(req)
    elif name == "preempt":
        lab.preempt(req)
    else:
        lab.finish(req, name)  # a reason equals its value: FinishReason("stop") == "stop"


def move_text(name: str) -> str:
    return name if name in ("admit", "preempt") else f"finish(req, {name!r})"


def reach(lab, req, state: str, rid: str) -> None:
    """Bring a new (waiting) request to ``state`` with the learner's own legal moves, so its status is the
    notebook's own enum member (a status from the grader would cross as a plain string)."""
    path = {"waiting": [], "running": ["admit"], "preempted": ["admit", "preempt"], "finished": ["abort"]}[
        state
    ]
    for name in path:
        try:
            move(lab, req, name)
        except RemoteError as e:
            raise AssertionError(
                f"bringing request {rid!r} to {state.upper()} by the legal moves {[move_text(m) for m in path]} failed: "
                f"{move_text(name)} raised {e.type_name}"
            ) from None
    got = status_of(req.status)
    assert got == state, (
        f"after the legal moves {[move_text(m) for m in path]} from WAITING, request {rid!r} should be "
        f"{state.upper()}, but its status is {got!r}"
    )


def legal_target(state: str, name: str) -> str | None:
    """The state a move leads to from ``state`` (nanolab's state machine), or None if it is illegal."""
    probe = reference.Request("probe", [1, 2], SamplingParams())
    probe.status = reference.RequestStatus(state)
    try:
        if name == "admit":
            reference.admit(probe)
        elif name == "preempt":
            reference.preempt(probe)
        else:
            reference.finish(probe, reference.FinishReason(name))
    except reference.IllegalTransition:
        return None
    return probe.status.value


# ---------------------------------------------------------------------------------------------- state machine


@pytest.mark.points(2)
def test_every_state_and_move_is_legal_or_refused_changing_nothing(lab, rng):
    """Check every state x move (admit, preempt, finish with stop/length/abort): the legal ones reach nanolab's state, the rest raise IllegalTransition naming the request and change nothing."""
    for state in STATES:
        for name in MOVES:
            rid = f"req-{rng.randrange(10**6)}"
            req = new_request(lab, rng, rid)
            reach(lab, req, state, rid)
            before = fields_of(req)
            target = legal_target(state, name)
            what = f"{move_text(name)} on a {state.upper()} request"
            if target is None:
                try:
                    move(lab, req, name)
                except RemoteError as e:
                    assert e.type_name == "IllegalTransition", (
                        f"{what} should raise IllegalTransition, not {e.type_name}"
                    )
                    assert rid in e.message, (
                        f"{what}: the IllegalTransition's message should name the request ({rid!r})"
                    )
                else:
                    raise AssertionError(
                        f"{what} is not a move of the state machine: it should raise IllegalTransition"
                    )
                changed = [k for k, v in fields_of(req).items() if v != before[k]]
                assert not changed, (
                    f"{what} raised, but changed {', '.join(changed)} first: check, then change"
                )
                continue
            try:
                move(lab, req, name)
            except RemoteError as e:
                raise AssertionError(f"{what} is a legal move, but it raised {e.type_name}") from None
            after = fields_of(req)
            assert after["status"] == target, (
                f"{what} should leave it {target.upper()}, not {after['status']!r}"
            )
            if name in ("stop", "length", "abort"):
                assert after["finish_reason"] == name, f"{what} should set finish_reason to {name!r}"
            else:
                assert after["finish_reason"] == before["finish_reason"], (
                    f"{what} should not set a finish_reason"
                )
            if name != "preempt":
                kept = [k for k in FIELDS if k not in ("status", "finish_reason") and after[k] != before[k]]
                assert not kept, (
                    f"{what} changed {', '.join(kept)}: it changes the status (and finish_reason) only"
                )


@pytest.mark.points(2)
def test_preempt_resets_the_computed_tokens_counts_and_keeps_the_output(lab, rng):
    """Check preempt over random admit/preempt cycles: num_computed_tokens back to 0, num_preemptions up by one each time, the output and the rest kept."""
    for trial in range(4):
        rid = f"cycle-{trial}-{rng.randrange(10**6)}"
        req = new_request(lab, rng, rid)
        start = fields_of(req)
        count = start["num_preemptions"]
        for _ in range(rng.randint(1, 4)):
            lab.admit(req)
            before = fields_of(req)
            what = f"preempt on a running request ({before['num_computed_tokens']} tokens computed, preempted {count} time(s) before)"
            try:
                lab.preempt(req)
            except RemoteError as e:
                raise AssertionError(f"{what} raised {e.type_name}") from None
            after = fields_of(req)
            count += 1
            assert after["status"] == "preempted", (
                f"{what} should leave it PREEMPTED, not {after['status']!r}"
            )
            assert after["num_computed_tokens"] == 0, (
                f"{what}: its keys and values are gone, so num_computed_tokens should go back to 0"
            )
            assert after["num_preemptions"] == count, f"{what}: num_preemptions should go up by exactly one"
            assert after["output_token_ids"] == start["output_token_ids"], (
                f"{what} changed output_token_ids: the generated tokens are kept (recomputing them brings their KV back)"
            )
            assert after["prompt_token_ids"] == start["prompt_token_ids"], f"{what} changed the prompt"
            assert after["admitted_seq"] == before["admitted_seq"] and after["finish_reason"] == "None", (
                f"{what} changed admitted_seq or finish_reason"
            )
            # a request preempted again must be admitted first: preempting a preempted one is refused
            problem = raises("IllegalTransition", lab.preempt, req)
            assert problem is None, (
                f"preempting request {rid!r} twice in a row should raise IllegalTransition ({problem})"
            )
            assert fields_of(req)["num_preemptions"] == count, "a refused preempt changed num_preemptions"
        lab.admit(req)
        lab.finish(req, "length")
        assert fields_of(req)["num_preemptions"] == count, "finish changed num_preemptions"


# ---------------------------------------------------------------------------------------------- batching


def learner_trace(lab, trace: list[BatchRequest]):
    """The trace as a list of the notebook's own BatchRequests, made in the learner's process.

    A BatchRequest is a NamedTuple, so one made by a call would come back here as a plain tuple (and
    a plain tuple has no ``.arrival``). The list is built in the sandbox instead, from the members of an
    Enum whose mixin type is the notebook's BatchRequest: each member *is* a BatchRequest with these
    fields. Members with equal values would merge, so a trace never repeats an (arrival, output_len)
    pair (`random_trace` makes sure). Where the notebook's BatchRequest crosses as a handle, it is used
    as it is."""
    if not trace:
        return []
    probe = lab.BatchRequest(trace[0].arrival, trace[0].output_len)
    if isinstance(probe, Remote):
        return [lab.BatchRequest(r.arrival, r.output_len) for r in trace]
    assert len(set(trace)) == len(trace), "a trace here never repeats a request (a grader problem, not yours)"
    members = lab.Enum("Trace", [(f"r{i}", tuple(r)) for i, r in enumerate(trace)], type=lab.BatchRequest)
    held = lab.hold([])
    held.extend(members)
    return held


def random_trace(rng, n: int) -> list[BatchRequest]:
    """n requests in arrival order: bursts of equal arrivals, idle gaps, long-tailed output lengths; no
    two requests equal."""
    t, trace, seen = rng.randint(0, 3), [], set()
    for _ in range(n):
        t += rng.choice([0, 0, 0, 1, 1, 2, 3, rng.randint(5, 25)])
        while True:
            out = rng.choice([1, 1, 2, rng.randint(1, 6), rng.randint(1, 20), rng.randint(20, 60)])
            if (t, out) not in seen:
                break
        seen.add((t, out))
        trace.append(BatchRequest(t, out))
    return trace


def batching_result(value, what: str) -> dict:
    expect(value, Remote, what)  # a BatchingResult (a dataclass: it stays in the sandbox)
    got = {name: getattr(value, name) for name in ("start", "finish", "batch_sizes")}
    for name, v in got.items():
        expect(v, list, f"{what}.{name}")
    return got


def _own_end(trace, result) -> list[int]:
    return [s + r.output_len - 1 for s, r in zip(result.start, trace)]


def compare_batching(lab, trace: list[BatchRequest], size: int, mode: str, label: str) -> None:
    what = f"simulate_batching(<{label}: {len(trace)} requests>, max_batch_size={size}, mode={mode!r})"
    got = batching_result(lab.simulate_batching(learner_trace(lab, trace), size, mode), what)
    want = simulate_batching(trace, size, mode)
    wrong = [name for name in ("start", "finish", "batch_sizes") if got[name] != getattr(want, name)]
    if not wrong:
        return
    hints = []
    if mode == "static" and got["start"] == want.start and got["finish"] == _own_end(trace, want):
        hints.append("in static batching every request of a batch is returned at the batch's last step")
    if mode == "static" and got["finish"] == want.finish and "batch_sizes" in wrong:
        hints.append("a request that is done stays in the forward as padding until its batch ends")
    if mode == "continuous" and "start" in wrong and all(g >= w for g, w in zip(got["start"], want.start)):
        hints.append("a seat freed by a request that is done is taken at the very next step")
    if len(got["batch_sizes"]) != len(want.batch_sizes):
        hints.append("batch_sizes has one entry per step, from step 0 to the last step anything runs")
    hint = f" ({'; '.join(hints)})" if hints else ""
    raise AssertionError(f"{what}: {', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} wrong{hint}")


@pytest.mark.points(2)
def test_simulate_batching_matches_the_reference_on_random_traces(lab, rng):
    """Check simulate_batching against nanolab's on random traces: both modes, batch sizes 1 to 12, bursts, idle gaps."""
    for _ in range(10):
        trace = random_trace(rng, rng.randint(1, 40))
        size = rng.choice([1, 2, 3, 4, 6, 8, 12])
        for mode in MODES:
            compare_batching(lab, trace, size, mode, "a random trace")


def test_simulate_batching_edge_cases(lab, rng):
    """Check simulate_batching on edges: an empty trace, one request, late first arrival, a burst larger than the batch, seats freed and refilled in the same step."""
    b = rng.randint(2, 5)
    late = rng.randint(1, 6)
    cases = [
        ("an empty trace", [], 3),
        ("one request", [BatchRequest(0, rng.randint(1, 9))], 1),
        ("a first arrival after step 0", [BatchRequest(late, 2), BatchRequest(late, 1)], 4),
        ("a burst larger than the batch", [BatchRequest(0, i + 1) for i in range(2 * b + 1)], b),
        ("arrivals exactly when a seat frees", [BatchRequest(0, 3), BatchRequest(0, 1), BatchRequest(1, 2), BatchRequest(3, 1)], 2),
        ("one-token requests only", [BatchRequest(t, 1) for t in range(0, 6, 2)], 1),
        ("an idle gap between two bursts", [BatchRequest(0, 2), BatchRequest(0, 1), BatchRequest(9, 3), BatchRequest(9, 1)], 2),
    ]  # fmt: skip
    for label, trace, size in cases:
        for mode in MODES:
            compare_batching(lab, trace, size, mode, label)


def test_simulate_batching_rejects_bad_input(lab, rng):
    """Check that simulate_batching raises ValueError for an unknown mode, max_batch_size < 1, output_len < 1, a negative arrival, a trace out of order."""
    ok = [BatchRequest(0, 2), BatchRequest(1, 3)]
    got = lab.simulate_batching(learner_trace(lab, ok), 2, "continuous")
    batching_result(got, "simulate_batching on a valid trace")  # a valid call must work
    bad = [
        ("an unknown mode 'round-robin'", ok, 2, "round-robin"),
        (f"max_batch_size={-rng.randint(0, 2)}", ok, -rng.randint(0, 2), "static"),
        (f"a request with output_len {-rng.randint(0, 1)}", [BatchRequest(0, 1), BatchRequest(1, -rng.randint(0, 1))], 2, "continuous"),
        ("a request arriving at step -1", [BatchRequest(-1, 2), BatchRequest(0, 1)], 2, "static"),
        ("a trace out of arrival order", [BatchRequest(3, 1), BatchRequest(1, 2)], 2, "continuous"),
    ]  # fmt: skip
    for what, trace, size, mode in bad:
        problem = raises("ValueError", lab.simulate_batching, learner_trace(lab, trace), size, mode)
        assert problem is None, f"simulate_batching with {what} should raise ValueError ({problem})"


# ---------------------------------------------------------------------------------------------- policies


def twins(lab, rng, specs: list[dict]) -> tuple[list, list[reference.Request]]:
    """The same requests on both sides: the learner's (handles) and nanolab's."""
    mine, theirs = [], []
    for s in specs:
        fields = dict(priority=s["priority"], arrival_time=s["arrival_time"], arrival_step=s["arrival_step"])
        mine.append(
            lab.Request(
                s["rid"],
                s["prompt"],
                output_token_ids=s["output"],
                num_computed_tokens=s["computed"],
                **fields,
            )
        )
        r = reference.Request(s["rid"], s["prompt"], SamplingParams(), **fields)
        r.output_token_ids, r.num_computed_tokens = list(s["output"]), s["computed"]
        theirs.append(r)
    return mine, theirs


def random_queue(rng, n: int, now: int) -> list[dict]:
    """n waiting requests in random list order: few distinct priorities and lengths (many ties), arrival
    steps up to ``now``, distinct arrival times in the order of the arrival steps."""
    steps = sorted(rng.randint(0, now) for _ in range(n))
    times = sorted(rng.sample(range(10 * n + 10), n))
    specs = []
    for i, (step, t) in enumerate(zip(steps, times)):
        prompt = rng.randint(1, 6)
        output = rng.choice([0, 0, rng.randint(1, 3)])
        computed = rng.choice([0, 0, rng.randint(0, prompt + output - 1)])
        specs.append(dict(rid=f"q{i}", prompt=[1] * prompt, output=[2] * output, computed=computed,
                          priority=rng.randint(0, 3), arrival_step=step, arrival_time=t / 4))  # fmt: skip
    rng.shuffle(specs)
    return specs


def order_of(value, what: str) -> list[str]:
    expect(value, list, what)
    for r in value:
        expect(r, Remote, f"each item of {what}")  # the requests themselves, not copies of their data
    return [r.request_id for r in value]


def _describe(spec: dict) -> str:
    left = len(spec["prompt"]) + len(spec["output"]) - spec["computed"]
    return f"{spec['rid']}(priority {spec['priority']}, arrival_step {spec['arrival_step']}, {left} left)"


def _policy_hint(policy: str, got: list[str], specs: list[dict], now: int, aging: int) -> str:
    by = {s["rid"]: s for s in specs}
    left = {r: len(s["prompt"]) + len(s["output"]) - s["computed"] for r, s in by.items()}
    if policy == "shortest" and got == sorted(
        by, key=lambda r: (len(by[r]["prompt"]), by[r]["arrival_time"])
    ):
        return " (shortest counts the tokens still to compute, remaining_prefill(), not the prompt's length)"
    if policy == "priority" and got == sorted(
        by, key=lambda r: (by[r]["priority"] - (now - by[r]["arrival_step"]) / aging, by[r]["arrival_time"])
    ):
        return " (a request moves up one level per *whole* aging_steps waited)"
    keys = {
        "shortest": lambda r: left[r],
        "priority": lambda r: by[r]["priority"] - (now - by[r]["arrival_step"]) // aging,
    }
    if policy in keys and sorted(got, key=keys[policy]) == got:
        return " (equal keys go to the earlier arrival_time)"
    return ""


@pytest.mark.points(2)
def test_waiting_order_matches_the_reference_on_random_queues(lab, rng):
    """Check waiting_order's exact order against nanolab's for each policy on random queues with many ties (ties by arrival_time) and random aging."""
    for _ in range(6):
        now = rng.randint(0, 60)
        specs = random_queue(rng, rng.randint(2, 12), now)
        mine, theirs = twins(lab, rng, specs)
        for policy in POLICIES:
            aging = rng.choice([1, 2, 3, 5, 8, 16])
            what = f"waiting_order(<{len(specs)} requests>, {policy!r}, now={now}, aging_steps={aging})"
            got = order_of(lab.waiting_order(mine, policy, now, aging), what)
            want = [r.request_id for r in waiting_order(theirs, policy, now, aging)]
            if got != want:
                queue = ", ".join(_describe(s) for s in specs)
                raise AssertionError(
                    f"{what} on the queue [{queue}] gives another order than nanolab's"
                    f"{_policy_hint(policy, got, specs, now, aging)}"
                )


@pytest.mark.points(1)
def test_aging_moves_a_request_up_a_level_exactly_at_each_multiple_of_aging_steps(lab, rng):
    """Check priority aging at the crossings: one step before, at, and one step after each multiple of aging_steps."""
    aging = rng.randint(2, 9)
    for p in range(1, 4):
        for k in range(1, p + 2):
            for offset in (-1, 0, 1):
                waited = k * aging + offset
                # the old request has waited `waited` steps; the rival has waited `rival` steps and
                # is one level more important, so they tie exactly when the old one has aged one more
                # whole level than the rival.
                rival = rng.randrange(aging)
                now = waited + 5
                specs = [
                    dict(rid="old", prompt=[1] * 3, output=[], computed=0, priority=p, arrival_step=now - waited, arrival_time=1.0),
                    dict(rid="rival", prompt=[1] * 3, output=[], computed=0, priority=p - k, arrival_step=now - rival, arrival_time=9.0),
                    dict(rid="new", prompt=[1] * 3, output=[], computed=0, priority=p - k + 1, arrival_step=now, arrival_time=20.0),
                ]  # fmt: skip
                rng.shuffle(specs)
                mine, theirs = twins(lab, rng, specs)
                what = (
                    f"waiting_order with aging_steps={aging} at now={now}: a request of priority {p} that has waited "
                    f"{waited} steps, one of priority {p - k} that has waited {rival}, one of priority {p - k + 1} "
                    "that just arrived"
                )
                got = order_of(lab.waiting_order(mine, "priority", now, aging), what)
                want = [r.request_id for r in waiting_order(theirs, "priority", now, aging)]
                assert got == want, (
                    f"{what}: the order is wrong (a request moves up one level when it has waited a whole multiple of "
                    "aging_steps, not before; equal levels go to the earlier arrival)"
                )


@pytest.mark.points(0.5)  # a check on inputs left unchanged weighs little (autograder/README.md)
def test_waiting_order_returns_a_new_list(lab, rng):
    """Check that waiting_order returns the policy's order as a new list and leaves the queue it is given as it was."""
    now = rng.randint(5, 30)
    specs = random_queue(rng, 8, now)
    mine, theirs = twins(lab, rng, specs)
    ids = [s["rid"] for s in specs]
    for policy in POLICIES:
        queue = lab.hold(mine)  # the very list waiting_order is given, kept in the sandbox
        got = order_of(lab.waiting_order(queue, policy, now, 4), f"waiting_order(..., {policy!r}, ...)")
        assert got == [r.request_id for r in waiting_order(theirs, policy, now, 4)], (
            f"waiting_order(..., {policy!r}, ...) is not the policy's order"
        )
        after = [r.request_id for r in lab.peek(queue)]
        assert after == ids, (
            f"waiting_order(..., {policy!r}, ...) changed the list it was given: return a new, sorted list "
            "(sorted(...)), do not sort the queue in place"
        )


def test_waiting_order_refuses_unknown_policies(lab, rng):
    """Check that waiting_order raises ValueError for an unknown policy or aging_steps < 1, and that aging_steps is read by "priority" only."""
    now = rng.randint(5, 30)
    specs = random_queue(rng, 8, now)
    mine, _ = twins(lab, rng, specs)
    for policy in ("lifo", "sjf", "random"):
        problem = raises("ValueError", lab.waiting_order, mine, policy, now, 4)
        assert problem is None, (
            f"waiting_order with the unknown policy {policy!r} should raise ValueError ({problem})"
        )
    problem = raises("ValueError", lab.waiting_order, mine, "priority", now, 0)
    assert problem is None, (
        f"waiting_order(..., 'priority', ..., aging_steps=0) should raise ValueError ({problem})"
    )
    mine, theirs = twins(lab, rng, specs)
    for policy in ("fcfs", "shortest"):  # aging_steps is read by "priority" only
        try:
            got = order_of(lab.waiting_order(mine, policy, now, 0), f"waiting_order(..., {policy!r}, ...)")
        except RemoteError as e:
            raise AssertionError(
                f"waiting_order(..., {policy!r}, ..., aging_steps=0) raised {e.type_name}: only 'priority' uses "
                "aging_steps, so only 'priority' refuses a value below 1"
            ) from None
        assert got == [r.request_id for r in waiting_order(theirs, policy, now, 0)], (
            f"waiting_order(..., {policy!r}, ..., aging_steps=0) is not the policy's order: fcfs and shortest do not depend on aging_steps"
        )


# ---------------------------------------------------------------------------------------------- victim


def _running_set(lab, rng, n: int):
    """n running requests on both sides; each learner request is told apart by its arrival_time (a marker),
    since two of them may share a request_id."""
    seqs = rng.sample(range(1, 3 * n + 1), n)
    mine, theirs = [], []
    for i in range(n):
        rid = f"r{i}"
        priority = rng.choice([0, 0, 1, 2])
        mine.append(lab.Request(rid, [1, 2], priority=priority, arrival_time=float(i), admitted_seq=seqs[i]))
        r = reference.Request(rid, [1, 2], SamplingParams(), priority=priority, arrival_time=float(i))
        r.status, r.admitted_seq = reference.RequestStatus.RUNNING, seqs[i]
        theirs.append(r)
    return mine, theirs


@pytest.mark.points(2)
def test_choose_victim_matches_the_reference_on_random_running_sets(lab, rng):
    """Check choose_victim against nanolab's on random running sets: the same request (by identity), whoever is scheduled or needy."""
    for trial in range(25):
        n = rng.randint(1, 9)
        mine, theirs = _running_set(lab, rng, n)
        picked = sorted(rng.sample(range(n), rng.randint(0, n)))
        needy = rng.randrange(n)
        scheduled = [i for i in picked if i != needy]
        twin = None
        if trial % 3 == 0 and n > 1:
            # a look-alike of an unscheduled request (same id and fields) is "scheduled": it is another object
            others = [i for i in range(n) if i not in scheduled and i != needy]
            if others:
                twin = rng.choice(others)
        sched_mine = [mine[i] for i in scheduled]
        if twin is not None:
            mine_twin = lab.Request(f"r{twin}", [1, 2], priority=theirs[twin].priority, arrival_time=-1.0,
                                    admitted_seq=theirs[twin].admitted_seq)  # fmt: skip
            sched_mine.append(mine_twin)
        want = choose_victim(theirs, [theirs[i] for i in scheduled], theirs[needy])
        listed = [f"r{i}" for i in scheduled] + ([f"a look-alike of r{twin}"] if twin is not None else [])
        running = ", ".join(
            f"r{i}(priority {r.priority}, admitted {r.admitted_seq})" for i, r in enumerate(theirs)
        )
        what = f"choose_victim(running=[{running}], scheduled=[{', '.join(listed)}], needy=r{needy})"
        got = lab.choose_victim(mine, sched_mine, mine[needy])
        expect(got, Remote, what)
        marker = got.arrival_time
        if marker == -1.0:
            raise AssertionError(
                f"{what} returned the look-alike, which is not running: tell requests apart with `is`"
            )
        if marker != float(want.arrival_time):
            hint = ""
            index = (
                int(marker) if isinstance(marker, float) and marker.is_integer() and 0 <= marker < n else None
            )
            if index is not None and index in scheduled:
                hint = " (a request already in this step's batch keeps its blocks)"
            elif twin is not None and index == twin:
                hint = " (requests are told apart by identity, `is`, not by equal fields)"
            elif index is not None and index != needy and want is theirs[needy]:
                hint = " (a request never pushes out a more important one: then it is the victim itself)"
            raise AssertionError(f"{what} picked another request than nanolab's{hint}")
