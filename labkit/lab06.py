from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


class OutOfBlocksError(RuntimeError):
    """More KV blocks were asked for than are free (nanolab's own error has the same name)."""


class BlockAllocator:
    """Lab 3's allocator with reference counts: ids handed out first in, first out, as nanolab's."""

    def __init__(self, num_blocks: int) -> None:
        self.num_total = num_blocks
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
        """One more reference on each of these (held) blocks: one more owner shares them."""
        if any(self._refs[b] == 0 for b in block_ids):
            raise ValueError(f"incref of a free block in {list(block_ids)}")
        for b in block_ids:
            self._refs[b] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each; a block whose last reference goes is free again."""
        if any(self._refs[b] == 0 for b in block_ids):
            raise ValueError(f"free of a block that is already free in {list(block_ids)}")
        for b in block_ids:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)


class MatchResult(NamedTuple):
    """The longest cached prefix of a prompt (nanolab's `MatchResult`)."""

    blocks: list[int]  # KV block ids of the cached prefix, one per block_size tokens
    num_tokens: int  # len(blocks) * block_size: prompt tokens that need no computing
    node: RadixNode  # where the match ends, for lock/unlock (the root for an empty match)


@dataclass(frozen=True)
class PrefixCacheStats:
    """Hit statistics (nanolab's `PrefixCacheStats`)."""

    num_requests: int = 0  # calls to record(): one per admitted request
    prompt_tokens: int = 0  # prompt tokens of those requests
    cached_tokens: int = 0  # prompt tokens served from the cache instead of computed

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(eq=False, repr=False)
class RadixNode:
    """One node of the tree: the edge from its parent (its tokens and their KV blocks) and its bookkeeping."""

    key: tuple[int, ...]  # token ids on the edge from the parent; len(key) == len(blocks) * block_size
    blocks: list[int]  # KV block ids of those tokens, one per block
    parent: RadixNode | None  # None for the root, and for a node evicted from the tree
    id: int  # creation order (the root is 0): breaks ties between nodes used at the same time
    children: dict[tuple[int, ...], RadixNode] = field(
        default_factory=dict
    )  # by the child's first block of tokens
    lock_ref: int = 0  # locks held on this node or on a node below it
    last_access: int = 0  # the cache's clock at the last match or insert through this node

    def __repr__(self) -> str:
        return f"RadixNode(id={self.id}, tokens={list(self.key)}, blocks={self.blocks}, lock_ref={self.lock_ref})"


def replay_cache(cache, ops: list[tuple]) -> list[tuple]:
    """Play an engine's part around ``cache``: the checks and the grader compare caches this way.

    ``cache`` was made with an allocator (``cache.allocator``). Operations:

    - ``("request", name, token_ids)``: a request arrives. Its prompt is matched (``match_prefix``), the
      match locked and its blocks shared (``incref``), the hit recorded; the rest of its tokens get new
      blocks (calling ``cache.evict`` first for the blocks the allocator is short of; if they are still
      short, the request is refused and its match unlocked and let go).
    - ``("finish", name)``: the request ends. Its whole blocks are inserted with its tokens, then it lets
      go of its own references and unlocks its match. (The engine also inserts a prompt as soon as it is
      computed; the replay inserts at the finish only.)
    - ``("evict", n)``: ``cache.evict(n)``.

    One record per operation: for a request ``("request", blocks matched, tokens matched)`` (or
    ``("refused",)``), for a finish ``("finish", what insert returned)``, for an evict ``("evict", blocks
    freed)``; each followed by the cache's ``total_size``, ``evictable_size``, ``protected_size`` and the
    allocator's ``num_free``; or ``("error", exception type name, message)``.
    """
    allocator, bs = cache.allocator, cache.block_size
    live: dict = {}
    records = []
    for op in ops:
        try:
            if op[0] == "request":
                _, name, tokens = op
                m = cache.match_prefix(tokens)
                cache.lock(m.node)
                allocator.incref(m.blocks)
                need = -(-len(tokens) // bs) - len(m.blocks)
                if need > allocator.num_free:
                    cache.evict(need - allocator.num_free)
                if need > allocator.num_free:
                    allocator.free(m.blocks)
                    cache.unlock(m.node)
                    record: tuple = ("refused",)
                else:
                    cache.record(len(tokens), m.num_tokens)
                    live[name] = (list(tokens), list(m.blocks) + allocator.allocate(need), m.node)
                    record = ("request", list(m.blocks), m.num_tokens)
            elif op[0] == "finish":
                tokens, table, node = live.pop(op[1])
                whole = len(tokens) // bs
                record = ("finish", cache.insert(tokens, table[:whole]))
                allocator.free(table)
                cache.unlock(node)
            else:
                record = ("evict", cache.evict(op[1]))
            record += (cache.total_size, cache.evictable_size, cache.protected_size, allocator.num_free)
        except Exception as e:  # the error is part of the behaviour being compared
            record = ("error", type(e).__name__, str(e))
        records.append(record)
    return records
