"""Block tables: which KV blocks each running request holds, on top of an allocator and a prefix cache.

The manager is the only place that turns "this request needs room for n more tokens" into allocator
calls. It knows the paging arithmetic (a request with t tokens holds ceil(t / block_size) blocks) and the
prefix cache protocol (see `nanolab.memory.prefix_cache`): match and lock on admission, insert on completion of
the prompt and on release, evict before giving up on an allocation.

Reference counting invariant: a block's ref count equals the number of its holders, where a holder is a
request whose block table lists it, or the prefix cache.

Sharing without a prefix cache: `fork` gives a second sequence the blocks of a first (one prompt, several
samples), and `copy_on_write` gives a sequence its own copy of a shared block just before it writes
into it, so that no holder ever sees another holder's tokens.
"""

from __future__ import annotations

from typing import Any, Protocol

from nanolab.memory.block_allocator import BlockAllocatorProtocol
from nanolab.memory.paging import cdiv
from nanolab.memory.prefix_cache import PrefixCacheProtocol


class PagedSequence(Protocol):
    """What the block manager reads and writes on a request (`nanolab.engine.request.Request` has it).

    The manager owns ``block_table``, ``prefix_node`` and resets ``num_computed_tokens`` /
    ``num_cached_tokens`` on admission and release; it reads the rest.
    """

    block_table: list[int]
    prefix_node: Any  # the prefix cache's node this sequence holds a lock on, or None
    num_computed_tokens: int
    num_cached_tokens: int
    num_preemptions: int

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...


class BlockManager:
    """Allocates and frees KV blocks for requests; uses the prefix cache when one is given."""

    def __init__(
        self,
        allocator: BlockAllocatorProtocol,
        block_size: int,
        prefix_cache: PrefixCacheProtocol | None = None,
    ) -> None:
        if prefix_cache is not None and prefix_cache.block_size != block_size:
            raise ValueError(
                f"the prefix cache uses block_size {prefix_cache.block_size} but the KV cache uses {block_size}"
            )
        self.allocator = allocator
        self.block_size = block_size
        self.prefix_cache = prefix_cache

    @property
    def num_total_blocks(self) -> int:
        return self.allocator.num_total

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def usage(self) -> float:
        """Fraction of KV blocks held by requests or the prefix cache."""
        return 1.0 - self.allocator.num_free / self.allocator.num_total

    def _reserve(self, n: int) -> bool:
        """Make sure n blocks are free, evicting unlocked prefix cache entries if needed."""
        short = n - self.allocator.num_free
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(short)
        return self.allocator.num_free >= n

    def admit(self, req: PagedSequence, max_new_tokens: int | None) -> int | None:
        """Give a waiting request its cached prefix and blocks for its next chunk.

        Returns the number of tokens to compute this step: the tokens not served by the prefix cache,
        capped at ``max_new_tokens`` (None: no cap). Returns None, changing nothing, when the blocks
        cannot be had or the whole uncached part must fit and does not.
        """
        cache = self.prefix_cache
        # a request that wants its prompt's log-probabilities must compute every position itself
        use_cache = cache is not None and not req.wants_prompt_logprobs
        match = cache.match_prefix(req.all_token_ids) if use_cache else None
        cached_blocks = list(match.blocks) if match is not None else []
        cached = match.num_tokens if match is not None else 0
        num_new = req.num_tokens - cached
        if max_new_tokens is not None:
            num_new = min(num_new, max_new_tokens)
        if num_new <= 0:
            return None
        needed = self.num_blocks_for(cached + num_new) - len(cached_blocks)
        if match is not None:
            cache.lock(match.node)  # before evicting: the matched path must survive the eviction
        if not self._reserve(needed):
            if match is not None:
                cache.unlock(match.node)
            return None
        if match is not None:
            self.allocator.incref(cached_blocks)
            req.prefix_node = match.node
            if req.num_preemptions == 0:  # count each prompt once, not again when it is recomputed
                cache.record(req.num_prompt_tokens, min(cached, req.num_prompt_tokens))
        req.block_table = cached_blocks + self.allocator.allocate(needed)
        req.num_computed_tokens = req.num_cached_tokens = cached
        return num_new

    def grow(self, req: PagedSequence, num_new_tokens: int) -> bool:
        """Make room for a running request's next ``num_new_tokens`` tokens. False if blocks ran out."""
        if req.num_computed_tokens + num_new_tokens <= len(req.block_table) * self.block_size:
            return True  # its blocks already have room (most decode steps)
        needed = self.num_blocks_for(req.num_computed_tokens + num_new_tokens) - len(req.block_table)
        if not self._reserve(needed):
            return False
        req.block_table += self.allocator.allocate(needed)
        return True

    def fork(self, parent: PagedSequence, child: PagedSequence) -> None:
        """Make ``child`` share all of ``parent``'s blocks (parallel sampling: one prompt, several samples).

        The child's block table becomes a copy of the parent's, each block gaining one reference, and
        the child takes the parent's ``num_computed_tokens``; no KV is copied. A shared block must then
        be written only through `copy_on_write`. Raises ValueError, changing nothing, if the child
        already holds blocks.
        """
        if child.block_table:
            raise ValueError(
                f"cannot fork into a sequence that holds {len(child.block_table)} blocks; release it first"
            )
        self.allocator.incref(parent.block_table)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens

    def copy_on_write(self, req: PagedSequence, num_new_tokens: int = 1) -> list[tuple[int, int]] | None:
        """Give ``req`` private copies of the shared blocks its next ``num_new_tokens`` tokens go into.

        Call it after `grow` and before the forward that writes those tokens. Every block of the table
        that will receive one of them (positions ``num_computed_tokens ..``) and has another holder (ref
        count > 1) is replaced in ``req``'s table by a fresh block; the old block loses ``req``'s
        reference and stays as it is for its other holders. Returns the (src, dst) block pairs whose
        keys and values the caller copies before the forward (`PagedKVCache.copy_blocks`), [] when
        nothing is shared, or None, changing nothing, when there are not enough free blocks.

        Example (block size 4: a 6-token prompt forked, then the child writes token 6 into block 1):
            shared [a, b] -> the child's table becomes [a, c] and the call returns [(b, c)]
        """
        bs = self.block_size
        first = req.num_computed_tokens // bs
        end = min(cdiv(req.num_computed_tokens + num_new_tokens, bs), len(req.block_table))
        shared = [i for i in range(first, end) if self.allocator.ref_count(req.block_table[i]) > 1]
        if not shared:
            return []
        if not self._reserve(len(shared)):
            return None
        pairs = []
        for i, dst in zip(shared, self.allocator.allocate(len(shared))):
            pairs.append((req.block_table[i], dst))
            req.block_table[i] = dst
        self.allocator.free([src for src, _ in pairs])  # the other holders keep theirs
        return pairs

    def rollback(self, req: PagedSequence) -> None:
        """Forget the keys and values past a request's tokens (speculative decoding's rejected guesses).

        ``num_computed_tokens`` comes back to at most ``num_tokens - 1`` (the last token, not yet
        computed, goes into the next step), and the blocks wholly past ``num_tokens`` go back to the
        allocator. The slots of rejected guesses in the blocks kept are overwritten by later steps.

        Example (block size 4, 6 tokens whose 3 guesses past them were computed and rejected):
            9 computed tokens in [a, b, c] -> 5 computed in [a, b]; c is freed
        """
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
        keep = self.num_blocks_for(req.num_tokens)
        if len(req.block_table) > keep:
            self.allocator.free(req.block_table[keep:])
            del req.block_table[keep:]

    def cache_computed(self, req: PagedSequence) -> None:
        """Offer the request's computed full blocks to the prefix cache (the request keeps its own refs).

        Called when a prompt is fully computed, so requests admitted later can share it while this one
        still runs. The request's lock moves to the end of the newly cached path.
        """
        cache = self.prefix_cache
        if cache is None:
            return
        n = (req.num_computed_tokens // self.block_size) * self.block_size
        if n == 0:
            return
        tokens = req.all_token_ids
        cache.insert(tokens[:n], req.block_table[: n // self.block_size])
        # Match n + 1 tokens so the match (capped at len - 1) can reach all n cached tokens.
        node = cache.match_prefix(tokens[: n + 1]).node
        cache.lock(node)
        if req.prefix_node is not None:
            cache.unlock(req.prefix_node)
        req.prefix_node = node

    def release(self, req: PagedSequence) -> None:
        """Drop all of a request's blocks (finish, abort or preemption), caching what it computed."""
        self.cache_computed(req)
        if req.block_table:
            self.allocator.free(req.block_table)
        if req.prefix_node is not None:
            self.prefix_cache.unlock(req.prefix_node)
        req.block_table = []
        req.prefix_node = None
        req.num_computed_tokens = 0
