"""The paged KV cache's `prepare` and `attend`: what every layer of the engine calls.

`attend` writes each layer's new keys and values and runs attention over the whole batch: decodes in
one call, short chunks after a cached prefix in one C++ call, other chunks one by one. Each backend is
compared here with dense float64 attention over the same tokens (atol = rtol = 1e-5), on a batch shaped
as the engine lays it out, with the queries a strided view as the model passes them.
"""

from __future__ import annotations

import pytest
import torch

from nanolab.memory.paged_attention import HAS_CPP_KERNEL
from nanolab.memory.paged_kv_cache import PagedKVCache, SeqSlice
from nanolab.model.attention import dense_causal_attention
from nanolab.model.config import ModelConfig

TOL = {"atol": 1e-5, "rtol": 1e-5}
BACKENDS = [
    "auto",
    "torch",
    pytest.param("cpp", marks=pytest.mark.skipif(not HAS_CPP_KERNEL, reason="no C++ kernel")),
]
CONFIG = ModelConfig(arch="llama", n_layers=2, n_heads=4, n_kv_heads=2, d_model=64)
BLOCK = 4


def run_steps(backend: str, steps: list[list[tuple[int, int]]], seed: int = 0):
    """Run `steps` (each a list of (sequence, new tokens)) through a cache; return each step's attention
    output per layer and, for checking, every sequence's keys, values and queries so far.

    Sequence s owns blocks [8s, 8s + 8) in reverse order, so its blocks are not in token order.
    """
    cache = PagedKVCache(CONFIG, num_blocks=40, block_size=BLOCK, attention_backend=backend)
    gen = torch.Generator().manual_seed(seed)
    nh, nkv, hd = CONFIG.n_heads, CONFIG.n_kv_heads, CONFIG.head_dim
    seen = {}  # sequence -> tokens so far
    history = {}  # (layer, sequence) -> list of (q, k, v) per token
    outputs = []
    for step in steps:
        slices = [SeqSlice(list(range(8 * s + 7, 8 * s - 1, -1)), seen.get(s, 0), n) for s, n in step]
        positions = cache.prepare(slices)
        T = sum(n for _, n in step)
        assert positions.tolist() == [p for _, start, n in slices for p in range(start, start + n)]
        per_layer = []
        for layer in range(CONFIG.n_layers):
            # The model's layout: q, k and v are views of one (T, nh + 2 nkv, hd) projection.
            heads = torch.randn(T, nh + 2 * nkv, hd, generator=gen)
            q, k, v = heads.split((nh, nkv, nkv), dim=1)
            assert not q.is_contiguous()
            per_layer.append(cache.attend(layer, q, k, v))
            row = 0
            for s, n in step:
                for i in range(n):
                    history.setdefault((layer, s), []).append((q[row + i], k[row + i], v[row + i]))
                row += n
        for s, n in step:
            seen[s] = seen.get(s, 0) + n
        outputs.append((step, per_layer, {key: list(h) for key, h in history.items()}))
    return outputs


def expected(step, layer, history) -> torch.Tensor:
    """Dense float64 attention for this step's new tokens of every sequence, in batch order."""
    rows = []
    for s, n in step:
        q, k, v = (torch.stack(x).double() for x in zip(*history[(layer, s)]))
        rows.append(dense_causal_attention(q, k, v)[-n:].float())
    return torch.cat(rows)


# Prefill (fresh chunks), then decodes only, then decodes with short chunks after a cached prefix
# (one call of the C++ kernel) and a long chunk after one (a paged prefill), then decodes again.
STEPS = [
    [(0, 5), (1, 3), (2, 2)],
    [(0, 1), (1, 1), (2, 1)],
    [(0, 1), (1, 1), (2, 3), (3, 6)],
    [(0, 1), (1, 1), (2, 1), (3, 1)],
    [(0, 1), (3, 12)],
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_attend_equals_dense_attention_on_every_kind_of_step(backend):
    for step, per_layer, history in run_steps(backend, STEPS):
        for layer, got in enumerate(per_layer):
            assert got.shape == (sum(n for _, n in step), CONFIG.n_heads, CONFIG.head_dim)
            torch.testing.assert_close(got, expected(step, layer, history), **TOL)


@pytest.mark.skipif(not HAS_CPP_KERNEL, reason="no C++ kernel")
def test_the_kernel_and_torch_give_the_same_steps():
    for (_, got, _), (_, want, _) in zip(run_steps("cpp", STEPS, seed=3), run_steps("torch", STEPS, seed=3)):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **TOL)


def test_prepare_refuses_a_block_outside_the_pool_before_any_layer_writes():
    cache = PagedKVCache(CONFIG, num_blocks=4, block_size=BLOCK)
    with pytest.raises(ValueError, match=r"slot 17, but the pool has 16 slots \(4 blocks of 4\)"):
        cache.prepare([SeqSlice([0, 4], 4, 2)])  # block 4 of a pool of 4
    with pytest.raises(ValueError, match="slot -3"):
        cache.prepare([SeqSlice([-1], 1, 1)])
    assert all(bool((t == 0).all()) for t in cache.k + cache.v)
