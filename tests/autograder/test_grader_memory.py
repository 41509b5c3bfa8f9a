"""The grading worker's memory cap bounds what grading maps, not the size of the torch build, and running
out of it says so (with the fix) rather than "the grader failed"."""

from __future__ import annotations

import errno
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from autograder.grading.grade import GradeOptions, _internal_failure
from autograder.submission.labs import LABS, LabSpec

ROOT = Path(__file__).resolve().parents[2]


PROBE = """
import importlib.util, sys
from pathlib import Path
from autograder.grading.grade import DEFAULT_TESTS_DIR, _preload_for
from autograder.submission.labs import LABS

notebook = Path(sys.argv[1])
_preload_for(str(notebook), None)
before = "torch" in sys.modules
spec = next(s for s in LABS.values() if s.notebook == notebook.name)
for path in sorted(DEFAULT_TESTS_DIR.glob(spec.test_prefix + "*.py")):
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(path.stem, path))
    module.__spec__.loader.exec_module(module)
print(before, "torch" in sys.modules)
"""


def test_every_lab_imports_what_its_hidden_tests_need_of_torch_before_the_cap() -> None:
    """For each lab, in a fresh interpreter: the worker's preloads, then the lab's hidden test modules. torch is
    loaded after them only if it was loaded before them (under the cap, a CUDA build's import would not fit);
    the tokenizer lab loads none."""

    def probe(spec: LabSpec) -> tuple[int, str]:
        done = subprocess.run(
            [sys.executable, "-c", PROBE, str(ROOT / "labs" / spec.notebook)],
            capture_output=True, text=True, check=True, cwd=ROOT,
        )  # fmt: skip
        return spec.number, done.stdout.strip()

    with ThreadPoolExecutor(2) as pool:
        answers = dict(pool.map(probe, LABS.values()))
    late = {lab: answer for lab, answer in answers.items() if answer == "False True"}
    assert not late, f"these labs' hidden tests import torch after the grading worker's memory cap: {late}"
    # every lab but the tokenizer's runs models in the grader (some import torch only when they do)
    assert answers == {lab: "False False" if lab == 1 else "True True" for lab in LABS}


def test_running_out_of_memory_is_named_with_the_cap_and_the_cpu_build() -> None:
    for error in (OSError(errno.ENOMEM, "Cannot allocate memory"), MemoryError()):
        result = _internal_failure("sub.ipynb", GradeOptions(), error)
        (message,) = result.messages
        assert "ran out of memory" in message and "3072 MB" in message and "whl/cpu" in message
    other = _internal_failure("sub.ipynb", GradeOptions(), OSError(errno.EACCES, "Permission denied"))
    assert "ran out of memory" not in other.messages[0]
