"""Measure a lab's tests with its mutants: how many planted learner bugs the hidden tests and the visible
checks catch.

    python scripts/mutants.py --lab 1                       # make mutants LAB=1
    python scripts/mutants.py --lab 2 --jobs 2 --json build/mutants/lab02.json
    python scripts/mutants.py --lab 1 --only merge-last-pair,tm-tie-largest --seeds 5,6,7

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

Exit status: 0 when both kill rates reach their targets (`autograder.mutants.HIDDEN_TARGET` and
`VISIBLE_TARGET`); 1 when a rate is under its target, a mutant no longer applies to its solution cell,
or the solution itself does not pass; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
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


def _first_line(text: str, limit: int = 160) -> str:
    line = next((s for s in text.strip().splitlines() if s.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def run_visible(task: Task) -> dict[str, Any]:
    """Run the notebook top to bottom (up to its last check) and say which cells raised, and why."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError
    from run_solutions import KERNEL

    nb = nbformat.reads(task.notebook, as_version=4)
    checks = visible_checks(nb)
    ids = [c.get("metadata", {}).get("nbgrader", {}).get("grade_id") for c in nb.cells]
    if checks:
        nb.cells = nb.cells[: max(i for i, g in enumerate(ids) if g in checks) + 1]
    client = NotebookClient(
        nb,
        kernel_name=KERNEL,
        timeout=task.cell_timeout,
        interrupt_on_timeout=True,  # a cell that hangs is interrupted (KeyboardInterrupt) and the run goes on
        allow_errors=True,
        resources={"metadata": {"path": str(ROOT / "solutions")}},
    )
    died = None
    start = time.perf_counter()
    try:
        client.execute(
            env={
                **os.environ,
                "CUDA_VISIBLE_DEVICES": "",
                "MPLBACKEND": "module://matplotlib_inline.backend_inline",
            }
        )
    except DeadKernelError as e:
        died = f"the kernel died ({e})"
    failed: dict[str, str] = {}  # check grade_id -> why
    errors: dict[str, str] = {}  # other cells that raised -> why
    for cell in nb.cells:
        grade_id = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") or cell.get("id", "?")
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
    return {"checks": checks, "failed": failed, "errors": errors, "seconds": time.perf_counter() - start}


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


def run_task(task: Task) -> dict[str, Any]:
    return run_visible(task) if task.kind == "visible" else run_hidden(task)


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


def print_report(lab: int, verdicts: list[Verdict], seeds: list[int], out: Any = sys.stdout) -> None:
    """One block per mutant: its verdicts and scores, the bug it models, and which checks and tests caught it."""
    width = max([len(v.key) for v in verdicts] + [6])
    print(f"Lab {lab}: {len(verdicts)} mutants; hidden tests graded with seeds {seeds}\n", file=out)
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


def summarize(verdicts: list[Verdict], out: Any = sys.stdout) -> Rates:
    """Print both kill rates against their targets, the weak spots and the survivors."""
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


def run_all(tasks: list[Task], jobs: int, progress: bool) -> list[tuple[Task, dict[str, Any]]]:
    """Run ``tasks`` in ``jobs`` worker processes; results in task order."""
    from tqdm.auto import tqdm

    results: dict[int, dict[str, Any]] = {}
    context = multiprocessing.get_context("spawn")
    with (
        ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool,
        tqdm(total=len(tasks), desc="mutants", unit="run", disable=not progress) as bar,
    ):
        futures = {pool.submit(run_task, task): i for i, task in enumerate(tasks)}
        for future in as_completed(futures):
            i = futures[future]
            task = tasks[i]
            bar.set_postfix_str(f"{task.key} {task.kind}", refresh=False)
            results[i] = future.result()
            bar.update()
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
        tasks.append(Task(key, "visible", text, **common))
        tasks += [Task(key, "hidden", text, seed=seed, **common) for seed in args.seeds]

    start = time.monotonic()
    results = run_all(tasks, min(args.jobs, len(tasks)), progress=sys.stderr.isatty())
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
    mutants = list(verdicts.values())
    print_report(args.lab, mutants, args.seeds)
    rates = summarize(mutants)
    print(f"\n{len(tasks)} runs in {elapsed:.0f} s with {args.jobs} jobs")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "lab": args.lab,
            "mutant_set": str(mutant_set.path),
            "seeds": args.seeds,
            "targets": {"hidden": HIDDEN_TARGET, "visible": VISIBLE_TARGET, "min_mutants": MIN_MUTANTS},
            "rates": {"hidden": rates.hidden, "visible": rates.visible},
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
