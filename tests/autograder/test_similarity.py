"""The similarity report: renaming, re-indenting and rewording comments hide nothing; different code is not
flagged; the lab's blank code is not a match; a copy of the reference or of a classmate is reported in the
CSV and the JSON, and the scores do not change."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

from helpers.grading_utils import grade_command

from autograder.grading import similarity
from autograder.grading.similarity import compare, fingerprints, graded_code_of, normalized_tokens, overlap

ROOT = Path(__file__).resolve().parents[2]

ORIGINAL = '''
def merge_counts(pairs, limit=10):
    """Count each pair."""
    counts = {}
    for a, b in pairs:  # every pair
        key = (a, b)
        counts[key] = counts.get(key, 0) + 1
        if len(counts) > limit:
            break
    best = max(counts, key=counts.get)
    return best, counts[best]
'''
DISGUISED = """
def tally(items, cap=99):
    # no docstring here, other names, other numbers, other layout
    seen = {}
    for left, right in items:
        k = (left, right)
        seen[k] = seen.get(k, 7) + 3
        if len(seen) > cap: break
    top = max(seen, key=seen.get)
    return top, seen[top]
"""


def test_renaming_comments_docstrings_and_layout_change_nothing() -> None:
    assert normalized_tokens(ORIGINAL) == normalized_tokens(
        DISGUISED.replace("if len(seen) > cap: break", "if len(seen) > cap:\n            break")
    )
    assert fingerprints(ORIGINAL) == fingerprints(DISGUISED.replace(": break", ":\n            break"))


def test_different_code_of_the_same_size_does_not_match() -> None:
    a = (ROOT / "nanolab" / "serving" / "metrics.py").read_text()
    b = (ROOT / "nanolab" / "serving" / "chat_protocol.py").read_text()
    fa, fb = fingerprints(a), fingerprints(b)
    assert len(fa) > 100 and len(fb) > 100
    assert overlap(fa, fb) < 0.2 and overlap(fb, fa) < 0.2


def rename(code: str) -> str:
    """A classmate's copy: every name of four letters or more given a suffix, comments reworded."""
    code = re.sub(r"#.*", "# mine", code)
    return re.sub(
        r"\b([a-z_][a-z0-9_]{3,})\b",
        lambda m: (
            m.group(1)
            if m.group(1)
            in {
                "self",
                "None",
                "True",
                "False",
                "return",
                "range",
                "isinstance",
                "raise",
                "while",
                "break",
                "continue",
                "lambda",
                "yield",
                "class",
                "assert",
                "import",
                "from",
                "global",
                "with",
                "elif",
                "else",
                "pass",
                "float",
                "list",
                "dict",
                "tuple",
                "sorted",
                "len",
                "sum",
                "max",
                "min",
                "enumerate",
                "zip",
                "bytes",
                "bytearray",
            }
            else m.group(1) + "_x"
        ),
        code,
    )


def test_a_copy_is_matched_and_the_blank_lab_is_not() -> None:
    solution = "\n".join(graded_code_of(ROOT / "solutions" / "lab01_tokenizer.ipynb"))
    blank = "\n".join(graded_code_of(ROOT / "labs" / "lab01_tokenizer.ipynb"))
    unrelated = (ROOT / "nanolab" / "serving" / "openai_protocol.py").read_text()
    batch = [("alice", solution), ("bob", rename(solution)), ("carol", blank), ("dan", unrelated)]
    found = {(m.submission, m.other) for m in compare(batch, template=blank, reference=solution)}
    assert {("alice", "bob"), ("bob", "alice"), ("alice", "reference"), ("bob", "reference")} <= found
    assert not [pair for pair in found if "carol" in pair or "dan" in pair], found


def test_the_cli_reports_matches_in_the_csv_and_json_without_changing_scores(tmp_path: Path) -> None:
    nb = json.loads((ROOT / "solutions" / "lab01_tokenizer.ipynb").read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code" and cell["metadata"].get("nbgrader", {}).get("solution"):
            cell["source"] = rename("".join(cell["source"]))
    for name in ("alice", "bob", "carol"):
        (tmp_path / name).mkdir()
    (tmp_path / "alice" / "lab01_tokenizer.ipynb").write_text(
        (ROOT / "solutions" / "lab01_tokenizer.ipynb").read_text()
    )
    (tmp_path / "bob" / "lab01_tokenizer.ipynb").write_text(json.dumps(nb))
    (tmp_path / "carol" / "lab01_tokenizer.ipynb").write_text(
        (ROOT / "labs" / "lab01_tokenizer.ipynb").read_text()
    )
    paths = [str(tmp_path / n / "lab01_tokenizer.ipynb") for n in ("alice", "bob", "carol")]
    outputs = ["--csv", str(tmp_path / "g.csv"), "--json", str(tmp_path / "g.json")]
    done = grade_command(*paths, "--jobs", "2", "--similarity", *outputs)
    with open(tmp_path / "g.csv", newline="") as f:
        rows = {r["student_id"]: r for r in csv.DictReader(f)}
    assert "bob" in rows["alice"]["similar_to"] and similarity.REFERENCE in rows["alice"]["similar_to"]
    assert "alice" in rows["bob"]["similar_to"]
    assert rows["carol"]["similar_to"] == ""
    assert float(rows["alice"]["total"]) == float(rows["alice"]["max_score"]) > 0  # the score is untouched
    graded = {Path(r["submission"]).parent.name: r for r in json.loads((tmp_path / "g.json").read_text())}
    assert {m["with"] for m in graded["bob"]["similar"]} >= {paths[0], similarity.REFERENCE}
    assert "similar:" in done.stdout
