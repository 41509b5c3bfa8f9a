"""How scripts/mutants.py runs notebooks: ``--quick`` and stopping.

Under ``--quick`` a code cell marked ``"nanolab": {"slow": true}`` never runs, so a slow check cell can
never catch a mutant, and the report names the checks that did not run; without ``--quick`` the same
cell runs and counts. A run that is stopped (SIGTERM) or whose task fails leaves no worker, kernel or
process a notebook started behind. The notebooks here are tiny ones built in a temporary folder, run on
a real kernel.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from autograder.sandbox import proctree

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import mutants as script  # noqa: E402
from run_solutions import ensure_kernel  # noqa: E402

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads processes from /proc")


def _check(source: str, grade_id: str, slow: bool = False) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(source, id=grade_id)
    cell.metadata["nbgrader"] = {"grade": True, "grade_id": grade_id, "points": 1, "solution": False}
    if slow:
        cell.metadata["nanolab"] = {"slow": True}
    return cell


def _notebook(marker: Path) -> str:
    """A fast check that passes, a slow experiment that leaves ``marker`` behind, a slow check that
    fails, and a fast check after them."""
    experiment = nbformat.v4.new_code_cell(
        f"from pathlib import Path\nPath({str(marker)!r}).touch()", id="exp"
    )
    experiment.metadata["nanolab"] = {"slow": True}
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("x = 1", id="setup"),
        _check("assert x == 1", "check-x"),
        experiment,
        _check("assert False, 'the slow check fails'", "check-slow", slow=True),
        _check("assert x == 1", "check-after"),
    ]
    return nbformat.writes(nb)


def test_quick_never_runs_a_slow_cell_nor_counts_its_check(tmp_path):
    """--quick: the slow experiment does not run and the failing slow check is listed as not run, never
    as a catch; without --quick both run and the slow check catches."""
    ensure_kernel()
    marker = tmp_path / "experiment-ran"
    text = _notebook(marker)

    quick = script.run_visible(script.Task("m", "visible", text, lab=1, quick=True))
    assert not marker.exists()
    assert quick["failed"] == {} and quick["errors"] == {}
    assert quick["checks"] == ["check-x", "check-after"]
    assert quick["checks_not_run"] == ["check-slow"]
    assert quick["cells_left_out"] == ["exp", "check-slow"]
    assert script.Verdict("m", "bug", "cell", quick).visible_caught is False

    full = script.run_visible(script.Task("m", "visible", text, lab=1))
    assert marker.exists()
    assert list(full["failed"]) == ["check-slow"] and "the slow check fails" in full["failed"]["check-slow"]
    assert full["checks"] == ["check-x", "check-slow", "check-after"] and full["checks_not_run"] == []
    assert script.Verdict("m", "bug", "cell", full).visible_caught is True


def test_the_report_says_the_visible_rate_counts_only_the_checks_that_ran():
    visible = {
        "checks": ["check-x"],
        "checks_not_run": ["check-serve", "check-chaos"],
        "cells_left_out": ["serve", "check-serve", "chaos", "check-chaos"],
    }
    scope = script.Scope.of(True, visible)
    verdicts = [script.Verdict("m", "bug", "cell", {"failed": {}}, [])]
    out = io.StringIO()
    script.print_report(8, verdicts, [1], out, scope)
    script.summarize(verdicts, out, scope)
    text = out.getvalue()
    assert text.count("slow cells left out") == 2  # under the title and under the rates
    assert "check-serve, check-chaos did not run" in text
    assert "counts only the 1 checks that ran" in text
    assert scope.to_dict()["checks_not_run"] == ["check-serve", "check-chaos"]
    assert script.Scope.of(False, {**visible, "checks_not_run": [], "cells_left_out": []}).note is None


def test_quick_reaches_every_notebook_run_and_the_json_report(tmp_path, monkeypatch, capsys):
    """main --quick: every visible task leaves the slow cells out, the hidden ones are as without it, and
    the JSON report says which checks the visible rate counts."""
    seen: list[script.Task] = []

    def fake_run_all(tasks, jobs, progress):
        seen.extend(tasks)
        visible = {"checks": ["check-merge"], "checks_not_run": ["check-slow"], "cells_left_out": ["exp"]}
        hidden = {"score": 10.0, "max_score": 10.0, "failed": {}, "internal_error": None, "seconds": 0.0}
        return [
            (t, {**visible, "failed": {}, "errors": {}, "seconds": 0.0})
            if t.kind == "visible"
            else (t, {**hidden, "seed": t.seed})
            for t in tasks
        ]

    monkeypatch.setattr(script, "run_all", fake_run_all)
    report = tmp_path / "report.json"
    argv = ["--lab", "1", "--only", "merge-last-pair", "--seeds", "7", "--quick", "--json", str(report)]
    assert script.main(argv) == 1  # nothing caught: under both targets
    assert {(t.kind, t.quick) for t in seen} == {("visible", True), ("hidden", False)}
    data = json.loads(report.read_text())
    assert data["quick"] is True
    assert data["visible_checks"]["checks_not_run"] == ["check-slow"]
    assert "slow cells left out" in data["visible_checks"]["note"]
    assert "check-slow did not run" in capsys.readouterr().out


def _driver(tmp_path: Path, notebooks: list[str], jobs: int) -> list[str]:
    """A command that runs ``notebooks``' visible checks with ``run_all``, as the script does."""
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT / 'scripts')!r})\n"
        "import mutants\n"
        "if __name__ == '__main__':\n"
        f"    texts = {notebooks!r}\n"
        "    tasks = [mutants.Task(str(i), 'visible', t, lab=1, cell_timeout=600) for i, t in enumerate(texts)]\n"
        f"    mutants.run_all(tasks, {jobs}, progress=False)\n"
    )
    return [sys.executable, str(driver)]


def _stuck(pids: Path) -> str:
    """A notebook whose cell starts a child process, writes the pids of the worker, the kernel and the
    child to ``pids``, and waits for minutes."""
    source = (
        "import os, pathlib, subprocess, time\n"
        "child = subprocess.Popen(['sleep', '300'])\n"
        f"pathlib.Path({str(pids)!r}).write_text(f'{{os.getppid()}} {{os.getpid()}} {{child.pid}}')\n"
        "time.sleep(300)\n"
    )
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source, id="stuck")]
    return nbformat.writes(nb)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def _watch(proc: subprocess.Popen, timeout: float, until=lambda: False) -> set[int]:
    """Every process seen below ``proc`` until ``until()`` holds or it ends (within ``timeout``)."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while proc.poll() is None and not until() and time.monotonic() < deadline:
        seen.update(proctree.descendants(proc.pid))
        time.sleep(0.05)
    return seen


def _left(pids: set[int], grace: float = 5.0) -> list[int]:
    """Those of ``pids`` still running after ``grace`` seconds (the resource tracker ends a moment after
    the run; a worker or kernel left behind would run for minutes)."""
    deadline = time.monotonic() + grace
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return sorted(p for p in pids if _alive(p))


def _kill_left(pids: set[int]) -> None:
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


@linux_only
def test_sigterm_stops_the_workers_their_kernels_and_what_the_notebook_started(tmp_path):
    ensure_kernel()
    pids = tmp_path / "pids"
    proc = subprocess.Popen(_driver(tmp_path, [_stuck(pids)], 1), stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()
    try:
        seen = _watch(proc, 120, until=lambda: pids.exists() and pids.read_text())
        assert proc.poll() is None and pids.exists(), "the notebook never started"
        worker, kernel, child = (int(p) for p in pids.read_text().split())
        seen |= {worker, kernel, child} | set(proctree.descendants(proc.pid))
        assert all(_alive(p) for p in (worker, kernel, child))
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode != 0 and "KeyboardInterrupt" in err
        assert time.monotonic() - start < 30
        left = _left(seen)
        assert not left, f"still running after SIGTERM: {left}"
    finally:
        proc.kill()
        _kill_left(seen)


@linux_only
def test_a_failing_task_stops_the_other_tasks_at_once(tmp_path):
    """One task raises (a notebook that is not JSON) while another would run for minutes: the error
    comes out within seconds, and nothing the run started is left."""
    ensure_kernel()
    proc = subprocess.Popen(
        _driver(tmp_path, [_stuck(tmp_path / "pids"), "not a notebook"], 2), stderr=subprocess.PIPE, text=True
    )
    seen: set[int] = set()
    try:
        seen = _watch(proc, 90)
        assert proc.poll() is not None, "the run went on after a task failed"
        assert proc.returncode != 0 and "NotJSONError" in proc.stderr.read()
        left = _left(seen)
        assert not left, f"still running after the failure: {left}"
    finally:
        proc.kill()
        _kill_left(seen)
