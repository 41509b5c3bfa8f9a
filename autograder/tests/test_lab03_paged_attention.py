"""Hidden tests for Lab 3 (paged KV memory), part 2: the learner's paged cache against dense attention, the
learner's allocator and cache inside nanolab's engine, and sharing blocks (fork, copy-on-write).

Models run here, in the grader; `SandboxedPagedCache` is the engine's ``kv_cache`` and sends each
``prepare`` and each layer's q, k, v to the learner's `PagedKVCache` in the sandbox. The learner's
allocator is handed to the engine as a handle, so every block the engine takes is taken by it.
Sequences (the notebook's `PagedSequence`) are remade for each step from plain data: handles are
read-only here. Feedback says what is wrong and on which input, never the expected output.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

import nanolab
from autograder.testing import RemoteError, bundled_model, expect, spread_out, stdlib_text, tiny_qwen2_model
from nanolab.engine.core import EngineStepError
from nanolab.memory.paging import cdiv, slot_mapping
from nanolab.model.attention import dense_causal_attention
from nanolab.model.config import ModelConfig
from nanolab.model.transformer import Transformer

STDLIB_FILES = ("textwrap.py", "heapq.py", "bisect.py", "shlex.py", "fnmatch.py", "string.py")
TIE_GAP = 1e-4  # a greedy choice closer than this may go either way with a different summation order


# ---------------------------------------------------------------------------------------------- helpers


def tensors(rng) -> torch.Generator:
    return torch.Generator().manual_seed(rng.randrange(2**31))


def as_tensor(value, what: str, shape: tuple[int, ...], floating: bool = True) -> torch.Tensor:
    expect(value, torch.Tensor, what)
    if tuple(value.shape) != tuple(shape):
        raise AssertionError(
            f"{what} should have shape {tuple(shape)}, but it has shape {tuple(value.shape)}"
        )
    if floating and not value.is_floating_point():
        raise AssertionError(f"{what} should be a floating-point tensor, not {value.dtype}")
    if not floating and value.dtype != torch.int64:
        raise AssertionError(f"{what} should be an int64 tensor, not {value.dtype}")
    return value


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> bool:
    return bool(torch.allclose(got.double(), want.double(), atol=tol, rtol=tol))


def learner_shape(lab, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int):
    return lab.ModelShape(
        n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, d_model=n_heads * head_dim
    )


def sequence(lab, table: list[int], computed: int):
    """A new `PagedSequence` in the sandbox with this table and token count."""
    return lab.PagedSequence(list(table), computed)


def table_of(seq) -> list[int]:
    table = expect(seq.block_table, list, "block_table")
    assert all(type(b) is int for b in table), "a block table should hold int block ids"
    return table


def refs_of(lab, allocator) -> list[int]:
    """Every block's reference count, read in one call through the notebook's replay."""
    (record,) = expect(lab.replay(allocator, [("ref_count", 0)]), list, "replay(...)")
    return expect(record[-1], list, "the reference counts")


def holders_of(tables: list[list[int]], num_blocks: int) -> list[int]:
    counts = [0] * num_blocks
    for table in tables:
        for b in table:
            counts[b] += 1
    return counts


pytestmark = pytest.mark.usefixtures("torch_on_one_thread")


# ---------------------------------------------------------------------------------------------- paged attention


def _schedule(rng, totals: dict[int, int]) -> list[list[tuple[int, int]]]:
    """Steps of (sequence, new tokens): prompts in one or more chunks, then decodes, mixed in random order."""
    done = dict.fromkeys(totals, 0)
    prompt = {s: rng.randint(1, n) for s, n in totals.items()}
    steps = []
    while any(done[s] < totals[s] for s in totals):
        step = []
        for s in rng.sample(list(totals), len(totals)):
            left = totals[s] - done[s]
            if left == 0 or rng.random() < 0.2:
                continue
            n = 1 if done[s] >= prompt[s] else min(left, rng.randint(1, prompt[s] - done[s]))
            step.append((s, n))
            done[s] += n
        if step:
            steps.append(step)
    return steps


def _variant_hint(q, k, v, start: int, n: int, table: list[int], block_size: int, got) -> str:
    """Plausible mistakes for one sequence's rows, told apart by what they would have returned."""
    end = start + n
    new_only = dense_causal_attention(q[start:end].double(), k[start:end].double(), v[start:end].double())
    if close(got, new_only):
        return "; it looks like the new tokens attend only to each other: gather the cached ones too"
    # The blocks gathered in the order of their ids: context slot j then holds logical position pos[j],
    # or nothing yet (zeros) where that position is past the sequence's end.
    order = sorted(range(cdiv(end, block_size)), key=lambda i: table[i])
    pos = torch.tensor([i * block_size + o for i in order for o in range(block_size)])[:end]
    if not torch.equal(pos, torch.arange(end)):
        valid = pos < end
        kk = torch.zeros(end, *k.shape[1:], dtype=torch.float64)
        vv = torch.zeros(end, *v.shape[1:], dtype=torch.float64)
        kk[valid], vv[valid] = k[pos[valid]].double(), v[pos[valid]].double()
        q_full = torch.cat([torch.zeros(end - n, *q.shape[1:], dtype=torch.float64), q[start:end].double()])
        if close(got, dense_causal_attention(q_full, kk, vv)[-n:]):
            return "; it looks like the blocks are gathered in the order of their ids, not in table order"
    return ""


@pytest.mark.points(2)
def test_paged_attention_equals_dense_attention_on_random_tables(lab, rng):
    """Check attend against dense attention: shuffled tables, any block size, MHA/GQA/MQA, prefills, chunks and decodes mixed."""
    g = tensors(rng)
    for n_layers, nh, nkv, hs in [(2, 4, 4, 8), (2, 8, 2, 8), (1, 4, 1, 16), (1, 6, 3, 4)]:
        block_size = rng.choice([1, 2, 3, 4, 8])
        totals = {s: rng.randint(1, 24) for s in range(rng.randint(1, 4))}
        num_blocks = sum(cdiv(n, block_size) for n in totals.values()) + rng.randint(0, 6)
        free = rng.sample(range(num_blocks), num_blocks)
        tables = {s: [free.pop() for _ in range(cdiv(n, block_size))] for s, n in totals.items()}
        q = {s: torch.randn(n_layers, n, nh, hs, generator=g) for s, n in totals.items()}
        k = {s: torch.randn(n_layers, n, nkv, hs, generator=g) for s, n in totals.items()}
        v = {s: torch.randn(n_layers, n, nkv, hs, generator=g) for s, n in totals.items()}
        cache = lab.PagedKVCache(learner_shape(lab, n_layers, nh, nkv, hs), num_blocks, block_size)
        done = dict.fromkeys(totals, 0)
        for step in _schedule(rng, totals):
            slices = [lab.SeqSlice(tables[s], done[s], n) for s, n in step]
            what = (
                f"prepare with {len(step)} sequence(s) (new tokens {[n for _, n in step]} after "
                f"{[done[s] for s, _ in step]} cached, blocks of {block_size})"
            )
            positions = as_tensor(cache.prepare(slices), what, (sum(n for _, n in step),), floating=False)
            want_positions = [p for s, n in step for p in range(done[s], done[s] + n)]
            assert positions.tolist() == want_positions, f"{what} returned the wrong positions"
            for layer in range(n_layers):
                rows = [(s, slice(done[s], done[s] + n)) for s, n in step]
                q_new, k_new, v_new = (torch.cat([d[s][layer, sl] for s, sl in rows]) for d in (q, k, v))
                label = f"attend(layer={layer}, ...) after {what} (heads {nh}/{nkv})"
                out = as_tensor(cache.attend(layer, q_new, k_new, v_new), label, (len(positions), nh, hs))
                row = 0
                for s, n in step:
                    end = done[s] + n
                    want = dense_causal_attention(q[s][layer, :end].double(), k[s][layer, :end].double(),
                                                  v[s][layer, :end].double())[-n:]  # fmt: skip
                    mine = out[row : row + n]
                    if not close(mine, want):
                        hint = _variant_hint(q[s][layer], k[s][layer], v[s][layer], done[s], n, tables[s],
                                             block_size, mine)  # fmt: skip
                        raise AssertionError(
                            f"{label}: the rows of sequence {step.index((s, n))} of the batch ({n} new after "
                            f"{done[s]} cached, table {tables[s]}) are not attention over its own tokens{hint}"
                        )
                    row += n
            for s, n in step:
                done[s] += n


def test_keys_and_values_land_in_their_slots(lab, rng):
    """Check that attend writes every new token's key and value into the slot its table gives, and nothing else."""
    g = tensors(rng)
    block_size = rng.choice([2, 3, 4])
    totals = {s: rng.randint(2, 12) for s in range(3)}
    num_blocks = sum(cdiv(n, block_size) for n in totals.values()) + 3
    free = rng.sample(range(num_blocks), num_blocks)
    tables = {s: [free.pop() for _ in range(cdiv(n, block_size))] for s, n in totals.items()}
    k = {s: torch.randn(2, n, 2, 4, generator=g) for s, n in totals.items()}
    v = {s: torch.randn(2, n, 2, 4, generator=g) for s, n in totals.items()}
    cache = lab.PagedKVCache(learner_shape(lab, 2, 2, 2, 4), num_blocks, block_size)
    done = dict.fromkeys(totals, 0)
    for step in _schedule(rng, totals):
        cache.prepare([lab.SeqSlice(tables[s], done[s], n) for s, n in step])
        for layer in range(2):
            new_k = torch.cat([k[s][layer, done[s] : done[s] + n] for s, n in step])
            new_v = torch.cat([v[s][layer, done[s] : done[s] + n] for s, n in step])
            cache.attend(layer, torch.randn(len(new_k), 2, 4, generator=g), new_k, new_v)
        for s, n in step:
            done[s] += n
    for name, data in (("k", k), ("v", v)):
        pools = expect(getattr(cache, name), list, f"cache.{name}")
        assert len(pools) == 2, f"cache.{name} should hold one tensor per layer"
        for layer, pool in enumerate(pools):
            pool = as_tensor(pool, f"cache.{name}[{layer}]", (num_blocks, block_size, 2, 4))
            flat = pool.reshape(-1, 2, 4)
            written = torch.zeros(len(flat), dtype=torch.bool)
            for s, n in totals.items():
                slots = torch.tensor(slot_mapping(tables[s], 0, n, block_size))
                assert torch.equal(flat[slots], data[s][layer].to(flat.dtype)), (
                    f"cache.{name}[{layer}]: a token of a sequence with table {tables[s]} (blocks of {block_size}) is "
                    "not in its slot, block_table[pos // block_size] * block_size + pos % block_size"
                )
                written[slots] = True
            assert not flat[~written].any(), f"cache.{name}[{layer}]: a slot no token belongs to was written"


# ---------------------------------------------------------------------------------------------- in the engine


class SandboxedPagedCache:
    """The engine's ``kv_cache``: ``prepare`` and every layer's ``attend`` run in the learner's cache."""

    def __init__(self, lab, remote_cache, n_heads: int, head_dim: int) -> None:
        self.make_slice = lab.SeqSlice
        self._prepare = remote_cache.prepare
        self._attend = remote_cache.attend
        self.n_heads, self.head_dim = n_heads, head_dim
        self.num_tokens = 0

    def prepare(self, seqs) -> torch.Tensor:
        slices = [self.make_slice(list(s.block_table), s.start_pos, s.num_new) for s in seqs]
        self.num_tokens = sum(s.num_new for s in seqs)
        what = f"prepare(...) with {len(seqs)} sequences in the engine"
        positions = as_tensor(self._prepare(slices), what, (self.num_tokens,), floating=False)
        want = [p for s in seqs for p in range(s.start_pos, s.start_pos + s.num_new)]
        assert positions.tolist() == want, f"{what} returned the wrong positions"
        return positions

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = self._attend(layer, q, k, v)
        what = f"attend(layer={layer}, ...) with {self.num_tokens} tokens in the engine"
        return as_tensor(out, what, (self.num_tokens, self.n_heads, self.head_dim)).to(q.dtype)


def _generate(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = nanolab.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    except EngineStepError as e:  # the learner's code raised (or stopped answering) inside a step
        raise e.__cause__ from None
    return [list(o.outputs[0].token_ids) for o in outputs]


@torch.inference_mode()
def _agree_up_to_ties(model, prompt: list[int], want: list[int], got: list[int]) -> bool:
    """Equal, or first different where the reference's own top two logits are a near tie."""
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            top = model.logits(torch.tensor([prompt + want[:i]]))[0, -1].topk(2).values
            return float(top[0] - top[1]) < TIE_GAP
    return len(want) == len(got)


def _serve_with_the_learners_parts(lab, model, tokenizer, prompts, max_tokens, settings, allocator=True):
    """Greedy outputs of the reference engine, and of the engine with the learner's allocator and cache."""
    reference = nanolab.LLM(model, tokenizer, **settings)
    want = _generate(reference, prompts, max_tokens)
    c = model.config
    learners = nanolab.LLM(
        model, tokenizer, block_allocator=lab.BlockAllocator(reference.engine.config.num_blocks) if allocator else None,
        **settings,
    )  # fmt: skip
    cfg = learners.engine.config
    remote = lab.PagedKVCache(learner_shape(lab, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim), cfg.num_blocks,
                              cfg.block_size)  # fmt: skip
    learners.engine.kv_cache = SandboxedPagedCache(lab, remote, c.n_heads, c.head_dim)
    got = _generate(learners, prompts, max_tokens)
    return reference, learners, want, got


@pytest.mark.points(2)
def test_your_allocator_and_cache_serve_the_bundled_model_through_preemptions(lab, rng):
    """Check that the engine with your allocator and cache gives nanolab's greedy outputs, with a pool that forces preemptions."""
    model, tokenizer = bundled_model()
    text = stdlib_text(*STDLIB_FILES)
    prompts = []
    for _ in range(6):
        start = rng.randrange(len(text) - 400)
        prompts.append(tokenizer.encode(text[start : start + 400])[: rng.randint(4, 20)])
    max_tokens = rng.randint(20, 28)
    block_size = rng.choice([2, 4])
    longest = max(len(p) for p in prompts) + max_tokens
    num_blocks = cdiv(longest, block_size) + rng.randint(2, 6)  # room for one request and a little more
    settings = dict(block_size=block_size, num_blocks=num_blocks, max_num_seqs=6, max_num_batched_tokens=32)
    reference, learners, want, got = _serve_with_the_learners_parts(
        lab, model, tokenizer, prompts, max_tokens, settings
    )
    assert reference.stats().preemptions > 0, (
        "the grader's setup did not preempt (a grader problem, not yours)"
    )
    for i, (prompt, w, g) in enumerate(zip(prompts, want, got)):
        assert _agree_up_to_ties(model, prompt, w, g), (
            f"with your allocator and cache (blocks of {block_size}, a pool of {num_blocks} blocks, requests preempted "
            f"and recomputed), the engine continued prompt {i} ({len(prompt)} tokens) differently from nanolab"
        )
    learners.engine.block_manager.prefix_cache.reset()
    allocator = learners.engine.block_manager.allocator
    assert allocator.num_free == allocator.num_total, (
        "after every request finished and the prefix cache let go, some blocks are still held by your allocator"
    )


def test_your_cache_serves_other_model_families(lab, rng):
    """Check your cache in the engine with random GPT-2 (MHA) and Llama-style (GQA) models, and a tiny random Qwen2 model (MQA, q/k/v biases)."""
    configs = [
        ModelConfig(arch="gpt2", vocab_size=64, n_layers=2, n_heads=4, n_kv_heads=4, d_model=32, d_ff=64, max_seq_len=64),
        ModelConfig(vocab_size=64, n_layers=3, n_heads=6, n_kv_heads=2, d_model=48, d_ff=64, max_seq_len=64),
    ]  # fmt: skip
    models = [(spread_out(Transformer(c), rng.randrange(2**31)), f"a random {c.arch} model") for c in configs]
    models.append((tiny_qwen2_model(rng.randrange(2**31)), "a tiny random Qwen2 model"))
    for model, label in models:
        config = model.config
        prompts = [[rng.randrange(64) for _ in range(rng.randint(1, 12))] for _ in range(3)]
        settings = dict(block_size=rng.choice([2, 4, 8]), num_blocks=64, max_num_seqs=3)
        _, _, want, got = _serve_with_the_learners_parts(
            lab, model, None, prompts, 12, settings, allocator=False
        )
        for prompt, w, g in zip(prompts, want, got):
            assert _agree_up_to_ties(model, prompt, w, g), (
                f"{label} ({config.n_heads} query heads, {config.n_kv_heads} KV heads) served with your cache "
                f"continued a {len(prompt)}-token prompt differently from nanolab"
            )


# ---------------------------------------------------------------------------------------------- sharing


def test_fork_shares_blocks_and_a_block_outlives_its_first_holder(lab, rng):
    """Check fork: tables copied, one reference more per block, nothing allocated; a shared block stays until its last holder lets go."""
    block_size = rng.choice([2, 4, 8])
    num_blocks = 32
    allocator = lab.BlockAllocator(num_blocks)
    manager = lab.BlockManager(allocator, block_size)
    prompt = rng.randint(1, 5 * block_size)
    parent = sequence(lab, [], 0)
    assert manager.grow(parent, prompt) is True, "grow failed on a new pool"
    table = table_of(parent)
    children = []
    for i in range(rng.randint(1, 3)):
        child = sequence(lab, [], 0)
        manager.fork(sequence(lab, table, prompt), child)
        assert table_of(child) == table, "after fork the child's table should list the parent's blocks"
        assert expect(child.num_computed_tokens, int, "num_computed_tokens") == prompt, (
            "after fork the child should have the parent's num_computed_tokens"
        )
        children.append(child)
        assert refs_of(lab, allocator) == holders_of([table] * (i + 2), num_blocks), (
            f"after {i + 1} fork(s), every shared block's count should be the number of tables that list it"
        )
        assert allocator.num_free == num_blocks - len(table), "fork should allocate nothing"
    manager.release(sequence(lab, table, prompt))
    assert refs_of(lab, allocator) == holders_of([table] * len(children), num_blocks), (
        "releasing the parent should drop one reference per block, and leave the blocks to the children"
    )
    for child in children:
        manager.release(child)
    assert allocator.num_free == num_blocks, "after every holder released its blocks, all should be free"
    tokens = rng.randint(0, 3) * block_size + rng.randint(1, block_size - 1)  # the last block partly filled
    kept, child = sequence(lab, [], 0), sequence(lab, [], 0)
    manager.grow(kept, tokens)
    kept_table = table_of(kept)
    kept = sequence(lab, kept_table, tokens)
    manager.fork(kept, child)
    manager.grow(child, 1)
    manager.copy_on_write(child)
    assert table_of(kept) == kept_table, (
        "a forked child's copy-on-write changed its parent's block table: the child needs a list of its own"
    )
    holder = sequence(lab, [], 0)
    manager.grow(holder, 1)
    holder_table = table_of(holder)
    before = (refs_of(lab, allocator), allocator.free_list())
    try:
        manager.fork(sequence(lab, holder_table, 1), holder)
    except RemoteError as e:
        assert e.type_name == "ValueError", (
            f"fork into a sequence that already holds blocks should raise ValueError, not {e.type_name}"
        )
    else:
        raise AssertionError("fork into a sequence that already holds blocks should raise ValueError")
    assert (refs_of(lab, allocator), allocator.free_list()) == before and table_of(holder) == holder_table, (
        "a fork into a sequence that holds blocks raised, but changed reference counts or tables first: "
        "check the child before touching anything"
    )


def _write(lab, manager, cache, table: list[int], computed: int, values: list[float], block_size: int):
    """One forward that writes ``values`` as the next tokens of a sequence (grow, copy-on-write, copy,
    prepare, attend); returns (new table, attention output rows, copy pairs)."""
    n = len(values)
    seq = sequence(lab, table, computed)
    assert manager.grow(seq, n) is True, "grow failed with free blocks left"
    touched = table_of(seq)[computed // block_size : cdiv(computed + n, block_size)]
    pairs = manager.copy_on_write(seq, n)
    assert pairs is not None, "copy_on_write returned None with free blocks left"
    for pair in expect(pairs, list, "copy_on_write(...)"):
        expect(pair, (tuple, list), "each pair of copy_on_write(...)")
        assert pair[0] in touched, (
            f"copy_on_write({n} new tokens after {computed}) copied block {pair[0]}, which those tokens are not "
            "written into: full blocks stay shared"
        )
    cache.copy_blocks(pairs)
    table = table_of(seq)
    cache.prepare([lab.SeqSlice(table, computed, n)])
    kv = torch.tensor(values, dtype=torch.float32)[:, None, None].expand(n, 1, 2).contiguous()
    out = cache.attend(0, torch.zeros(n, 1, 2), kv, kv)
    return table, out, pairs


def _read(cache, table: list[int], length: int, block_size: int) -> list[float]:
    pool = expect(cache.k, list, "cache.k")[0]
    flat = as_tensor(pool, "cache.k[0]", tuple(pool.shape)).reshape(-1, 2)
    return flat[slot_mapping(table, 0, length, block_size), 0].tolist()


@pytest.mark.points(2)
def test_copy_on_write_leaves_the_other_holders_data_untouched(lab, rng):
    """Check that samples forked from one prompt each write into a private copy: the parent's and siblings' tokens never change."""
    for boundary in (False, True):  # a prompt that ends inside a block, then one that fills its last block
        block_size = rng.choice([2, 3, 4])
        num_blocks = 48
        allocator = lab.BlockAllocator(num_blocks)
        manager = lab.BlockManager(allocator, block_size)
        cache = lab.PagedKVCache(learner_shape(lab, 1, 1, 1, 2), num_blocks, block_size)
        full = rng.randint(0, 3) * block_size
        prompt = full + block_size if boundary else full + rng.randint(1, block_size - 1)
        tokens = [float(i + 1) for i in range(prompt)]
        parent_table, _, _ = _write(lab, manager, cache, [], 0, tokens, block_size)
        samples = {}
        for c in range(rng.randint(2, 3)):
            child = sequence(lab, [], 0)
            manager.fork(sequence(lab, parent_table, prompt), child)
            samples[c] = (table_of(child), list(tokens))
        for _step in range(2 * block_size):
            for c, (table, written) in samples.items():
                n = rng.choice([1, 1, 2])
                values = [100.0 * (c + 1) + len(written) + i for i in range(n)]
                shared_before = refs_of(lab, allocator)
                table, out, pairs = _write(lab, manager, cache, table, len(written), values, block_size)
                written += values
                samples[c] = (table, written)
                what = (
                    f"blocks of {block_size}, a {prompt}-token prompt forked {len(samples)} ways: sample {c} wrote "
                    f"{n} token(s) after {len(written) - n}"
                )
                for old, _ in pairs:
                    assert shared_before[old] > 1, (
                        f"{what}: copy_on_write copied block {old}, which was not shared"
                    )
                assert _read(cache, parent_table, prompt, block_size) == tokens, (
                    f"{what}, and the parent's tokens changed: a shared block was written in place"
                )
                for other, (other_table, other_written) in samples.items():
                    assert _read(cache, other_table, len(other_written), block_size) == other_written, (
                        f"{what}, and sample {other}'s tokens are no longer what it wrote"
                    )
                want = dense_causal_attention(
                    torch.zeros(len(written), 1, 2, dtype=torch.float64),
                    torch.tensor(written, dtype=torch.float64)[:, None, None].expand(-1, 1, 2),
                    torch.tensor(written, dtype=torch.float64)[:, None, None].expand(-1, 1, 2),
                )[-n:]
                assert close(as_tensor(out, "attend(...)", (n, 1, 2)), want), (
                    f"{what}: its attention does not see its own tokens after the copy (copy_blocks, then write)"
                )
        tables = [parent_table] + [t for t, _ in samples.values()]
        assert refs_of(lab, allocator) == holders_of(tables, num_blocks), (
            "after the samples wrote, a block's count differs from the number of tables that list it"
        )


_steps = st.lists(
    st.tuples(
        st.sampled_from(["start", "fork", "write", "write", "release"]),
        st.integers(min_value=0, max_value=7),  # which sequence (modulo the live ones)
        st.integers(min_value=1, max_value=4),  # how many tokens
    ),
    min_size=1,
    max_size=14,
)


@pytest.mark.points(2)
def test_random_fork_grow_write_release_sequences(lab, rng):
    """Check random sequences of fork, grow + copy-on-write + write, and release: counts equal holders, every sequence reads back its tokens."""
    block_size = rng.choice([2, 3])
    num_blocks = 12

    @hypothesis_seed(rng.randrange(2**32))
    @settings(
        max_examples=25,
        deadline=None,
        database=None,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(_steps)
    def check(steps):
        allocator = lab.BlockAllocator(num_blocks)
        manager = lab.BlockManager(allocator, block_size)
        cache = lab.PagedKVCache(learner_shape(lab, 1, 1, 1, 2), num_blocks, block_size)
        live: list[tuple[list[int], list[float]]] = []  # each sequence's table and the tokens it wrote
        done: list[str] = []
        counter = 1.0
        for op, which, n in steps:
            if op == "start" or not live:
                live.append(([], []))
                which, op = len(live) - 1, "write"
            which %= len(live)
            table, written = live[which]
            if op == "fork":
                child = sequence(lab, [], 0)
                manager.fork(sequence(lab, table, len(written)), child)
                live.append((table_of(child), list(written)))
                done.append(f"fork(seq {which})")
            elif op == "release":
                manager.release(sequence(lab, table, len(written)))
                del live[which]
                done.append(f"release(seq {which})")
            else:
                seq = sequence(lab, table, len(written))
                if not manager.grow(seq, n):
                    assert table_of(seq) == table, "a grow that returned False changed the table"
                    done.append(f"grow(seq {which}, {n}) -> False")
                    continue
                pairs = manager.copy_on_write(seq, n)
                if pairs is None:
                    live[which] = (table_of(seq), written)  # grow's blocks stay, unwritten
                    done.append(f"copy_on_write(seq {which}, {n}) -> None")
                    continue
                cache.copy_blocks(expect(pairs, list, "copy_on_write(...)"))
                table = table_of(seq)
                values = [counter + i for i in range(n)]
                counter += n
                cache.prepare([lab.SeqSlice(table, len(written), n)])
                kv = torch.tensor(values)[:, None, None].expand(n, 1, 2).contiguous()
                cache.attend(0, torch.zeros(n, 1, 2), kv, kv)
                live[which] = (table, written + values)
                done.append(f"write {n} into seq {which}")
            where = f"with blocks of {block_size}, after {'; '.join(done)}"
            assert refs_of(lab, allocator) == holders_of([t for t, _ in live], num_blocks), (
                f"{where}: a block's reference count differs from the number of tables that list it"
            )
            for i, (t, w) in enumerate(live):
                assert len(t) >= cdiv(len(w), block_size), f"{where}: sequence {i}'s table is too short"
                assert _read(cache, t, len(w), block_size) == w, (
                    f"{where}: sequence {i} no longer reads back the tokens it wrote"
                )

    check()


def _forked_pair(lab, manager, block_size: int, computed: int, n: int):
    """A parent with ``computed`` tokens that made room for ``n`` more, then forked: (parent, its table, child)."""
    parent = sequence(lab, [], 0)
    assert manager.grow(parent, computed) is True, f"grow(seq, {computed}) on a new pool returned False"
    parent = sequence(lab, table_of(parent), computed)
    assert manager.grow(parent, n) is True, "grow failed with free blocks left"
    table = table_of(parent)
    child = sequence(lab, [], 0)
    manager.fork(parent, child)
    return (
        parent,
        table,
        sequence(lab, table_of(child), computed),
    )  # remade: only fork's references count here


@pytest.mark.points(2)
def test_copy_on_write_copies_every_shared_block_the_new_tokens_touch(lab, rng):
    """Check copy_on_write for several new tokens across block boundaries: each shared block they go into is copied, in table order, and no other."""
    for trial in range(4):
        block_size = rng.choice([2, 3, 4])
        num_blocks = 40
        allocator = lab.BlockAllocator(num_blocks)
        manager = lab.BlockManager(allocator, block_size)
        # Half the trials start inside a block, half exactly at a boundary after full blocks.
        partial = rng.randint(1, block_size - 1) if trial % 2 == 0 else 0
        computed = rng.randint(0 if partial else 1, 3) * block_size + partial
        n = block_size - partial + rng.randint(1, 2 * block_size)  # the last new token is past a boundary
        parent, table, child = _forked_pair(lab, manager, block_size, computed, n)
        what = (
            f"with blocks of {block_size}, a sequence with {computed} tokens computed grew for {n} more (table of "
            f"{len(table)}) and was forked; copy_on_write(child, {n})"
        )
        first, end = computed // block_size, cdiv(computed + n, block_size)
        free_before = allocator.free_list()
        pairs = expect(manager.copy_on_write(child, n), list, what)
        olds = []
        for pair in pairs:
            expect(pair, (tuple, list), f"each pair of {what}")
            assert len(pair) == 2, f"{what} returned a pair of {len(pair)} items"
            olds.append(pair[0])
        for i in range(first, end):
            if table[i] not in olds:
                raise AssertionError(
                    f"{what} left block {i} of the table shared, although position(s) "
                    f"{max(computed, i * block_size)}..{min(computed + n, (i + 1) * block_size) - 1} go into it: "
                    "check every block the new tokens touch, not only one"
                )
        for old in olds:
            assert old in table[first:end], (
                f"{what} copied block {old}, which none of the new tokens goes into: full blocks stay shared"
            )
        assert olds == table[first:end], f"{what} returned its pairs out of table order, or one block twice"
        news = [pair[1] for pair in pairs]
        assert len(set(news)) == len(news) and set(news) <= set(free_before), (
            f"{what}: each copy should be a distinct block that was free"
        )
        child_table = table_of(child)
        assert child_table == table[:first] + news + table[end:], (
            f"{what}: the child's table should list each copy in the place of the block it replaces"
        )
        assert table_of(parent) == table, f"{what} changed the parent's table"
        assert refs_of(lab, allocator) == holders_of([table, child_table], num_blocks), (
            f"{what}: a block's reference count differs from the number of tables that list it"
        )
        again = expect(manager.copy_on_write(child, n), list, f"{what}, called a second time")
        assert again == [] and table_of(child) == child_table, (
            f"{what}, called a second time, copied again: the child's blocks have one holder now"
        )


def test_copy_blocks_copies_every_layer_reading_every_source_first(lab, rng):
    """Check copy_blocks on a cache of several layers, with a block copied on in the same call: keys and values, sources read first."""
    g = tensors(rng)
    n_layers = rng.randint(2, 4)
    block_size = rng.choice([2, 3, 4])
    num_blocks = 10
    cache = lab.PagedKVCache(learner_shape(lab, n_layers, 2, 1, 4), num_blocks, block_size)
    slots = num_blocks * block_size
    cache.prepare([lab.SeqSlice(list(range(num_blocks)), 0, slots)])  # one sequence writes every slot
    for layer in range(n_layers):
        kv = torch.randn(2, slots, 1, 4, generator=g)
        cache.attend(layer, torch.randn(slots, 2, 4, generator=g), kv[0], kv[1])
    before = {
        name: [t.clone() for t in expect(getattr(cache, name), list, f"cache.{name}")] for name in ("k", "v")
    }
    a, b, c, d, e = rng.sample(range(num_blocks), 5)
    pairs = [(a, b), (b, c), (d, e)]  # b is written by the first pair and read by the second
    cache.copy_blocks(pairs)
    moved = {b: a, c: b, e: d}
    for name in ("k", "v"):
        pools = expect(getattr(cache, name), list, f"cache.{name}")
        assert len(pools) == n_layers, f"cache.{name} should hold one tensor per layer"
        for layer, pool in enumerate(pools):
            pool = as_tensor(pool, f"cache.{name}[{layer}]", tuple(before[name][layer].shape))
            old = before[name][layer]
            for block in range(num_blocks):
                src = moved.get(block, block)
                if not torch.equal(pool[block], old[src]):
                    what = "was changed" if src == block else f"is not what block {src} held before the call"
                    raise AssertionError(
                        f"after copy_blocks({pairs}) on a cache of {n_layers} layers, block {block} of "
                        f"cache.{name}[{layer}] {what}"
                    )


def test_prepare_and_attend_refuse_a_forward_that_does_not_fit(lab, rng):
    """Check that prepare raises ValueError for a table too short for its new tokens (several, across a block), and attend for a q of the wrong length."""
    block_size = rng.choice([2, 3, 4])
    cache = lab.PagedKVCache(learner_shape(lab, 1, 2, 1, 4), 8, block_size)
    table = rng.sample(range(8), rng.randint(1, 3))
    capacity = len(table) * block_size
    start = rng.randint(0, capacity - 1)
    fits = lab.SeqSlice(table, start, capacity - start)  # fills the table exactly
    what = f"prepare([SeqSlice({table}, {start}, {capacity - start})]) with blocks of {block_size}"
    as_tensor(cache.prepare([fits]), what, (capacity - start,), floating=False)
    start = rng.randint(max(0, capacity - block_size), capacity - 1)  # the first new token fits, the last not
    n = capacity - start + rng.randint(1, block_size)
    what = f"prepare([SeqSlice({table}, {start}, {n})]) with blocks of {block_size} (the table holds {capacity} slots)"
    try:
        cache.prepare([lab.SeqSlice(table, start, n)])
    except RemoteError as e:
        assert e.type_name == "ValueError", f"{what} should raise ValueError, not {e.type_name}"
    else:
        raise AssertionError(f"{what} should raise ValueError: its last new tokens have no slot")
    t = rng.randint(1, capacity)
    cache.prepare([lab.SeqSlice(table, 0, t)])
    for wrong in (t + 1, t - 1) if t > 1 else (t + 1,):
        what = f"attend(0, ...) with {wrong} tokens after a prepare of {t}"
        try:
            cache.attend(0, torch.zeros(wrong, 2, 4), torch.zeros(wrong, 1, 4), torch.zeros(wrong, 1, 4))
        except RemoteError as e:
            assert e.type_name == "ValueError", f"{what} should raise ValueError, not {e.type_name}"
        else:
            raise AssertionError(f"{what} should raise ValueError")


def test_cache_keeps_the_dtype_it_is_given(lab, rng):
    """Check that PagedKVCache keeps the block size, block count and dtype it is given, and attention in float64 keeps its precision."""
    g = tensors(rng)
    block_size = rng.choice([2, 4])
    num_blocks = 6
    float64 = lab.torch.float64  # the notebook's own torch.float64 (a dtype does not cross as data)
    cache = lab.PagedKVCache(learner_shape(lab, 2, 4, 2, 8), num_blocks, block_size, float64)
    made = f"PagedKVCache(<2 layers>, {num_blocks}, {block_size}, torch.float64)"
    assert expect(cache.block_size, int, f"{made}.block_size") == block_size, (
        f"{made}.block_size is not the one given"
    )
    assert expect(cache.num_blocks, int, f"{made}.num_blocks") == num_blocks, (
        f"{made}.num_blocks is not the one given"
    )
    for name in ("k", "v"):
        pools = expect(getattr(cache, name), list, f"cache.{name}")
        for layer, pool in enumerate(pools):
            pool = as_tensor(pool, f"cache.{name}[{layer}] of a cache made with dtype=torch.float64",
                             (num_blocks, block_size, 2, 8))  # fmt: skip
            assert pool.dtype == torch.float64, (
                f"cache.{name}[{layer}] of a cache made with dtype=torch.float64 is {pool.dtype}"
            )
            assert not pool.any(), f"cache.{name}[{layer}] of a new cache should be all zeros"
    n = rng.randint(2, num_blocks * block_size)
    table = rng.sample(range(num_blocks), cdiv(n, block_size))
    cache.prepare([lab.SeqSlice(table, 0, n)])
    q, k, v = (torch.randn(n, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    out = as_tensor(cache.attend(1, q, k, v), f"attend(1, ...) on a float64 cache ({n} tokens)", (n, 4, 8))
    assert close(out, dense_causal_attention(q, k, v), tol=1e-10), (
        f"attend(1, ...) on a float64 cache ({n} tokens, table {table}) lost precision or is wrong"
    )


def test_copy_on_write_without_free_blocks_changes_nothing(lab, rng):
    """Check that copy_on_write returns None and changes nothing when no block is free for the copy."""
    block_size = rng.choice([2, 4])
    allocator = lab.BlockAllocator(2)
    manager = lab.BlockManager(allocator, block_size)
    tokens = rng.randint(1, block_size - 1)
    parent = sequence(lab, [], 0)
    manager.grow(parent, tokens)
    table = table_of(parent)
    child = sequence(lab, [], 0)
    manager.fork(sequence(lab, table, tokens), child)
    allocator.allocate(1)
    before = (refs_of(lab, allocator), allocator.free_list())
    writer = sequence(lab, table, tokens)
    assert manager.copy_on_write(writer) is None, "copy_on_write with no free block should return None"
    assert table_of(writer) == table and (refs_of(lab, allocator), allocator.free_list()) == before, (
        "a copy_on_write that returns None must change nothing"
    )
    allocator.free([1 - table[0]])  # the other block is free again: now the copy can be made
    pairs = expect(manager.copy_on_write(writer), list, "copy_on_write(...) with a free block")
    assert [tuple(p) for p in pairs] == [(table[0], 1 - table[0])] and table_of(writer) == [1 - table[0]], (
        "with a block free again, copy_on_write should copy the shared block the next token goes into"
    )

    # Several shared blocks to copy, and one free block too few for them: all or nothing.
    block_size = rng.choice([2, 3, 4])
    partial = rng.randint(1, block_size - 1)
    n = block_size - partial + rng.randint(1, 2 * block_size)  # the new tokens cross into a second block
    touched = cdiv(partial + n, block_size)
    num_blocks = 2 * touched + 1
    allocator = lab.BlockAllocator(num_blocks)
    manager = lab.BlockManager(allocator, block_size)
    _, table, child = _forked_pair(lab, manager, block_size, partial, n)
    spare = expect(allocator.allocate(2), list, "allocate(2)")  # leaves touched - 1 free
    what = (
        f"with blocks of {block_size}, {touched} shared blocks to copy for {n} new tokens after {partial} and "
        f"{touched - 1} free, copy_on_write(child, {n})"
    )
    before = (refs_of(lab, allocator), allocator.free_list())
    assert manager.copy_on_write(child, n) is None, f"{what} should return None: the copies do not all fit"
    assert table_of(child) == table and (refs_of(lab, allocator), allocator.free_list()) == before, (
        f"{what} returned None but changed the table, the counts or the free list: check first, then copy"
    )
    allocator.free(spare[:1])
    what = f"with blocks of {block_size}, {touched} shared blocks to copy and exactly {touched} free, copy_on_write(child, {n})"
    pairs = manager.copy_on_write(child, n)
    assert pairs is not None, f"{what} returned None although there is a free block for every copy"
    assert len(expect(pairs, list, what)) == touched, (
        f"{what} did not copy every shared block the tokens go into"
    )
