"""Building fixture notebooks for the grading tests: edits of solutions/ and labs/, graded in one batch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from autograder.grading.grade import DEFAULT_TESTS_DIR, GradeOptions, grade
from autograder.grading.results import SubmissionResult
from autograder.sandbox.limits import Limits

STUB = "raise NotImplementedError()"

# A list whose comparisons always say "equal", for a tampered cell to return: made in the learner's process,
# it crosses to the grader as a plain list (or a handle), so the grader compares the data it holds.
LYING_LIST = """
class _Yes(list):
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = None
"""


def cell(nb: dict, grade_id: str) -> dict:
    """The notebook cell with this nbgrader grade_id."""
    return next(
        c for c in nb["cells"] if c.get("metadata", {}).get("nbgrader", {}).get("grade_id") == grade_id
    )


def edit(nb: dict, grade_id: str, change: Callable[[str], str]) -> None:
    """Replace a cell's source by ``change(source)``; an edit that changes nothing fails the test."""
    c = cell(nb, grade_id)
    old = "".join(c["source"])
    new = change(old)
    assert new != old, (
        f"the fixture edit of {grade_id!r} changed nothing: the notebook changed, update the test"
    )
    c["source"] = new


def prepend(nb: dict, grade_id: str, code: str) -> None:
    """Put ``code`` before the source of the cell ``grade_id``."""
    edit(nb, grade_id, lambda src: code + "\n" + src)


def sub(nb: dict, grade_id: str, old: str, new: str, count: int = -1) -> None:
    """Replace ``old`` by ``new`` in a cell (the first ``count`` times; all when -1)."""
    edit(nb, grade_id, lambda src: src.replace(old, new, count))


def lying(nb: dict, garbage: dict[str, list[str]], first: tuple[str, str], prelude: str = LYING_LIST) -> None:
    """A tampered submission: ``prelude`` (a lying container class) put before the definition ``first =
    (grade_id, "def name")``, and each stub of the graded cells replaced, in order, by ``garbage``'s wrong
    values of the right shapes."""
    grade_id, definition = first
    sub(nb, grade_id, definition, prelude + "\n\n" + definition, 1)
    for cell_id, replacements in garbage.items():
        for replacement in replacements:
            sub(nb, cell_id, STUB, replacement, 1)


class Batch:
    """Fixture notebooks written under ``base``, graded together against a copy of the hidden tests."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.tests_copy = base / "hidden"
        shutil.copytree(DEFAULT_TESTS_DIR, self.tests_copy, ignore=shutil.ignore_patterns("__pycache__"))
        self.notebooks: dict[str, Path] = {}

    def save(self, name: str, nb: dict) -> None:
        self.notebooks[name] = self.base / f"{name}.ipynb"
        self.notebooks[name].write_text(json.dumps(nb))

    def add_standard(
        self,
        solution: Path,
        lab: Path,
        planted_bugs: dict[str, tuple[str, str, str, str]],
        tampered: dict[str, Callable[[dict], None]],
    ) -> None:
        """The solution, the blank lab, the solution with each planted bug (cell, old, new, catching test)
        and the lab with each tampering."""
        self.save("solution", json.loads(solution.read_text()))
        self.save("blank", json.loads(lab.read_text()))
        for name, (grade_id, old, new, _) in planted_bugs.items():
            nb = json.loads(solution.read_text())
            sub(nb, grade_id, old, new)
            self.save(f"bug_{name}", nb)
        for name, tamper in tampered.items():
            nb = json.loads(lab.read_text())
            tamper(nb)
            self.save(f"tamper_{name}", nb)

    def grade(self, limits: Limits) -> dict[str, SubmissionResult]:
        names = list(self.notebooks)
        options = GradeOptions(tests_dir=self.tests_copy, limits=limits, max_restarts=2)
        results = grade([self.notebooks[n] for n in names], options, jobs=2, progress=False)
        return dict(zip(names, results))


# -- the checks every lab's grading tests make on its standard batch (see `Batch.add_standard`)


def check_solution_scores_full_marks(results: dict[str, SubmissionResult], lab: int) -> None:
    result = results["solution"]
    failed = {t.id: t.output for t in result.tests if t.status != "passed"}
    assert result.lab == lab and result.max_score > 0 and not failed, failed
    assert result.score == result.max_score


def check_blank_lab_scores_zero(results: dict[str, SubmissionResult]) -> None:
    result = results["blank"]
    assert result.max_score == results["solution"].max_score
    assert result.score == 0
    assert all("NotImplementedError" in t.output for t in result.tests), {
        t.id: t.output for t in result.tests
    }


def check_tamper_earns_nothing(results: dict[str, SubmissionResult], name: str) -> None:
    """The tampered submission ``name`` runs the blank lab's tests, fails every one with feedback, and scores 0."""
    result = results[f"tamper_{name}"]
    assert [t.id for t in result.tests] == [t.id for t in results["blank"].tests]
    assert result.score == 0
    assert all(t.status == "failed" and t.output for t in result.tests)


def check_planted_bug_is_caught(
    results: dict[str, SubmissionResult], planted_bugs: dict[str, tuple[str, str, str, str]], name: str
) -> None:
    """The test aimed at planted bug ``name`` fails, and the submission keeps partial credit."""
    result = results[f"bug_{name}"]
    catcher = planted_bugs[name][3]
    status = {t.id: t.status for t in result.tests}
    assert status[catcher] == "failed", f"{catcher} did not catch {name}"
    assert 0 < result.score < result.max_score


# A setup cell whose replay_schedule plays a correct scheduler of its own (the solution's code, run in a
# namespace of its own) and never touches the scheduler it is given: its records are right, the learner's
# Scheduler is a stub (Labs 4 and 5).
OWN_REPLAY = """

_OWN = {own!r}
_plain_replay = replay_schedule


def replay_schedule(scheduler, events, new_request=None):
    namespace = dict(globals())
    exec(_OWN, namespace)
    blocks = scheduler.block_manager
    own = namespace["Scheduler"](
        scheduler.config, BlockManager(BlockAllocator(blocks.allocator.num_total), blocks.block_size)
    )
    return _plain_replay(own, events, new_request)
"""


# A graded cell that rewrites the setup's replay_schedule in place (its code object, so every holder of the
# function runs the new code): it plays a correct scheduler of its own (the solution's code), then copies that
# scheduler's state onto the learner's stub and the stub's allocator, so that reading them back agrees with the
# records (Labs 4 and 5).
# The body of a forged replay_schedule(scheduler, events, new_request=None), given a ``namespace`` holding a correct
# Scheduler: a private copy plays the events with ``{replay}`` (the original replay), then its state is copied onto
# the graded scheduler and its allocator (here and in tests/labs/test_speed_forgery.py).
FORGED_SCHEDULE = """\
    blocks = scheduler.block_manager
    allocator = BlockAllocator(blocks.allocator.num_total)
    own = namespace["Scheduler"](scheduler.config, BlockManager(allocator, blocks.block_size))
    records = {replay}(own, events, new_request)
    scheduler.__dict__.update(own.__dict__)
    blocks.allocator.__dict__.update(allocator.__dict__)
    return records"""

IN_PLACE_REPLAY = (
    """
import types as _types

replay_schedule.__globals__["_plain_replay"] = _types.FunctionType(
    replay_schedule.__code__, replay_schedule.__globals__, "_plain_replay", replay_schedule.__defaults__
)


def _rewritten(scheduler, events, new_request=None):
    namespace = dict(globals())
    exec({own!r}, namespace)
"""
    + FORGED_SCHEDULE.format(replay="_plain_replay")
    + """


replay_schedule.__code__ = _rewritten.__code__
"""
)


def replay_rewritten_in_place(nb: dict, own: str, graded_cell: str) -> None:
    """Put `IN_PLACE_REPLAY`, playing ``own`` (a correct scheduler's code), at the start of ``graded_cell``."""
    prepend(nb, graded_cell, IN_PLACE_REPLAY.format(own=own))


def replay_ignoring_the_scheduler(nb: dict, own: str, graded_cell: str | None = None) -> None:
    """Define a replay_schedule that runs ``own`` (a correct scheduler's code) instead of the scheduler it is
    given: at the end of the setup cell, or (``graded_cell``) at the start of that graded cell."""
    if graded_cell is not None:
        prepend(nb, graded_cell, OWN_REPLAY.format(own=own))
        return
    setup = cell(nb, "setup")
    setup["source"] = "".join(setup["source"]) + OWN_REPLAY.format(own=own)


def check_setup_edit_earns_nothing(results: dict[str, SubmissionResult], name: str) -> None:
    """The tampered submission ``name``, whose setup cell was edited, earns nothing, and its feedback says that
    the lab's own setup code ran instead; the solution's has no such note."""
    check_tamper_earns_nothing(results, name)
    messages = results[f"tamper_{name}"].messages
    assert any("differs from the lab's own setup code" in m for m in messages), messages
    assert not any("setup code" in m for m in results["solution"].messages)


def solution_namespace(name: str) -> dict:
    """Run the setup and graded cells of ``solutions/<name>`` (no experiments) and return their namespace:
    a module's, registered in ``sys.modules`` so that the cells' dataclasses can find it."""
    import sys
    import types

    from autograder.submission.notebook import read_submission

    module = types.ModuleType(f"solution_{Path(name).stem}")
    sys.modules[module.__name__] = module
    for c in read_submission(Path(__file__).resolve().parents[2] / "solutions" / name).cells:
        exec(compile(c["source"], f"<cell {c['id']}>", "exec"), module.__dict__)
    return module.__dict__


# -- the scheduler labs (4 and 5): the same replay tampers, and the same tests of them


def scheduler_tampers(own: str) -> dict[str, Callable[[dict], None]]:
    """Lab 4's and Lab 5's replay tampers, each playing ``own`` (a correct scheduler's code) instead of the
    learner's stub: from an edited setup cell, from the same replay defined in the graded cell ``scheduler``,
    and from that cell rewriting the setup's replay in place (`IN_PLACE_REPLAY`)."""
    return {
        "replay_that_ignores_the_scheduler": lambda nb: replay_ignoring_the_scheduler(nb, own),
        "graded_cell_that_rebinds_the_replay": lambda nb: replay_ignoring_the_scheduler(nb, own, "scheduler"),
        "replay_rewritten_in_place": lambda nb: replay_rewritten_in_place(nb, own, "scheduler"),
    }


# Imported by the scheduler labs' grading modules, which pytest then collects them in (with their `batch`).


def test_a_replay_that_ignores_the_scheduler_earns_nothing(batch):
    """A setup cell whose replay_schedule reports a correct scheduler's decisions (the learner's Scheduler is a
    stub) is not run: the grader runs the lab's own setup code, says so, and the stub earns nothing."""
    check_setup_edit_earns_nothing(batch, "replay_that_ignores_the_scheduler")


def test_a_graded_cell_that_binds_the_replay_again_earns_nothing(batch):
    """The same replay defined in a graded cell: the hidden tests get the setup's replay_schedule, whose
    globals are the setup's own, so the learner's stub Scheduler is what runs."""
    check_tamper_earns_nothing(batch, "graded_cell_that_rebinds_the_replay")


def test_a_replay_rewritten_in_place_earns_nothing(batch):
    """A graded cell that rewrites the setup's replay_schedule in place to play a correct scheduler of its own,
    and copies that scheduler's state onto the learner's stub, earns nothing: the Scheduler's tests drive it
    from the grader through its handle, and the speed test first checks that it works when so driven."""
    check_tamper_earns_nothing(batch, "replay_rewritten_in_place")


def grade_command(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``nanolab grade ARGS`` in a fresh interpreter, as an instructor runs it; asserts it succeeded."""
    done = subprocess.run(
        [sys.executable, "-m", "nanolab.cli", "grade", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done
