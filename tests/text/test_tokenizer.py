"""The BPE tokenizer: tiktoken agrees with it, it round-trips, and its incremental trainer is exact."""

from __future__ import annotations

import doctest
import json
import sysconfig
from collections import Counter
from pathlib import Path

import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nanolab.text.bpe
import nanolab.text.tokenizer
from nanolab.text.bpe import bpe_encode, merge, pair_counts, train_merges
from nanolab.text.pretokenize import GPT2_PATTERN, GPT4_PATTERN
from nanolab.text.tokenizer import TOKENIZER_FILENAME, Tokenizer

tiktoken = pytest.importorskip("tiktoken")

EOT, FIM, USER = "<|endoftext|>", "<|fim_middle|>", "<|user|>"
SPECIALS = [EOT, FIM, USER]
STDLIB = Path(sysconfig.get_paths()["stdlib"])

# Text in several scripts, with emoji and combining marks, so that training learns merges of multi-byte
# UTF-8 sequences as well as of ASCII.
MULTILINGUAL = (
    "Grüße aus Köln, naïve café. Ελληνικά γράμματα. Привет, мир! 中文字符和标点。 日本語のテキスト。"
    " 한국어 문장. مرحبا بالعالم. नमस्ते दुनिया. 😀👍🏽👨‍👩‍👧 e\u0301 a\u0308 ٣٤٥ 3.14159 1,000,000\n"
)


def stdlib_source(skip: int, every: int, max_bytes: int) -> str:
    """Concatenated text of the stdlib's top-level .py files ``skip, skip + every, ...`` (sorted)."""
    files = sorted(STDLIB.glob("*.py"))[skip::every]
    parts, size = [], 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text.encode("utf-8"))
        if size >= max_bytes:
            break
    return "".join(parts)


@pytest.fixture(scope="session")
def corpus() -> str:
    return stdlib_source(skip=0, every=3, max_bytes=150_000) + MULTILINGUAL * 20


@pytest.fixture(scope="session", params=["gpt4", "gpt2"])
def tok(request, corpus) -> Tokenizer:
    vocab_size = {"gpt4": 700, "gpt2": 500}[request.param]
    return Tokenizer.train(corpus, vocab_size, pattern=request.param, special_tokens=SPECIALS)


@pytest.fixture(scope="session")
def enc(tok):
    return tok.to_tiktoken()


# ---- agreement with tiktoken ------------------------------------------------------------------


def test_ids_are_bytes_then_merges_then_special_tokens(tok, enc):
    """Ids 0..255 are single bytes, merges follow, special tokens come last; tiktoken has the same ids."""
    n_ordinary = 256 + len(tok.merges)
    assert tok.vocab_size == n_ordinary + len(SPECIALS) == enc.n_vocab
    assert [tok.decode_bytes([i]) for i in range(256)] == [bytes([i]) for i in range(256)]
    assert tok.special_tokens == {EOT: n_ordinary, FIM: n_ordinary + 1, USER: n_ordinary + 2}
    assert all(tok.decode_bytes([i]) == enc.decode_single_token_bytes(i) for i in range(tok.vocab_size))
    token_bytes = [tok.decode_bytes([i]) for i in range(n_ordinary)]
    assert len(set(token_bytes)) == n_ordinary, "two tokens share a byte string"


def test_training_learned_multibyte_tokens(tok):
    """The fixture is a real test of UTF-8 handling: some merges join bytes of non-ASCII characters."""
    assert any(max(tok.decode_bytes([256 + i])) >= 0x80 for i in range(len(tok.merges)))


def test_encode_matches_tiktoken_on_stdlib_source(tok, enc):
    """Our ids equal tiktoken's on Python source the tokenizer was not trained on."""
    text = stdlib_source(skip=1, every=3, max_bytes=300_000)
    ids = tok.encode(text, allowed_special="none")
    assert ids == enc.encode(text, disallowed_special=())
    assert tok.decode(ids) == text


_FRAGMENTS = [
    "'s", "'S", "'ll", "'LL", "'Ve", "'re", "'d", "'m", "'t", "'ſ", "don't", "’s",
    " ", "   ", "\n", "\n\n", "\r\n", "\t", " \n ", "\u00a0", "\u3000", "\u200b", "\x0b", "\x0c",
    "😀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "e\u0301", "\u0301\u0308", "ß", "İ", "ǅ", "K",
    "123", "1234567", "٣٤٥", "Ⅻ", "½", "3.14", "def f(x):", "    return x", "中文", "Привет",
]  # fmt: skip
# Characters assigned in this Python's Unicode database (tiktoken's Rust regex may know a newer
# Unicode; unassigned code points could be classified differently, which is not what is tested here).
_BROAD = st.characters(exclude_categories=("Cs", "Cn"))
_PIECES = st.one_of(
    st.text(_BROAD, max_size=8),
    st.sampled_from(_FRAGMENTS),
    st.text(st.sampled_from(" \t\n\r\u00a0\u2003"), min_size=1, max_size=6),
    st.integers(-(10**12), 10**12).map(str),
    st.text(st.characters(min_codepoint=0x300, max_codepoint=0x36F), min_size=1, max_size=3),
    st.text(st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF), min_size=1, max_size=3),
)
TEXTS = st.lists(_PIECES, max_size=12).map("".join)
_SETTINGS = settings(
    deadline=None, max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@_SETTINGS
@given(text=TEXTS)
def test_encode_matches_tiktoken_on_any_text(tok, enc, text):
    """Our ids equal tiktoken's on arbitrary Unicode: emoji, combining marks, whitespace runs, numbers."""
    assert tok.encode(text) == enc.encode(text)


@_SETTINGS
@given(text=TEXTS)
def test_decode_inverts_encode(tok, text):
    """decode(encode(s)) == s for every string."""
    assert tok.decode(tok.encode(text)) == text


@_SETTINGS
@given(parts=st.lists(st.one_of(TEXTS, st.sampled_from(SPECIALS)), max_size=8))
def test_special_tokens_match_tiktoken(tok, enc, parts):
    """With every special token allowed, or none of them recognised, our ids equal tiktoken's."""
    text = "".join(parts)
    assert tok.encode(text, allowed_special="all") == enc.encode(text, allowed_special="all")
    assert tok.encode(text, allowed_special="none") == enc.encode(text, disallowed_special=())
    assert tok.decode(tok.encode(text, allowed_special="all")) == text


def test_surrogates_are_repaired_as_tiktoken_does(tok, enc):
    """A surrogate pair becomes its character, a lone surrogate becomes U+FFFD, as in tiktoken."""
    for text in ["a\ud83d\ude00b", "x\udc00y", "\ud800"]:
        assert tok.encode(text) == enc.encode(text)
    assert tok.decode(tok.encode("x\udc00y")) == "x\ufffdy"


def test_invalid_utf8_decodes_to_replacement_characters(tok, enc):
    """Decoding half of a multi-byte character gives U+FFFD, exactly like tiktoken's decode."""
    ids = list(" é😀".encode())  # byte tokens, so any prefix is a valid id list
    for cut in range(len(ids) + 1):
        assert tok.decode(ids[:cut]) == enc.decode(ids[:cut])
    assert tok.decode([0xF0, 0x9F]) == "\ufffd"
    assert tok.decode_bytes([0xF0, 0x9F]) == b"\xf0\x9f"


# ---- special tokens ---------------------------------------------------------------------------


def test_allowed_special_tokens_become_their_ids(tok):
    """A special token allowed by name or by "all" encodes to its id; the text around it as usual."""
    text = f"hello{EOT} world{USER}"
    expected = (
        tok.encode("hello") + [tok.special_tokens[EOT]] + tok.encode(" world") + [tok.special_tokens[USER]]
    )
    assert tok.encode(text, allowed_special={EOT, USER}) == expected
    assert tok.encode(text, allowed_special="all") == expected
    assert tok.eos_token_id == tok.special_tokens[EOT]


def test_disallowed_special_token_raises_and_says_how_to_allow_it(tok, enc):
    """By default, or when not in the allowed set, a special token in the text is an error (as tiktoken)."""
    with pytest.raises(ValueError, match=r"'<\|user\|>'.*allowed_special=\{'<\|user\|>'\}"):
        tok.encode(f"hi {USER} there")
    with pytest.raises(ValueError, match=regex.escape(repr(USER))):
        tok.encode(f"{EOT}hi {USER}", allowed_special={EOT})
    with pytest.raises(ValueError):
        enc.encode(f"{EOT}hi {USER}", allowed_special={EOT})


def test_special_token_text_as_ordinary_text_matches_tiktoken(tok, enc):
    """allowed_special="none" encodes a special token's text like any other text."""
    text = f"a{EOT}b{FIM}"
    ids = tok.encode(text, allowed_special="none")
    assert ids == enc.encode(text, disallowed_special=())
    assert not set(ids) & set(tok.special_tokens.values())


def test_bad_allowed_special_is_a_clear_error(tok):
    with pytest.raises(ValueError, match="not special tokens"):
        tok.encode("x", allowed_special={"<|nope|>"})
    with pytest.raises(ValueError, match="for one token, pass"):
        tok.encode("x", allowed_special=EOT)
    with pytest.raises(TypeError, match="must be a str"):
        tok.encode(b"bytes")


def test_training_never_merges_across_a_special_token():
    """Special tokens cut the training text: no learned token holds part of one."""
    text = EOT.join(["hello"] * 40)
    tok = Tokenizer.train(text, 256 + 4 + 1, special_tokens=[EOT])
    learned = {tok.decode_bytes([i]) for i in range(256, 260)}
    assert learned == {b"el", b"lo", b"hel", b"hello"}  # ties: (e, l) < (h, e) < (l, l) < (l, o) by id


def test_eos_token_defaults_to_endoftext_and_can_be_chosen():
    corpus = "some text to train on " * 5
    assert Tokenizer.train(corpus, 260).eos_token_id is None
    assert Tokenizer.train(corpus, 260, special_tokens=[USER]).eos_token_id is None
    tok = Tokenizer.train(corpus, 262, special_tokens=[USER, EOT])
    assert tok.eos_token_id == 261 and tok.eos_token == EOT
    tok = Tokenizer.train(corpus, 262, special_tokens=[USER, EOT], eos_token=USER)
    assert tok.eos_token_id == 260


# ---- save / load ------------------------------------------------------------------------------


def test_save_load_round_trip(tok, tmp_path, corpus):
    """A saved and loaded tokenizer is the same tokenizer: merges, pattern, special tokens, ids."""
    path = tok.save(tmp_path)
    assert path == tmp_path / TOKENIZER_FILENAME
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["format"] == "nanolab-bpe" and data["version"] == 1
    assert data["pattern"] in (GPT2_PATTERN, GPT4_PATTERN) and data["pattern_name"] == tok.pattern_name
    loaded = Tokenizer.load(path)
    assert Tokenizer.load(tmp_path).merges == loaded.merges
    assert (loaded.merges, loaded.pattern, loaded.pattern_name) == (tok.merges, tok.pattern, tok.pattern_name)
    assert (loaded.special_tokens, loaded.eos_token_id, loaded.vocab_size) == (
        tok.special_tokens,
        tok.eos_token_id,
        tok.vocab_size,
    )
    sample = corpus[:20_000] + EOT
    assert loaded.encode(sample, allowed_special="all") == tok.encode(sample, allowed_special="all")


def test_custom_pattern_round_trips_and_agrees_with_tiktoken(tmp_path):
    pattern = r"[a-z]+|[0-9]|\s+|[^a-z0-9\s]+"
    tok = Tokenizer.train("abc abd abe 123 x-y-z " * 10, 260, pattern=pattern)
    assert tok.pattern_name is None and tok.pattern == pattern
    loaded = Tokenizer.load(tok.save(tmp_path / "custom.json"))
    assert loaded.pattern == pattern and loaded.merges == tok.merges
    text = "abde 12 x-y abc"
    assert loaded.encode(text) == tok.to_tiktoken().encode(text) == tok.encode(text)


def test_loading_a_bad_file_is_a_clear_error(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="no tokenizer file"):
        Tokenizer.load(tmp_path)
    path = tmp_path / "t.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Tokenizer.load(path)
    path.write_text(json.dumps({"model": {}}))
    with pytest.raises(ValueError, match="not a nanolab tokenizer file"):
        Tokenizer.load(path)
    data = json.loads(tok.save(path).read_text())
    path.write_text(json.dumps(data | {"version": 99}))
    with pytest.raises(ValueError, match="version 99"):
        Tokenizer.load(path)
    path.write_text(json.dumps(data | {"special_tokens": {EOT: 5}}))
    with pytest.raises(ValueError, match="inconsistent"):
        Tokenizer.load(path)


# ---- training: the incremental trainer is exact -----------------------------------------------


def naive_train(chunks: list[bytes], num_merges: int) -> list[tuple[int, int]]:
    """The oracle: re-count every pair of every chunk (no deduplication) before each merge."""
    words = [list(c) for c in chunks]
    merges = []
    for new_id in range(256, 256 + num_merges):
        counts = Counter(pair for w in words for pair in zip(w, w[1:]))
        if not counts:
            break
        best = min(counts, key=lambda pair: (-counts[pair], pair))  # most frequent, then smallest pair
        merges.append(best)
        for w_index, w in enumerate(words):
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(new_id)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            words[w_index] = out
    return merges


@settings(deadline=None, max_examples=200)
@given(
    words=st.lists(st.text("abcd", min_size=1, max_size=12), min_size=1, max_size=25),
    num_merges=st.integers(0, 40),
)
def test_incremental_training_equals_naive_recount(words, num_merges):
    """Pair counts kept up to date merge by merge give exactly the merges of re-counting everything."""
    chunks = [w.encode() for w in words]
    assert train_merges(Counter(chunks), num_merges) == naive_train(chunks, num_merges)


@settings(deadline=None, max_examples=50)
@given(
    text=st.text(st.sampled_from("ab cé\n1'😀"), max_size=300),
    pattern=st.sampled_from(["gpt2", "gpt4"]),
    num_merges=st.integers(0, 20),
)
def test_tokenizer_train_equals_naive_recount_on_random_text(text, pattern, num_merges):
    chunks = [c.encode() for c in regex.findall(Tokenizer(pattern=pattern).pattern, text)]
    expected = naive_train(chunks, num_merges)
    if len(expected) < num_merges:
        with pytest.raises(ValueError, match="only enough pairs"):
            Tokenizer.train(text, 256 + num_merges, pattern=pattern)
    else:
        assert list(Tokenizer.train(text, 256 + num_merges, pattern=pattern).merges) == expected


def test_incremental_training_equals_naive_recount_on_source_code():
    text = stdlib_source(skip=2, every=50, max_bytes=8_000)[:8_000]
    chunks = [c.encode() for c in regex.findall(GPT4_PATTERN, text)]
    assert list(Tokenizer.train(text, 256 + 60).merges) == naive_train(chunks, 60)


def test_ties_go_to_the_smallest_pair():
    """Equal counts: the pair with the smallest (left id, right id) is merged first."""
    assert train_merges({b"ba": 1, b"dc": 1, b"ab": 1}, 3) == [(97, 98), (98, 97), (100, 99)]


def test_training_shows_progress_when_verbose(capsys):
    Tokenizer.train("hello world " * 20, 262, verbose=True)
    assert "BPE merges" in capsys.readouterr().err
    Tokenizer.train("hello world " * 20, 262)
    assert "BPE merges" not in capsys.readouterr().err


def test_encode_cache_overflow_changes_nothing(tok, corpus, monkeypatch):
    """The per-chunk cache is emptied when full; results are the same with a tiny cache."""
    text = corpus[:30_000]
    expected = tok.encode(text)
    small = Tokenizer(tok.merges, tok.pattern, list(tok.special_tokens))
    monkeypatch.setattr(nanolab.text.tokenizer, "_CACHE_SIZE", 8)
    assert small.encode(text) == expected
    assert len(small._cache) <= 8


# ---- helpers ----------------------------------------------------------------------------------


def test_pair_counts_and_merge_agree_with_bpe_encode():
    """Applying a chunk's merges by hand gives the same tokens as the rank-based bpe_encode."""
    ranks = {bytes([i]): i for i in range(256)} | {b"ab": 256, b"abab": 257}
    assert bpe_encode(b"ababab", ranks) == merge(merge(list(b"ababab"), (97, 98), 256), (256, 256), 257)
    assert pair_counts(list(b"ababab")) == {(97, 98): 3, (98, 97): 2}
    assert bpe_encode(b"", ranks) == [] and bpe_encode(b"z", ranks) == [122]


@pytest.mark.parametrize("module", [nanolab.text.bpe, nanolab.text.tokenizer])
def test_docstring_examples_run(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


# ---- bad inputs -------------------------------------------------------------------------------


def test_bad_training_arguments_are_clear_errors():
    with pytest.raises(ValueError, match=r"at least 256 .* \+ 2 special tokens = 258"):
        Tokenizer.train("abc", 257, special_tokens=[EOT, USER])
    with pytest.raises(ValueError, match="unknown pattern name 'gpt3'"):
        Tokenizer.train("abc", 300, pattern="gpt3")
    with pytest.raises(ValueError, match="not a valid regex"):
        Tokenizer.train("abc", 300, pattern="(unclosed")
    with pytest.raises(TypeError, match="list of strings"):
        Tokenizer.train("abc", 300, special_tokens=EOT)
    with pytest.raises(ValueError, match="distinct"):
        Tokenizer.train("abc", 300, special_tokens=[EOT, EOT])
    with pytest.raises(ValueError, match="non-empty"):
        Tokenizer.train("abc", 300, special_tokens=[""])
    with pytest.raises(
        ValueError, match=regex.escape(f"eos_token {USER!r} is not one of the special tokens")
    ):
        Tokenizer.train("abc", 300, special_tokens=[EOT], eos_token=USER)
    with pytest.raises(ValueError, match=r"only enough pairs for 2 merges.*vocab_size <= 258"):
        Tokenizer.train("abc", 300)
    with pytest.raises(TypeError, match="text must be a str"):
        Tokenizer.train(b"abc", 300)


def test_bad_merges_and_ids_are_clear_errors(tok):
    with pytest.raises(ValueError, match=r"merge 0 is \(97, 256\)"):
        Tokenizer([(97, 256)])
    with pytest.raises(ValueError, match="same token b'abc'"):
        Tokenizer([(97, 98), (98, 99), (256, 99), (97, 257)])
    with pytest.raises(ValueError, match=f"token id {tok.vocab_size} is out of range"):
        tok.decode([1, tok.vocab_size])
    with pytest.raises(ValueError, match="token id -1 is out of range"):
        tok.decode([-1])


def test_a_whole_chunk_that_is_a_token_is_that_token():
    """As in tiktoken, a chunk equal to a token's bytes is that token, even where merging cannot reach it.

    Here "bc" outranks "ab", so merging "abcd" gets stuck at a, bc, d; "abcd" itself is token 259.
    """
    tok = Tokenizer([(98, 99), (97, 98), (99, 100), (257, 258)], pattern="gpt4")
    assert tok.encode("abcd") == [259] == tok.to_tiktoken().encode("abcd")
    assert tok.encode("abcde") == [97, 256, 100, 101] == tok.to_tiktoken().encode("abcde")


def test_a_longer_special_token_wins_over_its_prefix():
    """Where one special token is a prefix of another, the longer match is taken (documented rule)."""
    tok = Tokenizer(special_tokens=["<|a|>", "<|a|>b"])
    assert tok.encode("<|a|>b<|a|>", allowed_special="all") == [257, 256]
    with pytest.raises(ValueError, match=regex.escape("'<|a|>b'")):
        tok.encode("<|a|>b<|a|>", allowed_special={"<|a|>"})
