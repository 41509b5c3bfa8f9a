"""Lab 1's grading: the solution scores full marks, the blank lab zero, planted bugs lose points, and no
tampering earns credit or stops the grader.

Every graded notebook here is made from solutions/ or labs/ by text substitution, so the fixtures
stay in step with the notebooks. All of them are graded in one batch (``jobs=2``) against a copy of
the hidden tests, so nothing here can change the real ``autograder/tests``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from helpers.grading_utils import (
    STUB,
    Batch,
    check_blank_lab_scores_zero,
    check_planted_bug_is_caught,
    check_solution_scores_full_marks,
    prepend,
)
from helpers.grading_utils import cell as _cell
from helpers.grading_utils import sub as _sub

from autograder.grading.results import SubmissionResult, write_csv, write_gradescope, write_json
from autograder.sandbox.limits import Limits

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ROOT / "solutions" / "lab01_tokenizer.ipynb"
LAB = ROOT / "labs" / "lab01_tokenizer.ipynb"
GRADED = ("pair-counts", "merge", "train-merges", "bpe-encode", "tokenizer")
LIMITS = Limits(call_timeout_s=3, load_timeout_s=6, cpu_s=120, memory_mb=512, notebook_s=40)

# ---------------------------------------------------------------------------------------------- fixtures


def _stubs(nb: dict, replacement: str) -> None:
    for grade_id in GRADED:
        _sub(nb, grade_id, STUB, replacement)


PLANTED_BUGS = {
    # name: (cell, old, new, the hidden test that must catch it)
    "merge_off_by_one": (
        "merge",
        "if i + 1 < n and",
        "if i + 2 < n and",
        "test_merge_replaces_every_occurrence_left_to_right",
    ),
    "wrong_tie_break": (
        "train-merges",
        "count == counts[best] and pair < best",
        "count == counts[best] and pair > best",
        "test_train_merges_matches_the_reference_on_small_corpora",
    ),
    "decode_drops_bytes": (
        "tokenizer",
        'decode("utf-8", errors="replace")',
        'decode("utf-8", errors="ignore")',
        "test_decode_replaces_invalid_utf8",
    ),
    "no_regex_split": (
        "tokenizer",
        "chunks.update(split.findall(piece))",
        "chunks.update([piece])",
        "test_train_never_merges_across_regex_chunks",
    ),
    "no_whole_chunk_rule": (
        "tokenizer",
        "if piece in self.ranks:",
        "if False:",
        "test_encode_keeps_a_chunk_that_is_a_token_whole",
    ),
    "train_learns_nothing": (  # no merges at all: no token can span two chunks, and none is learned
        "tokenizer",
        "return cls(merges, pattern, specials)",
        "return cls([], pattern, specials)",
        "test_train_never_merges_across_regex_chunks",
    ),
    "train_learns_no_merges": (
        "tokenizer",
        "return cls(merges, pattern, specials)",
        "return cls([], pattern, specials)",
        "test_train_never_merges_across_regex_chunks",
    ),
    "trains_on_every_occurrence": (
        "train-merges",
        "words = [list(chunk) for chunk in word_counts if len(chunk) > 1]\n"
        "    freqs = [count for chunk, count in word_counts.items() if len(chunk) > 1]",
        "words = [list(chunk) for chunk, count in word_counts.items() if len(chunk) > 1 for _ in range(count)]\n"
        "    freqs = [1] * len(words)",
        "test_training_speed_is_within_budget",
    ),
}

FAKE_RESULTS = """
import json as _json, os as _os, sys as _sys
_fake = {"score": 22, "tests": [{"name": "everything", "score": 22, "max_score": 22, "status": "passed"}]}
print("============================== 16 passed in 0.42s ==============================")
print(_json.dumps(_fake))
print(_json.dumps(_fake), file=_sys.stderr)
for _fd in range(3, 40):  # every pipe the process holds, the grader's included
    _body = _json.dumps({"ok": True, "value": _fake, "id": 1}).encode()
    try:
        _os.write(_fd, len(_body).to_bytes(8, "big") + _body)
    except OSError:
        pass
"""

PATCH_EVERYTHING = """
import builtins, sys
builtins.AssertionError = Exception
sys.modules["pytest"] = None
_worker = sys.modules["__main__"]
if hasattr(_worker, "Worker"):  # the sandbox's own request loop: answer everything with True
    _worker.Worker.call = lambda self, target, args, kwargs: True
    _worker.Worker.origin = lambda self, name: {"defined": True, "own": True, "where": None}
builtins.isinstance = lambda *args: True
"""

ALWAYS_EQUAL = """
class AlwaysEqual:
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    def __hash__(self):
        return 0


class EqualList(list):
    def __eq__(self, other):
        return True
"""


def _tampered(tests_copy: Path) -> dict[str, callable]:
    hidden = tests_copy / "test_lab01.py"
    bpe_path = ROOT / "nanolab" / "text" / "bpe.py"
    tok_path = ROOT / "nanolab" / "text" / "tokenizer.py"

    def exit_at_import(nb):
        prepend(nb, "pair-counts", "import sys\nsys.exit(0)")

    def os_exit_at_import(nb):
        prepend(nb, "pair-counts", "import os\nos._exit(0)")

    def loop_at_import(nb):
        prepend(nb, "pair-counts", "while True:\n    pass")

    def exit_in_call(nb):
        _stubs(nb, "import sys; sys.exit(0)")

    def os_exit_in_call(nb):
        _stubs(nb, "import os; os._exit(3)")

    def sigkill_in_call(nb):
        _stubs(nb, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")

    def kill_grader(nb):
        # Refused where Landlock scopes signals; elsewhere it kills a grading worker, and the grader
        # re-grades the other notebooks that worker held.
        prepend(nb, "pair-counts", "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)")

    def loop_in_call(nb):
        _stubs(nb, "while True: pass")

    def huge_memory(nb):
        for grade_id in ("pair-counts", "merge"):  # grows until the address-space limit
            _sub(nb, grade_id, STUB, "hog = [bytearray(10**8) for _ in range(10**6)]")
        for grade_id in ("train-merges", "bpe-encode", "tokenizer"):  # one terabyte at once
            _sub(nb, grade_id, STUB, "hog = bytearray(1 << 40)")

    def fake_results(nb):
        prepend(nb, "pair-counts", FAKE_RESULTS)
        _stubs(nb, "print('22 passed'); return {'score': 22}")

    def patch_everything(nb):
        prepend(nb, "pair-counts", PATCH_EVERYTHING)

    def always_equal(nb):
        for grade_id in GRADED:
            prepend(nb, grade_id, ALWAYS_EQUAL)
        for grade_id in ("pair-counts", "merge", "bpe-encode"):
            _sub(nb, grade_id, STUB, "return AlwaysEqual()")
        _sub(nb, "train-merges", STUB, "return EqualList()")
        _sub(nb, "tokenizer", STUB, "return EqualList()")

    def write_files(nb):
        prepend(
            nb,
            "pair-counts",
            f"""
for _name in ("results.json", "conftest.py", "pytest.ini"):
    with open(_name, "w") as _f:
        _f.write("{{}}")
for _target in ({str(hidden)!r}, {str(tests_copy / "conftest.py")!r}):
    try:
        with open(_target, "w") as _f:
            _f.write("def test_everything():\\n    pass\\n")
    except OSError as _e:
        print("refused:", _e)
""",
        )

    def read_tests(nb):
        prepend(nb, "pair-counts", f"HIDDEN = open({str(hidden)!r}).read()")
        _stubs(nb, "return HIDDEN.count('assert')")

    def reexport_reference(nb):
        for grade_id, name in zip(GRADED[:4], ("pair_counts", "merge", "train_merges", "bpe_encode")):
            _cell(nb, grade_id)["source"] = f"from nanolab.text.bpe import {name}\n"
        _cell(nb, "tokenizer")["source"] = "from nanolab.text.tokenizer import Tokenizer\n"

    def subclass_reference(nb):
        _cell(nb, "tokenizer")["source"] = (
            "import nanolab.text.tokenizer\n\n\nclass Tokenizer(nanolab.text.tokenizer.Tokenizer):\n    pass\n"
        )
        _cell(nb, "merge")["source"] = (
            "import nanolab.text.bpe as _bpe\n\n\ndef merge(ids, pair, new_id):\n    return _bpe.merge(ids, pair, new_id)\n"
        )

    def reference_by_path(nb):
        # Loads the reference's files directly, around the import blocker; the grader still sees
        # that the graded objects were not defined in the notebook.
        _cell(nb, "pair-counts")["source"] = f"""
import importlib.util, sys
_spec = importlib.util.spec_from_file_location("my_bpe", {str(bpe_path)!r})
_bpe = importlib.util.module_from_spec(_spec)
sys.modules["my_bpe"] = _bpe
_spec.loader.exec_module(_bpe)
pair_counts, merge, train_merges, bpe_encode = _bpe.pair_counts, _bpe.merge, _bpe.train_merges, _bpe.bpe_encode
"""
        _cell(nb, "tokenizer")["source"] = f"""
_source = open({str(tok_path)!r}).read().replace("from nanolab.text.bpe import", "from my_bpe import")
_namespace = {{"__name__": "__main__"}}
exec(compile(_source, "copied.py", "exec"), _namespace)
Tokenizer = _namespace["Tokenizer"]
"""

    return {f.__name__: f for f in locals().values() if callable(f) and not f.__name__.startswith("_")}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """Grade every fixture notebook in one batch; returns (results by name, tests copy, digests before)."""
    base = tmp_path_factory.mktemp("grading")
    fixtures = Batch(base)
    tests_copy, notebooks, save = fixtures.tests_copy, fixtures.notebooks, fixtures.save
    fixtures.add_standard(SOLUTION, LAB, PLANTED_BUGS, _tampered(tests_copy))
    (base / "not_json.ipynb").write_text("this is not a notebook {")
    notebooks["not_json"] = base / "not_json.ipynb"
    nb = json.loads(SOLUTION.read_text())
    nb["metadata"]["nanolab"]["lab"] = 99
    save("unknown_lab", nb)
    nb = json.loads(SOLUTION.read_text())
    nb["cells"] = [c for c in nb["cells"] if c.get("id") != "merge"]
    save("missing_cell", nb)
    notebooks["no_such_file"] = base / "no_such_file.ipynb"

    before = {name: _digest(path) for name, path in notebooks.items() if path.exists()}
    hidden_before = {p.name: _digest(p) for p in tests_copy.glob("*.py")}
    results = fixtures.grade(LIMITS)
    return {
        "results": results,
        "notebooks": notebooks,
        "before": before,
        "tests_copy": tests_copy,
        "hidden_before": hidden_before,
        "base": base,
    }


# ---------------------------------------------------------------------------------------------- verdicts


def test_solution_scores_full_marks(batch):
    check_solution_scores_full_marks(batch["results"], lab=1)


def test_blank_lab_scores_zero(batch):
    check_blank_lab_scores_zero(batch["results"])


@pytest.mark.parametrize("name", sorted(PLANTED_BUGS))
def test_planted_bug_loses_points_in_the_test_that_targets_it(batch, name):
    check_planted_bug_is_caught(batch["results"], PLANTED_BUGS, name)


@pytest.mark.parametrize("name", sorted(_tampered(Path("/nonexistent"))))
def test_tampering_earns_no_more_than_the_blank_lab(batch, name):
    result = batch["results"][f"tamper_{name}"]
    blank = batch["results"]["blank"]
    assert result.score <= blank.score
    assert [t.id for t in result.tests] == [t.id for t in blank.tests], (
        "every hidden test must still be reported"
    )
    assert all(t.status == "failed" and t.output for t in result.tests)


def test_reexporting_the_reference_is_named_in_the_feedback(batch):
    for name in ("tamper_reexport_reference", "tamper_subclass_reference", "tamper_reference_by_path"):
        outputs = " ".join(t.output for t in batch["results"][name].tests)
        assert (
            "cannot be imported while this lab is graded" in outputs or "is not your own code" in outputs
        ), name


def test_timeouts_and_crashes_are_named_in_the_feedback(batch):
    results = batch["results"]
    assert any("time limit" in t.output for t in results["tamper_loop_in_call"].tests)
    assert any("died" in t.output and "SIGKILL" in t.output for t in results["tamper_sigkill_in_call"].tests)
    assert any("exit code 3" in t.output for t in results["tamper_os_exit_in_call"].tests)
    assert all("could not be loaded" in t.output for t in results["tamper_os_exit_at_import"].tests)
    assert all("could not be loaded" in t.output for t in results["tamper_loop_at_import"].tests)
    assert any("MemoryError" in t.output for t in results["tamper_huge_memory"].tests)


@pytest.mark.parametrize(
    ("name", "phrase"),
    [
        ("not_json", "not valid JSON"),
        ("unknown_lab", "there is no lab 99"),
        ("missing_cell", "missing the cells 'merge'"),
        ("no_such_file", "does not exist"),
    ],
)
def test_ungradable_notebooks_get_zero_and_a_clear_message(batch, name, phrase):
    result = batch["results"][name]
    assert not result.graded and result.score == 0 and result.internal_error is None
    assert phrase in " ".join(result.messages)


def test_missing_cell_still_lists_the_tests_it_failed(batch):
    result = batch["results"]["missing_cell"]
    assert len(result.tests) == len(batch["results"]["solution"].tests)
    assert all("missing the cells" in t.output for t in result.tests)


def test_grading_changes_neither_submissions_nor_hidden_tests(batch):
    for name, digest in batch["before"].items():
        assert _digest(batch["notebooks"][name]) == digest, f"{name} was modified by grading"
    after = {p.name: _digest(p) for p in batch["tests_copy"].glob("*.py")}
    assert after == batch["hidden_before"]
    assert not (ROOT / "results.json").exists() and not (Path.cwd() / "results.json").exists()


def test_every_result_makes_a_valid_gradescope_file(batch, tmp_path):
    results = list(batch["results"].values())
    written = write_gradescope(results, tmp_path / "gradescope")
    assert len(written) == len(results)
    for path in written:
        data = json.loads(path.read_text())
        assert isinstance(data["score"], (int, float)) and isinstance(data["execution_time"], (int, float))
        for test in data["tests"]:
            assert set(test) >= {"name", "score", "max_score", "status", "output", "visibility"}
            assert test["status"] in ("passed", "failed")
            assert 0 <= test["score"] <= test["max_score"]


def test_json_and_csv_have_one_entry_per_submission(batch, tmp_path):
    results = [batch["results"][n] for n in ("solution", "blank", "not_json")]
    write_json(results, tmp_path / "r.json")
    write_csv(results, tmp_path / "r.csv")
    data = json.loads((tmp_path / "r.json").read_text())
    assert [d["score"] for d in data] == [r.score for r in results]
    lines = (tmp_path / "r.csv").read_text().splitlines()
    header = lines[0].split(",")
    assert header[:3] == ["submission", "student_id", "lab"] and header[-4:] == [
        "total",
        "max_score",
        "similar_to",
        "notes",
    ]
    assert len(header) == 3 + len(results[0].tests) + 4 and len(lines) == 4
    assert SubmissionResult.from_dict(results[0].to_dict()).score == results[0].score
