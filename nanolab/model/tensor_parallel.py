"""Tensor parallelism's arithmetic: which part of every weight a rank holds, and where the ranks add up.

A model split over ``size`` ranks (Megatron-LM's scheme, as vLLM and SGLang use it) keeps the residual
stream whole on every rank and splits the two wide halves of each block:

- attention: the fused q/k/v projection is **column-parallel** (each rank computes the q, k and v of its
  own heads; the heads need nothing from each other), the output projection **row-parallel** (each rank
  multiplies its heads' slice of the input by its slice of the weight, and the partial results are summed
  across ranks: one all-reduce);
- MLP: the up (GPT-2's ``fc``, Llama's fused gate/up) projection column-parallel, the down projection
  row-parallel: one more all-reduce. The activation between them is element-wise, so it runs on each
  rank's slice without any communication.

"Column" and "row" are Megatron's names for ``Y = X A``: a column-parallel layer splits A's columns (the
output features: rows of a PyTorch ``Linear.weight``, which is (out, in)), a row-parallel layer A's rows
(the input features: columns of ``Linear.weight``). A row-parallel bias is added once, after the sum
(every rank holds it whole).

Heads: with ``n_heads`` query heads and ``n_kv_heads`` key/value heads over ``size`` ranks, rank r holds
query heads ``r * n_heads / size ..`` and the key/value heads those read. When ``size`` divides
``n_kv_heads`` the KV heads are split like the query heads; when ``n_kv_heads`` divides ``size`` (more
ranks than KV heads, as with a 1- or 2-KV-head GQA model on 4 ranks) each KV head is replicated on
``size / n_kv_heads`` ranks, as vLLM does; otherwise the split is refused. Each rank's KV cache holds its
own KV heads only, so the KV memory per rank is divided by ``size`` (or by ``n_kv_heads`` when
replicated).

The embeddings, the norms and the LM head are replicated: every rank needs the whole residual stream
anyway, and only the driver computes logits (it samples), so a vocabulary-parallel LM head would save
each worker its copy at the cost of one more collective per step; at nanolab's vocabulary sizes the copy
is small. A model with a large vocabulary would split it (vLLM's ``VocabParallelEmbedding`` and a
gather of the logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from nanolab.model.config import ModelConfig


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of ``size`` ranks, and how it sums a tensor with the other ranks' (in place).

    ``group`` is a ``torch.distributed`` process group (None: ``size`` must be 1, or the shard is only
    being laid out, not run). `all_reduce` is what the row-parallel layers call after their matmul.
    """

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"the number of ranks must be a positive integer, got {self.size!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {self.rank!r}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks, in place (every rank gets the sum); unchanged with one rank."""
        if self.size > 1:
            if self.group is None:
                raise RuntimeError("this shard has no process group: it can be laid out but not run")
            self.group.allreduce([x]).wait()
        return x


def check_shardable(config: ModelConfig, size: int) -> None:
    """Raise `ValueError` saying why ``config`` cannot be split over ``size`` ranks (nothing if it can)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    if config.n_heads % size:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the model's {config.n_heads} attention heads: "
            "each rank must hold the same number of whole heads"
        )
    if config.n_kv_heads % size and size % config.n_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {size} and the model's {config.n_kv_heads} key/value heads do not fit: "
            "the KV heads are split when the size divides them and replicated when they divide the size"
        )
    if config.d_ff % size:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the model's MLP width d_ff = {config.d_ff}"
        )


def head_ranges(n_heads: int, n_kv_heads: int, rank: int, size: int) -> tuple[range, range]:
    """The query heads and the key/value heads rank ``rank`` of ``size`` holds.

    The query heads are split evenly, in order. The KV heads are split the same way when ``size``
    divides ``n_kv_heads``; when ``n_kv_heads`` divides ``size`` each rank holds the one KV head its query
    heads read (replicated on ``size // n_kv_heads`` ranks). Anything else is a `ValueError`.

    Example:
        >>> head_ranges(8, 2, 1, 2)    # GQA, KV heads split
        (range(4, 8), range(1, 2))
        >>> head_ranges(8, 2, 3, 4)    # more ranks than KV heads: KV head 1 on ranks 2 and 3
        (range(6, 8), range(1, 2))
    """
    if not 0 <= rank < size or n_heads % size or n_heads % n_kv_heads:
        raise ValueError(
            f"cannot place rank {rank} of {size} over {n_heads} heads and {n_kv_heads} key/value heads"
        )
    per_rank = n_heads // size
    heads = range(rank * per_rank, (rank + 1) * per_rank)
    if n_kv_heads % size == 0:
        kv_per_rank = n_kv_heads // size
        return heads, range(rank * kv_per_rank, (rank + 1) * kv_per_rank)
    if size % n_kv_heads == 0:
        kv = rank // (size // n_kv_heads)
        return heads, range(kv, kv + 1)
    raise ValueError(f"{size} ranks cannot split or replicate {n_kv_heads} key/value heads")


def column_shard(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s slice of a column-parallel layer's weight or bias: its share of the output features
    (dim 0: the rows of a ``Linear.weight``, the entries of a bias). A view, not a copy."""
    if t.shape[0] % size:
        raise ValueError(f"{size} ranks cannot split {t.shape[0]} output features evenly")
    n = t.shape[0] // size
    return t[rank * n : (rank + 1) * n]


def row_shard(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s slice of a row-parallel layer's weight: its share of the input features (dim 1:
    the columns of a ``Linear.weight``). A view, not a copy."""
    if weight.shape[1] % size:
        raise ValueError(f"{size} ranks cannot split {weight.shape[1]} input features evenly")
    n = weight.shape[1] // size
    return weight[:, rank * n : (rank + 1) * n]


def qkv_shard(t: torch.Tensor, n_heads: int, n_kv_heads: int, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s rows of the fused q/k/v projection of a model with ``n_heads`` query heads and
    ``n_kv_heads`` KV heads (its weight or its bias): its query heads' rows, then its KV heads' rows of k,
    then of v (`head_ranges`). The fused tensor is [all q heads | all k heads | all v heads], so a plain
    `column_shard` would hand rank 0 the q heads of every rank instead. A new tensor.

    Example:
        >>> qkv_shard(torch.arange(8), 4, 2, 1, 2)   # head_dim 1: q heads 2-3, k head 1, v head 1
        tensor([2, 3, 5, 7])
    """
    hd = t.shape[0] // (n_heads + 2 * n_kv_heads)
    heads, kv = head_ranges(n_heads, n_kv_heads, rank, size)
    q, k, v = t.split((n_heads * hd, n_kv_heads * hd, n_kv_heads * hd))
    q = q[heads.start * hd : heads.stop * hd]
    return torch.cat((q, k[kv.start * hd : kv.stop * hd], v[kv.start * hd : kv.stop * hd]))


def gate_up_shard(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s rows of Llama's fused [gate | up] projection: its share of the gate's rows, then the
    same share of the up's (a rank multiplies silu(gate) by up element by element, so it needs both
    halves of the same features)."""
    gate, up = weight.chunk(2)
    return torch.cat((column_shard(gate, rank, size), column_shard(up, rank, size)))


def shard_state_dict(
    config: ModelConfig, state_dict: dict[str, torch.Tensor], rank: int, size: int
) -> dict[str, torch.Tensor]:
    """The tensors rank ``rank`` of ``size`` holds, under the same names, from a whole model's state dict
    (what `nanolab.model.transformer.Transformer` built with ``TPShard(rank, size)`` loads). Each tensor is
    a contiguous copy, so a rank holds its shard only."""
    check_shardable(config, size)
    out = {}
    for key, t in state_dict.items():
        name = key.rsplit(".", 2)[-2:]  # e.g. ["qkv", "weight"]
        module, kind = name if len(name) == 2 else ("", name[0])
        if ".layers." not in f".{key}":
            out[key] = t
        elif module == "qkv":
            out[key] = qkv_shard(t, config.n_heads, config.n_kv_heads, rank, size)
        elif module == "fc":
            out[key] = column_shard(t, rank, size)
        elif module == "gate_up":
            out[key] = gate_up_shard(t, rank, size)
        elif module in ("out", "proj", "down"):
            # a row-parallel bias is whole on every rank and added once, after the sum
            out[key] = row_shard(t, rank, size) if kind == "weight" else t
        else:  # norms
            out[key] = t
    if size == 1:
        return out
    return {k: v.clone(memory_format=torch.contiguous_format) for k, v in out.items()}


class LocalGroup:
    """``size`` ranks as threads of one process, summing through shared memory: a stand-in for a
    ``torch.distributed`` process group in tests and in the lab, where every rank's forward runs in a
    thread of its own (see `run_ranks`). Not a transport: the engine's ranks are processes joined by
    ``torch.distributed``."""

    def __init__(self, size: int) -> None:
        import threading

        self.size = size
        self._barrier = threading.Barrier(size)
        self._parts: list[torch.Tensor | None] = [None] * size
        self._ranks: dict[int, int] = {}  # thread id -> rank
        self.calls = 0  # all-reduces done (counted once per sum, not per rank)

    def bind(self, rank: int) -> None:
        """Say which rank the calling thread is."""
        import threading

        self._ranks[threading.get_ident()] = rank

    def allreduce(self, tensors: list[torch.Tensor]) -> _Done:
        import threading

        (x,) = tensors
        rank = self._ranks[threading.get_ident()]
        self._parts[rank] = x.clone()
        self._barrier.wait()
        total = self._parts[0].clone()
        for part in self._parts[1:]:
            total += part
        if self._barrier.wait() == 0:
            self.calls += 1
        x.copy_(total)
        return _Done()


class _Done:
    def wait(self) -> bool:
        return True


def run_ranks(size: int, fn: Any) -> list[Any]:
    """Call ``fn(rank, group)`` for every rank at once, each in a thread of its own joined by one
    `LocalGroup`; their results in rank order (the first exception raised, if any)."""
    import threading

    group = LocalGroup(size)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        group.bind(rank)
        try:
            results[rank] = fn(rank, group)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            errors.append(e)
            group._barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
