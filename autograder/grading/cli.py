"""``nanolab grade``: grade lab notebooks with the hidden tests and write the results.

Examples::

    nanolab grade work/lab01_tokenizer.ipynb                       # a learner checks their own work
    nanolab grade submissions/*/lab01*.ipynb --jobs 2 --csv grades.csv --json grades.json
    nanolab grade /autograder/submission/*.ipynb --gradescope /autograder/results/results.json
    nanolab grade submissions/*/lab01*.ipynb --tests ~/private-tests    # their test_lab01*.py as well

The exit status is 0 when every notebook was graded (whatever its score; a notebook that cannot be
graded scores zero), 1 when the grader itself or its hidden tests failed, or a results file could not
be written. Every run says on stderr whether submissions run in a bubblewrap sandbox
(`autograder.sandbox.isolation`), and how to get one when they do not.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

from autograder.grading.feedback import clean
from autograder.grading.grade import GradeOptions, grade
from autograder.grading.results import print_table, write_csv, write_gradescope, write_json
from autograder.sandbox import cgroups, isolation
from autograder.sandbox.limits import DEFAULT_MEMORY_MB, Limits
from autograder.submission.suite import EXTRA

DEFAULT_LIMITS = Limits()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("notebooks", nargs="+", metavar="NOTEBOOK", help="submitted .ipynb files")
    parser.add_argument("--lab", type=int, help="grade as this lab (default: the lab named in each notebook)")
    parser.add_argument(
        "--tests",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"a folder of your own tests test_labNN*.py, graded in addition to the built-in hidden tests "
        f"(their ids get the prefix '{EXTRA}/')",
    )
    parser.add_argument(
        "--gradescope",
        type=Path,
        metavar="F",
        help="write Gradescope's results.json to F (several notebooks: F is a folder, one file each)",
    )
    parser.add_argument("--json", type=Path, metavar="F", help="write all results as a JSON list to F")
    parser.add_argument(
        "--csv", type=Path, metavar="F", help="write one row per notebook, one column per test"
    )
    parser.add_argument(
        "--jobs", type=int, default=1, metavar="N", help="notebooks graded in parallel (default 1)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_LIMITS.call_timeout_s,
        metavar="S",
        help=f"seconds one call into a notebook's code may take (default {DEFAULT_LIMITS.call_timeout_s:g})",
    )
    parser.add_argument(
        "--memory-mb",
        type=int,
        default=None,
        metavar="M",
        help=f"memory for a notebook's code (default {DEFAULT_MEMORY_MB}, more for a lab that needs it)",
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="seed of the tests' random inputs (default: fresh)"
    )
    parser.add_argument(
        "--details", action="store_true", help="print every test's result, also for many notebooks"
    )
    parser.add_argument(
        "--similarity",
        action="store_true",
        help="report graded code shared between submissions, or with the reference, in the CSV "
        "(similar_to) and the JSON (similar); scores are not changed",
    )
    parser.add_argument(
        "--require-sandbox",
        action="store_true",
        help="grade nothing (exit 2) where the bubblewrap sandbox cannot start, rather than run the "
        "submissions' code as a plain process",
    )


def grade_options(args: argparse.Namespace) -> GradeOptions:
    """The `GradeOptions` the parsed command line asks for."""
    limits = Limits(
        call_timeout_s=args.timeout,
        load_timeout_s=max(DEFAULT_LIMITS.load_timeout_s, 2 * args.timeout),
        memory_mb=args.memory_mb,
    )
    return GradeOptions(lab=args.lab, extra_tests_dir=args.tests, limits=limits, seed=args.seed)


def run(args: argparse.Namespace) -> int:
    """Grade ``args.notebooks``; print the table and write the requested files."""
    if args.jobs < 1:
        print("nanolab grade: --jobs must be at least 1", file=sys.stderr)
        return 2
    if args.timeout <= 0:
        print("nanolab grade: --timeout must be positive", file=sys.stderr)
        return 2
    from autograder.grading.grade import DEFAULT_TESTS_DIR

    if args.tests is None and not DEFAULT_TESTS_DIR.is_dir():
        print(
            "nanolab grade: this nanolab has no hidden tests (a learner edition): your instructor grades your "
            "notebooks; the check cells in each notebook are your feedback as you work",
            file=sys.stderr,
        )
        return 2
    if args.tests is not None and not args.tests.is_dir():
        print(f"nanolab grade: the tests folder {args.tests} does not exist", file=sys.stderr)
        return 2
    if getattr(args, "require_sandbox", False) and not (status := isolation.status()).available:
        print(f"nanolab grade: {status.describe()}", file=sys.stderr)
        print("nanolab grade: --require-sandbox: nothing was graded", file=sys.stderr)
        return 2
    options = grade_options(args)
    threading.Thread(target=_say_which_sandbox, daemon=True).start()  # while the workers start
    _raise_soft_limits()
    jobs = min(args.jobs, os.cpu_count() or 1, len(args.notebooks))
    results = grade(args.notebooks, options, jobs=jobs, progress=sys.stderr.isatty())

    if getattr(args, "similarity", False):
        from autograder.grading.similarity import annotate

        annotate(results)
        for r in results:
            for m in r.similar:
                print(f"similar: {r.submission} shares {m['score']:.0%} of its graded code with {m['with']}")
    print_table(results, sys.stdout, details=True if args.details else None)
    status = isolation.status()
    if not status.available and any(r.confined is False for r in results):
        print(
            "WARNING: this kernel has no Landlock either, so submissions could write outside their "
            "directory; grade untrusted work in a container",
            file=sys.stderr,
        )
    failed = [r for r in results if r.internal_error]
    for r in failed:
        print(f"nanolab grade: {clean(r.submission)}: {clean(r.internal_error or '')}", file=sys.stderr)
    written = True
    for option, write in (
        (args.gradescope, write_gradescope),
        (args.json, write_json),
        (args.csv, write_csv),
    ):
        if option:
            try:
                write(results, option)
            except OSError as e:
                print(f"nanolab grade: could not write {option}: {e}", file=sys.stderr)
                written = False
    return 1 if failed or not written else 0


def _say_which_sandbox() -> None:
    """Print, as soon as it is known, whether submissions run in a bubblewrap sandbox and in cgroups."""
    for status in (isolation.status(), cgroups.status()):
        print(("" if status.available else "WARNING: ") + status.describe(), file=sys.stderr, flush=True)


def _raise_soft_limits() -> None:
    """Start from the hard limits: a soft limit lowered from outside (file size, open files) must not
    cost the batch its results files."""
    import resource

    for which in (resource.RLIMIT_FSIZE, resource.RLIMIT_NOFILE):
        try:
            _, hard = resource.getrlimit(which)
            resource.setrlimit(which, (hard, hard))
        except (ValueError, OSError):
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nanolab grade", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
