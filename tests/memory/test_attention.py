"""Paged attention: every backend equals dense causal attention, whatever the paging looks like.

Tolerance: float32 outputs are compared with a float64 dense reference at ``atol = rtol = 1e-5``
(observed errors are ~5e-7 for contexts of a few hundred tokens). Caches are filled with NaN before
the real tokens are written, so any read of a slot that was never written shows up as NaN.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanolab import _ext
from nanolab.memory.paged_attention import (
    HAS_CPP_KERNEL,
    gather_kv,
    paged_attention,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv,
)
from nanolab.memory.paging import slot_mapping, slot_of
from nanolab.model.attention import dense_causal_attention

TOL = {"atol": 1e-5, "rtol": 1e-5}
WHY_NO_CPP = (
    _ext.why_pure or "nanolab._C was built without paged_attention; reinstall with `pip install -e .`"
)
needs_cpp = pytest.mark.skipif(
    not HAS_CPP_KERNEL, reason=f"the C++ paged-attention kernel is unavailable: {WHY_NO_CPP}"
)
BACKENDS = ["torch", pytest.param("cpp", marks=needs_cpp)]
# (n_kv_heads, query heads per kv head): plain multi-head, GQA 2 and 4, and MQA.
GQA = [(4, 1), (2, 2), (2, 4), (1, 8)]
HYPOTHESIS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Paged(NamedTuple):
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 (B, width), padded with `pad`
    context_lens: torch.Tensor  # int32 (B,)
    ks: list[torch.Tensor]  # each sequence's keys in token order: (ctx, n_kv_heads, head_dim)
    vs: list[torch.Tensor]


def build(
    ctx_lens: list[int], block_size: int, n_kv: int, head_dim: int, seed: int = 0, pad: int = 0
) -> Paged:
    """Random k/v for each sequence, written through `write_kv` into shuffled physical blocks."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(per_seq) + 3  # a few blocks nobody owns
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(ctx_lens), max(per_seq, default=0) + 1), pad, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, n_kv, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    ks, vs = [], []
    for b, (c, n) in enumerate(zip(ctx_lens, per_seq)):
        tables[b, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
        k, v = torch.randn(2, c, n_kv, head_dim, generator=gen)
        write_kv(k_cache, v_cache, slot_of(tables[b], torch.arange(c), block_size), k, v)
        ks.append(k)
        vs.append(v)
    return Paged(k_cache, v_cache, tables, torch.tensor(ctx_lens, dtype=torch.int32), ks, vs)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense attention in float64 for the last q_len tokens of a sequence whose k/v are given."""
    T, q_len = k.shape[0], q.shape[0]
    q_full = torch.zeros(T, q.shape[1], q.shape[2], dtype=torch.float64)
    q_full[T - q_len :] = q.double()
    return dense_causal_attention(q_full, k.double(), v.double())[T - q_len :].float()


# --- the dense reference itself -------------------------------------------------------------------


@pytest.mark.parametrize(("n_kv", "group"), GQA)
def test_dense_reference_equals_torch_sdpa_with_is_causal(n_kv, group):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(9, n_kv * group, 16, generator=gen, dtype=torch.float64)
    k, v = torch.randn(2, 9, n_kv, 16, generator=gen, dtype=torch.float64)
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    torch.testing.assert_close(dense_causal_attention(q, k, v), want)


def test_dense_reference_first_token_sees_only_itself():
    q, k, v = torch.randn(3, 5, 2, 4).unbind(0)
    out = dense_causal_attention(q, k.clone(), v)
    assert torch.allclose(out[0], v[0], atol=1e-6)


# --- write_kv and the slot formula ----------------------------------------------------------------


def test_slots_follow_the_block_table():
    table = torch.tensor([7, 2, 5])
    got = slot_of(table, torch.arange(10), block_size=4)
    assert got.tolist() == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21]
    # the same formula on plain ints and lists, as the paged cache's batch layout uses it
    assert slot_mapping([7, 2, 5], 0, 10, block_size=4) == got.tolist()


@given(block_size=st.sampled_from([1, 2, 3, 16]), ctx=st.integers(1, 70), seed=st.integers(0, 1000))
@HYPOTHESIS
def test_write_kv_puts_each_token_at_its_slot_and_nowhere_else(block_size, ctx, seed):
    p = build([ctx], block_size, n_kv=2, head_dim=3, seed=seed)
    flat_k, flat_v = p.k_cache.view(-1, 2, 3), p.v_cache.view(-1, 2, 3)
    table = p.block_tables[0].tolist()
    written = set()
    for pos in range(ctx):
        slot = table[pos // block_size] * block_size + pos % block_size
        assert torch.equal(flat_k[slot], p.ks[0][pos]) and torch.equal(flat_v[slot], p.vs[0][pos])
        written.add(slot)
    untouched = [s for s in range(flat_k.shape[0]) if s not in written]
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()
    assert torch.equal(gather_kv(p.k_cache, p.block_tables[0], ctx), p.ks[0])


# --- decode ---------------------------------------------------------------------------------------


def decode_case(p: Paged, n_heads: int, seed: int = 0):
    """One query per sequence and the dense answer for it."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(p.ks), n_heads, p.k_cache.shape[3], generator=gen)
    want = torch.cat([reference(q[b : b + 1], p.ks[b], p.vs[b]) for b in range(len(p.ks))])
    return q, want


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 2, 16, 32])
def test_decode_at_block_boundaries_matches_dense(backend, block_size):
    """Contexts of one token, exactly k blocks, and one past: the partial-block edge cases."""
    lens = [1, block_size, block_size + 1, 2 * block_size, 2 * block_size + 1, 3 * block_size - 1 or 1]
    p = build(lens, block_size, n_kv=2, head_dim=32)
    q, want = decode_case(p, n_heads=4)
    got = paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, backend=backend)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@given(
    block_size=st.sampled_from([1, 2, 5, 16, 32]),
    lens=st.lists(st.integers(1, 300), min_size=1, max_size=5),
    gqa=st.sampled_from(GQA),
    head_dim=st.sampled_from([4, 20, 40, 64]),
    seed=st.integers(0, 10_000),
)
@HYPOTHESIS
def test_decode_matches_dense_for_any_paging(backend, block_size, lens, gqa, head_dim, seed):
    n_kv, group = gqa
    p = build(lens, block_size, n_kv, head_dim, seed=seed)
    q, want = decode_case(p, n_kv * group, seed)
    got = paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, backend=backend)
    torch.testing.assert_close(got, want, **TOL)


@needs_cpp
@given(
    block_size=st.sampled_from([1, 3, 16]),
    lens=st.lists(st.integers(1, 200), min_size=1, max_size=8),
    gqa=st.sampled_from(GQA),
    seed=st.integers(0, 10_000),
)
@HYPOTHESIS
def test_cpp_and_torch_backends_agree(block_size, lens, gqa, seed):
    n_kv, group = gqa
    p = build(lens, block_size, n_kv, 32, seed=seed)
    q, _ = decode_case(p, n_kv * group, seed)
    args = (q, p.k_cache, p.v_cache, p.block_tables, p.context_lens)
    torch.testing.assert_close(
        paged_decode_attention(*args, backend="cpp"), paged_decode_attention(*args, backend="torch"), **TOL
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pad", [0, -1, 10**6])
def test_block_table_padding_is_never_read(backend, pad):
    """Entries past a sequence's context may hold anything; a short sequence beside a long one is fine."""
    p = build([3, 40, 17], block_size=8, n_kv=2, head_dim=16, pad=pad)
    q, want = decode_case(p, n_heads=4)
    got = paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, backend=backend)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_scores_stay_finite_and_correct(backend):
    """The softmax subtracts the max: scores in the thousands neither overflow nor lose the answer."""
    p = build([50, 7], block_size=4, n_kv=1, head_dim=16, seed=3)
    q, _ = decode_case(p, n_heads=2, seed=3)
    q = q * 300
    want = torch.cat([reference(q[b : b + 1], p.ks[b], p.vs[b]) for b in range(2)])
    got = paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, backend=backend)
    assert got.isfinite().all()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@needs_cpp
def test_cpp_output_for_a_sequence_is_bitwise_independent_of_its_batch_and_threads():
    """A sequence decoded alone or beside others, on 1 or 4 threads, gets the very same bits."""
    from nanolab._ext import _C

    # Enough work that the kernel starts threads (it runs small calls on the calling thread).
    lens = [5, 900, 640, 1290, 77, 333]
    p = build(lens, block_size=16, n_kv=2, head_dim=64, seed=7)
    q = torch.randn(len(lens), 8, 64, generator=torch.Generator().manual_seed(7))
    batch = paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, backend="cpp")
    for b in range(len(lens)):
        alone = paged_decode_attention(
            q[b : b + 1],
            p.k_cache,
            p.v_cache,
            p.block_tables[b : b + 1],
            p.context_lens[b : b + 1],
            backend="cpp",
        )
        assert torch.equal(alone, batch[b : b + 1])
    arrays = (q.numpy(), p.k_cache.numpy(), p.v_cache.numpy(), p.block_tables.numpy(), p.context_lens.numpy())
    one, four = (_C.paged_attention(*arrays, None, 64**-0.5, n) for n in (1, 4))
    assert (one == four).all() and torch.equal(torch.from_numpy(one), batch)


@needs_cpp
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_cpp_kernel_runs_on_torchs_own_openmp_threads():
    """Built with OpenMP, the kernel's threads are torch's own team: the process maps one libgomp, the one
    torch's wheel ships, also when nanolab's kernels are loaded before torch is imported (``import nanolab``
    does). Threads of the kernel's own would share the cores with torch's, which spin-wait for a while after
    every matmul."""
    if _ext._C.threading != "openmp":
        pytest.skip("nanolab._C was built without OpenMP: the kernel starts threads of its own")
    shipped = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if not shipped.exists():
        pytest.skip("this torch build ships no libgomp.so.1 of its own (a conda build)")
    probe = (
        "import sys; import nanolab; assert 'torch' not in sys.modules; import torch; "
        "torch.mm(torch.ones(64, 64), torch.ones(64, 64)); "
        "print(sorted({line.split()[-1] for line in open('/proc/self/maps') if 'libgomp' in line}))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == str([str(shipped.resolve())])


# --- prefill over a cached prefix, and mixed batches ----------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@given(
    block_size=st.sampled_from([1, 2, 16, 32]),
    ctx=st.integers(1, 260),
    q_frac=st.floats(0.0, 1.0),
    gqa=st.sampled_from(GQA),
    seed=st.integers(0, 10_000),
)
@HYPOTHESIS
def test_prefill_with_cached_prefix_equals_dense_over_the_whole_sequence(
    backend, block_size, ctx, q_frac, gqa, seed
):
    """The last q_len rows of dense attention over all ctx tokens, from a paged prefix + new chunk."""
    n_kv, group = gqa
    q_len = max(1, round(q_frac * ctx))
    p = build([ctx], block_size, n_kv, 16, seed=seed)
    q = torch.randn(q_len, n_kv * group, 16, generator=torch.Generator().manual_seed(seed))
    got = paged_prefill_attention(q, p.k_cache, p.v_cache, p.block_tables[0], ctx, backend=backend)
    torch.testing.assert_close(got, reference(q, p.ks[0], p.vs[0]), **TOL)


@pytest.mark.parametrize("backend", [*BACKENDS, "auto"])
@pytest.mark.parametrize(("n_kv", "group"), GQA)
def test_mixed_batch_of_decodes_and_chunks_matches_dense(backend, n_kv, group):
    """One call for a whole batch; "auto" splits it (C++ decodes, long chunks through torch)."""
    lens, q_lens = [1, 40, 33, 100, 16, 7], [1, 1, 33, 20, 1, 7]
    p = build(lens, block_size=16, n_kv=n_kv, head_dim=32, seed=5)
    gen = torch.Generator().manual_seed(5)
    qs = [torch.randn(n, n_kv * group, 32, generator=gen) for n in q_lens]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    got = paged_attention(
        torch.cat(qs), p.k_cache, p.v_cache, p.block_tables, p.context_lens, qsl, backend=backend
    )
    want = torch.cat([reference(qs[s], p.ks[s], p.vs[s]) for s in range(len(lens))])
    torch.testing.assert_close(got, want, **TOL)


def test_auto_backend_gives_the_same_answer_as_torch():
    p = build([12, 90], block_size=16, n_kv=2, head_dim=32, seed=2)
    q, want = decode_case(p, n_heads=4, seed=2)
    got = paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, p.context_lens)
    torch.testing.assert_close(got, want, **TOL)
    prefill = paged_prefill_attention(q[:1].expand(90, 4, 32), p.k_cache, p.v_cache, p.block_tables[1], 90)
    torch.testing.assert_close(prefill, reference(q[:1].expand(90, 4, 32), p.ks[1], p.vs[1]), **TOL)


# --- bad input ------------------------------------------------------------------------------------


def bad_decode_calls():
    """(description, kwargs overrides, message regex) for paged_decode_attention on a good base call."""
    return [
        (
            "context too long",
            {"context_lens": [5, 17]},
            r"context_lens\[1\] is 17 but block_tables holds 2 blocks of 8 = 16",
        ),
        (
            "empty context",
            {"context_lens": [0, 3]},
            r"context_lens\[0\] is 0 but the sequence has 1 query token",
        ),
        (
            "bad block id",
            {"block_tables": [[0, 0], [1, 99]]},
            r"block_tables\[1, 1\] is 99, which is not a block .*num_blocks = 4",
        ),
        ("negative block id", {"block_tables": [[-2, 0], [1, 2]]}, r"block_tables\[0, 0\] is -2"),
        ("head_dim", {"q": torch.zeros(2, 4, 5)}, r"q must be \(tokens, n_heads, head_dim\) with head_dim 8"),
        ("heads not a multiple", {"q": torch.zeros(2, 3, 8)}, r"n_heads a multiple of n_kv_heads 2"),
        (
            "one query per sequence",
            {"q": torch.zeros(3, 4, 8)},
            r"q has 3 tokens but block_tables has 2 rows",
        ),
        ("lens shape", {"context_lens": [5]}, r"context_lens must be an integer \(B,\) tensor with B = 2"),
        ("float tables", {"block_tables": [[0.0, 1.0], [2.0, 3.0]]}, r"block_tables must be an integer"),
        ("backend name", {"backend": "gpu"}, r"backend must be 'auto', 'cpp' or 'torch', got 'gpu'"),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("what", "change", "match"), bad_decode_calls(), ids=[c[0] for c in bad_decode_calls()]
)
def test_bad_decode_input_names_the_problem(backend, what, change, match):
    call = {
        "q": torch.zeros(2, 4, 8),
        "k_cache": torch.zeros(4, 8, 2, 8),
        "v_cache": torch.zeros(4, 8, 2, 8),
        "block_tables": [[0, 1], [2, 3]],
        "context_lens": [5, 9],
        "backend": backend,
    }
    call.update(change)
    for key in ("block_tables", "context_lens"):
        if isinstance(call[key], list):
            t = torch.tensor(call[key])
            call[key] = t if t.dtype.is_floating_point else t.to(torch.int32)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(**call)


@needs_cpp
def test_cpp_backend_refuses_caches_it_would_have_to_copy():
    k = torch.zeros(4, 8, 2, 8, dtype=torch.float64)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"needs float32 CPU tensors but k_cache is torch.float64"):
        paged_decode_attention(torch.zeros(1, 2, 8), k, k.clone(), table, lens, backend="cpp")
    strided = torch.zeros(4, 8, 2, 16)[..., :8]
    with pytest.raises(ValueError, match=r"must be contiguous"):
        paged_decode_attention(torch.zeros(1, 2, 8), strided, strided, table, lens, backend="cpp")


def test_bad_prefill_input_names_the_problem():
    cache = torch.zeros(4, 8, 2, 8)
    q = torch.zeros(3, 4, 8)
    with pytest.raises(
        ValueError, match=r"context_len is 17 but block_table holds 2 blocks of 8 = 16 tokens; widen"
    ):
        paged_prefill_attention(q, cache, cache.clone(), torch.tensor([0, 1]), 17)
    with pytest.raises(ValueError, match=r"context_len is 2 but q has 3 tokens, whose own keys"):
        paged_prefill_attention(q, cache, cache.clone(), torch.tensor([0, 1]), 2)
    with pytest.raises(ValueError, match=r"block_table\[1\] is 4, which is not a block"):
        paged_prefill_attention(q, cache, cache.clone(), torch.tensor([0, 4]), 9)
    with pytest.raises(ValueError, match=r"block_table must be 1-D"):
        paged_prefill_attention(q, cache, cache.clone(), torch.tensor([[0, 1]]), 9)


def test_bad_query_start_loc_is_rejected():
    cache = torch.zeros(4, 8, 2, 8)
    tables, lens = torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([4, 4], dtype=torch.int32)
    for qsl in ([0, 2, 1], [1, 2, 3], [0, 1]):
        with pytest.raises(ValueError, match=r"query_start_loc"):
            paged_attention(torch.zeros(3, 4, 8), cache, cache.clone(), tables, lens, torch.tensor(qsl))


def test_bad_write_kv_input_names_the_problem():
    k_cache, v_cache = torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8)
    k = torch.ones(3, 2, 8)
    with pytest.raises(
        ValueError, match=r"slot_mapping holds slot 8, but the cache has 8 slots \(2 blocks of 4\)"
    ):
        write_kv(k_cache, v_cache, torch.tensor([0, 1, 8]), k, k)
    with pytest.raises(ValueError, match=r"slot_mapping holds slot -1"):
        write_kv(k_cache, v_cache, torch.tensor([-1, 1, 2]), k, k)
    with pytest.raises(ValueError, match=r"k has shape \(3, 2, 8\), expected .* \(2, 2, 8\)"):
        write_kv(k_cache, v_cache, torch.tensor([0, 1]), k, k[:2])
    with pytest.raises(ValueError, match=r"slot_mapping must hold integers"):
        write_kv(k_cache, v_cache, torch.tensor([0.0, 1.0, 2.0]), k, k)
    assert (k_cache == 0).all() and (v_cache == 0).all()  # nothing was written by the failed calls


def test_pure_python_mode_uses_torch_and_refuses_cpp():
    code = (
        "import torch\n"
        "from nanolab.memory.paged_attention import HAS_CPP_KERNEL, paged_decode_attention as f\n"
        "c = torch.randn(2, 4, 1, 8); t = torch.tensor([[0, 1]], dtype=torch.int32); n = torch.tensor([6], dtype=torch.int32)\n"
        "out = f(torch.randn(1, 2, 8), c, c.clone(), t, n)\n"
        "print(HAS_CPP_KERNEL, out.isfinite().all().item())\n"
        "try:\n    f(torch.randn(1, 2, 8), c, c.clone(), t, n, backend='cpp')\n"
        "except RuntimeError as e:\n    print(e)\n"
    )
    env = {**os.environ, "NANOLAB_PURE_PYTHON": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    first, second = out.stdout.splitlines()
    assert first == "False True"
    assert "C++ paged-attention kernel is not available (NANOLAB_PURE_PYTHON is set)" in second


def test_default_scale_is_one_over_sqrt_head_dim():
    p = build([20], block_size=4, n_kv=1, head_dim=16, seed=9)
    q, _ = decode_case(p, n_heads=1, seed=9)
    args = (q, p.k_cache, p.v_cache, p.block_tables, p.context_lens)
    torch.testing.assert_close(
        paged_decode_attention(*args, backend="torch"),
        paged_decode_attention(*args, 1 / math.sqrt(16), "torch"),
    )
    assert not torch.allclose(
        paged_decode_attention(*args, backend="torch"), paged_decode_attention(*args, 1.0, "torch")
    )
