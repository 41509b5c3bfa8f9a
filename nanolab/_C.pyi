"""Type stubs for nanolab's compiled module (built from csrc/ by the package's own build)."""

from collections.abc import Sequence

class BlockAllocator:
    """C++ twin of `nanolab.block_allocator.PyBlockAllocator`; see `BlockAllocatorProtocol`."""

    def __init__(self, num_blocks: int) -> None: ...
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks (ref count 1 each); raises OutOfBlocksError if fewer are free."""
    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per id; a block at zero goes back to the free list."""
    def incref(self, block_ids: Sequence[int]) -> None:
        """Add one reference per id (the id must be allocated)."""
    def ref_count(self, block_id: int) -> int: ...
    @property
    def num_free(self) -> int: ...
    @property
    def num_total(self) -> int: ...
    def free_list(self) -> list[int]:
        """The free ids in the order `allocate` hands them out."""
