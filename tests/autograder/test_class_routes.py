"""Grading a class outside Gradescope: an nbgrader course's ``submitted/`` tree graded with the hidden
tests into a CSV whose ``student_id`` column is nbgrader's (what its gradebook and an LMS key grades by),
and a grading run that refuses to go on without the sandbox when told to."""

from __future__ import annotations

import argparse
import csv
import shutil
from pathlib import Path

from helpers.grading_utils import grade_command

from autograder.grading import cli
from autograder.grading.results import student_id
from autograder.sandbox import isolation

ROOT = Path(__file__).resolve().parents[2]


def test_the_student_id_comes_from_nbgrader_s_tree_or_the_notebook_s_folder() -> None:
    assert student_id("course/submitted/alice/lab01/lab01_tokenizer.ipynb") == "alice"
    assert student_id("/srv/c/submitted/b.o-b_2/lab01/sub/lab01.ipynb") == "b.o-b_2"
    assert student_id("submissions/carol/lab01_tokenizer.ipynb") == "carol"
    assert student_id("lab01_tokenizer.ipynb") == ""
    assert student_id("submitted/lab01.ipynb") == "submitted"  # no student folder: the folder it is in


def test_an_nbgrader_submitted_tree_grades_into_a_csv_keyed_by_student_id(tmp_path: Path) -> None:
    course = tmp_path / "course"
    for student, notebook in (("alice", "solutions"), ("bob", "labs")):
        target = course / "submitted" / student / "lab01" / "lab01_tokenizer.ipynb"
        target.parent.mkdir(parents=True)
        shutil.copy(ROOT / notebook / "lab01_tokenizer.ipynb", target)
    submitted = sorted(map(str, course.glob("submitted/*/lab01/*.ipynb")))
    grade_command(*submitted, "--jobs", "2", "--csv", str(tmp_path / "grades.csv"))
    with open(tmp_path / "grades.csv", newline="") as f:
        rows = {row["student_id"]: row for row in csv.DictReader(f)}
    assert set(rows) == {"alice", "bob"}
    assert float(rows["alice"]["total"]) == float(rows["alice"]["max_score"]) > 0
    assert float(rows["bob"]["total"]) == 0


def test_require_sandbox_grades_nothing_where_it_cannot_start(monkeypatch, capsys) -> None:
    monkeypatch.setattr(isolation, "status", lambda: isolation.Status(False, reason="no user namespaces"))
    monkeypatch.setattr(cli, "grade", lambda *a, **k: (_ for _ in ()).throw(AssertionError("graded")))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([str(ROOT / "labs" / "lab01_tokenizer.ipynb"), "--require-sandbox"])
    assert cli.run(args) == 2
    assert "no user namespaces" in capsys.readouterr().err
