"""Block allocator speed: the C++ class vs its pure-Python twin, measured in the same run.

The workload imitates a serving engine: many requests each take a few blocks, some blocks get shared
(incref), then everything is freed in a scrambled order. One "operation" is one allocate, incref or
free call. Prints operations per second for both and the ratio.
"""

from __future__ import annotations

import argparse
import random
import time

from nanolab import PyBlockAllocator

try:
    from nanolab._C import BlockAllocator as CppBlockAllocator
except ImportError:  # pragma: no cover - reported below
    CppBlockAllocator = None


def workload(make, num_blocks: int, rounds: int, seed: int = 0) -> int:
    """Run the workload once; return the number of allocator calls made."""
    rng = random.Random(seed)
    sizes = [rng.randint(1, 8) for _ in range(num_blocks)]
    a = make(num_blocks)
    calls = 0
    for _ in range(rounds):
        held: list[list[int]] = []
        i = 0
        while a.num_free >= 8:
            held.append(a.allocate(sizes[i % len(sizes)]))
            calls += 1
            if i % 4 == 0:
                a.incref(held[-1][:1])
                held.append(held[-1][:1])
                calls += 1
            i += 1
        rng.shuffle(held)
        for blocks in held:
            a.free(blocks)
            calls += 1
    assert a.num_free == num_blocks
    return calls


def ops_per_second(make, num_blocks: int, rounds: int, repeats: int) -> float:
    best = float("inf")
    calls = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        calls = workload(make, num_blocks, rounds)
        best = min(best, time.perf_counter() - t0)
    return calls / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    py = ops_per_second(PyBlockAllocator, args.num_blocks, args.rounds, args.repeats)
    print(
        f"block allocator, {args.num_blocks} blocks, {args.rounds} fill/drain rounds, best of {args.repeats}"
    )
    print(f"  python twin : {py:12,.0f} ops/s")
    if CppBlockAllocator is None:
        print("  C++ kernel  : not built (run `make setup`)")
        return
    cpp = ops_per_second(CppBlockAllocator, args.num_blocks, args.rounds, args.repeats)
    print(f"  C++ kernel  : {cpp:12,.0f} ops/s")
    print(f"  ratio C++ / python: {cpp / py:.2f}x")


if __name__ == "__main__":
    main()
