"""The grader's own defences against what comes out of a sandbox, each tested on its own: bounded
decoding, feedback safe to print, the origin of graded names decided from the notebook's text,
removal that never follows a symlink, and results files written whole or not at all.

None of these needs bubblewrap: they hold wherever the grader runs.
"""

from __future__ import annotations

import doctest
import fcntl
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autograder.grading import feedback
from autograder.grading.results import SubmissionResult, TestResult, write_json
from autograder.sandbox.cleanup import remove_tree
from autograder.sandbox.limits import Limits
from autograder.sandbox.process import Sandbox
from autograder.sandbox.remote import SandboxFailure
from autograder.sandbox.runtime import codec
from autograder.submission import origin

ROOT = Path(__file__).resolve().parents[2]
P61 = 2**61 - 1  # ints that are multiples of it all have the hash 0


# ---------------------------------------------------------------------------------------------- decoding


def test_keys_that_share_a_hash_are_refused_before_they_cost_quadratic_time():
    """A dict of 100,000 int keys with one hash (``k * (2**61 - 1)``) would take minutes to build."""
    data = {"$d": [[k * P61, 1] for k in range(1, 100_001)]}
    start = time.monotonic()
    with pytest.raises(codec.CodecError, match="share one hash"):
        codec.decode(data)
    assert time.monotonic() - start < 2
    with pytest.raises(codec.CodecError, match="share one hash"):
        codec.decode({"$s": [{"$t": [k * P61, 0]} for k in range(1, 100)]})  # tuples of them too
    ordinary = {"$d": [[k, k] for k in range(50_000)]}
    assert len(codec.decode(ordinary)) == 50_000


@pytest.mark.parametrize(
    ("data", "phrase"),
    [
        ([0] * (codec.MAX_ITEMS + 1), "at most"),
        ({"$d": [[k, 0] for k in range(codec.MAX_KEYS + 1)]}, "at most"),
        ({"$s": list(range(codec.MAX_KEYS + 1))}, "at most"),
    ],
    ids=["values", "dict entries", "set members"],
)
def test_messages_are_bounded_in_values_and_entries(data, phrase):
    with pytest.raises(codec.CodecError, match=phrase):
        codec.decode(data)


def test_decoding_stops_at_its_deadline():
    with pytest.raises(codec.CodecError, match="too long"):
        codec.decode(list(range(100_000)), deadline=time.monotonic() - 1)
    assert codec.decode(list(range(10)), deadline=time.monotonic() + 10) == list(range(10))


def test_a_reply_too_big_to_decode_fails_the_call_and_the_sandbox_goes_on():
    """A reply over `MAX_REPLY_BYTES` is refused unread (the grader never holds it whole), the call
    fails, and a fresh sandbox answers the next call."""
    source = "def huge():\n    return list(range(3_000_000))\n\ndef small():\n    return 7\n"
    limits = Limits(call_timeout_s=20, load_timeout_s=30, memory_mb=1024)
    with Sandbox([{"id": "c", "source": source}], {"c": []}, limits) as sb:
        sb.start()
        with pytest.raises(SandboxFailure, match="larger than"):
            sb.get(None, "huge")()
        sb.start()
        assert sb.get(None, "small")() == 7


# ---------------------------------------------------------------------------------------------- feedback


def test_feedback_examples_run():
    for module in (feedback, origin):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


@pytest.mark.parametrize(
    "spoof",
    [
        "\x1b[2K\r\x1b[1Asolution.ipynb    1   22/22",  # erase the line, go up, print a fake score
        "\x1b]0;title\x07\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\",  # OSC title and hyperlink
        "\x1bP+q544e\x1b\\\x9b31m\x07\x08\x0c\x7f",  # DCS, an 8-bit CSI, bell, backspace, form feed, DEL
        "a\u202eb\u2066c\u200f",  # bidirectional overrides and marks
    ],
)
def test_clean_leaves_nothing_that_drives_a_terminal(spoof):
    out = feedback.clean("before " + spoof + " after\n\tline two")
    assert not any(ord(c) < 0x20 and c not in "\n\t" or 0x7F <= ord(c) <= 0x9F for c in out), repr(out)
    assert not any(c in out for c in "\u202e\u2066\u200f")
    assert out.startswith("before ") and out.endswith(" after\n\tline two")


def test_redactor_removes_quoted_grader_lines_and_keeps_the_learners_own():
    hidden = "def test_x(lab, rng):\n    assert lab.secret_function_name(12345) == 67890, 'msg'\n"
    learner = "    total = counts.get(pair, 0) + frequency_of_the_chunk\n"
    redact = feedback.Redactor([hidden + learner], [learner])
    quoted = "ValueError: assert lab.secret_function_name(12345) == 67890, 'msg'"
    escaped = "ValueError: " + repr(hidden)  # the whole file as one escaped line
    assert redact(quoted) == feedback.REDACTED
    assert redact(escaped) == feedback.REDACTED
    assert redact("line 3, in merge\n" + learner) == "line 3, in merge\n" + learner
    assert redact("ValueError: bad pair (1, 2)") == "ValueError: bad pair (1, 2)"


def test_the_grader_knows_its_secret_sources():
    """The solutions and the reference are read (from this checkout), so their lines can be removed."""
    secret, public = feedback.grader_sources()
    assert any("BEGIN SOLUTION" in text for text in secret) and any("def train_merges" in t for t in secret)
    assert public and not any("BEGIN SOLUTION" in text for text in public)


# ---------------------------------------------------------------------------------------------- origin

_DEF = "def merge(ids, pair, new_id):\n    return ids\n"


@pytest.mark.parametrize(
    ("cells", "verdict"),
    [
        ([("merge", _DEF)], None),
        ([("merge", "@decorate\n" + _DEF)], None),
        ([("merge", "class merge:\n    pass\n")], None),
        ([("merge", "from copied import merge\n")], "an import"),
        ([("merge", "import merge\n")], "an import"),
        ([("merge", "from copied import *\n" + _DEF)], "an import"),
        ([("merge", _DEF + "merge = other\n")], "an assignment"),
        ([("merge", _DEF + "merge, x = other, 1\n")], "an assignment"),
        ([("merge", _DEF + "if True:\n    merge: object = other\n")], "an assignment"),
        ([("merge", _DEF + "for merge in [other]:\n    pass\n")], "a `for` loop"),
        ([("merge", _DEF + "with ctx() as merge:\n    pass\n")], "a `with` statement"),
        ([("merge", _DEF + "try:\n    pass\nexcept E as merge:\n    pass\n")], "an `except ... as`"),
        ([("merge", _DEF + "def later():\n    global merge\n    merge = 1\n")], "a `global` declaration"),
        ([("merge", _DEF + "[(merge := other)]\n")], "an assignment"),
        ([("merge", _DEF + "del merge\n")], "a `del`"),
        ([("merge", _DEF + "match x:\n    case [merge]:\n        pass\n")], "an assignment"),
        ([("setup", _DEF), ("merge", "pass\n")], "in a cell you do not write code in"),
        ([("merge", "pass\n")], "no graded cell defines it"),
        ([("merge", _DEF), ("pair-counts", "def merge(:\n")], "syntax error"),
    ],
)
def test_the_learners_own_code_is_decided_from_the_notebooks_text(cells, verdict):
    """Only ``def``/``class`` statements in graded cells may bind a graded name, anywhere at module level."""
    got = origin.check([{"id": i, "source": s} for i, s in cells], {"merge": "merge", "x": "pair-counts"})
    if verdict is None:
        assert got["merge"] is None
    else:
        assert got["merge"] is not None and verdict in got["merge"], got["merge"]


# ---------------------------------------------------------------------------------------------- removal


def _state(path: Path) -> tuple:
    return path.read_bytes(), path.stat().st_mode, path.stat().st_mtime_ns


def test_removal_never_follows_a_symlink_and_undoes_what_a_submission_locked(tmp_path):
    """A tree full of links to a directory and a file outside it, and of directories and files it made
    unreadable, is removed whole; what the links point to is left exactly as it was."""
    outside = tmp_path / "outside"
    outside.mkdir()
    canary = outside / "canary.txt"
    canary.write_text("untouched")
    os.chmod(canary, 0o640)
    before = _state(canary), outside.stat().st_mode
    tree = tmp_path / "nanolab-sandbox-x"
    (tree / "work" / "deep").mkdir(parents=True)
    (tree / "work" / "deep" / "f").write_text("x")
    os.symlink(outside, tree / "work" / "dir_link")
    os.symlink(canary, tree / "work" / "file_link")
    os.symlink(outside, tree / "work" / "deep" / "swap")
    os.chmod(tree / "work" / "deep" / "f", 0)
    os.chmod(tree / "work" / "deep", 0)
    os.chmod(tree / "work", 0o500)
    remove_tree(tree)
    assert not tree.exists() and not tree.is_symlink()
    assert (_state(canary), outside.stat().st_mode) == before
    link = tmp_path / "link_to_outside"
    os.symlink(outside, link)
    remove_tree(link)  # the path itself a symlink: the link goes, its target stays
    assert not link.is_symlink() and _state(canary) == before[0]


def test_removal_clears_the_immutable_flag_as_root(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("only root can set the immutable flag")
    tree = tmp_path / "pinned"
    tree.mkdir()
    (tree / "f").write_text("x")
    fd = os.open(tree / "f", os.O_RDONLY)
    try:
        fcntl.ioctl(fd, 0x40086602, struct.pack("i", 0x10))  # FS_IOC_SETFLAGS, FS_IMMUTABLE_FL
    except OSError as e:
        pytest.skip(f"this file system has no immutable flag: {e}")
    finally:
        os.close(fd)
    with pytest.raises(PermissionError):
        (tree / "f").unlink()
    remove_tree(tree)
    assert not tree.exists()


# ---------------------------------------------------------------------------------------------- results


WRITE_UNDER_A_LIMIT = """
import resource, sys
from pathlib import Path
from autograder.grading.results import SubmissionResult, write_json
resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
try:
    write_json([SubmissionResult("new.ipynb", 1)] * 20, Path(sys.argv[1]))
except OSError as e:
    print("refused:", type(e).__name__)
"""


def test_a_results_file_is_written_whole_or_not_at_all(tmp_path):
    """With the file size limit at 64 bytes (what ``prlimit`` can do to a grader), writing fails and
    the results file already there is left whole, with no temporary file beside it."""
    path = tmp_path / "grades.json"
    write_json([SubmissionResult("old.ipynb", 1, tests=[TestResult("t", "t", 1.0, status="passed")])], path)
    before = path.read_bytes()
    out = subprocess.run(
        [sys.executable, "-c", WRITE_UNDER_A_LIMIT, str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert "refused:" in out.stdout, out.stdout + out.stderr
    assert path.read_bytes() == before and json.loads(before)[0]["submission"] == "old.ipynb"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grades.json"]


def test_the_cli_raises_a_lowered_soft_limit_and_says_when_it_cannot_write(tmp_path):
    """A soft file-size limit lowered from outside is raised back, so the results are written; a hard
    one it cannot raise makes ``nanolab grade`` say so and exit 1, leaving no partial file."""
    bad = tmp_path / "bad.ipynb"
    bad.write_text("{}")
    for hard, code in ((None, 0), (64, 1)):
        out_file = tmp_path / f"grades-{code}.json"
        limit = f"resource.setrlimit(resource.RLIMIT_FSIZE, (64, {hard or 'resource.RLIM_INFINITY'}))"
        script = (
            f"import resource, sys\n{limit}\nfrom nanolab.cli import main\n"
            f"sys.exit(main(['grade', {str(bad)!r}, '--json', {str(out_file)!r}]))"
        )
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120
        )
        assert out.returncode == code, out.stderr
        if code == 0:
            assert json.loads(out_file.read_text())[0]["score"] == 0
        else:
            assert "could not write" in out.stderr and not out_file.exists()
            assert not list(tmp_path.glob(".grades-*"))


# ---------------------------------------------------------------------------------------------- telling


@pytest.mark.parametrize(
    "module, line, reason, says",
    [
        ("isolation", "sandbox", "bubblewrap (bwrap) is not installed", ["NOT ISOLATED (bubblewrap (bwrap) is not installed)", "apt-get install bubblewrap", "container"]),
        ("cgroups", "cgroups", "no v1 memory hierarchy", ["cgroups: NONE (no v1 memory hierarchy)", "shared memory"]),
    ],
)  # fmt: skip
def test_nanolab_info_says_what_isolates_grading(capsys, monkeypatch, module, line, reason, says):
    """``nanolab info`` names the sandbox and whether each sandbox gets a cgroup; where one cannot be had, it
    says why, what that loses and how to get it."""
    from autograder.sandbox import cgroups, isolation
    from nanolab.cli import main

    source = {"isolation": isolation, "cgroups": cgroups}[module]
    assert main(["info"]) == 0
    assert f"grading {line}:" in capsys.readouterr().out
    missing = source.Status(False, reason=reason)
    monkeypatch.setattr(source, "status", lambda: missing)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for phrase in says:
        assert phrase in out, phrase
