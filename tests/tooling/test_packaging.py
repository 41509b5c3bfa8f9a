"""Packaging: the build, the C++/Python switch, and the two dependency lists kept in step."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~\[;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pyproject_requirements() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + project["optional-dependencies"]["dev"]
    # environment.yml pins Python 3.11: a requirement whose marker leaves 3.11 out is not for it
    python = re.search(r"- python=(\S+)", (ROOT / "environment.yml").read_text()).group(1)
    return {
        _name(r): r
        for r in reqs
        if Requirement(r).marker is None or Requirement(r).marker.evaluate({"python_version": python})
    }


def _environment_pip_requirements() -> dict[str, str]:
    """The entries of the `pip:` list in environment.yml (a flat YAML list; parsed without PyYAML)."""
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "- pip:")
    reqs = {}
    for line in lines[start + 1 :]:
        item = line.split("#", 1)[0].strip()
        if not item:
            continue
        if not item.startswith("- "):
            break
        item = item[2:].strip()
        if item.startswith("-e"):
            continue
        reqs[_name(item)] = item
    return reqs


def test_environment_yml_names_the_same_dependencies_as_pyproject():
    assert set(_environment_pip_requirements()) == set(_pyproject_requirements())


def test_torch_pin_is_the_same_in_the_makefile_and_environment_yml():
    makefile_pin = re.search(r"^TORCH := (\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert _environment_pip_requirements()["torch"] == makefile_pin


def test_the_cpp_extension_is_built_and_used():
    import nanolab._C  # noqa: F401 - the import is the check

    assert nanolab.HAS_C or nanolab._ext.why_pure == "NANOLAB_PURE_PYTHON is set"


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-W", "always", "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        check=True,
    )


def test_pure_python_env_var_forces_the_twin_without_a_warning():
    out = _run(
        "import nanolab; print(nanolab.BlockAllocator.__module__, nanolab.backend())", NANOLAB_PURE_PYTHON="1"
    )
    assert out.stdout.split() == ["nanolab.memory.block_allocator", "python"]
    assert "RuntimeWarning" not in out.stderr


def test_default_is_the_cpp_class():
    out = _run(
        "import nanolab; print(nanolab.BlockAllocator.__module__, nanolab.backend())", NANOLAB_PURE_PYTHON=""
    )
    assert out.stdout.split() == ["nanolab._C", "cpp"]


def test_missing_extension_falls_back_with_a_one_line_warning():
    code = "import sys; sys.modules['nanolab._C'] = None\nimport nanolab; print(nanolab.backend())"
    out = _run(code, NANOLAB_PURE_PYTHON="")
    assert out.stdout.strip() == "python"
    warnings = [line for line in out.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(warnings) == 1 and "pure-Python twins" in warnings[0]
