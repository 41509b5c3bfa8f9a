"""Errors that nanolab raises on purpose, shared by the C++ kernels and their Python twins."""

from __future__ import annotations


class NanolabError(Exception):
    """Base class for nanolab's own errors."""


class OutOfBlocksError(NanolabError, RuntimeError):
    """More KV blocks were asked for than are free. The allocator is left unchanged."""
