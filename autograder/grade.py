"""Grading notebooks: read each one, run the lab's hidden tests against it, collect the results.

`grade` is what ``nanolab grade`` calls. Each notebook is graded by a worker process of the grader
(trusted: it runs pytest and the reference implementation), which in turn runs the submission's code
in a sandboxed process (`autograder.sandbox`). Workers are reused across notebooks, ``jobs`` of them
in parallel. A notebook that cannot be graded gets a zero and a message; the batch always goes on.

The hidden tests (the built-in ones, and an instructor's extra ones in addition) are read once,
before any submission runs, and every notebook is graded against that in-memory copy
(`autograder.suite`). Sandboxes cannot write outside their own directory where the kernel has
Landlock; where it has not, the test files on disk are compared with that copy after each
notebook, restored if they changed, and the notebook graded then gets no credit.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import secrets
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

from autograder.labs import LABS, LabSpec
from autograder.notebook import SubmissionError, notebook_lab, read_notebook, read_submission
from autograder.results import SubmissionResult
from autograder.sandbox import Limits
from autograder.suite import EXTRA, TestFolder

DEFAULT_TESTS_DIR = Path(__file__).resolve().parent / "tests"

PYTEST_ARGS = [
    "-q",
    "--no-header",
    "--assert=plain",  # feedback is the assertion's own message, never the compared values
    "--tb=no",
    "--import-mode=importlib",
    "-p",
    "no:cacheprovider",
    "-W",
    "ignore::pytest.PytestAssertRewriteWarning",
]


@dataclass(frozen=True)
class GradeOptions:
    """How to grade: which lab, which hidden tests, what limits."""

    lab: int | None = None  # None: the lab named in each notebook
    tests_dir: Path = DEFAULT_TESTS_DIR  # the built-in hidden tests
    extra_tests_dir: Path | None = None  # an instructor's own tests, graded in addition (ids: extra/...)
    limits: Limits = field(default_factory=Limits)
    seed: int | None = None  # None: a fresh random seed per notebook
    max_restarts: int = 2  # sandbox restarts after a crash or timeout, per notebook

    def read_tests(self) -> tuple[TestFolder, ...]:
        """The built-in tests, then the extra ones; FileNotFoundError for a folder that is not there."""
        folders = [TestFolder.read(self.tests_dir)]
        if self.extra_tests_dir is not None:
            folders.append(TestFolder.read(self.extra_tests_dir, EXTRA))
        return tuple(folders)


def _spec_for_rejected(path: Path, lab: int | None) -> LabSpec | None:
    if lab is None:
        try:
            lab = notebook_lab(read_notebook(path), path)
        except SubmissionError:
            return None
    return LABS.get(lab) if lab is not None else None


def grade_notebook(path: str | Path, options: GradeOptions, tests: Sequence[TestFolder]) -> SubmissionResult:
    """Grade one notebook in this process (the sandbox is still a separate process)."""
    import pytest

    from autograder.plugin import GradingPlugin
    from autograder.session import Session

    start = time.monotonic()
    seed = options.seed if options.seed is not None else secrets.randbits(32)
    path = Path(path)
    result = SubmissionResult(submission=str(path), lab=options.lab, seed=seed)
    submission, rejected = None, None
    try:
        submission = read_submission(path, options.lab)
        spec = submission.spec
        result.messages += submission.warnings
    except SubmissionError as e:
        rejected = str(e)
        result.graded = False
        result.messages.append(f"not graded: {rejected}")
        spec = _spec_for_rejected(path, options.lab)
        if spec is None:
            result.execution_time = time.monotonic() - start
            return result
    result.lab = spec.number

    if not any(folder.modules_for(spec) for folder in tests):
        where = " or ".join(str(folder.path) for folder in tests)
        result.internal_error = (
            f"no hidden tests for lab {spec.number}: expected {spec.test_prefix}*.py in {where}"
        )
        result.messages.append(result.internal_error)
        return result

    session = Session(submission, spec, options.limits, seed, rejected, options.max_restarts)
    with tempfile.TemporaryDirectory(prefix="nanolab-tests-") as tmp:
        modules, prefixes = [], {}
        for folder in tests:
            written = folder.write_into(Path(tmp))
            prefixes[written] = folder.id_prefix
            modules += [str(written / name) for name in folder.modules_for(spec)]
        (Path(tmp) / "pytest.ini").write_text("[pytest]\n")
        plugin = GradingPlugin(session, prefixes)
        args = [*PYTEST_ARGS, "--rootdir", tmp, "-c", f"{tmp}/pytest.ini", *modules]
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                code = pytest.main(args, plugins=[plugin])
        finally:
            session.close()
            _forget_modules(tmp, [folder.name for folder in tests])
    result.confined = session.sandbox.confined if session.sandbox is not None else None
    result.tests = list(plugin.results.values())
    if plugin.collection_errors or (not plugin.results and code not in (0, 1)):
        detail = "\n".join(plugin.collection_errors) or log.getvalue()[-1500:]
        result.internal_error = f"the hidden tests for lab {spec.number} could not run:\n{detail}"
        result.messages.append(result.internal_error)
    result.execution_time = time.monotonic() - start
    return result


def _forget_modules(directory: str, folders: list[str]) -> None:
    """Drop the test modules imported from ``directory``, and the empty packages pytest made for its
    ``folders`` (``extra`` for ``extra/test_lab01.py``), so the next notebook imports them afresh."""
    for name, module in list(sys.modules.items()):
        from_directory = (getattr(module, "__file__", None) or "").startswith(directory)
        if from_directory or (name.split(".")[0] in folders and getattr(module, "__file__", None) is None):
            del sys.modules[name]


def _grade_task(path: str, options: GradeOptions, tests: tuple[TestFolder, ...]) -> dict:
    _not_dumpable()
    return grade_notebook(path, options, tests).to_dict()


def _not_dumpable() -> None:
    """Linux: stop other processes of this user (a sandbox) from ptracing this grader or reading its memory."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0
        except (OSError, AttributeError):
            pass


def _check_tests_unchanged(tests: Sequence[TestFolder], result: SubmissionResult) -> None:
    """Restore the hidden tests on disk if they changed while ``result`` was graded, and void it."""
    changed = [folder for folder in tests if folder.changed_on_disk()]
    if not changed:
        return
    for folder in changed:
        folder.restore()
    for test in result.tests:
        test.status = "failed"
    result.messages.append(
        "the hidden test files changed on disk while this notebook was graded; they were restored, "
        "and this notebook gets no credit"
    )


def _internal_failure(path: str, options: GradeOptions, error: BaseException) -> SubmissionResult:
    message = (
        f"the grader failed on this notebook ({type(error).__name__}: {error}); grade it again on its own"
    )
    return SubmissionResult(
        submission=path, lab=options.lab, graded=False, messages=[message], internal_error=message
    )


def grade(
    paths: Sequence[str | Path],
    options: GradeOptions | None = None,
    jobs: int = 1,
    progress: bool = True,
) -> list[SubmissionResult]:
    """Grade ``paths`` (``jobs`` at a time) and return their results in the same order.

    If a grading worker dies (which a submission should not be able to cause, but might where the
    kernel lacks Landlock), the notebooks it left unfinished are graded again one by one, each in a
    fresh worker, so one notebook can only ever spoil its own result.
    """
    from tqdm.auto import tqdm

    options = options or GradeOptions()
    tests = options.read_tests()
    paths = [str(p) for p in paths]
    results: dict[int, SubmissionResult] = {}

    def run_pool(indices: list[int], workers: int) -> list[int]:
        """Grade ``indices`` in one pool; returns those left unfinished because the pool broke."""
        broken = []
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            futures: dict[Future, int] = {
                pool.submit(_grade_task, paths[i], options, tests): i for i in indices
            }
            for future in as_completed(futures):
                i = futures[future]
                try:
                    result = SubmissionResult.from_dict(future.result())
                except BrokenProcessPool:
                    broken.append(i)
                    continue
                except Exception as e:  # a bug in the grader: report it, keep grading the others
                    result = _internal_failure(paths[i], options, e)
                _check_tests_unchanged(tests, result)
                results[i] = result
                bar.update()
        return broken

    with tqdm(
        total=len(paths), desc="grading", unit="notebook", disable=not progress or len(paths) < 2
    ) as bar:
        broken = run_pool(list(range(len(paths))), max(1, min(jobs, len(paths))))
        for i in sorted(broken):
            if run_pool([i], 1):
                results[i] = _internal_failure(
                    paths[i], options, BrokenProcessPool("its grading process died")
                )
                bar.update()
    return [results[i] for i in range(len(paths))]
