"""What `nanolab grade` imports is installed by a plain `pip install nanolab`: every third-party module the
grader and its hidden tests import (outside a ``try`` that handles its absence) belongs to a distribution in
``[project.dependencies]``, not only in the ``dev`` extra."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
OURS = {"autograder", "nanolab", "labkit"}


def guarded(tree: ast.AST) -> set[int]:
    """Line numbers of imports inside a ``try`` whose handlers catch ImportError or ModuleNotFoundError."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            h.type is not None and re.search(r"ImportError|ModuleNotFoundError", ast.unparse(h.type))
            for h in node.handlers
        ):
            for inner in node.body:
                lines |= {n.lineno for n in ast.walk(inner) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return lines


def imported_modules() -> dict[str, str]:
    """Top-level names of the third-party modules the grader imports -> a file that imports it."""
    found = {}
    for path in sorted((ROOT / "autograder").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = guarded(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and node.lineno not in skip:
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.lineno not in skip:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top and top not in OURS and top not in sys.stdlib_module_names:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def normalized(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_graders_imports_are_runtime_dependencies() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    runtime = {normalized(r) for r in project["dependencies"]}
    distributions = packages_distributions()
    modules = imported_modules()
    assert {"pytest", "hypothesis", "openai", "httpx"} <= set(modules), sorted(modules)
    missing = {}
    for module, where in modules.items():
        names = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
        if not names & runtime:
            missing[module] = where
    # packaging comes with pip and with pytest itself (a dependency of pytest)
    missing.pop("packaging", None)
    assert not missing, f"imported by the grader but not in [project.dependencies]: {missing}"
