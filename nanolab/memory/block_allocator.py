"""The KV block allocator: a free list of fixed-size KV blocks with a reference count per block.

A paged KV cache stores each request's keys and values in blocks taken from one shared pool. The
allocator hands out block ids, and counts how many holders share each block (a prefix shared by two
requests is stored once and held twice). A block returns to the free list when its last holder frees it.

`BlockAllocatorProtocol` is the contract; `PyBlockAllocator` is the pure-Python implementation and the C++
class in `nanolab._C` is its twin, held to identical behaviour by tests. `BlockAllocator` is whichever
of the two this installation uses (see `nanolab._ext`).

Deliberately left out: block sizes and KV tensors (the allocator only deals in ids; the KV cache owns
the storage), and any notion of which request holds what (the caller keeps its own block tables).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from nanolab.errors import OutOfBlocksError


@runtime_checkable
class BlockAllocatorProtocol(Protocol):
    """What the KV cache and the engine need from a block allocator.

    Contract, for every implementation:
    - block ids are the integers ``0 .. num_total - 1``;
    - ``allocate(n)`` returns ``n`` distinct free ids, each now with ref count 1, or raises
      `OutOfBlocksError` (n > num_free) / `ValueError` (n < 0) and changes nothing;
    - ``free(ids)`` drops one reference per listed id; a block whose count reaches 0 is free again.
      An id that is out of range or would drop below zero raises `ValueError` and changes nothing;
    - ``incref(ids)`` adds one reference per listed id; ids must be allocated (`ValueError` otherwise);
    - ``ref_count(id)`` is the number of holders (0 for a free block).
    """

    def allocate(self, n: int) -> list[int]: ...

    def free(self, block_ids: Sequence[int]) -> None: ...

    def incref(self, block_ids: Sequence[int]) -> None: ...

    def ref_count(self, block_id: int) -> int: ...

    @property
    def num_free(self) -> int: ...

    @property
    def num_total(self) -> int: ...


class PyBlockAllocator:
    """Pure-Python block allocator (the twin of the C++ ``nanolab._C.BlockAllocator``).

    Free blocks are handed out first-in first-out: the initial order is ``0, 1, 2, ...`` and a freed
    block joins the back of the queue, so recently freed blocks are reused last.

    Example:
        >>> a = PyBlockAllocator(4)
        >>> a.allocate(2)
        [0, 1]
        >>> a.incref([1]); a.ref_count(1)
        2
        >>> a.free([0, 1]); a.num_free, a.ref_count(1)
        (3, 1)
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self._ref_counts = [0] * num_blocks  # _ref_counts[id] == 0 <=> id is on the free list
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_total(self) -> int:
        return len(self._ref_counts)

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_total:
            raise ValueError(f"block id {block_id} is out of range [0, {self.num_total})")

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_free:
            raise OutOfBlocksError(
                f"cannot allocate {n} blocks: only {self.num_free} of {self.num_total} are free; "
                "free some blocks first or create the allocator with more blocks"
            )
        out = [self._free.popleft() for _ in range(n)]
        for block_id in out:
            self._ref_counts[block_id] = 1
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        # Validate the whole call before touching state: an id listed k times needs k references.
        drops: Counter[int] = Counter()
        for block_id in block_ids:
            self._check_id(block_id)
            drops[block_id] += 1
            if drops[block_id] > self._ref_counts[block_id]:
                raise ValueError(
                    f"double free of block {block_id}: it is already free; free each block once per holder"
                )
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)

    def incref(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] == 0:
                raise ValueError(
                    f"cannot incref block {block_id}: it is free; only allocated blocks can be shared"
                )
        for block_id in block_ids:
            self._ref_counts[block_id] += 1

    def free_list(self) -> list[int]:
        """The free block ids in the order `allocate` will hand them out."""
        return list(self._free)

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self.num_total}, num_free={self.num_free})"


def _default_allocator() -> type:
    from nanolab import _ext

    return _ext._C.BlockAllocator if _ext.HAS_C else PyBlockAllocator


BlockAllocator: type = _default_allocator()
"""The allocator this installation uses: the C++ class when the extension is built, else the twin."""
