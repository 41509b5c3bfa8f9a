"""Incremental detokenisation: the text of a growing list of token ids, a delta at a time.

A byte-level BPE token is a run of bytes, not of characters: a character of two to four UTF-8 bytes can
be split across tokens ("€" is three bytes, and a tokenizer may give it as two tokens). Decoding each
token on its own would print a replacement character for each half. `IncrementalDetokenizer` feeds the
tokens' bytes through Python's incremental UTF-8 decoder instead, which keeps an incomplete character
back until its last byte arrives; the deltas it returns therefore concatenate to exactly the text of
all the bytes decoded at once (``errors="replace"`` for bytes that never form a character).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


def token_bytes_table(tokenizer) -> list[bytes | None]:
    """Each token id's bytes, looked up once (None for a special token such as end-of-text: no text)."""
    special = set(getattr(tokenizer, "special_tokens", {}).values())
    return [None if i in special else tokenizer.decode_bytes([i]) for i in range(tokenizer.vocab_size)]


class IncrementalDetokenizer:
    """The text of one request's output tokens, decoded only where it grew.

    ``token_bytes[i]`` is token i's bytes (None: no text, as for special tokens or ids past the table).

    Example:
        >>> d = IncrementalDetokenizer([b"a", b"\\xe2\\x82", b"\\xac"])
        >>> d.update([0, 1]), d.update([0, 1, 2]), d.text
        ('a', '€', 'a€')
    """

    def __init__(self, token_bytes: Sequence[bytes | None]) -> None:
        self.token_bytes = token_bytes
        self.text = ""  # the text of token_ids[:num_decoded]
        self.num_decoded = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def update(self, token_ids: Sequence[int]) -> str:
        """Decode the tokens of ``token_ids`` past those already decoded; returns the text they add.

        ``token_ids`` is the whole output so far (it only grows). A character whose bytes are not all
        there yet is not returned: it comes with the token that completes it.
        """
        if self.num_decoded >= len(token_ids):
            return ""
        table = self.token_bytes
        data = b"".join(
            b for t in token_ids[self.num_decoded :] if 0 <= t < len(table) and (b := table[t]) is not None
        )
        self.num_decoded = len(token_ids)
        delta = self._decoder.decode(data)
        self.text += delta
        return delta

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` characters of the text (an output cut at a stop string)."""
        self.text = self.text[:length]
