"""Chunked prefill's pieces: the mask of a chunk after a cached prefix (`chunk_mask`), the budget planner
(`plan_prefill`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.engine_utils import random_plans

from nanolab.engine.chunking import plan_prefill
from nanolab.model.attention import chunk_mask, dense_causal_attention, sdpa

ROOT = Path(__file__).resolve().parents[2]
LAB05 = ROOT / "solutions" / "lab05_chunked_prefill.ipynb"


# ---------------------------------------------------------------------------------------------- chunk_mask


def test_chunk_mask_from_zero_is_the_causal_mask_and_a_decode_sees_everything():
    assert torch.equal(chunk_mask(0, 6), torch.ones(6, 6, dtype=torch.bool).tril())
    assert torch.equal(chunk_mask(9, 1), torch.ones(1, 10, dtype=torch.bool))
    assert chunk_mask(4, 0).shape == (0, 4)
    with pytest.raises(ValueError):
        chunk_mask(-1, 2)


@pytest.mark.parametrize("start,num_new", [(0, 7), (5, 3), (12, 1), (1, 11)])
def test_attention_of_a_chunk_with_its_mask_is_the_rows_of_full_causal_attention(start, num_new):
    torch.manual_seed(start * 31 + num_new)
    total = start + num_new
    q, k, v = torch.randn(total, 4, 8), torch.randn(total, 2, 8), torch.randn(total, 2, 8)
    full = dense_causal_attention(q, k, v)
    chunk = sdpa(q[start:], k, v, mask=chunk_mask(start, num_new))
    assert torch.allclose(chunk, full[start:], atol=1e-5)


# ---------------------------------------------------------------------------------------------- plan_prefill


def test_every_prompt_computes_exactly_its_tokens_within_the_budget_left_by_the_decodes():
    for lens, decodes, budget, order, chunk, plan in random_plans():
        assert [sum(column) for column in zip(*plan)] == lens
        assert all(0 < sum(row) <= budget - decodes for row in plan)
        if order == "round_robin":
            assert all(n <= chunk for row in plan for n in row)


def test_fcfs_fills_every_step_but_the_last_and_finishes_the_prompts_in_order():
    for lens, decodes, budget, order, _, plan in random_plans():
        if order != "fcfs":
            continue
        assert all(sum(row) == budget - decodes for row in plan[:-1])
        ends = [max(s for s, row in enumerate(plan) if row[i]) for i in range(len(lens))]
        assert ends == sorted(ends)


def test_round_robin_turns_start_after_the_last_prompt_served():
    assert plan_prefill([4, 4, 4], 1, 5, "round_robin", 2) == [[2, 2, 0], [2, 0, 2], [0, 2, 2]]
    # the budget cuts prompt 1 short at step 0 (1 of its 2): step 1 starts with prompt 2 all the same
    assert plan_prefill([2, 3, 2], 0, 3, "round_robin", 2) == [[2, 1, 0], [0, 1, 2], [0, 1, 0]]


@pytest.mark.parametrize(
    "args,kwargs",
    [
        (([3], 4, 4), {}),
        (([3], 1, 0), {}),
        (([3], -1, 4), {}),
        (([0], 1, 4), {}),
        (([3], 1, 4), {"order": "lifo"}),
        (([3], 1, 4), {"order": "round_robin"}),
        (([3], 1, 4), {"order": "round_robin", "chunk_size": 0}),
    ],
)
def test_plan_prefill_refuses_what_has_no_plan(args, kwargs):
    with pytest.raises(ValueError):
        plan_prefill(*args, **kwargs)


def test_no_prompts_no_steps_even_when_the_decodes_fill_the_budget():
    assert plan_prefill([], 8, 4) == []
