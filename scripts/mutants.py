"""Measure a lab's tests with its mutants: how many planted learner bugs the hidden tests and the visible
checks catch.

    python scripts/mutants.py --lab 1                       # make mutants LAB=1
    python scripts/mutants.py --lab 2 --jobs 2 --json build/mutants/lab02.json
    python scripts/mutants.py --lab 1 --only merge-last-pair,tm-tie-largest --seeds 5,6,7
    python scripts/mutants.py --lab 8 --quick --seeds 1     # make mutants LAB=8 MUTANTS_ARGS="--quick --seeds 1"

Each mutant of ``autograder/mutants/labNN.toml`` is the solution notebook with one planted bug. It

- runs top to bottom on a Jupyter kernel (nbclient, as ``make solutions`` runs notebooks), carrying on
  past errors. The visible checks (nbgrader ``grade: true`` code cells that are not hidden-test cells)
  whose cell raised are the ones that caught it. Cells after the last check are not run: they cannot
  change a check's verdict. A cell that runs longer than ``--cell-timeout`` is interrupted;
- is graded by the hidden tests once per grading seed, by the grader's own `grade_notebook` (what
  ``nanolab grade`` runs, with its default limits). The hidden tests catch a mutant only if it loses
  points on *every* seed. One that loses points on some seeds only is reported apart: whether it is
  caught depends on the random inputs, so the test that should catch it is weak.

First the unchanged solution goes through both: every check must pass and every seed give full marks,
or the measurement means nothing. Tasks run ``--jobs`` at a time in worker processes that keep the
grader and its imports loaded from one mutant to the next.

``--quick`` leaves out of the notebook runs every code cell marked slow in its metadata
(``"nanolab": {"slow": true}``: a live experiment such as a server or a load sweep, or a check of one).
Those cells are never run, so they never catch a mutant: the visible rate then counts only the checks
that ran, and the report says so and names the checks left out. The hidden tests are the same.

Interrupted (Ctrl-C, SIGTERM) or when a task fails, the script stops its workers, and each worker first
kills every process it started (kernels, sandboxes, whatever a notebook left running); a worker also
stops when the script's process dies.

Exit status: 0 when both kill rates reach their targets (`autograder.mutants.HIDDEN_TARGET` and
`VISIBLE_TARGET`); 1 when a rate is under its target, a mutant no longer applies to its solution cell,
or the solution itself does not pass; 2 for bad arguments; 130 when interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `autograder` from this checkout, also when run as a script

from autograder.mutants import (  # noqa: E402
    HIDDEN_TARGET,
    MIN_MUTANTS,
    VISIBLE_TARGET,
    Mutant,
    MutantError,
    MutantSet,
    apply_mutant,
    load_mutant_set,
)
from autograder.sandbox import proctree  # noqa: E402

DEFAULT_SEEDS = (1, 2, 3)
SOLUTION = "solution"  # the key of the unchanged notebook's results
HIDDEN_TESTS_MARK = "### BEGIN HIDDEN TESTS"


# ---------------------------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class Task:
    """One unit of work for a worker: run a notebook's visible checks, or grade it with one seed."""

    key: str  # mutant id, or SOLUTION
    kind: str  # "visible" or "hidden"
    notebook: str  # the notebook's JSON text
    lab: int
    seed: int | None = None
    cell_timeout: float = 60.0
    call_timeout: float = 30.0
    tests_dir: str | None = None
    quick: bool = False  # leave the slow cells out of the notebook run


def visible_checks(notebook: dict) -> list[str]:
    """grade_ids of the visible check cells: nbgrader ``grade: true`` code cells that are neither solution
    cells nor hidden-test cells, in notebook order."""
    ids = []
    for cell in notebook["cells"]:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if (
            cell.get("cell_type") == "code"
            and meta.get("grade")
            and not meta.get("solution")
            and HIDDEN_TESTS_MARK not in source
        ):
            ids.append(meta["grade_id"])
    return ids


def is_slow(cell: dict) -> bool:
    """A code cell marked ``"nanolab": {"slow": true}``: a live experiment (a server, a load sweep), or a
    check that depends on one."""
    meta = cell.get("metadata", {}).get("nanolab")
    return cell.get("cell_type") == "code" and isinstance(meta, dict) and meta.get("slow") is True


def _cell_name(cell: dict) -> str:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") or cell.get("id", "?")


def _first_line(text: str, limit: int = 160) -> str:
    line = next((s for s in text.strip().splitlines() if s.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def run_visible(task: Task) -> dict[str, Any]:
    """Run the notebook top to bottom (up to its last check; without its slow cells if ``task.quick``) and
    say which cells raised, and why, and which checks did not run."""
    import nbformat
    from nbclient.exceptions import DeadKernelError
    from run_solutions import kernel_env, notebook_client

    nb = nbformat.reads(task.notebook, as_version=4)
    every_check = visible_checks(nb)
    left_out = [_cell_name(c) for c in nb.cells if task.quick and is_slow(c)]
    if task.quick:  # out of the notebook: a cell that never runs can never count as a catch
        nb.cells = [c for c in nb.cells if not is_slow(c)]
    checks = visible_checks(nb)
    ids = [c.get("metadata", {}).get("nbgrader", {}).get("grade_id") for c in nb.cells]
    if checks:
        nb.cells = nb.cells[: max(i for i, g in enumerate(ids) if g in checks) + 1]
    died = None
    start = time.perf_counter()
    env = kernel_env()
    with notebook_client(
        nb,
        timeout=task.cell_timeout,
        interrupt_on_timeout=True,  # a cell that hangs is interrupted (KeyboardInterrupt) and the run goes on
        allow_errors=True,
        resources={"metadata": {"path": str(ROOT / "solutions")}},
    ) as client:
        try:
            _in_thread(lambda: client.execute(env=env))
        except DeadKernelError as e:
            died = f"the kernel died ({e})"
    failed: dict[str, str] = {}  # check grade_id -> why
    errors: dict[str, str] = {}  # other cells that raised -> why
    for cell in nb.cells:
        grade_id = _cell_name(cell)
        if cell.cell_type != "code":
            continue
        error = next((o for o in cell.get("outputs", []) if o.get("output_type") == "error"), None)
        if error is not None:
            why = f"{error.get('ename')}: {_first_line(error.get('evalue', ''))}"
        elif died and cell.get("execution_count") is None:
            why = f"not run: {died}"
        else:
            continue
        (failed if grade_id in checks else errors)[grade_id] = why
    return {
        "checks": checks,  # those that ran
        "checks_not_run": [c for c in every_check if c not in checks],
        "cells_left_out": left_out,
        "failed": failed,
        "errors": errors,
        "seconds": time.perf_counter() - start,
    }


def _in_thread(run: Callable[[], object]) -> None:
    """``run()`` in a thread of its own, its error raised here.

    nbclient puts its own SIGINT and SIGTERM handlers on the main thread while a notebook runs, and the
    defaults back after it, which would take a worker's (`_start_worker`) away; from another thread it
    cannot. When a stop signal interrupts the wait, the worker has killed the kernel: the run ends soon,
    and is given a moment to clean up."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            run()
        except BaseException as e:  # noqa: B036 - raised again in the caller's thread
            errors.append(e)

    thread = threading.Thread(target=target, name="notebook", daemon=True)
    thread.start()
    try:
        thread.join()
    except BaseException:
        thread.join(timeout=5.0)
        raise
    if errors:
        raise errors[0]


_TESTS: dict[str, tuple] = {}  # the hidden tests, read once per worker process


def run_hidden(task: Task) -> dict[str, Any]:
    """Grade the notebook with the hidden tests and ``task.seed``, as ``nanolab grade --seed`` does."""
    from autograder.grading.grade import DEFAULT_TESTS_DIR, GradeOptions, grade_notebook
    from autograder.sandbox.limits import Limits

    tests_dir = Path(task.tests_dir) if task.tests_dir else DEFAULT_TESTS_DIR
    limits = Limits(call_timeout_s=task.call_timeout, load_timeout_s=max(60.0, 2 * task.call_timeout))
    options = GradeOptions(lab=task.lab, tests_dir=tests_dir, limits=limits, seed=task.seed).resolved()
    if str(tests_dir) not in _TESTS:  # read once per worker, like the grader does per batch
        _TESTS[str(tests_dir)] = options.read_tests()
    with tempfile.TemporaryDirectory(prefix="nanolab-mutant-") as tmp:
        path = Path(tmp) / f"{task.key}.ipynb"
        path.write_text(task.notebook, encoding="utf-8")
        result = grade_notebook(path, options, _TESTS[str(tests_dir)])
    return {
        "seed": task.seed,
        "score": result.score,
        "max_score": result.max_score,
        "failed": {t.id: _first_line(t.output) for t in result.tests if t.status != "passed"},
        "internal_error": result.internal_error,
        "seconds": result.execution_time,
    }


# ---------------------------------------------------------------------------------------------- workers

_worker = False  # this process is a worker of `run_all`
_busy = False  # it is running a task
_stopping = False  # it was told to stop


def _start_worker(parent: int) -> None:
    """A worker's set-up: it stops on SIGTERM or SIGINT, and when the script's process dies (Linux)."""
    global _worker
    _worker = True
    proctree.become_subreaper()  # what a kernel leaves behind stays below this worker, where it is found
    signal.signal(signal.SIGTERM, _stop_worker)
    signal.signal(signal.SIGINT, _stop_worker)  # Ctrl-C reaches the whole process group
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the script died before the line above
        _stop_worker(signal.SIGTERM, None)


def _stop_worker(signum: int, frame: Any) -> None:
    """Kill every process this worker started (kernels, sandboxes, servers a notebook started), then end:
    at once when idle, else once the running task has unwound (its temporary folders removed)."""
    global _stopping
    _stopping = True
    proctree.kill_tree(os.getpid(), include_root=False)
    if _busy:
        raise KeyboardInterrupt
    os._exit(128 + signum)


def run_task(task: Task) -> dict[str, Any]:
    global _busy
    _busy = True
    try:
        return run_visible(task) if task.kind == "visible" else run_hidden(task)
    finally:
        _busy = False
        if _worker:  # whatever the notebook left running goes, so that no task inherits it
            proctree.kill_tree(os.getpid(), include_root=False)
            proctree.reap()
            if _stopping:
                os._exit(1)


# ---------------------------------------------------------------------------------------------- verdicts


@dataclass
class Verdict:
    """What the visible checks and the hidden tests made of one notebook."""

    key: str
    bug: str
    grade_id: str
    visible: dict[str, Any] = field(default_factory=dict)
    hidden: list[dict[str, Any]] = field(default_factory=list)  # one per seed, in seed order

    @property
    def visible_caught(self) -> bool:
        return bool(self.visible.get("failed"))

    @property
    def losing_seeds(self) -> list[int]:
        return [h["seed"] for h in self.hidden if h["score"] < h["max_score"]]

    @property
    def hidden_status(self) -> str:
        """What the hidden tests made of it: "caught" (points lost on every seed), "some seeds" or "survived"."""
        losing = len(self.losing_seeds)
        return "caught" if losing == len(self.hidden) else "some seeds" if losing else "survived"

    @property
    def tests_every_seed(self) -> list[str]:
        sets = [set(h["failed"]) for h in self.hidden]
        common = set.intersection(*sets) if sets else set()
        return [t for t in self.hidden[0]["failed"] if t in common] if self.hidden else []

    @property
    def tests_some_seeds(self) -> list[str]:
        every = set(self.tests_every_seed)
        seen: list[str] = []
        for h in self.hidden:
            seen += [t for t in h["failed"] if t not in every and t not in seen]
        return seen

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.key,
            "grade_id": self.grade_id,
            "bug": self.bug,
            "visible": {"caught": self.visible_caught, **self.visible},
            "hidden": {
                "status": self.hidden_status,
                "tests_every_seed": self.tests_every_seed,
                "tests_some_seeds": self.tests_some_seeds,
                "seeds": self.hidden,
            },
        }


def _rate(caught: int, total: int) -> float:
    return caught / total if total else 0.0


@dataclass(frozen=True)
class Scope:
    """Which visible checks the notebook runs had: all of them, or under ``--quick`` those left once the
    slow cells are out (read from the solution's run; a mutant changes no cell's metadata)."""

    quick: bool
    checks_run: list[str]
    checks_not_run: list[str]
    cells_left_out: list[str]

    @classmethod
    def of(cls, quick: bool, visible: dict[str, Any]) -> Scope:
        return cls(quick, visible["checks"], visible["checks_not_run"], visible["cells_left_out"])

    @property
    def note(self) -> str | None:
        """What the visible rate counts, when that is not every check; None when it is."""
        if not self.quick:
            return None
        if not self.cells_left_out:
            return "--quick: the notebook has no slow cells, so every check ran"
        note = f"the notebooks ran with the slow cells left out (--quick: {', '.join(self.cells_left_out)})"
        if not self.checks_not_run:
            return note + "; every check ran"
        return (
            f"{note}: the checks {', '.join(self.checks_not_run)} did not run, so the visible rate counts "
            f"only the {len(self.checks_run)} checks that ran"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "quick": self.quick,
            "checks_run": self.checks_run,
            "checks_not_run": self.checks_not_run,
            "cells_left_out": self.cells_left_out,
            "note": self.note,
        }


def print_report(
    lab: int, verdicts: list[Verdict], seeds: list[int], out: Any = None, scope: Scope | None = None
) -> None:
    """One block per mutant: its verdicts and scores, the bug it models, and which checks and tests caught it."""
    out = sys.stdout if out is None else out
    width = max([len(v.key) for v in verdicts] + [6])
    print(f"Lab {lab}: {len(verdicts)} mutants; hidden tests graded with seeds {seeds}", file=out)
    if scope is not None and scope.note:
        print(scope.note, file=out)
    print(file=out)
    print(f"{'mutant':<{width}}  {'visible':<8}  {'hidden':<10}  score per seed", file=out)
    for v in verdicts:
        visible = "caught" if v.visible_caught else "-"
        hidden = {"caught": "caught", "some seeds": "SOME SEEDS", "survived": "-"}[v.hidden_status]
        scores = " ".join(f"{h['score']:g}/{h['max_score']:g}" for h in v.hidden)
        print(f"{v.key:<{width}}  {visible:<8}  {hidden:<10}  {scores}", file=out)
        print(f"    bug: {v.bug}", file=out)
        print(f"    visible checks: {', '.join(v.visible['failed']) or 'none failed'}", file=out)
        tests = ", ".join(v.tests_every_seed) or "none on every seed"
        if v.tests_some_seeds:
            tests += "; on some seeds only: " + ", ".join(v.tests_some_seeds)
        print(f"    hidden tests: {tests}", file=out)


@dataclass(frozen=True)
class Rates:
    """The two kill rates, and whether both reach their targets."""

    hidden: float
    visible: float

    @property
    def ok(self) -> bool:
        return self.hidden >= HIDDEN_TARGET and self.visible >= VISIBLE_TARGET


def summarize(verdicts: list[Verdict], out: Any = None, scope: Scope | None = None) -> Rates:
    """Print both kill rates against their targets (and what the visible one counts), the weak spots and
    the survivors."""
    out = sys.stdout if out is None else out
    total = len(verdicts)
    hidden = sum(v.hidden_status == "caught" for v in verdicts)
    visible = sum(v.visible_caught for v in verdicts)
    rates = Rates(_rate(hidden, total), _rate(visible, total))
    print(file=out)
    for name, caught, rate, target in (
        ("hidden tests", hidden, rates.hidden, HIDDEN_TARGET),
        ("visible checks", visible, rates.visible, VISIBLE_TARGET),
    ):
        verdict = "ok" if rate >= target else "BELOW TARGET"
        print(
            f"{name:<15} caught {caught:>2} of {total} mutants: {rate:6.1%}  (target {target:.0%})  {verdict}",
            file=out,
        )
    if scope is not None and scope.note:
        print(f"  ({scope.note})", file=out)
    some = [v.key for v in verdicts if v.hidden_status == "some seeds"]
    if some:
        print(f"caught by the hidden tests on some seeds only (weak tests): {', '.join(some)}", file=out)
    hidden_survivors = [v.key for v in verdicts if v.hidden_status == "survived"]
    if hidden_survivors:
        print(f"survived the hidden tests: {', '.join(hidden_survivors)}", file=out)
    visible_survivors = [v.key for v in verdicts if not v.visible_caught]
    if visible_survivors:
        print(f"survived the visible checks: {', '.join(visible_survivors)}", file=out)
    both = [v.key for v in verdicts if not v.visible_caught and v.hidden_status == "survived"]
    if both:
        print(
            f"survived everything: {', '.join(both)} (a blind spot of both, or a mutant equivalent to the "
            "solution, which belongs out of the set)",
            file=out,
        )
    return rates


# ---------------------------------------------------------------------------------------------- main


def build_notebooks(mutant_set: MutantSet, only: list[str] | None) -> tuple[str, list[tuple[Mutant, str]]]:
    """The solution's JSON text, and each selected mutant with its notebook's JSON text.

    Raises MutantError (naming the mutant and its cell) for a mutant that no longer applies.
    """
    solution = json.loads(mutant_set.solution.read_text(encoding="utf-8"))
    selected = [mutant_set.get(i) for i in only] if only else list(mutant_set.mutants)
    notebooks = [
        (m, json.dumps(apply_mutant(m, solution, mutant_set.path), ensure_ascii=False)) for m in selected
    ]
    return json.dumps(solution, ensure_ascii=False), notebooks


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _stop_workers(workers: list[multiprocessing.process.BaseProcess], grace: float = 10.0) -> None:
    """SIGTERM each worker (it kills what it started, then ends); after ``grace`` seconds, kill what is
    left of a worker's tree from here."""
    for worker in workers:
        worker.terminate()
    deadline = time.monotonic() + grace
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            proctree.kill_tree(worker.pid)
            worker.join()


def run_all(tasks: list[Task], jobs: int, progress: bool) -> list[tuple[Task, dict[str, Any]]]:
    """Run ``tasks`` in ``jobs`` worker processes; results in task order.

    Interrupted (KeyboardInterrupt; SIGTERM raises it here) or when a task raises, the tasks not started
    are cancelled and the workers stopped, with every process they started, before the error goes on.
    """
    from tqdm.auto import tqdm

    results: dict[int, dict[str, Any]] = {}
    context = multiprocessing.get_context("spawn")
    others = set(multiprocessing.active_children())
    pool = ProcessPoolExecutor(
        max_workers=jobs, mp_context=context, initializer=_start_worker, initargs=(os.getpid(),)
    )
    handlers = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with tqdm(total=len(tasks), desc="mutants", unit="run", disable=not progress) as bar:
            futures = {pool.submit(run_task, task): i for i, task in enumerate(tasks)}
            for future in as_completed(futures):
                i = futures[future]
                task = tasks[i]
                bar.set_postfix_str(f"{task.key} {task.kind}", refresh=False)
                results[i] = future.result()
                bar.update()
    except BaseException:
        # Otherwise the workers would run the tasks already queued, kernels and all, and then wait
        # for more forever, orphaned once this process ends. A second Ctrl-C must not cut this short.
        for s in handlers:
            signal.signal(s, signal.SIG_IGN)
        pool.shutdown(wait=False, cancel_futures=True)
        _stop_workers([p for p in multiprocessing.active_children() if p not in others])
        pool.shutdown()  # its queues and their semaphores, now that no worker holds them
        raise
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    pool.shutdown()
    return [(task, results[i]) for i, task in enumerate(tasks)]


def _parse_ints(text: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("give at least one seed")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lab", type=int, required=True, help="the lab whose mutant set to run")
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="tasks run in parallel (default: cores)"
    )
    parser.add_argument(
        "--seeds",
        type=_parse_ints,
        default=list(DEFAULT_SEEDS),
        help="grading seeds, comma-separated (default: %(default)s); caught means caught on every one",
    )
    parser.add_argument("--only", help="comma-separated mutant ids: run just these")
    parser.add_argument(
        "--set",
        type=Path,
        metavar="TOML",
        help="the mutant set to run (default: autograder/mutants/labNN.toml)",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the full report as JSON to PATH")
    parser.add_argument(
        "--tests", type=Path, metavar="DIR", help="hidden tests folder (default: the grader's)"
    )
    parser.add_argument(
        "--cell-timeout", type=float, default=60.0, help="seconds a notebook cell may run (default 60)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds one graded call may take (nanolab grade's default)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="leave the cells marked slow (live experiments, and the checks of them) out of the notebook "
        "runs; the visible rate then counts only the checks that ran",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")

    try:
        mutant_set = load_mutant_set(args.lab, args.set)
        only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
        solution, notebooks = build_notebooks(mutant_set, only)
    except (MutantError, ValueError) as e:
        print(f"mutants: {e}", file=sys.stderr)
        return 1
    if only is None and len(notebooks) < MIN_MUTANTS:
        print(
            f"mutants: {mutant_set.path.name} has {len(notebooks)} mutants; measuring a lab takes at least "
            f"{MIN_MUTANTS}",
            file=sys.stderr,
        )
        return 1

    from run_solutions import ensure_kernel

    ensure_kernel()
    common = dict(
        lab=args.lab,
        cell_timeout=args.cell_timeout,
        call_timeout=args.timeout,
        tests_dir=str(args.tests) if args.tests else None,
    )
    tasks = []
    for key, text in [(SOLUTION, solution), *((m.id, text) for m, text in notebooks)]:
        tasks.append(Task(key, "visible", text, quick=args.quick, **common))
        tasks += [Task(key, "hidden", text, seed=seed, **common) for seed in args.seeds]

    start = time.monotonic()
    try:
        results = run_all(tasks, min(args.jobs, len(tasks)), progress=sys.stderr.isatty())
    except KeyboardInterrupt:
        print("mutants: interrupted; the workers and the kernels they started were stopped", file=sys.stderr)
        return 130
    elapsed = time.monotonic() - start

    bugs = {m.id: m for m, _ in notebooks}
    verdicts = {
        key: Verdict(key, bugs[key].bug if key in bugs else "", bugs[key].grade_id if key in bugs else "")
        for key in [SOLUTION, *bugs]
    }
    for task, result in results:
        if task.kind == "visible":
            verdicts[task.key].visible = result
        else:
            verdicts[task.key].hidden.append(result)
    broken = [
        f"{task.key} (seed {task.seed}): {result['internal_error']}"
        for task, result in results
        if task.kind == "hidden" and result["internal_error"]
    ]
    if broken:
        print("mutants: the grader could not grade:\n  " + "\n  ".join(broken), file=sys.stderr)
        return 1

    baseline = verdicts.pop(SOLUTION)
    problems = [f"its check {g} fails ({why})" for g, why in baseline.visible["failed"].items()]
    problems += [f"its cell {g} raises ({why})" for g, why in baseline.visible["errors"].items()]
    problems += [
        f"seed {h['seed']} gives {h['score']:g}/{h['max_score']:g} ({', '.join(h['failed'])})"
        for h in baseline.hidden
        if h["score"] < h["max_score"]
    ]
    scope = Scope.of(args.quick, baseline.visible)
    if args.quick and (baseline.visible["failed"] or baseline.visible["errors"]):
        problems.append("with --quick, a cell that needs a slow cell must be marked slow itself")
    mutants = list(verdicts.values())
    print_report(args.lab, mutants, args.seeds, scope=scope)
    rates = summarize(mutants, scope=scope)
    print(f"\n{len(tasks)} runs in {elapsed:.0f} s with {args.jobs} jobs")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "lab": args.lab,
            "mutant_set": str(mutant_set.path),
            "seeds": args.seeds,
            "targets": {"hidden": HIDDEN_TARGET, "visible": VISIBLE_TARGET, "min_mutants": MIN_MUTANTS},
            "rates": {"hidden": rates.hidden, "visible": rates.visible},
            "quick": args.quick,
            "visible_checks": scope.to_dict(),  # which checks the visible rate counts
            "ok": rates.ok and not problems,
            "seconds": elapsed,
            "solution": baseline.to_dict(),
            "mutants": [v.to_dict() for v in mutants],
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if problems:
        print(
            "mutants: the unchanged solution does not pass, so these rates mean nothing: "
            + "; ".join(problems),
            file=sys.stderr,
        )
        return 1
    return 0 if rates.ok else 1


if __name__ == "__main__":
    sys.exit(main())
