"""Grading notebooks: read each one, run the lab's hidden tests against it, collect the results.

`grade` is what ``nanolab grade`` calls. Each notebook is graded by a fresh worker process of the
grader (trusted: it runs pytest and the reference implementation), ``jobs`` at a time, each under a
watchdog (`autograder.grading.batch`); the worker in turn runs the submission's code in a sandboxed process
(`autograder.sandbox.process`). A worker may map at most `Limits.grader_memory_mb` more than it starts with,
adopts whatever the submission leaves running and kills it at the end. A notebook that cannot be
graded gets a zero and a message; the batch always goes on, and every notebook gets a result.

The hidden tests (the built-in ones, and an instructor's extra ones in addition) are read once,
before any submission runs, and every notebook is graded against that in-memory copy
(`autograder.submission.suite`). Under bubblewrap a sandbox cannot even see them; without it, Landlock keeps it
from writing outside its own directory where the kernel has Landlock, and where it has not, the test
files on disk are compared with that copy after each notebook, restored if they changed, and the
notebook graded then gets no credit.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from autograder.grading import batch, feedback
from autograder.grading.results import SubmissionResult
from autograder.sandbox import isolation, proctree
from autograder.sandbox.limits import Limits
from autograder.submission.labs import LABS, LabSpec
from autograder.submission.notebook import SubmissionError, notebook_lab, read_notebook, read_submission
from autograder.submission.suite import EXTRA, TestFolder

DEFAULT_TESTS_DIR = Path(__file__).resolve().parents[1] / "tests"

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

    def resolved(self) -> GradeOptions:
        """These options with the sandbox decided: bubblewrap where it can run, unless turned off."""
        if self.limits.isolate is not None:
            return self
        return replace(self, limits=replace(self.limits, isolate=isolation.status().available))

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


def grade_notebook(
    path: str | Path,
    options: GradeOptions,
    tests: Sequence[TestFolder],
    report: Callable[..., Any] | None = None,
) -> SubmissionResult:
    """Grade one notebook in this process (the sandbox is still a separate process). ``report``, if
    given, is told the lab, the collected tests and each verdict as they come (`autograder.grading.batch`)."""
    report = report or (lambda *message: None)
    import pytest

    from autograder.grading.plugin import GradingPlugin
    from autograder.grading.session import Session

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
    report("lab", spec.number)

    if not any(folder.modules_for(spec) for folder in tests):
        where = " or ".join(str(folder.path) for folder in tests)
        result.internal_error = (
            f"no hidden tests for lab {spec.number}: expected {spec.test_prefix}*.py in {where}"
        )
        result.messages.append(result.internal_error)
        return result

    session = Session(submission, spec, options.limits, seed, rejected, options.max_restarts)
    session.warm_up()  # the sandbox starts while pytest imports and collects the tests
    with tempfile.TemporaryDirectory(prefix="nanolab-tests-") as tmp:
        modules, prefixes = [], {}
        for folder in tests:
            written = folder.write_into(Path(tmp))
            prefixes[written] = folder.id_prefix
            modules += [str(written / name) for name in folder.modules_for(spec)]
        (Path(tmp) / "pytest.ini").write_text("[pytest]\n")
        plugin = GradingPlugin(session, prefixes, _safe_feedback(tests, submission), report)
        args = [*PYTEST_ARGS, "--rootdir", tmp, "-c", f"{tmp}/pytest.ini", *modules]
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                code = pytest.main(args, plugins=[plugin])
        finally:
            session.close()
            _forget_modules(tmp, [folder.name for folder in tests])
    result.confined = session.sandbox.confined if session.sandbox is not None else None
    result.isolated = session.sandbox.isolated if session.sandbox is not None else None
    result.tests = list(plugin.results.values())
    if plugin.collection_errors or (not plugin.results and code not in (0, 1)):
        detail = "\n".join(plugin.collection_errors) or log.getvalue()[-1500:]
        result.internal_error = f"the hidden tests for lab {spec.number} could not run:\n{detail}"
        result.messages.append(result.internal_error)
    result.messages = [feedback.clean(message) for message in result.messages]
    result.execution_time = time.monotonic() - start
    return result


def _safe_feedback(tests: Sequence[TestFolder], submission: Any) -> Callable[[str], str]:
    """What every test's feedback goes through: no control characters, no line of the hidden tests,
    the solutions or the reference, unless the learner's own notebook has it too. (The index of those
    lines is built for the first failure: a notebook that passes everything never needs it.)"""
    redactors: list[feedback.Redactor] = []

    def safe(text: str) -> str:
        if not redactors:
            secret, public = feedback.grader_sources()
            hidden = [data.decode("utf-8", "replace") for folder in tests for data in folder.files.values()]
            own = [cell["source"] for cell in submission.cells] if submission is not None else []
            redactors.append(feedback.Redactor([*hidden, *secret], [*public, *own]))
        return feedback.clean(redactors[0](text))

    return safe


def _forget_modules(directory: str, folders: list[str]) -> None:
    """Drop the test modules imported from ``directory``, and the empty packages pytest made for its
    ``folders`` (``extra`` for ``extra/test_lab01.py``), so the next notebook imports them afresh."""
    for name, module in list(sys.modules.items()):
        from_directory = (getattr(module, "__file__", None) or "").startswith(directory)
        if from_directory or (name.split(".")[0] in folders and getattr(module, "__file__", None) is None):
            del sys.modules[name]


def _grade_task(conn: Any) -> None:
    """A batch worker's whole life: grade one notebook, talking through ``conn`` (`autograder.grading.batch`)."""
    import autograder.grading.plugin  # noqa: F401 - with pytest, loaded while the batch decides the sandbox

    workdir, path, options, tests = conn.recv()
    tempfile.tempdir = os.environ["TMPDIR"] = workdir  # the batch removes it, however this ends
    # Only the grader's own plugin: whatever pytest plugins this environment has installed (hypothesis,
    # anyio, ...) neither take part in grading nor cost each notebook their start-up.
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    _not_dumpable()
    proctree.become_subreaper()  # what the submission detaches stays below this process
    _preload_for(path, options.lab)
    _limit_memory(options.limits.grader_memory_mb)
    try:
        result = grade_notebook(path, options, tests, lambda *message: conn.send(message))
    except BaseException as e:  # noqa: B036 - a bug in the grader: this notebook's result says so
        result = _internal_failure(path, options, e)
    finally:
        proctree.kill_tree(os.getpid(), include_root=False)  # whatever the submission left running
        proctree.reap()
    conn.send(("done", result.to_dict()))
    conn.close()


def _preload_for(path: str, lab: int | None) -> None:
    """Import the lab's big modules (its sandbox's preloads and its hidden tests' `LabSpec.grader_preload`,
    torch) before the worker's memory cap is set, so that the cap bounds what grading maps, not the size of
    the torch build: a CUDA build maps gigabytes more than the CPU one on import, most of it reserved and
    never touched."""
    try:
        number = lab if lab is not None else notebook_lab(read_notebook(Path(path)), Path(path))
        spec = LABS.get(number)
    except Exception:  # noqa: BLE001 - unreadable: grade_notebook says so, with the cap in place
        return
    for module in (*spec.preload, *spec.grader_preload) if spec is not None else ():
        with contextlib.suppress(ImportError):
            __import__(module)


def _limit_memory(megabytes: int) -> None:
    """Cap this process's address space at what it maps now plus ``megabytes`` (Linux)."""
    import resource

    try:
        with open("/proc/self/status") as f:
            mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = mapped + megabytes * 1024 * 1024
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (OSError, ValueError, StopIteration):
        pass


def _not_dumpable() -> None:
    """Linux: stop other processes of this user (a sandbox) from ptracing this grader or reading its memory."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0
        except (OSError, AttributeError):
            pass


def _check_tests_unchanged(tests: Sequence[TestFolder], result: SubmissionResult) -> None:
    """Restore the hidden tests on disk if they changed while ``result`` was graded, and void it.
    Only for a submission that ran without bubblewrap: one that ran in it could not even see them (and
    an instructor editing the tests meanwhile must not see the edits undone)."""
    if result.isolated:
        return
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
    if isinstance(error, MemoryError) or (isinstance(error, OSError) and error.errno == errno.ENOMEM):
        message = (
            f"the grader ran out of memory on this notebook ({type(error).__name__}: {error}): a grading "
            f"worker may map {options.limits.grader_memory_mb} MB on top of what it maps at its start "
            "(the lab's preloaded modules included). If torch is a CUDA build where no GPU is used, install "
            "the CPU build (pip install torch --index-url https://download.pytorch.org/whl/cpu)"
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
    """Grade ``paths`` (``jobs`` at a time, each in a fresh worker under a watchdog) and return their
    results in the same order; every notebook gets one, whatever happens (`autograder.grading.batch`)."""
    from tqdm.auto import tqdm

    options = options or GradeOptions()
    tests = options.read_tests()
    paths = [str(p) for p in paths]

    def arguments() -> tuple[GradeOptions, tuple[TestFolder, ...]]:
        nonlocal options  # the sandbox is decided (a trial run of bubblewrap) while the workers start
        options = options.resolved()
        return options, tests

    with tqdm(
        total=len(paths), desc="grading", unit="notebook", disable=not progress or len(paths) < 2
    ) as bar:

        def done(index: int, result: SubmissionResult) -> None:
            if result.isolated is None:
                result.isolated = options.limits.isolate
            _check_tests_unchanged(tests, result)
            bar.update()

        jobs = max(1, min(jobs, len(paths)))
        return batch.run(paths, _grade_task, arguments, jobs, options.limits.watchdog_s, done)
