"""The grading worker's memory cap bounds what grading maps, not the size of the torch build, and running
out of it says so (with the fix) rather than "the grader failed"."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

from autograder.grading.grade import GradeOptions, _internal_failure

ROOT = Path(__file__).resolve().parents[2]


def test_a_torch_lab_has_torch_imported_before_the_cap_and_a_pure_python_lab_does_not() -> None:
    probe = (
        "import sys; from autograder.grading.grade import _preload_for; "
        "_preload_for(sys.argv[1], None); print('torch' in sys.modules)"
    )
    answers = {}
    for notebook in ("lab03_paged_kv.ipynb", "lab01_tokenizer.ipynb"):
        done = subprocess.run(
            [sys.executable, "-c", probe, str(ROOT / "labs" / notebook)],
            capture_output=True,
            text=True,
            check=True,
        )
        answers[notebook] = done.stdout.strip()
    assert answers == {"lab03_paged_kv.ipynb": "True", "lab01_tokenizer.ipynb": "False"}


def test_running_out_of_memory_is_named_with_the_cap_and_the_cpu_build() -> None:
    for error in (OSError(errno.ENOMEM, "Cannot allocate memory"), MemoryError()):
        result = _internal_failure("sub.ipynb", GradeOptions(), error)
        (message,) = result.messages
        assert "ran out of memory" in message and "3072 MB" in message and "whl/cpu" in message
    other = _internal_failure("sub.ipynb", GradeOptions(), OSError(errno.EACCES, "Permission denied"))
    assert "ran out of memory" not in other.messages[0]
