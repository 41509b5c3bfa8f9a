"""Paged attention speed: the C++ kernel and torch gather + SDPA against SDPA on an unpaged cache.

Decode: B sequences, one new token each, every sequence holding ``ctx`` tokens in 16-token blocks
scattered at random over the pool (as they end up after a while of serving). The baseline is
PyTorch's scaled_dot_product_attention on the same keys and values stored contiguously
(B, n_kv_heads, ctx, head_dim), with the query heads that share a kv head passed as query rows (the
fastest way to run GQA decode through SDPA). It is what attention would cost with no paging at all.
All three run in the same process on the same data, taking turns in a shuffled order; times are the
best of several runs, and the table reports each paged backend's time as a multiple of the baseline
(lower is better). By default whatever the previous calls left in the CPU's caches stays there; with
``--cold`` a buffer twice the size of the last-level caches is read before every call, so each backend
reads its keys and values from memory, as the engine's decode steps do at large batches and contexts.

Prefill: one sequence's last q_len tokens over a ctx-token paged context, C++ kernel vs torch; this
is what sets ``nanolab.memory.attention_backends.AUTO_CPP_MAX_PREFILL``.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from pathlib import Path
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


def race(
    fns: dict[str, Callable[[], object]],
    min_time: float,
    before: Callable[[str], object] | None = None,
    rounds: int | None = None,
) -> dict[str, float]:
    """Best time in ms of each function.

    The functions take turns, round after round, in a shuffled order each round, so a busy spell on the
    machine hits all of them alike rather than whichever one happened to be running, and none always
    runs right after the same other one (whose leftovers in the caches it would inherit). ``before(name)``
    runs, untimed, before every call of the function ``name``. ``rounds``: exactly that many rounds
    (None: at least 3, and until each function has had ``min_time`` seconds on average).
    """
    for fn in fns.values():
        fn()  # warm up
    best = dict.fromkeys(fns, float("inf"))
    spent, done = 0.0, 0
    order = list(fns.items())
    shuffle = random.Random(0).shuffle
    while (done < rounds) if rounds is not None else (done < 3 or spent < min_time * len(fns)):
        shuffle(order)
        for name, fn in order:
            if before is not None:
                before(name)
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            best[name], spent = min(best[name], dt), spent + dt
        done += 1
    return {name: t * 1e3 for name, t in best.items()}


def last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The machine's last-level caches together, as Linux reports them: each cache once, however many
    CPUs share it (two sockets have two). ``default`` where Linux says nothing."""
    caches: dict[tuple[int, str], int] = {}  # (level, the CPUs sharing it) -> bytes
    for d in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            if (d / "type").read_text().strip() == "Instruction":
                continue
            level = int((d / "level").read_text())
            text = (d / "size").read_text().strip()
            shared = (d / "shared_cpu_list").read_text().strip()
        except (OSError, ValueError):
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        if text.rstrip("KMG").isdigit():
            caches[level, shared] = int(text.rstrip("KMG")) * unit
    if not caches:
        return default
    top = max(level for level, _ in caches)
    return sum(size for (level, _), size in caches.items() if level == top)


class CacheEvictor:
    """Reads a buffer twice the size of the last-level caches, which pushes everything else out of them.

    Called before each timed call (``--cold``), it makes every backend read its keys and values from
    memory, as a decode step does in the engine: there each layer's cache is read once per step, and
    the other layers' caches and weights pass through the caches in between. The buffer is written once
    at the start (untouched pages would all read the same zero page) and only read afterwards, so no
    dirty lines are left to be written back during the next timed call."""

    def __init__(self) -> None:
        self.nbytes = max(2 * last_level_cache_bytes(), 64 << 20)
        self.buffer = torch.ones(self.nbytes // 4)

    def __call__(self) -> None:
        self.buffer.sum()


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


def decode_fns(shape: Shape, B: int, ctx: int) -> dict[str, Callable[[], object]]:
    """The decode backends on one problem, checked against the contiguous SDPA."""
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
    return fns


def prefill_fns(shape: Shape, q_len: int, ctx: int) -> dict[str, Callable[[], object]]:
    gen = torch.Generator().manual_seed(q_len * 10_000 + ctx)
    nh, nkv, hs = shape.n_heads, shape.n_kv_heads, shape.head_dim
    q = torch.randn(q_len, nh, hs, generator=gen)
    k = torch.randn(1, nkv, ctx, hs, generator=gen)
    v = torch.randn(1, nkv, ctx, hs, generator=gen)
    k_cache, v_cache, tables = paged_copy(k, v, gen)

    def paged(backend: str):
        return lambda: paged_prefill_attention(q, k_cache, v_cache, tables[0], ctx, backend=backend)

    return {b: paged(b) for b in (("torch", "cpp") if HAS_CPP_KERNEL else ("torch",))}


def timed(
    make: Callable[[Shape, int, int], dict[str, Callable[[], object]]],
    shape: Shape,
    n: int,
    ctx: int,
    min_time: float,
    evict: CacheEvictor | None,
    rounds: int,
) -> dict[str, float]:
    """`race` the backends ``make(shape, n, ctx)`` returns; with ``evict``, each call's keys and values
    come from memory (``rounds`` calls).

    After the eviction, each backend first runs on a one-block problem (``make(shape, 1, BLOCK_SIZE)``): in
    the engine its code runs in every layer of every step and stays in the caches, while the keys and
    values it reads are new to them. Without that warm-up the Python around a kernel runs from memory
    too, which costs the paged backends (a few Python calls each) more than one call of SDPA.
    """
    fns = make(shape, n, ctx)
    if evict is None:
        return race(fns, min_time)
    small = make(shape, 1, BLOCK_SIZE)

    def before(name: str) -> None:
        evict()
        small[name]()

    return race(fns, min_time, before=before, rounds=rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--ctx", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds spent timing each backend")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="push the keys and values out of the CPU's caches before every call (the engine's case at "
        "large batches and contexts); each backend then runs --cold-rounds times",
    )
    parser.add_argument("--cold-rounds", type=int, default=15, help="calls of each backend with --cold")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small problems, short timings (a smoke test; the ratios mean little)",
    )
    args = parser.parse_args()
    if args.cold_rounds < 1:
        parser.error("--cold-rounds must be >= 1")
    prefill_ctx, prefill_lens = 1024, (1, 4, 8, 16, 64, 256)
    if args.quick:
        args.batch, args.ctx, args.min_time, args.cold_rounds = [1, 4], [32], 0.01, 2
        prefill_ctx, prefill_lens = 64, (1, 8)
    evict = CacheEvictor() if args.cold else None

    print(f"paged attention, fp32, block size {BLOCK_SIZE}, {torch.get_num_threads()} torch threads")
    if args.cold:
        print(
            f"  --cold: a {evict.nbytes >> 20} MB buffer is read before every call, then the backend runs on "
            f"one block; best of {args.cold_rounds}"
        )
    if not HAS_CPP_KERNEL:
        print("  (the C++ kernel is not built or NANOLAB_PURE_PYTHON is set: torch rows only)")
    decode_jobs = [(s, B, ctx) for s in SHAPES for B in args.batch for ctx in args.ctx]
    timing = (args.min_time, evict, args.cold_rounds)
    rows = [timed(decode_fns, *job, *timing) for job in tqdm(decode_jobs, desc="decode", leave=False)]
    prefill_jobs = [(SHAPES[0], n, prefill_ctx) for n in prefill_lens]
    prows = [timed(prefill_fns, *job, *timing) for job in tqdm(prefill_jobs, desc="prefill", leave=False)]

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

    print(f"\nprefill, {SHAPES[0].name}, ctx {prefill_ctx}: ms per call; x = C++ / torch")
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
