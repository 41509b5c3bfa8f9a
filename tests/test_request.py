"""A request's text: decoded on demand, the same however often it is read."""

from __future__ import annotations

import codecs

from hypothesis import given, settings
from hypothesis import strategies as st

from nanolab.engine.request import Request
from nanolab.model.sampling import SamplingParams

# Token bytes that cut multi-byte characters apart ("é" is c3 a9, "€" is e2 82 ac, "😀" is f0 9f 98 80),
# invalid bytes (ff, a lone continuation byte 80), plain ASCII, and a special token with no text (None).
TABLE = [
    b"a",
    b"\xc3",
    b"\xa9",
    b"\xe2\x82",
    b"\xac",
    b"\xf0\x9f",
    b"\x98\x80",
    b"\xff",
    b"\x80",
    b" x",
    None,
]
TOKENS = st.lists(st.integers(0, len(TABLE)), max_size=40)  # len(TABLE): an id past the table, no text


def one_token_at_a_time(tokens: list[int]) -> str:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text = ""
    for t in tokens:
        if t < len(TABLE) and TABLE[t] is not None:
            text += decoder.decode(TABLE[t])
    return text


def request(token_bytes=TABLE) -> Request:
    return Request("r", [1, 2], SamplingParams(max_tokens=50), token_bytes=token_bytes)


def request_with(tokens: list[int]) -> Request:
    r = request()
    r.output_token_ids += tokens
    return r


@settings(max_examples=300, deadline=None)
@given(TOKENS, st.sets(st.integers(0, 40)))
def test_text_is_the_same_whenever_it_is_read(tokens, read_after):
    """Reading after some appends (streaming) or only at the end (offline) gives the same text, equal
    to feeding the incremental decoder one token at a time, and every read is a prefix of the next."""
    r, seen = request(), ""
    for i, t in enumerate(tokens):
        r.output_token_ids.append(t)
        if i in read_after:
            text = r.output_text
            assert text.startswith(seen)
            seen = text
    assert r.output_text == one_token_at_a_time(tokens)
    assert request_with(tokens).output_text == one_token_at_a_time(tokens)


def test_a_split_character_waits_for_its_last_byte():
    r = request()
    r.output_token_ids += [0, 3]  # "a", then the first two bytes of "€"
    assert r.output_text == "a"
    r.output_token_ids.append(4)
    assert r.output_text == "a€"


def test_cutting_the_text_keeps_it_cut():
    r = request_with([0, 9, 0])
    assert r.output_text == "a xa"
    r.output_text = "a"  # what the engine does at a stop string
    assert r.output_text == "a"


def test_no_table_no_text():
    r = request(token_bytes=None)
    r.output_token_ids += [0, 1, 2]
    assert r.output_text == ""
