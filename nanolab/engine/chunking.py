"""Chunked prefill on a token clock: how one step's token budget is shared, before any model runs.

Lab 5 builds this first. A step computes at most ``budget`` tokens. Requests that decode need one token
each and go first (*decode-maximal* batching, as in Sarathi-Serve), so a long prompt never stalls them;
what is left of the budget goes to prompts, a *chunk* each, and a prompt longer than what is left simply
takes several steps. Two ways to share that rest between several prompts:

- ``"fcfs"``: in arrival order, each prompt takes all it can; the first prompt finishes as early as it
  could alone, the next ones start after it (the engine's scheduler does this);
- ``"round_robin"``: each prompt in turn takes at most ``chunk_size`` tokens, and the next step's turn
  starts with the prompt after the last one served; every prompt advances, and every one finishes late.

Seats and KV blocks are left out here; the scheduler (`nanolab.engine.scheduler`) has them.
"""

from __future__ import annotations

from collections.abc import Sequence

PREFILL_ORDERS = ("fcfs", "round_robin")


def plan_prefill(
    prompt_lens: Sequence[int],
    num_decodes: int,
    budget: int,
    order: str = "fcfs",
    chunk_size: int | None = None,
) -> list[list[int]]:
    """Per step, the tokens each prompt computes, while ``num_decodes`` requests decode beside them.

    Every prompt is there from step 0. Each step, the decodes take one token each first; the rest of
    ``budget`` goes to the prompts not yet done, in ``order`` (see the module): ``"fcfs"`` gives each, in
    list order, ``min(tokens it has left, tokens left in the step)``; ``"round_robin"`` the same capped at
    ``chunk_size``, starting with the prompt after the last one served the step before (in list order,
    wrapping around, skipping finished prompts; that last one may have been cut short by the budget).
    Returns one row per step until every prompt is done; row ``s`` holds the tokens prompt ``i`` computes
    at step ``s`` at index ``i`` (0 if none); ``[]`` for no prompts.

    Raises ValueError for a budget below 1, a negative ``num_decodes``, decodes that take the whole budget
    (the prompts would never advance), a prompt shorter than 1 token, another order, or round robin
    without a ``chunk_size`` of at least 1.

    Example:
        >>> plan_prefill([5, 2], num_decodes=2, budget=5)
        [[3, 0], [2, 1], [0, 1]]
        >>> plan_prefill([4, 4, 4], num_decodes=1, budget=5, order="round_robin", chunk_size=2)
        [[2, 2, 0], [2, 0, 2], [0, 2, 2]]
    """
    if order not in PREFILL_ORDERS:
        raise ValueError(
            f"unknown prefill order {order!r}; the orders are {', '.join(map(repr, PREFILL_ORDERS))}"
        )
    if budget < 1:
        raise ValueError(f"budget must be at least 1 token, got {budget}")
    if num_decodes < 0:
        raise ValueError(f"num_decodes must be >= 0, got {num_decodes}")
    if any(n < 1 for n in prompt_lens):
        raise ValueError(f"every prompt has at least 1 token, got {list(prompt_lens)}")
    if order == "round_robin" and (chunk_size is None or chunk_size < 1):
        raise ValueError(f"round robin needs a chunk_size of at least 1 token, got {chunk_size}")
    if prompt_lens and num_decodes >= budget:
        raise ValueError(
            f"{num_decodes} decodes take the whole budget of {budget} tokens: the prompts would never advance"
        )
    left = list(prompt_lens)
    cap = chunk_size if order == "round_robin" else None
    first = 0  # round robin: where this step's turn starts
    steps = []
    while any(left):
        row = [0] * len(left)
        room = budget - num_decodes
        last = None
        for k in range(len(left)):
            i = (first + k) % len(left)
            if room == 0:
                break
            if left[i] == 0:
                continue
            n = min(left[i], room) if cap is None else min(left[i], room, cap)
            row[i], left[i], room, last = n, left[i] - n, room - n, i
        if cap is not None:
            first = (last + 1) % len(left)
        steps.append(row)
    return steps
