"""The grader itself: solutions score full marks, blank labs zero, planted bugs lose points, and no
tampering earns credit or stops the grader.

Every graded notebook here is made from solutions/ or labs/ by text substitution, so the fixtures
stay in step with the notebooks. All of them are graded in one batch (``jobs=2``) against a copy of
the hidden tests, so nothing here can change the real ``autograder/tests``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from grading_utils import (
    STUB,
    Batch,
    check_blank_lab_scores_zero,
    check_planted_bug_is_caught,
    check_solution_scores_full_marks,
)
from grading_utils import cell as _cell
from grading_utils import edit as _edit
from grading_utils import sub as _sub
from hypothesis import given, settings
from hypothesis import strategies as st

from autograder.grading.grade import DEFAULT_TESTS_DIR, GradeOptions, grade
from autograder.grading.results import SubmissionResult, write_csv, write_gradescope, write_json
from autograder.sandbox.limits import Limits
from autograder.sandbox.process import Sandbox
from autograder.sandbox.remote import Remote, RemoteError, SandboxFailure
from autograder.sandbox.runtime import codec
from autograder.submission.notebook import SubmissionError, read_submission

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab01_tokenizer.ipynb"
LAB = ROOT / "labs" / "lab01_tokenizer.ipynb"
GRADED = ("pair-counts", "merge", "train-merges", "bpe-encode", "tokenizer")
LIMITS = Limits(call_timeout_s=3, load_timeout_s=6, cpu_s=120, memory_mb=512, notebook_s=40)

# ---------------------------------------------------------------------------------------------- fixtures


def _prepend(nb: dict, grade_id: str, code: str) -> None:
    _edit(nb, grade_id, lambda src: code + "\n" + src)


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
        _prepend(nb, "pair-counts", "import sys\nsys.exit(0)")

    def os_exit_at_import(nb):
        _prepend(nb, "pair-counts", "import os\nos._exit(0)")

    def loop_at_import(nb):
        _prepend(nb, "pair-counts", "while True:\n    pass")

    def exit_in_call(nb):
        _stubs(nb, "import sys; sys.exit(0)")

    def os_exit_in_call(nb):
        _stubs(nb, "import os; os._exit(3)")

    def sigkill_in_call(nb):
        _stubs(nb, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")

    def kill_grader(nb):
        # Refused where Landlock scopes signals; elsewhere it kills a grading worker, and the grader
        # re-grades the other notebooks that worker held.
        _prepend(nb, "pair-counts", "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)")

    def loop_in_call(nb):
        _stubs(nb, "while True: pass")

    def huge_memory(nb):
        for grade_id in ("pair-counts", "merge"):  # grows until the address-space limit
            _sub(nb, grade_id, STUB, "hog = [bytearray(10**8) for _ in range(10**6)]")
        for grade_id in ("train-merges", "bpe-encode", "tokenizer"):  # one terabyte at once
            _sub(nb, grade_id, STUB, "hog = bytearray(1 << 40)")

    def fake_results(nb):
        _prepend(nb, "pair-counts", FAKE_RESULTS)
        _stubs(nb, "print('22 passed'); return {'score': 22}")

    def patch_everything(nb):
        _prepend(nb, "pair-counts", PATCH_EVERYTHING)

    def always_equal(nb):
        for grade_id in GRADED:
            _prepend(nb, grade_id, ALWAYS_EQUAL)
        for grade_id in ("pair-counts", "merge", "bpe-encode"):
            _sub(nb, grade_id, STUB, "return AlwaysEqual()")
        _sub(nb, "train-merges", STUB, "return EqualList()")
        _sub(nb, "tokenizer", STUB, "return EqualList()")

    def write_files(nb):
        _prepend(
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
        _prepend(nb, "pair-counts", f"HIDDEN = open({str(hidden)!r}).read()")
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
    assert header[0] == "submission" and "total" in header
    assert len(header) == 2 + len(results[0].tests) + 3 and len(lines) == 4
    assert SubmissionResult.from_dict(results[0].to_dict()).score == results[0].score


# ---------------------------------------------------------------------------------------------- without Landlock


def test_without_landlock_overwritten_tests_are_restored_and_void_the_grade(tmp_path):
    """With no bubblewrap and write confinement off, a submission can overwrite the hidden tests; the
    grader restores them from its in-memory copy and gives that submission no credit."""
    tests_copy = tmp_path / "hidden"
    shutil.copytree(DEFAULT_TESTS_DIR, tests_copy, ignore=shutil.ignore_patterns("__pycache__"))
    original = (tests_copy / "test_lab01.py").read_bytes()
    nb = json.loads(SOLUTION.read_text())
    _prepend(
        nb,
        "pair-counts",
        f"open({str(tests_copy / 'test_lab01.py')!r}, 'w').write('def test_x():\\n    pass\\n')",
    )
    path = tmp_path / "overwrite.ipynb"
    path.write_text(json.dumps(nb))
    limits = Limits(**{**LIMITS.__dict__, "confine_writes": False, "isolate": False})
    [result] = grade([path], GradeOptions(tests_dir=tests_copy, limits=limits), progress=False)
    assert (tests_copy / "test_lab01.py").read_bytes() == original
    assert result.score == 0 and "restored" in " ".join(result.messages)


def test_a_notebook_that_kills_its_grading_worker_spoils_only_its_own_result(tmp_path):
    """Without bubblewrap and Landlock nothing stops a submission from killing the worker that grades
    it; that notebook gets an internal error, and its neighbour (in a worker of its own) its full score."""
    killer = json.loads(LAB.read_text())
    _prepend(killer, "pair-counts", "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)")
    paths = [tmp_path / "killer.ipynb", tmp_path / "solution.ipynb"]
    paths[0].write_text(json.dumps(killer))
    shutil.copy(SOLUTION, paths[1])
    limits = Limits(**{**LIMITS.__dict__, "confine_writes": False, "isolate": False})
    killed, solution = grade(paths, GradeOptions(limits=limits), jobs=2, progress=False)
    assert killed.score == 0 and killed.internal_error and "died" in killed.internal_error
    assert solution.score == solution.max_score > 0


# ---------------------------------------------------------------------------------------------- notebook reading


def test_wrong_lab_is_refused_with_the_lab_numbers(tmp_path):
    nb = json.loads(SOLUTION.read_text())
    nb["metadata"]["nanolab"]["lab"] = 2
    path = tmp_path / "lab02_x.ipynb"
    path.write_text(json.dumps(nb))
    with pytest.raises(SubmissionError, match="is a lab 2 notebook, but lab 1 is being graded"):
        read_submission(path, lab=1)


def test_lab_is_detected_from_metadata_and_magics_are_removed(tmp_path):
    nb = json.loads(SOLUTION.read_text())
    _prepend(nb, "merge", "%time x = 1\n!ls")
    path = tmp_path / "renamed.ipynb"
    path.write_text(json.dumps(nb))
    submission = read_submission(path)
    assert submission.spec.number == 1
    merge_source = next(c["source"] for c in submission.cells if c["id"] == "merge")
    assert "%time" not in merge_source and "!ls" not in merge_source
    assert [c["id"] for c in submission.cells] == ["setup", *GRADED]


# ---------------------------------------------------------------------------------------------- sandbox and codec


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        -(2**70),
        1.5,
        float("inf"),
        "héllo 👋",
        b"\x00\xff",
        [1, [2, (3, b"x")]],
        {(1, 2): 3, "a": {4}},
        frozenset({1, 2}),
    ],
)
def test_codec_round_trips_plain_data(value):
    back = codec.decode(codec.loads(codec.dumps({"v": codec.encode(value)})[8:])["v"])
    assert back == value and type(back) is (set if isinstance(value, frozenset) else type(value))


def _same(a, b) -> bool:
    """Equal, and of exactly the same types all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(v, b[k]) for k, v in a.items())
    return a == b


_keys = st.none() | st.booleans() | st.integers() | st.text(max_size=5) | st.binary(max_size=5)
_plain = st.recursive(
    _keys | st.floats(allow_nan=False),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(_keys | st.tuples(_keys, _keys), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(_plain)
def test_codec_round_trips_nested_plain_data_exactly(value):
    """decode(encode(v)) is v again, with the same types at every level (a tuple stays a tuple)."""
    assert _same(codec.decode(codec.loads(codec.dumps({"v": codec.encode(value)})[8:])["v"]), value)


def test_codec_sends_a_subclass_of_a_plain_type_as_its_value():
    """An enum member that is a str, int or float crosses as its value, whatever its __str__ says
    (Python 3.11's str() of a str-valued enum member is "Status.RUNNING", not "running")."""
    import enum

    class Status(str, enum.Enum):
        RUNNING = "running"

    class Level(enum.IntEnum):
        HIGH = 3

    class Loud(str):
        def __str__(self):
            return "something else"

    sent = codec.encode([Status.RUNNING, Level.HIGH, Loud("quiet"), 2.5])
    assert sent == ["running", 3, "quiet", 2.5]
    assert [type(v) for v in sent] == [str, int, str, float]


def test_codec_round_trips_arrays_and_refuses_object_arrays():
    np = pytest.importorskip("numpy")
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    back = codec.decode(codec.encode(array))
    assert back.dtype == np.float32 and back.shape == (3, 4) and (back == array).all()
    with pytest.raises(codec.CodecError):
        codec.decode({"$nd": ["|O", [1], "AAAAAAAAAAA="]})
    with pytest.raises(codec.CodecError):
        codec.decode({"$nd": ["<f4", [3], "AAAA"]})  # data shorter than the shape says


@pytest.mark.parametrize(
    "data",
    [{"$x": 1}, {"$t": "notalist"}, {"$b": "!!"}, {"$d": [[[1], 2]]}, {"$h": 1}, {}, {"$f": "1e9"}],
)
def test_codec_refuses_malformed_data(data):
    with pytest.raises(codec.CodecError):
        codec.decode(data)


def test_sandbox_proxies_objects_and_survives_misbehaving_code():
    source = """
import os, sys
class Box:
    def __init__(self, n):
        self.n = n
    def items(self, k):
        return [self.n] * k
class Liar:
    def __eq__(self, other):
        return True
def liar():
    return Liar()
def leave():
    sys.exit(0)
def die():
    os._exit(7)
def spin():
    while True:
        pass
def write_outside():
    open(os.path.expanduser("~/../escaped.txt"), "w").write("x")
"""
    with Sandbox(
        [{"id": "c", "source": source}], {"c": ["Box"]}, Limits(call_timeout_s=2, load_timeout_s=10)
    ) as sb:
        report = sb.start()
        assert report["cells"] == [{"id": "c", "error": None}]
        box = sb.get(None, "Box")(3)
        assert isinstance(box, Remote) and box.items(2) == [3, 3] and box.n == 3
        liar = sb.get(None, "liar")()
        assert isinstance(liar, Remote) and liar != 1 and not (liar == 1)
        with pytest.raises(TypeError):
            bool(liar)
        with pytest.raises(RemoteError, match="SystemExit"):
            sb.get(None, "leave")()
        assert sb.alive
        with pytest.raises(SandboxFailure, match="exit code 7"):
            sb.get(None, "die")()
        assert not sb.alive
        sb.start()
        with pytest.raises(SandboxFailure, match="restarted"):
            box.items(1)
        with pytest.raises(SandboxFailure, match="time limit"):
            sb.get(None, "spin")()
        if sys.platform.startswith("linux"):
            sb.start()
            if sb.confined:
                with pytest.raises(RemoteError, match="PermissionError"):
                    sb.get(None, "write_outside")()


def test_sandbox_holds_data_for_the_submission_and_reads_back_what_it_did():
    """A held object reaches the submission's code as itself (not a copy), so a test can see whether a
    call changed its input; plain arguments are copied, and the grader's own value never changes."""
    source = """
def pop_last(items):
    return items.pop()

def bump(table):
    table["n"] += 1
"""
    with Sandbox(
        [{"id": "c", "source": source}], {"c": []}, Limits(call_timeout_s=5, load_timeout_s=10)
    ) as sb:
        sb.start()
        mine = [1, 2, 3]
        held = sb.hold(mine)
        assert isinstance(held, Remote)
        assert sb.get(None, "pop_last")(held) == 3
        assert sb.value(held) == [1, 2] and mine == [1, 2, 3]
        assert sb.get(None, "pop_last")(mine) == 3 and mine == [1, 2, 3]  # an argument is a copy
        table = sb.hold({"n": 1})
        sb.get(None, "bump")(table)
        assert sb.value(table) == {"n": 2}


def test_cli_grades_and_writes_every_format(tmp_path):
    bad = tmp_path / "bad.ipynb"
    bad.write_text("{}")
    out = subprocess.run(
        [sys.executable, "-m", "nanolab.cli", "grade", str(LAB), str(bad), "--jobs", "2", "--timeout", "10"]
        + ["--json", str(tmp_path / "g.json"), "--csv", str(tmp_path / "g.csv")]
        + ["--gradescope", str(tmp_path / "gs")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert (
        re.search(r"lab01_tokenizer.ipynb +1 +0/\d+", out.stdout) and "not a Jupyter notebook" in out.stdout
    )
    assert len(json.loads((tmp_path / "g.json").read_text())) == 2
    assert len(list((tmp_path / "gs").glob("*.json"))) == 2
    assert len((tmp_path / "g.csv").read_text().splitlines()) == 3
