"""Tokenizer speed: training time, and encoding throughput against tiktoken, measured in the same run.

Text: the Python standard library's own top-level modules (sorted by name), so the run needs no
download. Training learns a 4096-token vocabulary from the first ~1 MB; encoding is measured on the
next ~1 MB, which training did not see.

- training: our incremental trainer (pair counts updated after each merge) on the full setting, and,
  on a small setting both can finish, against a naive trainer that re-counts every pair before each
  merge (the textbook loop);
- encoding: ours with an empty chunk cache ("cold") and with it filled ("warm"), against the
  `tiktoken.Encoding` from `Tokenizer.to_tiktoken()` (same ranks, same regex, same ids: checked), one
  thread each. Decoding likewise.
"""

from __future__ import annotations

import argparse
import sysconfig
import time
from collections import Counter
from pathlib import Path

import regex

from nanolab.text.tokenizer import Tokenizer


def stdlib_text(skip_bytes: int, num_bytes: int) -> str:
    """About ``num_bytes`` of whole stdlib modules, after skipping the first ``skip_bytes`` worth."""
    parts, seen = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        size = len(text.encode("utf-8"))
        seen += size
        if seen <= skip_bytes:
            continue
        parts.append(text)
        if seen >= skip_bytes + num_bytes:
            break
    return "".join(parts)


def naive_train(text: str, pattern: str, num_merges: int) -> list[tuple[int, int]]:
    """The baseline: every merge re-counts all pairs in all chunks (ties as ours: smallest pair)."""
    words = [list(chunk.encode("utf-8")) for chunk in regex.findall(pattern, text)]
    merges = []
    for new_id in range(256, 256 + num_merges):
        counts = Counter(pair for w in words for pair in zip(w, w[1:]))
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        merges.append(best)
        merged = []
        for w in words:
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(new_id)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged.append(out)
        words = merged
    return merges


def best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--train-bytes", type=int, default=1_000_000)
    parser.add_argument("--encode-bytes", type=int, default=1_000_000)
    parser.add_argument("--pattern", default="gpt4", help='"gpt2", "gpt4" or a regex')
    parser.add_argument(
        "--naive-bytes", type=int, default=100_000, help="text for the naive-trainer comparison"
    )
    parser.add_argument("--naive-merges", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    train_text = stdlib_text(0, args.train_bytes)
    eval_text = stdlib_text(len(train_text.encode("utf-8")), args.encode_bytes)
    train_mb, eval_mb = len(train_text.encode("utf-8")) / 1e6, len(eval_text.encode("utf-8")) / 1e6
    special = ["<|endoftext|>"]

    print(
        f"training: {train_mb:.2f} MB of stdlib source -> {args.vocab_size} tokens, pattern {args.pattern!r}"
    )
    t0 = time.perf_counter()
    tok = Tokenizer.train(
        train_text, args.vocab_size, pattern=args.pattern, special_tokens=special, verbose=True
    )
    train_s = time.perf_counter() - t0
    print(f"  incremental trainer : {train_s:8.2f} s  ({len(tok.merges) / train_s:,.0f} merges/s)")

    small = train_text[: args.naive_bytes]
    fast_s = best_time(lambda: Tokenizer.train(small, 256 + args.naive_merges, pattern=args.pattern), 1)
    t0 = time.perf_counter()
    naive = naive_train(small, tok.pattern, args.naive_merges)
    naive_s = time.perf_counter() - t0
    assert list(Tokenizer.train(small, 256 + args.naive_merges, pattern=args.pattern).merges) == naive
    print(f"  small setting ({len(small.encode()) / 1e6:.2f} MB, {args.naive_merges} merges), same merges:")
    print(
        f"    incremental {fast_s:.3f} s, naive re-count {naive_s:.3f} s: incremental is {naive_s / fast_s:.1f}x faster"
    )

    enc = tok.to_tiktoken()
    ids = tok.encode(eval_text)
    assert ids == enc.encode(eval_text), "our ids differ from tiktoken's"
    print(f"encoding: {eval_mb:.2f} MB of unseen stdlib source, {eval_mb * 1e6 / len(ids):.2f} bytes/token")

    def cold() -> None:
        Tokenizer(tok.merges, tok.pattern, special).encode(eval_text)

    ours_cold = best_time(cold, args.repeats)
    ours_warm = best_time(lambda: tok.encode(eval_text), args.repeats)
    theirs = best_time(lambda: enc.encode(eval_text), args.repeats)
    print(f"  ours, cold cache : {eval_mb / ours_cold:6.2f} MB/s")
    print(f"  ours, warm cache : {eval_mb / ours_warm:6.2f} MB/s")
    print(f"  tiktoken         : {eval_mb / theirs:6.2f} MB/s")
    print(f"  ratio tiktoken / ours: {ours_cold / theirs:.2f}x (cold), {ours_warm / theirs:.2f}x (warm)")

    ours_dec = best_time(lambda: tok.decode(ids), args.repeats)
    theirs_dec = best_time(lambda: enc.decode(ids), args.repeats)
    print(
        f"decoding: ours {eval_mb / ours_dec:,.0f} MB/s, tiktoken {eval_mb / theirs_dec:,.0f} MB/s, ratio tiktoken / ours {ours_dec / theirs_dec:.2f}x"
    )


if __name__ == "__main__":
    main()
