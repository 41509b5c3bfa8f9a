"""A Hugging Face checkpoint's tokenizer, behind the interface of nanolab's own `Tokenizer`.

A checkpoint written by ``save_pretrained`` keeps its tokenizer in ``tokenizer.json``: the `tokenizers`
library's one-file format (normalizer, pre-tokenizer, BPE/Unigram/WordPiece model, post-processor that
may add a BOS token, decoder, added tokens). ``tokenizer_config.json`` says which added token is BOS or
EOS, and may hold the chat template (see `nanolab.text.chat_template`). `HFTokenizer` loads both with
`tokenizers` and answers what the engine asks of any tokenizer: ``encode(text, allowed_special)``,
``decode``, ``decode_bytes``, ``special_tokens``, ``eos_token_id`` and ``vocab_size``.

The engine detokenizes incrementally from a table of each token's bytes (``decode_bytes([i])``), so
the text of a sequence must be the concatenation of its tokens' bytes. That holds for the two decoders
of nearly every causal LM:

- byte-level BPE (GPT-2, Llama 3, Qwen2): a token's characters stand for bytes, one character each
  (GPT-2's printable stand-ins, such as ``Ġ`` for a space), mapped back with `unicode_to_bytes`;
- SentencePiece-style BPE (Llama 2, Mistral): ``▁`` is a space and ``<0x0A>`` is the byte 0x0A.
  One difference is kept on purpose: the decoder strips the space that the tokenizer puts before the
  very first word of a text, whereas a generated token keeps it (it follows the prompt), as vLLM does.

Added tokens (``<|endoftext|>``, ``<|im_start|>``) stand for their own text. Other decoders (WordPiece's
``##``, ...) fall back on decoding each token alone.

Deliberately left out: "slow" tokenizers without a ``tokenizer.json`` (SentencePiece's
``tokenizer.model``, GPT-2's ``vocab.json`` + ``merges.txt``: convert them once with ``transformers``'
``AutoTokenizer.from_pretrained(...).save_pretrained(...)``), padding and truncation, batch encoding.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from nanolab.text.tokenizer import AllowedSpecial, allowed_special_tokens

HF_TOKENIZER_FILE = "tokenizer.json"
HF_TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback: <0x0A> is b"\n"


def unicode_to_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: the character that stands for each byte -> the byte.

    Printable bytes stand for themselves; the others (space, control bytes, ...) are shifted up past 255,
    so every token is a printable string.

    Example:
        >>> table = unicode_to_bytes()
        >>> table["A"], table["Ġ"], table["Ċ"]   # "Ġ" is a space, "Ċ" a newline
        (65, 32, 10)
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A `tokenizers.Tokenizer` with nanolab's tokenizer interface (see the module docstring).

    ``eos_token_ids``: the ids that end a generated sequence, first the main one (a checkpoint's
    generation config may list several: Llama 3 ends a text and a chat turn differently); by default
    the id of ``eos_token``, the tokenizer's own end-of-text token (what a chat template writes).
    ``special_tokens`` are the added tokens marked special: the engine gives them no text, as
    ``transformers``' ``decode(..., skip_special_tokens=True)`` and vLLM do.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        self._tok = tokenizer
        added = tokenizer.get_added_tokens_decoder()  # id -> AddedToken
        self._added = {i: t.content for i, t in added.items()}
        self._special = {t.content: i for i, t in sorted(added.items()) if t.special}
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.bos_token = bos_token
        if eos_token_ids is None:
            eos_id = None if eos_token is None else tokenizer.token_to_id(eos_token)
            eos_token_ids = () if eos_id is None else (eos_id,)
        self.eos_token_ids: tuple[int, ...] = tuple(int(i) for i in eos_token_ids)
        if eos_token is None and self.eos_token_ids:
            eos_token = tokenizer.id_to_token(self.eos_token_ids[0])
        self.eos_token = eos_token
        self._plain: Any = None  # a copy that reads special tokens' text as plain text, made when needed

    @classmethod
    def from_dir(cls, directory: str | Path, eos_token_ids: Sequence[int] | None = None) -> HFTokenizer:
        """Load ``tokenizer.json`` (and ``tokenizer_config.json``, if there) from a checkpoint directory.

        ``eos_token_ids`` comes from the model's config when it names them (see
        `nanolab.model.loading.load_tokenizer`); otherwise ``tokenizer_config.json``'s ``eos_token``.
        """
        try:
            from tokenizers import Tokenizer as RustTokenizer
        except ImportError as exc:
            raise ImportError(
                "a Hugging Face checkpoint's tokenizer.json needs the tokenizers package: pip install tokenizers"
            ) from exc
        directory = Path(directory)
        file = directory / HF_TOKENIZER_FILE
        try:
            tokenizer = RustTokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot read
            raise ValueError(
                f"{file} is not a tokenizer file the tokenizers library can read: {exc}"
            ) from None
        config = read_tokenizer_config(directory)
        return cls(
            tokenizer,
            bos_token=token_text(config.get("bos_token")),
            eos_token=token_text(config.get("eos_token")),
            eos_token_ids=eos_token_ids,
        )

    # ---- properties ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (ids are ``0 .. vocab_size - 1``)."""
        return self._vocab_size

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special token string -> id (a copy)."""
        return dict(self._special)

    @property
    def eos_token_id(self) -> int | None:
        """The main end-of-sequence id (the first of ``eos_token_ids``), or None when there is none."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self._tok.token_to_id(self.bos_token)

    def __repr__(self) -> str:
        return (
            f"HFTokenizer(vocab_size={self.vocab_size}, eos_token={self.eos_token!r}, "
            f"special_tokens={list(self._special)[:8]})"
        )

    # ---- encode / decode ----------------------------------------------------------------------

    def encode(
        self, text: str, allowed_special: AllowedSpecial = "none_raise", *, add_special_tokens: bool = True
    ) -> list[int]:
        """Encode ``text`` to token ids; ``allowed_special`` means what it means for `Tokenizer.encode`.

        ``add_special_tokens``: let the checkpoint's post-processor add its tokens (a BOS in front, for
        Llama), as ``transformers``' ``tokenizer(text)`` does. A rendered chat template already holds
        them, so chat prompts are encoded with ``add_special_tokens=False``.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if allowed_special == "none":
            if self._plain is None:
                from tokenizers import Tokenizer as RustTokenizer

                self._plain = RustTokenizer.from_str(self._tok.to_str())
                self._plain.encode_special_tokens = True  # special tokens' text is split like any other
            return self._plain.encode(text, add_special_tokens=add_special_tokens).ids
        allowed = self._allowed(allowed_special)
        forbidden = sorted(t for t in self._special if t not in allowed and t in text)
        if forbidden:
            token = forbidden[0]
            raise ValueError(
                f"the text contains the special token {token!r}, which is not allowed here. To encode "
                f"it as its special id, pass allowed_special={{{token!r}}} (or allowed_special='all'); "
                "to encode it as ordinary text, pass allowed_special='none'"
            )
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def _allowed(self, allowed_special: AllowedSpecial) -> frozenset[str]:
        return allowed_special_tokens(allowed_special, self._special)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes that ``ids`` stand for (special tokens as their UTF-8 text)."""
        table = self._token_bytes
        out = []
        for i in ids:
            if not 0 <= i < len(table):
                raise ValueError(
                    f"token id {i} is out of range: this tokenizer's ids are 0..{len(table) - 1}"
                )
            out.append(table[i])
        return b"".join(out)

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ``ids`` to text, special tokens included; bytes that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    @cached_property
    def _token_bytes(self) -> list[bytes]:
        """Every id's bytes (b"" for an id that no token has), worked out once from the decoder's kind."""
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        kinds = _decoder_kinds(decoder)
        if "ByteLevel" in kinds:
            chars = unicode_to_bytes()

            def convert(i: int, token: str) -> bytes:
                if all(c in chars for c in token):
                    return bytes(chars[c] for c in token)
                return token.encode("utf-8")
        elif kinds & {"ByteFallback", "Metaspace", "Replace"}:
            spaces = _space_marks(decoder)

            def convert(i: int, token: str) -> bytes:
                byte = _BYTE_TOKEN.fullmatch(token)
                if byte:
                    return bytes([int(byte.group(1), 16)])
                for mark in spaces:
                    token = token.replace(mark, " ")
                return token.encode("utf-8")
        else:

            def convert(i: int, token: str) -> bytes:
                return self._tok.decode([i], skip_special_tokens=False).encode("utf-8")

        table = []
        for i in range(self._vocab_size):
            token = self._tok.id_to_token(i)
            if i in self._added:
                table.append(self._added[i].encode("utf-8"))
            else:
                table.append(b"" if token is None else convert(i, token))
        return table


def _decoder_kinds(decoder: dict[str, Any]) -> set[str]:
    kinds = {decoder.get("type")}
    for inner in decoder.get("decoders") or ():
        kinds |= _decoder_kinds(inner)
    return kinds - {None}


def _space_marks(decoder: dict[str, Any]) -> list[str]:
    """The strings a SentencePiece-style decoder turns into a space (``▁``, from Replace or Metaspace)."""
    marks = []
    if decoder.get("type") == "Replace" and decoder.get("content") == " ":
        pattern = decoder.get("pattern") or {}
        if "String" in pattern:
            marks.append(pattern["String"])
    if decoder.get("type") == "Metaspace":
        marks.append(decoder.get("replacement", "▁"))
    for inner in decoder.get("decoders") or ():
        marks += _space_marks(inner)
    return marks or ["▁"]


def read_tokenizer_config(directory: str | Path) -> dict[str, Any]:
    """``tokenizer_config.json`` of a checkpoint directory as a dict ({} when there is none)."""
    file = Path(directory) / HF_TOKENIZER_CONFIG_FILE
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(config).__name__}")
    return config
