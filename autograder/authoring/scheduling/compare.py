"""A learner's scheduler checked against nanolab's: the first decision that differs, named with the
request state that led to it; the Scheduler object itself read back; the speed budget; generated workloads.
"""

from __future__ import annotations

import random
import time

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from autograder.authoring.scheduling.replay import (
    POLICIES,
    comparable,
    describe,
    driven_calls,
    learner_replay,
    learner_scheduler,
    reference_replay,
    status_of,
)
from autograder.authoring.scheduling.workloads import random_config, random_workload, where
from autograder.authoring.testing import Remote, expect
from nanolab.engine.scheduler import Scheduler


def first_difference(
    mine: list, theirs: list, events: list[tuple], chunked: bool = False
) -> tuple[int, str] | None:
    if len(mine) != len(theirs):  # zip below would stop at the shorter: an empty record list never differs
        i = min(len(mine), len(theirs))
        return i, f"replay_schedule returned {len(mine)} records for {len(theirs)} events"
    for i, (a, b) in enumerate(zip(mine, theirs)):
        a, b = comparable(a), comparable(b)
        if a == b:
            continue
        kind = events[i][0]
        if a[0] == "error" or b[0] == "error":
            if kind == "add":
                if b[0] == "error":
                    yours = f"it raised {a[1]}" if a[0] == "error" else "it accepted it"
                    return (
                        i,
                        f"add should refuse a request that can never run ({events[i][2]} tokens) with ValueError "
                        f"({yours})",
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


def check_speed(lab, cfg: dict, events: list[tuple], what: str) -> None:
    """The learner's Scheduler, driven from here through ``events`` (all of them in one message,
    `driven_calls`), decides as nanolab's and takes at most 20x the CPU time of nanolab's scheduler in the
    notebook's replay (the best of 3 runs) + 0.5 s, its final state read back inside the timed window. Each
    side is timed by its own CPU time (the reference's thread here, the learner's processes as the grader
    reads them), so a busy machine does not move the budget. ``what`` says what the workload is, for the
    message."""
    # Only a Scheduler that first works on a short workload may earn the speed points.
    head = [e for e in events if e[0] == "add"][:12] + [("step",)] * 5
    compare_with_reference(lab, cfg, head, f"before {what}, 12 of its requests and 5 steps")
    timings = []
    for _ in range(3):
        start = time.thread_time()
        want, reference = reference_replay(cfg, events)
        timings.append(time.thread_time() - start)
    budget = 20 * min(timings) + 0.5
    scheduler, allocator = learner_scheduler(lab, cfg)
    # The grader drives the Scheduler itself, the whole workload in one message (`driven_calls`): no helper
    # of the notebook stands between the calls and the Scheduler.
    calls, records = driven_calls(lab, scheduler, cfg, events)
    with lab.time_limit(2 * budget + 5.0):
        before = lab.cpu_seconds()
        got = records(lab.run(calls))
        # the Scheduler's own final state, read inside the timed window: work put off until it is read counts
        state_error = None
        try:
            check_state(scheduler, allocator, reference, "on the speed workload")
        except AssertionError as e:
            state_error = e
        elapsed = lab.cpu_seconds() - before
    diff = first_difference(got, want, events, cfg.get("chunked", False))
    if diff is not None:
        raise AssertionError(
            f"only a correct result counts: on this workload, {where(events, diff[0])}: {diff[1]}"
        )
    if state_error is not None:
        raise state_error
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
