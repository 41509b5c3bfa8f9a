from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a transformer that attention and its KV cache depend on.

    `nanolab.ModelConfig` has the same fields (and more), so the bundled model's ``model.config`` works
    wherever a `ModelShape` does.
    """

    n_layers: int  # transformer blocks; each has its own attention, and its own part of the KV cache
    n_heads: int  # query heads per layer
    n_kv_heads: int  # key/value heads per layer (grouped-query attention); divides n_heads
    d_model: int  # width of the residual stream: n_heads * head_dim
    max_seq_len: int = 2048  # longest sequence (prompt + output) the model accepts

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token: the fields of `nanolab.SamplingParams` that this lab uses (vLLM's names).

    ``temperature == 0`` means greedy: always the most likely token. ``top_k is None`` and ``top_p == 1``
    switch those filters off.
    """

    max_tokens: int = 16  # most tokens to generate
    temperature: float = 1.0  # logits are divided by it; 0 = greedy
    top_p: float = 1.0  # keep the smallest set of most likely tokens whose probability reaches top_p
    top_k: int | None = None  # keep the k most likely tokens; None = off
    seed: int | None = None  # seeds this request's own random generator; None = torch's global one

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be None (off) or an integer >= 1, got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(seed: int | None) -> torch.Generator | None:
    """A random generator seeded with ``seed``, or None (use torch's global generator) when seed is None."""
    return None if seed is None else torch.Generator().manual_seed(seed)
