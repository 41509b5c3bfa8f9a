"""Each lab's setup code, written once: ``labkit/labNN.py`` is the text of Lab NN's locked ``setup`` cell.

``make labs`` (``scripts/make_labs.py``) writes each module's text into the ``setup`` cell of
``solutions/labNN_*.ipynb`` and of the generated ``labs/`` notebook, and ``make check-notebooks`` fails
when a notebook's setup cell differs from its module. So the notebook stays self-contained (the learner
reads the types in the cell, and graded code may not import nanolab), while the code is one ruff-linted
module that tests can import. Edit the module, never the cell.

A setup module mirrors the reference types its lab's graded code needs (nanolab's own are the oracle;
``tests/labs/`` holds each lab to them) and may import only what graded code may: the standard library
and the lab's packages.
"""

from pathlib import Path


def module_path(lab: int) -> Path:
    """The file of Lab ``lab``'s setup module, ``labkit/labNN.py``."""
    return Path(__file__).resolve().parent / f"lab{lab:02d}.py"


def setup_text(lab: int) -> str:
    """Lab ``lab``'s setup code as its notebook's ``setup`` cell holds it (``make labs`` writes it there, and the
    grader runs it in place of the cell): the module's text without its final newline."""
    return module_path(lab).read_text(encoding="utf-8").rstrip("\n")
