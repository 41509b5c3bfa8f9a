"""Lab 10's solution against nanolab: its docstring examples, the cuts on random shapes and head layouts, both
forwards against nanolab's on every rank, and the setup's threads-as-ranks (`run_ranks`, `LocalGroup`, `TP`)
against nanolab's own."""

from __future__ import annotations

import doctest
import random
from pathlib import Path

import pytest
import torch
from helpers.grading_utils import solution_namespace

from labkit.lab10 import TP, apply_rope, causal_attend, run_attention_ranks, run_mlp_ranks, run_ranks
from nanolab.model import tensor_parallel as reference
from nanolab.model.attention import dense_causal_attention
from nanolab.model.transformer import apply_rope as nanolab_rope
from nanolab.model.transformer import attention_forward, mlp_forward

LAB10 = Path(__file__).resolve().parents[2] / "solutions" / "lab10_tensor_parallel.ipynb"


@pytest.fixture(scope="module")
def lab10() -> dict:
    return solution_namespace(LAB10.name)


def test_lab10_docstring_examples_run_on_the_solution(lab10):
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner()
    names = (
        "column_shard",
        "row_shard",
        "head_ranges",
        "qkv_shard",
        "gate_up_shard",
        "mlp_forward",
        "attention_forward",
    )
    tests = [t for name in names for t in finder.find(lab10[name], name, globs=lab10)]
    assert sum(len(t.examples) for t in tests) >= 9
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


def test_lab10_cuts_agree_with_nanolab(lab10):
    rng = random.Random(10)
    for _ in range(200):
        n_kv = rng.choice([1, 2, 4])
        n_heads = n_kv * rng.choice([1, 2, 4])
        sizes = [s for s in (1, 2, 4, 8) if n_heads % s == 0 and (n_kv % s == 0 or s % n_kv == 0)]
        size = rng.choice(sizes)
        rank = rng.randrange(size)
        assert lab10["head_ranges"](n_heads, n_kv, rank, size) == reference.head_ranges(
            n_heads, n_kv, rank, size
        )
        t = torch.randn((n_heads + 2 * n_kv) * rng.randint(1, 4), 3)
        assert torch.equal(
            lab10["qkv_shard"](t, n_heads, n_kv, rank, size),
            reference.qkv_shard(t, n_heads, n_kv, rank, size),
        )
        w = torch.randn(2 * size * rng.randint(1, 3), size * rng.randint(1, 3))
        for name in ("column_shard", "row_shard", "gate_up_shard"):
            assert torch.equal(lab10[name](w, rank, size), getattr(reference, name)(w, rank, size)), name


def test_lab10_forwards_agree_with_nanolab_on_every_rank(lab10):
    torch.manual_seed(0)
    x = torch.randn(5, 16)
    up, up_b, down, down_b = (
        torch.randn(64, 16) / 4,
        torch.randn(64),
        torch.randn(16, 32) / 4,
        torch.randn(16),
    )
    for act, w in (("gelu", up[:32]), ("swiglu", up)):
        bias = up_b[: w.shape[0]] if act == "gelu" else None
        whole = mlp_forward(x, w, bias, down, down_b, act, reference.TPShard())
        cut = reference.gate_up_shard if act == "swiglu" else reference.column_shard
        shards = [
            (
                cut(w, r, 2),
                None if bias is None else reference.column_shard(bias, r, 2),
                reference.row_shard(down, r, 2),
                down_b,
            )
            for r in range(2)
        ]
        outs, calls = run_mlp_ranks(lab10["mlp_forward"], x, shards, act)
        assert calls == 1 and all(torch.allclose(o, whole, atol=1e-5) for o in outs)
    qkv, out = torch.randn(8 * 2 + 2 * 2 * 2, 16) / 4, torch.randn(16, 16) / 4  # 8 heads of 2, 2 KV heads
    pos = torch.arange(5)
    inv = 1.0 / 10000 ** (torch.arange(0, 2, 2).float() / 2)
    ang = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    rope = (ang.cos()[:, None], ang.sin()[:, None])
    whole = attention_forward(
        x, qkv, None, out, None, 8, 2, rope, dense_causal_attention, reference.TPShard()
    )
    for size in (2, 4):
        shards = []
        for r in range(size):
            heads, kv = reference.head_ranges(8, 2, r, size)
            shards.append(
                (
                    reference.qkv_shard(qkv, 8, 2, r, size),
                    None,
                    reference.row_shard(out, r, size),
                    None,
                    len(heads),
                    len(kv),
                )
            )
        outs, calls = run_attention_ranks(lab10["attention_forward"], x, shards, rope)
        assert calls == 1 and all(torch.allclose(o, whole, atol=1e-5) for o in outs)


def test_setup_threads_sum_like_nanolabs_local_group():
    """run_ranks' LocalGroup sums as nanolab's does, counts sums and bytes, and a failing rank's error (not a
    broken barrier) reaches the caller; the setup's RoPE and attention are nanolab's."""
    parts = [torch.randn(3, 4) for _ in range(4)]
    outs, group = run_ranks(4, lambda tp: tp.all_reduce(parts[tp.rank].clone()))
    want = reference.run_ranks(4, lambda r, g: reference.TPShard(r, 4, g).all_reduce(parts[r].clone()))
    assert all(torch.allclose(o, w) for o, w in zip(outs, want))
    assert (group.calls, group.bytes) == (1, parts[0].nbytes)
    assert TP().all_reduce(parts[0]) is parts[0]

    def fails_on_rank_1(tp):
        if tp.rank == 1:
            raise KeyError("rank 1's own error")
        return tp.all_reduce(torch.ones(1))

    with pytest.raises(KeyError, match="rank 1's own error"):
        run_ranks(2, fails_on_rank_1)
    x, cos, sin = torch.randn(5, 3, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8)
    assert torch.allclose(apply_rope(x, cos, sin), nanolab_rope(x, cos, sin))
    q, k, v = torch.randn(6, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    assert torch.allclose(causal_attend(q, k, v), dense_causal_attention(q, k, v), atol=1e-6)
