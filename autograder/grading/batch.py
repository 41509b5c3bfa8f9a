"""Grading a batch: one fresh worker process per notebook, ``jobs`` at a time, each under a watchdog.

A worker is a process of the grader (trusted: it runs pytest and the reference) that grades one
notebook and ends, so nothing a notebook does to its worker (its limits, its memory, the modules it
imported) reaches another notebook. Workers are forked from a fork server that has imported the grader and
the labs' big modules once (`autograder.grading.zygote`), so each starts without importing torch again; they
take the batch's environment as it is when they start, not the server's. Where there is no fork server
(Windows), each worker is a fresh interpreter. It reports as it goes over a pipe: the tests it collected, each
test's verdict, then the whole result.

Whatever happens, every notebook gets a result:

- a worker still running after ``watchdog_s`` is killed; its notebook keeps the verdicts already
  reported, and every other test fails saying why;
- a worker that dies before reporting its result (which a submission should not be able to cause)
  leaves an internal error for its notebook; the batch goes on.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from autograder.grading.results import SubmissionResult, TestResult
from autograder.sandbox.cleanup import remove_tree
from autograder.sandbox.isolation import shared_mirror

# The worker's entry point: task(conn) receives (workdir, path, *args) through conn, then sends
# ("lab", number), ("collected", [test, ...]), ("test", test) and finally ("done", result) (tests and
# results as dicts). The arguments go through the pipe rather than to the process's start, which would
# block forever on a worker that dies before reading them all. ``workdir`` is the worker's own temporary
# folder: all its grading's temporary files go there, and the batch removes it when the worker ends,
# however it ends (a worker killed by the watchdog cleans up nothing itself).
Task = Callable[..., None]


@dataclass
class _Job:
    index: int
    path: str
    process: BaseProcess
    conn: Connection
    workdir: str
    started: float = field(default_factory=time.monotonic)
    lab: int | None = None
    tests: dict[str, dict] = field(default_factory=dict)  # by id, as last reported
    result: dict | None = None


def run(
    paths: Sequence[str],
    task: Task,
    args: tuple[Any, ...] | Callable[[], tuple[Any, ...]],
    jobs: int,
    watchdog_s: float,
    on_result: Callable[[int, SubmissionResult], None] = lambda i, r: None,
) -> list[SubmissionResult]:
    """Grade each of ``paths`` with ``task`` in its own process, ``jobs`` at a time; results in order.

    ``args`` may be a function giving them: it is called once the first workers are starting, so that
    what it waits for overlaps with their start-up."""
    with shared_mirror():  # the workers bind the lab's packages from one mirror (`isolation.mirrored`)
        return _run(paths, task, args, jobs, watchdog_s, on_result)


def _run(
    paths: Sequence[str],
    task: Task,
    args: tuple[Any, ...] | Callable[[], tuple[Any, ...]],
    jobs: int,
    watchdog_s: float,
    on_result: Callable[[int, SubmissionResult], None],
) -> list[SubmissionResult]:
    context = _context()
    results: dict[int, SubmissionResult] = {}
    waiting, running = list(enumerate(paths)), []

    def finish(job: _Job, result: SubmissionResult) -> None:
        running.remove(job)
        job.conn.close()
        job.process.join(timeout=5)
        remove_tree(job.workdir)
        results[job.index] = result
        on_result(job.index, result)

    while waiting or running:
        starting = []
        while waiting and len(running) < max(1, jobs):
            index, path = waiting.pop(0)
            ours, theirs = context.Pipe()
            process = context.Process(target=_start, args=(theirs, task), daemon=True)
            process.start()
            theirs.close()
            try:
                ours.send(dict(os.environ))
            except OSError:  # it died at once; its sentinel says so below
                pass
            running.append(_Job(index, path, process, ours, tempfile.mkdtemp(prefix="nanolab-worker-")))
            starting.append(running[-1])
        if callable(args):
            args = args()
        for job in starting:
            try:
                job.conn.send((job.workdir, job.path, *args))
            except OSError:  # it died at once; its sentinel says so below
                pass
        now = time.monotonic()
        timeout = max(0.0, min(job.started + watchdog_s for job in running) - now)
        ready = wait([job.conn for job in running] + [job.process.sentinel for job in running], timeout)
        for job in list(running):
            if job.conn in ready or job.process.sentinel in ready:
                _drain(job)
            if job.result is None and not job.process.is_alive():
                _drain(job)  # it may have ended just after sending its result
            if job.result is not None:
                finish(job, SubmissionResult.from_dict(job.result))
            elif not job.process.is_alive():
                finish(job, _died(job))
            elif time.monotonic() - job.started > watchdog_s:
                job.process.kill()
                finish(job, _stopped(job, watchdog_s))
    return [results[i] for i in range(len(paths))]


def _context() -> multiprocessing.context.BaseContext:
    """Where workers come from: the fork server, its preload set before its first start (it is one per
    process; one started earlier by other code keeps its own preload, and workers import what it lacks)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["autograder.grading.zygote"])
    return context


def _start(conn: Connection, task: Task) -> None:
    """A worker's first step: the batch's environment as it is now (a forked worker has the fork server's,
    from when that started), then the task."""
    environment = conn.recv()
    os.environ.clear()
    os.environ.update(environment)
    task(conn)


def _drain(job: _Job) -> None:
    """Take every message the worker has sent so far."""
    try:
        while job.result is None and job.conn.poll():
            kind, data = job.conn.recv()
            if kind == "lab":
                job.lab = data
            elif kind == "collected":
                job.tests = {test["id"]: test for test in data}
            elif kind == "test":
                job.tests[data["id"]] = data
            elif kind == "done":
                job.result = data
    except (EOFError, OSError):
        pass


def _stopped(job: _Job, watchdog_s: float) -> SubmissionResult:
    """The result of a notebook whose worker the watchdog stopped."""
    why = (
        f"grading this notebook was stopped after {watchdog_s:g} s (the grader's limit for one notebook); "
        "the tests that had not finished get no points"
    )
    tests = [TestResult(**test) for test in job.tests.values()]
    for test in tests:
        if test.status != "passed" and test.output == "did not run":
            test.output = why
    return SubmissionResult(submission=job.path, lab=job.lab, tests=tests, messages=[why])


def _died(job: _Job) -> SubmissionResult:
    code = job.process.exitcode
    message = (
        f"the grader failed on this notebook (its grading process died, exit code {code}); "
        "grade it again on its own"
    )
    return SubmissionResult(
        submission=job.path, lab=job.lab, graded=False, messages=[message], internal_error=message
    )
