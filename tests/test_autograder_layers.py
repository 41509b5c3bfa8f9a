"""The autograder's import structure: no cycles, a sandbox side that loads only what it must, and a
test-author API apart from the grading machinery.

Read from the source with `ast` (no module is imported), counting every import that runs, also those
inside functions; imports under ``if TYPE_CHECKING:`` are left out, since they never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

from import_graph import find_cycle, type_checking_lines

PACKAGE = Path(__file__).resolve().parents[1] / "autograder"


def runtime_imports(path: Path, package: str, modules: set[str]) -> set[str]:
    """The modules of ``package`` that ``path`` imports when it runs (``from pkg import mod`` counts as mod)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = type_checking_lines(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == package}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != package:
                continue
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules
            found |= subs or {node.module}
    return found


def import_graph(directory: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, for the ``.py`` files directly in ``directory``."""
    package = directory.name
    files = {f"{package}.{p.stem}" if p.stem != "__init__" else package: p for p in directory.glob("*.py")}
    modules = set(files)
    return {m: (runtime_imports(p, package, modules) & modules) - {m} for m, p in sorted(files.items())}


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for t in edges.get(todo.pop(), ()):
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


GRAPH = import_graph(PACKAGE)


def test_the_graph_sees_the_autograder():
    """Sanity: the walk finds the modules and real edges, function-level ones included."""
    assert {"autograder.sandbox", "autograder.remote", "autograder.testing", "autograder._worker"} <= set(
        GRAPH
    )
    assert "autograder.remote" in GRAPH["autograder.sandbox"]
    assert "autograder.codec" in GRAPH["autograder.sandbox"]  # `from autograder import codec`
    assert "autograder.plugin" in GRAPH["autograder.grade"]  # imported inside grade_notebook


def test_no_import_cycles_in_the_autograder():
    """No autograder module reaches itself through its imports."""
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_sandboxed_process_loads_only_the_codec_and_the_confinement():
    """The submission's process (`autograder._worker`) imports nothing of the grader's side, so there
    is less for a submission to patch and nothing of the verdicts to reach."""
    assert reachable(GRAPH, "autograder._worker") == {"autograder.codec", "autograder.confine"}


def test_the_test_author_api_does_not_pull_in_the_grading_machinery():
    """Hidden tests import `autograder.testing`; it stands below the plugin and the batch grader."""
    assert not reachable(GRAPH, "autograder.testing") & {"autograder.plugin", "autograder.grade"}


def test_hidden_tests_use_only_the_test_author_api():
    """A hidden test module imports from the test-author API only: `autograder.testing`, and checks several
    labs share that are built on it alone (`autograder.scheduling`), never the machinery behind them."""
    for path in sorted((PACKAGE / "tests").glob("test_lab*.py")):
        used = runtime_imports(path, "autograder", set())
        assert used <= {"autograder.testing", "autograder.scheduling"}, f"{path.name} imports {sorted(used)}"
    shared = runtime_imports(PACKAGE / "scheduling.py", "autograder", set())
    assert shared <= {"autograder.testing"}, f"scheduling.py imports {sorted(shared)}"


def test_the_checks_catch_a_cycle(tmp_path):
    """The cycle check is not vacuous: a cycle through a function-level import is found, and an import
    under ``if TYPE_CHECKING:`` is not counted."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import c\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import x\n"
    )
    graph = import_graph(pkg)
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    assert graph["pkg.d"] == set()
    (pkg / "c.py").write_text("")
    assert find_cycle(import_graph(pkg)) is None


def test_the_readme_names_every_module():
    """``autograder/README.md`` maps the whole package: a module added or renamed is listed there too."""
    readme = (PACKAGE / "README.md").read_text()
    missing = [p.name for p in sorted(PACKAGE.glob("*.py")) if p.stem not in ("__init__", "__main__")]
    missing = [name for name in missing if f"`{name}`" not in readme]
    assert not missing, f"autograder/README.md does not list {missing}"
