"""The grader's machinery, seen through Lab 1's notebooks: a grading worker that dies or finds its tests
overwritten, reading notebooks, the codec, the sandbox's proxies and the `nanolab grade` command."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.grading_utils import prepend
from hypothesis import given, settings
from hypothesis import strategies as st

from autograder.grading.grade import DEFAULT_TESTS_DIR, GradeOptions, grade
from autograder.sandbox.limits import Limits
from autograder.sandbox.process import Sandbox
from autograder.sandbox.remote import Later, Remote, RemoteError, SandboxFailure, identity
from autograder.sandbox.runtime import codec
from autograder.submission.notebook import SubmissionError, read_submission
from autograder.testing import Calls

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ROOT / "solutions" / "lab01_tokenizer.ipynb"
LAB = ROOT / "labs" / "lab01_tokenizer.ipynb"
GRADED = ("pair-counts", "merge", "train-merges", "bpe-encode", "tokenizer")
LIMITS = Limits(call_timeout_s=3, load_timeout_s=6, cpu_s=120, memory_mb=512, notebook_s=40)


# ---------------------------------------------------------------------------------------------- without Landlock


def test_without_landlock_overwritten_tests_are_restored_and_void_the_grade(tmp_path):
    """With no bubblewrap and write confinement off, a submission can overwrite the hidden tests; the
    grader restores them from its in-memory copy and gives that submission no credit."""
    tests_copy = tmp_path / "hidden"
    shutil.copytree(DEFAULT_TESTS_DIR, tests_copy, ignore=shutil.ignore_patterns("__pycache__"))
    original = (tests_copy / "test_lab01.py").read_bytes()
    nb = json.loads(SOLUTION.read_text())
    prepend(
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
    prepend(killer, "pair-counts", "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)")
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
    prepend(nb, "merge", "%time x = 1\n!ls")
    path = tmp_path / "renamed.ipynb"
    path.write_text(json.dumps(nb))
    submission = read_submission(path)
    assert submission.spec.number == 1
    merge_source = next(c["source"] for c in submission.cells if c["id"] == "merge")
    assert "%time" not in merge_source and "!ls" not in merge_source
    assert [c["id"] for c in submission.cells] == ["setup", *GRADED]


def test_the_grader_runs_the_labs_own_setup_code_and_notes_an_edited_setup_cell(tmp_path):
    """A setup cell is locked by convention only: an edited one (here a helper that lies) is replaced by the
    lab's own setup code, ``labkit/lab01.py``, and the submission is graded with a note saying so."""
    own = (ROOT / "labkit" / "lab01.py").read_text().rstrip("\n")
    nb = json.loads(SOLUTION.read_text())
    path = tmp_path / "lab01_tokenizer.ipynb"
    path.write_text(json.dumps(nb))
    untouched = read_submission(path)
    assert untouched.cells[0] == {"id": "setup", "source": own, "setup": True} and not untouched.warnings
    assert not any(c["setup"] for c in untouched.cells[1:])

    prepend(nb, "setup", "def split_at_specials(text, specials):\n    return [text]\n")
    path.write_text(json.dumps(nb))
    edited = read_submission(path)
    assert edited.cells == untouched.cells
    assert len(edited.warnings) == 1 and "differs from the lab's own setup code" in edited.warnings[0]


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


def test_a_batch_of_calls_runs_in_order_in_one_round_trip_and_reports_each_failure():
    source = """
class Stack:
    def __init__(self):
        self.items = []
    def push(self, x):
        self.items.append(x)
        return len(self.items)
    def pop(self):
        return self.items.pop()
"""
    with Sandbox(
        [{"id": "c", "source": source}], {"c": ["Stack"]}, Limits(call_timeout_s=5, load_timeout_s=10)
    ) as sb:
        sb.start()
        calls = Calls()
        stack = calls.call(sb.get(None, "Stack"), keep=False)
        push = calls.get(stack, "push", keep=False)
        for i in range(3):
            calls.call(push, [i, {"k": (i,)}])
        calls.call(calls.get(stack, "pop", keep=False))
        calls.set(stack, "items", [])
        calls.call(calls.get(stack, "pop", keep=False))  # raises: the next steps still run
        calls.call(calls.get(stack, "nothing"))  # raises, and the next step uses its result
        calls.call(push, "last")
        calls.get(stack, "items")
        calls.get(stack, "push")  # a method comes back as a handle
        before = sb._next_id
        got = sb.batch(calls.steps, calls.keep)
        assert sb._next_id == before + 1, "one message for the whole batch"
        assert len(got) == len(calls.keep) == 10
        assert got[:4] == [1, 2, 3, [2, {"k": (2,)}]]
        assert isinstance(got[4], RemoteError) and got[4].type_name == "IndexError"
        assert isinstance(got[5], RemoteError) and got[5].type_name == "AttributeError"
        assert isinstance(got[6], RemoteError) and got[6].type_name == "AttributeError"  # the step it used
        assert got[7] == 1 and got[8] == ["last"] and isinstance(got[9], Remote)
        assert identity(got[9]) != identity(sb.get(None, "Stack"))
        assert identity(sb.ref(sb.get(None, "Stack"), "__init__")) == identity(
            sb.ref(sb.get(None, "Stack"), "__init__")
        )
        [missing] = sb.batch([("call", Later(5), [], {})], [0])  # a step that does not exist
        assert isinstance(missing, RemoteError) and "unknown object handle" in missing.message


def test_a_graded_cell_that_binds_a_setup_name_again_changes_neither_the_setup_nor_what_the_grader_gets():
    """The setup code's functions keep their own globals, and the grader asking for a setup name gets the
    setup's object; the graded cells still see their own bindings, as in the notebook."""
    setup = "def truth():\n    return 1\n\ndef helper():\n    return truth()\n"
    graded = """
def truth():
    return 2

def helper():
    return 99

def Graded():
    return helper(), truth()
"""
    cells = [{"id": "setup", "source": setup, "setup": True}, {"id": "g", "source": graded, "setup": False}]
    with Sandbox(cells, {"g": ["Graded"]}, Limits(call_timeout_s=5, load_timeout_s=10)) as sb:
        sb.start()
        assert sb.get(None, "helper")() == 1  # the setup's helper, calling the setup's truth
        assert sb.get(None, "truth")() == 1
        assert sb.get(None, "Graded")() == (99, 2)


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
