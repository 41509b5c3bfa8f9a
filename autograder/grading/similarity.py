"""Copying, seen: how much of each submission's graded code is also in another submission of the batch, or
in the reference (nanolab's own source, and the lab's solution notebook where the checkout has it).

The comparison is MOSS's (Schleimer, Wilkerson and Aiken, "Winnowing: local algorithms for document
fingerprinting", SIGMOD 2003), on Python tokens:

- *normalised tokens*: the graded cells' code is tokenized; comments, docstrings and layout are dropped, and
  every identifier becomes ``V``, every number ``N`` and every string ``S``, so renaming variables,
  re-indenting or rewording comments changes nothing;
- *fingerprints*: every run of ``K`` consecutive tokens is hashed, and in every window of ``W`` consecutive
  hashes the smallest is kept (winnowing): a shared run of at least ``K + W - 1`` tokens always shares a
  fingerprint, and the set stays small;
- *overlap*: the share of a submission's fingerprints found in the other's (containment, not symmetric: a
  short submission copied into a long one is 100% contained). A pair is reported when the overlap reaches
  ``THRESHOLD`` and the submission has at least ``MIN_FINGERPRINTS`` fingerprints of its own (below that,
  there is too little code to tell: a blank lab, a few lines).

Code every submission starts from is left out first: the fingerprints of the lab's blank graded cells
(where the checkout has ``labs/``), and, in a batch of four or more, those more than half the submissions
share (the exercise's shape: its signatures, the obvious loop). The report never changes a score; it is a list of pairs
for a person to read.
"""

from __future__ import annotations

import hashlib
import io
import keyword
import tokenize
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

K = 15  # tokens per hashed run
W = 8  # hashes per winnowing window
THRESHOLD = 0.8  # overlap reported
MIN_FINGERPRINTS = 20  # fewer: too little code to judge
REFERENCE = "reference"  # the name a match with the reference is reported under

_SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}


def normalized_tokens(code: str) -> list[str]:
    """``code``'s tokens with identifiers, numbers and strings abstracted and comments, docstrings and
    layout dropped; code that does not tokenize contributes the tokens before the fault."""
    out: list[str] = []
    previous = tokenize.NEWLINE  # a string right after a statement's start is a docstring (or a no-op)
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type in _SKIP:
                if tok.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                    previous = tokenize.NEWLINE
                continue
            if tok.type == tokenize.STRING and previous == tokenize.NEWLINE:
                continue  # a string statement: a docstring
            previous = tok.type
            if tok.type == tokenize.NAME:
                out.append(tok.string if keyword.iskeyword(tok.string) else "V")
            elif tok.type == tokenize.NUMBER:
                out.append("N")
            elif tok.type in (tokenize.STRING, getattr(tokenize, "FSTRING_START", -1)):
                out.append("S")
            else:
                out.append(tok.string)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return out


def fingerprints(code: str, k: int = K, w: int = W) -> set[int]:
    """The winnowed fingerprints of ``code``'s normalised tokens."""
    tokens = normalized_tokens(code)
    hashes = [
        int.from_bytes(hashlib.blake2b(" ".join(tokens[i : i + k]).encode(), digest_size=8).digest(), "big")
        for i in range(len(tokens) - k + 1)
    ]
    if len(hashes) <= w:
        return set(hashes)
    return {min(hashes[i : i + w]) for i in range(len(hashes) - w + 1)}


def overlap(mine: set[int], theirs: set[int]) -> float:
    """The share of ``mine`` found in ``theirs`` (0 for an empty set)."""
    return len(mine & theirs) / len(mine) if mine else 0.0


@dataclass(frozen=True)
class Match:
    """``submission``'s graded code is ``score`` contained in ``other`` (another submission, or the
    reference)."""

    submission: str
    other: str
    score: float


def reference_code(lab_notebook: str) -> str:
    """What counts as the reference for a lab: nanolab's Python source, and the graded cells of the lab's
    solution notebook where this is a checkout that has it."""
    root = Path(__file__).resolve().parents[2]
    parts = [p.read_text(encoding="utf-8") for p in sorted((root / "nanolab").rglob("*.py"))]
    solution = root / "solutions" / lab_notebook
    if solution.is_file():
        parts += graded_code_of(solution)
    return "\n".join(parts)


def graded_code_of(path: Path) -> list[str]:
    """The sources of a notebook's graded (solution) cells, as nbgrader marks them."""
    import json

    nb = json.loads(path.read_text(encoding="utf-8"))
    out = []
    for cell in nb.get("cells", []):
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.get("cell_type") == "code" and meta.get("solution"):
            source = cell.get("source", "")
            out.append("".join(source) if isinstance(source, list) else source)
    return out


def compare(
    submissions: Sequence[tuple[str, str]],
    template: str = "",
    reference: str = "",
    threshold: float = THRESHOLD,
) -> list[Match]:
    """Every pair above ``threshold``: ``submissions`` are (name, graded code); ``template`` is the code every
    submission starts from (left out); ``reference`` is compared with each submission too."""
    common = fingerprints(template) if template else set()
    prints = {name: fingerprints(code) for name, code in submissions}
    if len(prints) >= 4:  # what more than half the class wrote alike is the exercise's shape, not a copy
        counts: dict[int, int] = {}
        for p in prints.values():
            for h in p:
                counts[h] = counts.get(h, 0) + 1
        common |= {h for h, c in counts.items() if c > len(prints) / 2}
    prints = {name: p - common for name, p in prints.items()}
    ref = fingerprints(reference) - common if reference else set()
    matches = []
    for name, mine in prints.items():
        if len(mine) < MIN_FINGERPRINTS:
            continue
        others: Iterable[tuple[str, set[int]]] = [(o, p) for o, p in prints.items() if o != name]
        if ref:
            others = [*others, (REFERENCE, ref)]
        for other, theirs in others:
            score = overlap(mine, theirs)
            if score >= threshold:
                matches.append(Match(name, other, round(score, 3)))
    return sorted(matches, key=lambda m: (m.submission, -m.score, m.other))


def annotate(results: Sequence, threshold: float = THRESHOLD) -> None:
    """Compare the graded code of ``results`` (`SubmissionResult`s) lab by lab, and record each one's matches
    in its ``similar`` list (``{"with": other submission or "reference", "score": overlap}``)."""
    from autograder.submission.labs import LABS

    root = Path(__file__).resolve().parents[2]
    by_lab: dict[int, list] = {}
    for r in results:
        if r.lab in LABS:
            by_lab.setdefault(r.lab, []).append(r)
    for lab, group in by_lab.items():
        notebook = LABS[lab].notebook
        codes = []
        for r in group:
            try:
                codes.append((r.submission, "\n".join(graded_code_of(Path(r.submission)))))
            except (OSError, ValueError, AttributeError, TypeError):
                codes.append((r.submission, ""))
        blank = root / "labs" / notebook
        template = "\n".join(graded_code_of(blank)) if blank.is_file() else ""
        found = compare(codes, template, reference_code(notebook), threshold)
        for r in group:
            r.similar = [{"with": m.other, "score": m.score} for m in found if m.submission == r.submission]
