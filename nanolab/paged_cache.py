"""The paged KV cache: every running request's keys and values in fixed-size blocks of one shared pool.

Storage per layer is ``k[layer]``, ``v[layer]`` of shape (num_blocks, block_size, n_kv_heads, head_dim).
A request's block table lists its blocks in token order, so the token at position ``pos`` lives in
slot ``block_table[pos // block_size] * block_size + pos % block_size`` of the flattened pool.

Before each forward, `prepare` is told which requests run and how many new tokens each brings (the
engine puts the one-token decodes first). It lays out the batch once — slot of every new token, block
tables and context lengths — so that `attend`, called by every layer, only writes the new keys/values
into their slots and runs attention: one batched paged-decode call for all decodes, and one paged
prefill call per prefill chunk (which attends over the request's cached prefix too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanolab.attention import paged_decode_attention, paged_prefill_attention, write_kv
from nanolab.model import ModelConfig


@dataclass(frozen=True)
class SeqSlice:
    """One request's new tokens in the flattened batch."""

    block_table: list[int]
    start_pos: int  # position of the first new token (= tokens already cached)
    num_new: int


def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Slots of positions start .. end-1.

    Example:
        >>> slot_mapping([7, 2], 14, 18, block_size=16)
        [126, 127, 32, 33]
    """
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


class PagedKVCache:
    """Implements `nanolab.kv_cache.KVCacheProtocol` over a paged pool of KV blocks."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        attention_backend: str = "auto",
    ) -> None:
        shape = (num_blocks, block_size, config.n_kv_heads, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(config.n_layers)]
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.backend = attention_backend
        self.scale = config.head_dim**-0.5
        self._num_decodes = 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)

    def prepare(self, seqs: list[SeqSlice]) -> torch.Tensor:
        """Lay out the next forward's batch; returns the positions (T,) of its new tokens.

        One-token sequences must come first: they form the decode group.
        """
        B = self.block_size
        slots: list[int] = []
        positions: list[int] = []
        decodes = [s for s in seqs if s.num_new == 1]
        n_dec = len(decodes)
        if seqs[:n_dec] != decodes:
            raise ValueError("prepare() needs the one-token (decode) sequences first")
        for s in seqs:
            end = s.start_pos + s.num_new
            if len(s.block_table) * B < end:
                raise ValueError(
                    f"a sequence needs {end} slots but its block table has {len(s.block_table)} blocks"
                )
            slots += slot_mapping(s.block_table, s.start_pos, end, B)
            positions += range(s.start_pos, end)
        self._slots = torch.tensor(slots, dtype=torch.long)
        self._num_decodes = n_dec
        if n_dec:
            width = max(len(s.block_table) for s in decodes)
            tables = [s.block_table + [0] * (width - len(s.block_table)) for s in decodes]
            self._dec_tables = torch.tensor(tables, dtype=torch.int32)  # (n_dec, width)
            self._dec_lens = torch.tensor([s.start_pos + 1 for s in decodes], dtype=torch.int32)
        # Prefill chunks: (first row, last row, block table, context length, starts at 0?)
        self._prefills = []
        row = n_dec
        for s in seqs[n_dec:]:
            table = torch.tensor(s.block_table, dtype=torch.int32)
            self._prefills.append((row, row + s.num_new, table, s.start_pos + s.num_new, s.start_pos == 0))
            row += s.num_new
        return torch.tensor(positions, dtype=torch.long)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.k[layer], self.v[layer]
        write_kv(k_cache, v_cache, self._slots, k, v)
        out = torch.empty_like(q)  # (T, nh, hs)
        n = self._num_decodes
        if n:
            out[:n] = paged_decode_attention(
                q[:n], k_cache, v_cache, self._dec_tables, self._dec_lens, self.scale, backend=self.backend
            )
        gqa = q.shape[1] != k.shape[1]
        for first, last, table, context_len, fresh in self._prefills:
            if fresh:
                # Nothing cached before this chunk: plain causal attention over the chunk itself.
                # 4-D inputs: with 3-D ones and enable_gqa, PyTorch's CPU SDPA takes a much slower path.
                y = F.scaled_dot_product_attention(
                    q[first:last].transpose(0, 1)[None],
                    k[first:last].transpose(0, 1)[None],
                    v[first:last].transpose(0, 1)[None],
                    is_causal=True,
                    scale=self.scale,
                    enable_gqa=gqa,
                )  # (1, nh, t, hs)
                out[first:last] = y[0].transpose(0, 1)
            else:
                out[first:last] = paged_prefill_attention(
                    q[first:last], k_cache, v_cache, table, context_len, self.scale
                )
        return out
