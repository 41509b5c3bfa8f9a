"""Grading notebooks: read each one, run the lab's hidden tests against it, collect the results.

`grade` is what ``nanolab grade`` calls. Each notebook is graded by a worker process of the grader
(trusted: it runs pytest and the reference implementation), which in turn runs the submission's code
in a sandboxed process (`autograder.sandbox`). Workers are reused across notebooks, ``jobs`` of them
in parallel. A notebook that cannot be graded gets a zero and a message; the batch always goes on.

The hidden tests are read once, before any submission runs, and every notebook is graded against
that in-memory copy. Sandboxes cannot write outside their own directory where the kernel has
Landlock; where it has not, the test files on disk are compared with that copy after each
notebook, restored if they changed, and the notebook graded then gets no credit.
"""

from __future__ import annotations

import contextlib
import hashlib
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

DEFAULT_TESTS_DIR = Path(__file__).resolve().parent / "tests"


@dataclass(frozen=True)
class GradeOptions:
    """How to grade: which lab, which hidden tests, what limits."""

    lab: int | None = None  # None: the lab named in each notebook
    tests_dir: Path = DEFAULT_TESTS_DIR
    limits: Limits = field(default_factory=Limits)
    seed: int | None = None  # None: a fresh random seed per notebook
    max_restarts: int = 2  # sandbox restarts after a crash or timeout, per notebook


def load_tests(tests_dir: Path) -> dict[str, bytes]:
    """Every ``.py`` file directly in ``tests_dir`` (test modules and their helpers), by name."""
    tests_dir = Path(tests_dir)
    if not tests_dir.is_dir():
        raise FileNotFoundError(f"the hidden tests folder {tests_dir} does not exist")
    return {p.name: p.read_bytes() for p in sorted(tests_dir.glob("*.py"))}


def _spec_for_rejected(path: Path, lab: int | None) -> LabSpec | None:
    if lab is None:
        try:
            lab = notebook_lab(read_notebook(path), path)
        except SubmissionError:
            return None
    return LABS.get(lab) if lab is not None else None


def grade_notebook(path: str | Path, options: GradeOptions, tests: dict[str, bytes]) -> SubmissionResult:
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

    test_files = sorted(n for n in tests if n.startswith(spec.test_prefix) and n.endswith(".py"))
    if not test_files:
        result.internal_error = (
            f"no hidden tests for lab {spec.number}: expected {spec.test_prefix}*.py in {options.tests_dir}"
        )
        result.messages.append(result.internal_error)
        return result

    session = Session(submission, spec, options.limits, seed, rejected, options.max_restarts)
    plugin = GradingPlugin(session)
    with tempfile.TemporaryDirectory(prefix="nanolab-tests-") as tmp:
        for name, source in tests.items():
            (Path(tmp) / name).write_bytes(source)
        (Path(tmp) / "pytest.ini").write_text("[pytest]\n")
        args = [
            "-q",
            "--no-header",
            "--assert=plain",
            "--tb=no",
            "--import-mode=importlib",
            "-p",
            "no:cacheprovider",
        ]
        args += [
            "-W",
            "ignore::pytest.PytestAssertRewriteWarning",
            "--rootdir",
            tmp,
            "-c",
            f"{tmp}/pytest.ini",
        ]
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                code = pytest.main([*args, *(f"{tmp}/{n}" for n in test_files)], plugins=[plugin])
        finally:
            session.close()
            _forget_modules(tmp)
    result.confined = session.sandbox.confined if session.sandbox is not None else None
    result.tests = list(plugin.results.values())
    if plugin.collection_errors or (not plugin.results and code not in (0, 1)):
        detail = "\n".join(plugin.collection_errors) or log.getvalue()[-1500:]
        result.internal_error = f"the hidden tests for lab {spec.number} could not run:\n{detail}"
        result.messages.append(result.internal_error)
    result.execution_time = time.monotonic() - start
    return result


def _forget_modules(directory: str) -> None:
    """Drop the test modules imported from ``directory`` so the next notebook imports them afresh."""
    for name, module in list(sys.modules.items()):
        if (getattr(module, "__file__", None) or "").startswith(directory):
            del sys.modules[name]


def _grade_task(path: str, options: GradeOptions, tests: dict[str, bytes]) -> dict:
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


def _digest(files: dict[str, bytes]) -> dict[str, str]:
    return {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}


def _check_tests_unchanged(options: GradeOptions, tests: dict[str, bytes], result: SubmissionResult) -> None:
    """Restore the hidden tests on disk if they changed while ``result`` was graded, and void it."""
    try:
        now = load_tests(options.tests_dir)
    except OSError:
        now = {}
    if _digest(now) == _digest(tests):
        return
    for name, data in tests.items():
        (Path(options.tests_dir) / name).write_bytes(data)
    for name in set(now) - set(tests):
        (Path(options.tests_dir) / name).unlink(missing_ok=True)
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
    tests = load_tests(options.tests_dir)
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
                _check_tests_unchanged(options, tests, result)
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
