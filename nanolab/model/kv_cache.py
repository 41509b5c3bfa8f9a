"""The KV cache seam between the model and whoever owns the batch, and the simplest cache behind it.

During generation every new token's keys and values are kept, so that later tokens can attend to them
without recomputing them. `Transformer.forward` does not know how its T tokens are grouped into sequences
or where past keys live: each attention layer calls ``cache.attend(layer, q, k, v)`` and the cache does
the rest. `KVCacheProtocol` is that contract. Two caches implement it:

- `ContiguousKVCache` (here): one sequence, one preallocated (max_seq_len, ...) slab per layer. What the
  single-request `nanolab.model.generate` loop uses, and what Lab 2 builds.
- the engine's paged cache: many sequences, keys and values in fixed-size blocks from a shared pool.

Deliberately left out here: more than one sequence, freeing or sharing memory (that is what paging buys).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from nanolab.model.attention import chunk_mask, sdpa

if TYPE_CHECKING:
    from nanolab.model.config import ModelConfig


@runtime_checkable
class KVCacheProtocol(Protocol):
    """What `Transformer.forward` needs from a KV cache.

    Before each forward the cache's owner sets it up for exactly the T new tokens of that forward
    (which sequence each belongs to, where its keys and values go). Then, once per layer:

    ``attend(layer, q, k, v)`` with q (T, n_heads, head_dim) and k, v (T, n_kv_heads, head_dim) (rotary
    embeddings already applied; the tensors may be non-contiguous views) stores the new tokens' k and v
    for ``layer`` and returns (T, n_heads, head_dim): each new token's attention output over its own
    sequence's cached tokens and the new tokens of that sequence up to and including itself, with scale
    1/sqrt(head_dim). Query head h reads key/value head h // (n_heads // n_kv_heads).
    """

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def kv_cache_bytes(config: ModelConfig, num_tokens: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes needed to cache ``num_tokens`` tokens: a key and a value vector per token, layer and KV head.

    Example:
        >>> from nanolab.model.config import ModelConfig
        >>> kv_cache_bytes(ModelConfig(n_layers=4, n_kv_heads=2, n_heads=4, d_model=128), 1000)
        2048000
    """
    per_token = 2 * config.n_layers * config.n_kv_heads * config.head_dim * dtype.itemsize
    return per_token * num_tokens


class ContiguousKVCache:
    """The keys and values of one sequence, in one preallocated tensor per layer.

    How its owner drives it: before every forward, ``prepare(num_new)`` says that the next forward
    brings ``num_new`` new tokens; it returns their positions (they go right after the tokens already
    cached). The forward's `attend` calls write the new keys/values there and attend over everything up
    to them. The cache never advances by itself::

        cache = ContiguousKVCache(model.config)
        positions = cache.prepare(len(prompt_ids))         # prefill: positions 0 .. P-1
        hidden = model(torch.tensor(prompt_ids), positions, cache)
        positions = cache.prepare(1)                       # one decode step: position P
        hidden = model(torch.tensor([next_id]), positions, cache)

    `length` counts the cached tokens, including those of the prepared forward.
    """

    def __init__(
        self,
        config: ModelConfig,
        max_seq_len: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        self.max_seq_len = config.max_seq_len if max_seq_len is None else max_seq_len
        if not 1 <= self.max_seq_len <= config.max_seq_len:
            raise ValueError(
                f"max_seq_len must be in [1, {config.max_seq_len}] (the model's), got {max_seq_len}"
            )
        shape = (config.n_layers, self.max_seq_len, config.n_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (n_layers, max_seq_len, nkv, hs)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0  # tokens cached, including the ones of the prepared forward
        self.start = 0  # position of the first new token of the prepared forward

    @property
    def nbytes(self) -> int:
        """Memory held by the key and value tensors."""
        return self.k.nbytes + self.v.nbytes

    def prepare(self, num_new: int) -> torch.Tensor:
        """Make room for the next forward's ``num_new`` tokens and return their positions, (num_new,) int64."""
        if num_new < 1:
            raise ValueError(f"num_new must be at least 1, got {num_new}")
        if self.length + num_new > self.max_seq_len:
            raise ValueError(
                f"the cache holds {self.length} tokens and {num_new} more would pass its max_seq_len "
                f"{self.max_seq_len}; make a larger cache or stop generating"
            )
        self.start, self.length = self.length, self.length + num_new
        return torch.arange(self.start, self.length, device=self.k.device)

    def reset(self) -> None:
        """Forget every cached token (the memory is kept for the next sequence)."""
        self.start = self.length = 0

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        start, end = self.start, self.length
        T = q.shape[0]
        if T != end - start:
            raise ValueError(f"the forward brought {T} tokens but prepare() was told {end - start}")
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v
        if T == 1 or start == 0:
            # One query sees every cached token; a prefill from 0 is the usual square causal mask.
            mask, is_causal = None, T > 1
        else:
            # New token i sits at position start + i and sees cached positions 0 .. start + i.
            mask, is_causal = chunk_mask(start, T, q.device), False  # (T, L)
        return sdpa(q, self.k[layer, :end], self.v[layer, :end], mask=mask, causal=is_causal)
