"""Hidden tests for Lab 2 (attention and the KV cache): the learner's attention, cache, memory calculator
and sampler against nanolab's reference, and the learner's cache driving real models.

Each test reaches the learner's code through the ``lab`` fixture (a sandboxed process) and draws its
inputs from ``rng``, seeded afresh for every grading run. Tensors cross as plain data: what comes back
is a fresh, plain ``torch.Tensor`` decoded here, so no object of the learner's takes part in a
comparison. The models run here, in the grader: `SandboxedCache` is the `KVCacheProtocol` they are
given, and it sends each layer's q, k, v to the learner's cache in the sandbox and takes back the
attention. Feedback says what is wrong and on what shapes; it never shows the expected output.
"""

from __future__ import annotations

import math

import pytest
import torch

import nanolab
from autograder.testing import bundled_model, expect, expect_value_error, spread_out, stdlib_text
from nanolab.model.attention import dense_causal_attention
from nanolab.model.config import ModelConfig
from nanolab.model.kv_cache import ContiguousKVCache as ReferenceCache
from nanolab.model.kv_cache import kv_cache_bytes
from nanolab.model.sampling import SamplingParams, filter_logits
from nanolab.model.transformer import Transformer

STDLIB_FILES = ("textwrap.py", "heapq.py", "bisect.py", "shlex.py", "fnmatch.py", "string.py")

# Public config.json numbers (Hugging Face hub): layers, query heads, KV heads, width, context.
REAL_MODELS = {
    "GPT-2 small": ModelConfig(
        arch="gpt2", n_layers=12, n_heads=12, n_kv_heads=12, d_model=768, max_seq_len=1024
    ),
    "GPT-2 XL": ModelConfig(
        arch="gpt2", n_layers=48, n_heads=25, n_kv_heads=25, d_model=1600, max_seq_len=1024
    ),
    "Qwen2-0.5B": ModelConfig(n_layers=24, n_heads=14, n_kv_heads=2, d_model=896, max_seq_len=32768),
    "Llama-2-7B": ModelConfig(n_layers=32, n_heads=32, n_kv_heads=32, d_model=4096, max_seq_len=4096),
    "Llama-3-8B": ModelConfig(n_layers=32, n_heads=32, n_kv_heads=8, d_model=4096, max_seq_len=8192),
    "Mistral-7B": ModelConfig(n_layers=32, n_heads=32, n_kv_heads=8, d_model=4096, max_seq_len=32768),
    "Llama-2-70B": ModelConfig(n_layers=80, n_heads=64, n_kv_heads=8, d_model=8192, max_seq_len=4096),
}
DTYPES = ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn")


# ---------------------------------------------------------------------------------------------- helpers


def tensors(rng) -> torch.Generator:
    """A torch generator seeded from the test's rng (so tensors differ from run to run as well)."""
    return torch.Generator().manual_seed(rng.randrange(2**31))


def as_tensor(value, what: str, shape: tuple[int, ...] | None = None, floating: bool = True) -> torch.Tensor:
    """``value`` checked to be a tensor of ``shape`` (floating point, or int64 when not ``floating``)."""
    expect(value, torch.Tensor, what)
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise AssertionError(
            f"{what} should have shape {tuple(shape)}, but it has shape {tuple(value.shape)}"
        )
    if floating and not value.is_floating_point():
        raise AssertionError(f"{what} should be a floating-point tensor, not {value.dtype}")
    if not floating and value.dtype != torch.int64:
        raise AssertionError(f"{what} should be an int64 tensor, not {value.dtype}")
    return value


def _count(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> bool:
    return bool(torch.allclose(got.double(), want.double(), atol=tol, rtol=tol))


def shape_of(lab, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, max_seq_len: int):
    """The notebook's `ModelShape` (made in the sandbox) and the same shape as a reference `ModelConfig`."""
    fields = dict(n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, d_model=n_heads * head_dim)
    return lab.ModelShape(**fields, max_seq_len=max_seq_len), ModelConfig(**fields, max_seq_len=max_seq_len)


def attention_variants(q, k, v, scale):
    """Plausible mistakes, for feedback: (description, output) pairs in float64."""
    T, n_heads, head_dim = q.shape
    L, n_kv = k.shape[0], k.shape[1]
    q, k, v = q.double(), k.double(), v.double()
    group = n_heads // n_kv

    def attend(k_heads, v_heads, scale, masked=True, axis=-1):
        scores = torch.einsum("thd,lhd->htl", q, k_heads) * scale
        if masked:
            future = torch.arange(L)[None, :] > torch.arange(L - T, L)[:, None]
            scores = scores.masked_fill(future, -math.inf)
        return torch.einsum("htl,lhd->thd", scores.softmax(dim=axis).nan_to_num(), v_heads)

    right = 1 / math.sqrt(head_dim) if scale is None else scale
    interleaved = (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
    out = [
        ("no causal mask: tokens see the tokens after them", attend(*interleaved, right, masked=False)),
        (
            "the softmax runs over the wrong axis (it should run over the keys)",
            attend(*interleaved, right, axis=-2),
        ),
    ]
    if scale is None:
        out.append(("the scores are not scaled by 1/sqrt(head_dim)", attend(*interleaved, 1.0)))
    else:
        out.append(("the `scale` argument is ignored", attend(*interleaved, 1 / math.sqrt(head_dim))))
    if 1 < group < n_heads:
        out.append(
            (
                "query heads read the wrong kv heads: head h reads kv head h // (n_heads // n_kv_heads)",
                attend(k.repeat(1, group, 1), v.repeat(1, group, 1), right),
            )
        )
    if L > T:
        out.append(
            ("the queries should be the last T of the L tokens", _first_positions(q, *interleaved, right))
        )
    return out


def _first_positions(q, k, v, scale):
    """Attention as if query i sat at position i (instead of L - T + i)."""
    T, L = q.shape[0], k.shape[0]
    scores = torch.einsum("thd,lhd->htl", q, k) * scale
    scores = scores.masked_fill(torch.arange(L)[None, :] > torch.arange(T)[:, None], -math.inf)
    return torch.einsum("htl,lhd->thd", scores.softmax(dim=-1), v)


def diagnose(q, k, v, scale, got) -> str:
    for description, output in attention_variants(q, k, v, scale):
        if close(got, output, 1e-4):
            return f"; it looks like {description}"
    return ""


def reference_attention(q_full, k, v, scale=None) -> torch.Tensor:
    """The reference's causal attention over the whole sequence, in float64."""
    return dense_causal_attention(q_full.double(), k.double(), v.double(), scale)


class SandboxedCache:
    """A `KVCacheProtocol` for a model running here: each layer's attention runs in the learner's cache."""

    def __init__(self, remote, heads: tuple[int, int]):
        self.remote = remote
        self._attend = remote.attend
        self.n_heads, self.head_dim = heads
        self.length = 0

    def prepare(self, num_new: int) -> torch.Tensor:
        start = self.length
        positions = self.remote.prepare(num_new)
        as_tensor(positions, f"prepare({num_new})", (num_new,), floating=False)
        if not torch.equal(positions, torch.arange(start, start + num_new)):
            raise AssertionError(
                f"prepare({num_new}) with {start} tokens cached should return the positions "
                f"{start}..{start + num_new - 1}"
            )
        self.length += num_new
        return positions

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = self._attend(layer, q, k, v)
        shape = (q.shape[0], self.n_heads, self.head_dim)
        what = f"attend(layer={layer}, ...) with {q.shape[0]} new tokens"
        return as_tensor(out, what, shape).to(q.dtype)


pytestmark = pytest.mark.usefixtures("torch_on_one_thread")


# ---------------------------------------------------------------------------------------------- attention


@pytest.mark.points(2)
def test_causal_attention_matches_the_reference(lab, rng):
    """Check that causal_attention matches the reference on random shapes: MHA, GQA, MQA, any scale."""
    g = tensors(rng)
    shapes = [(1, 1, 1, 4), (5, 4, 4, 8), (7, 8, 2, 16), (9, 6, 1, 8)]
    for _ in range(8):
        n_kv = rng.choice([1, 2, 3, 4])
        shapes.append((rng.randint(1, 24), n_kv * rng.choice([1, 2, 4]), n_kv, rng.choice([2, 8, 16, 32])))
    for T, nh, nkv, hs in shapes:
        q, k, v = (
            torch.randn(T, nh, hs, generator=g),
            torch.randn(T, nkv, hs, generator=g),
            torch.randn(T, nkv, hs, generator=g),
        )
        scale = rng.choice([None, None, round(rng.uniform(0.05, 1.0), 3)])
        got = lab.causal_attention(q, k, v) if scale is None else lab.causal_attention(q, k, v, scale=scale)
        what = f"causal_attention on q {tuple(q.shape)}, k and v {tuple(k.shape)}" + (
            f", scale={scale}" if scale is not None else ""
        )
        as_tensor(got, what, (T, nh, hs))
        if not close(got, reference_attention(q, k, v, scale)):
            raise AssertionError(f"{what} differs from the reference{diagnose(q, k, v, scale, got)}")


def test_future_tokens_have_no_influence(lab, rng):
    """Check that changing the keys, values or queries of later tokens never changes an earlier token's output,
    and that each output is a weighted average of the values (the weights add up to 1)."""
    g = tensors(rng)
    for _ in range(6):
        T, nkv = rng.randint(2, 14), rng.choice([1, 2, 4])
        nh, hs = nkv * rng.choice([1, 2]), rng.choice([4, 8])
        q, k, v = (
            torch.randn(T, nh, hs, generator=g),
            torch.randn(T, nkv, hs, generator=g),
            torch.randn(T, nkv, hs, generator=g),
        )
        base = as_tensor(lab.causal_attention(q, k, v), "causal_attention(q, k, v)", (T, nh, hs))
        i = rng.randrange(T - 1)  # tokens i+1.. change
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        q2[i + 1 :] = 3 * torch.randn(T - i - 1, nh, hs, generator=g)
        k2[i + 1 :] = 3 * torch.randn(T - i - 1, nkv, hs, generator=g)
        v2[i + 1 :] = 3 * torch.randn(T - i - 1, nkv, hs, generator=g)
        out = as_tensor(lab.causal_attention(q2, k2, v2), "causal_attention(q, k, v)", (T, nh, hs))
        assert close(out[: i + 1], base[: i + 1], 1e-5), (
            f"in a sequence of {T} tokens, changing tokens {i + 1}..{T - 1} changed the output of token {i} (or "
            "earlier ones): a token must not look at the tokens after it"
        )
        assert not close(out[i + 1 :], base[i + 1 :], 1e-3), (
            "changing the later tokens' queries, keys and values did not change their own outputs"
        )
        shifted = as_tensor(lab.causal_attention(q, k, v + 1), "causal_attention(q, k, v + 1)", (T, nh, hs))
        assert close(shifted, base + 1, 1e-4), (
            f"in a sequence of {T} tokens, adding 1 to every value did not add 1 to every output: each output "
            "should be a weighted average of the values it may see, with weights that add up to 1"
        )


def test_queries_are_the_last_tokens_of_a_longer_sequence(lab, rng):
    """Check that T queries over L > T keys are the last T tokens: decode steps and chunks of a longer sequence."""
    g = tensors(rng)
    for T in [1, 1, 2, 3, rng.randint(4, 10), rng.randint(1, 10)]:
        L = T + rng.randint(1, 20)
        nkv = rng.choice([1, 2, 4])
        nh, hs = nkv * rng.choice([1, 2, 3]), rng.choice([4, 8, 16])
        q_full = torch.randn(L, nh, hs, generator=g)
        k, v = torch.randn(L, nkv, hs, generator=g), torch.randn(L, nkv, hs, generator=g)
        what = f"causal_attention with {_count(T, 'query', 'queries')} and {L} keys/values (heads {nh}/{nkv})"
        got = as_tensor(lab.causal_attention(q_full[-T:], k, v), what, (T, nh, hs))
        if not close(got, reference_attention(q_full, k, v)[-T:]):
            hint = diagnose(q_full[-T:], k, v, None, got)
            raise AssertionError(
                f"{what} differs from the last {_count(T, 'row')} of attention over the whole sequence{hint}"
            )


ATTENTION_DTYPES = ((torch.float64, 1e-6), (torch.bfloat16, 5e-2), (torch.float16, 5e-3))


def test_attention_keeps_the_dtype(lab, rng):
    """Check that causal_attention returns a tensor of q's dtype (float64, bfloat16, float16) with the reference's
    values."""
    _attention_in_every_dtype(lab, rng, check_inputs=False)


@pytest.mark.points(0.5)  # a check on inputs left unchanged weighs little (autograder/README.md)
def test_attention_leaves_its_inputs_unchanged(lab, rng):
    """Check that causal_attention leaves the q, k and v it is given as they were."""
    _attention_in_every_dtype(lab, rng, check_inputs=True)


def _attention_in_every_dtype(lab, rng, check_inputs: bool) -> None:
    g = tensors(rng)
    for dtype, tol in ATTENTION_DTYPES:
        T = rng.randint(2, 9)
        L = T + rng.choice([0, rng.randint(1, 6)])
        nkv = rng.choice([1, 2])
        nh, hs = nkv * rng.choice([1, 2, 4]), rng.choice([4, 8, 16])
        q_full = torch.randn(L, nh, hs, generator=g).to(dtype)
        k, v = torch.randn(L, nkv, hs, generator=g).to(dtype), torch.randn(L, nkv, hs, generator=g).to(dtype)
        q = q_full[-T:].clone()
        name = str(dtype).removeprefix("torch.")
        what = f"causal_attention on {name} q {tuple(q.shape)}, k and v {tuple(k.shape)}"
        held = [lab.hold(x) for x in (q, k, v)]  # the tensors themselves reach the learner's function
        got = as_tensor(lab.causal_attention(*held), what, (T, nh, hs))
        assert got.dtype == dtype, f"{what} returned {got.dtype}: the output should have the dtype of q"
        for label, before, handle in zip("qkv", (q, k, v), held if check_inputs else ()):
            after = as_tensor(lab.peek(handle), f"the {label} given to causal_attention")
            assert torch.equal(after, before), (
                f"{what} changed the {label} it was given; compute into new tensors instead of writing into it"
            )
        assert close(got, reference_attention(q_full, k, v)[-T:], tol), f"{what} differs from the reference"


# ---------------------------------------------------------------------------------------------- the cache


def _chunks(rng, total: int) -> list[int]:
    """A prefill, then mostly single decode steps with a few multi-token forwards, summing to ``total``."""
    sizes = [rng.randint(1, max(1, total // 2))]
    while sum(sizes) < total:
        sizes.append(min(total - sum(sizes), 1 if rng.random() < 0.75 else rng.randint(2, 4)))
    return sizes


@pytest.mark.points(2)
def test_decode_with_the_cache_equals_full_recompute(lab, rng):
    """Check that a prefill, decode steps and chunks through the cache give the attention of the whole sequence (MHA, GQA, MQA)."""
    g = tensors(rng)
    for n_layers, nh, nkv, hs in [(2, 4, 4, 8), (3, 8, 2, 8), (1, 4, 1, 16), (2, 6, 3, 4)]:
        max_len = rng.randint(10, 32)
        shape, _ = shape_of(lab, n_layers, nh, nkv, hs, max_len)
        cache = lab.ContiguousKVCache(shape)
        attend = cache.attend
        total = rng.randint(max_len // 2, max_len)
        q = torch.randn(n_layers, total, nh, hs, generator=g)
        k, v = (
            torch.randn(n_layers, total, nkv, hs, generator=g),
            torch.randn(n_layers, total, nkv, hs, generator=g),
        )
        want = [reference_attention(q[layer], k[layer], v[layer]) for layer in range(n_layers)]
        pos = 0
        for n in _chunks(rng, total):
            positions = as_tensor(cache.prepare(n), f"prepare({n})", (n,), floating=False)
            assert torch.equal(positions, torch.arange(pos, pos + n)), (
                f"prepare({n}) with {pos} tokens cached should return the positions {pos}..{pos + n - 1}"
            )
            for layer in range(n_layers):
                sl = slice(pos, pos + n)
                what = f"attend(layer={layer}, ...) with {_count(n, 'new token')} after {pos} cached (heads {nh}/{nkv})"
                got = as_tensor(attend(layer, q[layer, sl], k[layer, sl], v[layer, sl]), what, (n, nh, hs))
                if not close(got, want[layer][sl]):
                    hint = (
                        ": the first forward is right but a later one is not, so look at where the new keys "
                        "and values are written and which cached ones are read"
                        if pos > 0
                        else ""
                    )
                    raise AssertionError(f"{what} differs from attention over the whole sequence{hint}")
            pos += n
        length = expect(cache.length, int, "cache.length")
        assert length == total, f"after {total} tokens went through the cache, its length should be {total}"


def test_cache_bookkeeping_and_errors(lab, rng):
    """Check the cache's contract: length, reset, nbytes, and ValueError for impossible requests."""
    g = tensors(rng)
    max_len = rng.randint(6, 20)
    shape, reference = shape_of(lab, 2, 4, 2, 8, max_len)
    cache = lab.ContiguousKVCache(shape)
    assert expect(cache.length, int, "cache.length") == 0, "a new cache should hold no tokens (length 0)"
    assert expect(cache.max_seq_len, int, "cache.max_seq_len") == max_len, (
        "max_seq_len should default to config.max_seq_len"
    )
    nbytes = expect(cache.nbytes, int, "cache.nbytes")
    assert nbytes == kv_cache_bytes(reference, max_len), (
        "nbytes is wrong: k and v should each be (n_layers, max_seq_len, n_kv_heads, head_dim) float32 tensors"
    )
    shorter = lab.ContiguousKVCache(shape, max_len - 2)
    assert shorter.nbytes == kv_cache_bytes(reference, max_len - 2), (
        "a cache of max_seq_len=m should hold m tokens"
    )
    for bad in (max_len + 1, 0):
        expect_value_error(
            lambda bad=bad: lab.ContiguousKVCache(shape, bad),
            f"ContiguousKVCache(config, {bad}) with config.max_seq_len={max_len} should raise ValueError",
        )
    k_new = as_tensor(cache.k, "cache.k", (2, max_len, 2, 8))
    assert not bool(k_new.any()) and not bool(as_tensor(cache.v, "cache.v", (2, max_len, 2, 8)).any()), (
        "a new cache's k and v should be zeros"
    )
    first = rng.randint(1, max_len - 3)
    cache.prepare(first)
    assert expect(cache.start, int, "cache.start") == 0, (
        f"after prepare({first}) on an empty cache, start should be 0"
    )
    too_many = max_len - first + 1
    expect_value_error(
        lambda: cache.prepare(too_many),
        f"prepare({too_many}) with {first} of {max_len} tokens cached should raise ValueError",
    )
    expect_value_error(lambda: cache.prepare(0), "prepare(0) should raise ValueError")
    assert (cache.length, cache.start) == (first, 0), (
        f"with {first} of {max_len} tokens cached, a refused prepare({too_many}) or prepare(0) changed length or "
        "start: check before changing anything, so that a refused call leaves the cache as it was"
    )
    positions = as_tensor(cache.prepare(1), "prepare(1)", (1,), floating=False)
    assert positions.tolist() == [first] and cache.start == first, (
        f"after a refused prepare, prepare(1) with {first} tokens cached should give position {first} and start "
        f"{first}"
    )
    cache.reset()
    assert cache.length == 0, "reset() should empty the cache"
    q, k, v = (
        torch.randn(3, 4, 8, generator=g),
        torch.randn(3, 2, 8, generator=g),
        torch.randn(3, 2, 8, generator=g),
    )
    positions = as_tensor(cache.prepare(3), "prepare(3)", (3,), floating=False)
    assert positions.tolist() == [0, 1, 2], "after reset() the next tokens should go to positions 0, 1, 2"
    got = as_tensor(cache.attend(0, q, k, v), "attend(0, ...) after reset()", (3, 4, 8))
    assert close(got, reference_attention(q, k, v)), (
        "after reset() attention should see only the new tokens, not the ones cached before"
    )
    cache.prepare(2)
    expect_value_error(
        lambda: cache.attend(0, q, k, v),
        "attend with 3 tokens after prepare(2) should raise ValueError (the forward does not match prepare)",
    )
    full = lab.ContiguousKVCache(shape)
    first = rng.randint(1, max_len - 1)
    full.prepare(first)
    positions = as_tensor(full.prepare(max_len - first), f"prepare({max_len - first})", floating=False)
    assert positions.tolist() == list(range(first, max_len)), (
        f"with {first} of {max_len} tokens cached, prepare({max_len - first}) fills the cache exactly: it should "
        "succeed and return the last positions"
    )
    expect_value_error(
        lambda: full.prepare(1), f"prepare(1) on a full cache of {max_len} should raise ValueError"
    )
    assert (full.length, full.start) == (max_len, first), (
        f"a refused prepare(1) on a full cache of {max_len} changed length or start; a refused call should leave "
        "the cache as it was"
    )
    for dtype_name in ("bfloat16", "float16"):
        small = lab.ContiguousKVCache(shape, max_len, getattr(lab.torch, dtype_name))
        k_dtype = as_tensor(small.k, "cache.k").dtype
        assert k_dtype == getattr(torch, dtype_name), (
            f"ContiguousKVCache(config, dtype=torch.{dtype_name}) holds {k_dtype} keys: use the dtype it is given"
        )
        assert small.nbytes == kv_cache_bytes(reference, max_len, getattr(torch, dtype_name)), (
            f"a {dtype_name} cache should take {getattr(torch, dtype_name).itemsize} bytes a number"
        )


@torch.inference_mode()
def _compare_in_model(
    lab, model: Transformer, tokenizer, prompt: list[int], max_new: int, label: str
) -> None:
    """Greedy generation through the learner's cache must pick `nanolab.generate`'s tokens: prefill the
    prompt, then feed the reference's tokens one at a time, with the reference cache alongside; at each
    step the logits must agree and the learner's argmax must be the reference's token."""
    tokens = nanolab.generate(model, tokenizer, prompt, max_new_tokens=max_new).token_ids
    c = model.config
    shape, _ = shape_of(lab, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.max_seq_len)
    mine = SandboxedCache(lab.ContiguousKVCache(shape, len(prompt) + len(tokens)), (c.n_heads, c.head_dim))
    theirs = ReferenceCache(c, len(prompt) + len(tokens))
    new = torch.tensor(prompt)
    for step, token in enumerate(tokens):
        positions = mine.prepare(len(new))
        got = model.compute_logits(model(new, positions, mine)[-1:])  # (1, V)
        want = model.compute_logits(model(new, theirs.prepare(len(new)), theirs)[-1:])
        gap = (got - want).abs().max().item()
        where = "the prefill" if step == 0 else f"decode step {step}"
        assert gap < 1e-3, (
            f"{label}: with your cache the logits after {where} ({len(prompt)}-token prompt) differ from the "
            f"reference's by up to {gap:.2g}"
        )
        top2 = want[0].topk(2).values
        if int(got.argmax()) != token and (top2[0] - top2[1]).item() > 1e-4:  # a near tie may go either way
            raise AssertionError(
                f"{label}: with your cache greedy decoding picks another token than nanolab.generate at {where}"
            )
        new = torch.tensor([token])


@pytest.mark.points(2)
def test_greedy_generation_with_your_cache_equals_the_reference(lab, rng):
    """Check that the bundled model generates nanolab.generate's greedy tokens with your cache, step by step."""
    model, tokenizer = bundled_model()
    text = stdlib_text(*STDLIB_FILES)
    for _ in range(2):
        start = rng.randrange(len(text) - 2000)
        prompt = tokenizer.encode(text[start : start + 2000])[: rng.randint(1, 60)]
        _compare_in_model(lab, model, tokenizer, prompt, rng.randint(12, 24), "the bundled model")


def test_your_cache_serves_both_model_families(lab, rng):
    """Check that your cache gives the reference's logits in random GPT-2 and Llama/Qwen2-style models (MHA, GQA)."""
    configs = [
        ModelConfig(
            arch="gpt2",
            vocab_size=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=4,
            d_model=32,
            d_ff=64,
            max_seq_len=48,
        ),
        ModelConfig(
            vocab_size=64,
            n_layers=3,
            n_heads=6,
            n_kv_heads=2,
            d_model=48,
            d_ff=64,
            max_seq_len=48,
            qkv_bias=True,
        ),
    ]
    for config in configs:
        model = spread_out(Transformer(config), rng.randrange(2**31))
        prompt = [rng.randrange(config.vocab_size) for _ in range(rng.randint(1, 16))]
        _compare_in_model(lab, model, None, prompt, rng.randint(8, 16), f"a random {config.arch} model")


# ---------------------------------------------------------------------------------------------- memory


@pytest.mark.points(2)
def test_kv_cache_bytes_on_real_model_configurations(lab, rng):
    """Check kv_cache_bytes against the reference for GPT-2, Qwen2, Llama 2/3, Mistral in several dtypes."""
    dtypes = {name: getattr(lab.torch, name) for name in DTYPES}  # the notebook's torch dtypes, as handles
    for name, config in REAL_MODELS.items():
        shape = lab.ModelShape(
            n_layers=config.n_layers,
            n_heads=config.n_heads,
            n_kv_heads=config.n_kv_heads,
            d_model=config.d_model,
            max_seq_len=config.max_seq_len,
        )
        for dtype_name in rng.sample(DTYPES, 3):
            dtype = getattr(torch, dtype_name)
            for tokens in (1, rng.randint(2, 5000), config.max_seq_len):
                got = expect(
                    lab.kv_cache_bytes(shape, tokens, dtypes[dtype_name]), int, "kv_cache_bytes(...)"
                )
                want = kv_cache_bytes(config, tokens, dtype)
                if got != want:
                    hints = [
                        (want // 2, "every token stores a key *and* a value"),
                        (
                            want * config.n_heads // config.n_kv_heads,
                            "count key/value heads, not query heads",
                        ),
                        (want // dtype.itemsize, "multiply by the bytes of one number (dtype.itemsize)"),
                    ]
                    hint = " or ".join(text for value, text in hints if value == got and value != want)
                    raise AssertionError(
                        f"kv_cache_bytes for {name} ({config.n_layers} layers, {config.n_heads} query heads, "
                        f"{config.n_kv_heads} KV heads, width {config.d_model}), {_count(tokens, 'token')} of {dtype_name} "
                        "is wrong" + (f": {hint}" if hint else "")
                    )
        got = lab.kv_cache_bytes(shape, 1000)
        assert got == kv_cache_bytes(config, 1000), "the default dtype should be float32 (4 bytes a number)"


# ---------------------------------------------------------------------------------------------- sampling


def _kept(logits: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(logits)


def _check_filtered(got, logits: torch.Tensor, want_kept: torch.Tensor, what: str) -> None:
    """``got`` keeps exactly ``want_kept``, with the input's values, and -inf everywhere else."""
    as_tensor(got, what, tuple(logits.shape))
    kept = _kept(got)
    if not torch.equal(kept, want_kept):
        few = (kept.sum(-1) < want_kept.sum(-1)).any().item()
        many = (kept.sum(-1) > want_kept.sum(-1)).any().item()
        hint = " (too few tokens)" if few and not many else " (too many tokens)" if many and not few else ""
        raise AssertionError(f"{what} keeps the wrong tokens{hint}")
    assert torch.equal(got[kept].to(logits.dtype), logits[kept]), (
        f"{what}: kept tokens must keep their logits unchanged"
    )
    assert bool((got[~kept] == -math.inf).all()), f"{what}: filtered tokens must be -inf (not 0 or NaN)"


@pytest.mark.points(0.5)  # a check on inputs left unchanged weighs little (autograder/README.md)
def test_filters_leave_their_input_unchanged(lab, rng):
    """Check that apply_top_k, apply_top_p and filter_logits return the right new tensor and leave the logits
    they are given as they were."""
    g = tensors(rng)
    top_p = None
    while top_p is None:
        V = rng.randint(10, 60)
        row = 2 * torch.randn(V, generator=g)
        top_p = _gap_top_p(rng, row.softmax(-1))
    logits = torch.stack(
        [row[torch.randperm(V, generator=g)] for _ in range(3)]
    )  # one distribution, 3 orders
    k = rng.randint(1, V - 1)
    params = [
        _params_of_kind(rng, kind, logits[b]) for b, kind in enumerate(("both", "greedy", "temperature"))
    ]
    want = {
        "apply_top_k": filter_logits(logits, [SamplingParams(top_k=k)] * 3),
        "apply_top_p": filter_logits(logits, [SamplingParams(top_p=top_p)] * 3),
        "filter_logits": filter_logits(logits, params),
    }
    calls = {
        "apply_top_k": lambda held: lab.apply_top_k(held, k),
        "apply_top_p": lambda held: lab.apply_top_p(held, top_p),
        "filter_logits": lambda held: lab.filter_logits(held, _learner_params(lab, params)),
    }
    for name, call in calls.items():
        held = lab.hold(logits)  # the tensor itself reaches the learner's function, not a copy
        got = as_tensor(call(held), f"{name}(...)", (3, V))
        assert torch.equal(_kept(got), _kept(want[name])), f"{name} on (3, {V}) logits keeps the wrong tokens"
        kept = _kept(got)
        assert close(got[kept], want[name][kept], 1e-5), (
            f"{name} on (3, {V}) logits changes the kept logits wrongly"
        )
        after = as_tensor(lab.peek(held), f"the logits given to {name}")
        assert torch.equal(after, logits), (
            f"{name} changed the logits it was given (3, {V}); return a new tensor instead of writing into them"
        )


def test_top_k_keeps_the_reference_tokens(lab, rng):
    """Check that apply_top_k keeps exactly the tokens the reference keeps: k=1, random k, k=V, k>V."""
    g = tensors(rng)
    for k_kind in ["one", "random", "random", "random", "all", "more", "random", "one"]:
        B, V = rng.randint(1, 4), rng.randint(2, 300)
        logits = rng.uniform(0.5, 5) * torch.randn(B, V, generator=g)
        k = {"one": 1, "all": V, "more": V + rng.randint(1, 10)}.get(k_kind) or rng.randint(1, V)
        want = filter_logits(logits, [SamplingParams(top_k=k)] * B)
        _check_filtered(
            lab.apply_top_k(logits, k), logits, _kept(want), f"apply_top_k on ({B}, {V}) logits, k={k}"
        )


def test_filters_work_on_any_leading_shape(lab, rng):
    """Check that apply_top_k and apply_top_p filter along the last axis of (V,) and (A, B, V) logits as they do
    row by row."""
    g = tensors(rng)
    V = rng.randint(6, 40)
    k = rng.randint(2, V - 2)
    for shape in ((V,), (2, 3, V)):
        logits = 2 * torch.randn(*shape, generator=g)
        rows = logits.reshape(-1, V)
        top_p = _gap_top_p(rng, rows[0].softmax(-1)) or 0.5
        for name, call, params in (
            ("apply_top_k", lambda x: lab.apply_top_k(x, k), SamplingParams(top_k=k)),
            ("apply_top_p", lambda x, top_p=top_p: lab.apply_top_p(x, top_p), SamplingParams(top_p=top_p)),
        ):
            arg = f"k={k}" if name == "apply_top_k" else f"top_p={top_p}"
            what = f"{name} on {tuple(shape)} logits, {arg}"
            got = as_tensor(call(logits), what, shape)
            want = torch.stack([filter_logits(row[None], [params])[0] for row in rows]).reshape(shape)
            if not torch.equal(_kept(got), _kept(want)):
                raise AssertionError(
                    f"{what} keeps other tokens than filtering each row alone: filter along the last axis "
                    "(the vocabulary), whatever the leading dimensions"
                )
            assert torch.equal(got[_kept(got)], logits[_kept(got)]), (
                f"{what}: kept logits must keep their values"
            )


def _gap_top_p(rng, probs: torch.Tensor) -> float | None:
    """A top_p at least 1e-4 away from every cumulative sum of the sorted probabilities (None if none is)."""
    cumulative = probs.double().sort(descending=True).values.cumsum(0).tolist()
    gaps = [
        (a, b) for a, b in zip([0.0, *cumulative], cumulative) if b - a > 3e-3 and b < 1 - 1e-4 and a < 0.999
    ]
    if not gaps:
        return None
    a, b = rng.choice(gaps)
    return round(a + rng.uniform(0.25, 0.75) * (b - a), 6)


@pytest.mark.points(2)
def test_top_p_keeps_the_reference_tokens(lab, rng):
    """Check that apply_top_p keeps exactly the reference's tokens: random top_p, top_p=1, tiny top_p, after top-k."""
    g = tensors(rng)
    cases = 0
    while cases < 14:
        V = rng.randint(2, 200)
        logits = rng.uniform(0.5, 4) * torch.randn(1, V, generator=g)
        top_p = _gap_top_p(rng, logits.softmax(-1)[0])
        if top_p is None:
            continue
        cases += 1
        if cases % 3 == 0:  # several rows: the same logits in other orders
            logits = torch.cat([logits, logits[:, torch.randperm(V, generator=g)]])
        want = filter_logits(logits, [SamplingParams(top_p=top_p)] * logits.shape[0])
        what = f"apply_top_p on ({logits.shape[0]}, {V}) logits with top_p={top_p}"
        _check_filtered(lab.apply_top_p(logits, top_p), logits, _kept(want), what)
    logits = 2 * torch.randn(2, 50, generator=g)
    _check_filtered(lab.apply_top_p(logits, 1.0), logits, _kept(logits), "apply_top_p(logits, 1.0)")
    peaked = torch.zeros(1, rng.randint(20, 200))
    peaked[0, rng.randrange(peaked.shape[1])] = rng.uniform(
        25, 35
    )  # one token has nearly all the probability
    what = "apply_top_p(logits, 1.0) on logits where one token has almost all the probability"
    _check_filtered(lab.apply_top_p(peaked, 1.0), peaked, _kept(peaked), what)
    only_best = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, logits.argmax(-1, keepdim=True), True)
    _check_filtered(lab.apply_top_p(logits, 1e-6), logits, only_best, "apply_top_p(logits, 1e-6)")
    for _ in range(4):  # on logits that top-k already filtered: -inf entries have probability 0
        V = rng.randint(10, 100)
        logits = 2 * torch.randn(1, V, generator=g)
        k = rng.randint(2, V - 1)
        top_k_logits = filter_logits(logits, [SamplingParams(top_k=k)])
        top_p = _gap_top_p(rng, top_k_logits.softmax(-1)[0])
        if top_p is None:
            continue
        want = filter_logits(logits, [SamplingParams(top_k=k, top_p=top_p)])
        what = f"apply_top_p with top_p={top_p} on ({V},)-token logits of which top-k left {k}"
        _check_filtered(lab.apply_top_p(top_k_logits, top_p), top_k_logits, _kept(want), what)


def test_ties_keep_the_right_number_of_tokens(lab, rng):
    """Check ties: top-k keeps exactly k tokens, top-p the reference's count (also when equal probabilities reach
    top_p exactly), and never a lower-ranked one over a higher."""
    g = tensors(rng)
    for V in (4, 8, 16):  # V equally likely tokens: m of them reach top_p = m / V exactly (no rounding)
        m = rng.randint(1, V - 1)
        got = as_tensor(lab.apply_top_p(torch.zeros(1, V), m / V), f"apply_top_p on {V} equal logits", (1, V))
        assert int(_kept(got).sum()) == m, (
            f"apply_top_p with {V} equally likely tokens and top_p={m}/{V} keeps {int(_kept(got).sum())} tokens, "
            "which is not the smallest set that reaches top_p: a token stays only while the ones before it have "
            "less than top_p"
        )
    for _ in range(6):
        V = rng.randint(4, 40)
        logits = torch.randint(0, 4, (2, V), generator=g).float()  # many equal logits
        k = rng.randint(1, V)
        got = as_tensor(lab.apply_top_k(logits, k), f"apply_top_k on tied logits, k={k}", (2, V))
        kept = _kept(got)
        assert kept.sum(-1).tolist() == [k, k], (
            f"apply_top_k with ties and k={k} should keep exactly {k} tokens per row"
        )
        kth = logits.topk(k, dim=-1).values[:, -1:].expand_as(logits)  # the k-th largest logit of each row
        assert bool((logits[kept] >= kth[kept]).all()) and bool((logits[~kept] <= kth[~kept]).all()), (
            f"apply_top_k with ties and k={k} dropped a token with a larger logit than one it kept"
        )
        probs = logits.softmax(-1)
        top_p = _gap_top_p(rng, probs[0])
        if top_p is None:
            continue
        want = _kept(filter_logits(logits[:1], [SamplingParams(top_p=top_p)]))
        got = as_tensor(
            lab.apply_top_p(logits[:1], top_p), f"apply_top_p on tied logits, top_p={top_p}", (1, V)
        )
        kept = _kept(got)[0]
        assert int(kept.sum()) == int(want.sum()), (
            f"apply_top_p with ties and top_p={top_p} keeps {int(kept.sum())} tokens, which is not the smallest "
            "set of most likely tokens that reaches top_p"
        )
        if bool((~kept).any()):
            assert bool(probs[0][kept].min() >= probs[0][~kept].max()), (
                f"apply_top_p with ties and top_p={top_p} dropped a more likely token than one it kept"
            )


ROW_KINDS = ("greedy", "temperature", "top_k", "top_k=1", "top_p", "both", "both", "both")


def _params_of_kind(rng, kind: str, logits_row: torch.Tensor) -> SamplingParams:
    """Random parameters of one kind of row; "both" (top-k then top-p) keeps a k well inside the vocabulary,
    as in practice, so that the order of the two filters matters."""
    V = logits_row.shape[-1]
    temperature = 0.0 if kind == "greedy" else round(rng.uniform(0.3, 2.0), 3)
    top_k = {"top_k": rng.randint(1, V), "top_k=1": 1, "both": rng.randint(2, max(2, V // 4))}.get(kind)
    if kind == "greedy" and rng.random() < 0.5:
        top_k = rng.randint(1, V)
    p = SamplingParams(temperature=temperature, top_k=top_k)
    return _with_safe_top_p(rng, logits_row, p) if kind in ("top_p", "both") else p


def _with_safe_top_p(rng, logits_row: torch.Tensor, p: SamplingParams) -> SamplingParams:
    """``p`` plus a top_p well away from the cumulative sums of its temperature + top-k distribution."""
    before_top_p = filter_logits(
        logits_row[None], [SamplingParams(temperature=p.temperature or 1.0, top_k=p.top_k)]
    )
    top_p = _gap_top_p(rng, before_top_p.softmax(-1)[0])
    return p if top_p is None else SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=top_p)


def _learner_params(lab, params: list[SamplingParams]) -> list:
    return [lab.SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p) for p in params]


@pytest.mark.points(2)
def test_filter_logits_matches_the_reference(lab, rng):
    """Check that filter_logits gives the reference's float32 logits row by row: temperature, then top-k, then
    top-p; greedy rows."""
    g = tensors(rng)
    for dtype in (torch.float32, torch.float32, torch.float32, torch.bfloat16, torch.float16):
        kinds = list(ROW_KINDS)
        rng.shuffle(kinds)
        B, V = len(kinds), rng.randint(8, 120)
        if dtype == torch.float32:
            logits = 3 * torch.randn(B, V, generator=g)
        else:  # distinct values even in 16 bits (a tie for the k-th place may go either way)
            logits = torch.stack([torch.randperm(V, generator=g) for _ in range(B)]) * (6 / V) - 3
            logits = logits.to(dtype)
        params = [_params_of_kind(rng, kind, logits[b].float()) for b, kind in enumerate(kinds)]
        want = filter_logits(logits, params)
        got = as_tensor(lab.filter_logits(logits, _learner_params(lab, params)), "filter_logits(...)", (B, V))
        assert got.dtype == torch.float32, (
            f"filter_logits on {str(dtype).removeprefix('torch.')} logits returned {got.dtype}: it should return "
            "float32 logits whatever the input's dtype"
        )
        for b, p in enumerate(params):
            what = f"filter_logits row {b} (temperature={p.temperature}, top_k={p.top_k}, top_p={p.top_p}, {V} tokens)"
            if not torch.equal(_kept(got[b]), _kept(want[b])):
                raise AssertionError(f"{what} keeps the wrong tokens")
            kept = _kept(want[b])
            assert close(got[b][kept], want[b][kept], 1e-5), (
                f"{what}: the kept logits should be the logits divided by the temperature"
                + (" (a greedy row keeps its logit as it is)" if p.greedy else "")
            )


def test_greedy_rows_take_the_argmax(lab, rng):
    """Check that temperature 0 always gives the argmax (the first one on ties), also among sampled rows, and that
    filter_logits keeps exactly that one token in a greedy row."""
    g = tensors(rng)
    V = rng.randint(5, 60)
    logits = torch.randint(0, 5, (6, V), generator=g).float()  # ties for the maximum are likely
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 3
    params[4] = SamplingParams(temperature=0.0, top_k=2, top_p=0.5)
    for _ in range(3):
        got = as_tensor(
            lab.sample(logits, _learner_params(lab, params), [None] * 6), "sample(...)", (6,), floating=False
        )
        for b in (0, 2, 4):
            assert int(got[b]) == int(logits[b].argmax()), (
                "a greedy row (temperature 0) should take its argmax: the first most likely token on a tie"
            )
    filtered = as_tensor(
        lab.filter_logits(logits, _learner_params(lab, params)), "filter_logits(...)", (6, V)
    )
    for b in (0, 2, 4):
        kept = _kept(filtered[b]).nonzero().flatten().tolist()
        assert kept == [int(logits[b].argmax())], (
            f"filter_logits keeps {_count(len(kept), 'token')} of a greedy row whose largest logit is tied: keep "
            "only the first argmax"
        )


def _chi2_limit(df: int, z: float = 4.75) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at about 1 - 1e-6."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _nucleus_of_two(rng, g: torch.Generator, V: int) -> tuple[SamplingParams, torch.Tensor]:
    """Parameters and (1, V) logits whose temperature-scaled probabilities are a, b, then a tail of smaller ones,
    with a top_p between a and a / (a + b): once, top-p keeps the two most likely tokens; applied again to
    their renormalised probabilities (a / (a + b) >= top_p), it would keep only the first."""
    a, b = rng.uniform(0.4, 0.5), rng.uniform(0.25, 0.33)
    tail = torch.rand(V - 2, generator=g) + 0.5
    probs = torch.cat([torch.tensor([a, b]), (1 - a - b) * tail / tail.sum()])
    top_p = round(a + rng.uniform(0.3, 0.7) * (a / (a + b) - a), 4)
    temperature = round(rng.uniform(0.6, 1.6), 2)
    logits = (temperature * probs.log())[torch.randperm(V, generator=g)][None]
    return SamplingParams(temperature=temperature, top_p=top_p), logits


@pytest.mark.points(2)
def test_sampled_tokens_follow_the_filtered_distribution(lab, rng):
    """Check that sample draws only kept tokens, with the probabilities of softmax(filter_logits) (chi-square test)."""
    g = tensors(rng)
    draws = 3000
    for case in range(4):
        V = rng.randint(5, 12)
        if case == 0:  # no filter, logits spread evenly: far from uniform on every seed
            logits = torch.linspace(-2.0, 2.0, V)[torch.randperm(V, generator=g)][None]
            params = SamplingParams(temperature=1.0, top_k=None, top_p=1.0)
        elif case == 1:  # a temperature far from 1: applied twice, it makes another distribution
            logits = torch.linspace(-2.0, 2.0, V)[torch.randperm(V, generator=g)][None]
            temperature = rng.choice([round(rng.uniform(0.4, 0.6), 2), round(rng.uniform(1.8, 2.5), 2)])
            params = SamplingParams(temperature=temperature, top_k=None, top_p=1.0)
        elif case == 2:  # a nucleus of two tokens that top-p, applied a second time, would cut to one
            params, logits = _nucleus_of_two(rng, g, V)
        else:
            logits = 1.5 * torch.randn(1, V, generator=g)
            base = SamplingParams(
                temperature=round(rng.uniform(0.6, 1.6), 2), top_k=rng.choice([None, V - 1, V - 2])
            )
            params = _with_safe_top_p(rng, logits[0], base) if rng.random() < 0.7 else base
        probs = filter_logits(logits, [params]).softmax(-1)[0].double()
        learner_params = _learner_params(lab, [params])
        got = lab.sample(logits.expand(draws, V).contiguous(), learner_params * draws, [None] * draws)
        got = as_tensor(got, "sample(...)", (draws,), floating=False)
        what = f"sample with temperature={params.temperature}, top_k={params.top_k}, top_p={params.top_p}"
        assert bool(((got >= 0) & (got < V)).all()), f"{what} returned token ids outside 0..{V - 1}"
        counts = torch.bincount(got, minlength=V).double()
        assert bool((counts[probs == 0] == 0).all()), f"{what} drew a token that the filters removed"
        expected = probs * draws
        mask = expected > 0
        chi2 = (((counts - expected) ** 2)[mask] / expected[mask]).sum().item()
        df = max(1, int(mask.sum()) - 1)
        assert chi2 < _chi2_limit(df), (
            f"{what}: over {draws} draws the token frequencies do not follow softmax(filter_logits(...)) "
            f"(chi-square {chi2:.0f} on {df} degrees of freedom)"
        )


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(lab, rng):
    """Check that the same seeds give the same tokens, and that a row's token depends only on its own generator."""
    g = tensors(rng)
    B, V = 4, 64
    logits = 0.3 * torch.randn(B, V, generator=g)  # flat: many likely tokens
    reference_params = [SamplingParams(temperature=1.0, top_k=16, top_p=0.99)] * B
    params = _learner_params(lab, reference_params)
    kept = _kept(filter_logits(logits, reference_params))
    seeds = [rng.randrange(2**31) for _ in range(B)]

    def draw(rows, row_seeds):
        out = lab.sample(logits[rows], [params[r] for r in rows], [lab.make_generator(s) for s in row_seeds])
        tokens = as_tensor(out, "sample(...)", (len(rows),), floating=False).tolist()
        for r, token in zip(rows, tokens):
            assert 0 <= token < V and bool(kept[r, token]), (
                f"sample with top_k=16 drew token {token}, which the filters removed from row {r}"
            )
        return tokens

    rows = list(range(B))
    first = draw(rows, seeds)
    assert draw(rows, seeds) == first, (
        "sampling twice with generators of the same seeds gave different tokens"
    )
    for r in (1, 3):
        assert draw([r], [seeds[r]]) == [first[r]], (
            f"row {r} drew a different token alone than in a batch of {B}: draw row b with generators[b] only"
        )
    others = {tuple(draw(rows, [s + 1000 + i for s in seeds])) for i in range(3)}
    assert len(others | {tuple(first)}) > 1, "different seeds always gave the same tokens: use the generators"
    winners = [rng.randrange(V) for _ in rows]
    peaked = logits.clone()
    peaked[rows, winners] += 40.0  # every other token has probability below e**-40
    got = lab.sample(peaked, params, [lab.make_generator(s) for s in seeds])
    assert as_tensor(got, "sample(...)", (B,), floating=False).tolist() == winners, (
        "with one token's logit 40 above the rest, seeded sampling should draw that token: each row's "
        "token must follow that row's logits"
    )
