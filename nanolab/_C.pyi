"""Type stubs for nanolab's compiled module (built from csrc/ by the package's own build)."""

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

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

def paged_attention(
    q: NDArray[np.float32],
    k_cache: NDArray[np.float32],
    v_cache: NDArray[np.float32],
    block_tables: NDArray[np.int32],
    context_lens: NDArray[np.int32],
    query_start_loc: NDArray[np.int32] | None,
    scale: float,
    num_threads: int,
) -> NDArray[np.float32]:
    """Paged attention over nanolab's KV layout, reading K/V in place; returns a new (T, n_heads, head_dim).

    q (T, n_heads, head_dim); k_cache, v_cache (num_blocks, block_size, n_kv_heads, head_dim);
    block_tables (B, max_blocks); context_lens (B,); query_start_loc (B + 1,) or None for decode
    (T == B, one query per sequence). All C-contiguous; a wrong dtype or layout is silently copied,
    so call it through `nanolab.attention`, which checks. Raises ValueError for bad shapes or indices.
    Runs on up to num_threads threads (OpenMP's team where it was built with OpenMP) with the GIL released.
    """

def linear_rows(
    x: NDArray[np.float32],
    weight: NDArray[np.float32],
    bias: NDArray[np.float32] | None,
    num_threads: int,
) -> NDArray[np.float32]:
    """``x @ weight.T + bias`` for a few rows of x, reading the weight in place; returns a new (rows, out).

    x (rows, in); weight (out, in); bias (out,) or None. All C-contiguous float32; a wrong dtype or layout is
    silently copied, so call it through `nanolab.model.prepacked.linear`, which checks. Raises ValueError for
    shapes that do not fit. Runs on up to num_threads threads with the GIL released; each output is the same
    float whatever the number of rows or threads.
    """
