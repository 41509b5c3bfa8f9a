"""The hidden tests of a grading run: the built-in folder, and an instructor's extra folder if given.

Each folder is read once, before any submission runs, into a `TestFolder`; every notebook is graded
against that in-memory copy, written afresh into a private temporary folder. Where the kernel lacks
Landlock a submission could overwrite the files on disk; `TestFolder.restore` puts them back.

An instructor's tests are graded in addition to the built-in ones, never instead: their ids (the CSV
columns) get the folder's name as a prefix (``extra/test_merge``), so an extra test named like a
built-in one is still a test of its own.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from autograder.submission.labs import LabSpec

BUILT_IN = "builtin"
EXTRA = "extra"


@dataclass(frozen=True)
class TestFolder:
    """One folder of hidden tests as read before grading."""

    __test__ = False  # not a pytest test class

    path: Path  # where the tests live on disk
    files: dict[str, bytes]  # every ``.py`` file directly in it (test modules and helpers), by name
    name: str = BUILT_IN  # its folder while grading; an instructor's tests: EXTRA

    @classmethod
    def read(cls, path: Path, name: str = BUILT_IN) -> TestFolder:
        """Read the ``.py`` files in ``path``; FileNotFoundError naming the folder if it is not one."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"the hidden tests folder {path} does not exist")
        return cls(path, {p.name: p.read_bytes() for p in sorted(path.glob("*.py"))}, name)

    @property
    def id_prefix(self) -> str:
        """What goes before each of its tests' ids: nothing for the built-in tests."""
        return "" if self.name == BUILT_IN else f"{self.name}/"

    def modules_for(self, spec: LabSpec) -> list[str]:
        """The test modules of lab ``spec``: ``test_labNN*.py``."""
        return sorted(n for n in self.files if n.startswith(spec.test_prefix) and n.endswith(".py"))

    def write_into(self, directory: Path) -> Path:
        """Write the in-memory copy into ``directory/<name>``; returns that folder."""
        folder = Path(directory) / self.name
        folder.mkdir()
        for name, source in self.files.items():
            (folder / name).write_bytes(source)
        return folder

    def changed_on_disk(self) -> bool:
        """Whether the files on disk differ from the copy read before grading."""
        try:
            now = TestFolder.read(self.path, self.name).files
        except OSError:
            return True
        return _digest(now) != _digest(self.files)

    def restore(self) -> None:
        """Put the files on disk back as they were read (and remove any ``.py`` added since)."""
        self.path.mkdir(parents=True, exist_ok=True)
        for name, data in self.files.items():
            (self.path / name).write_bytes(data)
        for extra in self.path.glob("*.py"):
            if extra.name not in self.files:
                extra.unlink(missing_ok=True)


def _digest(files: dict[str, bytes]) -> dict[str, str]:
    return {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
