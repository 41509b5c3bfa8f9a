"""A request's text and its stop rules: the incremental detokeniser gives the same text however often it
is read, and its deltas never split a character; `check_stop` applies the rules in order; `held_back`
keeps exactly the end of the text that could still become a stop string."""

from __future__ import annotations

import codecs

from hypothesis import given, settings
from hypothesis import strategies as st

from nanolab.engine.detokenizer import IncrementalDetokenizer
from nanolab.engine.request import FinishReason, Request
from nanolab.engine.stopping import check_stop, find_stop_string, held_back
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


@settings(max_examples=300, deadline=None)
@given(TOKENS, st.sets(st.integers(0, 40)))
def test_text_is_the_same_whenever_it_is_read(tokens, read_after):
    """Reading after some appends (streaming) or only at the end (offline) gives the same text, equal to
    decoding all the bytes at once; the deltas concatenate to it and none holds half a character."""
    d, ids, deltas = IncrementalDetokenizer(TABLE), [], []
    for i, t in enumerate(tokens):
        ids.append(t)
        if i in read_after:
            deltas.append(d.update(ids))
    deltas.append(d.update(ids))
    everything = b"".join(TABLE[t] for t in tokens if t < len(TABLE) and TABLE[t] is not None)
    at_once = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(everything)  # the end may wait
    assert d.text == one_token_at_a_time(tokens) == at_once
    assert "".join(deltas) == d.text
    once = IncrementalDetokenizer(TABLE)
    assert once.update(tokens) == d.text


def test_a_split_character_waits_for_its_last_byte():
    d = IncrementalDetokenizer(TABLE)
    assert d.update([0, 3]) == "a"  # "a", then the first two bytes of "€"
    assert d.update([0, 3, 4]) == "€"
    assert d.update([0, 3, 4]) == ""  # nothing new


def test_cutting_the_text_keeps_it_cut():
    d = IncrementalDetokenizer(TABLE)
    d.update([0, 9, 0])
    assert d.text == "a xa"
    d.truncate(1)  # what the engine does at a stop string
    assert d.text == "a"


def stopping(max_tokens=8, **kw) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(max_tokens=max_tokens, **kw))


def test_the_rules_in_order():
    r = stopping(stop_token_ids=[7])
    r.output_token_ids = [5]
    assert check_stop(r, 5, "x", 0, {5}, 64) == (FinishReason.STOP, "x")  # end of sequence
    r2 = stopping(ignore_eos=True, max_tokens=1)
    r2.output_token_ids = [5]
    assert check_stop(r2, 5, "x", 0, {5}, 64) == (FinishReason.LENGTH, "x")  # EOS ignored: the length
    r.output_token_ids = [7]
    assert check_stop(r, 7, "x", 0, {5}, 64) == (FinishReason.STOP, "x")  # a stop token id
    r3 = stopping(stop=["ab"], max_tokens=2)
    r3.output_token_ids = [1, 2]
    assert check_stop(r3, 2, "xxab", 3, {5}, 64) == (FinishReason.STOP, "xx")  # a stop string beats length
    r4 = stopping(max_tokens=50)
    r4.output_token_ids = [4] * 5
    assert check_stop(r4, 4, "", 0, {5}, 8) == (FinishReason.LENGTH, "")  # 3 + 5 tokens fill the context
    assert check_stop(r4, 4, "", 0, {5}, 9) == (None, "")


def test_a_stop_string_inside_one_long_token_is_found():
    """A single token can add many characters; the search starts where the stop string could begin."""
    text = "x" * 5 + " " * 20 + "##" + " " * 20
    assert find_stop_string(text, ["##"], 5) == 25
    assert find_stop_string(text, ["##"], 27) is None  # it ended before: it would have stopped already
    assert find_stop_string("a##b##", ["##", "b#"], 4) == 3  # the earliest new one


def test_held_back_is_exactly_a_possible_start():
    assert held_back("x = 1\n", ["\n\n"]) == 1
    assert held_back("x = 1", ["\n\n"]) == 0
    assert held_back("ab#", ["###", "#!"]) == 1
    assert held_back("a##", ["###"]) == 2
    assert held_back("a##", ["##"]) == 1  # a whole stop string would have stopped it; its start waits
    assert held_back("", ["##"]) == 0


@settings(max_examples=300, deadline=None)
@given(st.text("ab#", max_size=12), st.lists(st.text("ab#", min_size=1, max_size=4), min_size=1, max_size=3))
def test_held_back_agrees_with_its_definition(text, stops):
    expected = max(
        [k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])],
        default=0,
    )
    assert held_back(text, stops) == expected
