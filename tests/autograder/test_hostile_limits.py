"""The grader's limits hold against a submission that plays for time and against hidden tests that
misbehave: the notebook's budget clamps every call, a watchdog stops a grading worker that hangs
(keeping the verdicts already decided), the worker's memory is capped, and without bubblewrap the
worker still kills what a submission detached.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from helpers.grading_utils import STUB, sub

from autograder.grading.grade import DEFAULT_TESTS_DIR, GradeOptions, grade
from autograder.sandbox.limits import Limits

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ROOT / "solutions" / "lab01_tokenizer.ipynb"
LAB = ROOT / "labs" / "lab01_tokenizer.ipynb"
GRADED = ("pair-counts", "merge", "train-merges", "bpe-encode", "tokenizer")

# A Tokenizer whose every call takes most of the call timeout: the hidden tests hold on to one and
# call its methods again and again, never fetching a notebook global in between.
DAWDLER = """
import time


class Tokenizer:
    merges = []

    def __init__(self, *args, **kwargs):
        pass

    @classmethod
    def train(cls, *args, **kwargs):
        time.sleep(1.5)
        return cls()

    def encode(self, *args, **kwargs):
        time.sleep(1.5)
        return []

    def decode(self, *args, **kwargs):
        time.sleep(1.5)
        return ""

    def decode_bytes(self, *args, **kwargs):
        time.sleep(1.5)
        return b""
"""


def test_the_notebook_budget_clamps_every_call(tmp_path):
    """With 6 s for the whole notebook and 2 s a call, a submission whose every call takes 1.5 s is
    done in about 6 s (not minutes): once the budget is spent, each call fails at once, saying why."""
    nb = json.loads(LAB.read_text())
    for grade_id in GRADED[:4]:
        sub(nb, grade_id, STUB, "import time; time.sleep(1.5); return []")
    nb_cell = next(c for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") == "tokenizer")
    nb_cell["source"] = DAWDLER
    path = tmp_path / "dawdler.ipynb"
    path.write_text(json.dumps(nb))
    limits = Limits(call_timeout_s=2, load_timeout_s=20, notebook_s=6)
    start = time.monotonic()
    [result] = grade([path], GradeOptions(limits=limits), progress=False)
    assert time.monotonic() - start < 25 and result.execution_time < 15, result.execution_time
    assert result.score == 0
    outputs = [t.output for t in result.tests]
    assert sum("longer than 6 s in all" in o for o in outputs) >= len(outputs) // 2, outputs


HANGING_TESTS = '''
import time

from autograder.authoring.testing import expect


def test_a_passes(lab):
    """a quick check that passes"""
    assert expect(lab.merge([], (1, 2), 256), list, "merge([], (1, 2), 256)") == []


def test_b_hangs(lab):
    """a check that never ends (in the grader, where no call timeout reaches)"""
    time.sleep(3600)


def test_c_after(lab):
    """a check after the hang"""
    assert lab.merge([1, 2], (1, 2), 256) == [256]
'''


def test_a_watchdog_stops_a_hung_worker_and_keeps_the_verdicts_decided(tmp_path, monkeypatch):
    """A grading worker that hangs is stopped after `Limits.watchdog`; its notebook keeps the verdicts
    reported before the hang, every later test fails saying why, its neighbour is graded as usual, and
    nothing of the stopped worker's is left in the temporary folder."""
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "test_lab01_hang.py").write_text(HANGING_TESTS)
    limits = Limits(call_timeout_s=10, load_timeout_s=30, watchdog=45)  # room for every built-in test
    options = GradeOptions(tests_dir=DEFAULT_TESTS_DIR, extra_tests_dir=extra, limits=limits)
    start = time.monotonic()
    solution, blank = grade([SOLUTION, LAB], options, jobs=2, progress=False)
    assert time.monotonic() - start < 100
    status = {t.id: (t.status, t.output) for t in solution.tests}
    builtin = [i for i in status if not i.startswith("extra/")]
    assert builtin and all(status[i][0] == "passed" for i in builtin), status
    assert status["extra/test_a_passes"][0] == "passed"
    for hung in ("extra/test_b_hangs", "extra/test_c_after"):
        assert status[hung][0] == "failed" and "stopped after 45 s" in status[hung][1], status[hung]
    builtin_points = sum(t.max_score for t in solution.tests if not t.id.startswith("extra/"))
    assert solution.score == builtin_points + 1  # every built-in point, and test_a_passes' one
    assert any("stopped after 45 s" in m for m in solution.messages)
    assert blank.score == 0 and len(blank.tests) == len(solution.tests)
    assert not list(private_tmp.iterdir()), "the stopped worker's directories were left behind"


GREEDY_TESTS = '''
def test_a_grader_that_wants_too_much_memory(lab):
    """a check that allocates 8 GB in the grader"""
    hog = bytearray(8 << 30)
    assert hog


def test_after_it(lab):
    """a check after it"""
    assert lab.merge([1, 2], (1, 2), 256) == [256]
'''


def test_a_grading_worker_cannot_take_more_memory_than_its_limit(tmp_path):
    """The worker's address space is capped: an allocation over the cap fails that test alone."""
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "test_lab01_greedy.py").write_text(GREEDY_TESTS)
    limits = Limits(call_timeout_s=10, load_timeout_s=30, grader_memory_mb=1024)
    options = GradeOptions(tests_dir=tmp_path / "none", extra_tests_dir=extra, limits=limits)
    (tmp_path / "none").mkdir()
    [result] = grade([SOLUTION], options, progress=False)
    status = {t.id: (t.status, t.output) for t in result.tests}
    assert status["extra/test_a_grader_that_wants_too_much_memory"][0] == "failed"
    assert "MemoryError" in status["extra/test_a_grader_that_wants_too_much_memory"][1]
    assert status["extra/test_after_it"][0] == "passed" and result.internal_error is None


DETACH = """
import os, sys
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time\\nwhile True: time.sleep(1)", {marker!r}])
    os._exit(0)
"""


def test_without_bubblewrap_the_worker_still_kills_what_a_submission_detached(tmp_path, monkeypatch):
    """Where there is no PID namespace, the grading worker adopts the processes a submission detaches
    (fork, setsid) and kills them before it ends; no directory of its sandboxes is left."""
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))
    marker = f"nanolab-detached-{uuid.uuid4().hex}"
    nb = json.loads(LAB.read_text())
    source = next(
        c for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") == "pair-counts"
    )
    source["source"] = DETACH.format(marker=marker) + "".join(source["source"])
    path = tmp_path / "detacher.ipynb"
    path.write_text(json.dumps(nb))
    limits = Limits(call_timeout_s=5, load_timeout_s=30, isolate=False)
    [result] = grade([path], GradeOptions(limits=limits), progress=False)
    assert result.score == 0 and result.isolated is False
    time.sleep(0.5)
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    left.append(pid)
        except OSError:
            pass
    assert not left, "a detached process outlived its notebook's grading"
    assert not list(private_tmp.iterdir()), "the grading left directories behind"


SPINNERS = """
import os

for _ in range(24):  # busy processes, each in a session (and so a scheduling group) of its own
    if os.fork() == 0:
        os.setsid()
        while True:
            pass
"""


def test_a_notebook_that_starts_many_busy_sessions_leaves_its_neighbour_its_score(tmp_path):
    """A submission that starts 24 busy processes, each in a session of its own, while it is graded slowly,
    takes no more than its cgroup's quota: the solution graded beside it keeps full marks. (Without a cgroup
    each session is a scheduling group of its own, and the neighbour's calls run out of time.)"""
    from autograder.sandbox import cgroups

    if not cgroups.status().available:
        if os.environ.get("NANOLAB_SANDBOX_TEST") == "required":
            pytest.fail(f"cgroups are required here: {cgroups.status().reason}", pytrace=False)
        pytest.skip(f"no cgroups for sandboxes here: {cgroups.status().reason}")
    nb = json.loads(LAB.read_text())
    for grade_id in GRADED[:4]:
        sub(nb, grade_id, STUB, "import time; time.sleep(1.5); return []")
    cell = next(c for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") == "tokenizer")
    cell["source"] = SPINNERS + DAWDLER
    hostile, neighbour = tmp_path / "spinner.ipynb", tmp_path / "neighbour.ipynb"
    hostile.write_text(json.dumps(nb))
    neighbour.write_text(SOLUTION.read_text())
    limits = Limits(call_timeout_s=3, load_timeout_s=30, notebook_s=40, cpu_s=600)
    spinner, solution = grade([hostile, neighbour], GradeOptions(limits=limits), jobs=2, progress=False)
    assert spinner.score == 0
    failed = {t.id: t.output for t in solution.tests if t.status != "passed"}
    assert solution.score == solution.max_score, failed


def test_a_sandbox_launched_early_is_still_there_for_the_first_test():
    """`Session.warm_up` launches the sandbox before the tests load; it must wait for the first test
    (no restart, no lost time), whatever happens meanwhile in the grader's other threads."""
    import threading

    from autograder.grading.session import Session
    from autograder.submission.notebook import read_submission

    submission = read_submission(SOLUTION)
    session = Session(submission, submission.spec, Limits(call_timeout_s=10, load_timeout_s=30), seed=0)
    try:
        session.warm_up()
        worker = threading.Thread(target=time.sleep, args=(0.1,))  # a thread that ends meanwhile
        worker.start()
        worker.join()
        time.sleep(1.0)
        assert session.global_("merge")([1, 2, 1, 2], (1, 2), 256) == [256, 256]
        assert session.restarts == 0 and session.sandbox is not None and session.sandbox.alive
    finally:
        session.close()


def _answer_at_once(conn) -> None:
    """A batch task that sends its result and ends at once (the race a batch must not lose)."""
    from autograder.grading.results import SubmissionResult

    workdir, path, lab = conn.recv()
    conn.send(("done", SubmissionResult(path, lab).to_dict()))


def test_every_worker_that_answers_and_ends_at_once_keeps_its_result():
    """A worker that ends right after sending its result is not taken for one that died."""
    from autograder.grading import batch

    paths = [f"n{i}.ipynb" for i in range(40)]
    results = batch.run(paths, _answer_at_once, (7,), jobs=4, watchdog_s=60)
    assert [r.submission for r in results] == paths
    assert all(r.internal_error is None and r.lab == 7 for r in results), [
        r.internal_error for r in results if r.internal_error
    ]
