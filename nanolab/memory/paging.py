"""The paging arithmetic, written once: how many blocks t tokens take, and which slot holds token i.

A KV pool of ``num_blocks`` blocks of ``block_size`` tokens is one flat array of slots; block ``b``
holds slots ``b * block_size .. (b + 1) * block_size - 1``. A request's block table lists its blocks
in token order, so its token at position ``pos`` sits in block ``block_table[pos // block_size]`` at
offset ``pos % block_size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks of size ``b`` needed for ``a`` tokens.

    Example:
        >>> cdiv(50, 16), cdiv(48, 16), cdiv(0, 16)
        (4, 3, 0)
    """
    return -(-a // b)


def slot_of(block_table: T, pos: T, block_size: int) -> T:
    """The slot of position ``pos`` through ``block_table``.

    Works on Python ints and lists, and elementwise on integer tensors or arrays (``pos`` a tensor of
    positions, ``block_table`` a 1-D tensor of block ids).

    Example:
        >>> slot_of([7, 2], 17, block_size=16)
        33
    """
    return block_table[pos // block_size] * block_size + pos % block_size


def slot_mapping(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Slots of positions ``start .. end - 1``: where a forward writes those tokens' keys and values.

    Example:
        >>> slot_mapping([7, 2], 14, 18, block_size=16)
        [126, 127, 32, 33]
    """
    return [slot_of(block_table, p, block_size) for p in range(start, end)]
