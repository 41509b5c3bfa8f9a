"""Reading notebooks in tests: nbgrader metadata, cells by grade_id, the interface a cell declares."""

from __future__ import annotations

import ast
import inspect


def nbgrader_meta(cell: dict) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def cell_source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def cells_by_id(nb: dict) -> dict[str, dict]:
    return {nbgrader_meta(c)["grade_id"]: c for c in nb["cells"] if "grade_id" in nbgrader_meta(c)}


def interface(source: str) -> set[tuple[str, str, str | None]]:
    """(qualified name, signature, docstring) of every function and class in ``source`` and of the methods of
    its classes. A function's own body is not interface: helpers defined inside it are the learner's to write."""
    found = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.ClassDef)):
                name = prefix + child.name
                signature = ast.unparse(child.args) if isinstance(child, ast.FunctionDef) else ""
                found.add((name, signature, ast.get_docstring(child)))
                if isinstance(child, ast.ClassDef):
                    visit(child, name + ".")

    visit(ast.parse(source), "")
    return found


def parameters(fn) -> list[tuple[str, object]]:
    """Names and defaults of a callable's parameters (annotations aside: the notebook's name its own types)."""
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]
