"""Grading results and the files they are written to: terminal table, Gradescope JSON, JSON, CSV.

Gradescope's format (one ``results.json`` per submission) is documented at
https://gradescope-autograders.readthedocs.io/en/latest/specs/: a top-level ``score``,
``execution_time``, ``output`` and a ``tests`` list whose entries have ``name``, ``score``,
``max_score``, ``status`` ("passed"/"failed"), ``output`` and ``visibility``.

Every file is written whole or not at all (a temporary file beside it, then renamed over it), and
everything printed to a terminal goes through `autograder.grading.feedback.clean` first.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from autograder.grading.feedback import clean


@dataclass
class TestResult:
    """One hidden test's verdict on one submission.

    The grader makes it when pytest collects the test (failed, "did not run") and updates it as the
    test's reports come in, so a test that never got to run is still listed, with no points.
    """

    __test__ = False  # not a pytest test class

    id: str  # the test function's name (an instructor's extra test: prefixed): a stable key, a CSV column
    name: str  # what it checks, for people: the first line of the test's docstring
    max_score: float
    visibility: str = "visible"  # Gradescope's: visible, hidden, after_due_date, after_published
    status: str = "failed"  # "passed" or "failed"
    output: str = "did not run"  # feedback for the learner; empty when passed

    @property
    def score(self) -> float:
        """All of the test's points when it passed, none otherwise."""
        return self.max_score if self.status == "passed" else 0.0


@dataclass
class SubmissionResult:
    """All verdicts on one submitted notebook."""

    submission: str  # the path as given
    lab: int | None
    tests: list[TestResult] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)  # feedback about the whole submission
    graded: bool = True  # False when the notebook could not be graded at all (a zero)
    execution_time: float = 0.0
    seed: int | None = None
    internal_error: str | None = None  # a fault of the grader or its tests, not of the submission
    confined: bool | None = None  # whether the sandbox could not write outside its directory
    isolated: bool | None = None  # whether the sandbox ran under bubblewrap (autograder.sandbox.isolation)
    # graded code shared with another submission or the reference (autograder.grading.similarity), when
    # asked for: [{"with": submission path or "reference", "score": overlap}]; never changes the score
    similar: list[dict] = field(default_factory=list)

    @property
    def score(self) -> float:
        return sum(t.score for t in self.tests)

    @property
    def max_score(self) -> float:
        return sum(t.max_score for t in self.tests)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["score"], data["max_score"] = self.score, self.max_score
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SubmissionResult:
        fields = {k: v for k, v in data.items() if k not in ("score", "max_score", "tests")}
        return cls(tests=[TestResult(**t) for t in data.get("tests", [])], **fields)

    def to_gradescope(self, visibility: str | None = None) -> dict[str, Any]:
        """This result in Gradescope's ``results.json`` format; ``visibility`` (Gradescope's: visible,
        hidden, after_due_date, after_published), when given, is every test's and the result's."""
        return {
            "score": round(self.score, 4),
            "execution_time": round(self.execution_time, 3),
            "output": "\n".join(self.messages),
            "visibility": visibility or "visible",
            "stdout_visibility": "hidden",
            "tests": [
                {
                    "name": t.name,
                    "score": t.score,
                    "max_score": t.max_score,
                    "status": t.status,
                    "output": t.output,
                    "visibility": visibility or t.visibility,
                }
                for t in self.tests
            ],
        }


def submission_key(path: str) -> str:
    """A file-name-safe key for a submission path: ``subs/alice/lab01.ipynb`` -> ``subs_alice_lab01``."""
    stem = str(Path(path).with_suffix(""))
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._") or "submission"


def write_gradescope(results: list[SubmissionResult], path: Path) -> list[Path]:
    """One result: ``path`` is the results.json. Several: ``path`` is a directory of ``<key>.json``."""
    if len(results) == 1:
        write_atomically(path, json.dumps(results[0].to_gradescope(), indent=2) + "\n")
        return [path]
    path.mkdir(parents=True, exist_ok=True)
    written = []
    for result in results:
        out = path / f"{submission_key(result.submission)}.json"
        write_atomically(out, json.dumps(result.to_gradescope(), indent=2) + "\n")
        written.append(out)
    return written


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: into a temporary file beside it, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_json(results: list[SubmissionResult], path: Path) -> None:
    """A JSON list with, per submission, the Gradescope fields plus submission, lab, max_score, seed."""
    rows = []
    for r in results:
        row = {"submission": r.submission, "student_id": student_id(r.submission), "lab": r.lab}
        row |= {"max_score": r.max_score, "graded": r.graded}
        row |= r.to_gradescope() | {"seed": r.seed, "internal_error": r.internal_error, "similar": r.similar}
        for test, data in zip(r.tests, row["tests"]):
            data["id"] = test.id
        rows.append(row)
    write_atomically(path, json.dumps(rows, indent=2) + "\n")


def student_id(submission: str) -> str:
    """Whose a submission is, from its path: in an nbgrader course, the folder after ``submitted``
    (``submitted/<student id>/<assignment>/<notebook>``); else the folder the notebook is in
    (``submissions/alice/lab01.ipynb`` -> ``alice``); empty for a notebook given without a folder."""
    parts = Path(submission).parts
    if "submitted" in parts[:-1]:
        i = len(parts) - 1 - parts[::-1].index("submitted")
        if i + 1 < len(parts) - 1:
            return parts[i + 1]
    return parts[-2] if len(parts) >= 2 and parts[-2] not in (".", "..") else ""


def write_csv(results: list[SubmissionResult], path: Path) -> None:
    """One row per submission: submission, student id (see `student_id`), lab, one column per test (its
    score), total, max, notes."""
    test_ids: list[str] = []
    for r in results:
        test_ids += [t.id for t in r.tests if t.id not in test_ids]
    f = io.StringIO(newline="")
    writer = csv.writer(f)
    writer.writerow(
        ["submission", "student_id", "lab", *test_ids, "total", "max_score", "similar_to", "notes"]
    )
    for r in results:
        scores = {t.id: t.score for t in r.tests}
        notes = " | ".join(m.splitlines()[0] for m in r.messages if m)
        writer.writerow(
            [
                r.submission,
                student_id(r.submission),
                r.lab,
                *(_num(scores.get(i, 0.0)) for i in test_ids),
                _num(r.score),
                _num(r.max_score),
                "; ".join(f"{m['with']} ({m['score']:.0%})" for m in r.similar),
                notes,
            ]
        )
    write_atomically(path, f.getvalue())


def _num(x: float) -> str:
    return f"{x:g}"


def print_table(results: list[SubmissionResult], out: TextIO, details: bool | None = None) -> None:
    """A summary line per submission; with ``details`` (default: for a single one) every test too."""
    details = len(results) == 1 if details is None else details
    name = {id(r): clean(r.submission) for r in results}
    width = max([len(n) for n in name.values()] + [10])
    print(f"{'submission':<{width}}  lab  {'score':>11}  notes", file=out)
    for r in results:
        note = (
            (r.messages[0].splitlines()[0] if r.messages else "") if not r.graded or r.internal_error else ""
        )
        lab = "?" if r.lab is None else str(r.lab)
        score = f"{_num(r.score)}/{_num(r.max_score)}"
        print(f"{name[id(r)]:<{width}}  {lab:>3}  {score:>11}  {clean(note)[:100]}", file=out)
    if not details:
        return
    for r in results:
        print(file=out)
        for message in r.messages:
            print(clean(message), file=out)
        for t in r.tests:
            mark = "pass" if t.status == "passed" else "FAIL"
            print(f"  {mark}  {_num(t.score):>4}/{_num(t.max_score):<4} {clean(t.name)}", file=out)
            if t.status != "passed" and t.output:
                for line in clean(t.output).splitlines():
                    print(f"              {line}", file=out)
