"""Paged attention speed: the C++ kernel and torch gather + SDPA against SDPA on an unpaged cache.

Decode: B sequences, one new token each, every sequence holding ``ctx`` tokens in 16-token blocks
scattered at random over the pool (as they end up after a while of serving). The baseline is
PyTorch's scaled_dot_product_attention on the same keys and values stored contiguously
(B, n_kv_heads, ctx, head_dim), with the query heads that share a kv head passed as query rows (the
fastest way to run GQA decode through SDPA). It is what attention would cost with no paging at all.
All three run in the same process on the same data; times are the best of several runs, and the
table reports each paged backend's time as a multiple of the baseline (lower is better).

Prefill: one sequence's last q_len tokens over a ctx-token paged context, C++ kernel vs torch; this
is what sets ``nanolab.memory.attention_backends.AUTO_CPP_MAX_PREFILL``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from tqdm import tqdm

from nanolab.memory.attention_backends import AUTO_CPP_MAX_PREFILL
from nanolab.memory.paged_attention import HAS_CPP_KERNEL, paged_decode_attention, paged_prefill_attention


class Shape(NamedTuple):
    name: str
    n_heads: int
    n_kv_heads: int
    head_dim: int


SHAPES = [Shape("small (8/4 heads, d=64)", 8, 4, 64), Shape("large (32/8 heads, d=128)", 32, 8, 128)]
BLOCK_SIZE = 16


def race(fns: dict[str, Callable[[], object]], min_time: float, min_rounds: int = 3) -> dict[str, float]:
    """Best time in ms of each function.

    The functions take turns, round after round, so a busy spell on the machine hits all of them
    alike rather than whichever one happened to be running.
    """
    for fn in fns.values():
        fn()  # warm up
    best = dict.fromkeys(fns, float("inf"))
    spent, rounds = 0.0, 0
    while rounds < min_rounds or spent < min_time * len(fns):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            best[name], spent = min(best[name], dt), spent + dt
        rounds += 1
    return {name: t * 1e3 for name, t in best.items()}


def paged_copy(k: torch.Tensor, v: torch.Tensor, gen: torch.Generator):
    """The contiguous (B, kv, ctx, hs) k/v stored in shuffled blocks: (k_cache, v_cache, block_tables)."""
    B, n_kv, ctx, hs = k.shape
    per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = B * per_seq
    tables = torch.randperm(num_blocks, generator=gen).view(B, per_seq)
    caches = []
    for x in (k, v):
        padded = torch.zeros(B, per_seq * BLOCK_SIZE, n_kv, hs)
        padded[:, :ctx] = x.transpose(1, 2)
        cache = torch.empty(num_blocks, BLOCK_SIZE, n_kv, hs)
        cache[tables.flatten()] = padded.view(B * per_seq, BLOCK_SIZE, n_kv, hs)
        caches.append(cache)
    return caches[0], caches[1], tables.to(torch.int32)


def decode_row(shape: Shape, B: int, ctx: int, min_time: float) -> dict[str, float]:
    gen = torch.Generator().manual_seed(B * 10_000 + ctx)
    nh, nkv, hs = shape.n_heads, shape.n_kv_heads, shape.head_dim
    q = torch.randn(B, nh, hs, generator=gen)
    k = torch.randn(B, nkv, ctx, hs, generator=gen)
    v = torch.randn(B, nkv, ctx, hs, generator=gen)
    k_cache, v_cache, tables = paged_copy(k, v, gen)
    lens = torch.full((B,), ctx, dtype=torch.int32)
    q_grouped = q.view(B, nkv, nh // nkv, hs)

    def contiguous():
        return F.scaled_dot_product_attention(q_grouped, k, v).view(B, nh, hs)

    def paged(backend: str):
        return lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, backend=backend)

    fns = {"contiguous": contiguous, "torch": paged("torch")}
    if HAS_CPP_KERNEL:
        fns["cpp"] = paged("cpp")
    want = contiguous()
    for name in fns:
        assert torch.allclose(fns[name](), want, atol=1e-4), f"{name} disagrees with the contiguous SDPA"
    return race(fns, min_time)


def prefill_row(shape: Shape, q_len: int, ctx: int, min_time: float) -> dict[str, float]:
    gen = torch.Generator().manual_seed(q_len * 10_000 + ctx)
    nh, nkv, hs = shape.n_heads, shape.n_kv_heads, shape.head_dim
    q = torch.randn(q_len, nh, hs, generator=gen)
    k = torch.randn(1, nkv, ctx, hs, generator=gen)
    v = torch.randn(1, nkv, ctx, hs, generator=gen)
    k_cache, v_cache, tables = paged_copy(k, v, gen)

    def paged(backend: str):
        return lambda: paged_prefill_attention(q, k_cache, v_cache, tables[0], ctx, backend=backend)

    return race({b: paged(b) for b in (("torch", "cpp") if HAS_CPP_KERNEL else ("torch",))}, min_time)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--ctx", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds spent timing each backend")
    args = parser.parse_args()

    print(f"paged attention, fp32, block size {BLOCK_SIZE}, {torch.get_num_threads()} torch threads")
    if not HAS_CPP_KERNEL:
        print("  (the C++ kernel is not built or NANOLAB_PURE_PYTHON is set: torch rows only)")
    decode_jobs = [(s, B, ctx) for s in SHAPES for B in args.batch for ctx in args.ctx]
    rows = [
        decode_row(s, B, ctx, args.min_time) for s, B, ctx in tqdm(decode_jobs, desc="decode", leave=False)
    ]
    prefill_jobs = [(SHAPES[0], n, 1024) for n in (1, 4, 8, 16, 64, 256)]
    prows = [prefill_row(*job, args.min_time) for job in tqdm(prefill_jobs, desc="prefill", leave=False)]

    print("\ndecode: ms per call (best); x = time / contiguous SDPA (lower is better)")
    head = f"{'shape':<27}{'B':>4}{'ctx':>6}{'contig SDPA':>13}{'C++ kernel':>19}{'torch gather+SDPA':>21}"
    print(head + "\n" + "-" * len(head))
    for (shape, B, ctx), row in zip(decode_jobs, rows):
        base = row["contiguous"]
        cpp = f"{row['cpp']:9.3f} ({row['cpp'] / base:5.2f}x)" if "cpp" in row else f"{'-':>18}"
        print(
            f"{shape.name:<27}{B:>4}{ctx:>6}{base:13.3f}{cpp:>19}"
            f"{row['torch']:11.3f} ({row['torch'] / base:5.2f}x)"
        )

    print(f"\nprefill, {SHAPES[0].name}, ctx 1024: ms per call; x = C++ / torch")
    print(
        f"  (backend='auto' sends chunks of up to {AUTO_CPP_MAX_PREFILL} tokens to C++, longer ones to torch)"
    )
    for (_, q_len, _), row in zip(prefill_jobs, prows):
        ratio = f"  ({row['cpp'] / row['torch']:5.2f}x)" if "cpp" in row else ""
        print(
            f"  q_len {q_len:>5}: torch {row['torch']:9.3f}   C++ {row.get('cpp', float('nan')):9.3f}{ratio}"
        )


if __name__ == "__main__":
    main()
