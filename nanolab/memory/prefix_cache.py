"""The prefix cache contract: what the engine needs from a cache of already-computed prompt prefixes.

Requests often share a prefix (a system prompt, a few-shot preamble, the earlier turns of a chat). A
prefix cache keeps the KV blocks of prefixes it has seen, so a new request that starts the same way
reuses those blocks instead of computing them again. `nanolab.memory.radix_cache.RadixCache` is the reference
implementation; a learner's own cache that follows `PrefixCacheProtocol` can stand in for it.

How the engine drives a prefix cache, for one request:

1. ``m = cache.match_prefix(prompt)``; then at once ``cache.lock(m.node)`` so nothing the request reuses
   is evicted while it runs, and ``allocator.incref(m.blocks)`` because the request's block table holds
   those blocks too. ``cache.record(len(prompt), m.num_tokens)`` counts the hit once.
2. The request computes only ``prompt[m.num_tokens:]``, in new blocks from the allocator (calling
   ``cache.evict(n)`` first when the allocator is short of free blocks).
3. When the request finishes: ``cache.insert(tokens, full_blocks)`` hands the tree the blocks it does
   not have yet (the tree takes its own reference), then the request frees all of its own references
   (``allocator.free(block_table)``) and calls ``cache.unlock(m.node)``. ``tokens`` are the tokens
   whose KV is in the blocks: the last sampled token has none yet, so it is left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable


def reusable_prefix(prompt: Sequence[int], cached: Sequence[int], block_size: int) -> int:
    """How many of ``prompt``'s tokens a prefix cache holding ``cached`` (a sequence whose whole blocks
    are cached) serves instead of computing.

    The two share a common prefix of some length; a cache of blocks serves only the whole blocks of it,
    and never the whole prompt: at least one prompt token is computed, because its logits give the first
    output token. So the answer is the common prefix, cut down to whole blocks and capped at
    ``(len(prompt) - 1) // block_size * block_size``. Raises ValueError for a ``block_size`` below 1.

    Example:
        >>> reusable_prefix([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9], block_size=2)
        4
        >>> reusable_prefix([1, 2, 3, 4], [1, 2, 3, 4], block_size=2)  # the same prompt: one block is computed
        2
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    common = 0
    for a, b in zip(prompt, cached):
        if a != b:
            break
        common += 1
    cap = max(0, (len(prompt) - 1) // block_size * block_size)
    return min(common // block_size * block_size, cap)


class MatchResult(NamedTuple):
    """The longest cached prefix of a prompt, as returned by `PrefixCacheProtocol.match_prefix`."""

    blocks: list[int]  # KV block ids of the cached prefix, one per block_size tokens
    num_tokens: int  # len(blocks) * block_size: how many prompt tokens need no computing
    node: Any  # opaque handle for lock/unlock: where the match ends (the tree's root for an empty match)


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix cache hit statistics since the cache was made or last reset."""

    num_requests: int = 0  # calls to record(): one per admitted request
    prompt_tokens: int = 0  # prompt tokens of those requests
    cached_tokens: int = 0  # prompt tokens served from the cache instead of computed

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens (0.0 before any prompt was recorded)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@runtime_checkable
class PrefixCacheProtocol(Protocol):
    """What the engine needs from a prefix cache that stores KV blocks of ``block_size`` tokens.

    Sizes are in tokens and always a multiple of ``block_size``: only full blocks are cached. The
    cache holds one allocator reference on every block it stores; it never frees a block it did not
    take a reference on.
    """

    block_size: int

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Find the longest cached prefix of ``token_ids`` made of whole blocks.

        The match is capped at ``((len(token_ids) - 1) // block_size) * block_size`` tokens, so at least
        one prompt token is left to compute (its logits give the first output token). Marks the matched
        path as recently used. Does not lock anything and does not change any ref count: call `lock`
        on ``result.node`` before anything may evict (before the next `evict`).
        """
        ...

    def lock(self, node: Any) -> None:
        """Protect the path from the root to ``node`` from eviction (one more lock on each node)."""
        ...

    def unlock(self, node: Any) -> None:
        """Undo one `lock` of ``node``. Raises `ValueError` if ``node`` is not locked."""
        ...

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int]) -> int:
        """Cache ``token_ids`` (truncated to whole blocks), whose KV lives in ``blocks``.

        Requires ``len(blocks) == len(token_ids) // block_size`` (`ValueError` otherwise). Returns how
        many leading tokens were cached already: the cache keeps its own blocks for those and takes a
        reference (``allocator.incref``) on the blocks of the new part only. The caller still frees
        all of its own references afterwards, so its duplicates of cached blocks go back to the pool.
        """
        ...

    def evict(self, num_blocks: int) -> int:
        """Free cached blocks that no request has locked, least recently used first.

        Stops once at least ``num_blocks`` blocks are freed or nothing evictable is left, and returns
        how many were freed (it may free more than asked: a tree frees whole nodes). Freeing drops the
        cache's own reference only.
        """
        ...

    def reset(self) -> None:
        """Drop every cached block and the statistics. Raises `RuntimeError` if anything is locked."""
        ...

    def record(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Count one request's prompt length and how much of it the cache served, for `stats`."""
        ...

    def stats(self) -> PrefixCacheStats:
        """A snapshot of the hit statistics recorded so far."""
        ...

    @property
    def total_size(self) -> int:
        """Tokens cached (always ``evictable_size + protected_size``)."""
        ...

    @property
    def evictable_size(self) -> int:
        """Cached tokens that no lock protects: what ``evict`` could free, in tokens."""
        ...

    @property
    def protected_size(self) -> int:
        """Cached tokens on locked paths."""
        ...
