"""Random settings and workloads for the scheduler labs, seeded by the grading run: any mix of adds,
steps and aborts, one that ends with a readmitted request running, and the engine's arrival pattern.
"""

from __future__ import annotations

import math

from autograder.authoring.scheduling.replay import POLICIES, Driver
from nanolab.engine.request import RequestStatus


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


def where(events: list[tuple], i: int) -> str:
    step = sum(1 for e in events[: i + 1] if e[0] == "step")
    kind = events[i][0]
    if kind == "step":
        return f"at step {step}"
    return f"at the {kind} of request {events[i][1]!r} (after step {step})"
