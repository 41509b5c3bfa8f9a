"""nanolab: a small, complete LLM serving engine, and a lab workbook that has you build one."""

from __future__ import annotations

from nanolab._ext import HAS_C, backend
from nanolab.block_allocator import BlockAllocatorProtocol, PyBlockAllocator
from nanolab.errors import NanolabError, OutOfBlocksError

if HAS_C:
    from nanolab._ext import _C

    BlockAllocator = _C.BlockAllocator
else:
    BlockAllocator = PyBlockAllocator

__version__ = "0.1.0"

__all__ = [
    "HAS_C",
    "BlockAllocator",
    "BlockAllocatorProtocol",
    "NanolabError",
    "OutOfBlocksError",
    "PyBlockAllocator",
    "backend",
]
