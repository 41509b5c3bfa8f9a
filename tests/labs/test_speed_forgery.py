"""Speed points cannot be forged by rewriting a lab's helper in place (Labs 3 to 7).

A learner's graded object may be correct but slow. The notebook's helpers (``replay``, ``replay_schedule``,
``replay_cache``, ``run_engine``, ``run_static``) are the lab's setup code, which the grader runs itself, but a
graded cell can still rewrite such a function in place (its code object), so that it plays a fast private copy
of the lab's solution and then copies that copy's state onto the graded object. A speed test that timed the
helper would then time the copy and read back a forged, correct state. The hidden speed tests instead drive
the graded object itself from the grader (`autograder.testing.Calls`), so such a notebook fails the speed test
on its CPU time, like the same slow code without the rewrite.

Lab 7's step-by-step tests also drive the Engine from the grader: a blank Lab 7 whose graded cell rewrites
``run_engine`` and ``run_static`` in place to run a correct engine of its own earns nothing from them.

Each notebook is graded against a copy of one hidden test module that keeps only the tests named, which keeps
the run short.
"""

from __future__ import annotations

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers.grading_utils import FORGED_SCHEDULE, cell

from autograder.grading.grade import DEFAULT_TESTS_DIR, GradeOptions, grade
from autograder.sandbox.limits import Limits

ROOT = Path(__file__).resolve().parents[2]
LIMITS = Limits(call_timeout_s=30, load_timeout_s=60, cpu_s=300, notebook_s=240)

# The graded method spins first (correct, but slow): `_burn` goes before the graded cell's code and a call of it
# at the start of the method. After the cell's code, the setup's helper is rewritten in place (`REWRITE`) to
# play a private copy of the solution and forge the graded object's state.
BURN = """
import time as _time
import types as _types


def _burn():
    start = _time.process_time()
    while _time.process_time() - start < {seconds}:
        pass


"""

REWRITE = """
{helper}.__globals__["_plain_{helper}"] = _types.FunctionType(
    {helper}.__code__, {helper}.__globals__, "_plain_{helper}", {helper}.__defaults__
)


def _rewritten_{helper}{signature}:
    namespace = dict(globals())
    exec({own!r}, namespace)
{body}


{helper}.__code__ = _rewritten_{helper}.__code__
"""

SCHEDULER_BODY = FORGED_SCHEDULE.format(replay="_plain_replay_schedule")

ENGINE_CELLS = ("layout-batch", "stop-rules", "detokenizer", "engine")

# lab: (notebook, graded cell, class, slow method, seconds per call, hidden test module, speed test,
#       [(helper, signature, body)], the solution's cells the private copy runs)
CASES = {
    3: (
        "lab03_paged_kv.ipynb", "block-allocator", "BlockAllocator", "allocate", 0.001, "test_lab03.py",
        "test_allocator_speed_is_within_budget",
        [("replay", "(allocator, ops, record_state=True)", """\
    own = namespace["BlockAllocator"](allocator.num_total)
    records = _plain_replay(own, ops, record_state)
    allocator.__dict__.update(own.__dict__)
    return records""")],
        ("block-allocator",),
    ),
    4: (
        "lab04_schedulers.ipynb", "scheduler", "Scheduler", "schedule", 0.05, "test_lab04_engine.py",
        "test_schedule_speed_is_within_budget",
        [("replay_schedule", "(scheduler, events, new_request=None)", SCHEDULER_BODY)],
        ("transitions", "policies", "victim", "scheduler"),
    ),
    5: (
        "lab05_chunked_prefill.ipynb", "scheduler", "Scheduler", "schedule", 0.05, "test_lab05.py",
        "test_schedule_speed_is_within_budget",
        [("replay_schedule", "(scheduler, events, new_request=None)", SCHEDULER_BODY)],
        ("scheduler",),
    ),
    6: (
        "lab06_radix_cache.ipynb", "radix-cache", "RadixCache", "match_prefix", 0.005, "test_lab06.py",
        "test_cache_speed_is_within_budget",
        [("replay_cache", "(cache, ops)", """\
    allocator = type(cache.allocator)(cache.allocator.num_total)
    own = namespace["RadixCache"](allocator, cache.block_size)
    records = _plain_replay_cache(own, ops)
    original = cache.allocator
    cache.__dict__.update(own.__dict__)
    cache.allocator = original
    original.__dict__.update(allocator.__dict__)
    return records""")],
        ("radix-cache",),
    ),
    7: (
        "lab07_engine.ipynb", "engine", "Engine", "step", 0.005, "test_lab07.py",
        "test_loop_speed_is_within_budget",
        [("run_engine", "(engine_class, requests, settings=None, aborts=None, digest=False)", """\
    return _plain_run_engine(namespace["Engine"], requests, settings, aborts, digest)""")],
        ENGINE_CELLS,
    ),
}  # fmt: skip

# Lab 7's drivers, rewritten in a blank lab to run the solution's engine instead of the learner's stub.
ENGINE_DRIVERS = [
    CASES[7][7][0],
    ("run_static", "(generate, engine_class, requests, max_batch_size, settings=None)", """\
    return _plain_run_static(namespace["generate_static"], namespace["Engine"], requests, max_batch_size, settings)"""),
]  # fmt: skip
ENGINE_STEP_TESTS = (
    "test_engine_matches_the_reference_step_by_step",
    "test_aborts_free_every_block",
    "test_generate_static_matches_the_reference",
)


def solution_code(notebook: str, cells: tuple[str, ...]) -> str:
    solution = json.loads((ROOT / "solutions" / notebook).read_text())
    return "\n\n".join("".join(cell(solution, g)["source"]) for g in cells)


def rewrites(helpers: list[tuple[str, str, str]], own: str) -> str:
    return "".join(
        REWRITE.format(helper=h, signature=signature, own=own, body=body) for h, signature, body in helpers
    )


def forged(lab: int) -> dict:
    """The solution of ``lab``, its graded method slowed down, its helper rewritten in place (`BURN`, `REWRITE`)."""
    notebook, graded, cls, method, seconds, _, _, helpers, own_cells = CASES[lab]
    nb = json.loads((ROOT / "solutions" / notebook).read_text())
    target = cell(nb, graded)
    source = "".join(target["source"])
    start = re.compile(rf"^class {cls}\b", re.M).search(source).start()
    signature = re.compile(rf"\n    def {method}\(.*?:[ \t]*\n", re.S).search(source, start)
    assert signature is not None, f"no method {method} in {cls}"
    source = source[: signature.end()] + "        _burn()\n" + source[signature.end() :]
    own = rewrites(helpers, solution_code(notebook, own_cells))
    target["source"] = BURN.format(seconds=seconds) + source + "\n" + own
    return nb


def blank_engine_with_drivers_rewritten() -> dict:
    """The blank Lab 7 whose graded cell rewrites run_engine and run_static in place to run the solution."""
    nb = json.loads((ROOT / "labs" / "lab07_engine.ipynb").read_text())
    target = cell(nb, "engine")
    code = "\nimport types as _types\n" + rewrites(
        ENGINE_DRIVERS, solution_code("lab07_engine.ipynb", ENGINE_CELLS + ("static",))
    )
    target["source"] = "".join(target["source"]) + code
    return nb


def hidden_copy(base: Path, module: str, keep: tuple[str, ...]) -> Path:
    """A copy of the hidden tests holding only ``module``, with only the tests named in ``keep``."""
    folder = base / f"hidden_{Path(module).stem}_{len(keep)}"
    folder.mkdir()
    for extra in DEFAULT_TESTS_DIR.glob("conftest.py"):
        shutil.copy(extra, folder)
    text = (DEFAULT_TESTS_DIR / module).read_text()
    text += (
        "\n\nfor _name in [n for n in list(globals()) if n.startswith('test_') and n not in "
        f"{keep!r}]:\n    del globals()[_name]\n"
    )
    (folder / module).write_text(text)
    return folder


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("speed_forgery")
    results = {}
    for lab, case in CASES.items():
        path = base / f"forged_lab{lab}.ipynb"
        path.write_text(json.dumps(forged(lab)))
        options = GradeOptions(tests_dir=hidden_copy(base, case[5], (case[6],)), limits=LIMITS, seed=lab)
        results[lab] = (path, options)
    path = base / "blank_lab7_drivers.ipynb"
    path.write_text(json.dumps(blank_engine_with_drivers_rewritten()))
    options = GradeOptions(
        tests_dir=hidden_copy(base, "test_lab07.py", ENGINE_STEP_TESTS), limits=LIMITS, seed=7
    )
    results["drivers"] = (path, options)
    with ThreadPoolExecutor(2) as pool:  # two notebooks at a time, each graded in a worker of its own
        done = {
            key: pool.submit(grade, [path], options, progress=False)
            for key, (path, options) in results.items()
        }
        return {key: future.result()[0] for key, future in done.items()}


@pytest.mark.parametrize("lab", sorted(CASES))
def test_a_forged_speed_run_fails_the_speed_test_on_its_cpu_time(graded, lab):
    """The slow but correct graded object, whose helper plays a fast private copy and forges its state, fails
    the speed test because of its own CPU time or the wall-clock limit (not a wrong result): the grader timed
    the graded object."""
    result = graded[lab]
    [test] = result.tests
    assert test.id == CASES[lab][6]
    assert test.status == "failed", f"lab {lab}: the forged run earned the speed point"
    assert "of CPU time; the budget is" in test.output or "(time limit)" in test.output, test.output


def test_lab7_drivers_rewritten_in_place_earn_nothing(graded):
    """A blank Lab 7 whose graded cell rewrites run_engine and run_static in place to run a correct engine of
    its own earns nothing from the step-by-step, abort and static-batching tests: the grader drives the stub."""
    result = graded["drivers"]
    assert sorted(t.id for t in result.tests) == sorted(ENGINE_STEP_TESTS)
    assert result.score == 0, {t.id: t.output for t in result.tests}
    assert all(t.status == "failed" for t in result.tests)
