"""A nanolab tokenizer as a Hugging Face one: ``tokenizer.json`` (the `tokenizers` library's file) and
``tokenizer_config.json``, so that ``transformers.AutoTokenizer.from_pretrained(directory)``, and the
tools built on it (evaluation harnesses, load generators), read the same ids nanolab does.

The pieces, each chosen to give exactly nanolab's ids:

- **The split**: nanolab's regex, run by a ``Split`` pre-tokenizer (the `tokenizers` library's
  Oniguruma engine). One spelling must change: ``\\p{N}{1,3}+`` is possessive to the ``regex`` package
  (and to tiktoken) but means "one or more runs of 1 to 3 digits" to Oniguruma, which would keep a
  whole number in one chunk. A possessive interval at the end of an alternative gives the same
  chunks as a greedy one, so `hf_pattern` drops the ``+``.
- **Bytes as characters**: byte-level BPE files store a token's bytes as printable characters, one
  per byte (GPT-2's table, `byte_chars`); a ``ByteLevel`` pre-tokenizer and decoder convert.
- **The merges**: nanolab (like tiktoken) joins, at each step, the adjacent pair whose joined bytes
  form the lowest-ranked token, whichever two tokens they were made of. A Hugging Face BPE joins only
  the pairs its merge list names, so the list names every way to cut every token into two tokens,
  ordered by the token's rank. And a chunk that is a token as a whole is that token (``ignore_merges``),
  as in nanolab.
- **Special tokens**: added tokens with nanolab's ids, read as themselves wherever they appear in a text
  (``encode(text, allowed_special="all")`` in nanolab's terms).

``Tokenizer.save_hf(directory)`` writes both files; ``scripts/export_hf_tokenizer.py`` does it for a
checkpoint (the bundled model's are made so).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tokenizers

    from nanolab.text.tokenizer import Tokenizer

HF_TOKENIZER_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"


@cache
def byte_chars() -> tuple[str, ...]:
    """The character that stands for each byte in a byte-level BPE file (GPT-2's table).

    Printable Latin-1 bytes stand for themselves; the others (controls, space, 0x7F-0xA0, 0xAD) take
    the characters from U+0100 on, in byte order, so that no token's text holds a space or a control.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return tuple(chars[b] for b in range(256))


def as_chars(token: bytes) -> str:
    table = byte_chars()
    return "".join(table[b] for b in token)


def hf_pattern(pattern: str) -> str:
    """nanolab's split regex in the spelling Oniguruma reads the same way (see the module's docstring)."""
    return pattern.replace("{1,3}+", "{1,3}")


def vocab_and_merges(tok: Tokenizer) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The BPE model's vocabulary (token text -> id, special tokens left out) and merge list."""
    tokens = [tok.decode_bytes([i]) for i in range(256 + len(tok.merges))]
    rank = {t: i for i, t in enumerate(tokens)}
    merges = []
    for t in tokens:
        cuts = [(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in rank and t[k:] in rank]
        cuts.sort(key=lambda c: (rank[c[0]], rank[c[1]]))
        merges += [(as_chars(a), as_chars(b)) for a, b in cuts]
    return {as_chars(t): i for i, t in enumerate(tokens)}, merges


def to_hf(tok: Tokenizer) -> tokenizers.Tokenizer:
    """A `tokenizers.Tokenizer` that gives ``tok.encode(text, allowed_special="all")``'s ids."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab, merges = vocab_and_merges(tok)
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(hf_pattern(tok.pattern)), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    specials = sorted(tok.special_tokens.items(), key=lambda kv: kv[1])
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, _ in specials])
    for text, i in specials:
        if hf.token_to_id(text) != i:
            raise ValueError(f"special token {text!r} got id {hf.token_to_id(text)}, not nanolab's {i}")
    return hf


def tokenizer_config(
    tok: Tokenizer, chat_template: str | None = None, model_max_length: int | None = None
) -> dict[str, Any]:
    """``tokenizer_config.json``: the class transformers builds, the special tokens, the chat template."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": tok.eos_token,
        "bos_token": None,
        "pad_token": None,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {
                "content": text,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for text, i in sorted(tok.special_tokens.items(), key=lambda kv: kv[1])
        },
    }
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def save_hf(
    tok: Tokenizer,
    directory: str | Path,
    chat_template: str | None = None,
    model_max_length: int | None = None,
) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``; returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    to_hf(tok).save(str(directory / HF_TOKENIZER_FILE))
    config = tokenizer_config(tok, chat_template, model_max_length)
    (directory / HF_CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return directory
