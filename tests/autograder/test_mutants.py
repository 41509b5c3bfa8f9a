"""The mutant sets that measure the labs' tests, and the script that runs them.

The fast tests check every set without running it: each mutant still applies to its solution cell,
exactly once and inside the learner's code, ids are unique, each names its bug, every graded cell has
mutants, and a set is big enough to measure a lab. The harness test runs scripts/mutants.py for real on
two Lab 1 mutants (one grading seed): the hidden tests must catch both, and since the visible checks
miss the too-slow one, the script must report a visible rate under its target and exit 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autograder.mutants import (
    HIDDEN_TARGET,
    MIN_MUTANTS,
    MUTANTS_DIR,
    VISIBLE_TARGET,
    Mutant,
    MutantError,
    apply_mutant,
    cell_source,
    load_mutant_set,
)
from autograder.submission.labs import LABS

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import mutants as script  # noqa: E402

SETS = sorted(int(p.stem.removeprefix("lab")) for p in MUTANTS_DIR.glob("lab*.toml"))


def _solution(lab: int) -> dict:
    return json.loads(load_mutant_set(lab).solution.read_text(encoding="utf-8"))


def test_labs_1_and_2_have_mutant_sets():
    assert SETS[:2] == [1, 2]


@pytest.mark.parametrize("lab", SETS)
def test_every_mutant_applies_once_inside_the_solution_code_and_changes_it(lab):
    mutant_set = load_mutant_set(lab)
    solution = _solution(lab)
    for mutant in mutant_set.mutants:
        mutated = apply_mutant(mutant, solution, mutant_set.path)  # MutantError if it no longer applies
        before, after = cell_source(solution, mutant.grade_id), cell_source(mutated, mutant.grade_id)
        assert after != before, f"{mutant.id} does not change its cell"
        assert after == before.replace(mutant.old, mutant.new, 1)
        others = [g for g in LABS[lab].graded_cells if g != mutant.grade_id]
        assert all(cell_source(mutated, g) == cell_source(solution, g) for g in others), (
            f"{mutant.id} changed another cell than {mutant.grade_id!r}"
        )


@pytest.mark.parametrize("lab", SETS)
def test_a_set_has_enough_unique_named_mutants_covering_every_graded_cell(lab):
    mutants = load_mutant_set(lab).mutants
    assert len(mutants) >= MIN_MUTANTS, (
        f"lab {lab} has {len(mutants)} mutants; LABS.md asks for {MIN_MUTANTS}"
    )
    ids = [m.id for m in mutants]
    assert len(set(ids)) == len(ids), "mutant ids must be unique"
    for mutant in mutants:
        assert mutant.bug.strip() and "\n" not in mutant.bug.strip(), (
            f"{mutant.id} should name its bug in one line"
        )
    uncovered = set(LABS[lab].graded_cells) - {m.grade_id for m in mutants}
    assert not uncovered, f"no mutant of lab {lab} changes the graded cells {sorted(uncovered)}"


def test_targets_are_those_of_labs_md():
    assert (HIDDEN_TARGET, VISIBLE_TARGET, MIN_MUTANTS) == (0.95, 0.80, 25)


@pytest.mark.parametrize(
    ("old", "problem"),
    [
        ("this text is not in the cell", "does not occur"),
        ("out.append(", "occurs 2 times"),  # merge appends in two places
        ("Returns a new list", "not inside a ### BEGIN SOLUTION"),  # the docstring: not learner code
    ],
)
def test_a_mutant_that_no_longer_applies_is_refused_naming_it_and_its_cell(old, problem):
    mutant = Mutant(id="stale-one", grade_id="merge", bug="a stale mutant", old=old, new="pass")
    with pytest.raises(MutantError, match=f"stale-one.*'merge'.*{problem}|stale-one.*{problem}.*'merge'"):
        apply_mutant(mutant, _solution(1))


def test_malformed_sets_are_refused_with_the_reason(tmp_path):
    entry = '[[mutant]]\nid = "{id}"\ngrade_id = "{cell}"\nbug = "b"\nold = "x"\nnew = "y"\n'
    cases = {
        "duplicate": entry.format(id="a", cell="merge") * 2,
        "unknown cell": entry.format(id="a", cell="no-such-cell"),
        "bad id": entry.format(id="Not Kebab", cell="merge"),
        "missing field": '[[mutant]]\nid = "a"\ngrade_id = "merge"\nold = "x"\nnew = "y"\n',
    }
    reasons = {
        "duplicate": "used twice",
        "unknown cell": "not a graded cell",
        "bad id": "lowercase",
        "missing field": "`bug` must be a string",
    }
    for name, body in cases.items():
        path = tmp_path / f"{name.replace(' ', '_')}.toml"
        path.write_text("lab = 1\n" + body)
        with pytest.raises(MutantError, match=reasons[name]):
            load_mutant_set(1, path)


def _seed_result(seed: int, score: float, failed: list[str]) -> dict:
    return {"seed": seed, "score": score, "max_score": 10.0, "failed": dict.fromkeys(failed, "why")}


def test_a_mutant_counts_as_caught_only_when_it_loses_points_on_every_seed():
    every = script.Verdict(
        "a", "bug", "merge", {"failed": {}}, [_seed_result(s, 9, ["t1"]) for s in (1, 2, 3)]
    )
    some = script.Verdict(
        "b",
        "bug",
        "merge",
        {"failed": {}},
        [_seed_result(1, 9, ["t1"]), *(_seed_result(s, 10, []) for s in (2, 3))],
    )
    none = script.Verdict("c", "bug", "merge", {"failed": {}}, [_seed_result(s, 10, []) for s in (1, 2, 3)])
    mixed = script.Verdict(
        "d", "bug", "merge", {"failed": {}}, [_seed_result(1, 9, ["t1", "t2"]), _seed_result(2, 8, ["t1"])]
    )
    assert [v.hidden_status for v in (every, some, none, mixed)] == [
        "caught",
        "some seeds",
        "survived",
        "caught",
    ]
    assert mixed.tests_every_seed == ["t1"] and mixed.tests_some_seeds == ["t2"]


def test_the_script_measures_two_mutants_for_real(tmp_path):
    """scripts/mutants.py on Lab 1's off-by-one merge (caught everywhere) and an encode memo shared by every
    tokenizer (caught by the hidden tests only, since no check cell makes two tokenizers): both kill rates are computed from real runs, and a visible rate of 50% is
    under its target, so the script exits 1."""
    report = tmp_path / "report.json"
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "mutants.py"), "--lab", "1", "--seeds", "7", "--jobs", "2"]
        + ["--only", "merge-last-pair,tok-memo-shared", "--json", str(report)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    data = json.loads(report.read_text())
    verdicts = {m["id"]: m for m in data["mutants"]}
    assert verdicts["merge-last-pair"]["visible"]["caught"] is True
    assert "check-merge" in verdicts["merge-last-pair"]["visible"]["failed"]
    assert verdicts["merge-last-pair"]["hidden"]["status"] == "caught"
    assert (
        "test_merge_replaces_every_occurrence_left_to_right"
        in verdicts["merge-last-pair"]["hidden"]["tests_every_seed"]
    )
    assert verdicts["tok-memo-shared"]["visible"]["caught"] is False  # no check cell makes two tokenizers
    assert "test_encode_agrees_with_tiktoken" in verdicts["tok-memo-shared"]["hidden"]["tests_every_seed"]
    assert data["rates"] == {"hidden": 1.0, "visible": 0.5}
    assert data["solution"]["visible"]["failed"] == {} and data["solution"]["hidden"]["status"] == "survived"
    assert "BELOW TARGET" in out.stdout and "merge-last-pair" in out.stdout


def test_the_script_stops_at_a_mutant_that_no_longer_applies(tmp_path):
    stale = tmp_path / "stale.toml"
    stale.write_text(
        'lab = 1\n[[mutant]]\nid = "gone"\ngrade_id = "merge"\nbug = "b"\nold = "no such code"\nnew = "x"\n'
    )
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "mutants.py"), "--lab", "1", "--set", str(stale)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert "'gone'" in out.stderr and "'merge'" in out.stderr and "no longer applies" in out.stderr
