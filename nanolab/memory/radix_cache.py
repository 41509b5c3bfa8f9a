"""The radix prefix cache: a radix tree over token ids whose edges hold KV blocks (SGLang-style).

Every edge is labelled with a run of token ids and holds the KV blocks of those tokens, one block id per
``block_size`` tokens. A path from the root spells a prompt prefix; the blocks along it, in order, are
that prefix's KV cache, and prompts that start the same way share those nodes and blocks.

- `RadixCache.match_prefix` walks down from the root. When the match ends inside an edge, the node is
  split there, so a match always ends exactly at a node: the handle the caller locks.
- `RadixCache.insert` walks the same way and hangs the uncached rest of a sequence below the match.
- `RadixCache.lock` / `unlock` count, on every node from a node up to the root, the requests using it.
- `RadixCache.evict` frees unlocked leaves, least recently used first; a parent whose last child goes
  becomes a leaf, and so a candidate, in turn. Candidates wait in a heap, so evicting k nodes costs
  O(k log n) rather than a scan of the tree per node.

"Recently used" is a logical clock that ticks once per `match_prefix` and `insert`, so eviction order is
deterministic; a node's time is never older than any of its descendants'.

Deliberately left out: caching partial blocks. Only whole blocks are cached and matched, so up to
``block_size - 1`` tokens of a cached prefix are recomputed (SGLang caches single tokens when its page
size is 1). Also left out: a host-memory tier, cache-aware scheduling, and keys beyond token ids.

Example:
    >>> from nanolab.memory.block_allocator import PyBlockAllocator
    >>> allocator = PyBlockAllocator(8)
    >>> cache = RadixCache(allocator, block_size=2)
    >>> blocks = allocator.allocate(2)  # a finished request's KV for [1, 2, 3, 4]
    >>> cache.insert([1, 2, 3, 4, 5], blocks)  # token 5 is not a full block: not cached
    0
    >>> allocator.free(blocks)  # the request lets go; the tree keeps its own reference
    >>> m = cache.match_prefix([1, 2, 3, 4, 6])
    >>> m.blocks, m.num_tokens
    ([0, 1], 4)
    >>> cache.match_prefix([1, 2, 3, 4]).num_tokens  # at least one prompt token is always computed
    2
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from nanolab.memory.block_allocator import BlockAllocatorProtocol
from nanolab.memory.prefix_cache import MatchResult, PrefixCacheProtocol, PrefixCacheStats

__all__ = ["MatchResult", "PrefixCacheProtocol", "PrefixCacheStats", "RadixCache", "RadixNode"]


@dataclass(eq=False, repr=False)
class RadixNode:
    """One node: the edge from its parent (tokens and their blocks) and the node's bookkeeping."""

    key: tuple[int, ...]  # token ids on the edge from the parent; len(key) == len(blocks) * block_size
    blocks: list[int]  # KV block ids of those tokens
    parent: RadixNode | None  # None for the root and for a node no longer in the tree
    id: int  # creation order, for stable tie-breaks and printing
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)  # by the child's first block
    lock_ref: int = 0  # outstanding locks of this node or a descendant (for the root: all locks)
    last_access: int = 0  # logical time of the last match or insert through this node

    def __repr__(self) -> str:
        return f"RadixNode(id={self.id}, tokens={list(self.key)}, blocks={self.blocks}, lock_ref={self.lock_ref})"


class RadixCache:
    """A radix tree of cached prompt prefixes at block granularity; implements `PrefixCacheProtocol`.

    The tree holds exactly one allocator reference on each block it stores: taken by `insert` (for
    the new part), dropped by `evict` and `reset`. Sizes are in tokens.
    """

    def __init__(self, allocator: BlockAllocatorProtocol, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.allocator = allocator
        self.block_size = block_size
        self._new_tree()
        self._stats = PrefixCacheStats()

    def _new_tree(self) -> None:
        self._ids = itertools.count()
        self._seq = itertools.count()  # heap entries of one node may tie on (time, id); never compare nodes
        self.root = RadixNode(key=(), blocks=[], parent=None, id=next(self._ids))
        self._clock = 0
        self._heap: list[tuple[int, int, int, RadixNode]] = []  # (last_access, id, seq, node), lazily pruned
        self._num_nodes = 0  # not counting the root
        self._total = self._evictable = self._protected = 0

    # --- sizes and stats -------------------------------------------------------------------------

    @property
    def total_size(self) -> int:
        return self._total

    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def protected_size(self) -> int:
        return self._protected

    @property
    def num_cached_blocks(self) -> int:
        return self._total // self.block_size

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, not counting the root."""
        return self._num_nodes

    def record(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Count one admitted request. `match_prefix` does not count, as a request may be matched again
        while it waits; the engine records each request once, when it is admitted."""
        if not 0 <= cached_tokens <= prompt_tokens:
            raise ValueError(
                f"cached_tokens must be between 0 and prompt_tokens ({prompt_tokens}), got {cached_tokens}"
            )
        s = self._stats
        self._stats = PrefixCacheStats(
            s.num_requests + 1, s.prompt_tokens + prompt_tokens, s.cached_tokens + cached_tokens
        )

    def stats(self) -> PrefixCacheStats:
        return self._stats

    # --- match and insert ------------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """See `PrefixCacheProtocol.match_prefix`: the longest cached whole-block prefix of
        ``token_ids``, capped to leave at least one token to compute. May split a node."""
        tokens = tuple(token_ids)
        limit = max(0, (len(tokens) - 1) // self.block_size * self.block_size)
        node, num_tokens, blocks = self._walk(tokens[:limit])
        self._touch(node)
        return MatchResult(blocks, num_tokens, node)

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int]) -> int:
        """See `PrefixCacheProtocol.insert`: cache the whole blocks of ``token_ids``; return how many
        leading tokens were cached already. The tree increfs only the blocks of the new part."""
        bs = self.block_size
        num_blocks = len(token_ids) // bs
        if len(blocks) != num_blocks:
            raise ValueError(
                f"insert got {len(blocks)} blocks for {len(token_ids)} tokens; with block_size {bs} it "
                f"needs exactly {num_blocks}, one per full block (leave out a partial last block)"
            )
        tokens = tuple(token_ids[: num_blocks * bs])
        node, cached, _ = self._walk(tokens)
        if cached < len(tokens):
            new_blocks = list(blocks[cached // bs :])
            self.allocator.incref(new_blocks)  # first: a bad block id raises before the tree changes
            leaf = RadixNode(key=tokens[cached:], blocks=new_blocks, parent=node, id=next(self._ids))
            node.children[leaf.key[:bs]] = leaf
            self._num_nodes += 1
            self._total += len(leaf.key)
            self._evictable += len(leaf.key)
            node = leaf
        self._touch(node)
        return cached

    def _walk(self, tokens: tuple[int, ...]) -> tuple[RadixNode, int, list[int]]:
        """Descend while whole blocks of ``tokens`` match; split the last edge if the match ends inside
        it. Returns the node where the match ends, the matched length and the matched blocks."""
        bs = self.block_size
        node, pos, blocks = self.root, 0, []
        while pos + bs <= len(tokens):
            child = node.children.get(tokens[pos : pos + bs])
            if child is None:
                break
            n = 1  # the first block matched: it is the child's dict key
            most = min(len(child.key), len(tokens) - pos) // bs
            while n < most and child.key[n * bs : (n + 1) * bs] == tokens[pos + n * bs : pos + (n + 1) * bs]:
                n += 1
            if n < len(child.blocks):
                child = self._split(child, n)  # the loop ends next: the rest of the edge does not match
            blocks.extend(child.blocks)
            node, pos = child, pos + len(child.key)
        return node, pos, blocks

    def _split(self, child: RadixNode, num_blocks: int) -> RadixNode:
        """Cut ``child``'s edge after ``num_blocks`` blocks and return the new upper node. ``child``
        keeps the lower part, so a lock held on ``child`` still covers the same path."""
        assert child.parent is not None
        bs, cut = self.block_size, num_blocks * self.block_size
        upper = RadixNode(
            key=child.key[:cut],
            blocks=child.blocks[:num_blocks],
            parent=child.parent,
            id=next(self._ids),
            lock_ref=child.lock_ref,  # same locks and time: sizes and LRU order do not change
            last_access=child.last_access,
        )
        child.parent.children[child.key[:bs]] = upper
        upper.children[child.key[cut : cut + bs]] = child
        child.key, child.blocks, child.parent = child.key[cut:], child.blocks[num_blocks:], upper
        self._num_nodes += 1
        return upper

    def _touch(self, node: RadixNode) -> None:
        """Mark the path from ``node`` to the root as used now."""
        self._clock += 1
        n: RadixNode | None = node
        while n is not None:
            n.last_access = self._clock
            n = n.parent
        if self._is_evictable_leaf(node):
            self._push(node)  # new time, new heap entry; ``node`` is the only leaf the path can hold

    # --- locks -----------------------------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        """Protect the path from the root to ``node`` (call right after `match_prefix`)."""
        if node is not self.root and node.parent is None:
            raise ValueError(
                f"cannot lock {node!r}: it was evicted or reset; lock a match result before calling evict"
            )
        n: RadixNode | None = node
        while n is not None:
            if n.lock_ref == 0:
                self._evictable -= len(n.key)
                self._protected += len(n.key)
            n.lock_ref += 1
            n = n.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one `lock` of ``node``; the path becomes evictable where no other lock holds it."""
        if node.lock_ref <= 0:
            raise ValueError(f"cannot unlock {node!r}: it is not locked; call unlock once per lock")
        n: RadixNode | None = node
        while n is not None:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._evictable += len(n.key)
                self._protected -= len(n.key)
                if self._is_evictable_leaf(n):
                    self._push(n)
            n = n.parent

    # --- eviction --------------------------------------------------------------------------------

    def _is_evictable_leaf(self, node: RadixNode) -> bool:
        return node.parent is not None and not node.children and node.lock_ref == 0

    def _push(self, node: RadixNode) -> None:
        heapq.heappush(self._heap, (node.last_access, node.id, next(self._seq), node))
        if len(self._heap) > 2 * self._num_nodes + 64:  # mostly stale entries: rebuild from the tree
            self._heap = [(n.last_access, n.id, next(self._seq), n) for n in self._nodes()]
            self._heap = [e for e in self._heap if self._is_evictable_leaf(e[3])]
            heapq.heapify(self._heap)

    def evict(self, num_blocks: int) -> int:
        """See `PrefixCacheProtocol.evict`: free unlocked leaves, least recently used first, until at
        least ``num_blocks`` blocks are freed or none is evictable. Returns the blocks freed."""
        if num_blocks < 0:
            raise ValueError(f"cannot evict a negative number of blocks ({num_blocks})")
        freed = 0
        while freed < num_blocks and self._heap:
            stamp, _, _, node = heapq.heappop(self._heap)
            if stamp != node.last_access or not self._is_evictable_leaf(node):
                continue  # stale: touched, locked, grown or evicted since it was pushed
            parent = node.parent
            assert parent is not None
            self.allocator.free(node.blocks)  # drops the tree's reference only
            freed += len(node.blocks)
            del parent.children[node.key[: self.block_size]]
            node.parent = None
            self._num_nodes -= 1
            self._total -= len(node.key)
            self._evictable -= len(node.key)
            if self._is_evictable_leaf(parent):
                self._push(parent)
        return freed

    def reset(self) -> None:
        """Free every block the tree holds and forget the statistics. Refuses while anything is locked."""
        if self.root.lock_ref:
            locked = sum(1 for n in self._nodes() if n.lock_ref)
            raise RuntimeError(
                f"cannot reset the prefix cache: {self.root.lock_ref} lock(s) are outstanding on "
                f"{locked} node(s) (plus the root); unlock every locked match first"
            )
        nodes = list(self._nodes())
        self.allocator.free([b for n in nodes for b in n.blocks])
        for n in nodes:
            n.parent = None  # stale handles are refused by lock
        self._new_tree()
        self._stats = PrefixCacheStats()

    # --- looking at the tree ---------------------------------------------------------------------

    def _nodes(self) -> Iterator[RadixNode]:
        """Every node but the root, parents before children (iterative: chains can be deep)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def pretty(self, max_tokens: int = 24) -> str:
        """The tree as text, one node per line: edge tokens (``|`` between blocks), blocks, lock count
        and last-use time. Edges longer than ``max_tokens`` are shortened with ``...``."""
        bs = self.block_size
        lines = [
            f"RadixCache(block_size={bs}): {self._num_nodes} nodes, {self._total} tokens cached "
            f"(evictable {self._evictable}, protected {self._protected})",
            f"root lock={self.root.lock_ref}",
        ]
        stack = [(c, "", i == 0) for i, c in enumerate(reversed(self.root.children.values()))]
        while stack:
            node, indent, last = stack.pop()
            shown = node.key[:max_tokens]
            chunks = [" ".join(map(str, shown[i : i + bs])) for i in range(0, len(shown), bs)]
            more = f" ... (+{len(node.key) - len(shown)})" if len(node.key) > len(shown) else ""
            lines.append(
                f"{indent}{'└── ' if last else '├── '}[{'|'.join(chunks)}{more}] blocks={node.blocks} "
                f"lock={node.lock_ref} t={node.last_access}"
            )
            indent += "    " if last else "│   "
            stack.extend((c, indent, i == 0) for i, c in enumerate(reversed(node.children.values())))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.pretty()

    def __repr__(self) -> str:
        return (
            f"RadixCache(block_size={self.block_size}, nodes={self._num_nodes}, total_size={self._total}, "
            f"evictable_size={self._evictable}, protected_size={self._protected})"
        )
