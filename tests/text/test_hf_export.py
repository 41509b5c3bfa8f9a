"""A nanolab tokenizer written as a Hugging Face one (`nanolab.text.hf_export`): the `tokenizers` library and
`transformers.AutoTokenizer` read exactly nanolab's ids, for the bundled model's shipped files and for a
freshly trained tokenizer."""

from __future__ import annotations

import inspect
import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

tokenizers = pytest.importorskip("tokenizers")

from nanolab.model.loading import ASSETS_DIR, load_chat_template, load_tokenizer  # noqa: E402
from nanolab.text.hf_export import hf_pattern, to_hf  # noqa: E402
from nanolab.text.hf_tokenizer import HFTokenizer  # noqa: E402
from nanolab.text.pretokenize import GPT4_PATTERN  # noqa: E402
from nanolab.text.tokenizer import Tokenizer  # noqa: E402

TINYPY = ASSETS_DIR / "tinypy"
ROOT = Path(__file__).resolve().parents[2]
PIECES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "x", "X", "é", "ß", "😀", "中文", "—", "'s", "'LL",
          "'ve", "_", "#", "(", "))", "<|endoftext|>", "<|endoftext", "0", "7", "12", "123", "1234", "12345"]  # fmt: skip


def varied_texts(seed: int = 0) -> list[str]:
    """Python source, numbers of every length from 1 to 40 digits, whitespace runs, non-ASCII, special tokens."""
    rng = random.Random(seed)
    modules = (json, random, textwrap, inspect, subprocess)
    texts = [inspect.getsource(m) for m in modules]
    texts.append(" ".join(str(rng.randrange(10 ** rng.randint(1, 40))) for _ in range(2000)))
    texts.append("".join(str(n) for n in range(1, 2000)))  # digits glued across number boundaries
    texts.append("".join(rng.choice(PIECES) for _ in range(30000)))
    texts.append("naïve café, ∑ 😀 — «ünïcödé» Ω≈ç√∫ 東京 ٱلسَّلَامُ 👩‍👩‍👧\u200b\u00a0 end")
    return texts


@pytest.fixture(scope="module")
def tinypy() -> Tokenizer:
    return load_tokenizer(TINYPY)


def test_the_shipped_tokenizer_json_gives_nanolabs_ids_on_varied_text(tinypy) -> None:
    hf = tokenizers.Tokenizer.from_file(str(TINYPY / "tokenizer.json"))
    n = 0
    for text in varied_texts():
        want = tinypy.encode(text, allowed_special="all")
        got = hf.encode(text).ids
        assert got == want, (
            f"first difference at token {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"
        )
        assert hf.decode(got, skip_special_tokens=False) == tinypy.decode(want)
        n += len(want)
    assert n > 100_000  # the texts are large


def test_transformers_auto_tokenizer_reads_the_bundled_model(tinypy) -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(TINYPY)
    text = "def area(r):\n    return 3.14159 * r ** 2<|endoftext|>"
    assert tok(text)["input_ids"] == tinypy.encode(text, allowed_special="all")
    assert (tok.eos_token, tok.eos_token_id) == ("<|endoftext|>", tinypy.eos_token_id)
    messages = [{"role": "system", "content": "Helpers."}, {"role": "user", "content": "Read a JSON file."}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == load_chat_template(TINYPY, tinypy).render(messages, True)


def test_nanolabs_own_hugging_face_path_reads_the_same_ids(tinypy, tmp_path) -> None:
    tinypy.save_hf(tmp_path)
    hf = HFTokenizer.from_dir(tmp_path)
    for text in varied_texts(1)[-3:]:
        assert hf.encode(text, allowed_special="all") == tinypy.encode(text, allowed_special="all")
    assert hf.eos_token_id == tinypy.eos_token_id


def test_the_shipped_files_are_what_the_script_writes() -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "export_hf_tokenizer.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    config = json.loads((TINYPY / "tokenizer_config.json").read_text())
    assert config["chat_template"] == (TINYPY / "chat_template.jinja").read_text()
    assert config["model_max_length"] == json.loads((TINYPY / "config.json").read_text())["max_seq_len"]


def test_oniguruma_needs_the_possessive_digit_interval_spelled_greedy() -> None:
    """The `regex` package reads \\p{N}{1,3}+ as possessive; Oniguruma as (\\p{N}{1,3})+, a whole number."""
    assert "{1,3}+" in GPT4_PATTERN and "{1,3}+" not in hf_pattern(GPT4_PATTERN)
    split = tokenizers.pre_tokenizers.Split(tokenizers.Regex(GPT4_PATTERN), behavior="isolated")
    assert [p for p, _ in split.pre_tokenize_str("1234567")] == ["1234567"]  # what the plain copy would do
    fixed = tokenizers.pre_tokenizers.Split(tokenizers.Regex(hf_pattern(GPT4_PATTERN)), behavior="isolated")
    assert [p for p, _ in fixed.pre_tokenize_str("1234567")] == ["123", "456", "7"]


@pytest.fixture(scope="module")
def trained() -> Tokenizer:
    text = inspect.getsource(json) + inspect.getsource(textwrap) + " 12 345 6789 aaaa ééé 😀😀"
    return Tokenizer.train(text, 600, special_tokens=["<|endoftext|>", "<|pad|>"])


@pytest.fixture(scope="module")
def trained_hf(trained):
    return to_hf(trained)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.sampled_from(PIECES + ["a", "ab", "aaa", "def ", "self.", "json"]), max_size=60).map("".join)
)
def test_a_freshly_trained_tokenizer_exports_to_the_same_ids(trained, trained_hf, text) -> None:
    assert trained_hf.encode(text).ids == trained.encode(text, allowed_special="all")
