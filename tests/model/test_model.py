"""The transformer and its KV cache seam: the cached, flattened serving forward equals a plain forward."""

from __future__ import annotations

import doctest
import math

import pytest
import torch
from helpers.engine_utils import spread_out
from hypothesis import given, settings
from hypothesis import strategies as st

import nanolab.model.kv_cache
from nanolab.model.config import ModelConfig
from nanolab.model.kv_cache import ContiguousKVCache, KVCacheProtocol, kv_cache_bytes
from nanolab.model.transformer import Transformer, apply_rope, rope_tables

CONFIGS = {
    "gpt2": ModelConfig(arch="gpt2", vocab_size=80, n_layers=2, n_heads=4, n_kv_heads=4, d_model=32, d_ff=64,
                        max_seq_len=48),
    "llama_gqa": ModelConfig(arch="llama", vocab_size=80, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, d_ff=48,
                             max_seq_len=48, tie_embeddings=False, qkv_bias=True),
    "llama_mqa": ModelConfig(arch="llama", vocab_size=80, n_layers=3, n_heads=4, n_kv_heads=1, d_model=32, d_ff=48,
                             max_seq_len=48, rope_theta=500.0),
}  # fmt: skip


@pytest.fixture(params=sorted(CONFIGS))
def model(request) -> Transformer:
    return spread_out(Transformer(CONFIGS[request.param]))


class DenseTestCache:
    """An independent oracle cache for many sequences: per-sequence key/value lists, explicit softmax.

    ``layout`` lists (sequence id, number of new tokens) in the order the tokens are flattened.
    """

    def __init__(self) -> None:
        self.keys: dict[tuple[int, int], torch.Tensor] = {}  # (seq, layer) -> (L, nkv, hs)
        self.values: dict[tuple[int, int], torch.Tensor] = {}
        self.layout: list[tuple[int, int]] = []

    def attend(self, layer, q, k, v):
        out, at = [], 0
        for seq, n in self.layout:
            key = (seq, layer)
            empty = k.new_zeros(0, *k.shape[1:])
            self.keys[key] = K = torch.cat([self.keys.get(key, empty), k[at : at + n]])
            self.values[key] = V = torch.cat([self.values.get(key, empty), v[at : at + n]])
            L, group = K.shape[0], q.shape[1] // k.shape[1]
            K, V = K.repeat_interleave(group, dim=1), V.repeat_interleave(group, dim=1)  # (L, nh, hs)
            scores = torch.einsum("thd,lhd->htl", q[at : at + n], K) / math.sqrt(q.shape[-1])
            visible = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]  # (n, L)
            probs = scores.masked_fill(~visible, -math.inf).softmax(dim=-1)
            out.append(torch.einsum("htl,lhd->thd", probs, V))
            at += n
        assert at == q.shape[0]
        return torch.cat(out)


def test_config_round_trips_through_a_dict():
    for config in CONFIGS.values():
        assert ModelConfig.from_dict(config.to_dict()) == config
    assert CONFIGS["llama_gqa"].head_dim == 8 and CONFIGS["llama_gqa"].kv_size == 16


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(arch="bert"), "arch must be one of"),
        (dict(n_heads=4, n_kv_heads=3), "multiple of n_kv_heads"),
        (dict(d_model=30, n_heads=4), "multiple of n_heads"),
        (dict(arch="gpt2", n_kv_heads=2), "grouped-query"),
        (dict(n_layers=0), "n_layers must be a positive integer"),
        (dict(d_model=12, n_heads=4, n_kv_heads=4), "even head_dim"),
    ],
)
def test_config_rejects_impossible_shapes_with_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


def test_from_dict_names_unknown_keys():
    with pytest.raises(ValueError, match="n_embd"):
        ModelConfig.from_dict({**ModelConfig().to_dict(), "n_embd": 3})


def test_tied_embeddings_share_one_tensor_and_count_once():
    tied = Transformer(ModelConfig(tie_embeddings=True))
    untied = Transformer(ModelConfig(tie_embeddings=False))
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert untied.num_parameters() - tied.num_parameters() == tied.tok_emb.weight.numel()


@torch.no_grad()
def test_prefill_then_decode_through_the_contiguous_cache_equals_the_plain_forward(model):
    """Logits of every position agree whether the sequence goes through at once or token by token."""
    ids = torch.randint(0, model.config.vocab_size, (20,))
    expected = model.logits(ids[None])[0]  # (20, V)
    cache = ContiguousKVCache(model.config, max_seq_len=24)
    got = [model.compute_logits(model(ids[:7], cache.prepare(7), cache))]  # prefill of 7 tokens
    for t in range(7, 20):  # then one token per forward
        got.append(model.compute_logits(model(ids[t : t + 1], cache.prepare(1), cache)))
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-5, rtol=1e-5)
    assert cache.length == 20


@torch.no_grad()
def test_prefill_in_chunks_attends_to_the_earlier_chunks(model):
    """A second multi-token chunk sees the cached context and is causal within itself."""
    ids = torch.randint(0, model.config.vocab_size, (15,))
    expected = model.logits(ids[None])[0]
    cache = ContiguousKVCache(model.config)
    got = [
        model.compute_logits(model(ids[a:b], cache.prepare(b - a), cache))
        for a, b in [(0, 4), (4, 11), (11, 15)]
    ]
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_flattened_forward_of_many_sequences_equals_each_sequence_alone(model):
    """Tokens of different sequences, mixed in one forward (prefills and decodes), do not interact."""
    torch.manual_seed(1)
    V = model.config.vocab_size
    seqs = [torch.randint(0, V, (n,)) for n in (9, 3, 14)]
    expected = [model.logits(s[None])[0] for s in seqs]
    cache = DenseTestCache()
    done = [0, 0, 0]
    # step 1: prefill seq 0 (5 tokens) and seq 1 (3); step 2: decode seq 0 and 1, prefill seq 2 (14); ...
    steps = [[(0, 5), (1, 3)], [(0, 1), (1, 0), (2, 14)], [(2, 0), (0, 3)]]
    for step in steps:
        layout = [(s, n) for s, n in step if n]
        ids = torch.cat([seqs[s][done[s] : done[s] + n] for s, n in layout])
        positions = torch.cat([torch.arange(done[s], done[s] + n) for s, n in layout])
        cache.layout = layout
        logits = model.compute_logits(model(ids, positions, cache))
        at = 0
        for s, n in layout:
            torch.testing.assert_close(
                logits[at : at + n], expected[s][done[s] : done[s] + n], atol=1e-5, rtol=1e-5
            )
            at, done[s] = at + n, done[s] + n
    assert done == [9, 3, 14]


def test_logits_of_a_batch_equal_logits_of_each_row(model):
    ids = torch.randint(0, model.config.vocab_size, (3, 10))
    with torch.no_grad():
        batch = model.logits(ids)
        rows = torch.cat([model.logits(ids[i : i + 1]) for i in range(3)])
    assert batch.shape == (3, 10, model.config.vocab_size)
    torch.testing.assert_close(batch, rows, atol=1e-5, rtol=1e-5)


def test_logits_rejects_sequences_longer_than_the_model():
    model = Transformer(CONFIGS["gpt2"])
    with pytest.raises(ValueError, match="exceeds max_seq_len 48"):
        model.logits(torch.zeros(1, 49, dtype=torch.long))


def test_from_state_dict_rebuilds_the_same_model_and_names_bad_tensors():
    model = spread_out(Transformer(CONFIGS["llama_gqa"]))
    state = model.state_dict()
    again = Transformer.from_state_dict(model.config, state)
    ids = torch.randint(0, 80, (2, 6))
    with torch.no_grad():
        assert torch.equal(again.logits(ids), model.logits(ids))
    with pytest.raises(ValueError, match=r"missing tensors \['norm.weight'\]"):
        Transformer.from_state_dict(model.config, {k: v for k, v in state.items() if k != "norm.weight"})
    with pytest.raises(ValueError, match="unexpected tensors \\['extra'\\]"):
        Transformer.from_state_dict(model.config, {**state, "extra": torch.zeros(1)})
    with pytest.raises(ValueError, match="'tok_emb.weight' in the state dict has shape"):
        Transformer.from_state_dict(model.config, {**state, "tok_emb.weight": torch.zeros(3, 32)})


def test_contiguous_cache_satisfies_the_protocol_and_reports_its_memory():
    config = CONFIGS["llama_gqa"]
    cache = ContiguousKVCache(config, max_seq_len=10)
    assert isinstance(cache, KVCacheProtocol)
    assert cache.nbytes == kv_cache_bytes(config, 10) == 2 * 2 * 2 * 8 * 4 * 10
    assert kv_cache_bytes(config, 10, torch.bfloat16) == cache.nbytes // 2


def test_contiguous_cache_hands_out_positions_and_refuses_to_overflow():
    cache = ContiguousKVCache(CONFIGS["gpt2"], max_seq_len=6)
    assert cache.prepare(4).tolist() == [0, 1, 2, 3]
    assert cache.prepare(2).tolist() == [4, 5] and cache.length == 6
    with pytest.raises(ValueError, match="holds 6 tokens and 1 more would pass its max_seq_len 6"):
        cache.prepare(1)
    with pytest.raises(ValueError, match="at least 1"):
        cache.prepare(0)
    cache.reset()
    assert cache.prepare(1).tolist() == [0]
    with pytest.raises(ValueError, match="max_seq_len must be in"):
        ContiguousKVCache(CONFIGS["gpt2"], max_seq_len=49)


def test_contiguous_cache_refuses_a_forward_it_was_not_prepared_for():
    model = Transformer(CONFIGS["gpt2"])
    cache = ContiguousKVCache(model.config)
    cache.prepare(2)
    with pytest.raises(ValueError, match="brought 3 tokens but prepare\\(\\) was told 2"):
        model(torch.tensor([1, 2, 3]), torch.arange(3), cache)


def test_docstring_examples_run():
    assert doctest.testmod(nanolab.model.kv_cache).failed == 0


@settings(max_examples=30, deadline=None)
@given(m=st.integers(0, 23), n=st.integers(0, 23), shift=st.integers(0, 24))  # all < max_seq_len 48
def test_rope_scores_depend_only_on_the_distance_between_positions(m, n, shift):
    """<rope(q, m), rope(k, n)> == <rope(q, m + s), rope(k, n + s)>: RoPE encodes relative position."""
    cos, sin = rope_tables(CONFIGS["llama_gqa"])
    g = torch.Generator().manual_seed(m * 100 + n)
    q, k = torch.randn(2, 1, 8, generator=g, dtype=torch.float64)  # one head of head_dim 8

    def score(a, b):
        qa = apply_rope(q, cos[a].double()[None], sin[a].double()[None])
        kb = apply_rope(k, cos[b].double()[None], sin[b].double()[None])
        return (qa * kb).sum()

    assert torch.isclose(score(m, n), score(m + shift, n + shift), atol=1e-5)
    assert torch.isclose(apply_rope(q, cos[m].double()[None], sin[m].double()[None]).norm(), q.norm())
