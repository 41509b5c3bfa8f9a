from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


class OutOfBlocksError(RuntimeError):
    """More KV blocks were asked for than are free (nanolab's own error has the same name)."""


class KVPool:
    """The blocks of a paged KV cache, ``block_size`` token slots each: Lab 3's allocator, ids handed out first
    in, first out, as nanolab's. It can serve as nanolab's engine's allocator (``LLM(block_allocator=pool)``)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs blocks of at least one slot, got {num_blocks} x {block_size}")
        self.num_total = num_blocks
        self.block_size = block_size
        self._free = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    def allocate(self, n: int) -> list[int]:
        """n free blocks, each with one reference."""
        if n > len(self._free):
            raise OutOfBlocksError(f"cannot allocate {n} blocks: only {len(self._free)} are free")
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            self._refs[b] = 1
        return ids

    def incref(self, block_ids: Sequence[int]) -> None:
        """One more reference on each of these (held) blocks."""
        if any(not 0 <= b < self.num_total or self._refs[b] == 0 for b in block_ids):
            raise ValueError(f"incref of a block that is not held in {list(block_ids)}")
        for b in block_ids:
            self._refs[b] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block; a block whose last reference goes is free again. A block that is
        not held (never handed out, or freed already) is a ValueError, and nothing changes."""
        ids = list(block_ids)
        drops: dict[int, int] = {}
        for b in ids:
            drops[b] = drops.get(b, 0) + 1
        bad = [b for b, n in drops.items() if not 0 <= b < self.num_total or self._refs[b] < n]
        if bad:
            raise ValueError(f"free of block(s) {bad} that are not held (freed twice, or never handed out)")
        for b in ids:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)


@dataclass
class Seq:
    """A request as its KV cache sees it (nanolab's requests have these three fields too).

    ``num_tokens`` tokens are the request's prompt and output so far, the tokens kept by this step's
    verification included. ``num_computed_tokens`` positions have their keys and values written: right after
    a verification that counts the guesses' positions too, rejected ones included, so it may exceed
    ``num_tokens``. ``block_table[i]`` holds positions ``i * block_size`` to ``(i + 1) * block_size - 1``.
    """

    num_tokens: int
    num_computed_tokens: int
    block_table: list[int] = field(default_factory=list)


def draw_many(
    sampler: Callable,
    draft: Sequence[int] | None,
    target_probs,
    draft_probs=None,
    n: int = 1000,
    seed: int = 0,
) -> dict[tuple[int, ...], int]:
    """Call ``sampler(draft, target_probs, draft_probs, generator)`` ``n`` times with one generator seeded
    ``seed``; how many times each output came back. The checks use it to test a sampler's distribution.

    Without ``draft_probs`` the guesses are ``draft`` every time (certain guesses, as prompt lookup's). With
    it, ``draft`` is None: each call first draws its guesses from the rows of ``draft_probs``, with the same
    generator, as a draft model does, and passes them on.
    """
    p = torch.as_tensor(target_probs, dtype=torch.float32)
    q = None if draft_probs is None else torch.as_tensor(draft_probs, dtype=torch.float32)
    if (q is None) == (draft is None):
        raise ValueError(
            "give the guesses (draft) or the distribution they are drawn from (draft_probs), not both"
        )
    generator = torch.Generator().manual_seed(seed)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(n):
        guesses = (
            list(draft) if q is None else [int(torch.multinomial(row, 1, generator=generator)) for row in q]
        )
        out = sampler(guesses, p, q, generator)
        if not isinstance(out, list) or not all(isinstance(t, int) for t in out):
            raise TypeError(f"the sampler must return a list of ints, got {out!r:.80}")
        key = tuple(out)
        counts[key] = counts.get(key, 0) + 1
    return counts
