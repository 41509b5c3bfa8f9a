"""Reading a submitted notebook: which lab it is, and the code the grader will run.

The file is only read, never written. Anything wrong with it (not JSON, not a notebook, another
lab, a graded cell deleted) raises `SubmissionError` with a message meant for the learner; the
grader turns that into a zero for this submission and moves on to the next.

Only the lab's setup cells and graded cells are taken (by nbgrader ``grade_id``), in notebook order.
A setup cell is locked only by convention, so the grader never runs the submission's text of it: it runs
the lab's own setup code, ``labkit/labNN.py`` (the text ``make labs`` writes into the cell), and a
submission whose setup cell differs is graded all the same, with a note saying so. IPython syntax
(``%magic``, ``!shell``) in graded cells is replaced by ``pass``, since the grader runs plain Python.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import labkit
from autograder.submission.labs import LabSpec, lab_spec

MAX_NOTEBOOK_BYTES = 20 * 1024 * 1024


class SubmissionError(Exception):
    """A submission that cannot be graded; the message says why and what to do."""


@dataclass(frozen=True)
class Submission:
    """The parts of a notebook that the grader runs."""

    path: Path
    spec: LabSpec
    # [{"id": grade_id, "source": code, "setup": bool}] setup and graded cells, in notebook order; a setup
    # cell's source is the lab's own (`labkit.setup_text`), whatever the notebook holds
    cells: list[dict]
    warnings: list[str] = field(default_factory=list)


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    if isinstance(source, list) and all(isinstance(s, str) for s in source):
        return "".join(source)
    if isinstance(source, str):
        return source
    raise SubmissionError("a cell's source is neither text nor a list of lines; is the file a notebook?")


def _nbgrader(cell: dict) -> dict:
    meta = cell.get("metadata")
    nbgrader = meta.get("nbgrader") if isinstance(meta, dict) else None
    return nbgrader if isinstance(nbgrader, dict) else {}


def checksum(cell: dict) -> str:
    """nbgrader's checksum of a cell (same recipe as ``nbgrader.utils.compute_checksum``)."""
    meta = _nbgrader(cell)
    m = hashlib.md5()
    m.update(_source(cell).encode("utf-8"))
    m.update(str(cell.get("cell_type")).encode("utf-8"))
    for flag in ("grade", "solution", "locked"):
        m.update(str(bool(meta.get(flag, False))).encode("utf-8"))
    m.update(str(meta.get("grade_id")).encode("utf-8"))
    if meta.get("grade", False):
        m.update(str(float(meta.get("points", 0))).encode("utf-8"))
    return m.hexdigest()


_MAGIC = re.compile(r"^(\s*)[%!].*$", re.M)


def strip_magics(source: str) -> str:
    """Replace IPython-only lines (``%time``, ``!pip ...``) with ``pass``, keeping the indentation."""
    return _MAGIC.sub(lambda m: f"{m.group(1)}pass  # (IPython line removed by the grader)", source)


def read_notebook(path: Path) -> dict:
    """The notebook's JSON, checked to be an nbformat 4 notebook; `SubmissionError` otherwise."""
    if not path.exists():
        raise SubmissionError(f"{path} does not exist")
    if not path.is_file():
        raise SubmissionError(f"{path} is not a file")
    name = path.name
    size = path.stat().st_size
    if size > MAX_NOTEBOOK_BYTES:
        raise SubmissionError(
            f"{name} is {size / 1e6:.0f} MB; notebooks over {MAX_NOTEBOOK_BYTES // 2**20} MB are not graded "
            "(clear the outputs: Edit > Clear Outputs of All Cells, then save)"
        )
    try:
        nb = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise SubmissionError(f"{name} is not a notebook: it is not UTF-8 text") from None
    except (ValueError, RecursionError) as e:
        raise SubmissionError(f"{name} is not a notebook: it is not valid JSON ({str(e)[:120]})") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise SubmissionError(f"{name} is not a Jupyter notebook (no list of cells)")
    if nb.get("nbformat") != 4:
        raise SubmissionError(
            f"{name} is in notebook format {nb.get('nbformat')!r}; save it with JupyterLab (format 4)"
        )
    if not all(isinstance(cell, dict) for cell in nb["cells"]):
        raise SubmissionError(f"{name} is not a Jupyter notebook (a cell is not an object)")
    return nb


def notebook_lab(nb: dict, path: Path) -> int | None:
    """The lab number in the notebook's metadata, else in its file name (``lab01_...``), else None."""
    meta = nb.get("metadata")
    info = meta.get("nanolab") if isinstance(meta, dict) else None
    if isinstance(info, dict) and type(info.get("lab")) is int:
        return info["lab"]
    match = re.match(r"lab(\d+)", path.name)
    return int(match.group(1)) if match else None


def read_submission(path: str | Path, lab: int | None = None) -> Submission:
    """Read ``path`` and extract the code of lab ``lab`` (default: the lab named in the notebook)."""
    path = Path(path)
    nb = read_notebook(path)
    found = notebook_lab(nb, path)
    if lab is not None and found is not None and found != lab:
        raise SubmissionError(
            f"{path.name} is a lab {found} notebook, but lab {lab} is being graded; submit the lab {lab} notebook"
        )
    number = lab if lab is not None else found
    if number is None:
        raise SubmissionError(f"cannot tell which lab {path.name} is; pass --lab N")
    try:
        spec = lab_spec(number)
    except ValueError as e:
        raise SubmissionError(str(e)) from None

    wanted = set(spec.setup_cells) | set(spec.graded_cells)
    cells, seen, warnings = [], set(), []
    for cell in nb["cells"]:
        grade_id = _nbgrader(cell).get("grade_id")
        if cell.get("cell_type") != "code" or grade_id not in wanted:
            continue
        seen.add(grade_id)
        if grade_id in spec.setup_cells:
            own = labkit.setup_text(spec.number)
            if _source(cell).rstrip("\n") != own:
                warnings.append(
                    f"the locked cell {grade_id!r} differs from the lab's own setup code; the grader ran the "
                    f"lab's own instead (copy the cell back from labs/{spec.notebook} to run what is graded)"
                )
            cells.append({"id": grade_id, "source": own, "setup": True})
            continue
        cells.append({"id": grade_id, "source": strip_magics(_source(cell)), "setup": False})
    missing = [g for g in (*spec.setup_cells, *spec.graded_cells) if g not in seen]
    if missing:
        raise SubmissionError(
            f"{path.name} is missing the cells {', '.join(map(repr, missing))} of {spec.title}. The grader finds "
            f"cells by their nbgrader id; copy the missing cells back from labs/{spec.notebook} "
            "(write your code inside the given cells rather than in new ones)"
        )
    return Submission(path=path, spec=spec, cells=cells, warnings=warnings)
