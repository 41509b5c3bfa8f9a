"""The Gradescope kit: ``nanolab gradescope LAB --out FILE.zip`` and the ``run_autograder`` it ships, run in a
Gradescope-shaped folder tree (``source/``, ``submission/``, ``results/``) with submissions of every shape a
class uploads: the notebook in a folder beside Jupyter's checkpoints, several notebooks, none, another lab's
notebook, a machine without the sandbox."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from autograder import gradescope
from autograder.sandbox import isolation

ROOT = Path(__file__).resolve().parents[2]
SOLUTION_1 = ROOT / "solutions" / "lab01_tokenizer.ipynb"
BLANK_3 = ROOT / "labs" / "lab03_paged_kv.ipynb"


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kit") / "lab01.zip"
    assert (
        subprocess.run(
            [
                sys.executable,
                "-m",
                "nanolab.cli",
                "gradescope",
                "1",
                "--out",
                str(out),
                "--visibility",
                "after_due_date",
            ],
            capture_output=True,
            text=True,
            check=False,
        ).returncode
        == 0
    ), "nanolab gradescope failed"
    return out


def autograder_tree(tmp_path: Path, kit: Path, files: dict[str, Path | str]) -> Path:
    """A Gradescope-shaped /autograder: the kit unpacked in source/, run_autograder beside it, ``files``
    (path in the submission -> a notebook to copy, or text) in submission/."""
    root = tmp_path / "autograder"
    (root / "source").mkdir(parents=True)
    with zipfile.ZipFile(kit) as z:
        z.extractall(root / "source")
    shutil.copy(root / "source" / "run_autograder", root / "run_autograder")
    (root / "submission").mkdir()
    for name, content in files.items():
        target = root / "submission" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            shutil.copy(content, target)
        else:
            target.write_text(content)
    return root


def run_autograder(root: Path) -> dict:
    """Run the kit's run_autograder as Gradescope would (with this machine's Python); its one results.json."""
    env = {**os.environ, "AUTOGRADER_ROOT": str(root), "NANOLAB_PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(root / "run_autograder")], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = root / "results" / "results.json"
    assert results.is_file(), (
        f"results.json is not a file: {sorted(p.name for p in (root / 'results').iterdir())}"
    )
    assert [p.name for p in (root / "results").iterdir()] == ["results.json"]
    return json.loads(results.read_text())


def test_the_kit_holds_the_scripts_and_the_source_without_answers(kit: Path) -> None:
    with zipfile.ZipFile(kit) as z:
        names = set(z.namelist())
        assert {"setup.sh", "run_autograder", "kit.json", "nanolab-src.tar.gz"} <= names
        for script in ("setup.sh", "run_autograder"):
            mode = z.getinfo(script).external_attr >> 16
            assert mode & stat.S_IXUSR, f"{script} is not executable"
        meta = json.loads(z.read("kit.json"))
        setup = z.read("setup.sh").decode()
        source = z.read("nanolab-src.tar.gz")
    assert meta["lab"] == 1 and meta["notebook"] == "lab01_tokenizer.ipynb"
    assert meta["points"] == gradescope.lab_points(1) > 0
    assert meta["visibility"] == "after_due_date" and meta["sandbox"] == "required"
    assert "download.pytorch.org/whl/cpu" in setup and f"torch=={meta['torch']}" in setup
    assert "bubblewrap-0.8.0" in setup
    syntax = subprocess.run(["bash", "-n"], input=setup, text=True, capture_output=True)
    assert syntax.returncode == 0, syntax.stderr
    with tarfile.open(fileobj=io.BytesIO(source)) as tar:
        paths = {m.name.split("/", 1)[1] for m in tar.getmembers()}
    assert "pyproject.toml" in paths and "csrc/CMakeLists.txt" in paths
    assert "autograder/tests/test_lab01.py" in paths and "labkit/lab01.py" in paths
    assert not [p for p in paths if p.split("/")[0] in ("solutions", "labs", "tests", "work", "build")]
    assert not [p for p in paths if "__pycache__" in p or p.endswith((".so", ".pyc"))]


def test_bad_options_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    for args in (
        ["99", "--out", str(tmp_path / "x.zip")],
        ["1", "--out", str(tmp_path / "y.zip"), "--visibility", "soon"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "nanolab.cli", "gradescope", *args], capture_output=True, text=True
        )
        assert done.returncode == 2, done.stdout
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(
    not isolation.status().available, reason="grading under the sandbox needs bubblewrap or Landlock"
)
def test_a_notebook_in_a_folder_beside_checkpoints_is_found_and_graded_with_the_kits_visibility(
    tmp_path, kit
) -> None:
    root = autograder_tree(
        tmp_path,
        kit,
        {
            "my work/lab01_tokenizer.ipynb": SOLUTION_1,
            "my work/.ipynb_checkpoints/lab01_tokenizer-checkpoint.ipynb": BLANK_3,
            "__MACOSX/my work/._lab01_tokenizer.ipynb": "junk",
            "notes.txt": "hello",
        },
    )
    results = run_autograder(root)
    assert results["score"] == gradescope.lab_points(1), results["output"]
    assert results["tests"] and {t["visibility"] for t in results["tests"]} == {"after_due_date"}
    assert all(t["status"] == "passed" for t in results["tests"])


@pytest.mark.parametrize(
    ("files", "words"),
    [
        ({}, "no notebook"),
        ({"README.md": "my lab"}, "no notebook"),
        ({"a/lab01_tokenizer.ipynb": SOLUTION_1, "b/lab01_tokenizer.ipynb": SOLUTION_1}, "several notebooks"),
        ({"mine.ipynb": SOLUTION_1, "copy.ipynb": SOLUTION_1}, "several notebooks"),
    ],
    ids=["empty", "no notebook", "two with the lab's name", "two with other names"],
)
def test_a_submission_without_exactly_one_notebook_scores_zero_saying_what_to_upload(
    tmp_path, kit, files, words
) -> None:
    results = run_autograder(autograder_tree(tmp_path, kit, files))
    assert results["score"] == 0 and results["tests"] == []
    assert words in results["output"] and "lab01_tokenizer.ipynb" in results["output"]


def test_several_notebooks_with_one_named_for_the_lab_grade_that_one(tmp_path) -> None:
    (tmp_path / "scratch.ipynb").write_text("{}")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "lab01_tokenizer.ipynb").write_text("{}")
    found, note = gradescope.find_notebook(tmp_path, "lab01_tokenizer.ipynb")
    assert found == tmp_path / "sub" / "lab01_tokenizer.ipynb"
    assert "scratch.ipynb" in note and "was graded" in note


def test_another_labs_notebook_scores_zero_as_the_kits_lab(tmp_path, kit) -> None:
    results = run_autograder(autograder_tree(tmp_path, kit, {"lab03_paged_kv.ipynb": BLANK_3}))
    assert results["score"] == 0
    assert "lab 3" in results["output"] and "lab 1" in results["output"], results["output"]


def test_without_a_sandbox_the_required_policy_grades_nothing_and_says_so(
    tmp_path, monkeypatch, capsys
) -> None:
    root = tmp_path / "autograder"
    (root / "submission").mkdir(parents=True)
    shutil.copy(SOLUTION_1, root / "submission" / "lab01_tokenizer.ipynb")
    missing = isolation.Status(False, reason="bubblewrap 0.6.1 lacks --disable-userns")

    def no_grading(*args, **kwargs):
        raise AssertionError("a submission was graded without the sandbox")

    monkeypatch.setattr(isolation, "status", lambda: missing)
    monkeypatch.setattr("autograder.grading.grade.grade", no_grading)
    assert gradescope.run(root, 1, "visible", "required") == 0
    results = json.loads((root / "results" / "results.json").read_text())
    assert results["score"] == 0 and results["tests"] == [] and "sandbox" in results["output"]
    assert "0.6.1" in capsys.readouterr().err  # the reason, for the instructor (hidden from students)


def test_the_readme_gives_each_labs_total_points() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    line = readme[readme.index("Each lab's total points:") :].split("(`nanolab gradescope`")[0]
    listed = {int(n): float(p) for n, p in re.findall(r"Lab (\d+) (\d+(?:\.\d+)?)", line)}
    from autograder.submission.labs import LABS

    assert listed == {n: gradescope.lab_points(n) for n in LABS}
