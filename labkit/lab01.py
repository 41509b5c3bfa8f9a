from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import regex  # like `re`, plus the \p{L} (any letter) and \p{N} (any digit) classes the patterns use

Pair = tuple[int, int]

# The split patterns of tiktoken's GPT-2 ("r50k_base") and GPT-4 ("cl100k_base") encodings.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
GPT4_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
PATTERNS = {"gpt2": GPT2_PATTERN, "gpt4": GPT4_PATTERN}
ENDOFTEXT = "<|endoftext|>"


def split_at_specials(text: str, specials: Iterable[str]) -> list[str]:
    """Cut ``text`` at every occurrence of the special tokens, dropping them (longest token first).

    Example:
        >>> split_at_specials("ab<|endoftext|>cd", ["<|endoftext|>"])
        ['ab', 'cd']
    """
    specials = sorted(specials, key=lambda s: (-len(s), s))
    if not specials:
        return [text]
    return regex.split("|".join(map(regex.escape, specials)), text)
