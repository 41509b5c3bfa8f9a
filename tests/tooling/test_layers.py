"""The package's import structure: layers import downward only, no cycles, and nothing imports the root.

Read from the source with `ast` (no module is imported), counting every import, also those inside
functions, since a function-level import that goes upward is still a dependency on a higher layer.
Imports under ``if TYPE_CHECKING:`` are left out: they never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers.import_graph import find_cycle, type_checking_lines

PACKAGE = Path(__file__).resolve().parents[2] / "nanolab"

# Lowest first. A module may import from its own layer and the layers before it.
LAYERS = ["base", "text", "model", "memory", "engine", "serving", "top"]
BASE = {"nanolab._ext", "nanolab._version", "nanolab.errors", "nanolab._C"}
TOP = {"nanolab.cli", "nanolab.benchmark"}


def layer_of(module: str) -> str:
    if module in BASE:
        return "base"
    if module in TOP:
        return "top"
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in LAYERS:
        return parts[1]
    raise AssertionError(f"{module} belongs to no layer; add it to a subpackage or to BASE/TOP in this test")


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, modules: set[str]) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names) of every runtime import of a nanolab module in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = type_checking_lines(tree)
    found = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "nanolab":
                    found.append((node.lineno, alias.name, []))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "nanolab":
                continue
            names = [a.name for a in node.names]
            # `from nanolab.memory import paging` imports the module nanolab.memory.paging
            subs = [f"{node.module}.{n}" for n in names if f"{node.module}.{n}" in modules]
            if subs:
                found += [(node.lineno, s, []) for s in subs]
            else:
                found.append((node.lineno, node.module, names))
    return found


def package_graph() -> dict[str, list[tuple[int, str, list[str]]]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files) | {"nanolab._C"}
    return {name: imports_of(path, modules) for name, path in sorted(files.items())}


GRAPH = package_graph()


def test_the_graph_sees_the_whole_package():
    """Sanity: the walk finds every layer and real edges (a broken walk would pass every other test)."""
    assert {layer_of(m) for m in GRAPH if m != "nanolab"} == set(LAYERS)
    edges = {(m, target) for m, imps in GRAPH.items() for _, target, _ in imps}
    assert ("nanolab.engine.engine", "nanolab.engine.scheduler") in edges
    assert ("nanolab.memory.paged_kv_cache", "nanolab.memory.paged_attention") in edges


@pytest.mark.parametrize("module", [m for m in GRAPH if m != "nanolab"])
def test_no_module_imports_the_package_root_or_a_higher_layer(module):
    """Layers import downward only (serving -> engine -> memory -> model -> text), and never the root.

    The root (`nanolab/__init__.py`) is the public surface for users; code inside the package imports
    the module that defines a name, so the layers stay visible in the imports.
    """
    mine = LAYERS.index(layer_of(module))
    for line, target, names in GRAPH[module]:
        assert target != "nanolab", f"{module}:{line} imports {names} from the package root"
        assert LAYERS.index(layer_of(target)) <= mine, (
            f"{module}:{line} imports {target}, a higher layer ({layer_of(target)} > {layer_of(module)})"
        )


def test_no_import_cycles():
    """No module reaches itself through the imports (a cycle makes import order matter)."""
    edges = {m: sorted({t for _, t, _ in imps if t in GRAPH and t != m}) for m, imps in GRAPH.items()}
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_checks_catch_violations(tmp_path):
    """The checks are not vacuous: an upward import, an import of the root and a cycle are all found."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from nanolab.engine.llm import LLM\n    from nanolab import LLM as L2\n")
    targets = [t for _, t, _ in imports_of(bad, {"nanolab.engine.llm"})]
    assert targets == ["nanolab.engine.llm", "nanolab"]
    assert LAYERS.index(layer_of(targets[0])) > LAYERS.index(layer_of("nanolab.model.bad"))
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": ["c"], "c": []}) is None
