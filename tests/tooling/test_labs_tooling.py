"""The lab tooling: labs/ is generated from solutions/ deterministically, with the solutions removed,
the given cells locked and no outputs; check_notebooks catches drift; the solution notebooks run on a
real Jupyter kernel; each setup cell is its labkit module."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest
from helpers.notebook_utils import cell_source, cells_by_id, interface, nbgrader_meta

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import check_notebooks  # noqa: E402
import make_labs  # noqa: E402
import run_solutions  # noqa: E402

SOLUTIONS = make_labs.solution_notebooks()


def test_there_are_solution_notebooks():
    assert [p.name for p in SOLUTIONS] >= ["lab01_tokenizer.ipynb"]


@pytest.mark.parametrize("source", SOLUTIONS, ids=lambda p: p.name)
def test_generation_is_deterministic_and_labs_are_in_sync(source):
    text = make_labs.generate_lab(source)
    assert text == make_labs.generate_lab(source)
    assert (make_labs.LABS / source.name).read_text(encoding="utf-8") == text, "run `make labs`"


@pytest.mark.parametrize("source", SOLUTIONS, ids=lambda p: p.name)
def test_lab_hides_solutions_but_keeps_signatures_and_docstrings(source):
    solution = json.loads(source.read_text())
    lab = cells_by_id(json.loads((make_labs.LABS / source.name).read_text()))
    graded = [c for c in solution["cells"] if nbgrader_meta(c).get("solution")]
    assert graded
    for cell in graded:
        grade_id = nbgrader_meta(cell)["grade_id"]
        sol, blank = cell_source(cell), cell_source(lab[grade_id])
        assert "BEGIN SOLUTION" not in blank and "raise NotImplementedError()" in blank, grade_id
        region = sol.split("### BEGIN SOLUTION")[1].split("### END SOLUTION")[0]
        assert region.strip() not in blank, f"the solution of {grade_id} leaked into the lab"
        assert interface(sol) == interface(blank), f"{grade_id}: signatures or docstrings differ"


@pytest.mark.parametrize("source", SOLUTIONS, ids=lambda p: p.name)
def test_lab_is_clean_locked_and_says_it_is_generated(source):
    nb = json.loads((make_labs.LABS / source.name).read_text())
    meta = nb["metadata"]["nanolab"]
    assert meta["lab"] == json.loads(source.read_text())["metadata"]["nanolab"]["lab"]
    assert "Do not edit" in meta["generated"] and source.name in meta["generated"]
    for cell in nb["cells"]:
        grader = nbgrader_meta(cell)
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None
        if grader.get("locked"):
            assert cell["metadata"]["editable"] is False and cell["metadata"]["deletable"] is False
        if grader.get("solution"):
            assert cell["metadata"]["deletable"] is False and "checksum" in grader
        if grader.get("grade"):
            assert grader["points"] > 0 and cell_source(cell).startswith('"""Check that ')


def test_check_notebooks_passes_on_the_repository(capsys):
    assert check_notebooks.main() == 0, capsys.readouterr().err


def test_check_notebooks_reports_outputs_and_stale_labs(tmp_path, monkeypatch, capsys):
    lab = json.loads((make_labs.LABS / "lab01_tokenizer.ipynb").read_text())
    code = next(c for c in lab["cells"] if c["cell_type"] == "code")
    code["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["hi\n"]}]
    code["execution_count"] = 3
    stale = tmp_path / "lab01_tokenizer.ipynb"
    stale.write_text(json.dumps(lab, indent=1))
    problems = check_notebooks.output_problems(stale)
    assert any("has outputs" in p for p in problems) and any("execution count" in p for p in problems)

    monkeypatch.setattr(check_notebooks, "LABS", tmp_path)
    monkeypatch.setattr(check_notebooks, "notebooks_in_git", lambda: [])
    assert check_notebooks.main() == 1
    assert "out of date" in capsys.readouterr().err


def test_check_notebooks_reports_bad_nbgrader_metadata(tmp_path):
    nb = json.loads(SOLUTIONS[0].read_text())
    del nb["metadata"]["nanolab"]
    cells = nb["cells"]
    nbgrader_meta(cells[2])["grade_id"] = nbgrader_meta(cells[1])["grade_id"]
    check = next(c for c in cells if nbgrader_meta(c).get("grade"))
    del nbgrader_meta(check)["points"]
    path = tmp_path / "broken.ipynb"
    path.write_text(json.dumps(nb))
    problems = " ".join(check_notebooks.metadata_problems(path))
    assert (
        "metadata.nanolab.lab" in problems and "grade_id also used" in problems and "needs points" in problems
    )


@pytest.fixture(scope="module")
def executed_solutions(tmp_path_factory) -> tuple[Path, dict[str, float | Exception], dict[str, str]]:
    """Every solution notebook run top to bottom, two kernels at a time (a kernel mostly keeps one core busy),
    the labs with the most to run first: the folder of the executed copies, each one's seconds or error, and
    each one's text before it ran."""
    out = tmp_path_factory.mktemp("executed")
    before = {path.name: path.read_text() for path in SOLUTIONS}
    run_solutions.ensure_kernel()
    ran = run_solutions.run_notebooks(sorted(SOLUTIONS, reverse=True), timeout=120, jobs=2, out=out)
    return out, {path.name: outcome for path, outcome in ran}, before


@pytest.mark.slow
@pytest.mark.parametrize("source", SOLUTIONS, ids=lambda p: p.name)
def test_solution_notebook_runs_top_to_bottom_on_a_real_kernel(source, executed_solutions):
    out, outcomes, before = executed_solutions
    if isinstance(outcomes[source.name], Exception):
        raise outcomes[source.name]
    executed = json.loads((out / source.name).read_text())
    outputs = [o for c in executed["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
    assert not [o for o in outputs if o["output_type"] == "error"]
    assert any("all checks passed" in "".join(o.get("text", "")) for o in outputs)
    assert source.read_text() == before[source.name]  # solutions/ untouched
    assert all(c.get("outputs", []) == [] for c in json.loads(source.read_text())["cells"])


@pytest.mark.parametrize("source", SOLUTIONS, ids=lambda p: p.name)
def test_each_setup_cell_is_its_labkit_module(source):
    """A lab's setup code is written once, in ``labkit/labNN.py``: the solution's and the lab's setup cells
    hold exactly its text, and the module imports as it is (tests may use it instead of the notebook)."""
    nb = json.loads(source.read_text())
    number = nb["metadata"]["nanolab"]["lab"]
    module = ROOT / "labkit" / f"lab{number:02d}.py"
    text = module.read_text(encoding="utf-8").rstrip("\n")
    assert cell_source(cells_by_id(nb)["setup"]) == text, "run `make labs`"
    lab = json.loads((make_labs.LABS / source.name).read_text())
    assert cell_source(cells_by_id(lab)["setup"]) == text
    imported = importlib.import_module(f"labkit.lab{number:02d}")
    assert Path(imported.__file__).resolve() == module.resolve()


def test_a_setup_cell_edited_in_the_notebook_is_caught_and_rewritten(tmp_path, monkeypatch, capsys):
    """Editing the setup cell instead of its module is drift: check_notebooks names it, and make_labs writes
    the module's text back into the cell."""
    solutions = tmp_path / "solutions"
    solutions.mkdir()
    shutil.copy(make_labs.SOLUTIONS / "lab01_tokenizer.ipynb", solutions)
    nb = json.loads((solutions / "lab01_tokenizer.ipynb").read_text())
    setup = cells_by_id(nb)["setup"]
    setup["source"] = cell_source(setup) + "\nEXTRA = 1"
    (solutions / "lab01_tokenizer.ipynb").write_text(json.dumps(nb, indent=1))
    labs = tmp_path / "labs"
    labs.mkdir()
    shutil.copy(make_labs.LABS / "lab01_tokenizer.ipynb", labs)
    for module in (make_labs, check_notebooks):
        monkeypatch.setattr(module, "SOLUTIONS", solutions)
        monkeypatch.setattr(module, "LABS", labs)
    monkeypatch.setattr(make_labs, "ROOT", tmp_path)  # where its messages are relative to
    monkeypatch.setattr(make_labs, "solution_notebooks", lambda: [solutions / "lab01_tokenizer.ipynb"])
    monkeypatch.setattr(check_notebooks, "solution_notebooks", lambda: [solutions / "lab01_tokenizer.ipynb"])
    monkeypatch.setattr(check_notebooks, "notebooks_in_git", lambda: [])
    assert check_notebooks.main() == 1
    assert "setup cell differs from labkit/lab01.py" in capsys.readouterr().err
    assert make_labs.main(["--check"]) == 1
    assert make_labs.main([]) == 0
    assert "EXTRA = 1" not in (solutions / "lab01_tokenizer.ipynb").read_text()
    assert check_notebooks.main() == 0, capsys.readouterr().err
