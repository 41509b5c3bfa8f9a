"""Every check cell of every lab fails on the blank lab.

A learner runs the generated notebook (``labs/``) before writing anything, or cell by cell past a cell that
stopped at ``raise NotImplementedError()``. A check cell that passes then says "all checks passed" about code
nobody wrote: it checked a value left over from a cell that stopped half way, or nothing of the learner's at
all. So each blank lab runs top to bottom on a Jupyter kernel, carrying on past errors as a learner running
cell by cell does, and each check cell (nbgrader ``grade: true``, no solution) must raise.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from run_solutions import notebook_client  # noqa: E402

LABS = sorted((ROOT / "labs").glob("lab[0-9][0-9]_*.ipynb"))


def check_cells(nb) -> list:
    return [
        c
        for c in nb.cells
        if c.cell_type == "code"
        and c.metadata.get("nbgrader", {}).get("grade")
        and not c.metadata.get("nbgrader", {}).get("solution")
    ]


def test_every_lab_is_checked() -> None:
    assert len(LABS) >= 8, [p.name for p in LABS]


def passing_checks(path: Path) -> list[str]:
    """The check cells of the notebook at ``path`` that pass when it runs top to bottom past errors."""
    nb = nbformat.read(path, as_version=4)
    checks = check_cells(nb)
    assert checks, f"{path.name} has no check cells"
    with notebook_client(
        nb,
        timeout=300,
        allow_errors=True,
        resources={"metadata": {"path": str(path.parent)}},
    ) as client:
        client.execute()
    return [
        c.metadata["nbgrader"]["grade_id"]
        for c in checks
        if not any(o.output_type == "error" for o in c.get("outputs", []))
    ]


def test_no_check_cell_passes_on_a_blank_lab() -> None:
    # two labs at a time: each kernel runs on a core of its own
    with ThreadPoolExecutor(2) as pool:
        passing = dict(zip((p.name for p in LABS), pool.map(passing_checks, LABS)))
    assert not {name: ids for name, ids in passing.items() if ids}, (
        f"check cells that pass on a blank lab: {passing}"
    )
