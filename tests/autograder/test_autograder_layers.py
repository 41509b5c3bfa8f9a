"""The autograder's import structure: no cycles, a sandbox side that loads only what it must, and a
test-author API apart from the grading machinery.

Read from the source with `ast` (no module is imported), counting every import that runs, also those
inside functions; imports under ``if TYPE_CHECKING:`` are left out, since they never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers.import_graph import find_cycle, type_checking_lines

PACKAGE = Path(__file__).resolve().parents[2] / "autograder"


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


def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package at ``package_dir`` (its subpackages
    included), leaving out the hidden tests, which are data the grader reads rather than its code."""
    files = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if "tests" in parts:
            continue
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    files = module_files(package_dir)
    modules = set(files)
    package = package_dir.name
    return {m: (runtime_imports(p, package, modules) & modules) - {m} for m, p in files.items()}


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for t in edges.get(todo.pop(), ()):
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


def inside(module: str, *folders: str) -> bool:
    """Whether ``module`` is one of ``folders`` (dotted) or below one."""
    return any(module == f or module.startswith(f + ".") for f in folders)


GRAPH = import_graph(PACKAGE)
RUNTIME = "autograder.sandbox.runtime"

# What each folder may import of the package besides itself: the trust boundary, read from the source.
# The sandbox's host side stands on its runtime only; what a hidden test may use (authoring) reaches a
# session's calls but not the grading that decides verdicts; the submission's data knows the limits.
ALLOWED = {
    RUNTIME: (),
    "autograder.sandbox": (RUNTIME,),
    "autograder.submission": ("autograder.sandbox.limits",),
    "autograder.authoring": (
        "autograder.sandbox.remote",
        "autograder.grading.session",
        "autograder.sandbox.limits",
    ),
    "autograder.grading": ("autograder.sandbox", "autograder.submission", "autograder.authoring.testing"),
}


def test_the_graph_sees_the_autograder():
    """Sanity: the walk finds the modules in every folder and real edges, function-level ones included."""
    assert {
        "autograder.sandbox.process",
        "autograder.sandbox.remote",
        "autograder.authoring.testing",
        "autograder.testing",
        f"{RUNTIME}.worker",
        "autograder.submission.labs",
        "autograder.grading.grade",
    } <= set(GRAPH)
    assert "autograder.sandbox.remote" in GRAPH["autograder.sandbox.process"]
    assert (
        f"{RUNTIME}.codec" in GRAPH["autograder.sandbox.process"]
    )  # `from autograder.sandbox.runtime import codec`
    assert "autograder.grading.plugin" in GRAPH["autograder.grading.grade"]  # imported inside grade_notebook


def test_no_import_cycles_in_the_autograder():
    """No autograder module reaches itself through its imports."""
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_runtime_imports_nothing_outside_the_runtime():
    """The sandboxed process runs `autograder.sandbox.runtime` alone (bubblewrap binds that folder and no
    other file of the grader), so nothing in it may import anything outside it, and the packages above
    it import nothing either (outside the sandbox, `python -m` runs them first)."""
    runtime = [m for m in GRAPH if inside(m, RUNTIME)]
    assert {f"{RUNTIME}.worker", f"{RUNTIME}.codec", f"{RUNTIME}.confine"} <= set(runtime)
    for module in runtime:
        outside = {t for t in GRAPH[module] if not inside(t, RUNTIME)}
        assert not outside, f"{module} imports {sorted(outside)}, which the sandbox does not have"
    for parent in ("autograder", "autograder.sandbox"):
        assert not GRAPH[parent], f"{parent}/__init__.py imports {sorted(GRAPH[parent])}"


def test_each_folder_imports_only_what_its_side_of_the_boundary_may():
    """Every module imports, besides its own folder, only what `ALLOWED` gives its folder: the host side
    of the sandbox stands on the runtime, the test-author API never reaches the grading that decides
    verdicts, and the submission's data only knows the limits."""
    for module, targets in sorted(GRAPH.items()):
        folder = next((f for f in sorted(ALLOWED, key=len, reverse=True) if inside(module, f)), None)
        if folder is None:
            continue
        wrong = {t for t in targets if not inside(t, folder, *ALLOWED[folder])}
        assert not wrong, f"{module} imports {sorted(wrong)} (allowed: {folder} and {ALLOWED[folder]})"


def test_the_test_author_api_does_not_pull_in_the_grading_machinery():
    """Hidden tests import `autograder.testing`; it stands below the plugin and the batch grader."""
    for api in ("autograder.testing", "autograder.authoring.testing"):
        assert not reachable(GRAPH, api) & {"autograder.grading.plugin", "autograder.grading.grade"}


def test_hidden_tests_use_only_the_test_author_api():
    """A hidden test module imports from the test-author API only: `autograder.testing`, and the checks
    several labs share under `autograder.authoring`, never the machinery behind them."""
    for path in sorted((PACKAGE / "tests").glob("test_lab*.py")):
        used = runtime_imports(path, "autograder", set(GRAPH))
        wrong = {m for m in used if not inside(m, "autograder.testing", "autograder.authoring")}
        assert not wrong, f"{path.name} imports {sorted(wrong)}"


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
    """``autograder/README.md`` maps the whole package: a module added or renamed is listed there too,
    by its path inside the package."""
    readme = (PACKAGE / "README.md").read_text()
    paths = [p.relative_to(PACKAGE).as_posix() for p in module_files(PACKAGE).values()]
    missing = [p for p in paths if not p.endswith(("__init__.py", "__main__.py")) and f"`{p}`" not in readme]
    assert not missing, f"autograder/README.md does not list {missing}"
