"""Mutant sets: plausible learner bugs, planted one at a time in a solution notebook, that measure how
well a lab's tests catch real mistakes.

``autograder/mutants/labNN.toml`` holds the set of lab NN. Each ``[[mutant]]`` entry names

- ``id``: a short, unique name (``merge-last-pair``);
- ``grade_id``: the graded cell it changes (an nbgrader ``grade_id`` of the lab's solution notebook);
- ``old`` / ``new``: an exact text replacement in that cell. ``old`` must occur exactly once in the
  cell, inside a ``### BEGIN SOLUTION`` / ``### END SOLUTION`` region (the code a learner writes);
- ``bug``: the learner's mistake it models, in one line ("ties broken to the largest pair").

``scripts/mutants.py`` (``make mutants LAB=N``) runs each mutant's notebook to see which visible checks
fail, and grades it with the hidden tests. The targets below are LABS.md's: a lab's hidden tests must
catch at least `HIDDEN_TARGET` of at least `MIN_MUTANTS` mutants (on every grading seed), its visible
checks at least `VISIBLE_TARGET`. A mutant that behaves exactly like the solution (an *equivalent*
mutant) measures nothing: it is left out of the set rather than counted as a survivor.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli (a dependency of pytest there) is the same parser
    import tomli as tomllib

from autograder.submission.labs import LabSpec, lab_spec

HIDDEN_TARGET = 0.95  # share of mutants the hidden tests must catch, on every grading seed
VISIBLE_TARGET = 0.80  # share of mutants the visible check cells must catch
MIN_MUTANTS = 25  # the smallest mutant set that measures a lab

MUTANTS_DIR = Path(__file__).resolve().parent
SOLUTIONS_DIR = MUTANTS_DIR.parents[1] / "solutions"

_ID = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
_REGION = re.compile(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", re.S)


class MutantError(ValueError):
    """A mutant set that cannot be used: malformed, or a mutant that no longer applies to its cell."""


@dataclass(frozen=True)
class Mutant:
    """One planted bug: replace ``old`` by ``new`` in the solution cell ``grade_id``."""

    id: str
    grade_id: str
    bug: str
    old: str
    new: str


@dataclass(frozen=True)
class MutantSet:
    """The mutants of one lab, as read from its TOML file."""

    lab: int
    path: Path
    mutants: tuple[Mutant, ...]

    @property
    def spec(self) -> LabSpec:
        return lab_spec(self.lab)

    @property
    def solution(self) -> Path:
        """The solution notebook the mutants apply to."""
        return SOLUTIONS_DIR / self.spec.notebook

    def get(self, mutant_id: str) -> Mutant:
        """The mutant named ``mutant_id``; MutantError listing the known ids otherwise."""
        for mutant in self.mutants:
            if mutant.id == mutant_id:
                return mutant
        raise MutantError(
            f"{self.path.name} has no mutant {mutant_id!r}; its mutants are: "
            + ", ".join(m.id for m in self.mutants)
        )


def mutant_set_path(lab: int) -> Path:
    return MUTANTS_DIR / f"lab{lab:02d}.toml"


def load_mutant_set(lab: int, path: Path | None = None) -> MutantSet:
    """Read and check the mutant set of ``lab`` (from ``path``, default ``autograder/mutants/labNN.toml``).

    Checks the file's shape only: every field present and a string, ids unique and kebab-case, each
    ``grade_id`` a graded cell of the lab, ``old != new``, ``bug`` one line. Whether each mutant still
    applies to the solution notebook is `apply_mutant`'s check. Raises MutantError naming the problem.
    """
    path = Path(path) if path is not None else mutant_set_path(lab)
    if not path.is_file():
        raise MutantError(f"lab {lab} has no mutant set: {path} does not exist")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise MutantError(f"{path.name} is not valid TOML: {e}") from None
    if data.get("lab") != lab:
        raise MutantError(f"{path.name} says lab = {data.get('lab')!r}, but it is read as lab {lab}'s set")
    spec = lab_spec(lab)
    entries = data.get("mutant")
    if not isinstance(entries, list) or not entries:
        raise MutantError(f"{path.name} has no [[mutant]] entries")
    mutants, seen = [], set()
    for i, entry in enumerate(entries):
        where = f"{path.name}, mutant {entry.get('id', f'#{i + 1}')!r}"
        fields = {}
        for key in ("id", "grade_id", "bug", "old", "new"):
            value = entry.get(key)
            if not isinstance(value, str):
                raise MutantError(f"{where}: `{key}` must be a string")
            if key != "new" and not value.strip():  # an empty `new` deletes `old`
                raise MutantError(f"{where}: `{key}` must not be empty")
            fields[key] = value
        unknown = set(entry) - set(fields)
        if unknown:
            raise MutantError(f"{where}: unknown fields {sorted(unknown)}")
        mutant = Mutant(**fields)
        if not _ID.match(mutant.id):
            raise MutantError(f"{where}: ids are lowercase words joined by '-' (like 'merge-last-pair')")
        if mutant.id in seen:
            raise MutantError(f"{where}: the id is used twice")
        seen.add(mutant.id)
        if mutant.grade_id not in spec.graded_cells:
            raise MutantError(
                f"{where}: {mutant.grade_id!r} is not a graded cell of {spec.title} "
                f"(those are {', '.join(spec.graded_cells)})"
            )
        if "\n" in mutant.bug.strip():
            raise MutantError(f"{where}: `bug` should say the learner's mistake in one line")
        if mutant.old == mutant.new:
            raise MutantError(f"{where}: `old` and `new` are the same text, so it changes nothing")
        mutants.append(mutant)
    return MutantSet(lab=lab, path=path, mutants=tuple(mutants))


def cell_source(notebook: dict, grade_id: str) -> str:
    """The source of the code cell with this nbgrader ``grade_id``; MutantError if there is none."""
    for cell in notebook.get("cells", []):
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == grade_id:
            source = cell.get("source", "")
            return "".join(source) if isinstance(source, list) else source
    raise MutantError(f"the notebook has no cell with grade_id {grade_id!r}")


def apply_mutant(mutant: Mutant, notebook: dict, set_path: Path | None = None) -> dict:
    """A copy of the solution ``notebook`` with ``mutant`` applied to its cell.

    Raises MutantError, naming the mutant and the cell, unless ``old`` occurs exactly once in the cell,
    inside a solution region, and replacing it changes the cell.
    """
    where = f"mutant {mutant.id!r}" + (f" of {set_path.name}" if set_path else "")
    try:
        source = cell_source(notebook, mutant.grade_id)
    except MutantError as e:
        raise MutantError(f"{where}: {e}") from None
    count = source.count(mutant.old)
    if count != 1:
        found = "does not occur" if count == 0 else f"occurs {count} times"
        raise MutantError(
            f"{where} no longer applies: its `old` text {found} in the cell {mutant.grade_id!r} "
            "(it must occur exactly once). The solution changed: update the mutant to the new code"
        )
    start = source.index(mutant.old)
    end = start + len(mutant.old)
    regions = [m.span(1) for m in _REGION.finditer(source)]
    if not any(lo <= start and end <= hi for lo, hi in regions):
        raise MutantError(
            f"{where}: its `old` text in the cell {mutant.grade_id!r} is not inside a "
            "### BEGIN SOLUTION / ### END SOLUTION region; a mutant models code a learner writes"
        )
    changed = source[:start] + mutant.new + source[end:]
    result = copy.deepcopy(notebook)
    for cell in result["cells"]:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == mutant.grade_id:
            cell["source"] = changed
    return result
