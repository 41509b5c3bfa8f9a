"""Feedback safe to print and to hand to a learner: no control characters, no grader source.

Much of what a learner reads comes from their own process: exception messages, tracebacks. `clean`
takes out everything that could drive a terminal (escape sequences whole, carriage returns, other
control characters, bidirectional overrides), so no feedback can move the cursor, recolour a line or
overwrite the summary. `Redactor` takes out any line that quotes the hidden tests, the solutions or
the reference implementation (nanolab): under bubblewrap a submission cannot read them at all, and
this is the second line of defence (against a verbatim quote; a submission that can read them, where
bubblewrap cannot run, can also encode them).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from collections.abc import Iterable
from pathlib import Path

_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[PX^_][^\x1b]*(?:\x1b\\)?|.)?")
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
REDACTED = "[a line quoting the grader's own code was removed]"
_KEY = 24  # secret lines shorter than this are too common to tell apart from the learner's own


def clean(text: str) -> str:
    """``text`` without escape sequences and control characters (newlines and tabs stay).

    Example:
        >>> clean("ok\\x1b[2K\\r\\x1b[31m22/22\\x1b[0m\\u202e")
        'ok22/22'
    """
    return _CONTROL.sub("", _ANSI.sub("", text))


class Redactor:
    """Removes every line of feedback that quotes a line of the secret sources.

    Lines that also appear in what the learner has (``public``: their notebook, the blank labs) are
    not secret. A secret line counts when it appears whole, as written or as ``repr`` escapes it.
    """

    def __init__(self, secret: Iterable[str], public: Iterable[str] = ()):
        known = {line.strip() for text in public for line in text.splitlines()}
        self._index: dict[str, set[str]] = {}
        for text in secret:
            for line in text.splitlines():
                line = line.strip()
                if len(line) < _KEY or line in known:
                    continue
                for form in (line, repr(line)[1:-1]):
                    self._index.setdefault(form[:_KEY], set()).add(form)

    def __call__(self, text: str) -> str:
        return "\n".join(REDACTED if self._quotes(line) else line for line in text.split("\n"))

    def _quotes(self, line: str) -> bool:
        index = self._index
        for i in range(len(line) - _KEY + 1):
            forms = index.get(line[i : i + _KEY])
            if forms and any(line.startswith(form, i) for form in forms):
                return True
        return False


@functools.cache
def grader_sources() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(secret, public): the solution notebooks' code and nanolab's source; the blank labs' code.
    Read once per process, from the checkout this package lives in (what is not there is skipped)."""
    root = Path(__file__).resolve().parents[2]
    secret = [_code(nb) for nb in sorted((root / "solutions").glob("*.ipynb"))]
    spec = importlib.util.find_spec("nanolab")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        secret += [_read(p) for p in sorted(Path(folder).rglob("*.py"))]
    public = [_code(nb) for nb in sorted((root / "labs").glob("*.ipynb"))]
    return tuple(secret), tuple(public)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _code(notebook: Path) -> str:
    try:
        cells = json.loads(_read(notebook) or "{}").get("cells", [])
    except ValueError:
        return ""
    return "\n".join("".join(c.get("source", "")) for c in cells if isinstance(c, dict))
