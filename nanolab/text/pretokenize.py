"""Before any merge: how text is cut into chunks that BPE never merges across.

The split patterns of GPT-2 and GPT-4 (tiktoken's "r50k_base" and "cl100k_base"), the check of a
tokenizer's special tokens, and the repair of text that UTF-8 cannot hold. `nanolab.text.tokenizer`
uses them in that order: cut at special tokens, split with the pattern, then encode each chunk.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import regex

# The split patterns of tiktoken's "r50k_base" (GPT-2) and "cl100k_base" (GPT-4) encodings. They
# need the `regex` package: `re` has no \p{L}.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
GPT4_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
PATTERNS = {"gpt2": GPT2_PATTERN, "gpt4": GPT4_PATTERN}


def resolve_pattern(pattern: str) -> tuple[str | None, str]:
    """Return ``(name, regex)`` for a pattern name ("gpt2", "gpt4") or a regex string.

    A string made only of letters, digits and underscores is taken as a name and must be known.

    Example:
        >>> resolve_pattern("gpt2") == ("gpt2", GPT2_PATTERN)
        True
        >>> resolve_pattern("[a-z]+|[^a-z]")
        (None, '[a-z]+|[^a-z]')
    """
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a str (a name or a regex), got {type(pattern).__name__}")
    if pattern in PATTERNS:
        return pattern, PATTERNS[pattern]
    for name, known in PATTERNS.items():
        if pattern == known:
            return name, known
    if regex.fullmatch(r"\w+", pattern):
        raise ValueError(f"unknown pattern name {pattern!r}; use one of {sorted(PATTERNS)} or a regex string")
    try:
        regex.compile(pattern)
    except regex.error as exc:
        raise ValueError(f"pattern {pattern!r} is not a valid regex: {exc}") from None
    return None, pattern


def check_special_tokens(special_tokens: Iterable[str] | None) -> list[str]:
    """The special tokens as a list of distinct non-empty strings (None: none), or a clear error."""
    if special_tokens is None:
        return []
    if isinstance(special_tokens, str):
        raise TypeError(f"special_tokens must be a list of strings, got the string {special_tokens!r}")
    specials = list(special_tokens)
    for token in specials:
        if not isinstance(token, str) or not token:
            raise ValueError(f"special tokens must be non-empty strings, got {token!r}")
    duplicates = sorted(t for t, n in Counter(specials).items() if n > 1)
    if duplicates:
        raise ValueError(f"special tokens must be distinct; repeated: {duplicates}")
    return specials


def without_surrogates(text: str) -> str:
    """Turn surrogate pairs into the characters they stand for and lone surrogates into U+FFFD.

    Python strings may hold surrogates, UTF-8 may not; tiktoken repairs text the same way.

    Example:
        >>> without_surrogates("a\\ud83d\\ude00b\\udc00")
        'a😀b\\ufffd'
    """
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
