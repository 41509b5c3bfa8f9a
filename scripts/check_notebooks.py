"""Check the notebooks in the repository; CI runs this. Exit 1 with a message on any problem.

    python scripts/check_notebooks.py

Checks that:

- every notebook in git (tracked, or new and not ignored) has no outputs and no execution counts;
- every solution's setup cell is its ``labkit/labNN.py`` module's text;
- labs/ is exactly what ``make labs`` generates from solutions/ (and holds no lab without a solution);
- every solution notebook names its lab in ``metadata.nanolab.lab`` and carries valid nbgrader
  metadata (schema 3, unique ``grade_id``\\ s, points on check cells, ``### BEGIN SOLUTION`` regions only
  in solution cells), and the grader's spec for that lab finds all its setup and graded cells.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nbformat  # noqa: E402
from make_labs import LABS, ROOT, SOLUTIONS, generate_lab, include_setup, setup_module, solution_notebooks  # noqa: E402


def _rel(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def notebooks_in_git() -> list[Path]:
    """Tracked notebooks plus new ones git does not ignore.

    Without git: every notebook but those in .venv/, build/ and the learner's working copy work/.
    """
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.ipynb"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return sorted({ROOT / line for line in out.splitlines() if line and (ROOT / line).exists()})
    except (OSError, subprocess.CalledProcessError):
        skip = {".venv", "build", "work", ".ipynb_checkpoints"}
        return sorted(p for p in ROOT.rglob("*.ipynb") if not skip & set(p.relative_to(ROOT).parts))


def output_problems(path: Path) -> list[str]:
    """Cells of ``path`` that carry outputs or execution counts."""
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        return [f"{_rel(path)} is not valid JSON: {e}"]
    problems = []
    for i, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        where = f"{_rel(path)} cell {i} ({cell.get('id', '?')})"
        if cell.get("outputs"):
            problems.append(
                f"{where} has outputs: clear them (Edit > Clear Outputs of All Cells) before committing"
            )
        if cell.get("execution_count") is not None:
            problems.append(f"{where} has an execution count: clear outputs before committing")
    return problems


def metadata_problems(path: Path) -> list[str]:
    """nbgrader and nanolab metadata problems in a solution notebook."""
    from autograder.submission.labs import LABS as SPECS

    nb = json.loads(path.read_text(encoding="utf-8"))
    name = _rel(path)
    problems = []
    lab = nb.get("metadata", {}).get("nanolab", {}).get("lab")
    if type(lab) is not int:
        problems.append(f"{name}: metadata.nanolab.lab must be the lab's number")
    seen: dict[str, int] = {}
    for i, cell in enumerate(nb.get("cells", [])):
        meta = cell.get("metadata", {}).get("nbgrader")
        source = "".join(cell.get("source", []))
        if meta is None:
            if "BEGIN SOLUTION" in source:
                problems.append(f"{name} cell {i}: a solution region outside an nbgrader solution cell")
            continue
        grade_id = meta.get("grade_id")
        where = f"{name} cell {i} ({grade_id})"
        if meta.get("schema_version") != 3:
            problems.append(f"{where}: nbgrader schema_version must be 3")
        if not grade_id:
            problems.append(f"{name} cell {i}: an nbgrader cell needs a grade_id")
        elif grade_id in seen:
            problems.append(f"{where}: grade_id also used by cell {seen[grade_id]}")
        seen[grade_id] = i
        if meta.get("grade") and not isinstance(meta.get("points"), (int, float)):
            problems.append(f"{where}: a grade cell needs points")
        if meta.get("grade") and cell.get("cell_type") == "code" and not meta.get("solution"):
            if not source.lstrip().startswith('"""Check that '):
                problems.append(f'{where}: a check cell should start with a """Check that ...""" docstring')
        if "BEGIN SOLUTION" in source and not meta.get("solution"):
            problems.append(f"{where}: a solution region in a cell not marked as a solution cell")
    if type(lab) is int and lab in SPECS:
        spec = SPECS[lab]
        code_ids = {
            c.get("metadata", {}).get("nbgrader", {}).get("grade_id")
            for c in nb.get("cells", [])
            if c.get("cell_type") == "code"
        }
        for grade_id in (*spec.setup_cells, *spec.graded_cells):
            if grade_id not in code_ids:
                problems.append(f"{name}: the grader expects a code cell with grade_id {grade_id!r}")
        if spec.notebook != path.name:
            problems.append(f"{name}: the grader's spec for lab {lab} names the notebook {spec.notebook}")
    return problems


def main() -> int:
    problems: list[str] = []
    for path in notebooks_in_git():
        problems += output_problems(path)
    sources = solution_notebooks()
    for source in sources:
        problems += metadata_problems(source)
        target = LABS / source.name
        try:
            nb = nbformat.read(str(source), as_version=4)
            if include_setup(nb):
                problems.append(
                    f"{_rel(source)}: its setup cell differs from {_rel(setup_module(nb))}, where that code is "
                    "edited: run `make labs` and commit the result"
                )
            expected = generate_lab(source)
        except Exception as e:  # nbgrader raises RuntimeError for broken solution regions
            problems.append(f"{_rel(source)} cannot be turned into a lab: {e}")
            continue
        if not target.exists():
            problems.append(f"{_rel(target)} is missing: run `make labs`")
        elif target.read_text(encoding="utf-8") != expected:
            problems.append(
                f"{_rel(target)} is out of date with {_rel(source)} (or was edited by hand): "
                "run `make labs` and commit the result"
            )
    for lab in sorted(LABS.glob("*.ipynb")):
        if not (SOLUTIONS / lab.name).exists():
            problems.append(f"{_rel(lab)} has no solution notebook in solutions/; labs/ is generated only")
    for problem in problems:
        print(f"check_notebooks: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"check_notebooks: {len(sources)} solution notebooks, labs/ up to date, no outputs in git")
    return 0


if __name__ == "__main__":
    sys.exit(main())
