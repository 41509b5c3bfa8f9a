"""The paged KV cache: every running request's keys and values in fixed-size blocks of one shared pool.

Storage per layer is ``k[layer]``, ``v[layer]`` of shape (num_blocks, block_size, n_kv_heads, head_dim),
on the cache's ``device``, where every tensor `prepare` lays out lives too.
A request's block table lists its blocks in token order, so the token at position ``pos`` lives in
slot ``block_table[pos // block_size] * block_size + pos % block_size`` of the flattened pool.

Before each forward, `prepare` is told which requests run and how many new tokens each brings (the
engine puts the one-token decodes first). It lays out the batch once — slot of every new token, block
tables and context lengths — so that `attend`, called by every layer, only writes the new keys/values
into their slots and runs attention: one batched paged-decode call for all decodes, one call of the C++
kernel for all short chunks that follow a cached prefix (speculative decoding's verifications: a
request's last token and its guesses), and one paged prefill call per other chunk (which attends over
the request's cached prefix too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from nanolab.memory import attention_backends as _backends
from nanolab.memory.paged_attention import paged_decode_attention, paged_prefill_attention
from nanolab.memory.paging import slot_mapping, slot_of
from nanolab.model.attention import sdpa
from nanolab.model.config import ModelConfig

# Chunks of at most this many tokens after a cached prefix run together in one C++ kernel call (measured:
# 3x faster than a call per chunk for 8 chunks of 5 rows, still faster at 9 rows; slower alone at 17).
MAX_BATCHED_CHUNK = 9


class SeqSlice(NamedTuple):  # a NamedTuple: the engine builds one per request per step
    """One request's new tokens in the flattened batch."""

    block_table: list[int]
    start_pos: int  # position of the first new token (= tokens already cached)
    num_new: int


class PagedKVCache:
    """Implements `nanolab.model.kv_cache.KVCacheProtocol` over a paged pool of KV blocks."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        attention_backend: str = "auto",
        num_kv_heads: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        # num_kv_heads: the KV heads this cache holds (a tensor-parallel rank's share; None: the model's)
        num_kv_heads = config.n_kv_heads if num_kv_heads is None else num_kv_heads
        shape = (num_blocks, block_size, num_kv_heads, config.head_dim)
        self.device = torch.device(device)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(config.n_layers)]
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.backend = attention_backend
        self.scale = config.head_dim**-0.5
        self._num_decodes = 0
        self._short: tuple | None = None  # the short chunks' (rows, block tables, lens, query starts)
        # the C++ kernel takes the short chunks in one call where it can run this cache
        self._batch_short = (
            attention_backend != "torch"
            and _backends.HAS_CPP_KERNEL
            and dtype == torch.float32
            and self.device.type == "cpu"
        )
        # What every layer's `attend` hands the C++ kernel, made once: NumPy views of the pools (None
        # where the kernel cannot run this cache), and each pool flattened to its slots for the writes.
        self._pool_arrays = (
            [(k.numpy(), v.numpy()) for k, v in zip(self.k, self.v)] if self._batch_short else None
        )
        self._slot_views = [
            (k.view(-1, num_kv_heads, config.head_dim), v.view(-1, num_kv_heads, config.head_dim))
            for k, v in zip(self.k, self.v)
        ]
        self._only_decodes = False

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)

    def prepare(self, seqs: list[SeqSlice]) -> torch.Tensor:
        """Lay out the next forward's batch; returns the positions (T,) of its new tokens.

        One-token sequences must come first: they form the decode group. This runs once per engine
        step for every running request, so the decode group (most of a busy batch) is laid out with a
        few list comprehensions and one NumPy conversion per array rather than per-token Python work.
        """
        block_size, device = self.block_size, self.device
        n_dec = 0
        for s in seqs:
            if s.num_new != 1:
                break
            n_dec += 1
        decodes, chunks = seqs[:n_dec], seqs[n_dec:]
        if any(s.num_new == 1 for s in chunks):
            raise ValueError("prepare() needs the one-token (decode) sequences first")
        for s in seqs:  # what the comprehensions below would index past, with a message that says why
            if len(s.block_table) * block_size < s.start_pos + s.num_new:
                raise ValueError(
                    f"a sequence needs {s.start_pos + s.num_new} slots but its block table has "
                    f"{len(s.block_table)} blocks"
                )
        positions = [s.start_pos for s in decodes]
        slots = [slot_of(table, p, block_size) for table, p, _ in decodes]
        for table, start, n in chunks:
            slots += slot_mapping(table, start, start + n, block_size)
            positions += range(start, start + n)
        slots_np = np.array(slots, dtype=np.int64)
        if slots and (slots_np.min() < 0 or slots_np.max() >= self.num_blocks * block_size):
            bad = int(slots_np.min()) if slots_np.min() < 0 else int(slots_np.max())
            raise ValueError(
                f"a block table holds slot {bad}, but the pool has {self.num_blocks * block_size} slots "
                f"({self.num_blocks} blocks of {block_size}); slot = block_id * block_size + offset"
            )
        self._slots = torch.as_tensor(slots_np, device=device)  # checked here once, not in every layer
        self._num_decodes = n_dec
        if n_dec:
            width = max(len(s.block_table) for s in decodes)
            pad = [0] * width
            flat: list[int] = []
            for s in decodes:
                flat += s.block_table
                flat += pad[len(s.block_table) :]
            self._dec_arrays = (
                np.array(flat, dtype=np.int32).reshape(n_dec, width),
                np.array(positions[:n_dec], dtype=np.int32) + 1,
            )
            self._dec_tables = torch.as_tensor(self._dec_arrays[0], device=device)
            self._dec_lens = torch.as_tensor(self._dec_arrays[1], device=device)
        # Prefill chunks: (first row, last row, block table, context length, starts at 0?)
        self._prefills = []
        short: list[tuple[int, SeqSlice]] = []  # (first row, chunk) of the short chunks after a prefix
        row = n_dec
        for s in chunks:
            table, start, n = s
            if self._batch_short and start > 0 and n <= MAX_BATCHED_CHUNK:
                short.append((row, s))
            else:
                t = torch.tensor(table, dtype=torch.int32, device=device)
                self._prefills.append((row, row + n, t, start + n, start == 0))
            row += n
        self._short = None
        if short:
            width = max(len(s.block_table) for _, s in short)
            rows = [r for first, s in short for r in range(first, first + s.num_new)]
            tables = np.zeros((len(short), width), dtype=np.int32)
            for i, (_, s) in enumerate(short):
                tables[i, : len(s.block_table)] = s.block_table
            lens = np.array([s.start_pos + s.num_new for _, s in short], dtype=np.int32)
            starts = np.cumsum([0] + [s.num_new for _, s in short], dtype=np.int32)
            self._short = (torch.tensor(rows, dtype=torch.long, device=device), tables, lens, starts)
        self._only_decodes = 0 < n_dec == len(seqs)  # then `attend` returns the decodes' output as it is
        return torch.as_tensor(np.array(positions, dtype=np.int64), device=device)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """For each (src, dst) pair, make block ``dst`` a copy of block ``src`` in every layer (keys and
        values): what copy-on-write needs before a forward writes into ``dst`` (see
        `nanolab.memory.block_manager.BlockManager.copy_on_write`). Every source is read before any
        block is written. Raises ValueError, copying nothing, for an id outside the pool or a ``dst``
        named twice."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        for name, ids in (("src", src), ("dst", dst)):
            bad = ids[(ids < 0) | (ids >= self.num_blocks)]
            if bad.numel():
                raise ValueError(
                    f"copy_blocks: {name} block {int(bad[0])} is not a block of the pool (num_blocks = "
                    f"{self.num_blocks})"
                )
        if dst.unique().numel() != dst.numel():
            raise ValueError("copy_blocks: a dst block is named twice; each copy needs its own block")
        for k, v in zip(self.k, self.v):
            k[dst] = k[src]  # k[src] is a gathered copy, so an overlap cannot read a block already written
            v[dst] = v[src]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # The work between kernel calls is all Python and small, so it is kept to a few calls per layer:
        # the slots were checked in `prepare`, and the kernel gets arrays made before the first layer.
        k_slots, v_slots = self._slot_views[layer]
        k_slots.index_copy_(0, self._slots, k.to(k_slots.dtype))
        v_slots.index_copy_(0, self._slots, v.to(v_slots.dtype))
        k_cache, v_cache = self.k[layer], self.v[layer]
        kernel = self._pool_arrays is not None and q.dtype == torch.float32 and not q.requires_grad
        n = self._num_decodes
        if n and kernel:
            decoded = _backends.run_kernel(
                q[:n].numpy(), *self._pool_arrays[layer], *self._dec_arrays, None, self.scale
            )
        elif n:
            decoded = paged_decode_attention(
                q[:n], k_cache, v_cache, self._dec_tables, self._dec_lens, self.scale, backend=self.backend
            )
        if self._only_decodes:
            return decoded
        out = torch.empty_like(q)  # (T, nh, hs)
        if n:
            out[:n] = decoded
        if self._short is not None:
            rows, tables, lens, starts = self._short
            if kernel:
                out[rows] = _backends.run_kernel(
                    q[rows].numpy(), *self._pool_arrays[layer], tables, lens, starts, self.scale
                )
            else:
                out[rows] = _backends.cpp_attention(
                    q[rows],
                    k_cache,
                    v_cache,
                    *(torch.as_tensor(x) for x in (tables, lens, starts)),
                    self.scale,
                )
        for first, last, table, context_len, fresh in self._prefills:
            if fresh:
                # Nothing cached before this chunk: plain causal attention over the chunk itself.
                out[first:last] = sdpa(
                    q[first:last], k[first:last], v[first:last], causal=True, scale=self.scale
                )
            else:
                out[first:last] = paged_prefill_attention(
                    q[first:last], k_cache, v_cache, table, context_len, self.scale
                )
        return out
