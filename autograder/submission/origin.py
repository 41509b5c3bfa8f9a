"""Whether a graded name is the learner's own code, decided in the grader from the notebook's text.

The grader runs only the cells it extracted from the notebook (`autograder.submission.notebook`). A graded name
counts as the learner's own when those cells bind it at module level only with ``def name`` or
``class name`` statements, at least one of them in a graded cell: never with an import, an
assignment, a ``for``/``with``/``except`` target, a ``global`` declaration, or a ``del``. Under
bubblewrap the sandbox holds no reference code and no solution to run instead (`autograder.sandbox.isolation`),
so what such a ``def`` runs was written in the notebook.

What the sandbox itself reports about where an object comes from can only take credit away
(`autograder.grading.session`): it runs the submission's code and may say anything.

Example:
    >>> check([{"id": "merge", "source": "def merge(ids, pair, new_id): ..."}], {"merge": "merge"})
    {'merge': None}
    >>> print(check([{"id": "merge", "source": "from copied import merge"}], {"merge": "merge"})["merge"])
    the notebook binds it with an import (cell 'merge', line 1), not with `def merge` or `class merge`
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping


def check(cells: list[dict], graded: Mapping[str, str]) -> dict[str, str | None]:
    """For each graded name (name -> the grade_id of its cell): None when it is the learner's own code
    by the rule in the module docstring, else why not (a phrase for the learner)."""
    graded_cells = set(graded.values())
    trees: list[tuple[str, ast.Module]] = []
    for cell in cells:
        try:
            trees.append((cell["id"], ast.parse(cell["source"])))
        except (SyntaxError, ValueError) as e:
            line = getattr(e, "lineno", None)
            where = f" (cell {cell['id']!r}" + (f", line {line})" if line else ")")
            reason = f"a cell the grader runs has a syntax error{where}, so the grader cannot tell"
            return {name: reason for name in graded}
    out: dict[str, str | None] = {}
    for name in graded:
        own, reason = False, None
        for cell_id, tree in trees:
            for kind, line in _bindings(tree, name):
                if kind == "def" and cell_id in graded_cells:
                    own = True
                elif reason is None:
                    where = f"cell {cell_id!r}, line {line}"
                    if kind == "def":
                        kind = "a `def` or `class` in a cell you do not write code in"
                    reason = f"the notebook binds it with {kind} ({where}), not with `def {name}` or `class {name}`"
        if reason is None and not own:
            reason = f"no graded cell defines it with `def {name}` or `class {name}`"
        out[name] = reason
    return out


def _bindings(tree: ast.Module, name: str) -> Iterator[tuple[str, int]]:
    """(how, line) for every module-level binding of ``name``; "def" for a def or class statement."""
    for node in _module_level(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            yield "def", node.lineno
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                if bound == name or alias.name == "*":
                    yield "an import", node.lineno
        elif isinstance(node, ast.Global) and name in node.names:
            yield "a `global` declaration", node.lineno
        else:
            for target in _targets(node):
                if isinstance(target, ast.Name) and target.id == name:
                    yield _TARGET_KINDS.get(type(node), "an assignment"), node.lineno


_TARGET_KINDS = {
    ast.For: "a `for` loop",
    ast.AsyncFor: "a `for` loop",
    ast.With: "a `with` statement",
    ast.AsyncWith: "a `with` statement",
    ast.Delete: "a `del`",
    ast.ExceptHandler: "an `except ... as`",
}


def _module_level(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """Statements that run at module level (inside if/for/while/with/try/match blocks too), and every
    ``global`` declaration and walrus anywhere (they bind module-level names from inside functions)."""
    for node in body:
        yield node
        for child in ast.walk(node):
            if isinstance(child, (ast.Global, ast.NamedExpr)) and child is not node:
                yield child
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(node, field, None)
            if isinstance(inner, list):
                yield from _module_level(inner)
        for case in getattr(node, "cases", []):
            yield from _module_level(case.body)


def _targets(node: ast.AST) -> Iterator[ast.AST]:
    """The names a statement binds (unpacking, starred and match captures included)."""
    if isinstance(node, ast.Assign):
        roots = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor, ast.NamedExpr)):
        roots = [node.target]
    elif isinstance(node, (ast.With, ast.AsyncWith)):
        roots = [item.optional_vars for item in node.items if item.optional_vars is not None]
    elif isinstance(node, ast.Delete):
        roots = node.targets
    elif isinstance(node, ast.ExceptHandler):
        yield from ([ast.Name(id=node.name)] if node.name else [])
        return
    elif isinstance(node, ast.Match):
        roots = [p for case in node.cases for p in ast.walk(case.pattern)]
        for pattern in roots:
            capture = getattr(pattern, "name", None) or getattr(pattern, "rest", None)
            if capture:
                yield ast.Name(id=capture)
        return
    else:
        return
    for root in roots:
        for sub in ast.walk(root):
            if isinstance(sub, ast.Name):
                yield sub
