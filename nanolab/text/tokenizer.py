"""The reference tokenizer: byte-level BPE with a regex pre-split and special tokens.

Text becomes token ids in three steps, the same three as GPT-2/GPT-4's tiktoken encodings:

1. cut the text at the *allowed* special tokens (strings such as ``<|endoftext|>`` that map to one
   reserved id each and never take part in merges);
2. split each stretch between them into chunks with a regex (``pattern``: "gpt2", "gpt4" or your
   own), so that merges never cross, say, a word and the space before the next one;
3. encode each chunk's UTF-8 bytes with the learned merges (`nanolab.text.bpe.bpe_encode`).

Ids: 0..255 are the raw bytes, ``256 + i`` is the token made by merge ``i``, and the special tokens
come after the merges. A token's id is its merge rank, and no two tokens share a byte string, so
`Tokenizer.to_tiktoken` builds a `tiktoken.Encoding` that gives exactly our ids.

On disk a tokenizer is one JSON file (`TOKENIZER_FILENAME`, not to be confused with Hugging Face's
``tokenizer.json``)::

    {"format": "nanolab-bpe", "version": 1,
     "pattern_name": "gpt4",                # or null for a custom regex
     "pattern": "...",                      # the regex itself, always stored
     "merges": [[97, 98], [256, 99], ...],  # merge i joins these two ids into id 256 + i
     "special_tokens": {"<|endoftext|>": 4095},
     "eos_token": "<|endoftext|>",          # or null
     "vocab_size": 4096}

Deliberately left out: loading other tokenizers' files (GPT-2's merges.txt, Hugging Face's
tokenizer.json, tiktoken's .tiktoken), GPT-4's byte shuffle, normalization (NFC and the like),
batched or multi-threaded encoding, and ``disallowed_special``: a special token in the text is
either allowed, an error, or (``allowed_special="none"``) plain text.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import regex
from tqdm.auto import tqdm

from nanolab.text.bpe import Pair, bpe_encode, train_merges
from nanolab.text.pretokenize import (
    check_special_tokens,
    resolve_pattern,
    without_surrogates,
)

if TYPE_CHECKING:
    import tiktoken

ENDOFTEXT = "<|endoftext|>"  # the end-of-text token's conventional name; the default eos_token
TOKENIZER_FILENAME = "nanolab_tokenizer.json"
FORMAT, VERSION = "nanolab-bpe", 1
_CACHE_SIZE = 1 << 16  # chunks whose encoding is remembered; the cache is emptied when full

AllowedSpecial = Literal["none_raise", "none", "all"] | Collection[str]


def allowed_special_tokens(allowed_special: AllowedSpecial, special: Collection[str]) -> frozenset[str]:
    """The special tokens ``allowed_special`` lets through as themselves, out of a tokenizer's ``special``.

    ValueError for a string that is not one of the three words, or for a name that is not special.
    """
    if allowed_special == "all":
        return frozenset(special)
    if allowed_special in ("none", "none_raise"):
        return frozenset()
    if isinstance(allowed_special, str):
        raise ValueError(
            f"allowed_special must be 'none_raise', 'none', 'all' or a set of special tokens, "
            f"got the string {allowed_special!r} (for one token, pass {{{allowed_special!r}}})"
        )
    allowed = frozenset(allowed_special)
    unknown = sorted(allowed - set(special))
    if unknown:
        raise ValueError(
            f"allowed_special names {unknown}, which are not special tokens of this tokenizer "
            f"(it has {sorted(special)[:20]})"
        )
    return allowed


class Tokenizer:
    """A byte-level BPE tokenizer: `train` one, or build one from its merges; then encode/decode.

    ``merges[i] = (a, b)`` makes token ``256 + i`` from tokens ``a`` and ``b`` (both smaller ids).
    ``special_tokens`` are given ids after the merges, in order. ``eos_token`` names the one of them
    that ends a text; by default ``"<|endoftext|>"`` when it is among them, else there is none.

    Example:
        >>> tok = Tokenizer.train("ab ab ab", 259, special_tokens=["<|endoftext|>"])
        >>> tok.merges  # "a" + "b" -> 256 ("ab"), then " " + 256 -> 257 (" ab")
        ((97, 98), (32, 256))
        >>> tok.encode("ab ab<|endoftext|>", allowed_special="all")
        [256, 257, 258]
        >>> tok.decode([257, 258]), tok.eos_token_id, tok.vocab_size
        (' ab<|endoftext|>', 258, 259)
    """

    def __init__(
        self,
        merges: Sequence[Pair] = (),
        pattern: str = "gpt4",
        special_tokens: Iterable[str] | None = None,
        eos_token: str | None = None,
    ) -> None:
        self.pattern_name, self.pattern = resolve_pattern(pattern)
        self._split = regex.compile(self.pattern)
        self.merges: tuple[Pair, ...] = tuple((int(a), int(b)) for a, b in merges)
        vocab = [bytes([i]) for i in range(256)]
        for i, (a, b) in enumerate(self.merges):
            if not (0 <= a < len(vocab) and 0 <= b < len(vocab)):
                raise ValueError(f"merge {i} is ({a}, {b}) but only ids 0..{len(vocab) - 1} exist before it")
            vocab.append(vocab[a] + vocab[b])
        self._ranks = {token: i for i, token in enumerate(vocab)}  # bytes -> id, as tiktoken wants it
        if len(self._ranks) != len(vocab):
            dup = next(t for t in vocab if vocab.count(t) > 1)
            raise ValueError(f"two merges make the same token {dup!r}; each token's bytes must be unique")

        specials = check_special_tokens(special_tokens)
        self._special = {token: len(vocab) + i for i, token in enumerate(specials)}
        self._vocab = vocab + [token.encode("utf-8") for token in specials]  # id -> bytes, for decode
        if eos_token is None and ENDOFTEXT in self._special:
            eos_token = ENDOFTEXT
        if eos_token is not None and eos_token not in self._special:
            raise ValueError(
                f"eos_token {eos_token!r} is not one of the special tokens {specials}; add it to special_tokens"
            )
        self.eos_token = eos_token
        self._cache: dict[str, tuple[int, ...]] = {}
        self._special_regex: dict[frozenset[str], regex.Pattern] = {}

    # ---- training -----------------------------------------------------------------------------

    @classmethod
    def train(
        cls,
        text: str,
        vocab_size: int,
        pattern: str = "gpt4",
        special_tokens: Iterable[str] | None = None,
        *,
        eos_token: str | None = None,
        verbose: bool = False,
    ) -> Tokenizer:
        """Learn ``vocab_size - 256 - len(special_tokens)`` merges from ``text``.

        The text is cut at the special tokens (so no merge spans one), split with ``pattern``, and the
        distinct chunks are counted; training then runs on the chunk counts (`nanolab.text.bpe.train_merges`:
        most frequent pair first, ties to the smallest pair of ids). ``verbose`` shows a progress bar.
        Raises ValueError when ``vocab_size`` leaves no room for the 256 bytes and the special tokens,
        or when the text runs out of pairs to merge before reaching ``vocab_size``.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        specials = check_special_tokens(special_tokens)
        untrained = cls((), pattern, specials, eos_token)  # checks pattern and eos_token up front
        smallest = 256 + len(specials)
        if not isinstance(vocab_size, int) or vocab_size < smallest:
            raise ValueError(
                f"vocab_size={vocab_size!r} is too small: it must be at least 256 (one token per byte) "
                f"+ {len(specials)} special tokens = {smallest}"
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = without_surrogates(text)
        stretches = untrained._special_finder(frozenset(specials)).split(text) if specials else [text]
        chunks = Counter(
            chunk for stretch in stretches for chunk in untrained._split.findall(stretch) if chunk
        )
        word_counts = {chunk.encode("utf-8"): n for chunk, n in chunks.items()}

        num_merges = vocab_size - smallest
        with tqdm(total=num_merges, desc="BPE merges", unit="merge", disable=not verbose) as bar:
            merges = train_merges(word_counts, num_merges, on_merge=lambda pair, count: bar.update())
        if len(merges) < num_merges:
            raise ValueError(
                f"the text has only enough pairs for {len(merges)} merges, but vocab_size={vocab_size} "
                f"needs {num_merges}; use more text or vocab_size <= {smallest + len(merges)}"
            )
        return cls(merges, pattern, specials, eos_token)

    # ---- properties ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids: 256 bytes + merges + special tokens (ids are ``0 .. vocab_size - 1``)."""
        return len(self._vocab)

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special token string -> id (a copy)."""
        return dict(self._special)

    @property
    def eos_token_id(self) -> int | None:
        """Id of the end-of-text special token, or None when this tokenizer has none."""
        return None if self.eos_token is None else self._special[self.eos_token]

    def __repr__(self) -> str:
        pattern = self.pattern_name or "custom"
        return f"Tokenizer(vocab_size={self.vocab_size}, pattern={pattern!r}, special_tokens={list(self._special)})"

    # ---- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str, allowed_special: AllowedSpecial = "none_raise") -> list[int]:
        """Encode ``text`` to token ids.

        ``allowed_special`` says what a special token's text inside ``text`` becomes:

        - ``"none_raise"`` (default): an error, unless it is allowed (tiktoken's default too);
        - ``"all"``: its special id;
        - a set of special tokens: those become their ids, any other one raises;
        - ``"none"``: ordinary text, split and merged like any other (tiktoken's ``encode_ordinary``).

        Where one special token is a prefix of another, the longer one is matched first. The same
        call on ``self.to_tiktoken()`` gives the same ids (``"none"`` there is ``disallowed_special=()``),
        as long as no special token is a prefix of another (tiktoken leaves that order unspecified).
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        allowed = self._allowed(allowed_special)
        if allowed_special != "none":
            forbidden = frozenset(self._special) - allowed
            found = self._special_finder(forbidden).search(text) if forbidden else None
            if found:
                token = found.group()
                raise ValueError(
                    f"the text contains the special token {token!r}, which is not allowed here. To encode "
                    f"it as its special id, pass allowed_special={{{token!r}}} (or allowed_special='all'); "
                    "to encode it as ordinary text, pass allowed_special='none'"
                )
        try:
            return self._encode(text, allowed)
        except UnicodeEncodeError:
            return self._encode(without_surrogates(text), allowed)

    def _allowed(self, allowed_special: AllowedSpecial) -> frozenset[str]:
        return allowed_special_tokens(allowed_special, self._special)

    def _special_finder(self, tokens: frozenset[str]) -> regex.Pattern:
        if tokens not in self._special_regex:
            # Longest first, so a special token that is a prefix of another does not shadow it.
            alternatives = sorted(tokens, key=lambda t: (-len(t), t))
            self._special_regex[tokens] = regex.compile("|".join(map(regex.escape, alternatives)))
        return self._special_regex[tokens]

    def _encode(self, text: str, allowed: frozenset[str]) -> list[int]:
        if not allowed:
            return self._encode_ordinary(text)
        ids: list[int] = []
        start = 0
        for match in self._special_finder(allowed).finditer(text):
            ids.extend(self._encode_ordinary(text[start : match.start()]))
            ids.append(self._special[match.group()])
            start = match.end()
        ids.extend(self._encode_ordinary(text[start:]))
        return ids

    def _encode_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        cache, ranks = self._cache, self._ranks
        for chunk in self._split.findall(text):
            chunk_ids = cache.get(chunk)
            if chunk_ids is None:
                piece = chunk.encode("utf-8")
                rank = ranks.get(piece)  # a whole chunk that is a token is that token (as tiktoken)
                chunk_ids = (rank,) if rank is not None else tuple(bpe_encode(piece, ranks))
                if len(cache) >= _CACHE_SIZE:
                    cache.clear()
                cache[chunk] = chunk_ids
            ids.extend(chunk_ids)
        return ids

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes that ``ids`` stand for (special tokens as their UTF-8 text)."""
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= len(self._vocab)):
            bad = next(i for i in ids if not 0 <= i < len(self._vocab))
            raise ValueError(
                f"token id {bad} is out of range: this tokenizer's ids are 0..{len(self._vocab) - 1}"
            )
        vocab = self._vocab
        return b"".join([vocab[i] for i in ids])

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ``ids`` to text; bytes that are not valid UTF-8 become U+FFFD (as tiktoken does).

        ``decode(encode(s)) == s`` for every string without surrogates.
        """
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    # ---- files and tiktoken -------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """Write the tokenizer as JSON to ``path`` (a directory gets `TOKENIZER_FILENAME` inside).

        Returns the file written.
        """
        path = Path(path)
        if path.is_dir():
            path = path / TOKENIZER_FILENAME
        data = {
            "format": FORMAT,
            "version": VERSION,
            "pattern_name": self.pattern_name,
            "pattern": self.pattern,
            "merges": [list(pair) for pair in self.merges],
            "special_tokens": self.special_tokens,
            "eos_token": self.eos_token,
            "vocab_size": self.vocab_size,
        }
        path.write_text(json.dumps(data, ensure_ascii=False) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Read a tokenizer written by `save` (``path`` is the file or the directory holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / TOKENIZER_FILENAME
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f'{path} is not a nanolab tokenizer file (expected "format": {FORMAT!r})')
        if data.get("version") != VERSION:
            raise ValueError(
                f"{path} has format version {data.get('version')!r}; this nanolab reads version {VERSION}"
            )
        specials = data.get("special_tokens", {})
        tok = cls(data["merges"], data["pattern"], list(specials), data.get("eos_token"))
        if tok.special_tokens != specials or data.get("vocab_size", tok.vocab_size) != tok.vocab_size:
            raise ValueError(
                f"{path} is inconsistent: special token ids must follow the merges in order "
                f"(expected {tok.special_tokens}, found {specials}) and vocab_size must match"
            )
        return tok

    def save_hf(
        self, directory: str | Path, chat_template: str | None = None, model_max_length: int | None = None
    ) -> Path:
        """Write this tokenizer as a Hugging Face one (``tokenizer.json`` and ``tokenizer_config.json``) into
        ``directory``: ``transformers.AutoTokenizer.from_pretrained(directory)`` then gives the ids
        ``encode(text, allowed_special="all")`` gives. See `nanolab.text.hf_export`."""
        from nanolab.text.hf_export import save_hf

        return save_hf(self, directory, chat_template, model_max_length)

    def to_tiktoken(self, name: str = "nanolab") -> tiktoken.Encoding:
        """An equivalent `tiktoken.Encoding`, built offline from our ranks, pattern and special tokens.

        Valid because every token's bytes are unique and its id is its merge rank. A custom
        ``pattern`` must also be valid in tiktoken's regex dialect (Rust's fancy-regex).
        """
        try:
            import tiktoken
        except ImportError as exc:
            raise ImportError("to_tiktoken() needs the tiktoken package: pip install tiktoken") from exc
        return tiktoken.Encoding(
            name=name,
            pat_str=self.pattern,
            mergeable_ranks=dict(self._ranks),
            special_tokens=self.special_tokens,
            explicit_n_vocab=self.vocab_size,
        )
