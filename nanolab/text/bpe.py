"""Byte-pair encoding, the algorithm alone: count pairs, merge a pair, learn merges, apply ranks.

Everything here works on token ids (ints) and byte strings; nothing knows about text, regexes or
special tokens (that is `nanolab.text.tokenizer`). Ids 0..255 are the raw bytes; merge ``i`` creates id
``256 + i``, so a token's id is also its merge rank: lower ids were learned earlier.

Two algorithms live here:

- `train_merges` learns merges from a table of pre-split chunks ("words") and their multiplicities.
  It keeps the pair counts up to date after each merge by touching only the words that contain the
  merged pair, and picks the next pair from a heap, so a merge costs about as much as the words it
  changes rather than a pass over the corpus (compare the two-line `pair_counts` + `merge` loop that
  re-counts everything, which is the same algorithm, only slower).
- `bpe_encode` splits one chunk into tokens the way tiktoken does: start from single bytes and keep
  merging the adjacent pair whose concatenation has the lowest rank. Because it looks ranks up by
  bytes, a table of ``bytes -> rank`` is all it needs, and `tiktoken` given the same table agrees.

Deliberately left out: the regex pre-split and special tokens (see `nanolab.text.tokenizer`), training on
a stream too large for memory, and any parallelism.
"""

from __future__ import annotations

import heapq
import sys
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

Pair = tuple[int, int]

_NO_RANK = sys.maxsize  # rank of a pair that is not a token: never merged


def pair_counts(ids: Sequence[int]) -> dict[Pair, int]:
    """Count each adjacent pair of ids (overlapping pairs count separately).

    Example:
        >>> pair_counts([1, 2, 3, 1, 2])
        {(1, 2): 2, (2, 3): 1, (3, 1): 1}
        >>> pair_counts([7, 7, 7])
        {(7, 7): 2}
    """
    counts: dict[Pair, int] = {}
    for pair in zip(ids, ids[1:]):
        counts[pair] = counts.get(pair, 0) + 1
    return counts


def merge(ids: Sequence[int], pair: Pair, new_id: int) -> list[int]:
    """Replace every occurrence of ``pair`` in ``ids`` by ``new_id``, scanning left to right.

    Overlapping occurrences are merged greedily from the left, so ``aaa`` becomes ``[aa, a]``.

    Example:
        >>> merge([1, 2, 3, 1, 2], (1, 2), 256)
        [256, 3, 256]
        >>> merge([7, 7, 7], (7, 7), 256)
        [256, 7]
    """
    out: list[int] = []
    i, n = 0, len(ids)
    while i < n:
        if i + 1 < n and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def _merge_and_diff(word: list[int], a: int, b: int, new_id: int) -> tuple[list[int], list[tuple[Pair, int]]]:
    """`merge` one word, and also list how its pair counts change: ``[(pair, +1 or -1), ...]``.

    Only the neighbours of each merged occurrence change: ``(prev, a)`` becomes ``(prev, new)`` and
    ``(b, next)`` becomes ``(new, next)``. The left neighbour is read from the output, so back-to-back
    occurrences (``a b a b``) correctly produce ``(new, new)``.

    Example:
        >>> _merge_and_diff([1, 2, 1, 2], 1, 2, 9)
        ([9, 9], [((2, 1), -1), ((9, 1), 1), ((1, 2), -1), ((9, 1), -1), ((9, 9), 1), ((1, 2), -1)])
    """
    out: list[int] = []
    changes: list[tuple[Pair, int]] = []
    i, n = 0, len(word)
    while i < n:
        if i + 1 < n and word[i] == a and word[i + 1] == b:
            if out:
                prev = out[-1]
                changes.append(((prev, a), -1))
                changes.append(((prev, new_id), 1))
            if i + 2 < n:
                nxt = word[i + 2]
                changes.append(((b, nxt), -1))
                changes.append(((new_id, nxt), 1))
            changes.append(((a, b), -1))
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out, changes


def train_merges(
    word_counts: Mapping[bytes, int],
    num_merges: int,
    on_merge: Callable[[Pair, int], None] | None = None,
) -> list[Pair]:
    """Learn up to ``num_merges`` merges from chunks of bytes and how often each chunk occurs.

    Each step merges the most frequent adjacent pair, counted over all chunks weighted by their
    multiplicity, and applies it to every chunk (left to right, as `merge` does). Ties go to the
    smallest pair ``(left id, right id)``; for two raw bytes that is the lexicographically smallest
    byte pair. So the result depends only on the chunks and their counts, not on their order.

    Every token this creates has a byte string no other token has, which is what lets tiktoken (whose
    table maps bytes to ranks) reproduce our ids exactly. This holds by construction: a chunk's token
    boundaries only ever disappear, so a stretch of a chunk that is two adjacent tokens ``x, y`` today
    was never crossed by a token; every merge so far then acted inside it exactly as it would on the
    bytes ``x + y`` alone. If ``x + y`` were already a token ``t``, that stand-alone tokenization would have become
    ``[t]`` when ``t`` was learned and stayed so, not ``[x, y]``. Training asserts it anyway.

    Returns the merges in order (merge ``i`` creates token ``256 + i``); fewer than ``num_merges``
    when no pair is left to merge. ``on_merge(pair, count)`` is called after each merge.

    Example:
        >>> train_merges({b"abab": 1, b"ab": 3}, 2)
        [(97, 98), (256, 256)]
    """
    if num_merges < 0:
        raise ValueError(f"num_merges must be >= 0, got {num_merges}")
    words = [list(chunk) for chunk in word_counts]
    freqs = list(word_counts.values())

    counts: dict[Pair, int] = defaultdict(int)  # pair -> occurrences, weighted by word frequency
    where: dict[Pair, set[int]] = defaultdict(set)  # pair -> words that (may) contain it
    for w, (word, freq) in enumerate(zip(words, freqs)):
        for pair in zip(word, word[1:]):
            counts[pair] += freq
            where[pair].add(w)
    # Max-heap by count via negation; then the smallest pair wins ties. Entries go stale when a count
    # changes (a fresh entry is pushed then), so a popped entry is trusted only if it is current.
    heap = [(-count, a, b) for (a, b), count in counts.items()]
    heapq.heapify(heap)

    vocab = [bytes([i]) for i in range(256)]
    known = set(vocab)
    merges: list[Pair] = []
    while len(merges) < num_merges and heap:
        neg_count, a, b = heapq.heappop(heap)
        pair = (a, b)
        if counts.get(pair) != -neg_count:
            continue  # stale entry
        token = vocab[a] + vocab[b]
        assert token not in known, f"merge {pair} would duplicate token {token!r}"  # see docstring
        new_id = len(vocab)
        vocab.append(token)
        known.add(token)
        merges.append(pair)

        deltas: dict[Pair, int] = defaultdict(int)
        for w in where.pop(pair):
            new_word, changes = _merge_and_diff(words[w], a, b, new_id)
            if not changes:
                continue  # `where` is a superset: this word lost the pair to an earlier merge
            words[w] = new_word
            freq = freqs[w]
            for changed, sign in changes:
                deltas[changed] += sign * freq
                if sign > 0:
                    where[changed].add(w)
        del counts[pair]
        deltas.pop(pair, None)
        for changed, delta in deltas.items():
            if delta == 0:
                continue
            count = counts[changed] + delta
            if count > 0:
                counts[changed] = count
                heapq.heappush(heap, (-count, *changed))
            else:  # a pair of old tokens that vanished never comes back (merges only coarsen words)
                del counts[changed]
                where.pop(changed, None)
        if on_merge is not None:
            on_merge(pair, -neg_count)
    return merges


def bpe_encode(piece: bytes, ranks: Mapping[bytes, int]) -> list[int]:
    """Split one chunk into token ids by merging the lowest-rank adjacent pair until none is left.

    ``ranks`` maps a token's bytes to its id and must contain all 256 single bytes. The pair to merge
    is the one whose *concatenated bytes* have the lowest rank (leftmost on a tie), exactly as
    tiktoken's ``byte_pair_merge`` does.

    Example:
        >>> ranks = {bytes([i]): i for i in range(256)} | {b"ab": 256, b"abc": 257}
        >>> bpe_encode(b"abcab", ranks)
        [257, 256]
        >>> bpe_encode(b"xy", ranks)
        [120, 121]
    """
    if len(piece) < 2:
        return [ranks[piece]] if piece else []
    parts = [piece[i : i + 1] for i in range(len(piece))]
    # pair_ranks[i] is the rank of parts[i] + parts[i + 1]; only the neighbours of a merge change.
    pair_ranks = [ranks.get(parts[i] + parts[i + 1], _NO_RANK) for i in range(len(parts) - 1)]
    while pair_ranks:
        best = min(pair_ranks)
        if best == _NO_RANK:
            break
        i = pair_ranks.index(best)
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
        del pair_ranks[i]
        if i < len(pair_ranks):
            pair_ranks[i] = ranks.get(parts[i] + parts[i + 1], _NO_RANK)
        if i > 0:
            pair_ranks[i - 1] = ranks.get(parts[i - 1] + parts[i], _NO_RANK)
    return [ranks[p] for p in parts]
